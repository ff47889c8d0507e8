"""Replay lanes: several streams' calls at the same time on one GPU, each stream still exact.

One chunk of a launch-bound model replayed from graphs leaves most of a large GPU idle, and N
streams time-multiplexed over one set of graphs take N times as long as one. A `Lane` is one host
thread with one CUDA stream: give each lane its own transformed model (its own graphs, graph pool
and carries) and its own sessions, and the lanes' chunks run concurrently, each lane's graphs on
its own stream. Inside a lane, sessions take turns over the lane's graphs as before
(`Transformed.swap_in` / `swap_out`), so a session's result does not depend on which lane or
which other sessions ran beside it.

Build each lane's transformed model on the lane's own thread (`lane.submit(transform, ...)`). On
the H200 two Token2Wav lanes whose graphs were all captured on one thread hung when both replayed
at once (a kernel that never ended; an illegal memory access in a variant), and replied bit for
bit once each lane captured its own (`tests/serve/test_token2wav_gpu.py`). The likely reason, not
measured: torch gives each thread its own cuBLAS handle and workspace, and a graph keeps the
workspace of the thread that captured it, so graphs captured on one thread share one workspace.

What a thread does not inherit is set by the lane itself: its grad mode is the one of the thread
that made the lane (a new thread starts with grad enabled, and an engine would then refuse every
class that has parameters requiring grad as `autograd`), and its current stream is its own. The
device gate (`cadence_fx.replay.gate`) is held shared for the whole of each task, so a capture in
another lane never meets this lane's syncs or allocations halfway.

The process has one default CUDA generator, and a graph that draws from it reads the generator's
(seed, offset) when it is replayed and writes them into buffers shared by every graph that
registered the generator. Two lanes replaying such graphs at the same time would race on those
buffers and on the order of their draws. So every call that draws device RNG goes through one
`RngSection`: one at a time, on the section's own stream, from the calling session's own
generator state, which the section saves back after the call. A session then draws exactly what
it draws when it runs alone.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .multiplex import SessionState, rng_get, rng_set
from .replay.gate import GATE

__all__ = ["Lane", "RngSection"]


class Lane:
    """One host thread and one CUDA stream (module docstring). Tasks run in submission order."""

    def __init__(self, name: str, device: torch.device | str):
        self.name = name
        self.device = torch.device(device)
        self.grad_enabled = torch.is_grad_enabled()
        cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=name, initializer=self._enter)

    def _enter(self) -> None:
        torch.set_grad_enabled(self.grad_enabled)

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """Run `fn(*args, **kwargs)` on the lane's thread and stream; the future's result is
        ready on the device too (the lane synchronises its stream before the task ends)."""
        return self._executor.submit(self._run, fn, args, kwargs)

    def _run(self, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        stream_ctx = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with GATE.shared(), stream_ctx:
            out = fn(*args, **kwargs)
            if self.stream is not None:
                self.stream.synchronize()
        return out

    def close(self) -> None:
        self._executor.shutdown(wait=True)


class RngSection:
    """Calls that draw device RNG, from any lane: one at a time, on one stream, each from its
    session's own generator state (module docstring)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self._lock = threading.Lock()
        self.calls = 0

    def call(self, state: SessionState, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` drawing from `state.rng`, which then holds the advanced state."""
        with GATE.step_aside():  # the holder may be capturing: it must not wait for this thread
            self._lock.acquire()
        try:
            return self._call(state, fn, args, kwargs)
        finally:
            self._lock.release()

    def _call(self, state: SessionState, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        self.calls += 1
        if self.stream is None:
            rng_set(self.device, state.rng)
            out = fn(*args, **kwargs)
            state.rng = rng_get(self.device)
            return out
        caller = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(caller)
        with torch.cuda.stream(self.stream):
            rng_set(self.device, state.rng)
            out = fn(*args, **kwargs)
            state.rng = rng_get(self.device)
        caller.wait_stream(self.stream)
        # The outputs were allocated on the section's stream and are used on the caller's: the
        # allocator must not hand their memory to the section again before the caller is done.
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.record_stream(caller)
        return out
