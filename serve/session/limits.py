"""Every bound the service enforces, in one frozen record passed to the app factory."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    max_sessions: int = 16  # admission: more live sessions get ``resource_exhausted``
    max_frame_bytes: int = 1 << 20  # larger text frames get ``frame_too_large``
    max_pending_input_bytes: int = 1 << 20  # decoded audio queued per session: ``input_backpressure``
    max_pending_commands: int = 1024  # commands queued per session: ``input_backpressure``
    max_outbound_events: int = 20_000  # a client that reads slower than this is disconnected
    idle_ttl_s: float = 300.0  # no client frame and no response for this long: session expires
    grace_s: float = 30.0  # disconnected duplex session waits this long for a resume
    max_session_s: float = 3600.0
    reap_interval_s: float = 0.25
    heartbeat_s: float = 0.0  # 0: no session.heartbeat events
    journal_max_events: int = 4096
    journal_max_bytes: int = 16 << 20
    workers: int = 4  # threads for decode and resampling (model calls get one thread per session slot)

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 0:
                raise ValueError(f"Limits.{name} must not be negative, got {value}")
