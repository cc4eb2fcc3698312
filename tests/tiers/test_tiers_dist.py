"""Two tiers with 2 ranks (torchrun, gloo, FSDP2): each rank's local copies, and the ranks'
agreement on the step they restore (the scenarios are in tests/workers/tier_worker.py)."""

from __future__ import annotations

import os
import subprocess

import pytest

from ..support.launch import torchrun

pytestmark = pytest.mark.slow



def _run(tmp_path, only: str = "") -> subprocess.CompletedProcess:
    proc = torchrun(2, "tier_worker.py", str(tmp_path / "bucket"), str(tmp_path / "local"), str(tmp_path),
                    env={"TIER_WORKER_ONLY": only}, timeout=300)
    key = [ln for ln in proc.stdout.splitlines() if "Error" in ln or "RANK" in ln]
    assert proc.returncode == 0, "\n".join(key[-30:]) + "\n----\n" + proc.stdout[-3000:]
    for r in range(2):
        assert f"RANK {r} OK" in proc.stdout
    return proc


#: scenarios of ranks that fail apart (tests/workers/tier_worker.py): every rank fails the step together
ONE_RANK_FAILS = ["fails_after_agreement", "invalid_on_one_rank", "out_of_step",
                  "resave_on_one_rank", "settle_on_one_rank", "saves_resume_after_one_failure",
                  "restore_named_steps_differ", "preemption_on_one_rank",
                  "save_raises_on_every_rank"]


def test_one_rank_failing_fails_the_step_on_every_rank_never_a_mixed_step(tmp_path):
    _run(tmp_path, ",".join(ONE_RANK_FAILS))


def test_two_ranks_restore_the_newest_step_every_rank_holds_else_the_bucket(tmp_path):
    _run(tmp_path)
    # each rank wrote only its own directory; rank 1's was emptied by the test
    assert sorted(os.listdir(tmp_path / "local")) == ["rank0", "rank1"]
    assert sorted(n for n in os.listdir(tmp_path / "local" / "rank0") if n.isdigit()) == ["2", "3", "4"]
    assert not [n for n in os.listdir(tmp_path / "local" / "rank1") if n.isdigit()]
