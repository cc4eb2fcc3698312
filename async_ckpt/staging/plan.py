"""State dict -> staging plan: a template of the nested structure plus a flat list of tensors.

The plan walks the user's state dict once, validates every leaf and records where each tensor
sits. Non-tensor leaves are pickled at the call, once (:func:`~async_ckpt.format.torch_record.pickle_value`:
this also proves that they can be saved), and the snapshot keeps those bytes, so a later
mutation by the training loop cannot leak into the checkpoint and no value is ever unpickled
while saving; a random number generator state -- a NumPy array or scalar, a NumPy generator,
a ``random.Random`` -- is copied instead and saved as itself (see :func:`_rng_copy`). A
top-level value with ``state_dict``/``load_state_dict`` (DCP's ``Stateful``, which DCP saves
through its ``state_dict()``) is asked for its ``state_dict()`` here, at the call, and what it
returns is planned as any other entry: user code never runs on the writer thread, where its
failure on one rank could not be reported to the others.
"""

from __future__ import annotations

import copy
import random
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

import torch
from torch.nn.parameter import is_lazy

from ..compat import dcp_flatten_state_dict
from ..errors import CheckpointError, InvalidStateDictError
from ..format.dcp_layout import is_stateful
from ..format.torch_record import pickle_value

_IMMUTABLE = (int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device, torch.Size)


