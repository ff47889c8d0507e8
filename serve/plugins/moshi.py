"""``moshi-tiny`` (the service's embedded default), ``moshi-small`` (both on a CPU) and
``moshi-full`` (on an NVIDIA GPU).

Moshi (Mimi codec, LM and depformer) at a size of ``models/moshi_stream.py`` on a device, both
explicit (``MoshiPlugin(size=..., device=...)``; each size has its default device, ``DEVICES``):
random weights from a fixed seed, nothing downloaded, real codebook counts, delays, vocabularies
and ring capacities; or, with ``weights``, a published checkpoint of that size (``moshi-full``
with ``kyutai/moshiko-pytorch-bf16`` or ``kyutai/moshika-pytorch-bf16``: the real Moshi). TINY
is SMALL cut down for 8 sessions on 2 CPU cores (one layer per transformer, widths of 32, 8-dimensional codebook vectors, 4 SEANet filters and no residual
units; what it keeps is listed at its definition); ``bench/results/history/serve_load_moshi.json`` is
what 8 sessions of it measured. FULL is Moshi 7B as shipped (the 7.7B-parameter LM in bfloat16
and Mimi), on CUDA. Every size runs full duplex on its native clock, its sessions as the
**slots** of one batch per place (``models/moshi_slots.py``: one Mimi and one ``LMGen`` at batch
B, the four stages under ``ExactShapeReplay`` at that batch; replayed as CUDA graphs on a GPU,
eager with admission bookkeeping on a CPU).

The clock is one **tick** per 80 ms frame: 1920 samples at 24 kHz in, ``mimi.encode`` ->
``LMGen.step`` -> ``mimi.decode``, 1920 samples out; only a stream's first tick gives nothing (the
LM's acoustic delay of one frame). A place ticks all its sessions in one batched call: every
slot with a frame waiting runs it, the others are masked (``serve/runtime/slots.py``). Every
tick is the vendor's own batched streaming step at that B, so a stream's output is the slot's
row of the vendor's batched loop over the same ticks (the same frames, joins and seed), bit for
bit. It is not the vendor's batch-1 stream: the vendor samples all rows of a batch from one
generator, so with sampling on a session's draws depend on the batch (its size, the session's
row, every tick the place ran); greedy (``sampling=False``), a slot depends on its own frames
only, and its tokens measured equal to batch 1's (PCM within 2.6e-8 on a CPU: batched kernels
round differently).

How a duplex model maps onto the session's turns:

* ``feed``: one tick on the user's frame. Moshi speaks while it listens; what it says during the
  user's turn belongs to no response and is dropped (``listened`` frames), but for its last frame
  (below). While a reply is in progress (the user talks over it and no barge-in cancelled it), it
  is the reply's next frame. A turn the server VAD ends inside an append ends at its stop: the
  append's frames after the stop are fed after ``begin_response``, as the reply's next frames.
* ``begin_response``: the reply lasts as many frames as the user's turn (the frames fed since the
  last ``begin_response``), at least 1 and at most ``max_reply_frames``. A duplex model never ends
  a turn by itself; it talks for as long as its clock runs, so the plugin sets the length. The
  reply **opens with what Moshi said on the last frame its slot ticked before the reply** (as a
  rule the turn's last frame). The reply is a window onto Moshi's one stream of speech, which runs
  on the same clock as what it hears; the window starts at the frame where the turn ended (for a
  server VAD turn, inside the trailing silence that ended it), not one frame after it: the frame
  Moshi's own timeline pairs with the turn's last input frame (the vendor's codebook delays spread
  what one tick reads and samples over neighbouring frames). So the first audio waits
  only for the turn's own frames still queued on the slot, not for one more tick after them; the
  reply's next frames are queued behind that one at its first ``step``. A turn that fed nothing (a
  reply asked for on an empty turn, or after ``clear_input``) opens with a tick of its own, as
  does a stream's very first tick, which says nothing (the acoustic delay). An opening output
  already computed when the reply begins (the turn's frames all ticked) is handed out with the
  frame after it: at once, a client playing it would wait for that frame, up to two ticks away.
* ``step``: the reply's next frame, one computed by a ``feed`` if there is one, else a tick on
  80 ms of silence (the user listens while Moshi speaks); None once the reply's frames are out.
  While nothing fed brings the reply's next frames, ``step`` ticks them ahead on silence before it
  returns (``REPLY_AHEAD_FRAMES``, never past the reply's length), so they ride the slot's next
  ticks while the session hands this one out: the model's clock runs at most that many frames
  ahead of the session's, and a frame fed meanwhile comes after them.
* ``cancel``: the rest of the reply is dropped. The model keeps its state: it has said what it
  said, and the clock goes on from there.
* ``clear_input``: the cleared frames stop counting toward the turn. The model heard them as they
  arrived and keeps them: a duplex model absorbs its input tick by tick and cannot unhear it.

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

The batch samples from torch's default generator of the device; its runtime swaps the batch's
own generator states (seeded once with ``seed``) in for each tick, so nothing else in the
process moves them. Ticks run in inference mode (the same values as ``no_grad``, with less
bookkeeping per operator). The turn bookkeeping above stays with the session, so a reply frame
that a ``feed`` already computed costs ``step`` no request to its slot.

The batch size is fixed when a place builds its batch: ``reserve(sessions)``, which the server
calls at startup with its session limit, builds every place's batch at ``slots`` (the option),
or at ``ceil(sessions / places)`` without it, ahead of the first session (warmed up: certified
on a CPU, captured on a GPU; a line on stderr per place), and refuses a limit beyond the slots.
A stream opened before any ``reserve`` fixes it at ``slots`` or ``DEFAULT_SLOTS``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
from abc import ABC, abstractmethod
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from cadence_fx.determinism import pin_deterministic
from cadence_fx.memory import DeviceMemory
from cadence_fx.models.moshi_checkpoint import MoshiCheckpoint, locate
from cadence_fx.models.moshi import contract_for
from cadence_fx.models.moshi_slots import MoshiSlots, Tick, transform_slots
from cadence_fx.models.moshi_stream import (
    FULL,
    SAMPLE_RATE,
    SMALL,
    TINY,
    MoshiConfig,
    build_models,
    no_compile,
    random_pcm,
)

from ..runtime.heap import PAUSES, settle
from ..runtime.slots import SlotScheduler, SlotsFull, TickRecord
from .base import ModelPlugin, ModelStream, PluginInfo, add_counters

log = logging.getLogger(__name__)

SIZES: dict[str, MoshiConfig] = {"tiny": TINY, "small": SMALL, "full": FULL}
DEVICES: dict[str, str] = {"tiny": "cpu", "small": "cpu", "full": "cuda"}  # each size's default device
FRAME_SAMPLES = 1920  # 80 ms at 24 kHz: one tick
# How many of a reply's next frames ``step`` keeps ticking ahead on silence when nothing fed brings them.
REPLY_AHEAD_FRAMES = 2
SILENCE = np.zeros(FRAME_SAMPLES, dtype=np.float32)
WORKER_OPS = ("tick", "start", "parameters", "describe")
MAX_SLOTS = 64  # the largest batch per place: the vendor's own batch of 64 measured 110 GiB on one H200 (issue 13)
DEFAULT_SLOTS = 8  # a place's batch when a stream opens before any ``reserve``


# ---------------------------------------------------------------- in a worker process


class _Engine:
    """A place's weights (a checkpoint's, else random from the seed) and its batch of slots
    (``MoshiSlots``: Moshi's slots bindings on the one pipeline), on one device."""

    def __init__(self, config: MoshiConfig, sampling: bool, device: str, checkpoint: MoshiCheckpoint | None) -> None:
        self.config, self.sampling, self.device = config, sampling, torch.device(device)
        self.models = (
            build_models(config, self.device) if checkpoint is None else checkpoint.load(self.device, config.lm_dtype)
        )
        self.runtime: MoshiSlots | None = None
        self.start_error: str | None = None  # why the batch could not be built, for every tick after
        self.ticks = 0  # batched calls
        self.tick_seconds = 0.0  # spent ticking: this place's load
        self.tick_cpu_seconds = 0.0  # of which its thread ran on a core (less: others had it, or the GPU worked)
        # The tick's wall time in its parts: the frames made tensors; the batched call (on a GPU:
        # its launches and the vendor glue's waits); its outputs copied to the host in one copy
        # (on a GPU: the wait for the device's last stage) and split into the slots' rows.
        self.phase_seconds = {"inputs": 0.0, "call": 0.0, "outputs": 0.0}
        # On a GPU, also the device's span from the call's first launch to the end of its last
        # stage (CUDA events, read once the outputs' copy has waited past them): beyond the
        # stages' own device time, the device waited for the host inside the tick.
        if self.device.type == "cuda":
            self.phase_seconds["device"] = 0.0
        # This process's device memory (peak allocated, reserved, footprint): a worker process's
        # own, which the server process, holding no CUDA memory of its own, cannot see.
        self.memory = DeviceMemory(self.device) if self.device.type == "cuda" else None

    def handle(self, op: str, args: tuple) -> Any:
        if op == "tick":
            started, cpu = time.perf_counter(), time.thread_time()
            outs = self.tick(*args)
            self.tick_seconds += time.perf_counter() - started
            self.tick_cpu_seconds += time.thread_time() - cpu
            return outs
        if op == "start":
            return self.start(*args)
        if op == "describe":
            return self.describe()
        if op == "parameters":
            return tuple(sum(p.numel() for p in m.parameters()) for m in (self.models.mimi, self.models.lm))
        raise ValueError(f"unknown worker operation {op!r}; expected one of {', '.join(WORKER_OPS)}")

    def start(self, slots: int) -> None:
        """The batch of ``slots`` slots, built (its stages warmed up: certified on a CPU, captured
        on a GPU) and reset to a fresh streaming state, so no session's frame pays for it."""
        try:
            self.runtime, _ = transform_slots(self.models, contract_for(self.config, slots=slots),
                                              sampling=self.sampling, seed=self.config.seed)
        except Exception as error:
            self.start_error = f"{type(error).__name__}: {error}"
            raise

    def tick(self, frames: dict[int, np.ndarray], joins: tuple[int, ...]) -> dict[int, np.ndarray | None]:
        """One batched call: each live slot's 1920 output samples (None before its acoustic delay)."""
        if self.runtime is None:
            why = f"its start failed: {self.start_error}" if self.start_error else "its start never ran"
            raise RuntimeError(f"this place has no batch: {why}")
        started = time.perf_counter()
        tick = Tick({slot: torch.from_numpy(frame) for slot, frame in frames.items()}, joins)
        on_gpu = self.device.type == "cuda"
        if on_gpu:
            first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            first.record()
        called = time.perf_counter()
        out = self.runtime.tick(tick)
        returned = time.perf_counter()
        if on_gpu:
            last.record()
        pcm = out.pcm.to("cpu").numpy()  # one copy for the batch, fresh each tick: its rows are the outputs
        if on_gpu:
            self.phase_seconds["device"] += first.elapsed_time(last) / 1e3  # done: the copy waited past it
        speaking = set(out.speaking)
        outputs = {slot: pcm[slot] if slot in speaking else None for slot in frames}
        ended = time.perf_counter()
        for phase, seconds in (("inputs", called - started), ("call", returned - called), ("outputs", ended - returned)):
            self.phase_seconds[phase] += seconds
        self.ticks += 1
        return outputs

    def close(self) -> None:
        if self.runtime is not None:
            self.runtime.close()

    def describe(self) -> dict[str, Any]:
        runtime = self.runtime
        return {
            "slots": None if runtime is None else runtime.slots,
            "warm_up_ticks": 0 if runtime is None else runtime.warm_up_ticks,
            "ticks": self.ticks,
            "tick_seconds": round(self.tick_seconds, 3),
            "tick_cpu_seconds": round(self.tick_cpu_seconds, 3),
            "phase_seconds": {phase: round(seconds, 3) for phase, seconds in self.phase_seconds.items()},
            "stamps": [] if runtime is None else list(runtime.report.stamps),
            "replays": {} if runtime is None else runtime.counters(),
            "memory": None if self.memory is None else self.memory.record(),
            "gc": PAUSES.record(),
        }


def _worker_main() -> None:
    """A worker process (started by ``_Worker``): answers requests ``(op, args)`` on the
    connection at file descriptor ``argv[2]``, one at a time, until None or the server is gone."""
    options = json.loads(sys.argv[1])
    conn = Connection(int(sys.argv[2]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when its workers stop
    if options["cores"]:
        os.sched_setaffinity(0, options["cores"])
    torch.set_num_threads(options["threads"])
    torch.set_grad_enabled(False)
    config = dataclasses.replace(SIZES[options["size"]], seed=options["seed"])
    checkpoint = None if options["weights"] is None else MoshiCheckpoint.from_json(options["weights"])
    if options["device"] == "cuda":
        pin_deterministic()  # this process's: a stream is bit-exact against deterministic eager
    with no_compile():
        engine = _Engine(config, options["sampling"], options["device"], checkpoint)
        while True:
            try:
                request = conn.recv()
            except EOFError:
                return
            if request is None:
                return
            op, args = request
            try:
                answer = engine.handle(op, args)
            except Exception:
                conn.send(("error", traceback.format_exc()))
                continue
            if op == "start":
                settle()  # the weights and the batch live as long as the process: no collection walks them again
                PAUSES.watch()  # the collections while it ticks
            conn.send(("ok", answer))


# ---------------------------------------------------------------- in the server process


class _Place(ABC):
    """Where some streams' ticks run: requests ``(op, args)`` answered one at a time, in arrival
    order, by an ``_Engine``."""

    index: int
    name: str
    streams: int  # open streams placed here
    scheduler: SlotScheduler | None = None  # its slots, once the batch size is known
    started: Future | None = None  # its batch being built (the "start" request), once the batch size is known

    def run_tick(self, frames: dict[int, np.ndarray], joins: tuple[int, ...]) -> dict[int, np.ndarray | None]:
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
        self, name: str, config: MoshiConfig, sampling: bool, device: str, checkpoint: MoshiCheckpoint | None,
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
            "from cadence_fx.serve.plugins.moshi import _worker_main; _worker_main()"
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

    def run_tick(self, frames: dict[int, np.ndarray], joins: tuple[int, ...]) -> dict[int, np.ndarray | None]:
        # "start" goes through the other thread: a tick sent straight from here could overtake it.
        # The first tick waits for the batch (and raises what building it raised).
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
                f"{self.name} worker {self.index} (pid {self.process.pid}) is gone (exit code "
                f"{self.process.poll()}) during {op}"
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


class MoshiStream(ModelStream):
    """One session's conversation with Moshi: the turn bookkeeping here, the ticks in its slot
    of its place's batch. ``feed`` submits its frames and returns at once: their outputs are
    taken in order by the stream's next call that needs them (a ``step`` waits for the frames
    fed since its reply began, which are the reply's next frames), so a session's next append
    is queued on its slot before the last one's ticks are done and its slot misses no tick in
    between. A tick that failed raises from the first call that takes its outputs. A reply frame
    that a ``feed`` computed is handed out by ``step`` without a request of its own."""

    def __init__(self, plugin: MoshiPlugin, place: _Place, slot: int) -> None:
        self._plugin, self._place, self.slot = plugin, place, slot
        self._pending: deque[np.ndarray] = deque()  # reply frames computed by ``feed``
        # Frames ticking whose outputs are not taken yet: (their future, how many, the reply they
        # were fed in or ticked ahead for, else None; the reply their last output opens, else None).
        self._inflight: deque[tuple[Future, int, int | None, int | None]] = deque()
        self._heard: np.ndarray | None = None  # the slot's latest output when no reply took it: the next reply may open with it
        # How the current reply opens, until its first ``step``: with the output of a frame ticked
        # before it began, still "ticking" or "done" at its start; None: with a tick of its own.
        self._opening: str | None = None
        self._reply = 0  # which reply is current: begin_response and cancel move it on
        self._closed = False
        self.budget = 0  # reply frames still to come out of ``step``
        self.turn_frames = 0  # user frames fed since the last ``begin_response``
        self.ticks = 0
        self.listened = 0  # output frames no reply handed out: said during the user's turn, or cut off by a cancel
        self.replied = 0  # output frames returned by ``step``

    def feed(self, frame: np.ndarray) -> None:
        self.feed_frames([frame])

    def feed_frames(self, frames: list[np.ndarray]) -> None:
        """All of them in one request to the slot: one frame per tick of the batch."""
        for frame in frames:
            if frame.shape != (FRAME_SAMPLES,) or frame.dtype != np.float32:
                raise ValueError(
                    f"feed takes float32 frames of {FRAME_SAMPLES} samples, got {frame.dtype} {frame.shape}"
                )
        self._take(wait=False)
        if not frames:
            return
        future = self._place.scheduler.submit(self.slot, frames, follows=self.follows)
        self._inflight.append((future, len(frames), self._reply if self.budget else None, None))
        self.turn_frames += len(frames)
        self.ticks += len(frames)

    def clear_input(self) -> None:
        self.turn_frames = 0

    def begin_response(self) -> None:
        self._take(wait=False)
        if self.budget or self._pending:
            raise RuntimeError(f"begin_response while a reply is in progress ({self.budget} frames still to come)")
        fed, self.budget = self.turn_frames > 0, min(max(self.turn_frames, 1), self._plugin.max_reply_frames)
        self.turn_frames = 0
        self._reply += 1
        if fed:  # the reply opens with the output of the last frame its slot was given
            if self._inflight:
                future, frames, reply, _ = self._inflight[-1]
                self._inflight[-1] = (future, frames, reply, self._reply)
                if self.budget > 1:  # ``step`` asks for the reply's next frame once this one is out
                    self._place.scheduler.follow(self.slot)
                self._opening = "ticking"
            elif self._heard is not None:
                self._pending.append(self._heard)
                self._heard = None
                self._opening = "done"
        # The reply's first frame is the last of the frames its slot still has to tick, one a tick
        # (or the tick after them, when the turn fed nothing).
        self._plugin._count_reply_start(self._place.scheduler.queued(self.slot))

    def step(self) -> np.ndarray | None:
        if self.budget == 0:
            return None
        self._take(wait=False)
        if self._opening is not None:
            # The reply opens with an output of before it began: its next frames queue behind that one
            # now, not once the session has it and asks again. One computed already goes out with
            # the frame after it: at once, a client playing it would wait for that one (two ticks away).
            done, self._opening = self._opening == "done", None
            self._tick_ahead(len(self._pending) + self._coming() - 1, self.budget - 1)
            while done and len(self._pending) < min(self.budget, 2):
                self._take(wait=True, first=True)
        # Frames fed (or ticked ahead) since this reply began are its next frames: they come first.
        while not self._pending:  # a stream's first tick gives nothing: then one more
            if not self._coming():
                # The session asks for the reply's next frame at once (``follows``), unless this is the last.
                future = self._place.scheduler.submit(self.slot, [SILENCE], follows=self.follows and self.budget > 1)
                self._inflight.append((future, 1, self._reply, None))
                self.ticks += 1
                self._plugin._count(silence=1)
            self._take(wait=True, first=True)
        out = self._pending.popleft()
        self.budget -= 1
        self.replied += 1
        self._plugin._count(replied=1)
        self._tick_ahead(len(self._pending) + self._coming(), self.budget)
        return out

    def _tick_ahead(self, coming: int, budget: int) -> None:
        """The reply's next frames, ticked ahead on silence up to ``REPLY_AHEAD_FRAMES`` (never past
        its ``budget``) while ``coming`` frames already are: they ride the slot's next ticks while
        the session hands this one out, instead of waiting for it to ask for them."""
        while coming < min(budget, REPLY_AHEAD_FRAMES):
            self._inflight.append((self._place.scheduler.submit(self.slot, [SILENCE]), 1, self._reply, None))
            self.ticks += 1
            self._plugin._count(silence=1)
            coming += 1

    def cancel(self) -> None:
        self.budget = 0
        self._dropped(len(self._pending))  # computed, never handed out
        self._pending.clear()
        self._reply += 1
        self._opening = None

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.cancel()
            while self._inflight:  # the slot is released with nothing of it left in flight
                try:
                    self._take(wait=True)
                except Exception as error:  # noqa: BLE001 - the session is ending; its slot must still come back
                    log.warning("moshi slot %d: a tick of the closing stream failed: %s", self.slot, error)
            if self._heard is not None:  # no reply opens with it now
                self._heard = None
                self._dropped(1)
            self._plugin._placed_off(self._place, self.slot)

    @property
    def place(self) -> int:
        """The index of the place whose batch holds this stream's slot."""
        return self._place.index

    def _coming(self) -> int:
        """How many frames ticking now belong to the current reply (the one it opens with included)."""
        return sum(frames if reply == self._reply else int(opens == self._reply) for _, frames, reply, opens in self._inflight)

    def _take(self, *, wait: bool, first: bool = False) -> None:
        """The outputs of the frames ticking (fed, or silence for a reply), oldest first: those
        already computed (``wait`` False), all of them (``wait``), or only the oldest request's
        (``first``). Those of a frame fed or ticked for the current reply are its next frames, up to
        its budget, after the output it opens with; the others Moshi said while it was not replying:
        the latest is held (``_heard``) for the next reply to open with, and the ones before it are
        dropped."""
        listened = 0
        try:
            while self._inflight and (wait or self._inflight[0][0].done()):
                future, _, reply, opens = self._inflight.popleft()
                for out in future.result():
                    if self._heard is not None:  # a later output came: the one held opens no reply
                        self._heard = None
                        listened += 1
                    if out is None:
                        continue
                    if reply == self._reply and len(self._pending) < self.budget:
                        self._pending.append(out)
                    else:
                        self._heard = out
                if opens == self._reply and self._heard is not None:
                    self._pending.append(self._heard)
                    self._heard = None
                if first:
                    break
        finally:
            self._dropped(listened)

    def _dropped(self, frames: int) -> None:
        """``frames`` outputs no reply hands out, counted as listened here and in the plugin."""
        self.listened += frames
        self._plugin._count(listened=frames)


def _require_cuda(name: str) -> None:
    if not torch.cuda.is_available():
        why = (
            f"this torch ({torch.__version__}) is built without CUDA"
            if torch.version.cuda is None
            else f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no CUDA device"
        )
        raise RuntimeError(
            f"{name} runs on an NVIDIA GPU (device 'cuda') and there is none here: {why}, "
            "torch.cuda.is_available() is False. On a CPU, serve moshi-tiny or moshi-small."
        )


def _checkpoint_of_size(name: str, size: str, weights: str) -> MoshiCheckpoint:
    """The checkpoint at ``weights``, refused unless it is Moshi at ``size``: its sizes are fixed."""
    checkpoint = locate(weights)
    differences = checkpoint.differences(SIZES[size])
    if differences:
        fits = [other for other, config in SIZES.items() if not checkpoint.differences(config)]
        hint = (f"it is Moshi at the {fits[0].upper()} size: serve it with --model moshi-{fits[0]}" if fits
                else f"it is none of the sizes {', '.join(SIZES)}")
        raise ValueError(
            f"{name} serves Moshi at the {size.upper()} size, but checkpoint {weights!r} differs in "
            f"{len(differences)} setting{'s' if len(differences) > 1 else ''} (checkpoint value, then "
            f"{size.upper()}'s): {'; '.join(differences)}; {hint}"
        )
    return checkpoint


class MoshiPlugin(ModelPlugin):
    """Moshi at ``size`` (``tiny``, ``small`` or ``full``) on ``device`` (``cpu`` or ``cuda``;
    None: the size's own, ``DEVICES``), full duplex on 24 kHz frames of 80 ms, ticking in
    ``processes`` worker processes, or in the server process when that is 0. See the module
    docstring."""

    def __init__(
        self,
        *,
        size: str = "tiny",
        device: str | None = None,
        seed: int = 0,
        sampling: bool = True,
        max_reply_frames: int = 125,
        processes: int | None = None,
        threads: int | None = None,
        pin: bool = True,
        weights: str | None = None,
        slots: int | None = None,
        record: bool = False,
    ) -> None:
        """``seed`` draws the weights and seeds each batch's sampling; ``sampling`` False decodes
        greedily. ``weights`` is a published checkpoint instead (a directory or a hub repo id, see
        ``models/moshi_checkpoint.py``), located (downloaded if need be) here, once, and loaded by
        every place from the same files; it must be Moshi at ``size`` (a checkpoint fixes the
        size: the published Moshi 7B is ``full``), with the LM in the size's dtype. ``slots`` is
        the batch of each place (1 to ``MAX_SLOTS``): the sessions it holds at once. None sizes
        it at ``reserve(sessions)`` to ``ceil(sessions / places)``, or to ``DEFAULT_SLOTS`` when a
        stream opens first; given, ``reserve`` refuses more sessions than the places' slots hold.
        ``record`` keeps every batched tick's frames and joins (``history``), to check a run
        against the vendor's batched loop. ``processes`` defaults to 1; on a GPU it is 1 or 0 (the
        server process.
        ``threads`` is torch's intra-op thread count in each worker process (1 by default): the
        model is small enough that a tick is bound by per-operator overhead, and a second thread
        only contends for the cores the other workers and the event loop need. ``pin`` puts each
        worker process on cores of its own (``threads`` of them, from this process's CPU set) when
        there are enough for all: a worker sleeps between requests while the event loop and the
        other workers run, and one that wakes on another core finds its caches cold (8 sessions on
        2 cores measured 14.8 ms of CPU per tick pinned, 17.8 ms not). Fails before building
        anything (or downloading a checkpoint) when the device is not there.
        """
        if size not in SIZES:
            raise ValueError(f"unknown Moshi size {size!r}; expected one of {', '.join(SIZES)}")
        device = DEVICES[size] if device is None else device
        if device not in ("cpu", "cuda"):
            raise ValueError(f"unknown device {device!r} for Moshi; expected 'cpu' or 'cuda'")
        if max_reply_frames < 1:
            raise ValueError(f"max_reply_frames must be at least 1, got {max_reply_frames}")
        if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_SLOTS):
            raise ValueError(f"slots must be a batch of 1 to {MAX_SLOTS} sessions per place, got {slots!r}")
        processes = 1 if processes is None else processes
        if processes < 0:
            raise ValueError(f"processes must be 0 (ticks in the server process) or more, got {processes}")
        if device == "cuda" and processes > 1:
            raise ValueError(
                f"on cuda the ticks run in one worker process (processes=1) or in the server process "
                f"(processes=0), not in {processes} worker processes: each would need its own copy of the weights on the GPU"
            )
        if processes and threads is None:
            threads = 1
        if not processes and threads is not None:
            raise ValueError(
                "threads is the torch thread count of each worker process; with processes=0 the ticks run "
                f"in the server process, which keeps its own (got threads={threads})"
            )
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self.name = f"moshi-{size}" if device == DEVICES[size] else f"moshi-{size}-{device}"
        if device == "cuda":
            _require_cuda(self.name)
        self.size, self.device, self.seed, self.sampling = size, device, seed, sampling
        self.max_reply_frames, self.processes, self.threads = max_reply_frames, processes, threads
        self.config = dataclasses.replace(SIZES[size], seed=seed)
        self.checkpoint = None if weights is None else _checkpoint_of_size(self.name, size, weights)
        self.slots, self.record = slots, record
        self.streams = 0
        self.listened = self.replied = self.silence = 0
        self.queued_at_reply_start: list[int] = []  # [k]: replies that began with k of their slot's frames not yet done
        self._lock = threading.Lock()  # placement and counters: streams call from several threads
        self._started: list[Future] = []  # each place's batch, being built or built
        self.cores: list[list[int]] = []  # of each worker process, when pinned
        if processes:
            available = sorted(os.sched_getaffinity(0))
            if pin and processes * threads <= len(available):
                self.cores = [available[i * threads : (i + 1) * threads] for i in range(processes)]
            options = {"size": size, "device": device, "seed": seed, "sampling": sampling, "threads": threads,
                       "weights": None if self.checkpoint is None else self.checkpoint.to_json()}
            self._places: list[_Place] = [
                _Worker(i, self.name, options | {"cores": self.cores[i] if self.cores else None})
                for i in range(processes)
            ]
            where = f"in {processes} worker process{'es' if processes > 1 else ''}"
        else:
            self._places = [_InProcess(self.name, self.config, sampling, device, self.checkpoint)]
            where = "in the server process, on one thread"
        try:
            counts = [p.submit("parameters") for p in self._places]  # answered once a place has built its weights
            mimi, lm = counts[0].result()
            for other in counts[1:]:
                other.result()
        except BaseException:
            self.close()
            raise
        on = torch.cuda.get_device_name() if device == "cuda" else "CPU"
        loaded = f"random weights, seed {seed}" if self.checkpoint is None else f"weights of {self.checkpoint.source}"
        self.info = PluginInfo(
            name=self.name,
            input_rate=SAMPLE_RATE,
            output_rate=SAMPLE_RATE,
            frame_samples=FRAME_SAMPLES,
            description=(
                f"Moshi {size.upper()} (Mimi {mimi / 1e6:.1f}M + LM {lm / 1e6:.1f}M parameters, {loaded}) "
                f"on {on}, full duplex at 12.5 frames/s through the cadence-fx transform, {where}, each place's "
                "sessions ticking as the slots of one batch; a reply lasts as long as the user's turn, at most "
                f"{max_reply_frames * FRAME_SAMPLES / SAMPLE_RATE:g} s"
            ),
        )

    def open_stream(self) -> MoshiStream:
        """In a free slot of the place with the fewest open streams (the first such); no call to
        it yet. Raises ``SlotsFull`` when every slot of every place is taken."""
        with self._lock:
            self._start(DEFAULT_SLOTS if self.slots is None else self.slots)
            open_places = [p for p in self._places if p.scheduler.free]
            if not open_places:
                raise SlotsFull(f"{self.name}: all {self._capacity()} are taken; a session needs a free slot")
            place = min(open_places, key=lambda p: p.streams)
            slot = place.scheduler.acquire()
            place.streams += 1
            self.streams += 1
        return MoshiStream(self, place, slot)

    def free_slots(self) -> int:
        """Slots no stream holds, all places together (every slot before the batch is built)."""
        with self._lock:
            if not self._started:
                return len(self._places) * (DEFAULT_SLOTS if self.slots is None else self.slots)
            return sum(place.scheduler.free for place in self._places)

    def _placed_off(self, place: _Place, slot: int) -> None:
        with self._lock:
            place.scheduler.release(slot)
            place.streams -= 1

    def _count_reply_start(self, queued: int) -> None:
        with self._lock:
            self.queued_at_reply_start += [0] * (queued + 1 - len(self.queued_at_reply_start))
            self.queued_at_reply_start[queued] += 1

    def _count(self, listened: int = 0, replied: int = 0, silence: int = 0) -> None:
        with self._lock:
            self.listened += listened
            self.replied += replied
            self.silence += silence

    def _start(self, slots: int) -> None:
        """Each place's batch of ``slots`` (once, under the lock): its scheduler now, its runtime
        built by the place (queued ahead of any tick)."""
        if self._started:
            return
        self.slots = slots
        for place in self._places:
            place.started = place.submit("start", slots)
            self._started.append(place.started)
            place.scheduler = SlotScheduler(slots, place.run_tick, name=f"{self.name}[{place.index}]", record=self.record)

    def _capacity(self, slots: int | None = None) -> str:
        places, slots = len(self._places), self.slots if slots is None else slots
        return f"{places * slots} slots ({places} place{'s' if places > 1 else ''} x {slots})"

    def reserve(self, sessions: int) -> None:
        """Slots for ``sessions`` concurrent streams, each place's batch built now (a line of
        progress per place); refused when the slots, fixed by the option or by a stream opened
        earlier, hold fewer."""
        places = len(self._places)
        with self._lock:
            batch = -(-sessions // places) if self.slots is None else self.slots
            if sessions > places * batch:
                raise ValueError(
                    f"{self.name} holds {self._capacity(batch)}, not {sessions} sessions at once: give it "
                    f"slots={-(-sessions // places)} or admit at most {places * batch} sessions"
                )
            self._start(batch)
        started = time.monotonic()
        for place, future in zip(self._places, self._started):
            future.result()
            print(f"{self.name}: {self.slots} slots ready in place {place.index} ({time.monotonic() - started:.1f} s)",
                  file=sys.stderr, flush=True)

    def history(self, place: int = 0) -> list[TickRecord]:
        """Every batched tick of a place so far (with ``record=True``): its frames and joins."""
        scheduler = self._places[place].scheduler
        if scheduler is None or scheduler.history is None:
            raise ValueError(f"{self.name} keeps no history: open it with record=True (and tick it)")
        return list(scheduler.history)

    def describe(self) -> dict[str, Any]:
        """What the service runs, with the transform's stamps and the counters of all places."""
        parts = [p.submit("describe") for p in self._places]
        places = [part.result() for part in parts]
        replays: dict[str, Any] = {}
        for part in places:
            add_counters(replays, part["replays"])
        schedulers = [p.scheduler for p in self._places if p.scheduler is not None]
        return {
            "model": self.name,
            "size": self.size,
            "device": self.device,
            "weights": None if self.checkpoint is None else self.checkpoint.source,
            "seed": self.seed,
            "sampling": self.sampling,
            "processes": self.processes,
            "threads": self.threads,
            "cores_per_process": self.cores or None,
            "max_reply_frames": self.max_reply_frames,
            "streams": self.streams,
            "slots_per_process": [part["slots"] for part in places],
            "slots_taken_per_process": [s.slots - s.free for s in schedulers],
            "frames": {  # a session's frame, ticked in its slot
                "ticks": sum(s.frames for s in schedulers),
                "listened": self.listened,
                "replied": self.replied,
                # of all the ticks, those on 80 ms of silence for a reply's frame that no fed frame brought
                "silence": self.silence,
                # [k]: the replies that began while k of their slot's frames were not done yet (the
                # user's frames still queued, the running tick's included): their first frame came
                # with the k-th of those ticks (after them, for a reply to a turn that fed nothing)
                "queued_at_reply_start": list(self.queued_at_reply_start),
            },
            # Per process that ticks (the server process itself when processes is 0): its batched
            # calls (each runs the frames of every slot that had one waiting), the warm-up calls of
            # building its batch (outside any session), seconds spent ticking (its load) and of
            # them on a core.
            "batched_ticks_per_process": [part["ticks"] for part in places],
            "warm_up_ticks_per_process": [part["warm_up_ticks"] for part in places],
            "tick_seconds_per_process": [part["tick_seconds"] for part in places],
            "tick_cpu_seconds_per_process": [part["tick_cpu_seconds"] for part in places],
            # Where a place's time went, per tick part: on its ticking thread (``_Engine.tick``:
            # inputs, the batched call, outputs) and on its scheduler's thread in the server
            # (gathering the slots that come right back, the round trip to the place, answering
            # the sessions), with the slots a tick ran without for want of time to gather them.
            "tick_phase_seconds_per_process": [part["phase_seconds"] for part in places],
            "scheduler_seconds_per_process": [s.seconds.as_dict() for s in schedulers],
            "follow_misses_per_process": [s.follow_misses for s in schedulers],
            # On a GPU, each ticking process's own device memory (a worker's is not the server's).
            "memory_per_process": [part["memory"] for part in places],
            # Each ticking process's garbage collections (``serve/runtime/heap.py``): a full one holds its tick.
            "gc_per_process": [part["gc"] for part in places],
            "transform": {
                "stamps": next((part["stamps"] for part in places if part["stamps"]), []),
                "replays": replays,
            },
        }

    def close(self) -> None:
        for place in self._places:
            if place.scheduler is not None:
                place.scheduler.close()
        for place in self._places:
            place.close()


def measure(frames: int = 100, threads: int = 1, size: str = "tiny", device: str | None = None) -> dict[str, Any]:
    """Per-frame compute time of one stream, as its session sees it (the request to its place
    included): a turn of ``frames // 2`` fed frames, then its reply of as many steps. On a CPU
    the stream ticks in one worker process with ``threads`` torch threads."""
    on_cpu = (DEVICES[size] if device is None else device) == "cpu"
    where = {"processes": 1, "threads": threads} if on_cpu else {}
    plugin = MoshiPlugin(size=size, device=device, max_reply_frames=frames, **where)
    try:
        plugin.reserve(1)
        stream = plugin.open_stream()
        fed = frames // 2
        pcm = random_pcm(fed).reshape(-1).numpy()
        times = []
        for i in range(fed):
            start = time.perf_counter()
            stream.feed(pcm[i * FRAME_SAMPLES : (i + 1) * FRAME_SAMPLES])
            times.append(time.perf_counter() - start)
        stream.begin_response()
        while True:
            start = time.perf_counter()
            if stream.step() is None:
                break
            times.append(time.perf_counter() - start)
        stream.close()
    finally:
        plugin.close()
    ms = [1e3 * t for t in times]
    percentiles = statistics.quantiles(ms, n=100)
    frame_ms = 1e3 * FRAME_SAMPLES / SAMPLE_RATE
    return {
        "model": plugin.name,
        "frames": len(ms),
        "torch_threads": threads if on_cpu else None,
        "p50_ms": round(percentiles[49], 2),
        "p95_ms": round(percentiles[94], 2),
        "max_ms": round(max(ms), 2),
        "first_ms": round(ms[0], 2),
        "frame_ms": frame_ms,
        "over_frame": sum(t > frame_ms for t in ms),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="per-frame compute time of one stream of the Moshi plugin")
    parser.add_argument("--frames", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the worker process (CPU)")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: the size's own (full: cuda)")
    args = parser.parse_args()
    print(json.dumps(measure(args.frames, args.threads, args.size, args.device)))
