"""Two tiers against the real fake-gcs-server on loopback: the bucket goes away in the middle of
an upload while local saves go on; nothing committed is lost; uploads work again once it is back."""

from __future__ import annotations

import os

import pytest

from async_ckpt import CheckpointManager
from async_ckpt.errors import CheckpointError
from async_ckpt.storage import RetryPolicy

from ..conftest import assert_bitwise_equal, target_like
from ..storage.test_cloud import MiB, _PausingFS, big_state
from ..support.storage_servers import FakeGCSServer


@pytest.mark.slow  # gcsfs retries a refused connection for ~30 s before it gives up
def test_bucket_down_mid_upload_local_saves_go_on_and_uploads_resume(own_gcs_server: FakeGCSServer, tmp_path) -> None:
    server = own_gcs_server
    bucket = server.new_bucket()
    local = str(tmp_path / "local")
    opts = dict(storage_options=bucket.storage_options, save_interval=3, local_dir=local, local_policy=1,
                local_retention=10)
    mgr = CheckpointManager(bucket.url, retry=RetryPolicy(attempts=1), **opts)
    mgr.storage.max_file_bytes = 4 * MiB  # several objects per step
    mgr.save(3, big_state(3))
    gate = _PausingFS(mgr.storage.fs)
    mgr.storage.fs = gate
    assert mgr.save_async(6, big_state(6))  # due for both tiers
    assert gate.first_done.wait(60)  # one object of step 6 is up, the others wait
    server.stop()
    gate.server_down.set()
    for s in (7, 8):  # local saves go on while the upload of 6 fails
        assert mgr.save_async(s, big_state(s))
    mgr.roots[0].writer.join()
    local_steps = sorted(int(n) for n in os.listdir(local) if n.isdigit())
    assert local_steps == [3, 6, 7, 8]
    assert gate.upload_failed.wait(120)
    server.start()  # the same port and objects
    mgr.roots[-1].writer.wait_idle()
    with pytest.raises(CheckpointError) as ei:
        mgr.join()  # the failed upload is surfaced here, not in the saves above
    assert ei.value.step == 6
    assert mgr.step_tiers()[8] == ("local",)
    mgr.save(9, big_state(9))  # the bucket is back: the next upload commits
    assert mgr.step_tiers()[9] == ("local", "persistent")
    for s in (3, 6, 7, 8):  # every committed local step is still there and restores bitwise
        out = target_like(big_state(s))
        assert mgr.restore(s, out) == s
        assert_bitwise_equal(out, big_state(s))
    mgr.close()
    with CheckpointManager(bucket.url, storage_options=bucket.storage_options) as plain:
        assert 9 in plain.all_steps() and 6 not in plain.all_steps()
        out = target_like(big_state(9))
        assert plain.restore(None, out) == 9
    assert_bitwise_equal(out, big_state(9))
