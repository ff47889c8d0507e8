"""Compute rule: exact-shape CUDA-graph replay with fail-closed admission (DESIGN.md section 2.4).

`ExactShapeReplay` wraps a hot callable (an nn.Module, a GraphModule, a function) together with
its catalog: the finite set of `Signature`s the contract says it will be called with. One CUDA
graph is captured per catalog class, at exact shapes (never padded), all classes of one binding
sharing one graph memory pool. Every call is admitted or refused, and a refused call runs the
stock callable eagerly and is counted under its reason:

1. signature: shapes, strides, dtypes, devices, requires_grad, memory formats, the structure of
   the arguments and every non-tensor argument must match a catalog class exactly; an argument
   the engine cannot key on (an arbitrary object, a tensor subclass, a sparse tensor) means eager;
2. address stability: arguments declared `aliased` (contract-owned regions such as the carry) are
   read and written by the graph in place, with no staging copy, so their `data_ptr` is checked on
   every call; drift drops the class's graph, records an invalidation and runs that call eagerly;
   the next call recaptures at the new address. Module parameters and buffers are checked the
   same way. Every other tensor argument is copied into a static buffer per call;
3. effects, certified once per class before capture: a probationary eager call watches the host
   RNGs and the CUDA generators and is then rewound (RNG state and every tensor it wrote), so it
   is invisible. Host-RNG readers are rejected for good (a graph would freeze the drawn values).
   Device-RNG readers are admitted: PyTorch registers the default CUDA generator with each graph
   and feeds each replay the generator's current seed and Philox offset, advancing it by the
   graph's whole increment, so a replay draws exactly what eager would have drawn from the same
   state, and the first call after capture is itself a replay.

Life of one class, in three visible phases: `eager` (not yet certified, refused, or invalidated),
`capture` (probe, warm-up on a side stream, capture; the capturing call's output already comes
from replaying the fresh graph) and `replay`.

Output rule. `output_rule="clone"` (the default) hands back clones of the graph's static outputs,
so no caller ever holds memory that a later replay overwrites. `output_rule="static"` hands back
the graph's own output tensors, valid until the next call of the same class, which overwrites them
in place (zero copies; for callers that consume an output before the next call). In both rules an
output that is a view of an aliased argument or of module state is returned as that view, as eager
would. A copied argument that the callable writes in place is written back after each replay.

Policy that decides how capture treats individual operators is injected as `CaptureHook`s (host
constants: `cadence_fx.passes.hoist`; cuts around operators that cannot be captured:
`cadence_fx.passes.piecewise`). A cut ends the current graph segment; at replay the segments are
replayed in order with the cut operator run eagerly between them on their static buffers.

Without CUDA (or for a class whose tensors are not on a CUDA device) admission, certification and
counters work the same, and every admitted call runs eagerly, counted as `no_cuda`: nothing
pretends to replay.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import gc
import logging
import warnings
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol, Sequence, Union

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from cadence_fx.determinism import RngState, StateSnapshot

__all__ = [
    "MissReason",
    "Phase",
    "TensorSpec",
    "Signature",
    "ShapeClass",
    "Miss",
    "HoistedConstant",
    "CutRecord",
    "Certificate",
    "ReplayCounters",
    "CaptureContext",
    "CaptureHook",
    "NOT_HANDLED",
    "ReplayError",
    "ExactShapeReplay",
    "current_capture",
    "HostCounters",
]

log = logging.getLogger("cadence_fx.replay")


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


class Phase(str, enum.Enum):
    EAGER = "eager"
    CAPTURE = "capture"
    REPLAY = "replay"


# ---------------------------------------------------------------------------------------------
# Signatures

_SCALAR_TYPES = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device,
                 torch.memory_format, torch.layout, enum.Enum)
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
        fmt = "contiguous" if stride == _contiguous_strides(shape) else "strided"
        return (_T, shape, stride, self.dtype, torch.device(self.device), self.requires_grad, fmt)


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


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: some permutation of `t` is contiguous, so it can be staged."""
    expected = 1
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


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
    spec = []
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
            value = pytree.tree_unflatten(list(leaves[i:i + ts.num_leaves]), ts)
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


_FIELDS = ((MissReason.DEVICE, 4), (MissReason.DTYPE, 3), (MissReason.SHAPE, 1),
           (MissReason.MEMORY_FORMAT, 6), (MissReason.STRIDE, 2), (MissReason.REQUIRES_GRAD, 5))


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
        keys = []
        for name, x in zip(_leaf_names(spec), leaves):
            k = _leaf_key(x)
            if k is None:
                raise TypeError(f"{name}: cannot key on {type(x).__name__}")
            keys.append(k)
        return cls(tuple(keys), spec, _context())

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
            return MissReason.STRUCTURE, (f"structure: expected {_structure(expected.spec)}, "
                                          f"got {_structure(self.spec)}",)
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


