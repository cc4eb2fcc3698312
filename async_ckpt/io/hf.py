"""Hugging Face checkpoints: sharded safetensors and their index, as ``save_pretrained`` writes them.

A directory holds ``model-0000K-of-0000N.safetensors`` files and ``model.safetensors.index.json``
(``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``); ``transformers``'
``from_pretrained``, ``safetensors`` and torchtitan's ``initial_load_in_hf`` read it. A directory
holding one ``model.safetensors`` and no index is read too. The files are made and parsed by the
``safetensors`` package; this module decides the shards, writes each file atomically through
:class:`~async_ckpt.storage.storage.Storage` (any fsspec URL), the index last, and loads such a
directory into a state dict's tensors in place (cast to their dtypes where asked).
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Mapping, Optional

import torch

from ..errors import InvalidArgumentError, InvalidStateDictError, StateDictMismatchError
from ..storage.storage import Storage

#: The index ``from_pretrained`` looks for beside the shards.
INDEX_NAME = "model.safetensors.index.json"
#: The one file of an unsharded checkpoint.
SINGLE_NAME = "model.safetensors"
#: ``save_pretrained``'s default ``max_shard_size`` ("5GB").
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError:
        raise ImportError("Hugging Face checkpoints need the safetensors package (pip install safetensors)") from None
    return safetensors.torch


def shard_names(tensors: Mapping[str, torch.Tensor], max_shard_bytes: int) -> List[List[str]]:
    """The names of ``tensors`` in shards of at most ``max_shard_bytes`` each, in order, as
    ``save_pretrained`` cuts them (a tensor larger than the limit is a shard of its own).

    Args:
        tensors: the tensors, by name, in the order they are written.
        max_shard_bytes: the most tensor bytes in one shard.

    Returns:
        The names of each shard's tensors (one empty shard for no tensors).
    """
    shards: List[List[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def save_hf(tensors: Mapping[str, Any], path: str, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
            dtype: Optional[torch.dtype] = None, storage_options: Optional[Dict[str, Any]] = None,
            metadata: Optional[Mapping[str, str]] = None) -> List[str]:
    """Write ``tensors`` as a Hugging Face checkpoint directory: sharded safetensors and the index.

    Each file is written whole or not at all (a temporary name then a rename, or one PUT), the
    index last, so a reader that finds the index finds every shard. Files of other names in
    ``path`` are left alone; files of the names written are replaced.

    Args:
        tensors: flat names (``"model.layers.0.weight"``) to tensors (any device; copied to the host).
        path: the directory (a local path or fsspec URL); made if missing.
        max_shard_bytes: the most tensor bytes per shard file.
        dtype: cast floating-point tensors to this dtype (e.g. ``torch.bfloat16``); others keep theirs.
        storage_options: fsspec options for a remote ``path``.
        metadata: string pairs stored in each shard's header and the index's ``metadata``.

    Returns:
        The names of the files written, the index last.

    Raises:
        InvalidStateDictError: a value that is not a tensor (named), or a sparse / quantized one.
        InvalidArgumentError: ``max_shard_bytes`` not a positive int, ``dtype`` not a floating dtype.
        StorageError: the storage refused a write.
    """
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise InvalidArgumentError(f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise InvalidArgumentError(f"dtype must be a floating-point torch.dtype such as torch.bfloat16, got {dtype!r}")
    st = _safetensors()
    host: Dict[str, torch.Tensor] = {}
    seen: set = set()
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise InvalidStateDictError(f"{name!r} is a {type(t).__name__}: a Hugging Face checkpoint holds tensors "
                                        f"only (leave it out, or export the tensors' subtree)")
        if t.layout != torch.strided or t.is_quantized:
            raise InvalidStateDictError(f"{name!r} is a {t.layout} / quantized tensor: safetensors holds dense tensors only")
        v = t.detach().to("cpu")
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        v = v.contiguous()
        key = (v.untyped_storage().data_ptr(), v.storage_offset()) if v.numel() else None
        if key is not None and (key in seen or v.untyped_storage().nbytes() != v.numel() * v.element_size()):
            v = v.clone()  # safetensors refuses tensors that share memory
        if key is not None:
            seen.add(key)
        host[name] = v
    storage = Storage(path, storage_options)
    storage.makedirs(storage.root)
    shards = shard_names(host, max_shard_bytes)
    extra = dict(metadata or {})
    names: List[str] = []
    weight_map: Dict[str, str] = {}
    for i, members in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        data = st.save({n: host[n] for n in members}, metadata={"format": "pt", **extra})
        storage.write_bytes_atomic(storage.join(file), data)
        names.append(file)
        weight_map.update((n, file) for n in members)
    total = sum(t.numel() * t.element_size() for t in host.values())
    index = {"metadata": {"total_size": total, **extra}, "weight_map": weight_map}
    storage.write_bytes_atomic(storage.join(INDEX_NAME), json.dumps(index, indent=2, sort_keys=True).encode())
    return [*names, INDEX_NAME]


def shard_files(path: str, storage_options: Optional[Dict[str, Any]] = None) -> Dict[str, str]:
    """The tensors of a Hugging Face checkpoint directory and the file holding each: its index
    (no tensor read), or the one ``model.safetensors`` (read).

    Args:
        path: the directory (a local path or fsspec URL).
        storage_options: fsspec options for a remote ``path``.

    Returns:
        Tensor name to file name (for a single file: every name it holds).

    Raises:
        FileNotFoundError: neither ``model.safetensors.index.json`` nor ``model.safetensors`` is there.
        ValueError: the index is not the JSON ``save_pretrained`` writes.
    """
    storage = Storage(path, storage_options)
    if storage.exists(storage.join(INDEX_NAME)):
        raw = storage.read_bytes(storage.join(INDEX_NAME))
        try:
            weight_map = json.loads(raw)["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("weight_map is not a mapping of names to files")
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}/{INDEX_NAME} is not a Hugging Face index ({exc})") from None
        return dict(weight_map)
    if storage.exists(storage.join(SINGLE_NAME)):
        return {n: SINGLE_NAME for n in _safetensors().load(storage.read_bytes(storage.join(SINGLE_NAME)))}
    raise FileNotFoundError(f"{path} holds no Hugging Face checkpoint (neither {INDEX_NAME} nor {SINGLE_NAME})")


def load_hf(path: str, state_dict: Optional[Dict[str, Any]] = None, *, cast: bool = True, strict: bool = True,
            storage_options: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Read a Hugging Face checkpoint directory (:func:`save_hf`'s, ``save_pretrained``'s).

    Args:
        path: the directory (a local path or fsspec URL).
        state_dict: flat names to tensors to load into, in place (any device); None: return
            the checkpoint's tensors on the host.
        cast: a tensor stored in another dtype than its target's is cast to the target's (as
            ``dcp.load`` does); False: refuse it.
        strict: every target must be in the checkpoint.
        storage_options: fsspec options for a remote ``path``.

    Returns:
        ``state_dict`` loaded, or the checkpoint's tensors.

    Raises:
        FileNotFoundError: ``path`` holds no Hugging Face checkpoint.
        StateDictMismatchError: (with ``state_dict``) a target missing from the checkpoint
            (``strict``), of another shape, or of another dtype without ``cast``.
        InvalidStateDictError: a target that is not a tensor.
    """
    st = _safetensors()
    storage = Storage(path, storage_options)
    where = shard_files(path, storage_options)
    if state_dict is not None:
        for name, t in state_dict.items():
            if not isinstance(t, torch.Tensor):
                raise InvalidStateDictError(f"target {name!r} is a {type(t).__name__}: load a Hugging Face "
                                            f"checkpoint into tensors")
        missing = sorted(n for n in state_dict if n not in where)
        if missing and strict:
            raise StateDictMismatchError(
                f"{path} has no tensor named {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} "
                f"({len(missing)} of {len(state_dict)} targets); pass strict=False to load the others")
        wanted = {n: f for n, f in where.items() if n in state_dict}
    else:
        wanted = where
    out: Dict[str, Any] = {} if state_dict is None else state_dict
    for file in sorted(set(wanted.values())):
        loaded = st.load(storage.read_bytes(storage.join(file)))
        for name in (n for n, f in wanted.items() if f == file):
            if name not in loaded:
                raise StateDictMismatchError(f"{path}/{file} lacks {name!r}, which its index places there")
            src = loaded[name]
            if state_dict is None:
                out[name] = src
                continue
            dst = state_dict[name]
            if tuple(dst.shape) != tuple(src.shape):
                raise StateDictMismatchError(f"{name!r}: the checkpoint's shape is {tuple(src.shape)}, the "
                                             f"target's {tuple(dst.shape)}")
            if dst.dtype != src.dtype and not cast:
                raise StateDictMismatchError(f"{name!r}: stored as {src.dtype}, the target is {dst.dtype}; pass "
                                             f"cast=True to cast on load")
            with torch.no_grad():
                dst.copy_(src)
    return out
