"""Audio formats of the Realtime wire and conversion to and from a model's native rate.

Wire formats: GA ``audio/pcm`` (16-bit little-endian mono, 24 kHz only), ``audio/pcmu`` and
``audio/pcma`` (G.711 at 8 kHz); on input the beta spellings ``pcm16``, ``g711_ulaw`` and
``g711_alaw`` are accepted too and normalised to GA.  A duplex connection also takes vLLM-Omni's
``pcm_f32le`` (32-bit float little-endian mono) and 16-bit or float PCM at any of
``DUPLEX_PCM_RATES`` (``serve/protocol/duplex.py`` reads those fields); a rate outside them is
refused, never read as another.  Inside the service audio is float32 in [-1, 1).  Everything here
is pure numpy/scipy and safe to run in a worker thread.
"""

from __future__ import annotations

import base64
import binascii
import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from scipy import signal

from .errors import ProtocolError, quoted

Encoding = Literal["pcm16", "pcmu", "pcma", "f32le"]

_GA_TYPE = {"pcm16": "audio/pcm", "pcmu": "audio/pcmu", "pcma": "audio/pcma", "f32le": "audio/pcm_f32le"}
_BETA_TYPE: dict[str, Encoding] = {"pcm16": "pcm16", "g711_ulaw": "pcmu", "g711_alaw": "pcma"}
# The beta-style names of each encoding, as vLLM-Omni's duplex fields spell them.
BETA_NAME = {"pcm16": "pcm16", "pcmu": "g711_ulaw", "pcma": "g711_alaw", "f32le": "pcm_f32le"}
_BYTES = {"pcm16": 2, "pcmu": 1, "pcma": 1, "f32le": 4}
_G711_RATE = 8000
PCM_RATE = 24000
# The PCM rates a duplex connection may declare (vLLM-Omni's clients send 16 and 24 kHz); every
# one is resampled to and from the model's own rate.
DUPLEX_PCM_RATES = (8000, 16000, 22050, 24000, 32000, 44100, 48000)


@dataclass(frozen=True)
class AudioFormat:
    """One wire audio format: its encoding and sample rate."""

    encoding: Encoding
    rate: int

    @property
    def bytes_per_sample(self) -> int:
        return _BYTES[self.encoding]

    def to_wire(self) -> dict[str, Any]:
        """The GA JSON spelling (``{"type": "audio/pcm", "rate": 24000}``)."""
        if self.encoding in ("pcm16", "f32le"):
            return {"type": _GA_TYPE[self.encoding], "rate": self.rate}
        return {"type": _GA_TYPE[self.encoding]}

    def duration_ms(self, n_bytes: int) -> float:
        return n_bytes * 1000.0 / (self.rate * self.bytes_per_sample)

    def samples(self, n_bytes: int) -> int:
        return n_bytes // self.bytes_per_sample

    def ms(self, n_samples: int) -> int:
        return n_samples * 1000 // self.rate


PCM24K = AudioFormat("pcm16", PCM_RATE)
PCMU = AudioFormat("pcmu", _G711_RATE)
PCMA = AudioFormat("pcma", _G711_RATE)


def duplex_format(encoding_name: object, rate: object, param: str) -> AudioFormat:
    """vLLM-Omni's spelling of a format (``pcm16`` or ``pcm_f32le`` with ``sample_rate_hz``; the
    G.711 names at 8 kHz), else ``unsupported_audio_format`` naming what is served."""
    names: dict[str, Encoding] = {
        "pcm16": "pcm16",
        "pcm_s16le": "pcm16",
        "s16le": "pcm16",
        "pcm_f32le": "f32le",
        "f32le": "f32le",
        "g711_ulaw": "pcmu",
        "g711_alaw": "pcma",
    }
    encoding = names.get(encoding_name) if isinstance(encoding_name, str) else None
    if encoding is None:
        raise ProtocolError(
            "unsupported_audio_format",
            f"unsupported audio format {quoted(encoding_name)}; served: pcm16, pcm_f32le, g711_ulaw, g711_alaw",
            param,
        )
    if encoding in ("pcmu", "pcma"):
        if rate not in (None, _G711_RATE):
            raise ProtocolError("unsupported_audio_format", f"G.711 is 8000 Hz only, got {quoted(rate)}", param)
        return AudioFormat(encoding, _G711_RATE)
    if rate is None:
        rate = PCM_RATE
    if isinstance(rate, bool) or not isinstance(rate, int) or rate not in DUPLEX_PCM_RATES:
        raise ProtocolError(
            "unsupported_audio_format",
            f"sample rate {quoted(rate)} Hz is not served; served rates: {', '.join(map(str, DUPLEX_PCM_RATES))}",
            param,
        )
    return AudioFormat(encoding, rate)


