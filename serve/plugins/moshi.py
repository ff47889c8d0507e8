"""``moshi-tiny`` (the service's embedded default), ``moshi-small`` (both on a CPU) and
``moshi-full`` (on an NVIDIA GPU).

Moshi (Mimi codec, LM and depformer) at a size of ``models/moshi_stream.py`` on a device, both
explicit (``MoshiPlugin(size=..., device=...)``; each size has its default device, ``DEVICES``):
random weights from a fixed seed, nothing downloaded, real codebook counts, delays, vocabularies
and ring capacities; or, with ``weights``, a published checkpoint of that size (``moshi-full``
with ``kyutai/moshiko-pytorch-bf16`` or ``kyutai/moshika-pytorch-bf16``: the real Moshi). TINY
is SMALL cut down for 8 sessions on 2 CPU cores (one layer per transformer, widths of 32, 8-dimensional codebook vectors, 4 SEANet filters and no residual
units; what it keeps is listed at its definition); ``bench/results/serve_load_moshi.json`` is
what 8 sessions of it measured. FULL is Moshi 7B as shipped (the 7.7B-parameter LM in bfloat16
and Mimi), on CUDA. Every size runs full duplex on its native clock through the cadence-fx
transform of the Moshi family (``transform(models, contract_for(config))``: the four stages
under ``ExactShapeReplay``; replayed as CUDA graphs on a GPU, eager with admission bookkeeping on
a CPU).

The clock is one **tick** per 80 ms frame: 1920 samples at 24 kHz in, ``mimi.encode`` ->
``LMGen.step`` -> ``mimi.decode``, 1920 samples out; only a stream's first tick gives nothing (the
LM's acoustic delay of one frame). Every tick is the vendor's own streaming step, so a stream's
output is the stock vendor stream of the same input ticks and seed, bit for bit.

How a duplex model maps onto the session's turns:

* ``feed``: one tick on the user's frame. Moshi speaks while it listens; what it says during the
  user's turn belongs to no response and is dropped (``listened`` frames). While a reply is in
  progress (the user talks over it and no barge-in cancelled it), it is the reply's next frame.
* ``begin_response``: the reply lasts as many frames as the user's turn (the frames fed since the
  last ``begin_response``), at least 1 and at most ``max_reply_frames``. A duplex model never ends
  a turn by itself; it talks for as long as its clock runs, so the plugin sets the length.
* ``step``: the reply's next frame, one computed by a ``feed`` if there is one, else a tick on
  80 ms of silence (the user listens while Moshi speaks); None once the reply's frames are out.
* ``cancel``: the rest of the reply is dropped. The model keeps its state: it has said what it
  said, and the clock goes on from there.
* ``clear_input``: the cleared frames stop counting toward the turn. The model heard them as they
  arrived and keeps them: a duplex model absorbs its input tick by tick and cannot unhear it.

Where the ticks run: in **tick places**, each holding one copy of the weights (an ``_Engine``)
and running its streams' ticks one request at a time in arrival order (a ``feed_frames`` is one
request for all its frames); each new stream goes to the place with the fewest open streams.

* On a CPU (``processes`` >= 1, 2 by default): worker processes. A tick is bound by per-operator
  overhead in Python (thousands of small operator calls; the depformer's eight codebooks alone
  are about 40% of it), so it holds the GIL for most of its time: two threads running the stock
  SMALL loop on two streams measured 25.9 frames/s in all, one thread 22.5. So the plugin ticks
  in worker processes, one per core of the machine the default is sized for, each with one torch
  thread, pinned to a core of its own (``pin``), and the vendor's process-wide no-compile flag
  held for its life; a worker builds the same weights from the seed.
* On a GPU (``processes=0``, the only choice there): one thread of the server process, which
  holds the device. Worker processes would each need their own copy of FULL's 15 GB of weights
  and a CUDA context, and a single-threaded worker buys nothing when the work is on the device: a
  replayed tick launches a few CUDA graphs, and torch lets go of the GIL while it waits for the
  device, so the event loop stays responsive. The thread sets no process-wide torch option but
  the vendor's no-compile flag (held while the plugin is open) and, on a GPU, deterministic
  kernels (``pin_deterministic``, for the life of the process). A CPU plugin can tick there too
  (``processes=0``), which the CPU tests use.

The vendor samples from torch's default generator of the device, so each stream swaps its own
generator states (the host's and, on a GPU, the device's) in for its ticks: one session's audio
does not depend on the others'. Ticks run in inference mode (the same values as ``no_grad``,
with less bookkeeping per operator). The turn bookkeeping above stays with the session, so a
reply frame that a ``feed`` already computed costs ``step`` no request to its place.

Sessions on a place share its weights. Each stream leases a **replica** (the modules
deep-copied with every parameter and buffer shared, then transformed: its own streaming state,
rings included, about 1.6 GB at FULL size) from its place's pool and gives it back when it
closes; the next session on it starts from the base state, which ``TransformedMoshi.session``
writes in place. ``reserve(sessions)``, which the server calls at startup with its session
limit, builds ``ceil(sessions / places)`` replicas per place ahead of time (the places in
parallel, a line on stderr per replica; on a GPU, building a replica captures its graphs):
least-loaded placement never puts more streams than that on one place, so no session waits for
a replica. A stream that finds its place's pool empty (no ``reserve``) builds one on the spot,
counted as ``replicas_on_demand`` in ``describe()``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import itertools
import json
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
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from cadence_fx import transform
from cadence_fx.determinism import pin_deterministic
from cadence_fx.models.moshi_checkpoint import MoshiCheckpoint, locate
from cadence_fx.models.moshi_replay import TransformedMoshi, contract_for
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

from .base import ModelPlugin, ModelStream, PluginInfo

SIZES: dict[str, MoshiConfig] = {"tiny": TINY, "small": SMALL, "full": FULL}
DEVICES: dict[str, str] = {"tiny": "cpu", "small": "cpu", "full": "cuda"}  # each size's default device
FRAME_SAMPLES = 1920  # 80 ms at 24 kHz: one tick
SILENCE = np.zeros(FRAME_SAMPLES, dtype=np.float32)
WARM_UP_TICKS = 2
WORKER_OPS = ("tick", "close", "parameters", "reserve", "describe")


# ---------------------------------------------------------------- in a worker process


class _Ticker:
    """One stream's clock on its place: its replica's open session and its generator states."""

    def __init__(self, engine: _Engine) -> None:
        self._engine = engine
        self._replica = engine.lease()
        self._stack = contextlib.ExitStack()
        session = self._replica.session(sampling=engine.sampling, seed=engine.config.seed)
        self._tick_fn = self._stack.enter_context(session)
        self._rng = engine.generators()  # the session seeded the default generators: this stream's draws

    def tick(self, frames: list[np.ndarray]) -> list[np.ndarray | None]:
        """One tick per frame, in order: each tick's 1920 output samples (None on a stream's first)."""
        outs = []
        device = self._engine.device
        self._engine.set_generators(self._rng)
        with torch.inference_mode():
            for frame in frames:
                _, pcm = self._tick_fn(torch.from_numpy(frame).view(1, 1, FRAME_SAMPLES).to(device))
                # A replayed output is a static buffer: copied out.
                outs.append(None if pcm is None else pcm.reshape(-1).to("cpu", copy=True).numpy())
        self._rng = self._engine.generators()
        self._engine.ticks += len(frames)
        return outs

    def close(self) -> None:
        self._stack.close()
        self._engine.give_back(self._replica)


class _Engine:
    """A place's weights (a checkpoint's, else random from the seed), replica pool and streams'
    clocks, on one device."""

    def __init__(self, config: MoshiConfig, sampling: bool, device: str, checkpoint: MoshiCheckpoint | None) -> None:
        self.config, self.sampling, self.device = config, sampling, torch.device(device)
        self.models = (
            build_models(config, self.device) if checkpoint is None else checkpoint.load(self.device, config.lm_dtype)
        )
        self.replicas: list[TransformedMoshi] = []
        self.free: list[TransformedMoshi] = []
        self.on_demand = 0
        self.tickers: dict[int, _Ticker] = {}
        self.ticks = 0
        self.tick_seconds = 0.0  # spent ticking: this place's load
        self.tick_cpu_seconds = 0.0  # of which its thread ran on a core (less: others had it, or the GPU worked)

    def handle(self, op: str, key: int | None, args: tuple, progress: Callable[[], None]) -> Any:
        if op == "tick":
            started, cpu = time.perf_counter(), time.thread_time()
            ticker = self.tickers.get(key)
            if ticker is None:
                ticker = self.tickers[key] = _Ticker(self)
            outs = ticker.tick(*args)
            self.tick_seconds += time.perf_counter() - started
            self.tick_cpu_seconds += time.thread_time() - cpu
            return outs
        if op == "close":
            ticker = self.tickers.pop(key, None)
            if ticker is not None:
                ticker.close()
            return None
        if op == "reserve":
            return self.reserve(*args, progress)
        if op == "describe":
            return self.describe()
        if op == "parameters":
            return tuple(sum(p.numel() for p in m.parameters()) for m in (self.models.mimi, self.models.lm))
        raise ValueError(f"unknown worker operation {op!r}; expected one of {', '.join(WORKER_OPS)}")

    def reserve(self, replicas: int, progress: Callable[[], None]) -> int:
        """Build free replicas until the pool holds ``replicas`` in all; returns how many were built."""
        built = 0
        while len(self.replicas) < replicas:
            self.free.append(self._build())
            built += 1
            progress()
        return built

    def lease(self) -> TransformedMoshi:
        if self.free:
            return self.free.pop()
        self.on_demand += 1
        return self._build()

    def give_back(self, replica: TransformedMoshi) -> None:
        self.free.append(replica)

    def generators(self) -> tuple[torch.Tensor, ...]:
        """The states of the default generators a tick draws from: the host's, and the GPU's."""
        host = torch.get_rng_state()
        return (host,) if self.device.type == "cpu" else (host, torch.cuda.get_rng_state(self.device))

    def set_generators(self, states: tuple[torch.Tensor, ...]) -> None:
        torch.set_rng_state(states[0])
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(states[1], self.device)

    def _build(self) -> TransformedMoshi:
        shared = {
            id(t): t
            for module in (self.models.mimi, self.models.lm)
            for t in itertools.chain(module.parameters(), module.buffers())
        }
        replica, _ = transform(copy.deepcopy(self.models, shared), contract_for(self.config))
        # A binding certifies its class on its first call (a second or two on a CPU) and captures its
        # graphs on a GPU: done here, so that it never lands in a session's frame. Two ticks, since
        # the first one decodes nothing. The next session resets the state in place.
        silence = torch.from_numpy(SILENCE).view(1, 1, FRAME_SAMPLES).to(self.device)
        with replica.session(sampling=self.sampling, seed=self.config.seed) as tick, torch.inference_mode():
            for _ in range(WARM_UP_TICKS):
                tick(silence)
        self.replicas.append(replica)
        return replica

    def describe(self) -> dict[str, Any]:
        replays: dict[str, dict[str, Any]] = {}
        for replica in self.replicas:
            _merge(replays, replica.counters())
        return {
            "replicas": len(self.replicas),
            "replicas_on_demand": self.on_demand,
            "streams_open": len(self.tickers),
            "ticks": self.ticks,
            "tick_seconds": round(self.tick_seconds, 3),
            "tick_cpu_seconds": round(self.tick_cpu_seconds, 3),
            "stamps": list(self.replicas[0].report.stamps) if self.replicas else [],
            "replays": replays,
        }


def _merge(total: dict[str, Any], counters: dict[str, Any]) -> None:
    """Add nested counters into ``total``."""
    for key, value in counters.items():
        if isinstance(value, dict):
            _merge(total.setdefault(key, {}), value)
        else:
            total[key] = total.get(key, 0) + value


def _worker_main() -> None:
    """A worker process (started by ``_Worker``): answers requests ``(op, stream key, args)`` on the
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
    with no_compile():
        engine = _Engine(config, options["sampling"], "cpu", checkpoint)
        while True:
            try:
                request = conn.recv()
            except EOFError:
                return
            if request is None:
                return
            op, key, args = request
            try:
                conn.send(("ok", engine.handle(op, key, args, lambda: conn.send(("progress", None)))))
            except Exception:
                conn.send(("error", traceback.format_exc()))


