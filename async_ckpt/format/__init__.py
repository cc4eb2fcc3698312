"""The on-disk format of a step, without I/O or threads: names, records, manifests, DCP metadata.

* :mod:`.step_names`: the names of the directories under a root, made and parsed;
* :mod:`.manifest`: the JSON manifest (files, sizes, CRC-32Cs, the copy's identity) and the
  commit marker; :mod:`.crc`: CRC-32C, and of a concatenation from its parts; :mod:`.buffers`: a
  buffer's address;
* :mod:`.torch_record`: one ``torch.save`` record (zip member), rendered and parsed;
* :mod:`.dcp_layout`: DCP's keys and paths of a state dict (flatten, ``set_element``, the
  ``Stateful`` test), the metadata file's name, the write memo;
* :mod:`.unpickling`: the restricted unpicklers; :mod:`.validate`: the check of a step's DCP
  metadata against itself and its manifest.
"""
