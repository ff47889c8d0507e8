"""``tone``: a TEST DOUBLE, not a model.

It stands in for a real model so the service can be tested exactly: its reply is a 440 Hz sine
whose length is a pure function of the user turn's length (half as long, in whole 40 ms chunks,
at least one chunk). It reads nothing of the audio's content. Optional delays simulate compute
time per frame and per chunk, for backpressure and mid-response tests.

It ships in the installed package, not in tests/, because it is a model users serve, not only a
test's tool: ``cadence-fx serve --model tone`` is the service without weights or a GPU, exact to
the sample (docs/service.md's first commands; docs/deployment.md's two Ray replicas), and the
in-process API's documented example (serve/inprocess.py) opens its session on ``ToneModel()``.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from .base import ModelPlugin, ModelStream, PluginInfo

INPUT_RATE = 16_000
OUTPUT_RATE = 24_000
FRAME_SAMPLES = 320  # 20 ms at 16 kHz
CHUNK_SAMPLES = 960  # 40 ms at 24 kHz
FREQUENCY_HZ = 440.0
AMPLITUDE = 0.25


def reply_chunks(turn_samples: int) -> int:
    """Chunks in the reply to a turn of ``turn_samples`` input-rate samples."""
    reply_samples = turn_samples * OUTPUT_RATE // INPUT_RATE // 2
    return max(1, -(-reply_samples // CHUNK_SAMPLES))


def render(n_chunks: int) -> np.ndarray:
    """The whole reply of ``n_chunks`` chunks, as ``step`` yields it chunk by chunk."""
    t = np.arange(n_chunks * CHUNK_SAMPLES, dtype=np.float64)
    return (AMPLITUDE * np.sin(2.0 * math.pi * FREQUENCY_HZ * t / OUTPUT_RATE)).astype(np.float32)


class ToneStream(ModelStream):
    def __init__(self, feed_delay_s: float, step_delay_s: float) -> None:
        self._feed_delay_s = feed_delay_s
        self._step_delay_s = step_delay_s
        self.turn_samples = 0
        self.frames_fed = 0
        self._reply: np.ndarray | None = None
        self._next = 0

    def feed(self, frame: np.ndarray) -> None:
        assert frame.shape == (FRAME_SAMPLES,) and frame.dtype == np.float32, (frame.shape, frame.dtype)
        if self._feed_delay_s:
            time.sleep(self._feed_delay_s)
        self.turn_samples += FRAME_SAMPLES
        self.frames_fed += 1

    def clear_input(self) -> None:
        self.turn_samples = 0

    def begin_response(self) -> None:
        self._reply = render(reply_chunks(self.turn_samples))
        self._next = 0
        self.turn_samples = 0

    def step(self) -> np.ndarray | None:
        if self._reply is None or self._next >= len(self._reply):
            self._reply = None
            return None
        if self._step_delay_s:
            time.sleep(self._step_delay_s)
        chunk = self._reply[self._next : self._next + CHUNK_SAMPLES]
        self._next += CHUNK_SAMPLES
        return chunk

    def cancel(self) -> None:
        self._reply = None


class ToneModel(ModelPlugin):
    info = PluginInfo(
        name="tone",
        input_rate=INPUT_RATE,
        output_rate=OUTPUT_RATE,
        frame_samples=FRAME_SAMPLES,
        description="test double: a sine reply half as long as the user turn; not a model",
    )

    def __init__(self, feed_delay_s: float = 0.0, step_delay_s: float = 0.0) -> None:
        self.feed_delay_s = feed_delay_s
        self.step_delay_s = step_delay_s
        self.streams = 0

    def open_stream(self) -> ToneStream:
        self.streams += 1
        return ToneStream(self.feed_delay_s, self.step_delay_s)

    def describe(self) -> dict[str, Any]:
        return {
            "model": self.info.name,
            "streams": self.streams,
            "feed_delay_s": self.feed_delay_s,
            "step_delay_s": self.step_delay_s,
        }