Catalog = Union[Sequence[Union[ShapeClass, Signature]], Callable[[Signature], Union[bool, str, None]]]


@dataclass(frozen=True)
class Miss:
    """One refused call: the reason and what was expected against what came."""

    reason: MissReason
    detail: tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.reason.value + (": " + "; ".join(self.detail) if self.detail else "")


# ---------------------------------------------------------------------------------------------
# Certificates and counters


@dataclass(frozen=True)
class HoistedConstant:
    """A host-computed, configuration-only tensor now resident on the device (passes/hoist.py)."""

    site: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str
    nbytes: int
    shared: bool = True

    def __str__(self) -> str:
        how = "shared buffer" if self.shared else "device copy per call (the callable writes it)"
        return f"{self.site}: {str(self.dtype).removeprefix('torch.')}{list(self.shape)} -> {self.device}, {how}"


@dataclass(frozen=True)
class CutRecord:
    """An operator run eagerly between captured segments (passes/piecewise.py)."""

    name: str
    reason: str
    count: int

    def __str__(self) -> str:
        return f"{self.name} x{self.count}: {self.reason}"


@dataclass(frozen=True)
class Certificate:
    """What was checked for one class before capture, and the verdict."""

    shape_class: str
    signature: Signature
    admitted: bool
    reason: str
    captured: bool = False
    segments: int = 0
    host_rng: tuple[str, ...] = ()
    device_rng_advance: tuple[int, ...] = ()
    writes: tuple[str, ...] = ()
    aliased: tuple[str, ...] = ()
    copied: tuple[str, ...] = ()
    written_back: tuple[str, ...] = ()
    host_constants: tuple[HoistedConstant, ...] = ()
    cuts: tuple[CutRecord, ...] = ()
    checks: tuple[str, ...] = ()

    @property
    def reads_device_rng(self) -> bool:
        return any(self.device_rng_advance)

    def explain(self) -> str:
        verdict = "admitted" if self.admitted else "REJECTED"
        lines = [f"class {self.shape_class}: {verdict} ({self.reason})",
                 f"  signature: {self.signature.describe()}"]
        if self.captured:
            lines.append(f"  captured: {self.segments} graph segment(s)")
        lines.append("  checked: " + ", ".join(self.checks))
        rng = ", ".join(f"+{a}" for a in self.device_rng_advance if a) or "none"
        lines.append(f"  host RNG: {', '.join(self.host_rng) or 'none'}; device RNG philox offset: {rng}")
        for title, items in (("aliased", self.aliased), ("copied", self.copied), ("writes", self.writes),
                             ("written back", self.written_back)):
            if items:
                lines.append(f"  {title}: {', '.join(items)}")
        lines += [f"  host constant {c}" for c in self.host_constants]
        lines += [f"  cut {c}" for c in self.cuts]
        return "\n".join(lines)


@dataclass
class ReplayCounters:
    """`replays` counts calls whose outputs came from graph replay, the capturing call included."""

    calls: int = 0
    captures: int = 0
    replays: int = 0
    eager: int = 0
    invalidations: int = 0
    fallbacks: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "captures": self.captures, "replays": self.replays,
                "eager": self.eager, "invalidations": self.invalidations,
                "fallbacks": dict(sorted(self.fallbacks.items()))}


class ReplayError(RuntimeError):
    """A replay could not complete and the call's effects cannot be undone."""


# ---------------------------------------------------------------------------------------------
# Capture hooks: the seam through which passes decide how capture treats single operators

NOT_HANDLED = object()


class CaptureHook(Protocol):
    """Sees every torch call made by the wrapped callable while it is probed, warmed up and
    captured (never during replay, where no Python runs). Returns a result to handle the call
    or `NOT_HANDLED` to pass it on. A hook may also define `before_capture()`, called after the
    warm-up and before the capture of each class, outside any capture."""

    def intercept(self, ctx: CaptureContext, func: Callable[..., Any], args: tuple,
                  kwargs: dict[str, Any]) -> Any: ...


class HostCounters(Protocol):
    """Host-side integers the wrapped callable advances on every call (a stream's position, a
    carry's retained extent), which a replay, running no Python, would leave behind.

    The engine rewinds them after the probe and each warm-up (as it rewinds the tensors those
    calls wrote), records per class how far the capturing call moved each one, and moves them by
    as much after every replay, exactly as an eager call of that class would."""

    def read(self) -> Sequence[int]: ...

    def write(self, values: Sequence[int]) -> None: ...