class _Slot:
    """Placeholder for the i-th tensor of a plan inside the template (one per tensor per save:
    a plain slotted class, cheaper to create than a dataclass)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class _DSlot(_Slot):
    """Placeholder for a DTensor: the i-th tensor is its local shard; ``spec`` rebuilds it."""

    __slots__ = ("spec",)

    def __init__(self, index: int, spec: Any = None) -> None:
        super().__init__(index)
        self.spec = spec


_DTensorType: Optional[type]
try:
    from torch.distributed.tensor import DTensor as _DTensor

    _DTensorType = _DTensor
except Exception:  # torch built without distributed
    _DTensorType = None


def _is_dtensor(value: Any) -> bool:
    return _DTensorType is not None and isinstance(value, _DTensorType)


def _host_dtensor(local: torch.Tensor, spec: Any) -> Any:
    """A DTensor over ``local`` (a host copy of a shard) with the original mesh and placements.

    DCP then writes only this rank's chunk, with the global shape and offsets of the original.
    """
    from torch.distributed.tensor import DTensor

    if spec.mesh.device_type == local.device.type:
        return DTensor.from_local(local, spec.mesh, spec.placements, run_check=False,
                                  shape=spec.shape, stride=spec.stride)
    # A CUDA/XLA mesh: from_local would move the host copy back to the device; the private
    # constructor keeps it where it is (DCP only reads the spec and the local tensor).
    return DTensor(local, spec, requires_grad=False)


@dataclass
class StagingPlan:
    """The result of :func:`make_plan`: what to copy and how to put it back together.

    Attributes:
        template: the state dict's structure, a slot in place of each tensor.
        tensors: the tensors, in slot order.
        keys: their dotted paths (``model.weight``).
        int_keys: dotted paths of dict entries whose key is an int (e.g. ``optim.state.0``):
            DCP's flat names turn keys into strings, and restore needs to know which ones to
            turn back.
        others: dotted paths of the non-tensor leaves and of every list and tuple (which DCP
            may store as one item): with ``keys``, what two entries' flat names can collide on.
        odd_keys: a key is a str subclass (an enum): DCP names it ``str(key)``, the plan by
            its value.
        pickled: ``(dotted path, PickledObject)`` of the leaves pickled by this plan (not ints,
            strings, ...): the values a restore may need ``allow_pickle=True`` for.
        stateful: top-level key -> what that ``Stateful`` value's ``state_dict()`` returned
            (planned in its place, as DCP saves it).
    """

    template: Any
    tensors: List[torch.Tensor] = field(default_factory=list)
    keys: List[str] = field(default_factory=list)
    int_keys: List[str] = field(default_factory=list)
    others: List[str] = field(default_factory=list)
    odd_keys: bool = False
    pickled: List[Tuple[str, Any]] = field(default_factory=list)
    stateful: Dict[str, Any] = field(default_factory=dict)
    #: :meth:`dtensor_specs`, found once per plan (the template does not change once planned)
    _dtensor_specs: Optional[Dict[int, Any]] = field(default=None, init=False, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors."""
        return sum(map(attrgetter("nbytes"), self.tensors))

    def by_device_type(self) -> Dict[str, List[Tuple[int, torch.Tensor]]]:
        """``(index, tensor)`` pairs grouped by device type (``"cpu"``, ``"cuda"``, ``"xla"``)."""
        ts = self.tensors
        if ts:  # one device type throughout (the usual case): decided in C-level loops
            for kind, attr in (("cpu", "is_cpu"), ("xla", "is_xla"), ("cuda", "is_cuda")):
                if all(map(attrgetter(attr), ts)):
                    return {kind: list(enumerate(ts))}
        out: Dict[str, List[Tuple[int, torch.Tensor]]] = {}
        for i, t in enumerate(ts):
            kind = "cpu" if t.is_cpu else "cuda" if t.is_cuda else "xla" if t.is_xla else t.device.type  # type: ignore[attr-defined]  # torch stubs omit Tensor.is_xla
            out.setdefault(kind, []).append((i, t))
        return out

    def build(self, host_tensors: List[torch.Tensor], dropping: bool = False) -> Any:
        """The template with every slot replaced by the matching host tensor.

        Args:
            host_tensors: one tensor per slot, in the order of :attr:`tensors`.
            dropping: some entries are :data:`DROPPED` (another rank stages them): their keys
                are left out.

        Returns:
            The state dict of host tensors.
        """
        return (_fill_dropping if dropping else _fill)(self.template, host_tensors)

    def dtensor_specs(self) -> Dict[int, Any]:
        """Tensor index -> DTensor spec (mesh, placements, global shape), for DTensor shards.

        Returns:
            The spec of each tensor that is a DTensor's local shard, by its index (one dict per
            plan, walked once: not to be changed).
        """
        if self._dtensor_specs is not None:
            return self._dtensor_specs
        out: Dict[int, Any] = {}

        def walk(t: Any) -> None:
            if isinstance(t, _DSlot):
                out[t.index] = t.spec
            elif isinstance(t, dict):
                for v in t.values():
                    walk(v)
            elif isinstance(t, (list, tuple)):
                for v in t:
                    walk(v)

        walk(self.template)
        self._dtensor_specs = out
        return out

    def in_sequence(self) -> Set[str]:
        """Keys of the tensors that lie inside a list or tuple.

        DCP may store such a container as one item, so its tensors are staged with it.

        Returns:
            The keys.
        """
        containers = set(self.others)
        out = set()
        for key in self.keys:
            parts = key.split(".")
            if any(".".join(parts[:n]) in containers for n in range(1, len(parts))):
                out.add(key)
        return out

    def check_tensors(self) -> None:
        """Raise :class:`InvalidStateDictError` naming the first tensor that cannot be staged.

        Quantized, nested, meta, or of a dtype without a copy kernel such as
        ``torch.float4_e2m1fn_x2``. A Python step per tensor: the stager calls it only once staging
        failed, to tell a bad state dict from a failure of its own."""
        names = self.keys if len(self.keys) == len(self.tensors) else [str(i) for i in range(len(self.tensors))]
        for name, t in zip(names, self.tensors):
            problem = unsupported_tensor(t)
            if problem is not None:
                raise InvalidStateDictError(f"{name}: {problem}")


def _copies(dtype: torch.dtype) -> bool:
    """Whether this torch can copy tensors of ``dtype`` (decided by trying, once per dtype at
    import: torch 2.9 has no copy kernel for ``float4_e2m1fn_x2``, newer releases do)."""
    try:
        src = torch.zeros(4, dtype=torch.uint8).view(dtype)
        torch.empty_like(src).copy_(src)
        src.clone()
        return True
    except Exception:  # the dtype cannot be copied as bytes here: the probe's answer
        return False


#: quantized dtypes: the values are not their bytes (scale and zero point live on the tensor)
_QUANTIZED = ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
#: sub-byte and packed dtypes: refused where this torch has no copy kernel for them
_PACKED = ("float4_e2m1fn_x2", *(f"uint{b}" for b in range(1, 8)), *(f"int{b}" for b in range(1, 8)))

