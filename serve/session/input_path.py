"""A session's input audio, from an append's base64 to the model's native frames.

The session's input format (``session.audio.input.format``) is what its buffer, its VAD and its
ledgers count in. An append may declare its own ``format`` and ``sample_rate_hz`` (vLLM-Omni's
clients always do): one that matches the session's is read as it is; another is read in the
format it declares and converted to the session's (its rate resampled, with a resampler per
declared format that keeps its state from one append to the next), so no audio is ever read in a
format it is not in. A declared ``duration_ms`` that the bytes do not make (by more than the
client's rounding, 1 ms) is refused: the bytes and the declaration disagree about what the audio
is. Everything here but ``declared`` runs in a worker thread, one append at a time.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..protocol import ProtocolError, StreamResampler, client_commands, quoted
from ..protocol import audio as wire_audio
from .vad import EnergyVad

# How far a declared duration may be from the bytes': vLLM-Omni's client rounds it to the millisecond.
_DURATION_SLACK_MS = 1.0


class InputPath:
    def __init__(self, fmt: wire_audio.AudioFormat, model_rate: int, frame_samples: int) -> None:
        self.model_rate = model_rate
        self.frame_samples = frame_samples
        self.format = fmt
        self._resampler = StreamResampler(fmt.rate, model_rate)
        self._converters: dict[wire_audio.AudioFormat, StreamResampler] = {}
        self.frame = np.zeros(0, dtype=np.float32)  # the partial native frame

    def set_format(self, fmt: wire_audio.AudioFormat) -> None:
        """The session's input format changed (session.update)."""
        if fmt != self.format:
            self.format = fmt
            self._resampler = StreamResampler(fmt.rate, self.model_rate)
            self._converters.clear()

    def declared(self, cmd: client_commands.InputAudioBufferAppend) -> wire_audio.AudioFormat:
        """The format the append is in: its own declaration, else the session's."""
        if cmd.format is None and cmd.sample_rate_hz is None:
            return self.format
        current = wire_audio.BETA_NAME[self.format.encoding]
        name = cmd.format if cmd.format is not None else current
        rate = cmd.sample_rate_hz
        if rate is None and name == current:
            rate = self.format.rate
        return wire_audio.duplex_format(name, rate, "format" if cmd.format is not None else "sample_rate_hz")

    def ingest(
        self, cmd: client_commands.InputAudioBufferAppend, fmt: wire_audio.AudioFormat, vad: EnergyVad | None
    ) -> tuple[bytes, list[np.ndarray], list[tuple[Any, int, int]], int]:
        """Worker thread: decode (in ``fmt``, then to the session's format), run the VAD, resample
        and cut into native frames. Returns the bytes in the session's format, the frames, each VAD
        edge with where it falls (how many of the bytes, and of the frames, lie before it), and how
        many model-rate samples the resampler made."""
        data = wire_audio.b64decode(cmd.audio)
        try:
            x = wire_audio.decode_samples(data, fmt)
            self._check_duration(cmd, fmt, len(data))
        except ProtocolError as err:
            err.audio_bytes = len(data)
            raise
        if fmt != self.format:
            converter = self._converters.get(fmt)
            if converter is None:
                converter = self._converters[fmt] = StreamResampler(fmt.rate, self.format.rate)
            x = converter.process(x)
            data = wire_audio.encode_samples(x, self.format)
            x = wire_audio.decode_samples(data, self.format)  # as the buffer holds it, exactly
        session_fmt = self.format
        start = vad.received if vad is not None else 0
        edges = vad.process(x) if vad is not None else []
        y = self._resampler.process(x)
        pending = np.concatenate([self.frame, y])
        size = self.frame_samples
        n = len(pending) // size
        frames = [pending[i * size : (i + 1) * size] for i in range(n)]
        placed = []
        for edge in edges:
            into_x = min(len(x), max(0, edge.ms * session_fmt.rate // 1000 - start))
            into_y = into_x * len(y) // max(len(x), 1)
            placed.append((edge, into_x * session_fmt.bytes_per_sample, min(n, (len(self.frame) + into_y) // size)))
        self.frame = pending[n * size :]
        return data, frames, placed, len(y)

    @staticmethod
    def _check_duration(cmd: client_commands.InputAudioBufferAppend, fmt: wire_audio.AudioFormat, n_bytes: int) -> None:
        if cmd.duration_ms is None:
            return
        actual = fmt.duration_ms(n_bytes)
        if abs(cmd.duration_ms - actual) > _DURATION_SLACK_MS:
            raise ProtocolError(
                "invalid_value",
                f"duration_ms {quoted(cmd.duration_ms)} does not match the audio: {n_bytes} bytes of "
                f"{wire_audio.BETA_NAME[fmt.encoding]} at {fmt.rate} Hz are {actual:.1f} ms",
                "duration_ms",
            )

    def take_padded(self) -> tuple[np.ndarray, int] | None:
        """The partial frame zero-padded to a whole one, and the padding; None if there is none."""
        if len(self.frame) == 0:
            return None
        pad = self.frame_samples - len(self.frame)
        frame = np.concatenate([self.frame, np.zeros(pad, dtype=np.float32)])
        self.frame = np.zeros(0, dtype=np.float32)
        return frame, pad

    def discard(self) -> int:
        """Drop the partial frame (the client cleared its input); returns its samples."""
        dropped = len(self.frame)
        self.frame = np.zeros(0, dtype=np.float32)
        return dropped
