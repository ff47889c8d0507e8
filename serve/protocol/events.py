"""The server events of the Realtime wire, typed: a dataclass per event, named by its ``TYPE``, all
of them in ``EVENTS``. A ``JOURNALED`` event carries a ``server_event_seq`` and is replayed on
resume; a connection-level one is not.

Tiers (``tiers.py``): GA events with GA fields, those fields plus ours made with ``tier2()``, and
our own events (``TIER = 3``). ``codec`` is the only place that turns them into JSON and back; the
client's side is ``client_commands.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .tiers import tier2


@dataclass(kw_only=True)
class ServerEvent:
    TYPE: ClassVar[str]
    TIER: ClassVar[int] = 1
    # Journaled events carry a server_event_seq and are replayed on resume; connection-level
    # events (resumed, replaced, resync_required, heartbeat, expired, closed) are not.
    JOURNALED: ClassVar[bool] = True
    event_id: str = ""
    server_event_seq: int | None = tier2()


@dataclass(kw_only=True)
class SessionCreated(ServerEvent):
    TYPE = "session.created"
    # A client that never saw session.created cannot resume, so there is nothing to replay.
    JOURNALED = False
    session: dict
    resume_token: str | None = tier2()
    generation: int | None = tier2()


@dataclass(kw_only=True)
class SessionUpdated(ServerEvent):
    TYPE = "session.updated"
    session: dict


@dataclass(kw_only=True)
class InputAudioBufferCommitted(ServerEvent):
    TYPE = "input_audio_buffer.committed"
    item_id: str
    previous_item_id: str | None = None
    turn_id: int | None = tier2()
    audio_bytes: int | None = tier2()


@dataclass(kw_only=True)
class InputAudioBufferCleared(ServerEvent):
    TYPE = "input_audio_buffer.cleared"
    audio_bytes: int | None = tier2()


@dataclass(kw_only=True)
class InputAudioBufferSpeechStarted(ServerEvent):
    TYPE = "input_audio_buffer.speech_started"
    audio_start_ms: int
    item_id: str


@dataclass(kw_only=True)
class InputAudioBufferSpeechStopped(ServerEvent):
    TYPE = "input_audio_buffer.speech_stopped"
    audio_end_ms: int
    item_id: str


@dataclass(kw_only=True)
class ConversationItemAdded(ServerEvent):
    TYPE = "conversation.item.added"
    item: dict
    previous_item_id: str | None = None


@dataclass(kw_only=True)
class ConversationItemDone(ServerEvent):
    TYPE = "conversation.item.done"
    item: dict
    previous_item_id: str | None = None


@dataclass(kw_only=True)
class ConversationItemRetrieved(ServerEvent):
    TYPE = "conversation.item.retrieved"
    item: dict


@dataclass(kw_only=True)
class ConversationItemTruncated(ServerEvent):
    TYPE = "conversation.item.truncated"
    item_id: str
    content_index: int
    audio_end_ms: int


@dataclass(kw_only=True)
class ConversationItemDeleted(ServerEvent):
    TYPE = "conversation.item.deleted"
    item_id: str


@dataclass(kw_only=True)
class ResponseCreated(ServerEvent):
    TYPE = "response.created"
    response: dict
    response_id: str | None = tier2()  # vLLM-Omni's: the id at the top level too
    epoch: int | None = tier2()
    turn_id: int | None = tier2()
    # The response's own instructions (response.create), which GA's response object has no field for.
    instructions: str | None = tier2()


@dataclass(kw_only=True)
class ResponseDone(ServerEvent):
    TYPE = "response.done"
    response: dict
    response_id: str | None = tier2()
    epoch: int | None = tier2()
    turn_id: int | None = tier2()
    playback: dict | None = tier2()


@dataclass(kw_only=True)
class ResponseOutputItemAdded(ServerEvent):
    TYPE = "response.output_item.added"
    response_id: str
    output_index: int
    item: dict


@dataclass(kw_only=True)
class ResponseOutputItemDone(ServerEvent):
    TYPE = "response.output_item.done"
    response_id: str
    output_index: int
    item: dict


@dataclass(kw_only=True)
class ResponseContentPartAdded(ServerEvent):
    TYPE = "response.content_part.added"
    response_id: str
    item_id: str
    output_index: int
    content_index: int
    part: dict


@dataclass(kw_only=True)
class ResponseContentPartDone(ServerEvent):
    TYPE = "response.content_part.done"
    response_id: str
    item_id: str
    output_index: int
    content_index: int
    part: dict


@dataclass(kw_only=True)
class ResponseOutputAudioDelta(ServerEvent):
    TYPE = "response.output_audio.delta"
    response_id: str
    item_id: str
    output_index: int
    content_index: int
    delta: str
    epoch: int | None = tier2()
    turn_id: int | None = tier2()
    # Position of this delta's first sample in the response, in output-format samples.
    audio_offset: int | None = tier2()
    # vLLM-Omni's: the delta's own format and rate (what its client decodes and times it by).
    format: str | None = tier2()
    sample_rate_hz: int | None = tier2()


@dataclass(kw_only=True)
class ResponseOutputAudioTranscriptDelta(ServerEvent):
    """Text the model produced with its audio (Moshi's text tokens, detokenized)."""

    TYPE = "response.output_audio_transcript.delta"
    response_id: str
    item_id: str
    output_index: int
    content_index: int
    delta: str


@dataclass(kw_only=True)
class ResponseOutputAudioTranscriptDone(ServerEvent):
    TYPE = "response.output_audio_transcript.done"
    response_id: str
    item_id: str
    output_index: int
    content_index: int
    transcript: str


@dataclass(kw_only=True)
class ResponseOutputAudioDone(ServerEvent):
    TYPE = "response.output_audio.done"
    response_id: str
    item_id: str
    output_index: int
    content_index: int
    epoch: int | None = tier2()


@dataclass(kw_only=True)
class OutputAudioBufferCleared(ServerEvent):
    TYPE = "output_audio_buffer.cleared"
    response_id: str


@dataclass(kw_only=True)
class RateLimitsUpdated(ServerEvent):
    TYPE = "rate_limits.updated"
    # A snapshot of the limits now, not history: sent to the connection attached, never replayed.
    JOURNALED = False
    rate_limits: list


@dataclass(kw_only=True)
class Error(ServerEvent):
    TYPE = "error"
    error: dict


@dataclass(kw_only=True)
class SessionResumed(ServerEvent):
    TYPE = "session.resumed"
    TIER = 3
    JOURNALED = False
    session_id: str
    resume_token: str
    generation: int
    last_server_event_seq: int
    replayed: int
    session: dict | None = None


@dataclass(kw_only=True)
class SessionReplaced(ServerEvent):
    TYPE = "session.replaced"
    TIER = 3
    JOURNALED = False
    session_id: str


@dataclass(kw_only=True)
class SessionResyncRequired(ServerEvent):
    """The journal no longer holds what the client missed: here is the state to restart from."""

    TYPE = "session.resync_required"
    TIER = 3
    JOURNALED = False
    session_id: str
    requested_seq: int
    oldest_available_seq: int
    last_server_event_seq: int
    session: dict
    item_ids: list
    active_response_id: str | None = None


@dataclass(kw_only=True)
class SessionExpired(ServerEvent):
    TYPE = "session.expired"
    TIER = 3
    JOURNALED = False
    session_id: str
    reason: str


@dataclass(kw_only=True)
class SessionClosed(ServerEvent):
    TYPE = "session.closed"
    TIER = 3
    JOURNALED = False
    session_id: str
    reason: str


@dataclass(kw_only=True)
class SessionHeartbeatEvent(ServerEvent):
    TYPE = "session.heartbeat"
    TIER = 3
    JOURNALED = False
    last_server_event_seq: int
    server_time_ms: int


@dataclass(kw_only=True)
class BargeIn(ServerEvent):
    """User speech cut a response short: the response was cancelled at ``epoch``."""

    TYPE = "barge_in"
    TIER = 3
    response_id: str
    audio_start_ms: int
    epoch: int


@dataclass(kw_only=True)
class SessionHeartbeatAck(ServerEvent):
    """The answer to a client's ``session.heartbeat`` (vLLM-Omni's)."""

    TYPE = "session.heartbeat_ack"
    TIER = 3
    JOURNALED = False
    session_id: str


@dataclass(kw_only=True)
class ResponseSpeak(ServerEvent):
    """vLLM-Omni's decision event: the response speaks (sent once, before its first audio)."""

    TYPE = "response.speak"
    TIER = 3
    response_id: str
    item_id: str


@dataclass(kw_only=True)
class ResponseListen(ServerEvent):
    """vLLM-Omni's decision event: the response ended without a sample of audio (the model
    listened); sent before its terminal events."""

    TYPE = "response.listen"
    TIER = 3
    response_id: str
    response: dict


EVENTS: dict[str, type[ServerEvent]] = {
    e.TYPE: e
    for e in (
        SessionCreated,
        SessionUpdated,
        InputAudioBufferCommitted,
        InputAudioBufferCleared,
        InputAudioBufferSpeechStarted,
        InputAudioBufferSpeechStopped,
        ConversationItemAdded,
        ConversationItemDone,
        ConversationItemRetrieved,
        ConversationItemTruncated,
        ConversationItemDeleted,
        ResponseCreated,
        ResponseDone,
        ResponseOutputItemAdded,
        ResponseOutputItemDone,
        ResponseContentPartAdded,
        ResponseContentPartDone,
        ResponseOutputAudioDelta,
        ResponseOutputAudioTranscriptDelta,
        ResponseOutputAudioTranscriptDone,
        ResponseOutputAudioDone,
        OutputAudioBufferCleared,
        RateLimitsUpdated,
        Error,
        SessionResumed,
        SessionReplaced,
        SessionResyncRequired,
        SessionExpired,
        SessionClosed,
        SessionHeartbeatEvent,
        SessionHeartbeatAck,
        ResponseSpeak,
        ResponseListen,
        BargeIn,
    )
}
