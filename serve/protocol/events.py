"""Typed client commands and server events of the Realtime wire.

Tier 1: OpenAI Realtime GA names and fields exactly.  Tier 2: the same names with our extra fields,
marked ``TIER2`` and sent only on duplex connections.  Tier 3: our own names (``TIER = 3``), duplex
connections only.  ``codec`` is the only place that turns these into JSON and back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

TIER2 = {"tier": 2}


def _t2(default: Any = None) -> Any:
    return field(default=default, metadata=TIER2)


# ---------------------------------------------------------------- client commands


@dataclass(frozen=True, kw_only=True)
class ClientCommand:
    TYPE: ClassVar[str]
    TIER: ClassVar[int] = 1
    event_id: str | None = None
    # Tier 2: a command may name its session; one that names another session is refused.
    session_id: str | None = None


@dataclass(frozen=True, kw_only=True)
class SessionUpdate(ClientCommand):
    TYPE = "session.update"
    session: dict


@dataclass(frozen=True, kw_only=True)
class InputAudioBufferAppend(ClientCommand):
    """Tier 2 (vLLM-Omni's): the append's own ``format`` and ``sample_rate_hz`` (it is read in
    them), its ``duration_ms`` (checked against its bytes), ``audio_end_ms`` and ``is_speech``
    (read, not used: the server keeps its own count and runs its own VAD), ``video_frames``
    (refused unless empty: the models hear audio only)."""

    TYPE = "input_audio_buffer.append"
    audio: str
    format: str | None = _t2()
    sample_rate_hz: int | None = _t2()
    duration_ms: int | None = _t2()
    audio_end_ms: int | None = _t2()
    is_speech: bool | None = _t2()
    video_frames: list | None = _t2()


@dataclass(frozen=True, kw_only=True)
class InputAudioBufferCommit(ClientCommand):
    """Tier 2 (vLLM-Omni's): ``final`` (default true: the turn is over, its partial frame is
    zero-padded; false: more of the turn follows, the partial frame goes on), ``response_create``
    (ask for a response after the commit; without it, a final commit asks for one when the
    session's ``extra_body.auto_response`` is on)."""

    TYPE = "input_audio_buffer.commit"
    final: bool | None = _t2()
    response_create: bool | None = _t2()


@dataclass(frozen=True, kw_only=True)
class InputAudioBufferClear(ClientCommand):
    TYPE = "input_audio_buffer.clear"


@dataclass(frozen=True, kw_only=True)
class ConversationItemCreate(ClientCommand):
    TYPE = "conversation.item.create"
    item: dict
    previous_item_id: str | None = None


@dataclass(frozen=True, kw_only=True)
class ConversationItemRetrieve(ClientCommand):
    TYPE = "conversation.item.retrieve"
    item_id: str


@dataclass(frozen=True, kw_only=True)
class ConversationItemTruncate(ClientCommand):
    TYPE = "conversation.item.truncate"
    item_id: str
    content_index: int
    audio_end_ms: int


@dataclass(frozen=True, kw_only=True)
class ConversationItemDelete(ClientCommand):
    TYPE = "conversation.item.delete"
    item_id: str


@dataclass(frozen=True, kw_only=True)
class ResponseCreate(ClientCommand):
    TYPE = "response.create"
    response: dict | None = None


@dataclass(frozen=True, kw_only=True)
class ResponseCancel(ClientCommand):
    TYPE = "response.cancel"
    response_id: str | None = None


@dataclass(frozen=True, kw_only=True)
class OutputAudioBufferClear(ClientCommand):
    TYPE = "output_audio_buffer.clear"


@dataclass(frozen=True, kw_only=True)
class SessionResume(ClientCommand):
    """Reattach this connection to ``session_id``; replays journaled events after the last seen."""

    TYPE = "session.resume"
    TIER = 3
    session_id: str = field()  # required here; a bare annotation would inherit the base's None
    resume_token: str
    # One of the two is required (``seen``): ours, or vLLM-Omni's name for the same number.
    last_server_event_seq: int | None = None
    last_received_server_event_seq: int | None = None
    generation: int | None = None

    @property
    def seen(self) -> int:
        """The last ``server_event_seq`` the client holds, under either name."""
        ours, theirs = self.last_server_event_seq, self.last_received_server_event_seq
        assert ours is not None or theirs is not None, "the codec requires one of them"
        return ours if ours is not None else theirs  # type: ignore[return-value]


@dataclass(frozen=True, kw_only=True)
class SessionEventAck(ClientCommand):
    """The client holds every event up to ``server_event_seq``: the journal may drop them."""

    TYPE = "session.event_ack"
    TIER = 3
    server_event_seq: int


@dataclass(frozen=True, kw_only=True)
class PlaybackAck(ClientCommand):
    """The client has played ``audio_end_ms`` (vLLM-Omni: ``played_ms``) of a response's audio;
    without ``response_id``, of the active response, else of the latest. ``committed_ms``
    (vLLM-Omni's: how much of it the client counts as heard) is at most the played time;
    ``item_id``, if given, must name the response's item."""

    TYPE = "playback.ack"
    TIER = 3
    response_id: str | None = None
    audio_end_ms: int | None = None
    played_ms: int | float | None = None
    committed_ms: int | float | None = None
    item_id: str | None = None


@dataclass(frozen=True, kw_only=True)
class SessionHeartbeat(ClientCommand):
    TYPE = "session.heartbeat"
    TIER = 3


@dataclass(frozen=True, kw_only=True)
class InputTextAppend(ClientCommand):
    """vLLM-Omni's text input: refused by name (``unsupported_feature``), the models hear audio only."""

    TYPE = "input.text.append"
    TIER = 3
    text: str


@dataclass(frozen=True, kw_only=True)
class InputCancel(ClientCommand):
    """vLLM-Omni's: drop the user's uncommitted input (as ``input_audio_buffer.clear``)."""

    TYPE = "input.cancel"
    TIER = 3


@dataclass(frozen=True, kw_only=True)
class BargeInCommand(ClientCommand):
    """vLLM-Omni's client barge-in: the user talks over the reply, which is cancelled at once. The
    server announces it with the ``barge_in`` event, as it does when its VAD hears the speech:
    one name, one idea (a barge-in happened), whoever noticed it."""

    TYPE = "barge_in"
    TIER = 3


@dataclass(frozen=True, kw_only=True)
class TurnSignal(ClientCommand):
    """vLLM-Omni's envelope for a command by name: ``event`` (``barge_in``, ``input.cancel``,
    ``response.cancel``, ``session.update``, ``conversation.item.*``) with its fields in
    ``payload``; it is handled as that command. Any other ``event`` is refused by name."""

    TYPE = "turn.signal"
    TIER = 3
    event: str
    payload: dict | None = None


@dataclass(frozen=True, kw_only=True)
class SessionClose(ClientCommand):
    """End the session now (a bare disconnect keeps it for the grace period instead)."""

    TYPE = "session.close"
    TIER = 3


# ---------------------------------------------------------------- server events


@dataclass(kw_only=True)
class ServerEvent:
    TYPE: ClassVar[str]
    TIER: ClassVar[int] = 1
    # Journaled events carry a server_event_seq and are replayed on resume; connection-level
    # events (resumed, replaced, resync_required, heartbeat, expired, closed) are not.
    JOURNALED: ClassVar[bool] = True
    event_id: str = ""
    server_event_seq: int | None = _t2()


@dataclass(kw_only=True)
class SessionCreated(ServerEvent):
    TYPE = "session.created"
    # A client that never saw session.created cannot resume, so there is nothing to replay.
    JOURNALED = False
    session: dict
    resume_token: str | None = _t2()
    generation: int | None = _t2()


@dataclass(kw_only=True)
class SessionUpdated(ServerEvent):
    TYPE = "session.updated"
    session: dict


@dataclass(kw_only=True)
class InputAudioBufferCommitted(ServerEvent):
    TYPE = "input_audio_buffer.committed"
    item_id: str
    previous_item_id: str | None = None
    turn_id: int | None = _t2()
    audio_bytes: int | None = _t2()


@dataclass(kw_only=True)
class InputAudioBufferCleared(ServerEvent):
    TYPE = "input_audio_buffer.cleared"
    audio_bytes: int | None = _t2()


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
    response_id: str | None = _t2()  # vLLM-Omni's: the id at the top level too
    epoch: int | None = _t2()
    turn_id: int | None = _t2()
    # The response's own instructions (response.create), which GA's response object has no field for.
    instructions: str | None = _t2()


@dataclass(kw_only=True)
class ResponseDone(ServerEvent):
    TYPE = "response.done"
    response: dict
    response_id: str | None = _t2()
    epoch: int | None = _t2()
    turn_id: int | None = _t2()
    playback: dict | None = _t2()


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
    epoch: int | None = _t2()
    turn_id: int | None = _t2()
    # Position of this delta's first sample in the response, in output-format samples.
    audio_offset: int | None = _t2()
    # vLLM-Omni's: the delta's own format and rate (what its client decodes and times it by).
    format: str | None = _t2()
    sample_rate_hz: int | None = _t2()


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
    epoch: int | None = _t2()


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


COMMANDS: dict[str, type[ClientCommand]] = {
    c.TYPE: c
    for c in (
        SessionUpdate,
        InputAudioBufferAppend,
        InputAudioBufferCommit,
        InputAudioBufferClear,
        ConversationItemCreate,
        ConversationItemRetrieve,
        ConversationItemTruncate,
        ConversationItemDelete,
        ResponseCreate,
        ResponseCancel,
        OutputAudioBufferClear,
        SessionResume,
        SessionEventAck,
        PlaybackAck,
        SessionHeartbeat,
        SessionClose,
        InputTextAppend,
        InputCancel,
        BargeInCommand,
        TurnSignal,
    )
}

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
