"""Energy-based server VAD over 10 ms frames of the client's audio.

A frame is speech when its RMS exceeds a gate of ``-70 + 50 * threshold`` dBFS (threshold 0.5:
-45 dBFS). Speech starts at the first speech frame after silence; it stops once
``silence_duration_ms`` of consecutive silence has followed. Times count client-rate samples since
the session began, so they match the Realtime ``audio_start_ms`` / ``audio_end_ms`` fields.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..protocol import TurnDetection


@dataclass(frozen=True)
class VadEdge:
    kind: str  # "started" or "stopped"
    ms: int


class EnergyVad:
    def __init__(self, rate: int, config: TurnDetection, start_sample: int = 0) -> None:
        self.rate = rate
        self.frame = rate // 100
        self.gate = 10.0 ** ((-70.0 + 50.0 * config.threshold) / 20.0)
        self.prefix_samples = config.prefix_padding_ms * rate // 1000
        self.silence_frames = max(1, -(-config.silence_duration_ms // 10))
        self.samples = start_sample  # samples consumed into whole frames
        self._carry = np.zeros(0, dtype=np.float32)
        self.speaking = False
        self._silent_run = 0

    @property
    def received(self) -> int:
        """Samples taken so far, the partial 10 ms frame included."""
        return self.samples + len(self._carry)

    def process(self, x: np.ndarray) -> list[VadEdge]:
        x = np.concatenate([self._carry, x]) if len(self._carry) else x
        n = len(x) // self.frame
        self._carry = x[n * self.frame :].copy()
        if n == 0:
            return []
        frames = x[: n * self.frame].astype(np.float64).reshape(n, self.frame)
        speech = np.sqrt((frames * frames).mean(axis=1)) > self.gate
        edges = []
        for is_speech in speech:
            self.samples += self.frame
            if is_speech:
                self._silent_run = 0
                if not self.speaking:
                    self.speaking = True
                    onset = self.samples - self.frame
                    edges.append(VadEdge("started", max(0, onset - self.prefix_samples) * 1000 // self.rate))
            elif self.speaking:
                self._silent_run += 1
                if self._silent_run >= self.silence_frames:
                    self.speaking = False
                    self._silent_run = 0
                    edges.append(VadEdge("stopped", self.samples * 1000 // self.rate))
        return edges
