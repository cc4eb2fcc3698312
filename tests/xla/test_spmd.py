"""The torch_xla drop-in under SPMD (issue 34): PJRT CPU with 4 virtual devices, ``xr.use_spmd()``.

Each scenario of tests/workers/spmd_scenarios.py runs in its own process (``tests/workers/spmd_worker.py
<scenario> <root>``): an abort in torch_xla's C++ ends that process only, so one crash cannot
hide the others. torch_xla 2.9's own ``CheckpointManagerTest`` and ``OptimizerCheckpointTest``
(``manager_*``, ``sgd``, ``adamw``), the abort of issue 34 (``unsynced_save``), every state a
torch_xla user can hand to a save (``states``), optimizer state between async_ckpt,
``dcp.load`` with ``SPMDLoadPlanner`` and torch_xla's manager (``optim_interop``), two
processes saving together under torchrun (``two_processes``), and the transfer left to the
copier thread while the state changes (``deferred``, issue 46).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from typing import Dict, Optional

import pytest

from ..support.launch import torchrun
from ..support.paths import REPO, WORKERS

pytestmark = [pytest.mark.xla,
              pytest.mark.skipif(importlib.util.find_spec("torch_xla") is None, reason="torch_xla is not installed")]

TIMEOUT = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run_scenario(name: str, root: str, devices: int = 4, extra_env: Optional[Dict[str, str]] = None,
                 ) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.update(extra_env or {})
    env.update({"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices), "OMP_NUM_THREADS": "1",
                "XLA_COORDINATOR_PORT": str(_free_port()),
                "PYTHONPATH": os.pathsep.join([REPO, env.get("PYTHONPATH", "")])})
    return subprocess.run([sys.executable, os.path.join(WORKERS, "spmd_worker.py"), name, root], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT)


def _check(name: str, proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0 and f"{name} OK" in proc.stdout, \
        f"{name}: exit status {proc.returncode}\n{proc.stdout[-6000:]}"


@pytest.mark.parametrize("name", ["manager_checkpointing", "manager_step_tracking", "manager_max_to_keep",
                                  "manager_async", "manager_async_step_tracking"])
def test_torch_xla_checkpoint_manager_test(name, tmp_path):
    """torch_xla's ``CheckpointManagerTest``, one test per process."""
    _check(name, run_scenario(name, str(tmp_path / "ckpt")))


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_torch_xla_optimizer_checkpoint_test(name, tmp_path):
    """torch_xla's ``OptimizerCheckpointTest`` (skipped off TPU there, for its manager's
    preemption IP discovery, which async_ckpt does not need)."""
    _check(name, run_scenario(name, str(tmp_path / "ckpt")))


def test_save_of_a_model_never_synced_does_not_abort(tmp_path):
    """The abort of issue 34: ``_to_dlpack`` on a tensor holding host data only."""
    _check("unsynced_save", run_scenario("unsynced_save", str(tmp_path / "ckpt")))


def test_every_spmd_state_is_staged_and_saved_bitwise(tmp_path):
    _check("states", run_scenario("states", str(tmp_path / "ckpt")))


def test_optimizer_state_between_async_ckpt_dcp_and_torch_xla(tmp_path):
    _check("optim_interop", run_scenario("optim_interop", str(tmp_path / "ckpt")))


@pytest.mark.parametrize("aliasing", ["1", "0"])
def test_deferred_spmd_transfer_holds_the_values_at_the_call(aliasing, tmp_path):
    """Issue 46: under SPMD ``save_async`` transfers on the copier thread from references taken
    at the call; changing the state right after the call (optimizer step + sync, ``add_`` +
    ``mark_step``, buffers marked for donation), with and without
    ``XLA_ENABLE_PARAM_ALIASING``, leaves the step written with the values at the call."""
    proc = run_scenario("deferred", str(tmp_path / "ckpt"), extra_env={"XLA_ENABLE_PARAM_ALIASING": aliasing})
    _check("deferred", proc)


@pytest.mark.slow
def test_two_processes_of_two_devices_save_and_restore_together(tmp_path):
    """torchrun, 2 processes x 2 virtual devices over gloo. torch_xla 2.9's PJRT CPU client
    cannot make one mesh of several processes' devices (each process sees only its own), so each
    process shards a whole replica over its 2 devices; the step is saved and restored by both."""
    proc = torchrun(2, "spmd_worker.py", "two_processes", str(tmp_path / "ckpt"), env={"CPU_NUM_DEVICES": "2"},
                    timeout=TIMEOUT)
    assert proc.returncode == 0 and proc.stdout.count("two_processes OK") == 2, proc.stdout[-6000:]
