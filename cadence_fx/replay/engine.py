"""The engine: `ExactShapeReplay`, the admission of every call and the life of each class in three
visible phases (eager, capture, replay); the package docstring says what each phase checks."""

from __future__ import annotations

import contextlib
import enum
import gc
import logging
import operator
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch
from torch.utils import _pytree as pytree

from cadence_fx.determinism import RngState, StateSnapshot

from .capture import (
    _BUSY,
    _CURRENT,
    CaptureContext,
    CaptureHook,
    _GraphStep,
    _GuardFailure,
    _HookMode,
    _Recorder,
    _Rejected,
)
from .certificate import Certificate, CutRecord
from .counters import ReplayCounters
from .gate import GATE
from .signature import (
    _T,
    Catalog,
    Miss,
    MissReason,
    ShapeClass,
    Signature,
    _context,
    is_dense,
    _flatten,
    _leaf_key,
    _leaf_owners,
    _unflatten,
)

log = logging.getLogger("cadence_fx.replay")


class Phase(str, enum.Enum):
    EAGER = "eager"
    CAPTURE = "capture"
    REPLAY = "replay"


class HostCounters(Protocol):
    """Host-side integers the wrapped callable advances on every call (a stream's position, a
    carry's retained extent), which a replay, running no Python, would leave behind.

    The engine rewinds them after the probe and each warm-up (as it rewinds the tensors those
    calls wrote), records per class how far the capturing call moved each one, and moves them by
    as much after every replay, exactly as an eager call of that class would."""

    def read(self) -> Sequence[int]: ...

    def write(self, values: Sequence[int]) -> None: ...