def parse_format(value: object, param: str, duplex: bool = False) -> AudioFormat:
    """A GA format object or a beta format string, else ``unsupported_audio_format``. ``duplex``: a
    duplex connection's, where ``audio/pcm`` may have any of ``DUPLEX_PCM_RATES`` and
    ``audio/pcm_f32le`` and ``pcm_f32le`` are served too (vLLM-Omni's extension)."""
    if duplex and isinstance(value, str) and value != "pcm16":
        return duplex_format(value, None, param)
    if duplex and isinstance(value, dict) and value.get("type") in ("audio/pcm", "audio/pcm_f32le"):
        name = "pcm16" if value["type"] == "audio/pcm" else "pcm_f32le"
        return duplex_format(name, value.get("rate", PCM_RATE), f"{param}.rate")
    if isinstance(value, str):
        encoding = _BETA_TYPE.get(value)
        if encoding is None:
            raise ProtocolError("unsupported_audio_format", f"unsupported audio format {quoted(value)}", param)
        return PCM24K if encoding == "pcm16" else AudioFormat(encoding, _G711_RATE)
    if not isinstance(value, dict):
        raise ProtocolError("invalid_value", "audio format must be an object or a string", param)
    kind = value.get("type")
    if kind == "audio/pcm":
        rate = value.get("rate", PCM_RATE)
        if rate != PCM_RATE:
            raise ProtocolError(
                "unsupported_audio_format", f"audio/pcm is 24000 Hz only, got rate {quoted(rate)}", f"{param}.rate"
            )
        return PCM24K
    if kind == "audio/pcmu":
        return PCMU
    if kind == "audio/pcma":
        return PCMA
    raise ProtocolError("unsupported_audio_format", f"unsupported audio format type {quoted(kind)}", f"{param}.type")


def b64decode(text: str, param: str = "audio") -> bytes:
    """Strict base64 (RFC 4648 alphabet, padding required); anything else is ``invalid_base64``."""
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ProtocolError("invalid_base64", f"audio is not valid base64: {exc}", param) from None


def b64encode(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


# G.711 per ITU-T G.711 as in the reference g711.c; tables are built once over every code/sample.
_SEG_UEND = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF])
_SEG_AEND = np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF])


def _build_ulaw_encode() -> np.ndarray:
    pcm = np.arange(-32768, 32768, dtype=np.int64) >> 2
    mask = np.where(pcm < 0, 0x7F, 0xFF)
    mag = np.minimum(np.abs(pcm), 8159) + (0x84 >> 2)
    seg = np.searchsorted(_SEG_UEND, mag, side="left")
    uval = (seg << 4) | ((mag >> (seg + 1)) & 0xF)
    return (np.where(seg >= 8, 0x7F, uval) ^ mask).astype(np.uint8)


def _build_ulaw_decode() -> np.ndarray:
    u = ~np.arange(256, dtype=np.int64) & 0xFF
    t = (((u & 0xF) << 3) + 0x84) << ((u & 0x70) >> 4)
    return np.where(u & 0x80, 0x84 - t, t - 0x84).astype(np.int16)


def _build_alaw_encode() -> np.ndarray:
    pcm = np.arange(-32768, 32768, dtype=np.int64) >> 3
    mask = np.where(pcm >= 0, 0xD5, 0x55)
    mag = np.where(pcm >= 0, pcm, -pcm - 1)
    seg = np.searchsorted(_SEG_AEND, mag, side="left")
    quant = np.where(seg < 2, mag >> 1, mag >> np.maximum(seg, 1)) & 0xF
    aval = (seg << 4) | quant
    return (np.where(seg >= 8, 0x7F, aval) ^ mask).astype(np.uint8)


