"""A training loop interrupted by Ctrl-C while a save is being written (test_messages.py).

argv: ROOT. Step 1 is committed; the save of step 2 goes through a filesystem whose data files
take 3 s each to open, so the parent's SIGINTs arrive while it is being written."""

from __future__ import annotations

import sys
import time

import fsspec
import torch
from fsspec.implementations.dirfs import DirFileSystem

from async_ckpt import CheckpointManager


class SlowFS(DirFileSystem):
    """The local directory ``path``, through fsspec's generic backend, with slow data files."""

    protocol = "slowdir"
    slow = False

    def open(self, path, mode="rb", *args, **kwargs):  # type: ignore[override]
        if SlowFS.slow and "w" in mode and str(path).endswith(".distcp"):
            time.sleep(3)
        return super().open(path, mode, *args, **kwargs)


fsspec.register_implementation("slowdir", SlowFS, clobber=True)

root = sys.argv[1]  # an existing directory; the checkpoints go to <root>/ckpt
state = {"w": torch.arange(1000, dtype=torch.float32)}
with CheckpointManager("slowdir://ckpt", write_threads=1, storage_options={"path": root, "target_protocol": "file"}) \
        as mgr:
    mgr.save(1, state)
    SlowFS.slow = True
    state["w"] += 1
    mgr.save_async(2, state)
    print("SAVING", flush=True)
    # The training loop: the first Ctrl-C lands here. Short sleeps, as a loop's steps: a signal
    # the kernel hands to another thread (the writer) does not cut a long sleep short, so one
    # time.sleep(60) held the KeyboardInterrupt back until the save had ended (flaky under load).
    for _ in range(600):
        time.sleep(0.1)