class ReplayError(RuntimeError):
    """A replay could not complete and the call's effects cannot be undone, or the engine was
    driven in a way it cannot serve (from two threads at once)."""


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


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
        pool: a CUDA graph memory pool (`torch.cuda.graph_pool_handle()`) shared with the engines
            whose graphs run on the same stream, one after another, never at the same time as these
            (the engines of one stream: a later capture then reuses the intermediates an earlier
            one freed); default: a pool of this engine's own, shared by its classes.
        write_before_read: tensors (regions) every call writes in place, only at positions it
            writes before it reads them: the probe's snapshot leaves out whatever shares their
            memory (a batch's rings would cost their size again), since the capture and the
            warm-ups write the same positions again before they read them.
        inference: run every call under `torch.no_grad()`, whatever the calling thread's grad
            mode (grad mode is per thread: a new thread starts with grad enabled, and a graph
            replays no autograd history anyway). Without it, a call in grad mode over tensors that
            require grad is refused as `autograd` (and the refusal is logged with its thread).
        debug: log every refused call with expected against actual.

    Threads: one engine serves one thread at a time (a second thread entering while the first is
    inside raises `ReplayError`); different engines may be driven from different threads at once,
    each on its own CUDA stream. Captures are serialized process-wide by the device gate
    (`cadence_fx.replay.gate`), replays are not.
    """

    def __init__(self, fn: Callable[..., Any], catalog: Catalog, *, name: str | None = None,
                 aliased: Sequence[int | str] = (), hooks: Sequence[CaptureHook] = (),
                 modules: Sequence[torch.nn.Module] | None = None, output_rule: str = "clone",
                 host_counters: HostCounters | None = None, warmup: int = 2, max_invalidations: int = 3,
                 check_module_state: bool = True, pool: Any = None, inference: bool = False,
                 write_before_read: Sequence[torch.Tensor] = (), debug: bool = False):
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
        self.inference = inference
        self._unsnapshotted = {t.untyped_storage().data_ptr() for t in write_before_read}
        self._shared_pool = pool is not None
        self._inside = threading.RLock()
        self.counters = ReplayCounters()
        self.last_miss: Miss | None = None
        self._classes: dict[Signature, _ClassState] = {}
        self._misses: dict[Signature, Miss] = {}
        self._pool: Any = pool
        self._state_places: list[tuple[dict, str, str]] = []  # ``_module_state_places``, at the first capture
        self._state_ptrs: list[int] = []
        self._state_tables: list[dict] = []  # ``_remember_state``: the places, split for C-level passes
        self._state_names: list[str] = []
        self._state_tensors: list[torch.Tensor | None] = []
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

    @property
    def memory(self) -> dict[str, dict[str, int | None]]:
        """Per captured class: staged bytes (the memory model's charge) against the graph pool's
        measured growth at its capture (`Certificate`); empty without CUDA."""
        return {name: {"staged_bytes": c.staged_bytes, "pool_reserved_bytes": c.pool_reserved_bytes,
                       "reserved_bytes": c.reserved_bytes}
                for name, c in self.certificates.items() if c.pool_reserved_bytes is not None}

    @property
    def module_state(self) -> tuple[torch.Tensor, ...]:
        """The parameters and buffers of `modules` (`_module_state_places`), each tensor once: the
        tensors whose addresses every replay checks. The graphs of a binding's classes share the
        model's tensors, so the check does not grow with the number of classes."""
        return tuple({id(t): t for t in (table[name] for table, name, _ in self._module_state_places())}.values())

    def _module_state_places(self) -> list[tuple[dict, str, str]]:
        """Where `modules` hold their parameters and buffers: (the owning module's ``_parameters``
        or ``_buffers``, the name in it, the qualified name), each place once. A replay reads each
        place again, so a tensor that a module rebinds (``module.buf = torch.zeros(...)``) is
        drift as much as one whose storage was swapped (``.data =``)."""
        places: dict[tuple[int, str], tuple[dict, str, str]] = {}
        for root in self.modules:
            for prefix, module in root.named_modules(remove_duplicate=False):
                for table in (module._parameters, module._buffers):
                    for name, tensor in table.items():
                        if tensor is not None:
                            places.setdefault((id(table), name), (table, name, f"{prefix}.{name}" if prefix else name))
        return list(places.values())

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
        if not self._inside.acquire(blocking=False):
            raise ReplayError(f"{self.name}: called from thread {threading.current_thread().name!r} while another "
                              "thread is inside it: one engine serves one thread at a time (its static buffers "
                              "and graphs are one stream's); give each thread its own engine")
        try:
            with GATE.shared(), (torch.no_grad() if self.inference else contextlib.nullcontext()):
                return self._call(args, kwargs)
        finally:
            self._inside.release()

    def _call(self, args: tuple, kwargs: dict[str, Any]) -> Any:
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
        with GATE.exclusive():
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
        # Every module tensor, every replayed call, at the address it had at the capture (C-level
        # passes in `_state_unmoved`; the loop below only to name the first that moved).
        if self.check_module_state and st.phase is Phase.REPLAY and not self._state_unmoved():
            for (table, name, qualified), ptr, now in zip(self._state_places, self._state_ptrs, self._state_now()):
                if now != ptr:
                    held = table.get(name)
                    what = "no tensor" if held is None else f"{tuple(held.shape)}"
                    return f"module state {qualified} {what}: data_ptr expected {ptr:#x}, got {now:#x}"
        return None

    def _state_now(self) -> list[int]:
        """The address each place of the module state holds now (0 where it holds no tensor)."""
        return [0 if (t := table.get(name)) is None else t.data_ptr() for table, name, _ in self._state_places]

    def _remember_state(self) -> None:
        """The module state every replay checks: where it is, the tensors there and their addresses."""
        self._state_places = self._module_state_places()
        self._state_ptrs = self._state_now()
        self._state_tables = [table for table, _, _ in self._state_places]
        self._state_names = [name for _, name, _ in self._state_places]
        self._state_tensors = list(map(dict.get, self._state_tables, self._state_names))

    def _state_unmoved(self) -> bool:
        """Every place of the module state holds a tensor at the address it held at the first
        capture. It runs on every replayed call over every parameter of the model, so in C-level
        passes over the tensor objects last seen there. A place that holds another object now (a
        module that rebinds a buffer) is decided by its address, as the check always was (a tensor
        rebound at the same address, with other strides, is not caught), and the new objects are
        remembered so the next call takes the C-level passes again."""
        now = list(map(dict.get, self._state_tables, self._state_names))
        if all(map(operator.is_, now, self._state_tensors)):
            return list(map(torch.Tensor.data_ptr, now)) == self._state_ptrs
        if self._state_now() != self._state_ptrs:
            return False
        self._state_tensors = now
        return True

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
        snapshot = StateSnapshot.of([(n, x) for n, x in [*((names[i], x) for i, x in enumerate(leaves)
                                                            if isinstance(x, torch.Tensor)), *buffers]
                                     if x.untyped_storage().data_ptr() not in self._unsnapshotted])
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
                    thread=threading.current_thread().name,
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
            refusal = Miss(MissReason.AUTOGRAD, (
                f"grad mode with tensors that require grad on thread {threading.current_thread().name!r}: "
                "graphs replay no autograd history (grad mode is per thread: call it under torch.no_grad() "
                "there, or build the engine with inference=True)",))
        elif shared := _shares_module_state(names, leaves, st.aliased, buffers):
            refusal = Miss(MissReason.LAYOUT, (f"{shared} share memory with module state the callable "
                                               "writes; a staged copy would go stale: declare them aliased",))
        elif sparse := [f"{names[i]} {tuple(x.shape)} strides {x.stride()}" for i, x in enumerate(leaves)
                        if isinstance(x, torch.Tensor) and i not in st.aliased and not is_dense(x)]:
            refusal = Miss(MissReason.LAYOUT, tuple(
                f"{arg} is not dense (its strides leave gaps or repeat elements): the engine stages only dense "
                "tensors; declare it aliased or pass a dense tensor" for arg in sparse))
        if refusal is not None:
            return self._refuse(st, refusal, base, args, kwargs)
        st.aliased_ptrs = [(i, leaves[i].data_ptr()) for i in st.aliased]
        if device is None:
            st.phase = Phase.EAGER
            st.capturable = False
            st.certificate = Certificate(admitted=True, reason="admitted; no CUDA device: runs eager", **base)
            return self._eager(Miss(MissReason.NO_CUDA), args, kwargs)
        return self._capture(st, sig, leaves, spec, args, kwargs, device, stream, snapshot, rng, base, writes)

    def _refuse(self, st: _ClassState, refusal: Miss, base: dict[str, Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        """A class refused for good: certified as such, logged once (with the thread it was met on:
        a refusal in a worker thread must not pass unseen), and this call runs eagerly."""
        st.phase = Phase.EAGER
        st.refused = refusal
        st.certificate = Certificate(admitted=False, reason=str(refusal), **base)
        log.warning("%s: class %s refused on thread %r: %s", self.name, st.shape_class.name, base["thread"], refusal)
        return self._eager(refusal, args, kwargs)

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

        reserved_before = torch.cuda.memory_reserved(device)
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
        if self._pool is None or not (self._shared_pool or any(other.steps for other in self._classes.values())):
            # A pool of this engine's own whose graphs are all gone cannot be reused: start a new one.
            self._pool = torch.cuda.graph_pool_handle()
        staged_bytes = sum(b.numel() * b.element_size() for _, b in copy_in if b.device.type == "cuda")
        recorder = _Recorder(self._pool)
        ctx = CaptureContext("capture", device, recorder, host_data=host_roots)
        torch.cuda.synchronize(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        pool_before = torch.cuda.memory_reserved(device)
        failure: BaseException | None = None
        # No collection may run inside a capture (a finaliser's CUDA call would break it), so the
        # collector is off while capturing, rather than a full gc.collect() before every capture:
        # with many graphs alive, that cost about 0.5 s a class.
        collecting = gc.isenabled()
        gc.disable()
        with torch.cuda.device(device), torch.cuda.stream(stream):
            recorder.begin()
            try:
                with self._hooked(ctx):
                    out = self.fn(*cap_args, **cap_kwargs)
                recorder.end()
            except BaseException as e:  # noqa: BLE001 - any failure to capture means eager
                recorder.abort()
                failure = e
            finally:
                if collecting:
                    gc.enable()
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
            return self._refuse(st, refusal, base, args, kwargs)

        # The last segment is captured but not yet run; earlier ones ran at their cuts.
        recorder.steps[-1].run()
        torch.cuda.synchronize(device)
        reserved_after = torch.cuda.memory_reserved(device)
        st.host_advance = tuple(after - before for before, after in zip(counters, self._read_counters(), strict=True))
        written = set(writes)
        st.steps = recorder.steps
        st.guarded = recorder.has_guards
        st.copy_in = copy_in
        st.write_back = [(i, buf) for i, buf in copy_in if names[i] in written]
        persistent = {leaves[i].untyped_storage().data_ptr() for i in st.aliased}
        if not self._state_places:
            self._remember_state()
        persistent |= {t.untyped_storage().data_ptr() for t in self.module_state}
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
                                     written_back=tuple(names[i] for i, _ in st.write_back),
                                     staged_bytes=staged_bytes, pool_reserved_bytes=reserved_after - pool_before,
                                     reserved_bytes=reserved_after - reserved_before, **base)
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
