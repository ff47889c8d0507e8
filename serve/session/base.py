"""The bottom piece of a ``Session`` (serve/session/session.py): its state, what it sends, its
input budget, and the input it hands the model.

Emission: every event the session sends is stamped with an ``event_id``; on a duplex connection
the journaled ones also get a ``server_event_seq`` and go into the journal (for a resume) before
the socket. The input budget (``Limits.input_bytes``) counts data commands' frames while queued,
the uncommitted buffer, every history item's JSON, and committed turns' audio, oldest first.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..plugins import ModelPlugin
from ..protocol import ProtocolError, ResponseParams, SessionConfig, client_commands, encode_event
from ..protocol import audio as wire_audio
from ..protocol import events as ev
from ..protocol.duplex import DuplexSettings, capabilities, duplex_session_fields
from ..runtime.text import text_of
from .codes import error_event
from .input_path import InputPath
from .journal import Journal
from .lease import Lease
from .ledger import Ledgers
from .limits import Limits
from .messages import Inbound, Lost, b64_decoded_len
from .port import ModelPort
from .transport import Transport
from .vad import EnergyVad


class SessionHost(Protocol):
    """What a session needs of the manager that made it (``SessionManager``), so that the session
    layer's dependencies point one way: the manager imports the session, never the reverse."""

    @property
    def model_executor(self) -> Executor: ...

    def remaining(self) -> int: ...

    def forget(self, session: Any) -> None: ...


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(8)}"


@dataclass
class Response:
    id: str
    item_id: str
    epoch: int
    turn_id: int
    params: ResponseParams
    previous_item_id: str | None
    out_samples: int = 0  # delivered, in output-format samples
    acked_ms: int = 0
    spoke: bool = False  # response.speak sent (duplex)
    transcript: str = ""  # the text the model produced with the reply so far

    @property
    def output_format(self) -> wire_audio.AudioFormat:
        return self.params.output_format


