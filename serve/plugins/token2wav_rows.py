"""``token2wav`` and ``token2wav-full`` with ``slots``: the sessions as the rows of one batch.

The default plugin (``token2wav.py``) runs one stream a call, on replay lanes, exact to the stock
vendor stream. Given ``slots`` (``serve --slots N``), the plugin runs instead one
``BatchedStreams`` of capacity N (``models/token2wav_batch.py``) under the batch-invariant
envelope: each live session is a row, and the rows that have a chunk waiting are stepped together,
rows of one catalog class sharing a call. What a session says is the same as in the default plugin
(its stand-in tokens, ``token_seed``; its reply lengths, ``reply_chunks``); its noise is its row's
``StreamRng``, seeded with ``rng_seed``. Its audio is bit for bit the vendor's stream of its tokens
run alone under the same envelope at the same capacity (not the default plugin's bits: the
envelope computes some ops another way; docs/families/token2wav.md, "Batched streams").

Rows, turns and ticks. Admission is a free slot (``SlotsFull`` otherwise, and ``reserve`` refuses
more sessions than the slots). A session's calls go through a ``SlotScheduler``
(``serve/runtime/slots.py``), whose one thread owns the batch: each tick takes the next request
of every slot that has one waiting and runs them together. A request is a turn start (the row
joins at its session's first turn, from the prompt state computed once at start-up; later turns
reset it to that state), a chunk (28 tokens; the reply's last one flushes) or a leave (the session
closed). A tick runs its turn starts and leaves first, then every chunk in one ``step``; so a row
joins, resets, flushes and leaves at its own chunk boundaries, whatever the other rows do.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cadence_fx.models.token2wav_batch import BatchedStreams
from cadence_fx.models.token2wav_envelope import envelope
from cadence_fx.models.token2wav_stream import random_chunks

from ..runtime.slots import SlotScheduler, SlotsFull
from .base import ModelPlugin, ModelStream, PluginInfo
from .token2wav import (
    FRAME_SAMPLES,
    INPUT_RATE,
    OUTPUT_RATE,
    TurnInput,
    build_models,
    check_settings,
    rng_seed,
    token_seed,
)

__all__ = ["RowStream", "SlotsFull", "Token2WavRowsPlugin"]


@dataclass(frozen=True)
class TurnStart:
    """The session's turn starts: its row joins (its first turn) or returns to the prompt state."""

    key: int


@dataclass(frozen=True)
class Chunk:
    """One chunk of the session's reply: (1, 28) speech tokens; ``last`` flushes."""

    key: int
    tokens: torch.Tensor
    last: bool


@dataclass(frozen=True)
class Leave:
    """The session closed: its row leaves (if it ever joined)."""

    key: int


class RowStream(ModelStream):
    """One session's stream: a slot of the scheduler and, from its first turn, a row of the batch."""

    def __init__(self, plugin: Token2WavRowsPlugin, index: int, slot: int) -> None:
        self._plugin = plugin
        self.index = index  # the row's key, and the stream's seeds
        self.slot = slot
        self.turn = 0
        self.input = TurnInput()
        self._tokens: list[torch.Tensor] = []
        self._next = 0
        self._closed = False

    def feed(self, frame: np.ndarray) -> None:
        self.input.feed(frame)

    def clear_input(self) -> None:
        self.input.clear()

    def begin_response(self) -> None:
        n = self.input.take_reply_chunks(self._plugin.max_reply_chunks)
        self._tokens = random_chunks(token_seed(self.index, self.turn), n, device=self._plugin.device)
        self._next = 0
        self._plugin.request(self, TurnStart(self.index))
        self.turn += 1

    def step(self) -> np.ndarray | None:
        if self._next >= len(self._tokens):
            self._tokens = []
            return None
        i = self._next
        self._next += 1
        out = self._plugin.request(self, Chunk(self.index, self._tokens[i], i == len(self._tokens) - 1))
        assert out is not None  # a chunk's answer is its PCM
        return out

    def cancel(self) -> None:
        self._tokens = []

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._tokens = []
            try:
                self._plugin.request(self, Leave(self.index))
            finally:  # the slot is free for the next session even if the batch failed
                self._plugin.release(self.slot)


