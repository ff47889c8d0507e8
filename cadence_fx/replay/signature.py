"""Signatures: the exact key of one call (shapes, strides, dtypes, devices, memory formats, the
structure of the arguments, every non-tensor argument), the catalog classes built from them, and
why a call misses (`MissReason`, `Miss`: expected against actual)."""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.utils import _pytree as pytree


class MissReason(str, enum.Enum):
    """Why a call ran eagerly. Counter keys are the string values."""

    STRUCTURE = "structure"
    DEVICE = "device"
    DTYPE = "dtype"
    SHAPE = "shape"
    MEMORY_FORMAT = "memory_format"
    STRIDE = "stride"
    REQUIRES_GRAD = "requires_grad"
    SCALAR = "scalar"
    UNKEYABLE = "unkeyable"
    NOT_IN_CATALOG = "not_in_catalog"
    POINTER_DRIFT = "pointer_drift"
    HOST_RNG = "host_rng"
    STATE_REBIND = "state_rebind"
    AUTOGRAD = "autograd"
    LAYOUT = "layout"
    HOST_DATA = "host_data"
    UNCAPTURABLE = "uncapturable"
    CUT_GUARD = "cut_guard"
    NESTED = "nested"
    NO_CUDA = "no_cuda"


_SCALAR_TYPES = (
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    type(None),
    torch.dtype,
    torch.device,
    torch.memory_format,
    torch.layout,
    enum.Enum,
)
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
# A leaf key is a plain tuple (cheap to build on every call):
#   ("T", shape, stride, dtype, device, requires_grad, memory_format)  or  ("S", type, value).
_T, _S = "T", "S"


@dataclass(frozen=True)
class TensorSpec:
    """A tensor argument of a catalog signature, described without allocating it.

    `stride=None` means contiguous. The catalog code builds one per hot-operator input from the
    contract's region extents.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    device: torch.device | str = "cpu"
    stride: tuple[int, ...] | None = None
    requires_grad: bool = False

    def key(self) -> tuple:
        shape = tuple(int(s) for s in self.shape)
        stride = _layout_strides(shape, tuple(self.stride)) if self.stride is not None else _contiguous_strides(shape)
        # The format of the tensor it describes, decided by torch itself (a zero-size view is
        # contiguous whatever its strides), so the key is the one that tensor's call computes.
        fmt = _memory_format(torch.empty_strided(shape, stride, device="meta"))
        return (_T, shape, stride, self.dtype, _indexed(self.device), self.requires_grad, fmt)


def _indexed(device: torch.device | str) -> torch.device:
    """`device` with its index: a tensor placed on "cuda" reports the current device (cuda:0)."""
    device = torch.device(device)
    if device.index is not None or device.type in ("cpu", "meta"):
        return device
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    current = accelerator is not None and accelerator.type == device.type
    return torch.device(device.type, torch.accelerator.current_device_index() if current else 0)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def _memory_format(t: torch.Tensor) -> str:
    if t.is_contiguous():
        return "contiguous"
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        return "channels_last"
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d):
        return "channels_last_3d"
    return "strided"


def is_dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: some permutation of `t` is contiguous (or it has no elements),
    so it can be staged."""
    if t.numel() == 0:
        return True
    expected = 1
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