# ---------------------------------------------------------------- in the server process


class _Place(ABC):
    """Where some streams' ticks run: requests ``(op, stream key, args)`` answered one at a time,
    in arrival order, by an ``_Engine``."""

    index: int
    name: str
    streams: int  # open streams placed here

    @abstractmethod
    def submit(
        self, op: str, key: int | None = None, *args: Any, progress: Callable[[], None] = lambda: None
    ) -> Future: ...

    def call(self, op: str, key: int | None = None, *args: Any) -> Any:
        return self.submit(op, key, *args).result()

    @abstractmethod
    def close(self) -> None: ...


class _InProcess(_Place):
    """Ticks on one thread of the server process (a GPU's place): the engine is built there and
    every request runs there, so the thread's grad mode and the device's state stay its own."""

    def __init__(
        self, name: str, config: MoshiConfig, sampling: bool, device: str, checkpoint: MoshiCheckpoint | None
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

    def submit(
        self, op: str, key: int | None = None, *args: Any, progress: Callable[[], None] = lambda: None
    ) -> Future:
        return self._thread.submit(self._handle, op, key, args, progress)

    def _handle(self, op: str, key: int | None, args: tuple, progress: Callable[[], None]) -> Any:
        return self._engine.result().handle(op, key, args, progress)  # raises what building it raised

    def close(self) -> None:
        self._thread.submit(self._flags.close).result()
        self._thread.shutdown(wait=True)
        # The engine goes now (a GPU's weights and replicas are freed at close, not when the last
        # reference to the plugin does).
        self._engine = Future()
        self._engine.set_exception(RuntimeError(f"{self.name} is closed"))


class _Worker(_Place):
    """One worker process and the one thread that talks to it: requests go out in arrival order,
    one at a time.

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
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-{index}")

    def submit(
        self, op: str, key: int | None = None, *args: Any, progress: Callable[[], None] = lambda: None
    ) -> Future:
        return self._thread.submit(self._roundtrip, op, key, args, progress)

    def _roundtrip(self, op: str, key: int | None, args: tuple, progress: Callable[[], None]) -> Any:
        self.conn.send((op, key, args))
        while True:
            try:
                kind, value = self.conn.recv()
            except (EOFError, OSError):
                raise RuntimeError(
                    f"{self.name} worker {self.index} (pid {self.process.pid}) is gone (exit code "
                    f"{self.process.poll()}) during {op}"
                ) from None
            if kind == "progress":
                progress()
            elif kind == "error":
                raise RuntimeError(f"{self.name} worker {self.index} failed in {op}:\n{value}")
            else:
                return value

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._thread.submit(self.conn.send, None).result()
        self._thread.shutdown(wait=True)
        self.conn.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class MoshiStream(ModelStream):
    """One session's conversation with Moshi: the turn bookkeeping here, the ticks on its place.
    A reply frame that a ``feed`` computed is handed out by ``step`` without a request."""

    def __init__(self, plugin: MoshiPlugin, place: _Place, key: int) -> None:
        self._plugin, self._place, self._key = plugin, place, key
        self._pending: deque[np.ndarray] = deque()  # reply frames computed by ``feed``
        self._closed = False
        self.budget = 0  # reply frames still to come out of ``step``
        self.turn_frames = 0  # user frames fed since the last ``begin_response``
        self.ticks = 0
        self.listened = 0  # output frames of the user's turn, dropped
        self.replied = 0  # output frames returned by ``step``

    def feed(self, frame: np.ndarray) -> None:
        self.feed_frames([frame])

    def feed_frames(self, frames: list[np.ndarray]) -> None:
        """All of them in one request to the place."""
        for frame in frames:
            if frame.shape != (FRAME_SAMPLES,) or frame.dtype != np.float32:
                raise ValueError(
                    f"feed takes float32 frames of {FRAME_SAMPLES} samples, got {frame.dtype} {frame.shape}"
                )
        listened = 0
        for out in self._tick(frames):
            self.turn_frames += 1
            if out is None:
                continue
            if len(self._pending) < self.budget:
                self._pending.append(out)
            else:
                listened += 1
        self.listened += listened
        self._plugin._count(listened=listened)

    def clear_input(self) -> None:
        self.turn_frames = 0

    def begin_response(self) -> None:
        if self.budget or self._pending:
            raise RuntimeError(f"begin_response while a reply is in progress ({self.budget} frames still to come)")
        self.budget = min(max(self.turn_frames, 1), self._plugin.max_reply_frames)
        self.turn_frames = 0

    def step(self) -> np.ndarray | None:
        if self.budget == 0:
            return None
        out = self._pending.popleft() if self._pending else None
        while out is None:  # only a stream's first tick gives nothing
            (out,) = self._tick([SILENCE])
        self.budget -= 1
        self.replied += 1
        self._plugin._count(replied=1)
        return out

    def cancel(self) -> None:
        self.budget = 0
        self._pending.clear()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.cancel()
            try:
                self._place.call("close", self._key)
            finally:
                self._plugin._placed_off(self._place)

    def _tick(self, frames: list[np.ndarray]) -> list[np.ndarray | None]:
        outs = self._place.call("tick", self._key, frames)
        self.ticks += len(frames)
        return outs


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
    ) -> None:
        """``seed`` draws the weights and seeds every session's sampling; ``sampling`` False decodes
        greedily. ``weights`` is a published checkpoint instead (a directory or a hub repo id, see
        ``models/moshi_checkpoint.py``), located (downloaded if need be) here, once, and loaded by
        every place from the same files; it must be Moshi at ``size`` (a checkpoint fixes the
        size: the published Moshi 7B is ``full``), with the LM in the size's dtype. ``processes``
        defaults to 2 on a CPU and must be 0 (its default) on a GPU.
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
        processes = (2 if device == "cpu" else 0) if processes is None else processes
        if processes < 0:
            raise ValueError(f"processes must be 0 (ticks in the server process) or more, got {processes}")
        if device == "cuda" and processes:
            raise ValueError(
                f"on cuda the ticks run in the server process (processes=0), not in {processes} worker "
                "processes: each would need the GPU and its own copy of the weights"
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
        self.streams = 0
        self.listened = self.replied = 0
        self._keys = itertools.count()
        self._lock = threading.Lock()  # placement and counters: streams call from several threads
        self.cores: list[list[int]] = []  # of each worker process, when pinned
        if processes:
            available = sorted(os.sched_getaffinity(0))
            if pin and processes * threads <= len(available):
                self.cores = [available[i * threads : (i + 1) * threads] for i in range(processes)]
            options = {"size": size, "seed": seed, "sampling": sampling, "threads": threads,
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
                f"on {on}, full duplex at 12.5 frames/s through the cadence-fx transform, {where}; a "
                f"reply lasts as long as the user's turn, at most {max_reply_frames * FRAME_SAMPLES / SAMPLE_RATE:g} s"
            ),
        )

    def open_stream(self) -> MoshiStream:
        """On the place with the fewest open streams (the first such): no call to it yet."""
        with self._lock:
            place = min(self._places, key=lambda p: p.streams)
            place.streams += 1
            self.streams += 1
        return MoshiStream(self, place, next(self._keys))

    def _placed_off(self, place: _Place) -> None:
        with self._lock:
            place.streams -= 1

    def _count(self, listened: int = 0, replied: int = 0) -> None:
        with self._lock:
            self.listened += listened
            self.replied += replied

    def reserve(self, sessions: int) -> None:
        """Replicas for ``sessions`` concurrent streams, built now, a line of progress per replica."""
        per_place = -(-sessions // len(self._places))
        total, done, started = per_place * len(self._places), [0], time.monotonic()
        lock = threading.Lock()

        def progress() -> None:
            with lock:
                done[0] += 1
                print(f"{self.name}: replica {done[0]}/{total} ready ({time.monotonic() - started:.1f} s)",
                      file=sys.stderr, flush=True)

        for future in [p.submit("reserve", None, per_place, progress=progress) for p in self._places]:
            future.result()

    def describe(self) -> dict[str, Any]:
        """What the service runs, with the transform's stamps and the counters of all places."""
        parts = [p.submit("describe") for p in self._places]
        places = [part.result() for part in parts]
        total: dict[str, Any] = {}
        for part in places:
            _merge(total, {k: part[k] for k in ("replicas", "replicas_on_demand", "ticks", "replays")})
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
            "replicas": total["replicas"],
            "replicas_per_process": [part["replicas"] for part in places],
            "replicas_on_demand": total["replicas_on_demand"],
            "frames": {
                "ticks": total["ticks"],
                "listened": self.listened,
                "replied": self.replied,
                "warm_up": WARM_UP_TICKS * total["replicas"],  # outside any session
            },
            # Per process that ticks (the server process itself when processes is 0): seconds spent
            # ticking (its load), of them on a core, and its open streams.
            "tick_seconds_per_process": [part["tick_seconds"] for part in places],
            "tick_cpu_seconds_per_process": [part["tick_cpu_seconds"] for part in places],
            "streams_open_per_process": [part["streams_open"] for part in places],
            "transform": {
                "stamps": next((part["stamps"] for part in places if part["stamps"]), []),
                "replays": total["replays"],
            },
        }

    def close(self) -> None:
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