class Token2WavRowsPlugin(ModelPlugin):
    """The module docstring's plugin: ``slots`` sessions as the rows of one ``BatchedStreams``."""

    def __init__(
        self,
        depth: str = "full",
        *,
        slots: int,
        seed: int = 0,
        max_reply_chunks: int = 8,
        weights: str | Path | None = None,
        prompt: str | Path | None = None,
        record: bool = False,
    ) -> None:
        started = time.perf_counter()
        if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
            raise ValueError(f"slots must be a positive integer (sessions as the rows of one batch), got {slots!r}")
        name, self.device = check_settings(depth, max_reply_chunks)
        self.depth, self.seed, self.max_reply_chunks, self.slots = depth, seed, max_reply_chunks, slots
        self.weights = None if weights is None else str(weights)
        flow, hift, self.prompt, what = build_models(depth, self.device, seed, weights, prompt)
        self.info = PluginInfo(
            name=name,
            input_rate=INPUT_RATE,
            output_rate=OUTPUT_RATE,
            frame_samples=FRAME_SAMPLES,
            description=f"MiniCPM-o 4.5 Token2Wav ({what}), sessions as the rows of one batch of {slots} "
            "under the batch-invariant envelope, on stand-in speech tokens",
        )
        self.batched = BatchedStreams(flow, hift, capacity=slots, record=record)
        self.batched.share_prompt(self.prompt)  # every row's first turn starts from it: no join computes it
        self._lock = threading.Lock()
        self.streams = 0  # streams ever opened
        self.chunks = 0  # chunks the rows ran (on the scheduler's thread)
        self.calls_by_rows: dict[int, int] = {}  # the batch's calls by the rows they held
        self.scheduler = SlotScheduler(slots, self._tick, name=name, record=record)
        self.startup_s = time.perf_counter() - started
        print(
            f"{name}: {slots} slots as the rows of one batch; prompt state ready; start-up took {self.startup_s:.1f} s",
            file=sys.stderr,
            flush=True,
        )

    # -- the scheduler's side ------------------------------------------------------------------------

    def request(self, stream: RowStream, request: TurnStart | Chunk | Leave) -> np.ndarray | None:
        """``request`` run at the scheduler's next tick that takes it; its answer (a chunk's PCM)."""
        future = self.scheduler.submit(stream.slot, [request], follows=stream.follows)
        (out,) = future.result()
        return out

    def _tick(self, requests: dict[int, Any], joins: tuple[int, ...]) -> dict[int, np.ndarray | None]:
        """On the scheduler's thread: every slot's request of this tick (``joins`` needs nothing: a
        row joins at its session's first turn start)."""
        outs: dict[int, np.ndarray | None] = {}
        chunks: dict[int, Chunk] = {}
        for slot, request in requests.items():
            if isinstance(request, TurnStart):
                if request.key in self.batched.rows:
                    self.batched.reset_turn(request.key)
                else:
                    self.batched.join(request.key, self.prompt, rng_seed(self.seed, request.key))
                outs[slot] = None
            elif isinstance(request, Leave):
                if request.key in self.batched.rows:
                    self.batched.leave(request.key)
                outs[slot] = None
            else:
                chunks[slot] = request
        if chunks:
            done = self.batched.step({c.key: c.tokens for c in chunks.values()}, last={c.key for c in chunks.values() if c.last})
            for slot, chunk in chunks.items():
                outs[slot] = done[chunk.key].speech.float().reshape(-1).cpu().numpy()
            with self._lock:
                self.chunks += len(chunks)
                self.calls_by_rows = dict(sorted(self.batched.call_rows.items()))
        return outs

    # -- admission -----------------------------------------------------------------------------------

    def reserve(self, sessions: int) -> None:
        """The batch holds ``slots`` sessions: a server that admits more is refused at start-up."""
        if sessions > self.slots:
            raise ValueError(
                f"{self.info.name} holds {self.slots} sessions as the rows of one batch, not {sessions}: "
                f"give it slots={sessions} or admit at most {self.slots} sessions"
            )

    def free_slots(self) -> int:
        return self.scheduler.free

    def open_stream(self) -> RowStream:
        """A session on the lowest free slot; ``SlotsFull`` when every slot is taken."""
        slot = self.scheduler.acquire()
        with self._lock:
            stream = RowStream(self, self.streams, slot)
            self.streams += 1
        return stream

    def release(self, slot: int) -> None:
        self.scheduler.release(slot)

    def describe(self) -> dict[str, Any]:
        with self._lock:
            streams, chunks, calls_by_rows = self.streams, self.chunks, dict(self.calls_by_rows)
        return {
            "model": self.info.name,
            "depth": self.depth,
            "weights": self.weights or "random",
            "device": str(self.device),
            "slots": self.slots,
            "envelope": envelope(self.slots),
            "streams": streams,
            "streams_open": self.slots - self.scheduler.free,
            "chunks": chunks,
            "ticks": self.scheduler.ticks,
            "calls_by_rows": calls_by_rows,
            "tick_seconds": self.scheduler.seconds.as_dict(),
            "startup_seconds": round(self.startup_s, 2),
        }

    def close(self) -> None:
        self.scheduler.close()
