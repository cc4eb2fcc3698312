"""DCP-format save and load over :class:`~async_ckpt.storage.fs.Storage`.

* :mod:`.writer`: the write path (record streams, concurrent checksummed files, the
  planner-free single-process save);
* :mod:`.layout_memo`: what that save remembers of a layout for the next one (:class:`WriteMemo`);
* :mod:`.reader`: the read path (concurrent verified reads, then the state dict is touched);
* :mod:`.safety`: the restricted unpicklers for ``.metadata``, objects and tensor records;
* :mod:`.validate`: the check of a step's unpickled ``.metadata`` against itself and its manifest;
* :mod:`.common`: ``METADATA_NAME`` and running a DCP call.
"""

from .common import METADATA_NAME
from .reader import FsspecStorageReader, load_state_dict
from .safety import load_metadata
from .validate import check_step_metadata
from .writer import FsspecStorageWriter, WriteMemo, save_state_dict

__all__ = ["METADATA_NAME", "FsspecStorageReader", "FsspecStorageWriter", "WriteMemo", "check_step_metadata",
           "load_metadata", "load_state_dict", "save_state_dict"]
