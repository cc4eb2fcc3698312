"""Copies of a local step on the persistent root: ``promote`` (an explicit request, or a skipped
upload caught up by the next free upload slot: :class:`UploadCatchUp`)."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..errors import (
    CheckpointError,
    StepNotFoundError,
)
from ..format.manifest import CopyIdentity, Manifest
from ..io.copies import copy_files
from ..policies import keeping
from ..stats import SaveStats
from .roots import PERSISTENT, Root

log = logging.getLogger("async_ckpt")


def promote(local: Root, persistent: Root, step: int, *, verify: bool = True,
            threads: int = 8) -> Tuple[Manifest, List[int]]:
    """Copy the local tier's committed ``step`` to the persistent tier and commit it there,
    with the local copy's commit time (the persistent tier's order stays the order of the
    saves); returns its manifest and the steps the persistent tier's retention then dropped
    (that pass keeps the promoted step, which an explicit request put there; later passes
    treat it as any other step). Every file is checked
    against the local manifest (size, and CRC-32C with ``verify``) before anything is
    committed; a copy another job saved (for another persistent root) or one rank of a
    multi-rank job saved (its shards only) is refused, and so is
    a step the persistent tier already holds (it may be a newer save). The caller holds the
    persistent tier's writer lease."""
    if step not in local.store.layout.committed_steps():
        raise StepNotFoundError(f"no committed local checkpoint for step {step} under {local.url}", step=step)
    opened = local.store.layout.read_committed(step)
    path, manifest = opened.where, opened.manifest
    identity = manifest.identity
    r, w = identity.rank or 0, identity.world_size or 1
    root = identity.saved_for_another(local.home)
    if root is not None:
        raise CheckpointError(f"the local copy of step {step} in {local.url} was saved for the checkpoint path "
                              f"{root}, not {local.home}: another job's step is not promoted", step=step)
    if w != 1:  # <local_dir>/rank<r> of a multi-rank job: that rank's shards only
        raise CheckpointError(f"the local copy of step {step} in {local.url} was saved by rank {r} of {w}: it holds "
                              f"that rank's shards only, not a whole checkpoint (save the step with force=True "
                              f"from the job instead)", step=step)
    if step in persistent.store.layout.committed_steps():  # never replace a (maybe newer) save
        raise CheckpointError(f"step {step} is already committed under {persistent.url}; delete it there first "
                              f"to replace it with the local copy", step=step)
    dst = persistent.store
    write = dst.begin_write(step)
    try:
        assert write.target is not None
        target = write.target.path
        dst.storage.makedirs(target)

        # through the one verified read, in blocks: never a whole file in memory
        copy_files(local.store.storage, path, manifest.files, dst.storage, target, verify=verify,
                   threads=max(1, min(threads, 4)))
        # keeps its commit time (the order of the saves) and its files' checksums; every file is
        # written here (a copy: nothing is shared with an earlier step of this root), so a file an
        # incremental local save took loses its ref and count, and keeps only that it may hold
        # records the step does not use
        files = {name: rec if not rec.may_hold_unused else
                 dataclasses.replace(rec, ref=None, carried=None, unused_records=True)
                 for name, rec in manifest.files.items()}
        new = dataclasses.replace(manifest, files=files, identity=CopyIdentity(save_id=identity.save_id))
        policy = persistent.retention
        dropped = write.commit(new, keeping(policy, step))
        return new, dropped
    finally:
        write.abort()  # nothing once committed


# ---- uploads a busy bucket made save_async skip -----------------------------------------------

#: ``SaveStats.extra`` keys, with a local tier: how far the bucket (``path``) was behind when the
#: save committed: this manager's saves taken since the newest of them committed to ``path``,
#: and the seconds between the two saves (None while ``path`` holds none of them)
UPLOAD_LAG, UPLOAD_LAG_S = "upload_lag", "upload_lag_s"
#: ``SaveStats.extra`` key of a skipped upload that a free upload slot made up for
CAUGHT_UP = "caught_up"


def save_number(sid: Optional[str]) -> Optional[int]:
    """The manager's count of the save that wrote a copy (from its save id), or None."""
    try:
        return int(str(sid).rsplit(".", 1)[1])
    except (IndexError, ValueError):
        return None


@dataclass
class _Skipped:
    step: int
    save: int  # the manager's count of the save
    taken_at: float  # its wall-clock time (the commit time of its copies)
    t0: float  # perf_counter() at the save_async call
    local: "Future[Any]"  # its local save's job


