"""``moshi-tiny`` (the service's embedded default), ``moshi-small`` (both on a CPU) and
``moshi-full`` (on an NVIDIA GPU).

Moshi (Mimi codec, LM and depformer) at a size of ``models/moshi_stream.py`` on a device, both
explicit (``MoshiPlugin(size=..., device=...)``; each size has its default device, ``DEVICES``):
random weights from a fixed seed, nothing downloaded, real codebook counts, delays, vocabularies
and ring capacities; or, with ``weights``, a published checkpoint of that size (``moshi-full``
with ``kyutai/moshiko-pytorch-bf16`` or ``kyutai/moshika-pytorch-bf16``: the real Moshi). TINY
is SMALL cut down for 8 sessions on 2 CPU cores (one layer per transformer, widths of 32, 8-dimensional codebook vectors, 4
SEANet filters and no residual
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

Each frame Moshi speaks comes with the text token it sampled on that tick: a stream hands it out
as text (``take_text``), which the session sends as transcript deltas, detokenized by the
checkpoint's tokenizer or, for random weights, a stand-in with a piece for every id
(``models/moshi_tokenizer.py``).

This module is the plugin (sizes, options, placement of streams, ``reserve``, ``describe``). How a
session's turns map onto the model's clock: ``moshi_turns.py`` (``MoshiStream``). Where the ticks
run (worker processes or a thread of this one) and why: ``moshi_places.py``; what runs there:
``moshi_worker.py``.

The batch samples from torch's default generator of the device; its runtime swaps the batch's
own generator states (seeded once with ``seed``) in for each tick, so nothing else in the
process moves them. Ticks run in inference mode (the same values as ``no_grad``, with less
bookkeeping per operator). The turn bookkeeping stays with the session, so a reply frame
that a ``feed`` already computed costs ``step`` no request to its slot.

The batch size is fixed when a place builds its batch: ``reserve(sessions)``, which the server
calls at startup with its session limit, builds every place's batch at ``slots`` (the option),
or at ``ceil(sessions / places)`` without it, ahead of the first session (warmed up: certified
on a CPU, captured on a GPU; a line on stderr per place), and refuses a limit beyond the slots.
A stream opened before any ``reserve`` fixes it at ``slots`` or ``DEFAULT_SLOTS``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from cadence_fx.models.moshi_checkpoint import MoshiCheckpoint, locate
from cadence_fx.models.moshi_stream import SAMPLE_RATE, MoshiConfig, random_pcm
from cadence_fx.models.moshi_tokenizer import TextPieces, stand_in_tokenizer

from ..runtime.slots import SlotScheduler, SlotsFull, TickRecord
from .base import ModelPlugin, PluginInfo, add_counters
from .moshi_places import _InProcess, _Place, _Worker
from .moshi_turns import FRAME_SAMPLES, REPLY_AHEAD_FRAMES, SILENCE, MoshiStream, StreamPlace, scheduler_of
from .moshi_worker import SIZES, WORKER_OPS

__all__ = [
    "DEVICES",
    "FRAME_SAMPLES",
    "MAX_SLOTS",
    "MoshiPlugin",
    "MoshiStream",
    "REPLY_AHEAD_FRAMES",
    "SILENCE",
    "SIZES",
    "WORKER_OPS",
    "measure",
]

DEVICES: dict[str, str] = {"tiny": "cpu", "small": "cpu", "full": "cuda"}  # each size's default device
MAX_SLOTS = 64  # the largest batch per place: the vendor's own batch of 64 measured 110 GiB on one H200 (issue 13)
DEFAULT_SLOTS = 8  # a place's batch when a stream opens before any ``reserve``


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
        hint = (
            f"it is Moshi at the {fits[0].upper()} size: serve it with --model moshi-{fits[0]}"
            if fits
            else f"it is none of the sizes {', '.join(SIZES)}"
        )
        raise ValueError(
            f"{name} serves Moshi at the {size.upper()} size, but checkpoint {weights!r} differs in "
            f"{len(differences)} setting{'s' if len(differences) > 1 else ''} (checkpoint value, then "
            f"{size.upper()}'s): {'; '.join(differences)}; {hint}"
        )
    return checkpoint


def _text_pieces(name: str, config: MoshiConfig, checkpoint: MoshiCheckpoint | None) -> TextPieces:
    """The pieces of the text tokens the LM samples: the checkpoint's tokenizer, or the stand-in
    for random weights (``models/moshi_tokenizer.py``); a tokenizer that cannot read every id is refused."""
    card = config.lm_kwargs["text_card"]
    if checkpoint is None:
        return TextPieces(stand_in_tokenizer(card), card, f"{name} (random weights)")
    return TextPieces(Path(checkpoint.info.tokenizer), card, f"{name} checkpoint {checkpoint.source!r}")


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
        self.text = _text_pieces(self.name, self.config, self.checkpoint)
        self.slots, self.record = slots, record
        self.streams = 0
        self.listened = self.replied = self.silence = 0
        self.queued_at_reply_start: list[int] = []  # [k]: replies that began with k of their slot's frames not yet done
        self._lock = threading.Lock()  # placement and counters: streams call from several threads
        self._started: list[Future] = []  # each place's batch, being built or built
        self.cores: list[list[int]] = []  # of each worker process, when pinned
        if processes:
            assert threads is not None, "a worker process's threads default to 1 above"
            available = sorted(os.sched_getaffinity(0))
            if pin and processes * threads <= len(available):
                self.cores = [available[i * threads : (i + 1) * threads] for i in range(processes)]
            options = {
                "size": size,
                "device": device,
                "seed": seed,
                "sampling": sampling,
                "threads": threads,
                "weights": None if self.checkpoint is None else self.checkpoint.to_json(),
            }
            self._places: list[_Place] = [
                _Worker(i, self.name, options | {"cores": self.cores[i] if self.cores else None}) for i in range(processes)
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
            slots = DEFAULT_SLOTS if self.slots is None else self.slots
            self._start(slots)
            open_places = [p for p in self._places if scheduler_of(p).free]
            if not open_places:
                raise SlotsFull(f"{self.name}: all {self._capacity(slots)} are taken; a session needs a free slot")
            place = min(open_places, key=lambda p: p.streams)
            slot = scheduler_of(place).acquire()
            place.streams += 1
            self.streams += 1
        return MoshiStream(self, place, slot)

    def free_slots(self) -> int:
        """Slots no stream holds, all places together (every slot before the batch is built)."""
        with self._lock:
            if not self._started:
                return len(self._places) * (DEFAULT_SLOTS if self.slots is None else self.slots)
            return sum(scheduler_of(place).free for place in self._places)

    def _placed_off(self, place: StreamPlace, slot: int) -> None:
        with self._lock:
            scheduler_of(place).release(slot)
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

    def _capacity(self, slots: int) -> str:
        places = len(self._places)
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
            print(
                f"{self.name}: {self.slots} slots ready in place {place.index} ({time.monotonic() - started:.1f} s)",
                file=sys.stderr,
                flush=True,
            )

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
    plugin = MoshiPlugin(
        size=size,
        device=device,
        max_reply_frames=frames,
        processes=1 if on_cpu else None,
        threads=threads if on_cpu else None,
    )
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
