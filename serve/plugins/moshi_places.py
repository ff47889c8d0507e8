"""Where a Moshi plugin's ticks run, seen from the server process: its places.

Where the ticks run: in **tick places**, each holding one copy of the weights and one batch of
``slots`` slots (an ``_Engine``). Admission is a free slot: a new stream takes the lowest free
slot of the place with the fewest open streams, and ``SlotsFull`` says so when none is left. A
place's ``SlotScheduler`` (in the server process) runs one batched call at a time, as soon as
any slot has a frame waiting and for as long as any has, each with one frame of every waiting
slot (a ``feed_frames`` of k frames rides k ticks); a slot's first tick after a new stream took
it resets that slot alone. ``feed`` does not wait for its ticks: its frames queue on the slot
behind the ones already there, and their outputs are taken by the stream's next call that needs
them, so a session's next append is waiting on its slot when the last one's frames are done (with
``feed`` waiting for its ticks, each append's request missed the tick that started while its
session got the answer and sent the next). A request says it ``follows`` when the session said so for its call
(``ModelStream.follows``: it asks for the reply's next frame as soon as this is answered), so the
next tick waits a moment for that slot instead of leaving it for the one after (a batched call
costs about the same at any fill).

* On a CPU (``processes`` >= 1, 1 by default): worker processes. A tick is bound by per-operator
  overhead in Python (thousands of small operator calls; the depformer's eight codebooks alone
  are about 40% of it), so it holds the GIL for most of its time, and a batch of B slots costs
  little more than one: at the TINY size, one call for 8 live slots took 63 ms of CPU where one
  for 1 slot took 39 ms (measured on this 2-core machine at a load average of 12, where one
  session alone takes 15 ms when the machine is idle). So one worker process ticks all the
  sessions in one batch, with one torch thread, pinned to a core of its own (``pin``), and the
  vendor's process-wide no-compile flag held for its life; the other core is the server's. A
  worker builds the same weights from the seed.
* On a GPU (``processes=1`` by default, at most 1): one worker process holds the device, the
  weights and the batch, and pins deterministic kernels (``pin_deterministic``) for its life. A
  replayed tick is a few CUDA graphs launched between the vendor's eager glue, and that glue
  competes for the interpreter with the server's event loop when both share a process: measured
  at 64 sessions on the H200, the device's span of a tick was 59.4 ms in the server process and
  51.2 ms in a worker (``bench/results/history/serve_load_moshi_full_64_ahead.json``,
  ``history/serve_load_moshi_full_64_worker.json``). A second worker would need a second copy of FULL's
  15 GB of weights. ``processes=0`` ticks on one thread of the server process instead (the thread
  sets no process-wide torch option but the vendor's no-compile flag, held while the plugin is
  open, and on a GPU deterministic kernels for the life of the process); the CPU tests use it.

"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from cadence_fx.determinism import pin_deterministic
from cadence_fx.models.moshi_checkpoint import MoshiCheckpoint
from cadence_fx.models.moshi_stream import MoshiConfig, no_compile

from ..runtime.slots import SlotScheduler
from .moshi_worker import Spoken, _Engine


class _Place(ABC):
    """Where some streams' ticks run: requests ``(op, args)`` answered one at a time, in arrival
    order, by an ``_Engine``."""

    index: int
    name: str
    streams: int  # open streams placed here
    scheduler: SlotScheduler | None = None  # its slots, once the batch size is known
    started: Future | None = None  # its batch being built (the "start" request), once the batch size is known

    def run_tick(self, frames: dict[int, np.ndarray], joins: tuple[int, ...]) -> dict[int, Spoken | None]:
        return self.call("tick", frames, joins)

    @abstractmethod
    def submit(self, op: str, *args: Any) -> Future: ...

    def call(self, op: str, *args: Any) -> Any:
        return self.submit(op, *args).result()

    @abstractmethod
    def close(self) -> None: ...


class _InProcess(_Place):
    """Ticks on one thread of the server process (a GPU's place): the engine is built there and
    every request runs there, so the thread's grad mode and the device's state stay its own."""

    def __init__(
        self,
        name: str,
        config: MoshiConfig,
        sampling: bool,
        device: str,
        checkpoint: MoshiCheckpoint | None,
    ) -> None:
        self.index, self.name, self.streams = 0, name, 0
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-ticks")
        self._flags = contextlib.ExitStack()
        self._engine = self._thread.submit(self._start, config, sampling, device, checkpoint)

    def _start(self, config: MoshiConfig, sampling: bool, device: str, checkpoint: MoshiCheckpoint | None) -> _Engine:
        torch.set_grad_enabled(False)  # this thread's mode only
        self._flags.enter_context(no_compile())  # process-wide, for as long as the plugin is open
        if device == "cuda":
            pin_deterministic()  # for the process's life: a stream is bit-exact against deterministic eager
        return _Engine(config, sampling, device, checkpoint)

    def submit(self, op: str, *args: Any) -> Future:
        return self._thread.submit(self._handle, op, args)

    def _handle(self, op: str, args: tuple) -> Any:
        return self._engine.result().handle(op, args)  # raises what building it raised

    def _close(self) -> None:
        if self._engine.done() and self._engine.exception() is None:
            self._engine.result().close()
        self._flags.close()

    def close(self) -> None:
        self._thread.submit(self._close).result()
        self._thread.shutdown(wait=True)
        # The engine goes now (a GPU's weights and batch are freed at close, not when the last
        # reference to the plugin does).
        self._engine = Future()
        self._engine.set_exception(RuntimeError(f"{self.name} is closed"))


class _Worker(_Place):
    """One worker process: requests go out one at a time (a lock), a tick's straight from the
    scheduler's thread (each thread hop in a busy server process waits for the interpreter), the
    others (start, describe) through a thread of its own.

    The process is a fresh interpreter on this one's ``sys.path`` (not a multiprocessing child, which
    would import the caller's main module again), talking over a socket pair; it exits when its
    end of the pair closes, so it never outlives the server.
    """

    def __init__(self, index: int, name: str, options: dict[str, Any]) -> None:
        self.index, self.name = index, name
        ours, theirs = socket.socketpair()
        code = (
            "import json, sys; sys.path[:] = json.loads(sys.argv[3]); "
            "from cadence_fx.serve.plugins.moshi_worker import _worker_main; _worker_main()"
        )
        self.process = subprocess.Popen(
            [sys.executable, "-c", code, json.dumps(options), str(theirs.fileno()), json.dumps(sys.path)],
            pass_fds=(theirs.fileno(),),
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        self.streams = 0  # open streams placed here
        self._lock = threading.Lock()  # one request on the connection at a time
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-{index}")

    def run_tick(self, frames: dict[int, np.ndarray], joins: tuple[int, ...]) -> dict[int, Spoken | None]:
        # "start" goes through the other thread: a tick sent straight from here could overtake it.
        # The first tick waits for the batch (and raises what building it raised).
        assert self.started is not None, f"{self.name}: ticks are scheduled only once its batch was started"
        self.started.result()
        return self._roundtrip("tick", (frames, joins))

    def submit(self, op: str, *args: Any) -> Future:
        return self._thread.submit(self._roundtrip, op, args)

    def _roundtrip(self, op: str, args: tuple) -> Any:
        with self._lock:
            self.conn.send((op, args))
            try:
                kind, value = self.conn.recv()
            except (EOFError, OSError):
                kind, value = "gone", None
        if kind == "gone":
            raise RuntimeError(
                f"{self.name} worker {self.index} (pid {self.process.pid}) is gone (exit code {self.process.poll()}) during {op}"
            )
        if kind == "error":
            raise RuntimeError(f"{self.name} worker {self.index} failed in {op}:\n{value}")
        return value

    def close(self) -> None:
        with contextlib.suppress(OSError), self._lock:
            self.conn.send(None)
        self._thread.shutdown(wait=True)
        self.conn.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
