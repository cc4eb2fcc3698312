"""DCP-format save and load over :class:`~async_ckpt.storage.storage.Storage`.

* :mod:`.writer`: the write path (record streams, concurrent checksummed files, the
  planner-free single-process save);
* :mod:`.file_assignment`: what that save remembers of a layout for the next one (:class:`WriteMemo`);
* :mod:`.step_io`: one step's files written and read (:func:`~.step_io.write_step`,
  :func:`~.step_io.read_step`): the choice of data path;
* :mod:`.read_exec`: the one verified read of a step's files (sinks, the one wording of damage);
* :mod:`.reader`: DCP's ``StorageReader`` (custom planners, several ranks);
* :mod:`.direct`, :mod:`.atomic_restore`: reads straight into the targets, or staged in host
  buffers first (atomic);
* :mod:`.unpickling`: the restricted unpicklers for ``.metadata``, objects and tensor records;
* :mod:`.validate`: the check of a step's unpickled ``.metadata`` against itself and its manifest;
* :mod:`.dcp_call`: ``METADATA_NAME`` and running a DCP call.
"""

from .dcp_call import METADATA_NAME
from .reader import FsspecStorageReader, load_state_dict
from .reuse import Reuse
from .unpickling import load_metadata
from .validate import check_step_metadata
from .writer import FsspecStorageWriter, WriteMemo, save_state_dict

__all__ = ["METADATA_NAME", "FsspecStorageReader", "FsspecStorageWriter", "Reuse", "WriteMemo", "check_step_metadata",
           "load_metadata", "load_state_dict", "save_state_dict"]
