"""A checkpoint root whose storage does not answer, or is mistyped: the constructor fails fast,
in one line naming the URL, the cause, what to check and the setting that raises the bound;
every storage client's errors reach the caller as async_ckpt's typed errors.

Failures come from real sockets on 127.0.0.1 (a closed port, a port that accepts but never
answers) and from a host name that cannot resolve (``.invalid``, refused without a network)."""

from __future__ import annotations

import os
import pathlib
import socket
import time
from typing import Iterator

import pytest

from async_ckpt import CheckpointManager
from async_ckpt.errors import CheckpointError, InvalidArgumentError, StorageError, StorageUnreachableError
from async_ckpt.storage import RetryPolicy
from async_ckpt.storage.storage import Storage

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """An endpoint that accepts connections and never answers (a black hole behind a proxy)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def _options(proto: str, endpoint: str) -> dict:
    if proto == "gs":
        return {"endpoint_url": endpoint, "token": "anon", "project": "test"}
    return {"endpoint_url": endpoint, "key": "k", "secret": "s"}


@pytest.mark.parametrize("proto", ["gs", "s3"])
def test_an_endpoint_that_does_not_resolve_fails_the_constructor_fast(proto: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(StorageUnreachableError) as ei:
        CheckpointManager(f"{proto}://bucket/run", storage_options=_options(proto, "http://nonexistent.invalid"))
    assert time.monotonic() - t0 < 20  # gcsfs alone retried this for minutes
    msg = str(ei.value)
    assert f"checkpoint path {proto}://bucket/run cannot be reached" in msg
    assert "host nonexistent.invalid does not resolve" in msg
    assert "check the endpoint, bucket and credentials (storage_options) and the network" in msg
    assert "RetryPolicy(connect_timeout=SECONDS)" in msg
    assert "\n" not in msg


@pytest.mark.parametrize("proto", ["gs", "s3"])
def test_a_closed_endpoint_port_fails_the_constructor_fast(proto: str) -> None:
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    t0 = time.monotonic()
    with pytest.raises(CheckpointError) as ei:  # a typed error: botocore's did not derive from it
        CheckpointManager(f"{proto}://bucket/run", storage_options=_options(proto, endpoint))
    assert time.monotonic() - t0 < 20
    assert isinstance(ei.value, StorageUnreachableError)
    assert f"the endpoint {endpoint} refuses connections" in str(ei.value)


def test_an_endpoint_that_never_answers_fails_within_connect_timeout(silent_endpoint: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(StorageUnreachableError) as ei:
        CheckpointManager("s3://bucket/run", storage_options=_options("s3", silent_endpoint),
                          retry=RetryPolicy(connect_timeout=2))
    assert time.monotonic() - t0 < 15
    assert f"no answer within 2 s from {silent_endpoint}" in str(ei.value)
    assert "RetryPolicy(connect_timeout=SECONDS) (now 2 s)" in str(ei.value)


def test_a_client_error_of_a_later_call_is_a_storage_error() -> None:
    """botocore's EndpointConnectionError (not an OSError) of any storage call is a StorageError."""
    opts = _options("s3", f"http://127.0.0.1:{_closed_port()}")
    opts["config_kwargs"] = {"retries": {"max_attempts": 1, "mode": "standard"}}
    st = Storage("s3://bucket/run", opts, retry=RetryPolicy(attempts=1))
    with pytest.raises(StorageError) as ei:
        st.read_bytes(st.join("manifest.json"))
    assert "EndpointConnectionError" in str(ei.value)
    assert type(ei.value.__cause__).__module__.startswith("botocore")


def test_connect_timeout_is_validated() -> None:
    with pytest.raises(InvalidArgumentError, match="RetryPolicy.connect_timeout must be a number of seconds > 0"):
        RetryPolicy(connect_timeout=0)


@pytest.mark.parametrize("typo, likely", [("gs:/bucket/run", "gs://bucket/run"), ("gcs:/x", "gcs://x"),
                                          ("s3:/bucket/run", "s3://bucket/run")])
def test_a_url_with_one_slash_is_refused_naming_the_url(typo: str, likely: str, tmp_path: pathlib.Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for path in (typo, pathlib.Path(likely)):  # pathlib folds '//' into '/'
        with pytest.raises(InvalidArgumentError) as ei:
            CheckpointManager(path)
        assert f"did you mean {likely!r}?" in str(ei.value)
        assert "looks like a URL with one slash" in str(ei.value)
    assert os.listdir(tmp_path) == []  # nothing saved to ./gs:/...


def test_a_colon_in_a_local_directory_name_is_not_a_url(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "run:/a"  # not a protocol: saved as a local path, as before
    with CheckpointManager(str(path)) as mgr:
        mgr.save(1, {"x": 1})
    assert os.path.isdir(path / "1") or any(os.scandir(path))