class UploadCatchUp:
    """Skipped uploads, made up for by the next free upload slot (one process, a local tier).

    A ``save_async`` due for the bucket while its uploads are busy saves the step to the local
    tier only (:meth:`skipped`). When the upload running then ends, the bucket's writer thread,
    still in that slot, promotes the newest local copy of the skipped saves (:meth:`run`), and
    again while saves were skipped meanwhile: the bucket is never more than one upload behind.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wanted: Optional[_Skipped] = None
        self._uploaded: Optional[Tuple[int, float]] = None  # (save, taken at) of the newest save in the bucket
        self._warned = False  # a skip was warned about since the last upload

    def skipped(self, step: int, save: int, taken_at: float, t0: float, local: "Future[Any]") -> bool:
        """Training thread: the save ``save`` of ``step`` (its local job ``local``) skipped the
        bucket. Returns whether it is the first skip since the bucket's last upload (warned
        about; the rest are logged at INFO)."""
        with self._lock:
            self._wanted = _Skipped(step, save, taken_at, t0, local)
            first, self._warned = not self._warned, True
        return first

    def uploaded(self, save: Optional[int], taken_at: Optional[float]) -> None:
        """The bucket's writer committed the save ``save``, taken at ``taken_at``."""
        if save is None or taken_at is None:
            return
        with self._lock:
            if self._uploaded is None or save > self._uploaded[0]:
                self._uploaded = (save, taken_at)
            self._warned = False

    def lag(self, save: Optional[int], taken_at: Optional[float]) -> Dict[str, Any]:
        """The :data:`UPLOAD_LAG` and :data:`UPLOAD_LAG_S` entries of a save's statistics."""
        with self._lock:
            up = self._uploaded
        if save is None:
            return {}
        if up is None:
            return {UPLOAD_LAG: save, UPLOAD_LAG_S: None}
        return {UPLOAD_LAG: max(0, save - up[0]),
                UPLOAD_LAG_S: None if taken_at is None else max(0.0, taken_at - up[1])}

    def run(self, local: Root, persistent: Root, *, verify: bool, threads: int,
            committed: Callable[[SaveStats], None], failed: Callable[[int, BaseException], None]) -> None:
        """The bucket's writer thread, at the end of an upload: promote the newest skipped
        save's local copy, and again while saves were skipped meanwhile (the caller holds the
        bucket's lease and its upload slot). ``committed`` gets each promotion's statistics,
        ``failed`` each failure (a failed upload of that step)."""
        while True:
            with self._lock:
                want, self._wanted = self._wanted, None
                up = self._uploaded
            if want is None:
                return
            if up is not None and want.save <= up[0]:
                continue  # the bucket holds a newer save already
            try:
                want.local.result()  # its local copy committed (a local write, bounded as every one)
            except BaseException as exc:  # noqa: BLE001 - that local save's failure is raised on its own
                log.info("not uploading step %d from local_dir %s: its local save failed (%s)", want.step, local.url,
                         exc)
                continue
            t = time.perf_counter()
            try:
                with local.store.catalog.hold(want.step):  # the local tier's retention keeps it meanwhile
                    if want.step in persistent.store.layout.committed_steps():
                        continue  # saved there since (a forced save)
                    manifest, dropped = promote(local, persistent, want.step, verify=verify, threads=threads)
            except StepNotFoundError:
                log.info("not uploading step %d: local_dir %s no longer holds it", want.step, local.url)
                continue
            except Exception as exc:  # noqa: BLE001 - a failed upload, raised by join()/close()
                failed(want.step, exc)
                continue
            if dropped:
                log.info("the retention of %s dropped steps %s", persistent.url, dropped)
            self.uploaded(want.save, want.taken_at)
            done = time.perf_counter()
            stats = SaveStats(step=want.step, nbytes=manifest.nbytes, num_tensors=manifest.num_tensors,
                              files=len(manifest.files), written_bytes=sum(r.size for r in manifest.files.values()),
                              write_s=done - t, durable_s=done - want.t0, commit_time=manifest.commit_time,
                              extra={"tier": PERSISTENT, CAUGHT_UP: True, **self.lag(want.save, want.taken_at)})
            log.info("uploaded step %d from local_dir %s (its upload had been skipped)", want.step, local.url)
            committed(stats)
