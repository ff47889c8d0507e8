"""Every bound the service enforces, in one frozen record passed to the app factory.

A session's memory is bounded in bytes, in three parts (docs/serving.md, "The service's limits, delivery guarantee and access"):

* ``input_bytes``: commands that carry data (appends, item and session updates, response requests)
  while queued, the uncommitted input audio, and the kept history: conversation items and the
  audio of committed turns. A data command that would exceed it gets ``input_backpressure``; the
  audio of the oldest turns is dropped first to make room (their items stay).
* ``outbound_bytes``: events queued for one socket and not yet written. A client that falls this
  far behind is disconnected with 4008: the queue and the event that did not fit are dropped. A
  duplex client resumes and loses none of them, because
* ``journal_bytes`` (at least ``outbound_bytes`` plus the largest event): the newest events of a
  duplex session, kept for a resume, hold whatever the socket's queue can hold and the event that
  overflowed it. (A journal of only ``outbound_bytes`` lost the older of two 9 MB retrieve answers,
  one queued and one overflowing, at such a close: issue 41.)
"""

from __future__ import annotations

from dataclasses import dataclass

# Room for an event's own fields around its largest payload (ids are at most 256 characters).
EVENT_ENVELOPE_BYTES = 16 << 10


@dataclass(frozen=True)
class Limits:
    max_sessions: int = 16  # admission: more live sessions get ``resource_exhausted``
    max_sessions_per_client: int = 4  # live sessions one client address may hold
    max_frame_bytes: int = 1 << 20  # larger text frames get ``frame_too_large``
    max_pending_input_bytes: int = 1 << 20  # decoded audio queued per session: ``input_backpressure``
    max_pending_commands: int = 1024  # commands queued per session: ``input_backpressure``
    input_bytes: int = 8 << 20  # per session: queued data commands + uncommitted audio + kept history
    outbound_bytes: int = 12 << 20  # per socket: events not yet written; beyond: close 4008
    journal_bytes: int = 24 << 20  # per duplex session: the newest events, kept for a resume
    idle_ttl_s: float = 300.0  # no client frame and no response for this long: session expires
    grace_s: float = 30.0  # disconnected duplex session waits this long for a resume
    max_session_s: float = 3600.0
    bind_timeout_s: float = 10.0  # a socket opened to resume, still without a session after this: closed
    max_resume_failures: int = 3  # wrong tokens or unknown sessions per socket before it is closed
    drain_s: float = 10.0  # at shutdown, how long responses in progress may still run
    reap_interval_s: float = 0.25
    heartbeat_s: float = 0.0  # 0: no session.heartbeat events
    workers: int = 4  # threads for decode and resampling (model calls get one thread per session slot)
    reply_lead_s: float = 0.0  # 0: a reply is computed as fast as the model goes; above: at most this far ahead of playback
    request_timeout_s: float = 10.0  # an HTTP request (a WebSocket handshake too) must arrive whole within this: 408, closed

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 0:
                raise ValueError(f"Limits.{name} must not be negative, got {value}")
        if self.max_sessions_per_client < 1:
            raise ValueError("Limits.max_sessions_per_client must be at least 1")
        if self.request_timeout_s <= 0:
            raise ValueError(
                f"Limits.request_timeout_s must be above 0 (seconds a request may take to arrive whole), "
                f"got {self.request_timeout_s}"
            )
        if self.outbound_bytes < self.largest_event_bytes:
            raise ValueError(
                f"Limits.outbound_bytes ({self.outbound_bytes}) must hold the largest event a session can "
                f"send, {self.largest_event_bytes} bytes: a retrieved turn of input_bytes of audio in base64, "
                "or a client's largest frame echoed back"
            )
        if self.journal_bytes < self.min_journal_bytes:
            raise ValueError(
                f"Limits.journal_bytes ({self.journal_bytes}) must be at least Limits.outbound_bytes "
                f"({self.outbound_bytes}) plus the largest event ({self.largest_event_bytes} bytes), "
                f"{self.min_journal_bytes}: at a 4008 close the socket's queue and the event that did not fit "
                "are dropped, and the journal must still hold all of them for the resume"
            )

    @property
    def largest_event_bytes(self) -> int:
        """An upper bound on one encoded event: a turn's audio (at most ``input_bytes``) in base64,
        plus the largest client frame it may carry along (an item, the instructions), plus its
        envelope. The history's item ids in ``session.resync_required`` fit the same bound, since
        every id is part of an item counted in ``input_bytes``."""
        return 4 * -(-self.input_bytes // 3) + self.max_frame_bytes + EVENT_ENVELOPE_BYTES

    @property
    def min_journal_bytes(self) -> int:
        """What a 4008 close drops, at most: a full outbound queue (``outbound_bytes``; a duplex
        session's events are the journal's own texts) and the event that did not fit. The event
        the socket's writer is sending, and those in the network's buffers, are not dropped: they
        reach a client that reads again."""
        return self.outbound_bytes + self.largest_event_bytes
