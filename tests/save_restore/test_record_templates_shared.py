"""Record templates met by many writers at once: one (dtype, shape) has one template, the
writer process renders each record from the template its item names, and a record rendered
from another template never commits.

Many saves of changing shapes, through both tiers and by two managers at once, each restore
every committed step bitwise (a record written with a stale head and tail used to commit and
verify, then fail ``restore(step)``).
"""

from __future__ import annotations

import os
import threading
import types

import pytest
import torch

from async_ckpt import CheckpointError, CheckpointManager, WriterProcessError
from async_ckpt.format.torch_record import RecordTemplates

from ..support.tree import assert_bitwise_equal

needs_process = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the writer process needs Linux")


def test_threads_meeting_a_new_shape_at_once_all_get_its_one_template():
    templates = RecordTemplates()
    shapes = [(n, 3) for n in range(5, 45)]
    threads = 8
    got = [[None] * len(shapes) for _ in range(threads)]
    barrier = threading.Barrier(threads)

    def meet(k: int) -> None:
        for i, shape in enumerate(shapes):
            t = torch.zeros(shape)
            barrier.wait()
            got[k][i] = templates.template(t)

    workers = [threading.Thread(target=meet, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for i, shape in enumerate(shapes):
        first = got[0][i]
        assert first is not None and first.reads_as(torch.float32, shape)
        assert all(got[k][i] is first for k in range(threads)), shape
        assert templates.template(torch.ones(shape)) is first
    assert len({got[0][i].serial for i in range(len(shapes))}) == len(shapes)


def _state(step: int, n: int = 8) -> dict:
    """``n`` tensors whose shapes (and two of them dtypes) change every step; sizes from a few
    bytes to ~200 KiB, so both small records (gathered) and large ones (data_at) are made."""
    g = torch.Generator().manual_seed(step)
    out = {}
    for i in range(n):
        rows = 1 + (step * 7 + i * 13) % 97
        cols = 1 + (step * 3 + i * 5) % (64 if i % 2 else 600)
        dtype = (torch.float32, torch.bfloat16, torch.float64, torch.int32)[(step + i) % 4]
        t = torch.randn(rows, cols, generator=g)
        out[f"t{i}"] = t.to(dtype) if dtype != torch.int32 else (t * 1000).to(torch.int32)
    return {"model": out, "step": step}


def _restore_all(root: str, saved: dict, **kwargs) -> int:
    with CheckpointManager(root, **kwargs) as mgr:
        steps = mgr.all_steps()
        for step in steps:
            target = {"model": {k: torch.zeros_like(v) for k, v in saved[step]["model"].items()}, "step": -1}
            assert mgr.restore(step, target) == step
            assert_bitwise_equal(target, saved[step])
    return len(steps)


def _save_changing_shapes(root: str, local: str, first: int, saves: int, saved: dict) -> None:
    with CheckpointManager(root, writer="process", local_dir=local, local_policy=1, local_retention=saves,
                           save_interval=2, max_to_keep=saves) as mgr:
        for step in range(first, first + saves):
            sd = _state(step)
            saved[step] = sd
            mgr.save_async(step, sd)
        mgr.join()


@needs_process
def test_many_changing_shapes_through_both_tiers_and_two_managers_restore_every_step(tmp_path):
    saves = 60
    saved: dict = {}
    roots = [(str(tmp_path / f"bucket{k}"), str(tmp_path / f"local{k}")) for k in range(2)]
    errors = []

    def run(k: int) -> None:
        try:
            _save_changing_shapes(*roots[k], first=k * 1000, saves=saves, saved=saved)
        except BaseException as exc:  # noqa: BLE001 - raised below
            errors.append(exc)

    workers = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors, errors
    for root, local in roots:
        assert _restore_all(local, saved) == saves  # the local tier's steps, as a root of its own
        assert _restore_all(root, saved) == saves // 2  # the persistent root's (every 2nd step)


@needs_process
def test_a_record_rendered_from_another_template_is_refused_before_the_step_commits(tmp_path):
    """The writer process is told a wrong head and tail for a template it renders: the save
    fails before committing, the committed steps stay, and the next save (a new writer
    process) commits and restores bitwise."""
    root = str(tmp_path / "c")
    sd = {"w": torch.randn(64, 33), "b": torch.randn(1000, 100)}
    with CheckpointManager(root, writer="process") as mgr:
        mgr.save(1, {"b": sd["b"]})
        proc = mgr.writer_process
        started = proc.started
        from async_ckpt.format.torch_record import RECORDS

        tpl = RECORDS.template(sd["w"])  # not sent to the process yet
        other = RECORDS.template(torch.zeros(33, 64))
        assert tpl is not None and other is not None and len(other.head) == len(tpl.head)
        # the process is told another template's head and tail under this template's serial
        wrong = types.SimpleNamespace(head=other.head, tail=other.tail)
        job = {"root": root, "retry": None, "path": "unused", "files": [], "threads": 1, "records": False}
        proc.submit(job, [], {tpl.serial: wrong}).result(timeout=60)
        with pytest.raises(CheckpointError) as ei:
            mgr.save(2, sd)
        assert isinstance(ei.value.__cause__, WriterProcessError), ei.value
        assert "other than their templates" in str(ei.value.__cause__)
        assert mgr.all_steps() == [1]
        mgr.save(3, sd)
        assert proc.started == started + 1
        assert mgr.all_steps() == [1, 3]
        target = {"b": torch.zeros_like(sd["b"])}
        mgr.restore(1, target)
        assert_bitwise_equal(target, {"b": sd["b"]})
        target = {k: torch.zeros_like(v) for k, v in sd.items()}
        mgr.restore(3, target)
        assert_bitwise_equal(target, sd)