class _Rejected(Exception):
    def __init__(self, reason: MissReason, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


class _GuardFailure(Exception):
    pass


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
_CURRENT: contextvars.ContextVar[CaptureContext | None] = contextvars.ContextVar("cadence_capture", default=None)
_BUSY: contextvars.ContextVar[bool] = contextvars.ContextVar("cadence_replay_busy", default=False)


def current_capture() -> CaptureContext | None:
    """The capture context of the engine now probing or capturing, if any."""
    return _CURRENT.get()


class CaptureContext:
    """What a hook may ask of the engine during one phase ("probe", "warmup" or "capture")."""

    def __init__(self, phase: str, device: torch.device | None, recorder: _Recorder | None = None,
                 host_data: Iterable[torch.Tensor] = ()):
        self.phase = phase
        self.device = device
        self._recorder = recorder
        self._host: dict[int, weakref.ref] = {}
        self.cuts: dict[str, list] = {}
        self.constants: dict[str, HoistedConstant] = {}
        for t in host_data:
            self.mark_host_data(t)

    @property
    def capturing(self) -> bool:
        return self._recorder is not None

    def cut(self, name: str, reason: str, func: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        """Run `func` eagerly between graph segments (while capturing: end the segment, replay it,
        run `func`, stage its tensor results in static buffers, start the next segment)."""
        entry = self.cuts.setdefault(name, [reason, 0])
        entry[1] += 1
        with torch._C.DisableTorchFunction():
            if self._recorder is None:
                result = func(*args, **kwargs)
            else:
                result = self._recorder.cut(func, args, kwargs)
        for t in pytree.tree_leaves(result):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self.mark_host_data(t)
        return result

    def reject(self, reason: MissReason, detail: str) -> None:
        raise _Rejected(reason, detail)

    def add_constant(self, record: HoistedConstant) -> None:
        self.constants[record.site] = record

    def mark_host_data(self, t: torch.Tensor) -> None:
        """`t` is per-call host data (an argument, or derived from one), never a constant."""
        self._host[id(t)] = weakref.ref(t)

    @property
    def has_host_data(self) -> bool:
        return bool(self._host)

    def is_host_data(self, t: torch.Tensor) -> bool:
        ref = self._host.get(id(t))
        return ref is not None and ref() is t


class _HookMode(TorchFunctionMode):
    def __init__(self, ctx: CaptureContext, hooks: Sequence[CaptureHook]):
        super().__init__()
        self.ctx, self.hooks = ctx, hooks

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for hook in self.hooks:
            result = hook.intercept(self.ctx, func, args, kwargs)
            if result is not NOT_HANDLED:
                return result
        return func(*args, **kwargs)


# ---------------------------------------------------------------------------------------------
# Graph segments


class _GraphStep:
    __slots__ = ("graph",)

    def __init__(self, graph: torch.cuda.CUDAGraph):
        self.graph = graph

    def run(self) -> None:
        self.graph.replay()


class _CutStep:
    """An eager operator between segments. Its arguments are segment outputs (graph-pool tensors
    that each replay refreshes) or static inputs; its results are staged into `statics`, which the
    next segment reads. Non-tensor results were baked into the next segment, so they are guards."""

    def __init__(self, func, args, kwargs, statics, spec):
        self.func, self.args, self.kwargs, self.statics, self.spec = func, args, kwargs, statics, spec

    def run(self) -> None:
        leaves = pytree.tree_leaves(self.func(*self.args, **self.kwargs))
        if len(leaves) != len(self.statics):
            raise _GuardFailure(f"{self.func}: {len(leaves)} results, captured {len(self.statics)}")
        for s, r in zip(self.statics, leaves):
            if isinstance(s, torch.Tensor):
                if not isinstance(r, torch.Tensor) or r.shape != s.shape or r.dtype != s.dtype:
                    raise _GuardFailure(f"{getattr(self.func, '__name__', self.func)}: result changed shape")
                s.copy_(r)
            elif r != s:
                raise _GuardFailure(f"{getattr(self.func, '__name__', self.func)}: expected {s!r}, got {r!r}")


class _Recorder:
    def __init__(self, pool: Any):
        self.pool = pool
        self.steps: list[_GraphStep | _CutStep] = []
        self._graph: torch.cuda.CUDAGraph | None = None

    @property
    def has_guards(self) -> bool:
        return any(isinstance(s, _CutStep) and not all(isinstance(x, torch.Tensor) for x in s.statics)
                   for s in self.steps)

    def begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self.pool)
        # A host sync inside the capture then raises before it reaches CUDA, so the capture stays
        # valid and can be ended cleanly (an invalidated capture leaves the RNG in capture mode).
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")
            torch.cuda.set_sync_debug_mode("error")

    def end(self) -> None:
        torch.cuda.set_sync_debug_mode(0)
        graph, self._graph = self._graph, None
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
            graph.capture_end()
        self.steps.append(_GraphStep(graph))

    def cut(self, func, args, kwargs) -> Any:
        self.end()
        self.steps[-1].run()
        result = func(*args, **kwargs)
        leaves, spec = pytree.tree_flatten(result)
        with torch.inference_mode(False):  # replay refreshes these outside inference mode
            statics = [x.clone() if isinstance(x, torch.Tensor) else x for x in leaves]
        self.steps.append(_CutStep(func, args, kwargs, statics, spec))
        self.begin()
        return pytree.tree_unflatten(statics, spec)

    def abort(self) -> None:
        torch.cuda.set_sync_debug_mode(0)
        if self._graph is not None:
            with contextlib.suppress(Exception):
                self._graph.capture_end()
            self._graph = None
        self.steps = []


# ---------------------------------------------------------------------------------------------
# The engine


@dataclass
class _ClassState:
    shape_class: ShapeClass
    names: list[str]
    aliased: list[int]
    phase: Phase = Phase.EAGER
    certificate: Certificate | None = None
    refused: Miss | None = None
    capturable: bool = True
    invalidations: int = 0
    aliased_ptrs: list[tuple[int, int]] = field(default_factory=list)
    steps: list = field(default_factory=list)
    guarded: bool = False
    copy_in: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    write_back: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    out_leaves: list[Any] = field(default_factory=list)
    out_clone: list[bool] = field(default_factory=list)
    out_spec: Any = None
    host_advance: tuple[int, ...] = ()  # how far one call of this class moves each host counter

    def drop_graphs(self) -> None:
        self.phase = Phase.EAGER
        self.steps, self.copy_in, self.write_back, self.out_leaves, self.out_clone = [], [], [], [], []


def _shares_module_state(names: list[str], leaves: list[Any], aliased: frozenset[int],
                         buffers: list[tuple[str, torch.Tensor]]) -> list[str]:
    """Copied arguments that are views of a module buffer: staging them would feed the graph a
    snapshot while the callable updates the buffer itself (the stock Token2Wav cache is a view of
    the CFM's own cache buffer on its first chunks)."""
    storages = {b.untyped_storage().data_ptr(): n for n, b in buffers if b.untyped_storage().data_ptr()}
    return [f"{names[i]} ~ {storages[x.untyped_storage().data_ptr()]}" for i, x in enumerate(leaves)
            if isinstance(x, torch.Tensor) and i not in aliased and x.untyped_storage().data_ptr() in storages]


def _modules_of(fn: Any) -> list[torch.nn.Module]:
    if isinstance(fn, torch.nn.Module):
        return [fn]
    owner = getattr(fn, "__self__", None)
    return [owner] if isinstance(owner, torch.nn.Module) else []


class ExactShapeReplay:
    """Replays `fn` from one CUDA graph per catalog class; see the module docstring.

    Args:
        fn: the hot callable.
        catalog: the admissible classes, as `ShapeClass`es or `Signature`s (misses are then
            explained field by field), or a predicate over `Signature` returning a class name,
            True (admitted under a generated name) or a falsy value (miss: `not_in_catalog`).
        aliased: argument positions (int) or keyword names (str) of contract-owned regions: their
            tensors are passed to the graph by address and checked by `data_ptr` on every call.
        hooks: `CaptureHook`s applied while probing and capturing (in order).
        modules: modules whose parameters and buffers the callable reads; defaults to `fn` itself
            (or the module a bound method belongs to). Their buffers are rewound after the probe
            and their addresses checked on every replay.
        output_rule: "clone" or "static" (module docstring).
        host_counters: the callable's host-side counters (`HostCounters`), kept in step with
            eager across probes, warm-ups and replays.
        warmup: eager runs before capture on the side stream, the certification probe included.
        max_invalidations: after this many invalidations a class stays eager for good.
        debug: log every refused call with expected against actual.
    """

    def __init__(self, fn: Callable[..., Any], catalog: Catalog, *, name: str | None = None,
                 aliased: Sequence[int | str] = (), hooks: Sequence[CaptureHook] = (),
                 modules: Sequence[torch.nn.Module] | None = None, output_rule: str = "clone",
                 host_counters: HostCounters | None = None, warmup: int = 2, max_invalidations: int = 3,
                 check_module_state: bool = True, debug: bool = False):
        if output_rule not in ("clone", "static"):
            raise ValueError(f"output_rule must be 'clone' or 'static', not {output_rule!r}")
        if warmup < 1:
            raise ValueError("warmup must be >= 1: the first warm-up run is the certification probe")
        self.fn = fn
        self.name = name or getattr(fn, "__qualname__", type(fn).__name__)
        self.aliased = frozenset(aliased)
        self.hooks = tuple(hooks)
        self.modules = list(modules) if modules is not None else _modules_of(fn)
        self.output_rule = output_rule
        self.host_counters = host_counters
        self.warmup = warmup
        self.max_invalidations = max_invalidations
        self.check_module_state = check_module_state
        self.debug = debug
        self.counters = ReplayCounters()
        self.last_miss: Miss | None = None
        self._classes: dict[Signature, _ClassState] = {}
        self._misses: dict[Signature, Miss] = {}
        self._pool: Any = None
        self._state_tensors: list[torch.Tensor] = []
        self._state_ptrs: list[int] = []
        self._predicate: Callable[[Signature], Any] | None = None
        self._catalog: dict[tuple, ShapeClass] = {}
        if callable(catalog) and not isinstance(catalog, (list, tuple)):
            self._predicate = catalog
        else:
            for i, entry in enumerate(catalog):
                sc = entry if isinstance(entry, ShapeClass) else ShapeClass(f"class{i}", entry)
                self._catalog[sc.signature.catalog_key] = sc

    # -- public views ------------------------------------------------------------------------

    @property
    def shape_classes(self) -> tuple[ShapeClass, ...]:
        """The catalog's classes, as given; empty for a predicate catalog, whose classes are only
        named as calls arrive (their certificates then say which)."""
        return tuple(self._catalog.values())

    @property
    def certificates(self) -> dict[str, Certificate]:
        return {st.shape_class.name: st.certificate for st in self._classes.values() if st.certificate}

    def phase(self, shape_class: str) -> Phase:
        for st in self._classes.values():
            if st.shape_class.name == shape_class:
                return st.phase
        return Phase.EAGER

    def explain(self) -> str:
        c = self.counters
        lines = [f"ExactShapeReplay {self.name}: {c.calls} calls, {c.captures} captures, {c.replays} replays, "
                 f"{c.eager} eager, {c.invalidations} invalidations"]
        if c.fallbacks:
            lines.append("  eager by reason: " + ", ".join(f"{k}={v}" for k, v in sorted(c.fallbacks.items())))
        for st in self._classes.values():
            lines.append(f"  [{st.phase.value}] {st.shape_class.name}")
            if st.certificate:
                lines.append("    " + st.certificate.explain().replace("\n", "\n    "))
        if self.last_miss:
            lines.append(f"  last miss: {self.last_miss}")
        return "\n".join(lines)

    def reset(self) -> None:
        """Drop every graph and certificate (counters are kept)."""
        for st in self._classes.values():
            st.drop_graphs()
        self._classes.clear()
        self._misses.clear()

    # -- the call ----------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.counters.calls += 1
        if _BUSY.get() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            # Inside another engine's probe or capture: run plainly, the outer engine records it.
            return self._eager(Miss(MissReason.NESTED), args, kwargs)
        leaves, spec = _flatten(args, kwargs)
        keys = []
        for x in leaves:
            k = _leaf_key(x)
            if k is None:
                return self._eager(Miss(MissReason.UNKEYABLE, (f"cannot key on {type(x).__name__}",)), args, kwargs)
            keys.append(k)
        sig = Signature(tuple(keys), spec, _context())
        st = self._classes.get(sig)
        if st is None:
            st = self._admit(sig)
            if st is None:
                return self._eager(self._misses[sig], args, kwargs)
        if st.phase is Phase.REPLAY:
            drift = self._drift(st, leaves)
            if drift is None:
                return self._replay(st, leaves, args, kwargs)
            self._invalidate(st, drift)
            return self._eager(Miss(MissReason.POINTER_DRIFT, (drift,)), args, kwargs)
        if st.refused is not None:
            return self._eager(st.refused, args, kwargs)
        if st.certificate is not None and not st.capturable:
            drift = self._drift(st, leaves)
            if drift is not None:
                self._invalidate(st, drift)
                st.aliased_ptrs = [(i, leaves[i].data_ptr()) for i in st.aliased]
                return self._eager(Miss(MissReason.POINTER_DRIFT, (drift,)), args, kwargs)
            return self._eager(Miss(MissReason.NO_CUDA), args, kwargs)
        return self._certify_and_capture(st, sig, leaves, spec, args, kwargs)

    # -- admission ---------------------------------------------------------------------------

    def _admit(self, sig: Signature) -> _ClassState | None:
        if sig in self._misses:
            return None
        sc: ShapeClass | None = None
        if self._predicate is not None:
            verdict = self._predicate(sig)
            if isinstance(verdict, ShapeClass):
                sc = verdict
            elif isinstance(verdict, str):
                sc = ShapeClass(verdict, sig)
            elif verdict:
                sc = ShapeClass(f"class{len(self._classes)}", sig)
            else:
                self._remember_miss(sig, Miss(MissReason.NOT_IN_CATALOG, ("the catalog predicate refused it",)))
                return None
        else:
            sc = self._catalog.get(sig.catalog_key)
            if sc is None:
                self._remember_miss(sig, self._nearest_miss(sig))
                return None
        if any(st.shape_class.name == sc.name for st in self._classes.values()):
            sc = ShapeClass(f"{sc.name}{list(sig.context)}", sc.signature, sc.extents)
        owners = _leaf_owners(sig.spec)
        aliased = [i for i, o in enumerate(owners) if o in self.aliased and sig.leaves[i][0] == _T]
        st = _ClassState(sc, sig.names(), aliased)
        self._classes[sig] = st
        return st

    def _remember_miss(self, sig: Signature, miss: Miss) -> None:
        if len(self._misses) >= 1024:
            self._misses.clear()
        self._misses[sig] = miss

    def _nearest_miss(self, sig: Signature) -> Miss:
        best: tuple[int, MissReason, tuple[str, ...]] | None = None
        for sc in self._catalog.values():
            reason, lines = sig.diff(sc.signature)
            score = 10**6 if reason is MissReason.STRUCTURE else len(lines)
            if best is None or score < best[0]:
                best = (score, reason, (f"nearest class {sc.name}",) + lines)
        if best is None:
            return Miss(MissReason.NOT_IN_CATALOG, ("empty catalog",))
        return Miss(best[1], best[2])

    def _drift(self, st: _ClassState, leaves: list[Any]) -> str | None:
        for i, ptr in st.aliased_ptrs:
            now = leaves[i].data_ptr()
            if now != ptr:
                return f"{st.names[i]}: data_ptr expected {ptr:#x}, got {now:#x}"
        if self.check_module_state and st.phase is Phase.REPLAY:
            for t, ptr in zip(self._state_tensors, self._state_ptrs):
                if t.data_ptr() != ptr:
                    return f"module state {tuple(t.shape)}: data_ptr expected {ptr:#x}, got {t.data_ptr():#x}"
        return None

    def _invalidate(self, st: _ClassState, detail: str) -> None:
        self.counters.invalidations += 1
        st.invalidations += 1
        st.drop_graphs()
        log.info("%s: class %s invalidated: %s", self.name, st.shape_class.name, detail)
        if st.invalidations >= self.max_invalidations:
            st.refused = Miss(MissReason.POINTER_DRIFT, (f"address unstable: {st.invalidations} invalidations",))

    def _eager(self, miss: Miss, args: tuple, kwargs: dict[str, Any]) -> Any:
        self.counters.eager += 1
        self.counters.fallbacks[miss.reason.value] += 1
        self.last_miss = miss
        if self.debug and miss.reason not in (MissReason.NO_CUDA, MissReason.NESTED):
            log.warning("%s: eager (%s)", self.name, miss)
        return self.fn(*args, **kwargs)

    # -- certification and capture -----------------------------------------------------------

    @contextlib.contextmanager
    def _hooked(self, ctx: CaptureContext) -> Iterator[None]:
        token, busy = _CURRENT.set(ctx), _BUSY.set(True)
        try:
            if self.hooks:
                with _HookMode(ctx, self.hooks):
                    yield
            else:
                yield
        finally:
            _BUSY.reset(busy)
            _CURRENT.reset(token)

    def _capture_device(self, leaves: list[Any]) -> torch.device | None:
        if not torch.cuda.is_available():
            return None
        for x in leaves:
            if isinstance(x, torch.Tensor) and x.device.type == "cuda":
                return x.device
        for m in self.modules:
            for p in m.parameters():
                if p.device.type == "cuda":
                    return p.device
        return None

    def _certify_and_capture(self, st: _ClassState, sig: Signature, leaves: list[Any], spec: tuple,
                             args: tuple, kwargs: dict[str, Any]) -> Any:
        names = st.names
        device = self._capture_device(leaves)
        buffers = [(f"buffer {n}", b) for m in self.modules for n, b in m.named_buffers()]
        snapshot = StateSnapshot.of([(names[i], x) for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
                                    + buffers)
        rng = RngState.capture()
        bindings = [(mod, dict(mod._buffers)) for m in self.modules for mod in m.modules()]
        host_roots = [x for x in leaves if isinstance(x, torch.Tensor) and x.device.type == "cpu"]
        checks = ["signature", "host RNG", "device RNG", "writes", "buffer rebinding"]
        if st.aliased:
            checks.append("aliased data_ptr")
        if device is not None:
            stream = self._side_stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            stream_ctx: Any = torch.cuda.stream(stream)
        else:
            stream, stream_ctx = None, contextlib.nullcontext()
        st.phase = Phase.CAPTURE
        rejected: _Rejected | None = None
        counters = self._read_counters()
        with stream_ctx:
            probe = CaptureContext("probe", device, host_data=host_roots)
            try:
                with self._hooked(probe):
                    self.fn(*args, **kwargs)
            except _Rejected as r:
                rejected = r
            except BaseException:
                snapshot.restore()
                rng.restore()
                self._write_counters(counters)
                for mod, saved in bindings:
                    mod._buffers.update(saved)
                st.phase = Phase.EAGER
                raise
            after = RngState.capture()
            writes = snapshot.written()
            rebound = [f"{type(mod).__name__}.{n}" for mod, saved in bindings for n, b in saved.items()
                       if mod._buffers.get(n) is not b]
            for mod, saved in bindings:
                mod._buffers.update(saved)
            snapshot.restore()
            rng.restore()
            self._write_counters(counters)
        if stream is not None:
            torch.cuda.current_stream(device).wait_stream(stream)
        host_rng = rng.host_readers(after)
        copied = [names[i] for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and i not in st.aliased]
        base = dict(shape_class=st.shape_class.name, signature=sig, host_rng=host_rng,
                    device_rng_advance=rng.device_advance(after), writes=writes,
                    aliased=tuple(names[i] for i in st.aliased), copied=tuple(copied),
                    host_constants=tuple(probe.constants.values()),
                    cuts=tuple(CutRecord(n, r, c) for n, (r, c) in probe.cuts.items()), checks=tuple(checks))
        refusal: Miss | None = None
        if rejected is not None:
            refusal = Miss(rejected.reason, (rejected.detail,))
        elif host_rng:
            refusal = Miss(MissReason.HOST_RNG, (f"reads the host RNG ({', '.join(host_rng)}); "
                                                 "a graph would freeze the drawn values",))
        elif rebound:
            refusal = Miss(MissReason.STATE_REBIND, (f"rebinds buffers {rebound}; a graph cannot",))
        elif torch.is_grad_enabled() and (
                any(k[0] == _T and k[5] for k in sig.leaves)
                or any(p.requires_grad for m in self.modules for p in m.parameters())):
            refusal = Miss(MissReason.AUTOGRAD, ("grad mode with tensors that require grad: "
                                                 "graphs replay no autograd history",))
        elif shared := _shares_module_state(names, leaves, st.aliased, buffers):
            refusal = Miss(MissReason.LAYOUT, (f"{shared} share memory with module state the callable "
                                               "writes; a staged copy would go stale: declare them aliased",))
        elif device is not None:
            overlapping = [names[i] for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)
                           and i not in st.aliased and not _dense(x)]
            if overlapping:
                refusal = Miss(MissReason.LAYOUT, (f"{overlapping} overlap in memory and cannot be staged; "
                                                   "declare them aliased",))
        if refusal is not None:
            st.phase = Phase.EAGER
            st.refused = refusal
            st.certificate = Certificate(admitted=False, reason=str(refusal), **base)
            return self._eager(refusal, args, kwargs)
        st.aliased_ptrs = [(i, leaves[i].data_ptr()) for i in st.aliased]
        if device is None:
            st.phase = Phase.EAGER
            st.capturable = False
            st.certificate = Certificate(admitted=True, reason="admitted; no CUDA device: runs eager", **base)
            return self._eager(Miss(MissReason.NO_CUDA), args, kwargs)
        return self._capture(st, sig, leaves, spec, args, kwargs, device, stream, snapshot, rng, base, writes)

    def _read_counters(self) -> tuple[int, ...]:
        return () if self.host_counters is None else tuple(self.host_counters.read())

    def _write_counters(self, values: Sequence[int]) -> None:
        if self.host_counters is not None:
            self.host_counters.write(values)

    @staticmethod
    def _side_stream(device: torch.device) -> torch.cuda.Stream:
        """One side stream per device for every engine's probes, warm-ups and captures: each new
        stream costs its own cuBLAS workspace (32 MiB on an H200), held for the process's life."""
        if device not in _SIDE_STREAMS:
            _SIDE_STREAMS[device] = torch.cuda.Stream(device)
        return _SIDE_STREAMS[device]

    def _capture(self, st, sig, leaves, spec, args, kwargs, device, stream, snapshot, rng, base, writes) -> Any:
        names = st.names
        counters = self._read_counters()
        with torch.cuda.stream(stream):
            for _ in range(self.warmup - 1):
                with self._hooked(CaptureContext("warmup", device, host_data=[
                        x for x in leaves if isinstance(x, torch.Tensor) and x.device.type == "cpu"])):
                    self.fn(*args, **kwargs)
                snapshot.restore()
                rng.restore()
                self._write_counters(counters)
        torch.cuda.current_stream(device).wait_stream(stream)

        static: list[Any] = list(leaves)
        copy_in: list[tuple[int, torch.Tensor]] = []
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor) and i not in st.aliased:
                buf = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
                with torch.no_grad():
                    buf.copy_(x)
                static[i] = buf
                copy_in.append((i, buf))
        cap_args, cap_kwargs = _unflatten(static, spec)
        for hook in self.hooks:
            prepare = getattr(hook, "before_capture", None)
            if prepare is not None:
                prepare()
        host_roots = [b for _, b in copy_in if b.device.type == "cpu"]
        if self._pool is None or not any(other.steps for other in self._classes.values()):
            # A pool whose graphs are all gone cannot be reused: start a new one.
            self._pool = torch.cuda.graph_pool_handle()
        recorder = _Recorder(self._pool)
        ctx = CaptureContext("capture", device, recorder, host_data=host_roots)
        torch.cuda.synchronize(device)
        gc.collect()
        stream.wait_stream(torch.cuda.current_stream(device))
        failure: BaseException | None = None
        with torch.cuda.device(device), torch.cuda.stream(stream):
            recorder.begin()
            try:
                with self._hooked(ctx):
                    out = self.fn(*cap_args, **cap_kwargs)
                recorder.end()
            except BaseException as e:  # noqa: BLE001 - any failure to capture means eager
                recorder.abort()
                failure = e
        torch.cuda.current_stream(device).wait_stream(stream)
        if failure is not None:
            torch.cuda.synchronize(device)
            snapshot.restore()
            rng.restore()
            self._write_counters(counters)
            if isinstance(failure, _Rejected):
                refusal = Miss(failure.reason, (failure.detail,))
            else:
                first = str(failure).strip().splitlines()[0] if str(failure).strip() else ""
                refusal = Miss(MissReason.UNCAPTURABLE, (f"{type(failure).__name__}: {first}",))
            st.phase = Phase.EAGER
            st.refused = refusal
            st.certificate = Certificate(admitted=False, reason=str(refusal), **base)
            return self._eager(refusal, args, kwargs)

        # The last segment is captured but not yet run; earlier ones ran at their cuts.
        recorder.steps[-1].run()
        st.host_advance = tuple(after - before for before, after in zip(counters, self._read_counters(), strict=True))
        written = set(writes)
        st.steps = recorder.steps
        st.guarded = recorder.has_guards
        st.copy_in = copy_in
        st.write_back = [(i, buf) for i, buf in copy_in if names[i] in written]
        persistent = {leaves[i].untyped_storage().data_ptr() for i in st.aliased}
        if not self._state_tensors:
            self._state_tensors = [t for m in self.modules for t in (*m.parameters(), *m.buffers())]
            self._state_ptrs = [t.data_ptr() for t in self._state_tensors]
        persistent |= {t.untyped_storage().data_ptr() for t in self._state_tensors}
        out_leaves, st.out_spec = pytree.tree_flatten(out)
        st.out_leaves = out_leaves
        st.out_clone = [isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in persistent
                        for o in out_leaves]
        base.update(host_constants=tuple(ctx.constants.values()) or base["host_constants"],
                    cuts=tuple(CutRecord(n, r, c) for n, (r, c) in ctx.cuts.items()) or base["cuts"])
        segments = sum(isinstance(s, _GraphStep) for s in st.steps)
        reason = "admitted; captured" + ("; device RNG via graph-safe philox state"
                                         if any(base["device_rng_advance"]) else "")
        st.certificate = Certificate(admitted=True, reason=reason, captured=True, segments=segments,
                                     written_back=tuple(names[i] for i, _ in st.write_back), **base)
        st.phase = Phase.REPLAY
        self.counters.captures += 1
        self.counters.replays += 1
        for i, buf in st.write_back:
            with torch.inference_mode(leaves[i].is_inference()):
                leaves[i].copy_(buf)
        return self._outputs(st)

    # -- replay ------------------------------------------------------------------------------

    def _replay(self, st: _ClassState, leaves: list[Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        with torch.no_grad():
            for i, buf in st.copy_in:
                buf.copy_(leaves[i])
            if st.guarded:
                before = torch.cuda.get_rng_state()
            try:
                for step in st.steps:
                    step.run()
            except _GuardFailure as g:
                if st.certificate is not None and st.certificate.writes:
                    raise ReplayError(f"{self.name}: class {st.shape_class.name}: cut guard failed after "
                                      f"in-place writes: {g}") from None
                torch.cuda.set_rng_state(before)
                return self._eager(Miss(MissReason.CUT_GUARD, (str(g),)), args, kwargs)
        for i, buf in st.write_back:
            with torch.inference_mode(leaves[i].is_inference()):
                leaves[i].copy_(buf)
        if st.host_advance:
            self._write_counters([value + step for value, step in zip(self._read_counters(), st.host_advance, strict=True)])
        self.counters.replays += 1
        return self._outputs(st)

    def _outputs(self, st: _ClassState) -> Any:
        if self.output_rule == "static":
            return pytree.tree_unflatten(st.out_leaves, st.out_spec)
        outs = [o.clone() if c else o for o, c in zip(st.out_leaves, st.out_clone)]
        return pytree.tree_unflatten(outs, st.out_spec)