#: dtypes whose tensors cannot be saved here: quantized ones always, packed ones whose copy this
#: torch does not implement (decided by behaviour, not by version)
UNCOPYABLE_DTYPES = frozenset(
    d for n in (*_QUANTIZED, *_PACKED) for d in (getattr(torch, n, None),)
    if isinstance(d, torch.dtype) and (n in _QUANTIZED or not _copies(d)))


_LAZY = ("an uninitialized parameter (a LazyModule's, before its first forward) has no data to save: run a "
         "forward pass first, or leave it out of the state dict")
_NAMED = "named tensors cannot be saved: save t.rename(None) (and the names, if you need them, as a list of str)"


def unsupported_tensor(t: torch.Tensor) -> Optional[str]:
    """Why ``t`` cannot be saved, or ``None`` if it can."""
    if is_lazy(t):
        return _LAZY
    if _has_names is not None and _has_names(t):
        return _NAMED
    if t.is_meta:
        return "a meta tensor has no data to save"
    if t.is_nested:
        return "nested tensors cannot be saved (save their components, e.g. t.unbind())"
    if t.is_quantized:
        return f"quantized tensors ({t.dtype}) cannot be saved (save t.dequantize(), or t.int_repr() with its scale and zero point)"
    if t.dtype in UNCOPYABLE_DTYPES:
        return f"{t.dtype} tensors cannot be saved (torch has no copy kernel for this dtype)"
    if (t.is_conj() or t.is_neg()) and t.numel():
        try:
            t.reshape(-1)[:1].resolve_conj().resolve_neg()
        except Exception as exc:  # e.g. no neg kernel for float8
            kind = "conjugate" if t.is_conj() else "negative"
            return f"a {kind} view of a {t.dtype} tensor cannot be resolved to be saved ({exc})"
    return None


class _Run(dict):
    """The template of a mapping whose values are all plain strided tensors under keys of type
    ``str``: slots ``start, start + 1, ...`` in key order, filled by one ``dict(zip(...))``
    instead of a Python step per key. :class:`PlanMemo` keeps it for the next plan, with the
    mapping's keys (a list, compared in one call) and their dotted paths."""

    __slots__ = ("start", "key_list", "paths")
    start: int
    key_list: List[Any]
    paths: List[str]


class PlanMemo:
    """What :func:`make_plan` learned from the last state dict, to plan the next one faster.

    A training loop saves the same structure every time (``model.state_dict()`` is a new dict
    of new tensor objects, but with the same keys). For a mapping whose values were all plain
    tensors, the next plan compares its keys as one list and checks its values in C-level
    loops instead of visiting them one by one in Python.
    Anything else -- other keys, a value that is not a plain strided tensor, tensors before
    it that moved its start -- is walked as without a memo, and remembered afresh. Holds
    keys and templates only, never tensors. One per :class:`~.stager.Stager` (its eager and lazy stagers share it). Entries never change
    once made, so concurrent plans stay correct; they only remember less.
    """

    __slots__ = ("seen", "names")

    def __init__(self) -> None:
        self.seen: Dict[Optional[str], _Run] = {}  # by path; None: the state dict itself
        #: the flat names (tensor keys, then other paths) of the last plan, known distinct
        self.names: Optional[List[str]] = None


