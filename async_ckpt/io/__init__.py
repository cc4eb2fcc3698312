"""DCP-format save and load over :class:`~async_ckpt.storage.storage.Storage`.

* :mod:`.writer`: the write path (record streams, concurrent checksummed files, the
  planner-free single-process save);
* :mod:`.step_io`: one step's files written and read (:func:`~.step_io.write_step`,
  :func:`~.step_io.read_step`): the choice of data path;
* :mod:`.read_exec`: the one verified read of a step's files (sinks, the one wording of damage);
* :mod:`.reader`: DCP's ``StorageReader`` (custom planners, several ranks);
* :mod:`.direct`, :mod:`.atomic_restore`: reads straight into the targets, or staged in host
  buffers first (atomic);
* :mod:`.dcp_call`: running a DCP call.
"""

from .dcp_adapters import FsspecStorageReader, load_state_dict
from .reuse import Reuse
from .write import FsspecStorageWriter, save_state_dict

__all__ = ["FsspecStorageReader", "FsspecStorageWriter", "Reuse", "load_state_dict", "save_state_dict"]
