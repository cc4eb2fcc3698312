"""Worker for tests/ranks/test_distributed.py: rank 1 dies in the middle of a save; rank 0 must raise
within the manager's collective timeout instead of hanging.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python dist_death_worker.py <root>

Rank 0 prints ``RAISED <seconds> <message>`` once its join() raised.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from async_ckpt import CheckpointError, CheckpointManager  # noqa: E402
from tests.support import faulty_fs  # noqa: E402,F401  (registers faulty://)


def main() -> None:
    import faulthandler

    faulthandler.dump_traceback_later(120, exit=True)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mgr = CheckpointManager("faulty://" + sys.argv[1], collective_timeout_s=15)
    sd = {"x": torch.full((1024,), float(rank)), f"r{rank}": torch.ones(8)}
    assert mgr.save(1, sd)  # a save that works on both ranks
    if rank == 1:
        mgr.storage.fs.inject("write", "*.distcp", "die")  # exits with faulty_fs.DIE_STATUS mid-write
    t0 = time.monotonic()
    try:
        mgr.save_async(2, sd)
        mgr.join()
    except CheckpointError as exc:
        print(f"RAISED {time.monotonic() - t0:.1f} {exc}", flush=True)
        assert mgr.all_steps() == [1], mgr.all_steps()  # nothing committed for step 2
        os._exit(0)
    print("NO ERROR", flush=True)
    os._exit(3)


if __name__ == "__main__":
    main()