@functools.lru_cache(maxsize=4096)
def _layout_strides(shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[int, ...]:
    """Strides with those of size-1 dimensions canonicalised: a size-1 dimension is never stepped
    over, so its stride addresses nothing (``x[..., -n:].clone()`` keeps arbitrary ones)."""
    contiguous = _contiguous_strides(shape)
    return tuple(c if n == 1 else st for n, st, c in zip(shape, stride, contiguous))


def _leaf_key(x: Any) -> tuple | None:
    if isinstance(x, torch.Tensor):
        if type(x) not in _PLAIN_TENSORS or x.layout is not torch.strided:
            return None
        shape = tuple(x.shape)
        return (_T, shape, _layout_strides(shape, x.stride()), x.dtype, x.device, x.requires_grad, _memory_format(x))
    if isinstance(x, _SCALAR_TYPES):
        return (_S, type(x), x)
    if isinstance(x, TensorSpec):
        return x.key()
    return None


def _is_leaf(x: Any) -> bool:
    return isinstance(x, (torch.Tensor, TensorSpec)) or isinstance(x, _SCALAR_TYPES)


def _flatten(args: tuple, kwargs: Mapping[str, Any]) -> tuple[list[Any], tuple]:
    """Leaves of (args, kwargs) and a hashable spec: one (key, TreeSpec | None) per argument.

    Keyword arguments are flattened in sorted order, so their order at the call site is no key.
    """
    leaves: list[Any] = []
    spec: list[tuple[int | str, pytree.TreeSpec | None]] = []
    for i, a in enumerate(args):
        if _is_leaf(a):
            leaves.append(a)
            spec.append((i, None))
        else:
            sub, ts = pytree.tree_flatten(a)
            leaves.extend(sub)
            spec.append((i, ts))
    for k in sorted(kwargs):
        a = kwargs[k]
        if _is_leaf(a):
            leaves.append(a)
            spec.append((k, None))
        else:
            sub, ts = pytree.tree_flatten(a)
            leaves.extend(sub)
            spec.append((k, ts))
    return leaves, tuple(spec)


def _unflatten(leaves: Sequence[Any], spec: tuple) -> tuple[tuple, dict[str, Any]]:
    args, kwargs, i = [], {}, 0
    for key, ts in spec:
        if ts is None:
            value, i = leaves[i], i + 1
        else:
            value = pytree.tree_unflatten(list(leaves[i : i + ts.num_leaves]), ts)
            i += ts.num_leaves
        if isinstance(key, int):
            args.append(value)
        else:
            kwargs[key] = value
    return tuple(args), kwargs


def _leaf_owners(spec: tuple) -> list[int | str]:
    owners: list[int | str] = []
    for key, ts in spec:
        owners.extend([key] * (1 if ts is None else ts.num_leaves))
    return owners


def _leaf_names(spec: tuple) -> list[str]:
    names = []
    for key, ts in spec:
        base = f"args[{key}]" if isinstance(key, int) else key
        if ts is None:
            names.append(base)
            continue
        dummy = pytree.tree_unflatten(list(range(ts.num_leaves)), ts)
        names.extend(base + pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(dummy)[0])
    return names


def _context() -> tuple:
    autocast = torch.is_autocast_enabled("cuda")
    return (torch.is_grad_enabled(), torch.get_autocast_dtype("cuda") if autocast else None)


_FIELDS = (
    (MissReason.DEVICE, 4),
    (MissReason.DTYPE, 3),
    (MissReason.SHAPE, 1),
    (MissReason.MEMORY_FORMAT, 6),
    (MissReason.STRIDE, 2),
    (MissReason.REQUIRES_GRAD, 5),
)


@dataclass(frozen=True)
class Signature:
    """The exact key of one call: one key per argument leaf, the argument structure, and the
    grad/autocast context the call runs under (graphs captured under one context are never
    replayed under another; the context is not part of catalog matching)."""

    leaves: tuple[tuple, ...]
    spec: tuple
    context: tuple = (False, None)

    @classmethod
    def of(cls, *args: Any, **kwargs: Any) -> Signature:
        """Signature of a call with these arguments (tensors or `TensorSpec`s and scalars)."""
        leaves, spec = _flatten(args, kwargs)
        keys = [_leaf_key(x) for x in leaves]
        if None in keys:  # the leaves' names only for the message: building them costs more than the keys
            name, x = next((n, x) for n, x, k in zip(_leaf_names(spec), leaves, keys) if k is None)
            raise TypeError(f"{name}: cannot key on {type(x).__name__}")
        return cls(tuple(cast("list[tuple]", keys)), spec, _context())  # no None: refused above

    @property
    def catalog_key(self) -> tuple:
        return (self.leaves, self.spec)

    def names(self) -> list[str]:
        return _leaf_names(self.spec)

    def describe(self) -> str:
        parts = []
        for name, k in zip(self.names(), self.leaves):
            if k[0] == _T:
                fmt = "" if k[6] == "contiguous" else f" {k[6]} stride={k[2]}"
                grad = " requires_grad" if k[5] else ""
                parts.append(f"{name}: {str(k[3]).removeprefix('torch.')}{list(k[1])} {k[4]}{fmt}{grad}")
            else:
                parts.append(f"{name}={k[2]!r}")
        return ", ".join(parts)

    def diff(self, expected: Signature) -> tuple[MissReason, tuple[str, ...]]:
        """Why `self` (actual) is not `expected`: the first reason and every mismatch, printed
        as expected against actual."""
        if self.spec != expected.spec:
            return MissReason.STRUCTURE, (f"structure: expected {_structure(expected.spec)}, got {_structure(self.spec)}",)
        lines: list[str] = []
        reasons: list[MissReason] = []
        for name, a, e in zip(self.names(), self.leaves, expected.leaves):
            if a == e:
                continue
            if a[0] != e[0] or a[0] == _S:
                reasons.append(MissReason.SCALAR)
                lines.append(f"{name}: expected {_show(e)}, got {_show(a)}")
                continue
            for reason, i in _FIELDS:
                if a[i] != e[i]:
                    reasons.append(reason)
                    lines.append(f"{name}.{reason.value}: expected {e[i]}, got {a[i]}")
        order = [r for r, _ in _FIELDS] + [MissReason.SCALAR]
        return min(reasons, key=order.index), tuple(lines)


def _show(k: tuple) -> str:
    return f"tensor{list(k[1])}" if k[0] == _T else repr(k[2])


def _structure(spec: tuple) -> str:
    return "(" + ", ".join(f"{k}" if ts is None else f"{k}:{ts.num_leaves} leaves" for k, ts in spec) + ")"


@dataclass(frozen=True)
class ShapeClass:
    """One catalog class: a name from the catalog (e.g. "L=402"), its signature and the extents
    that produced it (e.g. (("L", 402),))."""

    name: str
    signature: Signature
    extents: tuple[tuple[str, int], ...] = ()


ReplayCatalog = Sequence[ShapeClass | Signature] | Callable[[Signature], bool | str | None]


@dataclass(frozen=True)
class Miss:
    """One refused call: the reason and what was expected against what came."""

    reason: MissReason
    detail: tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.reason.value + (": " + "; ".join(self.detail) if self.detail else "")
