"""Capture: the seam through which passes decide how capture treats single operators
(`CaptureHook`, `CaptureContext`), and the graph segments a capture records (one CUDA graph per
segment, the operators cut between them run eagerly)."""

from __future__ import annotations

import contextlib
import contextvars
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from .certificate import HoistedConstant
from .signature import MissReason

NOT_HANDLED = object()


class CaptureHook(Protocol):
    """Sees every torch call made by the wrapped callable while it is probed, warmed up and
    captured (never during replay, where no Python runs). Returns a result to handle the call
    or `NOT_HANDLED` to pass it on. A hook may also define `before_capture()`, called after the
    warm-up and before the capture of each class, outside any capture."""

    def intercept(self, ctx: CaptureContext, func: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any: ...


class _Rejected(Exception):
    def __init__(self, reason: MissReason, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


class _GuardFailure(Exception):
    pass


_CURRENT: contextvars.ContextVar[CaptureContext | None] = contextvars.ContextVar("cadence_capture", default=None)
_BUSY: contextvars.ContextVar[bool] = contextvars.ContextVar("cadence_replay_busy", default=False)


def current_capture() -> CaptureContext | None:
    """The capture context of the engine now probing or capturing, if any."""
    return _CURRENT.get()


class CaptureContext:
    """What a hook may ask of the engine during one phase ("probe", "warmup" or "capture")."""

    def __init__(
        self, phase: str, device: torch.device | None, recorder: _Recorder | None = None, host_data: Iterable[torch.Tensor] = ()
    ):
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
        return any(isinstance(s, _CutStep) and not all(isinstance(x, torch.Tensor) for x in s.statics) for s in self.steps)

    def begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        # thread_local: other threads' CUDA calls (replays and eager work of other engines on their
        # own streams) neither fail nor invalidate this capture; only this thread's would.
        self._graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        # A host sync inside the capture then raises before it reaches CUDA, so the capture stays
        # valid and can be ended cleanly (an invalidated capture leaves the RNG in capture mode).
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")
            torch.cuda.set_sync_debug_mode("error")

    def end(self) -> None:
        torch.cuda.set_sync_debug_mode(0)
        graph, self._graph = self._graph, None
        if graph is None:
            raise RuntimeError("capture end without a capture begun: `begin` starts every graph segment")
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
