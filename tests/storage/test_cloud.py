"""CheckpointManager on gs:// and s3:// against real servers on loopback (see storage_servers.py).

Each backend-generic test runs twice (``bucket`` is parametrised over fake-gcs-server and
moto's S3 server). Nothing in gcsfs or s3fs is mocked: failures come from stopping a server.
"""

from __future__ import annotations

import threading
from typing import Any, Dict

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

from async_ckpt import CheckpointManager
from async_ckpt.errors import CheckpointError, StorageError
from async_ckpt.storage import RetryPolicy
from async_ckpt.storage.retry import is_transient

from ..conftest import assert_bitwise_equal, make_state, target_like
from ..support.storage_servers import Bucket, MotoS3Server

MiB = 2**20


def big_state(seed: int, mib: int = 8) -> Dict[str, Any]:
    """Model + Adam state plus ``mib`` MiB of extra tensors (several data objects per step)."""
    model, opt = make_state(seed)
    g = torch.Generator().manual_seed(seed)
    extra = {f"w{i}": torch.randn(MiB // 4, generator=g) for i in range(mib)}
    extra["bf16"] = torch.randn(1000, generator=g).to(torch.bfloat16)
    extra["ints"] = torch.arange(1000, dtype=torch.int64) * seed
    return {"model": model.state_dict(), "optim": opt.state_dict(), "extra": extra,
            "meta": {"epoch": seed, "name": f"run-{seed}"}}


def objects(bucket: Bucket) -> list:
    return sorted(p[len(bucket.name) + 1:] for p in bucket.fs().find(bucket.name))


def manager(bucket: Bucket, **kw: Any) -> CheckpointManager:
    mgr = CheckpointManager(bucket.url, storage_options=bucket.storage_options, **kw)
    mgr.storage.max_file_bytes = 4 * MiB  # several objects per step even for small test states
    return mgr


# ---- round trips ---------------------------------------------------------------------------

def test_round_trip_bitwise(bucket: Bucket) -> None:
    states = {s: big_state(s) for s in (1, 2)}
    with manager(bucket) as mgr:
        for s, sd in states.items():
            assert mgr.save_async(s, sd, metrics={"loss": 1.0 / s})
        mgr.join()
        assert mgr.all_steps() == [1, 2] and mgr.latest_step() == 2
        for s in (None, 1):  # newest, then a named older step
            out = target_like(states[1])
            got = mgr.restore(s, out)
            assert_bitwise_equal(out, states[got])
        assert mgr.metrics(1) == {"loss": 1.0}
    names = objects(bucket)
    data = [n for n in names if n.startswith("run/2/") and n.endswith(".distcp")]
    assert len(data) >= 3, names  # uploaded as several objects, concurrently
    assert {"run/2/.metadata", "run/2/manifest.json", "run/2/COMMITTED"} <= set(names)
    assert not [n for n in names if "probe" in n], names  # the writability probe cleans up

    # The step is a plain DCP checkpoint: torch's own fsspec reader loads it from the bucket.
    ref = big_state(2)
    out = {"extra": target_like(ref["extra"])}
    dcp.load(out, storage_reader=FsspecReader(f"{bucket.url}/2", **bucket.storage_options), no_dist=True)
    assert_bitwise_equal(out["extra"], ref["extra"])


def test_s3_client_kwargs_pass_through(s3_server: MotoS3Server) -> None:
    b = s3_server.new_bucket()
    opts = {"key": b.storage_options["key"], "secret": b.storage_options["secret"],
            "client_kwargs": {"endpoint_url": s3_server.url}}
    sd = big_state(3, mib=1)
    with CheckpointManager(b.url, storage_options=opts) as mgr:
        mgr.save(5, sd)
        out = target_like(sd)
        assert mgr.restore(None, out) == 5
    assert_bitwise_equal(out, sd)


# ---- retention, listing, the commit marker, cleanup ------------------------------------------

def test_retention_deletes_objects(bucket: Bucket) -> None:
    sd = big_state(4, mib=1)
    with manager(bucket, max_to_keep=2) as mgr:
        for s in range(5):
            mgr.save_async(s, sd)
    steps = sorted({n.split("/")[1] for n in objects(bucket)})
    assert steps == ["3", "4"]
    with manager(bucket, max_to_keep=2) as mgr:
        assert mgr.all_steps() == [3, 4]
        out = target_like(sd)
        assert mgr.restore(None, out) == 4
    assert_bitwise_equal(out, sd)


def test_marker_decides_and_cleanup_removes_incomplete(bucket: Bucket) -> None:
    sd = big_state(5, mib=1)
    with manager(bucket) as mgr:
        mgr.save(1, sd)
    fs = bucket.fs()
    # A step whose upload never finished: data and manifest, no COMMITTED marker.
    for name in ("__0_0.distcp", "manifest.json", ".metadata"):
        fs.pipe_file(f"{bucket.name}/run/7/{name}", b"partial")
    with manager(bucket, keep_incomplete=True) as mgr:
        assert mgr.all_steps() == [1]  # only the marker makes a step exist
        assert mgr.latest_step() == 1
    assert any(n.startswith("run/7/") for n in objects(bucket))
    with manager(bucket) as mgr:  # a manager that has not saved holds no lease: it removes nothing
        pass
    assert any(n.startswith("run/7/") for n in objects(bucket))
    with manager(bucket) as mgr:  # default: the first save cleans incomplete steps up in the background
        mgr.save(2, sd)
    names = objects(bucket)
    assert not any(n.startswith("run/7/") for n in names), names
    assert "run/1/COMMITTED" in names and "run/2/COMMITTED" in names
    assert not any(".async_ckpt.lease" in n for n in names), names  # released at close
    with manager(bucket) as mgr:
        out = target_like(sd)
        assert mgr.restore(None, out) == 2
    assert_bitwise_equal(out, sd)


# ---- a server that goes away in the middle of an upload --------------------------------------

class _PausingFS:
    """Delegates to the real gcsfs/s3fs filesystem; the first data-file upload of a save goes
    through, the others wait until the test has stopped the server, then proceed (and fail,
    once the client library has given up retrying: ``upload_failed``)."""

    def __init__(self, fs: Any) -> None:
        self._fs = fs
        self._n = 0
        self._lock = threading.Lock()
        self.first_done = threading.Event()
        self.server_down = threading.Event()
        self.upload_failed = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)

    def pipe_file(self, path: str, data: Any, **kw: Any) -> Any:
        if path.endswith(".distcp"):
            with self._lock:
                n, self._n = self._n, self._n + 1
            if n == 0:
                out = self._fs.pipe_file(path, data, **kw)
                self.first_done.set()
                return out
            assert self.server_down.wait(60)
            try:
                return self._fs.pipe_file(path, data, **kw)
            except BaseException:
                self.upload_failed.set()
                raise
        return self._fs.pipe_file(path, data, **kw)


@pytest.mark.slow  # gcsfs retries a refused connection for ~30 s before it gives up
@pytest.mark.parametrize("kind", ["gcs", "s3"])
def test_server_stopped_mid_upload(kind: str, request: pytest.FixtureRequest) -> None:
    server = request.getfixturevalue(f"own_{kind}_server")
    bucket = server.new_bucket()
    old, new = big_state(10), big_state(11)
    mgr = manager(bucket, retry=RetryPolicy(attempts=1))  # the client libraries retry already
    mgr.save(1, old)

    gate = _PausingFS(mgr.storage.fs)
    mgr.storage.fs = gate
    assert mgr.save_async(2, new)
    assert gate.first_done.wait(60)  # one object of step 2 is up, the others are in flight
    server.stop()
    gate.server_down.set()
    assert gate.upload_failed.wait(120)  # the client library gave up on the server
    # Back on the same port (objects written before the stop are still there) before the
    # writer's clean-up of the failed step, which would otherwise wait out gcsfs's retries too.
    server.start()
    with pytest.raises(CheckpointError) as ei:
        mgr.join()
    assert ei.value.step == 2
    assert mgr.all_steps() == [1]  # nothing of step 2 was committed
    assert "run/2/COMMITTED" not in objects(bucket)
    out = target_like(old)
    assert mgr.restore(None, out) == 1
    assert_bitwise_equal(out, old)

    # The same manager saves again once the server is back, and the step is complete.
    mgr.save(3, new)
    assert mgr.all_steps() == [1, 3]
    mgr.close()
    # A new manager cleans up the half-uploaded step 2.
    with manager(bucket) as mgr2:
        out = target_like(new)
        assert mgr2.restore(None, out) == 3
    assert_bitwise_equal(out, new)
    assert not any(n.startswith("run/2/") for n in objects(bucket))


# ---- clear errors --------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["gcs", "s3"])
def test_missing_bucket_is_a_clear_error(kind: str, request: pytest.FixtureRequest) -> None:
    server = request.getfixturevalue(f"{kind}_server")
    proto = "gs" if kind == "gcs" else "s3"
    with pytest.raises(StorageError, match="bucket does not exist"):
        CheckpointManager(f"{proto}://no-such-bucket-4f2a/run", storage_options=server.storage_options())
    fs = fsspec.filesystem(proto, **server.storage_options())
    assert not fs.exists("no-such-bucket-4f2a")  # and it was not created behind the user's back


def test_s3_wrong_credentials_is_a_clear_error(s3_server: MotoS3Server) -> None:
    bucket = s3_server.new_bucket()
    s3_server.require_auth(0)  # moto now checks keys like S3 does
    try:
        opts = s3_server.storage_options(key="AKIAWRONGWRONGWRONG0", secret="nope")
        with pytest.raises(StorageError, match="Access Key Id") as ei:
            CheckpointManager(bucket.url, storage_options=opts)
        assert "storage_options" in str(ei.value)
        assert not is_transient(ei.value.__cause__)
    finally:
        s3_server.no_auth()


def test_transient_classification_of_real_client_errors(s3_server: MotoS3Server) -> None:
    """A refused connection (server down) is transient; a missing object is permanent."""
    down = MotoS3Server()  # a free port nobody listens on
    fs = fsspec.filesystem("s3", **down.storage_options())
    with pytest.raises(Exception) as ei:
        fs.pipe_file("some-bucket/x", b"x")
    assert is_transient(ei.value), repr(ei.value)
    up = s3_server.new_bucket().fs()
    with pytest.raises(FileNotFoundError) as ei2:
        up.cat_file("no-such-bucket-4f2a/x")
    assert not is_transient(ei2.value)
