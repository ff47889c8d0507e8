"""The client commands of the Realtime wire, typed: a frozen dataclass per command, named by its
``TYPE``, all of them in ``COMMANDS``.

Tiers (``tiers.py``): GA commands with GA fields, those fields plus ours made with ``tier2()``, and
our own commands (``TIER = 3``). ``codec`` decodes a command, checking each field against its
annotation, and is the only place that turns one into JSON and back; the server's side is
``events.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from .tiers import tier2


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
    format: str | None = tier2()
    sample_rate_hz: int | None = tier2()
    duration_ms: int | None = tier2()
    audio_end_ms: int | None = tier2()
    is_speech: bool | None = tier2()
    video_frames: list | None = tier2()


@dataclass(frozen=True, kw_only=True)
class InputAudioBufferCommit(ClientCommand):
    """Tier 2 (vLLM-Omni's): ``final`` (default true: the turn is over, its partial frame is
    zero-padded; false: more of the turn follows, the partial frame goes on), ``response_create``
    (ask for a response after the commit; without it, a final commit asks for one when the
    session's ``extra_body.auto_response`` is on)."""

    TYPE = "input_audio_buffer.commit"
    final: bool | None = tier2()
    response_create: bool | None = tier2()


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
        if self.last_server_event_seq is not None:
            return self.last_server_event_seq
        assert self.last_received_server_event_seq is not None, "the codec requires one of them"
        return self.last_received_server_event_seq


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
