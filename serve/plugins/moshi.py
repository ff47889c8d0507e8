"""``moshi-small``: the embedded default model.

Moshi (Mimi codec, LM and depformer) at the SMALL size of ``models/moshi_stream.py``: random
weights from a fixed seed, nothing downloaded, real codebook counts, delays, vocabularies and ring
capacities. It runs full duplex on its native clock through the cadence-fx transform of the Moshi
family (``transform(models, contract_for(SMALL))``: the four stages under ``ExactShapeReplay``,
eager with admission bookkeeping on a CPU).

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

Sessions share the weights. Each stream leases a **replica** (the modules deep-copied with every
parameter and buffer shared, then transformed) from a pool and gives it back when it closes; the
next session on it starts from the base state, which ``TransformedMoshi.session`` writes in place.
All model work of the plugin runs on one worker thread, one tick at a time: the vendor samples
from torch's default generator and reads process-wide flags, so ticks must not overlap. Each
stream swaps its own generator state in for its ticks, so one session's audio does not depend on
the others'.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import itertools
import json
import statistics
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import torch

from cadence_fx import transform
from cadence_fx.models.moshi_replay import TransformedMoshi, contract_for
from cadence_fx.models.moshi_stream import SAMPLE_RATE, SMALL, MoshiModels, build_models, no_compile, random_pcm

from .base import ModelPlugin, ModelStream, PluginInfo

NAME = "moshi-small"
FRAME_SAMPLES = 1920  # 80 ms at 24 kHz: one tick
SILENCE = np.zeros(FRAME_SAMPLES, dtype=np.float32)
WARM_UP_TICKS = 2

T = TypeVar("T")


class MoshiStream(ModelStream):
    """One session's conversation with Moshi. Every method runs on the plugin's worker thread."""

    def __init__(self, plugin: MoshiPlugin) -> None:
        self._plugin = plugin
        self._stack: contextlib.ExitStack | None = None  # the leased replica's open session
        self._replica: TransformedMoshi | None = None
        self._tick_fn: Callable[[torch.Tensor], tuple[Any, Any]] | None = None
        self._rng: torch.Tensor | None = None  # this stream's default-generator state
        self._pending: deque[np.ndarray] = deque()  # reply frames computed by ``feed``
        self.budget = 0  # reply frames still to come out of ``step``
        self.turn_frames = 0  # user frames fed since the last ``begin_response``
        self.ticks = 0
        self.listened = 0  # output frames of the user's turn, dropped
        self.replied = 0  # output frames returned by ``step``

    # ------------------------------------------------------------ the seam

    def feed(self, frame: np.ndarray) -> None:
        assert frame.shape == (FRAME_SAMPLES,) and frame.dtype == np.float32, (frame.shape, frame.dtype)
        self._plugin.call(self._feed, frame)

    def clear_input(self) -> None:
        self._plugin.call(self._clear_input)

    def begin_response(self) -> None:
        self._plugin.call(self._begin_response)

    def step(self) -> np.ndarray | None:
        return self._plugin.call(self._step)

    def cancel(self) -> None:
        self._plugin.call(self._cancel)

    def close(self) -> None:
        self._plugin.call(self._close)

    # ------------------------------------------------------------ on the worker thread

    def _feed(self, frame: np.ndarray) -> None:
        out = self._tick(frame)
        self.turn_frames += 1
        if out is None:
            return
        if len(self._pending) < self.budget:
            self._pending.append(out)
        else:
            self.listened += 1
            self._plugin.listened += 1

    def _clear_input(self) -> None:
        self.turn_frames = 0

    def _begin_response(self) -> None:
        assert self.budget == 0 and not self._pending, "a reply is still in progress"
        self.budget = min(max(self.turn_frames, 1), self._plugin.max_reply_frames)
        self.turn_frames = 0

    def _step(self) -> np.ndarray | None:
        if self.budget == 0:
            return None
        out = self._pending.popleft() if self._pending else None
        while out is None:  # only a stream's first tick gives nothing
            out = self._tick(SILENCE)
        self.budget -= 1
        self.replied += 1
        self._plugin.replied += 1
        return out

    def _cancel(self) -> None:
        self.budget = 0
        self._pending.clear()

    def _close(self) -> None:
        self._cancel()
        if self._stack is not None:
            self._stack.close()
            self._plugin.give_back(self._replica)
            self._stack = self._replica = self._tick_fn = None

    def _tick(self, frame: np.ndarray) -> np.ndarray | None:
        if self._tick_fn is None:
            self._open()
        # Sessions interleave their ticks and may leave the vendor's no-compile flag and the
        # thread's grad mode as another session found them: each tick sets both itself.
        with torch.random.fork_rng(devices=[]), torch.no_grad(), no_compile():
            torch.set_rng_state(self._rng)
            _, pcm = self._tick_fn(torch.from_numpy(frame).view(1, 1, FRAME_SAMPLES))
            self._rng = torch.get_rng_state()
        self.ticks += 1
        self._plugin.ticks += 1
        return None if pcm is None else pcm.reshape(-1).numpy().copy()  # a replayed output is a static buffer

    def _open(self) -> None:
        self._replica = self._plugin.lease()
        self._stack = contextlib.ExitStack()
        with torch.random.fork_rng(devices=[]):  # the session seeds the default generator: keep that seed ours
            self._tick_fn = self._stack.enter_context(
                self._replica.session(sampling=self._plugin.sampling, seed=self._plugin.seed)
            )
            self._rng = torch.get_rng_state()


class MoshiPlugin(ModelPlugin):
    """Moshi SMALL, full duplex, on 24 kHz frames of 80 ms. See the module docstring."""

    def __init__(
        self,
        *,
        seed: int = SMALL.seed,
        sampling: bool = True,
        max_reply_frames: int = 125,
        threads: int = 1,
        models: MoshiModels | None = None,
    ) -> None:
        """``seed`` draws the weights (unless ``models`` are given, e.g. shared with another plugin)
        and seeds every session's sampling; ``sampling`` False decodes greedily. ``threads`` is
        torch's intra-op thread count on the worker (torch keeps it per thread): the model is small
        enough that a tick is bound by per-operator overhead, and a second thread only contends for
        the core the event loop needs.
        """
        if max_reply_frames < 1:
            raise ValueError(f"max_reply_frames must be at least 1, got {max_reply_frames}")
        self.seed, self.sampling, self.max_reply_frames, self.threads = seed, sampling, max_reply_frames, threads
        self.ticks = self.listened = self.replied = 0
        self.streams = 0
        self._replicas: list[TransformedMoshi] = []
        self._free: list[TransformedMoshi] = []
        self._worker = ThreadPoolExecutor(
            1, thread_name_prefix=NAME, initializer=torch.set_num_threads, initargs=(threads,)
        )
        self.models = models if models is not None else self.call(build_models, dataclasses.replace(SMALL, seed=seed))
        self.call(lambda: self.give_back(self.lease()))  # one replica ready for the first session
        mimi, lm = (sum(p.numel() for p in m.parameters()) for m in (self.models.mimi, self.models.lm))
        self.info = PluginInfo(
            name=NAME,
            input_rate=SAMPLE_RATE,
            output_rate=SAMPLE_RATE,
            frame_samples=FRAME_SAMPLES,
            description=(
                f"Moshi SMALL (Mimi {mimi / 1e6:.1f}M + LM {lm / 1e6:.1f}M parameters, random weights, seed {seed}), "
                f"full duplex at 12.5 frames/s through the cadence-fx transform; a reply lasts as long as the "
                f"user's turn, at most {max_reply_frames * FRAME_SAMPLES / SAMPLE_RATE:g} s"
            ),
        )

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` on the worker thread and wait for it."""
        return self._worker.submit(fn, *args).result()

    def open_stream(self) -> MoshiStream:
        self.streams += 1
        return MoshiStream(self)

    def lease(self) -> TransformedMoshi:
        """A replica no stream holds (worker thread only)."""
        if self._free:
            return self._free.pop()
        shared = {
            id(t): t
            for module in (self.models.mimi, self.models.lm)
            for t in itertools.chain(module.parameters(), module.buffers())
        }
        replica, _ = transform(copy.deepcopy(self.models, shared), contract_for(self.models.config))
        # A binding certifies its class on its first call (a second or two on a CPU): done here, so
        # that it never lands in a session's frame. Two ticks, since the first one decodes nothing.
        # The next session resets the state in place.
        session = replica.session(sampling=self.sampling, seed=self.seed)
        with torch.random.fork_rng(devices=[]), session as tick, torch.no_grad(), no_compile():
            for _ in range(WARM_UP_TICKS):
                tick(torch.from_numpy(SILENCE).view(1, 1, FRAME_SAMPLES))
        self._replicas.append(replica)
        return replica

    def give_back(self, replica: TransformedMoshi) -> None:
        self._free.append(replica)

    def describe(self) -> dict[str, Any]:
        """What the service runs, with the transform's stamps and replay counters over all replicas."""
        return self.call(self._describe)

    def _describe(self) -> dict[str, Any]:
        replays: dict[str, dict[str, Any]] = {}
        for replica in self._replicas:
            for name, counters in replica.counters().items():
                total = replays.setdefault(name, {})
                for key, value in counters.items():
                    if isinstance(value, dict):
                        merged = total.setdefault(key, {})
                        for reason, n in value.items():
                            merged[reason] = merged.get(reason, 0) + n
                    else:
                        total[key] = total.get(key, 0) + value
        return {
            "model": NAME,
            "seed": self.seed,
            "sampling": self.sampling,
            "threads": self.threads,
            "max_reply_frames": self.max_reply_frames,
            "streams": self.streams,
            "replicas": len(self._replicas),
            "frames": {
                "ticks": self.ticks,
                "listened": self.listened,
                "replied": self.replied,
                "warm_up": WARM_UP_TICKS * len(self._replicas),  # outside any session
            },
            "transform": {"stamps": list(self._replicas[0].report.stamps), "replays": replays},
        }

    def close(self) -> None:
        self._worker.shutdown(wait=True)


def measure(frames: int = 100, threads: int = 1) -> dict[str, Any]:
    """Per-frame compute time of one stream, as its session sees it (the hand-off to the worker
    included): a turn of ``frames // 2`` fed frames, then its reply of as many steps."""
    plugin = MoshiPlugin(threads=threads, max_reply_frames=frames)
    try:
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
        torch_threads = plugin.call(torch.get_num_threads)
    finally:
        plugin.close()
    ms = [1e3 * t for t in times]
    percentiles = statistics.quantiles(ms, n=100)
    frame_ms = 1e3 * FRAME_SAMPLES / SAMPLE_RATE
    return {
        "frames": len(ms),
        "torch_threads": torch_threads,
        "p50_ms": round(percentiles[49], 2),
        "p95_ms": round(percentiles[94], 2),
        "max_ms": round(max(ms), 2),
        "first_ms": round(ms[0], 2),
        "frame_ms": frame_ms,
        "over_frame": sum(t > frame_ms for t in ms),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="per-frame compute time of the moshi-small plugin")
    parser.add_argument("--frames", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    print(json.dumps(measure(args.frames, args.threads)))
