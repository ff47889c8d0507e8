"""The engine: `ExactShapeReplay`, the admission of every call and the life of each class in three
visible phases (eager, capture, replay); the package docstring says what each phase checks. The
dispatcher (`dispatch.py`) maps a call to its class, the runner (`runner.py`) certifies, captures
and replays it, and `module_state.py` checks the module tensors a graph reads by address."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from .capture import (
    _BUSY,
    CaptureHook,
)
from .certificate import Certificate
from .counters import ReplayCounters
from .dispatch import ClassState, Dispatcher, Phase
from .gate import GATE
from .module_state import ModuleState
from .runner import ReplayError, certify_and_capture, replay
from .signature import (
    Miss,
    MissReason,
    ReplayCatalog,
    ShapeClass,
    Signature,
    _context,
    _flatten,
    _leaf_key,
)

log = logging.getLogger("cadence_fx.replay")


class HostCounters(Protocol):
    """Host-side integers the wrapped callable advances on every call (a stream's position, a
    carry's retained extent), which a replay, running no Python, would leave behind.

    The engine rewinds them after the probe and each warm-up (as it rewinds the tensors those
    calls wrote), records per class how far the capturing call moved each one, and moves them by
    as much after every replay, exactly as an eager call of that class would."""

    def read(self) -> Sequence[int]: ...

    def write(self, values: Sequence[int]) -> None: ...


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

    def __init__(
        self,
        fn: Callable[..., Any],
        catalog: ReplayCatalog,
        *,
        name: str | None = None,
        aliased: Sequence[int | str] = (),
        hooks: Sequence[CaptureHook] = (),
        modules: Sequence[torch.nn.Module] | None = None,
        output_rule: str = "clone",
        host_counters: HostCounters | None = None,
        warmup: int = 2,
        max_invalidations: int = 3,
        check_module_state: bool = True,
        pool: Any = None,
        inference: bool = False,
        write_before_read: Sequence[torch.Tensor] = (),
        debug: bool = False,
    ):
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
        self._pool: Any = pool
        self.dispatcher = Dispatcher(catalog, self.aliased)
        self.state_check = ModuleState(self.modules)

    @property
    def shape_classes(self) -> tuple[ShapeClass, ...]:
        """The catalog's classes, as given; empty for a predicate catalog, whose classes are only
        named as calls arrive (their certificates then say which)."""
        return tuple(self.dispatcher.catalog.values())

    @property
    def certificates(self) -> dict[str, Certificate]:
        return {st.shape_class.name: st.certificate for st in self.dispatcher.classes.values() if st.certificate}

    @property
    def memory(self) -> dict[str, dict[str, int | None]]:
        """Per captured class: staged bytes (the memory model's charge) against the graph pool's
        measured growth at its capture (`Certificate`); empty without CUDA."""
        return {
            name: {
                "staged_bytes": c.staged_bytes,
                "pool_reserved_bytes": c.pool_reserved_bytes,
                "reserved_bytes": c.reserved_bytes,
            }
            for name, c in self.certificates.items()
            if c.pool_reserved_bytes is not None
        }

    @property
    def module_state(self) -> tuple[torch.Tensor, ...]:
        """The parameters and buffers of `modules` (`ModuleState.find`), each tensor once: the
        tensors whose addresses every replay checks. The graphs of a binding's classes share the
        model's tensors, so the check does not grow with the number of classes."""
        return tuple({id(t): t for t in (table[name] for table, name, _ in self.state_check.find())}.values())

    def phase(self, shape_class: str) -> Phase:
        for st in self.dispatcher.classes.values():
            if st.shape_class.name == shape_class:
                return st.phase
        return Phase.EAGER

    def explain(self) -> str:
        c = self.counters
        lines = [
            f"ExactShapeReplay {self.name}: {c.calls} calls, {c.captures} captures, {c.replays} replays, "
            f"{c.eager} eager, {c.invalidations} invalidations"
        ]
        if c.fallbacks:
            lines.append("  eager by reason: " + ", ".join(f"{k}={v}" for k, v in sorted(c.fallbacks.items())))
        for st in self.dispatcher.classes.values():
            lines.append(f"  [{st.phase.value}] {st.shape_class.name}")
            if st.certificate:
                lines.append("    " + st.certificate.explain().replace("\n", "\n    "))
        if self.last_miss:
            lines.append(f"  last miss: {self.last_miss}")
        return "\n".join(lines)

    def reset(self) -> None:
        """Drop every graph and certificate (counters are kept)."""
        self.dispatcher.reset()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self._inside.acquire(blocking=False):
            raise ReplayError(
                f"{self.name}: called from thread {threading.current_thread().name!r} while another "
                "thread is inside it: one engine serves one thread at a time (its static buffers "
                "and graphs are one stream's); give each thread its own engine"
            )
        try:
            with GATE.shared(), torch.no_grad() if self.inference else contextlib.nullcontext():
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
        st = self.dispatcher.admit(sig)
        if st is None:
            return self._eager(self.dispatcher.misses[sig], args, kwargs)
        if st.phase is Phase.REPLAY:
            drift = self._drift(st, leaves)
            if drift is None:
                return replay(self, st, leaves, args, kwargs)
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
            return certify_and_capture(self, st, sig, leaves, spec, args, kwargs)

    def _drift(self, st: ClassState, leaves: list[Any]) -> str | None:
        for i, ptr in st.aliased_ptrs:
            now = leaves[i].data_ptr()
            if now != ptr:
                return f"{st.names[i]}: data_ptr expected {ptr:#x}, got {now:#x}"
        # Every module tensor, every replayed call, at the address it had at the capture.
        if self.check_module_state and st.phase is Phase.REPLAY:
            return self.state_check.first_moved()
        return None

    def _invalidate(self, st: ClassState, detail: str) -> None:
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

    def _read_counters(self) -> tuple[int, ...]:
        return () if self.host_counters is None else tuple(self.host_counters.read())

    def _write_counters(self, values: Sequence[int]) -> None:
        if self.host_counters is not None:
            self.host_counters.write(values)
