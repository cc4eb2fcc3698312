"""Lightning's, accelerate's, transformers' and torchtitan's own checkpoint tests, run against async_ckpt's integrations.

Not collected by pytest and not part of CI: the frameworks' test files are not vendored. Run it
by hand with a clone of the framework at (or near) the installed version::

    python -m tests.frameworks.upstream_suites lightning SRC [--rev REV] [-- PYTEST_ARGS...]
    python -m tests.frameworks.upstream_suites accelerate SRC [--rev REV] [-- PYTEST_ARGS...]
    python -m tests.frameworks.upstream_suites transformers SRC [-- PYTEST_ARGS...]
    python -m tests.frameworks.upstream_suites torchtitan SRC [--rev REV] [-- PYTEST_ARGS...]

Their test dependencies must be importable (Lightning: ``cloudpickle``, ``jsonargparse``,
``tensorboardX``; accelerate: ``parameterized``), for example installed with
``pip install --target DIR`` and ``DIR`` added to ``PYTHONPATH``.

``SRC`` is a checkout or a bare repository (with ``--rev``, the files are read with
``git archive REV``; without, from the working tree). The test files are copied to a temporary
directory and only the way the framework's checkpoint I/O is set up is changed there; every
assertion is theirs:

* Lightning (``tests/tests_pytorch``: ``plugins/test_checkpoint_io_plugin.py``,
  ``checkpointing/test_model_checkpoint.py``, ``test_checkpoint_callback_frequency.py``,
  ``test_trainer_checkpoint.py``): every ``Trainer`` made without a ``CheckpointIO`` plugin
  gets ``plugins=[AsyncCkptIO()]`` (their ``conftest.py`` wraps ``Trainer.__init__``);
  ``test_checkpoint_io_plugin.py``'s ``CustomCheckpointIO`` (a synchronous ``torch.save``
  plugin) becomes ``AsyncCkptIO``, and the base plugin its ``AsyncCheckpointIO`` wraps too.
* accelerate (``tests/test_state_checkpointing.py``): every ``Accelerator`` is ``attach``-ed
  as it is made.
* transformers (``tests/trainer/test_trainer_checkpointing.py`` and its
  ``trainer_test_utils.py``, at the installed version; the repository is too large to clone, so
  ``SRC`` may be a directory holding just those two files under ``tests/trainer/``): every
  ``Trainer`` made without an ``AsyncCkptCallback`` gets one (a ``conftest.py`` wraps
  ``Trainer.__init__``). Set ``USE_TORCH_XLA=0`` (the runner does).

Each run ends with a line saying how many of the framework's objects got the integration
(accelerate: how many Accelerators were attached; transformers: how many Trainers got the callback, were bound to
it, and those that saved asynchronously through it).
* torchtitan (``tests/unit_tests/test_checkpoint.py``, 0.3.0: ``release/0.3``; needs torch >=
  2.11): the test file imports ``CheckpointManager`` and ``AsyncMode`` from
  ``async_ckpt.integrations.torchtitan`` instead of torchtitan's DCP backend.

``--wait`` adds, before each assertion that reads a file the test has just saved (in the
background, here), a wait for the pending writes, as the integrations' docs ask of code that
reads the files by other means than the framework's own load.

Prints pytest's outcome of every test (``-v``) and exits with pytest's status; ``--baseline``
runs the same files unchanged (the framework's own checkpoint I/O), to tell what fails here
anyway (a missing optional package, the machine) from what the integration changes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LIGHTNING_FILES = [
    "tests/tests_pytorch/__init__.py",
    "tests/tests_pytorch/conftest.py",
    "tests/tests_pytorch/helpers",
    "tests/tests_pytorch/plugins/__init__.py",
    "tests/tests_pytorch/plugins/test_checkpoint_io_plugin.py",
    "tests/tests_pytorch/checkpointing/__init__.py",
    "tests/tests_pytorch/checkpointing/test_model_checkpoint.py",
    "tests/tests_pytorch/checkpointing/test_checkpoint_callback_frequency.py",
    "tests/tests_pytorch/checkpointing/test_trainer_checkpoint.py",
]

LIGHTNING_CONFTEST = '''

# ---- async_ckpt: every Trainer without a CheckpointIO plugin gets AsyncCkptIO -------------------
import lightning.pytorch as _pl
from lightning.fabric.plugins import CheckpointIO as _CheckpointIO
from lightning.pytorch.strategies import Strategy as _Strategy

from async_ckpt.integrations.lightning import AsyncCkptIO as _AsyncCkptIO

_trainer_init = _pl.Trainer.__init__


def _init_with_async_ckpt(self, *args, **kwargs):
    plugins = kwargs.get("plugins")
    plugins = [] if plugins is None else list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
    strategy = kwargs.get("strategy")
    if not any(isinstance(p, _CheckpointIO) for p in plugins) and not (
            isinstance(strategy, _Strategy) and strategy._checkpoint_io is not None):
        kwargs["plugins"] = plugins + [_AsyncCkptIO()]
    _trainer_init(self, *args, **kwargs)


_pl.Trainer.__init__ = _init_with_async_ckpt
'''

#: file -> [(their text, ours)]: each must occur exactly once
LIGHTNING_PATCHES: Dict[str, List[tuple]] = {
    "tests/tests_pytorch/plugins/test_checkpoint_io_plugin.py": [
        ("from lightning.pytorch.strategies import SingleDeviceStrategy\n",
         "from lightning.pytorch.strategies import SingleDeviceStrategy\n"
         "from async_ckpt.integrations.lightning import AsyncCkptIO\n"),
        ("class CustomCheckpointIO(CheckpointIO):", "class _TheirCustomCheckpointIO(CheckpointIO):"),
        ("\n\ndef test_checkpoint_plugin_called(", "\n\nCustomCheckpointIO = AsyncCkptIO\n\n\n"
                                                    "def test_checkpoint_plugin_called("),
        ("    checkpoint_plugin = AsyncCheckpointIO()\n", "    checkpoint_plugin = AsyncCheckpointIO(AsyncCkptIO())\n"),
    ],
}

#: ``--wait``: a wait for the pending writes before each assertion that reads a file the test
#: has just saved asynchronously (what the integrations' docs ask of code reading the files by
#: other means than the framework's own load)
LIGHTNING_WAITS: Dict[str, List[tuple]] = {
    "tests/tests_pytorch/checkpointing/test_model_checkpoint.py": [
        ("                assert os.listdir(tmp_path) == [\"model.ckpt\"]",
         "                self.trainer.strategy.checkpoint_io.wait()\n"
         "                assert os.listdir(tmp_path) == [\"model.ckpt\"]"),
        ("    mc._save_last_checkpoint(trainer, {\"foo\": torch.tensor(1)})\n",
         "    mc._save_last_checkpoint(trainer, {\"foo\": torch.tensor(1)})\n"
         "    trainer.strategy.checkpoint_io.wait()\n"),
        ("    mc._save_none_monitor_checkpoint(trainer, {})\n",
         "    mc._save_none_monitor_checkpoint(trainer, {})\n    trainer.strategy.checkpoint_io.wait()\n"),
    ],
}

ACCELERATE_FILES = ["tests/test_state_checkpointing.py"]

ACCELERATE_WAITS: Dict[str, List[tuple]] = {
    "tests/test_state_checkpointing.py": [
        ("            assert len(os.listdir(accelerator.project_dir)) == 1",
         "            accelerator._async_ckpt_saver.wait()\n"
         "            assert len(os.listdir(accelerator.project_dir)) == 1"),
        ("            assert not os.path.exists(os.path.join(tmpdir, \"checkpoints\", \"checkpoint_0\"))",
         "            accelerator._async_ckpt_saver.wait()\n"
         "            assert not os.path.exists(os.path.join(tmpdir, \"checkpoints\", \"checkpoint_0\"))"),
    ],
}

TORCHTITAN_FILES = ["tests/__init__.py", "tests/unit_tests/__init__.py", "tests/unit_tests/test_checkpoint.py"]

TORCHTITAN_PATCHES: Dict[str, List[tuple]] = {
    "tests/unit_tests/test_checkpoint.py": [
        ("from torchtitan.components.checkpointer.dcp import AsyncMode, CheckpointManager\n",
         "from async_ckpt.integrations.torchtitan import AsyncMode, CheckpointManager\n"),
    ],
}

ACCELERATE_CONFTEST = '''
# ---- async_ckpt: every Accelerator is attached as it is made -----------------------------------
import accelerate as _accelerate

from async_ckpt.integrations.accelerate import attach as _attach

_accelerator_init = _accelerate.Accelerator.__init__


_savers = []


def _init_attached(self, *args, **kwargs):
    _accelerator_init(self, *args, **kwargs)
    _savers.append(_attach(self))


_accelerate.Accelerator.__init__ = _init_attached


def pytest_terminal_summary(terminalreporter):
    saved = sum(1 for s in _savers if s.stats)
    terminalreporter.write_line(f"async_ckpt: {len(_savers)} Accelerators attached, "
                                f"{saved} saved asynchronously through attach")
'''


TRANSFORMERS_FILES = ["tests/trainer/test_trainer_checkpointing.py", "tests/trainer/trainer_test_utils.py"]

TRANSFORMERS_CONFTEST = '''
# ---- async_ckpt: every Trainer made without the callback gets AsyncCkptCallback -----------------
import inspect as _inspect

import transformers as _transformers

from async_ckpt.integrations.transformers import AsyncCkptCallback as _AsyncCkptCallback

_trainer_init = _transformers.Trainer.__init__
_signature = _inspect.signature(_trainer_init)
_callbacks = []


def _init_with_async_ckpt(self, *args, **kwargs):
    bound = _signature.bind(self, *args, **kwargs)
    callbacks = list(bound.arguments.get("callbacks") or [])
    if not any(isinstance(c, _AsyncCkptCallback) for c in callbacks):
        cb = _AsyncCkptCallback()
        _callbacks.append(cb)
        bound.arguments["callbacks"] = callbacks + [cb]
    _trainer_init(*bound.args, **bound.kwargs)


_transformers.Trainer.__init__ = _init_with_async_ckpt


def pytest_terminal_summary(terminalreporter):
    bound = sum(1 for cb in _callbacks if cb.trainer is not None)
    saved = sum(1 for cb in _callbacks if cb.stats)
    terminalreporter.write_line(f"async_ckpt: {len(_callbacks)} Trainers got AsyncCkptCallback, {bound} bound to "
                                f"it, {saved} saved asynchronously through it")
'''


def extract(src: str, rev: Optional[str], paths: List[str], dest: str) -> None:
    """Copy ``paths`` of the framework's repository ``src`` (at ``rev``: ``git archive``) into ``dest``."""
    if rev is not None:
        archive = subprocess.run(["git", "-C", src, "archive", "--format=tar", rev, "--", *paths],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
        return
    for p in paths:
        s, d = os.path.join(src, p), os.path.join(dest, p)
        os.makedirs(os.path.dirname(d), exist_ok=True)
        (shutil.copytree if os.path.isdir(s) else shutil.copy)(s, d)


def patch(dest: str, patches: Dict[str, List[tuple]], conftest: Optional[str], addition: str = "") -> None:
    """Apply the text patches (each must match once) and append ``addition`` to ``conftest``
    (None: no conftest)."""
    for rel, edits in patches.items():
        path = os.path.join(dest, rel)
        text = open(path).read()
        for theirs, ours in edits:
            if text.count(theirs) != 1:
                raise SystemExit(f"{rel}: expected {theirs!r} once (another version of the file?)")
            text = text.replace(theirs, ours)
        with open(path, "w") as f:
            f.write(text)
    if conftest is not None:
        with open(os.path.join(dest, conftest), "a") as f:
            f.write(addition)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("framework", choices=["lightning", "accelerate", "transformers", "torchtitan"])
    parser.add_argument("src", help="a checkout or bare repository of the framework")
    parser.add_argument("--rev", help="the revision to read (git archive); default: the working tree")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    parser.add_argument("--wait", action="store_true",
                        help="also wait for pending writes before the assertions that read a file just saved")
    parser.add_argument("--baseline", action="store_true",
                        help="run the files unchanged (the framework's own checkpoint I/O), for comparison")
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []  # passed to pytest
    args = parser.parse_args(argv[:len(argv) - len(extra) - (1 if "--" in argv else 0)])
    dest = tempfile.mkdtemp(prefix=f"upstream-{args.framework}-")
    try:
        if args.framework == "lightning":
            files = LIGHTNING_FILES
            extract(args.src, args.rev, files, dest)
            if not args.baseline:
                patches = {**LIGHTNING_PATCHES, **(LIGHTNING_WAITS if args.wait else {})}
                patch(dest, patches, "tests/tests_pytorch/conftest.py", LIGHTNING_CONFTEST)
            root = os.path.join(dest, "tests")
        elif args.framework == "torchtitan":
            files = TORCHTITAN_FILES
            extract(args.src, args.rev, files, dest)
            if not args.baseline:
                patch(dest, TORCHTITAN_PATCHES, None)
            root = dest
        elif args.framework == "accelerate":
            files = ACCELERATE_FILES
            extract(args.src, args.rev, files, dest)
            if not args.baseline:
                patch(dest, ACCELERATE_WAITS if args.wait else {}, "tests/conftest.py", ACCELERATE_CONFTEST)
            root = dest
        else:
            files = TRANSFORMERS_FILES
            extract(args.src, args.rev, files, dest)
            for pkg in ("tests/__init__.py", "tests/trainer/__init__.py"):  # for their relative import
                open(os.path.join(dest, pkg), "a").close()
            if not args.baseline:
                patch(dest, {}, "tests/trainer/conftest.py", TRANSFORMERS_CONFTEST)
            root = dest
        tests = [os.path.join(dest, f) for f in files if os.path.basename(f).startswith("test_")]
        # PJRT_DYNAMIC_PLUGINS: importing torch_xla (where it is installed) sets it, which
        # Lightning's conftest reports as a variable leaked by the test that first imports it.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, REPO, os.environ.get("PYTHONPATH", "")]),
                   PJRT_DEVICE="CPU", USE_TORCH_XLA="0", PJRT_DYNAMIC_PLUGINS="1")
        cmd = [sys.executable, "-m", "pytest", "-v", "-rfEs", "-p", "no:cacheprovider", "--rootdir", root,
               *tests, *extra]
        return subprocess.run(cmd, cwd=root, env=env).returncode
    finally:
        if args.keep:
            print(f"kept {dest}")
        else:
            shutil.rmtree(dest, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
