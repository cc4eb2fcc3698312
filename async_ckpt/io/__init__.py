"""One step's files: written and read, in DCP's format, through
:class:`~async_ckpt.storage.storage.Storage`.

* :mod:`.write`: the writer of a step's files (record streams, concurrent checksummed files,
  the planner-free single-process save, the incremental splice);
* :mod:`.reuse`: incremental saves: what the last step holds, the files shared into a new step;
* :mod:`.read_exec`: the one verified read of a step's files, the only module that opens them
  (parallel, CRC-32C as the bytes arrive, one wording of damage);
* :mod:`.read_plan`: which byte ranges a read needs, worked out before anything is read;
* :mod:`.sinks`: where the bytes go (target tensors; host buffers; staged files; nothing);
  :mod:`.device_targets`: XLA and CUDA targets through host stand-ins;
* :mod:`.copies`: a step's files copied to another storage; :mod:`.ranges`: byte ranges of them;
* :mod:`.read_targets`: the restore straight into the target tensors, and the atomic one
  staged in host buffers first;
* :mod:`.dcp_adapters`: DCP's ``StorageWriter`` and ``StorageReader``, the load planners, the
  one check of a step's ``.metadata`` (:func:`~.dcp_adapters.read_metadata`); :mod:`.dcp_call`:
  running a DCP call;
* :mod:`.step_io`: one step's files written and read (:func:`~.step_io.write_step`,
  :func:`~.step_io.read_step`): the one choice of data path.
"""

from .dcp_adapters import FsspecStorageReader, FsspecStorageWriter, load_state_dict
from .reuse import Reuse
from .step_io import save_state_dict

__all__ = ["FsspecStorageReader", "FsspecStorageWriter", "Reuse", "load_state_dict", "save_state_dict"]