def make_plan(state_dict: Any, memo: Optional[PlanMemo] = None) -> StagingPlan:
    """Flatten ``state_dict`` into a :class:`StagingPlan`, validating every leaf.

    Args:
        state_dict: the state dict (a mapping).
        memo: kept from one call to the next, makes repeated plans of one structure faster;
            the plan is the same with or without it.

    Returns:
        The plan.

    Raises:
        InvalidStateDictError: ``state_dict`` is not a mapping, a key is not a string (or an
            int below the top level), a leaf cannot be pickled, the nesting is too deep to
            walk, two entries' flattened names (``a.b`` for ``{"a": {"b": x}}``) are equal, a
            tensor is named or a LazyModule's uninitialized parameter.
        CheckpointError: a top-level ``Stateful`` value's ``state_dict()`` raised (chained).
    """
    if not isinstance(state_dict, Mapping):
        hint = ""
        if callable(getattr(state_dict, "state_dict", None)):  # a module or an optimizer
            hint = (f"; pass its state_dict() (e.g. {{'model': model.state_dict()}}), or put the "
                    f"{type(state_dict).__name__} itself under a key ({{'model': model}})")
        raise InvalidStateDictError(
            f"state_dict must be a mapping (e.g. a dict), got {type(state_dict).__name__}{hint}"
        )
    plan = StagingPlan(template=None)
    seen: Optional[Dict[Optional[str], _Run]] = {} if memo is not None else None
    try:
        plan.template = _walk_mapping(state_dict, None, plan, memo.seen if memo is not None else None, seen)
    except RecursionError:
        depth, where = _deepest(state_dict)
        raise InvalidStateDictError(
            f"{where}: the state dict is nested {depth} levels deep, too deep to save") from None
    _check_names(state_dict, plan, memo)
    if _has_names is not None and any(map(_has_names, plan.tensors)):  # a C-level loop; staging (lazy: later) would fail without the key
        plan.check_tensors()
    if memo is not None:
        memo.seen = seen  # type: ignore[assignment]  # only what this state dict still has
    return plan


def _check_names(state_dict: Mapping, plan: StagingPlan, memo: Optional[PlanMemo]) -> None:
    """Raise :class:`InvalidStateDictError` if two entries flatten to one name (DCP's flat
    names join keys with ``.``: ``{"a.b": x, "a": {"b": y}}``, or ``{0: x, "0": y}`` below the
    top). A set of the plan's names finds candidates; DCP's own flattening decides (it keeps
    some lists and every tuple as one item). The names of the last plan, once checked, are
    kept in ``memo``: a training loop's next plan has equal names, compared as one list."""
    names = plan.keys + plan.others if plan.others else plan.keys
    if not plan.odd_keys and memo is not None and memo.names is not None and memo.names == names:
        return
    if plan.odd_keys or len(set(names)) != len(names):
        try:
            dcp_flatten_state_dict()({**state_dict, **plan.stateful})
        except ValueError as exc:
            msg = str(exc)
            lead = "duplicated flatten key "
            if msg.startswith(lead):
                raise InvalidStateDictError(
                    f"{msg[len(lead):]}: two entries of the state dict have this flattened name "
                    f"(nested keys are joined with '.', and int keys become strings); rename one") from None
            raise
    if memo is not None:
        memo.names = None if plan.odd_keys else names


