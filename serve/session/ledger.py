"""Ledgers: where every input byte and every output sample of a session went.

Invariants (checked by ``check``):
  input:    received = committed + cleared + buffered
  model in: resampled + padded = fed + discarded + pending
  playback: per response, generated model samples = delivered + dropped (at the model rate)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class InputLedger:
    received_bytes: int = 0  # appended audio accepted into the buffer
    committed_bytes: int = 0
    cleared_bytes: int = 0
    rejected_bytes: int = 0  # appended but refused (backpressure, bad length); never buffered
    rejected_appends: int = 0  # refused appends, including those whose bytes are unknown (bad base64)
    resampled_samples: int = 0  # at the model's input rate
    fed_samples: int = 0
    padded_samples: int = 0  # zeros that completed the last frame of a turn the client committed (a VAD turn pads none)
    discarded_samples: int = 0  # partial frame dropped by a clear
    pending_samples: int = 0  # partial frame waiting for more input

    @property
    def buffered_bytes(self) -> int:
        return self.received_bytes - self.committed_bytes - self.cleared_bytes


@dataclass
class ResponseLedger:
    created: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0


@dataclass
class PlaybackLedger:
    generated_samples: int = 0  # at the model's output rate
    delivered_samples: int = 0  # model-rate samples whose audio went out in deltas
    dropped_samples: int = 0  # model-rate samples fenced off by cancel or barge-in
    delivered_bytes: int = 0  # in the output format
    acked_ms: int = 0  # sum over responses of the highest playback.ack
    truncated_ms: int = 0


@dataclass
class Ledgers:
    input: InputLedger = field(default_factory=InputLedger)
    responses: ResponseLedger = field(default_factory=ResponseLedger)
    playback: PlaybackLedger = field(default_factory=PlaybackLedger)
    history_items: int = 0
    history_audio_dropped_bytes: int = 0  # committed turns' audio dropped to keep the input budget

    def check(self) -> None:
        i, p = self.input, self.playback
        assert i.buffered_bytes >= 0, self
        assert i.resampled_samples + i.padded_samples == i.fed_samples + i.discarded_samples + i.pending_samples, i
        assert p.generated_samples == p.delivered_samples + p.dropped_samples, p

    def to_dict(self) -> dict:
        out = asdict(self)
        out["input"]["buffered_bytes"] = self.input.buffered_bytes
        return out
