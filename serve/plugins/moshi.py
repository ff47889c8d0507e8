"""``moshi-tiny`` (the service's embedded default) and ``moshi-small``: Moshi on a CPU.

Moshi (Mimi codec, LM and depformer) at the TINY or SMALL size of ``models/moshi_stream.py``:
random weights from a fixed seed, nothing downloaded, real codebook counts, delays, vocabularies
and ring capacities. TINY is SMALL cut down for 8 sessions on 2 CPU cores (one layer per
transformer, widths of 64, 16-dimensional codebook vectors, no SEANet residual units; what it
keeps is listed at its definition); ``bench/results/serve_load_moshi.json`` is what 8 sessions
of it measured. It runs full duplex on its native clock through the cadence-fx transform of the
Moshi family (``transform(models, contract_for(config))``: the four stages under
``ExactShapeReplay``, eager with admission bookkeeping on a CPU).

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

Where the ticks run. A tick is bound by per-operator overhead in Python (thousands of small
operator calls; the depformer's eight codebooks alone are about 40% of it), so it holds the GIL
for most of its time: two threads running the stock SMALL loop on two streams measured 25.9
frames/s in all, one thread 22.5. The plugin therefore ticks in ``processes``
worker processes (2 by default, one per core of the machine the default is sized for), each with
one torch thread, and puts each new stream on the process with the fewest open streams. A
worker builds the same weights from the seed, runs its streams' ticks one request at a time in
arrival order (a ``feed_frames`` is one request for all its frames), and holds the vendor's
process-wide no-compile flag for its life. The vendor samples from torch's default generator, so
each stream swaps its own generator state in for its ticks: one session's audio does not depend
on the others'. Ticks run in inference mode (the same values as ``no_grad``, with less
bookkeeping per operator). The turn bookkeeping above stays in the server process, so a reply
frame that a ``feed`` already computed costs ``step`` no round trip to the worker.

Sessions on a worker share its weights. Each stream leases a **replica** (the modules
deep-copied with every parameter and buffer shared, then transformed) from its worker's pool
and gives it back when it closes; the next session on it starts from the base state, which
``TransformedMoshi.session`` writes in place. ``reserve(sessions)``, which the server calls at
startup with its session limit, builds ``ceil(sessions / processes)`` replicas per worker ahead
of time (the workers in parallel, a line on stderr per replica): least-loaded placement never
puts more streams than that on one worker, so no session waits for a replica. A stream that
finds its worker's pool empty (no ``reserve``) builds one on the spot, counted as
``replicas_on_demand`` in ``describe()``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import itertools
import json
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from cadence_fx import transform
from cadence_fx.models.moshi_replay import TransformedMoshi, contract_for
from cadence_fx.models.moshi_stream import SAMPLE_RATE, SMALL, TINY, MoshiConfig, build_models, no_compile, random_pcm

from .base import ModelPlugin, ModelStream, PluginInfo

SIZES: dict[str, MoshiConfig] = {"tiny": TINY, "small": SMALL}
FRAME_SAMPLES = 1920  # 80 ms at 24 kHz: one tick
SILENCE = np.zeros(FRAME_SAMPLES, dtype=np.float32)
WARM_UP_TICKS = 2
WORKER_OPS = ("tick", "close", "parameters", "reserve", "describe")


# ---------------------------------------------------------------- in a worker process


class _Ticker:
    """One stream's clock on its worker: its replica's open session and its generator state."""

    def __init__(self, engine: _Engine) -> None:
        self._engine = engine
        self._replica = engine.lease()
        self._stack = contextlib.ExitStack()
        session = self._replica.session(sampling=engine.sampling, seed=engine.config.seed)
        self._tick_fn = self._stack.enter_context(session)
        self._rng = torch.get_rng_state()  # the session seeded the default generator: this stream's draws

    def tick(self, frames: list[np.ndarray]) -> list[np.ndarray | None]:
        """One tick per frame, in order: each tick's 1920 output samples (None on a stream's first)."""
        outs = []
        torch.set_rng_state(self._rng)
        with torch.inference_mode():
            for frame in frames:
                _, pcm = self._tick_fn(torch.from_numpy(frame).view(1, 1, FRAME_SAMPLES))
                # A replayed output is a static buffer: copied out.
                outs.append(None if pcm is None else pcm.reshape(-1).numpy().copy())
        self._rng = torch.get_rng_state()
        self._engine.ticks += len(frames)
        return outs

    def close(self) -> None:
        self._stack.close()
        self._engine.give_back(self._replica)


class _Engine:
    """A worker's weights, replica pool and streams' clocks."""

    def __init__(self, config: MoshiConfig, sampling: bool) -> None:
        self.config, self.sampling = config, sampling
        self.models = build_models(config)
        self.replicas: list[TransformedMoshi] = []
        self.free: list[TransformedMoshi] = []
        self.on_demand = 0
        self.tickers: dict[int, _Ticker] = {}
        self.ticks = 0
        self.tick_seconds = 0.0  # spent ticking: this worker's load
        self.tick_cpu_seconds = 0.0  # of which on a core (less: other processes had it)

    def handle(self, op: str, key: int | None, args: tuple, progress: Callable[[], None]) -> Any:
        if op == "tick":
            started, cpu = time.perf_counter(), time.process_time()
            ticker = self.tickers.get(key)
            if ticker is None:
                ticker = self.tickers[key] = _Ticker(self)
            outs = ticker.tick(*args)
            self.tick_seconds += time.perf_counter() - started
            self.tick_cpu_seconds += time.process_time() - cpu
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

    def _build(self) -> TransformedMoshi:
        shared = {
            id(t): t
            for module in (self.models.mimi, self.models.lm)
            for t in itertools.chain(module.parameters(), module.buffers())
        }
        replica, _ = transform(copy.deepcopy(self.models, shared), contract_for(self.config))
        # A binding certifies its class on its first call (a second or two on a CPU): done here, so
        # that it never lands in a session's frame. Two ticks, since the first one decodes nothing.
        # The next session resets the state in place.
        with replica.session(sampling=self.sampling, seed=self.config.seed) as tick, torch.inference_mode():
            for _ in range(WARM_UP_TICKS):
                tick(torch.from_numpy(SILENCE).view(1, 1, FRAME_SAMPLES))
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
    torch.set_num_threads(options["threads"])
    torch.set_grad_enabled(False)
    config = dataclasses.replace(SIZES[options["size"]], seed=options["seed"])
    with no_compile():
        engine = _Engine(config, options["sampling"])
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


class _Worker:
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

    def call(self, op: str, key: int | None = None, *args: Any) -> Any:
        return self.submit(op, key, *args).result()

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
    """One session's conversation with Moshi: the turn bookkeeping here, the ticks on its worker.
    A reply frame that a ``feed`` computed is handed out by ``step`` without a round trip."""

    def __init__(self, plugin: MoshiPlugin, worker: _Worker, key: int) -> None:
        self._plugin, self._worker, self._key = plugin, worker, key
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
        """All of them in one round trip to the worker."""
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
                self._worker.call("close", self._key)
            finally:
                self._plugin._placed_off(self._worker)

    def _tick(self, frames: list[np.ndarray]) -> list[np.ndarray | None]:
        outs = self._worker.call("tick", self._key, frames)
        self.ticks += len(frames)
        return outs


class MoshiPlugin(ModelPlugin):
    """Moshi at ``size`` (``tiny`` or ``small``), full duplex on 24 kHz frames of 80 ms, ticking in
    ``processes`` worker processes. See the module docstring."""

    def __init__(
        self,
        *,
        size: str = "tiny",
        seed: int = 0,
        sampling: bool = True,
        max_reply_frames: int = 125,
        processes: int = 2,
        threads: int = 1,
    ) -> None:
        """``seed`` draws the weights and seeds every session's sampling; ``sampling`` False decodes
        greedily. ``threads`` is torch's intra-op thread count in each worker: the model is small
        enough that a tick is bound by per-operator overhead, and a second thread only contends
        for the cores the other workers and the event loop need.
        """
        if size not in SIZES:
            raise ValueError(f"unknown Moshi size {size!r}; expected one of {', '.join(SIZES)}")
        if max_reply_frames < 1:
            raise ValueError(f"max_reply_frames must be at least 1, got {max_reply_frames}")
        if processes < 1 or threads < 1:
            raise ValueError(f"processes and threads must be at least 1, got {processes} and {threads}")
        self.name = f"moshi-{size}"
        self.size, self.seed, self.sampling = size, seed, sampling
        self.max_reply_frames, self.processes, self.threads = max_reply_frames, processes, threads
        self.config = dataclasses.replace(SIZES[size], seed=seed)
        self.streams = 0
        self.listened = self.replied = 0
        self._keys = itertools.count()
        self._lock = threading.Lock()  # placement and counters: streams call from several threads
        options = {"size": size, "seed": seed, "sampling": sampling, "threads": threads}
        self._workers = [_Worker(i, self.name, options) for i in range(processes)]
        try:
            counts = [w.submit("parameters") for w in self._workers]  # answered once a worker has built its weights
            mimi, lm = counts[0].result()
            for other in counts[1:]:
                other.result()
        except BaseException:
            self.close()
            raise
        self.info = PluginInfo(
            name=self.name,
            input_rate=SAMPLE_RATE,
            output_rate=SAMPLE_RATE,
            frame_samples=FRAME_SAMPLES,
            description=(
                f"Moshi {size.upper()} (Mimi {mimi / 1e6:.1f}M + LM {lm / 1e6:.1f}M parameters, random weights, seed "
                f"{seed}), full duplex at 12.5 frames/s through the cadence-fx transform, in {processes} worker "
                f"process{'es' if processes > 1 else ''}; a reply lasts as long as the user's turn, at most "
                f"{max_reply_frames * FRAME_SAMPLES / SAMPLE_RATE:g} s"
            ),
        )

    def open_stream(self) -> MoshiStream:
        """On the worker with the fewest open streams (the first such): no call to it yet."""
        with self._lock:
            worker = min(self._workers, key=lambda w: w.streams)
            worker.streams += 1
            self.streams += 1
        return MoshiStream(self, worker, next(self._keys))

    def _placed_off(self, worker: _Worker) -> None:
        with self._lock:
            worker.streams -= 1

    def _count(self, listened: int = 0, replied: int = 0) -> None:
        with self._lock:
            self.listened += listened
            self.replied += replied

    def reserve(self, sessions: int) -> None:
        """Replicas for ``sessions`` concurrent streams, built now, a line of progress per replica."""
        per_worker = -(-sessions // len(self._workers))
        total, done, started = per_worker * len(self._workers), [0], time.monotonic()
        lock = threading.Lock()

        def progress() -> None:
            with lock:
                done[0] += 1
                print(f"{self.name}: replica {done[0]}/{total} ready ({time.monotonic() - started:.1f} s)",
                      file=sys.stderr, flush=True)

        for future in [w.submit("reserve", None, per_worker, progress=progress) for w in self._workers]:
            future.result()

    def describe(self) -> dict[str, Any]:
        """What the service runs, with the transform's stamps and the counters of all workers."""
        parts = [w.submit("describe") for w in self._workers]
        workers = [part.result() for part in parts]
        total: dict[str, Any] = {}
        for part in workers:
            _merge(total, {k: part[k] for k in ("replicas", "replicas_on_demand", "ticks", "replays")})
        return {
            "model": self.name,
            "seed": self.seed,
            "sampling": self.sampling,
            "processes": self.processes,
            "threads": self.threads,
            "max_reply_frames": self.max_reply_frames,
            "streams": self.streams,
            "replicas": total["replicas"],
            "replicas_per_process": [part["replicas"] for part in workers],
            "replicas_on_demand": total["replicas_on_demand"],
            "frames": {
                "ticks": total["ticks"],
                "listened": self.listened,
                "replied": self.replied,
                "warm_up": WARM_UP_TICKS * total["replicas"],  # outside any session
            },
            # Per worker: seconds spent ticking (its load), of them on a core, and its open streams.
            "tick_seconds_per_process": [part["tick_seconds"] for part in workers],
            "tick_cpu_seconds_per_process": [part["tick_cpu_seconds"] for part in workers],
            "streams_open_per_process": [part["streams_open"] for part in workers],
            "transform": {
                "stamps": next((part["stamps"] for part in workers if part["stamps"]), []),
                "replays": total["replays"],
            },
        }

    def close(self) -> None:
        for worker in self._workers:
            worker.close()


def measure(frames: int = 100, threads: int = 1, size: str = "tiny") -> dict[str, Any]:
    """Per-frame compute time of one stream, as its session sees it (the round trip to its worker
    included): a turn of ``frames // 2`` fed frames, then its reply of as many steps."""
    plugin = MoshiPlugin(size=size, threads=threads, max_reply_frames=frames, processes=1)
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
        "torch_threads": threads,
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
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    args = parser.parse_args()
    print(json.dumps(measure(args.frames, args.threads, args.size)))