class SessionBase:
    """A session's state (every field, set here), its emission, its input budget, and its feed of
    input frames to the model. The pieces above it (conversation, fence, turns, lifetime) only
    call down to it."""

    def __init__(
        self,
        manager: SessionHost,
        session_id: str,
        plugin: ModelPlugin,
        limits: Limits,
        executor: Executor,
        duplex: bool,
        client: str,
    ) -> None:
        self.manager = manager
        self.id = session_id
        self.client = client  # the address that created it (the per-client session limit)
        self.plugin = plugin
        self.limits = limits
        self.executor = executor
        self.duplex = duplex
        self.config = SessionConfig(model=plugin.info.name)
        self.settings = DuplexSettings()  # vLLM-Omni's session fields (duplex connections)
        info = plugin.info
        self.capabilities = capabilities(info.frame_samples, info.input_rate, info.output_rate)
        self.conversation_id = "conv_" + session_id.removeprefix("sess_")
        self.stream = plugin.open_stream()
        self._take_text = text_of(self.stream)  # None: the model produces no text
        self.port = ModelPort(manager.model_executor, self.stream)
        self.mailbox: asyncio.Queue[Any] = asyncio.Queue()
        self.journal = Journal(limits.journal_bytes) if duplex else None
        now = time.monotonic()
        self.lease = Lease(now, limits.idle_ttl_s, limits.grace_s, limits.max_session_s)
        self.expires_at = int(time.time() + limits.max_session_s)
        self.ledgers = Ledgers()
        self.epoch = 0
        self.turn_id = 0
        self.active: Response | None = None
        self.responses: dict[str, Response] = {}
        self.last_response_id: str | None = None
        self.history: list[dict] = []
        # The input budget (Limits.input_bytes): data commands' frames while queued, the
        # uncommitted buffer, every history item's JSON, and committed turns' audio, oldest first.
        self._queued_bytes = 0
        self._handling: Inbound | None = None  # the command being handled
        self._item_bytes: dict[str, int] = {}
        self._items_bytes = 0
        self._user_audio: dict[str, bytes] = {}
        self._user_audio_bytes = 0
        self._buffer = bytearray()  # uncommitted input, in the input format
        self.input = InputPath(self.config.input_format, plugin.info.input_rate, plugin.info.frame_samples)
        self._vad = self._new_vad(0)
        self._vad_item_id: str | None = None
        self.pending_input_bytes = 0
        self._refusing_input = False  # an append was refused for backpressure and the queue has not drained since
        self.transport: Transport | None = None
        self.closed = False
        self._events = 0
        self._tick_queued = False
        self._last_heartbeat = now
        self._runner: asyncio.Task | None = None
        self._reply_paused = False  # the reply's task waits for its playback (Limits.reply_lead_s)
        self._task: asyncio.Task | None = None

    def _new_vad(self, start_sample: int) -> EnergyVad | None:
        td = self.config.turn_detection
        return None if td is None else EnergyVad(self.config.input_format.rate, td, start_sample)

    # ------------------------------------------------------------ emission

    def emit(self, event: ev.ServerEvent) -> None:
        self._stamp(event)
        text = None
        if self.journal is not None and event.JOURNALED:
            event.server_event_seq = self.journal.next_seq()
            text = encode_event(event, duplex=True)
            self.journal.append(event.server_event_seq, text)
        if self.transport is not None:
            self._send(self.transport, event, text)

    def _deliver_direct(self, event: ev.ServerEvent, transport: Transport | None = None) -> None:
        """A connection-level event: not journaled, only to this transport."""
        target = transport or self.transport
        if target is None:  # detached: a connection-level event has no connection to go to
            return
        self._stamp(event)
        self._send(target, event)

    def _send(self, transport: Transport, event: ev.ServerEvent, text: str | None = None) -> None:
        """``text``: the event's encoding, when the journal already made it."""
        transport.send(event, text, self.duplex)
        if transport.closed and transport is self.transport:
            self._lose_transport()

    def _lose_transport(self) -> None:
        """The socket closed under the session (its client read too slowly, or is gone): a duplex
        session waits for a resume, as after a disconnect; a Realtime one ends."""
        self.transport = None
        if self.duplex:
            self.lease.detach(time.monotonic())
        else:
            self.mailbox.put_nowait(Lost())

    def _stamp(self, event: ev.ServerEvent) -> None:
        self._events += 1
        event.event_id = f"event_{self.id[5:13]}{self._events:06d}"

    def _session_wire(self) -> dict:
        wire = self.config.to_wire(self.id, self.expires_at)
        if self.duplex:
            wire.update(duplex_session_fields(self.config, self.settings, self.capabilities))
            wire["audio"]["input"]["sample_rate_hz"] = self.config.input_format.rate
            wire["audio"]["output"]["sample_rate_hz"] = self.config.output_format.rate
        return wire

    def report_rate_limits(self) -> None:
        """``rate_limits.updated`` to the attached client: ``requests`` are the sessions the server
        still admits (its session limit's room, at most the model's free slots; none left: a new
        session gets ``resource_exhausted``), ``tokens`` the bytes of input
        audio this session may still queue (fewer than an append's: ``input_backpressure``). Sent
        after ``session.created``, to every session when the server fills up or stops being full,
        and to a session when it refuses an append for backpressure and once its queue has drained
        after that."""
        if self.transport is None or self.closed:
            return
        limits = self.limits
        self._deliver_direct(
            ev.RateLimitsUpdated(
                rate_limits=[
                    {
                        "name": "requests",
                        "limit": limits.max_sessions,
                        "remaining": self.manager.remaining(),
                    },
                    {
                        "name": "tokens",
                        "limit": limits.max_pending_input_bytes,
                        "remaining": limits.max_pending_input_bytes - self.pending_input_bytes,
                    },
                ]
            )
        )

    # ------------------------------------------------------------ the input budget

    def _dequeued(self, msg: Inbound) -> None:
        """A command left the input queue (handled or dropped)."""
        self.pending_input_bytes -= msg.pending_bytes
        self._queued_bytes -= msg.budgeted_bytes
        self._trim_history_audio()
        if self._refusing_input and self.pending_input_bytes == 0:
            self._refusing_input = False
            self.report_rate_limits()

    def _kept(self) -> None:
        """The command being handled keeps its data now (in the buffer, in the history): its frame
        stops counting as queued at the same moment, so the budget counts it once."""
        assert self._handling is not None
        self._queued_bytes -= self._handling.budgeted_bytes
        self._handling.budgeted_bytes = 0

    def _trim_history_audio(self) -> None:
        """Drop the audio of the oldest committed turns until the input budget holds again. Their
        items stay; retrieving one shows no audio."""
        budget = self.limits.input_bytes
        while self._user_audio and (self._queued_bytes + len(self._buffer) + self._items_bytes + self._user_audio_bytes > budget):
            dropped = len(self._user_audio.pop(next(iter(self._user_audio))))
            self._user_audio_bytes -= dropped
            self.ledgers.history_audio_dropped_bytes += dropped

    def _refuse(self, command: client_commands.ClientCommand, why: str) -> None:
        if isinstance(command, client_commands.InputAudioBufferAppend):
            self.ledgers.input.rejected_appends += 1
            self.ledgers.input.rejected_bytes += b64_decoded_len(command.audio)
        self.emit(error_event(ProtocolError("input_backpressure", why, None, command.event_id)))

    # ------------------------------------------------------------ input frames to the model

    async def _feed(self, frames: list[np.ndarray]) -> None:
        if frames and self.active is not None:  # one call each: the reply's frames go in between
            for index, frame in enumerate(frames):
                # The next call follows at once: this append's next frame, or the reply's next
                # frame, unless the reply is paced and waits for its playback.
                follows = index + 1 < len(frames) or not self._reply_paused
                await self.port.call(self.stream.feed, frame, follows=follows)
        elif frames:
            await self.port.call(self.stream.feed_frames, frames)
        self.ledgers.input.fed_samples += len(frames) * self.plugin.info.frame_samples

    async def _flush_frame(self) -> None:
        """Close the turn on a whole native frame: zero-pad the partial one and feed it."""
        padded = self.input.take_padded()
        if padded is None:
            return
        frame, pad = padded
        await self.port.call(self.stream.feed, frame)
        led = self.ledgers.input
        led.padded_samples += pad
        led.fed_samples += len(frame)
        led.pending_samples = 0