def _build_alaw_decode() -> np.ndarray:
    a = np.arange(256, dtype=np.int64) ^ 0x55
    t = (a & 0xF) << 4
    seg = (a & 0x70) >> 4
    t = np.where(seg == 0, t + 8, (t + 0x108) << np.maximum(seg - 1, 0))
    return np.where(a & 0x80, t, -t).astype(np.int16)


_ULAW_ENCODE, _ULAW_DECODE = _build_ulaw_encode(), _build_ulaw_decode()
_ALAW_ENCODE, _ALAW_DECODE = _build_alaw_encode(), _build_alaw_decode()


def decode_samples(data: bytes, fmt: AudioFormat, param: str = "audio") -> np.ndarray:
    """Wire bytes to float32 samples: in [-1, 1) from the integer formats; float input is taken as
    it is, and must be finite and within [-1, 1] (a value outside is not audio in this format:
    int16 bytes read as floats, say)."""
    if fmt.encoding == "f32le":
        if len(data) % 4:
            raise ProtocolError("invalid_audio_length", f"pcm_f32le needs whole 32-bit samples, got {len(data)} bytes", param)
        x = np.frombuffer(data, dtype="<f4").astype(np.float32)
        bad = ~(np.abs(x) <= 1.0)  # NaN fails the comparison too
        if bad.any():
            index = int(np.argmax(bad))
            raise ProtocolError(
                "invalid_value",
                f"pcm_f32le sample {index} is {float(x[index])!r}: samples must be finite and within [-1, 1]",
                param,
            )
        return x
    if fmt.encoding == "pcm16":
        if len(data) % 2:
            raise ProtocolError("invalid_audio_length", f"audio/pcm needs whole 16-bit samples, got {len(data)} bytes", param)
        pcm = np.frombuffer(data, dtype="<i2")
    else:
        table = _ULAW_DECODE if fmt.encoding == "pcmu" else _ALAW_DECODE
        pcm = table[np.frombuffer(data, dtype=np.uint8)]
    return pcm.astype(np.float32) / np.float32(32768.0)


def encode_samples(samples: np.ndarray, fmt: AudioFormat) -> bytes:
    """float32 samples to wire bytes; int16-representable values round-trip exactly."""
    if fmt.encoding == "f32le":
        return np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0).astype("<f4").tobytes()
    pcm = np.clip(np.rint(np.asarray(samples, dtype=np.float64) * 32768.0), -32768, 32767).astype(np.int16)
    if fmt.encoding == "pcm16":
        return pcm.astype("<i2").tobytes()
    table = _ULAW_ENCODE if fmt.encoding == "pcmu" else _ALAW_ENCODE
    return table[pcm.astype(np.int64) + 32768].tobytes()


class StreamResampler:
    """Rational-rate polyphase resampler that keeps its filter state across chunks.

    Feeding a signal in any chunking yields bit-identical output to feeding it whole, and after
    ``n`` input samples exactly ``ceil(n * up / down)`` output samples have come out (the filter's
    group delay shows as latency, never as lost or extra samples).
    """

    def __init__(self, src_rate: int, dst_rate: int, half_width: int = 10) -> None:
        g = math.gcd(src_rate, dst_rate)
        self.src_rate, self.dst_rate = src_rate, dst_rate
        self.up, self.down = dst_rate // g, src_rate // g
        self.samples_in = 0
        self.samples_out = 0
        if self.up == self.down == 1:
            self._taps = None
            return
        span = max(self.up, self.down)
        self._taps = signal.firwin(2 * half_width * span + 1, 1.0 / span, window=("kaiser", 5.0)) * self.up
        self._zi = np.zeros(len(self._taps) - 1)
        self._phase = 0  # index of the next upsampled sample, modulo ``down``

    def process(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        self.samples_in += len(x)
        if self._taps is None or len(x) == 0:  # lfilter refuses an empty signal
            self.samples_out += len(x)
            return x.copy()
        stuffed = np.zeros(len(x) * self.up)
        stuffed[:: self.up] = x
        filtered, self._zi = signal.lfilter(self._taps, 1.0, stuffed, zi=self._zi)
        start = (-self._phase) % self.down
        out = filtered[start :: self.down].astype(np.float32)
        self._phase = (self._phase + len(stuffed)) % self.down
        self.samples_out += len(out)
        return out

    def expected_out(self, n_in: int) -> int:
        return -(-n_in * self.up // self.down)