def _deepest(state_dict: Mapping) -> Tuple[int, str]:
    """The nesting depth of ``state_dict`` and the (shortened) path to its deepest entry,
    found without recursion."""
    best: Tuple[int, Tuple[Any, ...]] = (0, ())
    stack: List[Tuple[Any, Tuple[Any, ...]]] = [(state_dict, ())]
    while stack:
        value, path = stack.pop()
        if len(path) > best[0]:
            best = (len(path), path)
        if isinstance(value, Mapping):
            stack.extend((v, path + (k,)) for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            stack.extend((v, path + (i,)) for i, v in enumerate(value))
    depth, path = best
    parts = [str(p) for p in path]
    where = ".".join(parts) if len(parts) <= 8 else ".".join(parts[:4]) + ". ... ." + ".".join(parts[-2:])
    return depth, where


_type, _layout, _requires_grad = type, attrgetter("layout"), attrgetter("requires_grad")
_has_names = getattr(torch.Tensor, "has_names", None)  # named tensors: gone from newer torch


def _plain_tensors(vals: List[Any]) -> Optional[List[torch.Tensor]]:
    """``vals`` ready for the plan if every one is a plain strided tensor (detached where it
    requires grad), else ``None``. C-level loops: no Python code runs per value."""
    if set(map(_type, vals)) != {torch.Tensor} or set(map(_layout, vals)) != {torch.strided}:
        return None
    if any(map(_requires_grad, vals)):
        return [v.detach() if v.requires_grad else v for v in vals]
    return vals


def _walk_mapping(value: Mapping, path: Optional[str], plan: StagingPlan, old: Optional[Dict[Optional[str], _Run]],
                  new: Optional[Dict[Optional[str], _Run]]) -> Dict[Any, Any]:
    """The template of one mapping (``path`` None: the state dict itself, whose keys must be
    strings); with ``old``/``new``, reuses and records :class:`_Run` templates."""
    tensors, keys = plan.tensors, plan.keys
    if old is not None:
        e = old.get(path)
        if e is not None and e.start == len(tensors):
            ks = list(value.keys())
            # Equal keys of exactly type str: a str subclass (an enum) equals its value, but is
            # named differently (see the walk below).
            if ks == e.key_list and set(map(_type, ks)) == {str}:
                vals = _plain_tensors(list(value.values()))
                if vals is not None:
                    tensors += vals
                    keys += e.paths
                    new[path] = e  # type: ignore[index]  # new is a dict whenever old is (make_plan)
                    return e
    out: Dict[Any, Any] = {}
    start = len(tensors)
    plain = True  # every value a plain strided tensor under a string key (see _Run)
    tensor_type, strided, slot = torch.Tensor, torch.strided, _Slot
    top = path is None
    prefix = "" if top else path + "."  # type: ignore[operator]
    for k, v in value.items():
        if type(k) is str:
            sub = prefix + k
        elif top:
            if not isinstance(k, str):
                raise InvalidStateDictError(
                    f"top-level state_dict keys must be strings, got {k!r} ({type(k).__name__})"
                )
            sub, plain = k, False  # a str subclass (an enum, say): named as it is
            plan.odd_keys = True
        elif isinstance(k, bool) or not isinstance(k, (str, int)):
            raise InvalidStateDictError(
                f"{path}: nested keys must be strings or ints, got {k!r} ({type(k).__name__})"
            )
        else:
            sub = f"{prefix}{k}"
            plain = False
            if isinstance(k, int):
                plan.int_keys.append(sub)
            else:
                plan.odd_keys = True
        if type(v) is tensor_type and v.layout is strided:  # inlined common case
            out[k] = slot(len(tensors))
            tensors.append(v.detach() if v.requires_grad else v)
            keys.append(sub)
        else:
            plain = False
            if top and is_stateful(v):
                v = plan.stateful[sub] = _state_of(v, sub)
                out[k] = _walk(v, sub, plan, old, new)
            else:
                out[k] = _walk(v, sub, plan, old, new)
    if plain and out and len(out) == len(tensors) - start:  # (a Mapping that yields a key twice: no)
        run = _Run(out)
        run.start, run.key_list, run.paths = start, list(out), keys[start:]
        if new is not None:
            new[path] = run
        return run
    return out


def _walk(value: Any, path: str, plan: StagingPlan, old: Optional[Dict[Optional[str], _Run]] = None,
          new: Optional[Dict[Optional[str], _Run]] = None) -> Any:
    if type(value) is torch.Tensor and value.layout == torch.strided:  # the common case, first
        plan.tensors.append(value.detach() if value.requires_grad else value)
        plan.keys.append(path)
        return _Slot(len(plan.tensors) - 1)
    if _is_dtensor(value):
        # Stage only this rank's shard; the spec (mesh, placements, global shape) is kept.
        local = value.to_local().detach()
        if local.is_sparse or local.layout != torch.strided:
            raise InvalidStateDictError(f"{path}: only strided (dense) tensors can be saved, got {local.layout}")
        plan.tensors.append(local)
        plan.keys.append(path)
        return _DSlot(len(plan.tensors) - 1, value._spec)
    if isinstance(value, torch.Tensor):
        if is_lazy(value):  # any use of it raises torch's own error, without the key
            raise InvalidStateDictError(f"{path}: {_LAZY}")
        if value.is_sparse or value.layout != torch.strided:
            raise InvalidStateDictError(f"{path}: only strided (dense) tensors can be saved, got {value.layout}")
        plan.tensors.append(value.detach() if value.requires_grad else value)
        plan.keys.append(path)
        return _Slot(len(plan.tensors) - 1)
    if isinstance(value, Mapping):
        return _walk_mapping(value, path, plan, old, new)
    plan.others.append(path)
    if isinstance(value, list):
        return [_walk(v, f"{path}.{i}", plan, old, new) for i, v in enumerate(value)]
    if type(value) is tuple:
        return tuple(_walk(v, f"{path}.{i}", plan, old, new) for i, v in enumerate(value))
    if isinstance(value, _IMMUTABLE):
        return value
    native = _rng_copy(value)
    if native is not _NOT_RNG:
        return native
    try:
        pickled = pickle_value(value)  # its __reduce__ runs here, once; nothing is unpickled
    except Exception as exc:  # lambdas, open files, locks, ...
        raise InvalidStateDictError(
            f"{path}: a {type(value).__name__} cannot be saved in a checkpoint ({exc})"
        ) from exc
    plan.pickled.append((path, pickled))
    return pickled


_NOT_RNG: Any = object()


def _rng_copy(value: Any) -> Any:
    """A copy, taken now, of a random number generator state: a NumPy array or scalar (not of
    object dtype), a NumPy ``Generator`` or ``RandomState`` of one of NumPy's bit generators, or
    a ``random.Random``; :data:`_NOT_RNG` for anything else.

    Such a value is saved as itself, not pickled at the call: restore builds these classes
    without ``allow_pickle`` (``RNG_GLOBALS`` in ``format.unpickling``), and inside a list
    or tuple (one item, ``torch.save``-d whole) a pickled value could come back only through
    ``pickle.loads``."""
    if type(value) is random.Random:
        return copy.deepcopy(value)
    np = sys.modules.get("numpy")
    if np is None:  # numpy was never imported: the value is none of its types
        return _NOT_RNG
    if type(value) is np.ndarray:
        return _NOT_RNG if value.dtype.hasobject else value.copy(order="K")
    if isinstance(value, np.generic):
        return _NOT_RNG if value.dtype.hasobject else value  # immutable
    nr = sys.modules.get("numpy.random")
    if nr is not None and type(value) in (nr.Generator, nr.RandomState) \
            and type(getattr(value, "bit_generator", None) or getattr(value, "_bit_generator", None)) in (
                nr.MT19937, nr.PCG64, nr.PCG64DXSM, nr.Philox, nr.SFC64):
        return copy.deepcopy(value)
    return _NOT_RNG


def _state_of(value: Any, path: str) -> Any:
    """What a top-level ``Stateful`` value's ``state_dict()`` returns (what DCP would save in its
    place), asked for on the caller's thread at the call."""
    try:
        return value.state_dict()
    except Exception as exc:
        raise CheckpointError(f"{path!r}: {type(value).__name__}.state_dict() raised {type(exc).__name__}: {exc}"
                              ) from exc


#: a host list entry for a tensor this rank does not stage (another rank stages it): the key is
#: left out of the snapshot (see ``StagingPlan.build``)
DROPPED: Any = object()


def _fill(template: Any, host: List[torch.Tensor]) -> Any:
    if type(template) is _Run:
        return dict(zip(template, host[template.start: template.start + len(template)]))
    if isinstance(template, _DSlot):
        return _host_dtensor(host[template.index], template.spec)
    if isinstance(template, _Slot):
        return host[template.index]
    if isinstance(template, dict):  # plain slots inline: one call per tensor saved
        return {k: host[v.index] if type(v) is _Slot else _fill(v, host) for k, v in template.items()}
    if isinstance(template, list):
        return [_fill(v, host) for v in template]
    if type(template) is tuple:
        return tuple(_fill(v, host) for v in template)
    return template


def _fill_dropping(template: Any, host: List[Any]) -> Any:
    """:func:`_fill`, leaving out the dict entries whose host tensor is :data:`DROPPED` (never
    inside a list or tuple: see ``StagingPlan.in_sequence``)."""
    if isinstance(template, _Slot):
        local = host[template.index]
        if local is DROPPED or not isinstance(template, _DSlot):
            return local
        return _host_dtensor(local, template.spec)
    if isinstance(template, dict):  # a _Run too
        pairs: Iterable[Tuple[Any, Any]]
        if type(template) is _Run:
            pairs = zip(template, host[template.start: template.start + len(template)])
        else:
            pairs = ((k, _fill_dropping(v, host)) for k, v in template.items())
        return {k: v for k, v in pairs if v is not DROPPED}
    if isinstance(template, list):
        return [_fill_dropping(v, host) for v in template]
    if type(template) is tuple:
        return tuple(_fill_dropping(v, host) for v in template)
    return template
