"""One session: its owner task, mailbox, fence, ledgers, lease and journal.

Everything that changes session state runs in the owner task, one mailbox message at a time, so
commands take effect in arrival order. Slow work (base64, G.711, resampling, VAD energy, model
calls) runs on the shared executor; model calls go through a ``ModelPort`` that keeps them in
session order, never lets two of them overlap, and runs them on the manager's model executor.

Fence: every response belongs to the epoch in force when it was created. Cancel and barge-in
advance the epoch and emit the response's terminal events at once; chunks of an older epoch that
arrive later are dropped and counted, never emitted.

A reply's audio is the one thing not emitted by the owner: its task emits each chunk as the
model hands it over (on the event loop, through the fence), so a command that waits for the
model (an append's frames riding ticks of a batch) never holds a playing reply's audio back.
While a reply plays, an append's frames go to the model one call each, so the reply's next
chunk is computed between two of them rather than after all. A reply is computed as fast as the
model goes, or, with ``Limits.reply_lead_s``, at most that far ahead of its playback (a model
that ticks sessions together then ticks no faster than their clients play).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..plugins import ConfigRefused, ModelPlugin, ModelStream
from ..protocol import ProtocolError, ResponseParams, SessionConfig, StreamResampler, encode_event, quoted
from ..protocol import audio as wire_audio
from ..protocol import events as ev
from ..protocol.duplex import DuplexSettings, apply_duplex, capabilities, duplex_session_fields, signalled_command
from ..runtime.text import text_of
from .playback import ack_played_ms
from .input_path import InputPath
from .journal import Journal
from .ledger import Ledgers
from .lease import Lease
from .limits import Limits
from .transport import Transport
from .vad import EnergyVad

if TYPE_CHECKING:
    from .manager import SessionManager

log = logging.getLogger("cadence_fx.serve")

CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001  # server shutdown
CLOSE_POLICY = 1008  # too many failed resumes
CLOSE_TRY_AGAIN = 1013
CLOSE_EXPIRED = 4001
CLOSE_REPLACED = 4002


def b64_decoded_len(text: str) -> int:
    """Exact decoded length of valid base64 (an estimate for invalid input)."""
    pad = 2 if text.endswith("==") else 1 if text.endswith("=") else 0
    return max(0, len(text) * 3 // 4 - pad)


class ModelPort:
    """Runs one stream's blocking calls on the executor, in call order, one at a time; each call
    tells the stream whether the next one follows at once (``ModelStream.follows``)."""

    def __init__(self, executor: Executor, stream: ModelStream) -> None:
        self._executor = executor
        self._stream = stream
        self._lock = asyncio.Lock()

    async def call(
        self, fn: Callable[..., Any], *args: Any, guard: Callable[[], bool] | None = None, follows: bool = False
    ) -> Any:
        async with self._lock:
            if guard is not None and not guard():
                return None
            return await asyncio.get_running_loop().run_in_executor(self._executor, self._run, follows, fn, args)

    def _run(self, follows: bool, fn: Callable[..., Any], args: tuple) -> Any:
        self._stream.follows = follows
        return fn(*args)


# Mailbox messages.
@dataclass
class _Inbound:
    command: ev.ClientCommand
    transport: Transport
    pending_bytes: int = 0  # decoded audio of an append
    budgeted_bytes: int = 0  # the frame of a data command, while queued (the input budget)


@dataclass
class _Reject:
    error: ProtocolError
    transport: Transport


@dataclass
class _Chunk:  # not a mailbox message: the reply's task hands it to ``_on_chunk`` itself
    epoch: int
    response_id: str
    model_samples: int
    data: bytes
    text: str = ""  # what the model said with this chunk (a stream with ``take_text``)


@dataclass
class _ReplyEnd:
    epoch: int
    response_id: str
    error: str | None


@dataclass
class _Resume:
    command: ev.SessionResume
    transport: Transport
    future: asyncio.Future


@dataclass
class _Detach:
    transport: Transport


@dataclass
class _Release:
    transport: Transport


@dataclass
class _Tick:
    pass


@dataclass
class _Open:
    command: ev.SessionUpdate


@dataclass
class _Stop:
    reason: str


@dataclass
class _Lost:
    """The socket closed under a Realtime session (its client read too slowly, or is gone)."""


# Commands that bring data the session keeps or holds while they wait: the input budget covers them.
_DATA_COMMANDS = (ev.InputAudioBufferAppend, ev.ConversationItemCreate, ev.SessionUpdate, ev.ResponseCreate,
                  ev.TurnSignal)


@dataclass
class _Response:
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


class Session:
    def __init__(
        self,
        manager: SessionManager,
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
        self.active: _Response | None = None
        self.responses: dict[str, _Response] = {}
        self.last_response_id: str | None = None
        self.history: list[dict] = []
        # The input budget (Limits.input_bytes): data commands' frames while queued, the
        # uncommitted buffer, every history item's JSON, and committed turns' audio, oldest first.
        self._queued_bytes = 0
        self._handling: _Inbound | None = None  # the command being handled
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

    # ------------------------------------------------------------ lifecycle

    def start(self, transport: Transport, opening: ev.SessionUpdate | None = None) -> None:
        """Announce the session (``session.created``, ``rate_limits.updated``) and start its owner.
        ``opening``: the connection's first command, a ``session.update`` (``autostart=0``): it is
        applied first, so ``session.created`` already carries it (vLLM-Omni's client keeps the
        session object of ``session.created``), and answered with ``session.updated`` after."""
        self.transport = transport
        self.lease.attach(time.monotonic())
        if opening is None:
            self._announce()
        else:
            self.mailbox.put_nowait(_Open(opening))
        self._task = asyncio.get_running_loop().create_task(self._own(), name=f"session {self.id}")

    def _announce(self) -> None:
        token = self.lease.issue_token() if self.duplex else None
        self.emit(
            ev.SessionCreated(
                session=self._session_wire(),
                resume_token=token,
                generation=self.lease.generation if self.duplex else None,
            )
        )
        self.report_rate_limits()

    async def _open(self, msg: _Open) -> None:
        try:
            await self._apply_session(msg.command.session)
        except ProtocolError as err:  # the session opens as it was; the error follows its announcement
            self._announce()
            err.event_id = err.event_id or msg.command.event_id
            raise
        self._announce()
        self.emit(ev.SessionUpdated(session=self._session_wire()))

    async def _own(self) -> None:
        try:
            while not self.closed:
                msg = await self.mailbox.get()
                try:
                    await self._handle(msg)
                except ProtocolError as err:
                    self.emit(_error_event(err))
                except Exception as exc:  # a bug must not take the session down: report it typed
                    log.exception("session %s failed on %s", self.id, type(msg).__name__)
                    self.emit(_error_event(ProtocolError("server_error", f"internal error: {type(exc).__name__}")))
                # The socket's writer runs between two messages, so a burst of events reaches the
                # network as it is made and only a client that does not read fills the outbound budget.
                await asyncio.sleep(0)
        finally:
            if not self.closed:
                await self._shutdown(None, "owner_failed", CLOSE_NORMAL)
            while not self.mailbox.empty():
                msg = self.mailbox.get_nowait()
                if isinstance(msg, _Resume) and not msg.future.done():
                    msg.future.set_exception(ProtocolError("session_not_found", "session has ended", "session_id"))

    async def _stop(self, reason: str) -> None:
        """Server shutdown: a response still running fails (``server_shutdown``), then the client is
        told (``session.closed`` on duplex connections) and its socket closed with 1001."""
        if self.active is not None:
            resp, self.active = self.active, None
            self.epoch += 1
            message = "the server shut down before the response ended"
            error = {"type": "server_error", "code": reason, "message": message}
            self._finish(resp, "failed", {"type": "failed", "error": error})
        await self._shutdown(ev.SessionClosed(session_id=self.id, reason=reason), reason, CLOSE_GOING_AWAY)

    async def _shutdown(self, event: ev.ServerEvent | None, reason: str, code: int) -> None:
        self.closed = True
        if self.transport is not None:
            if event is not None and self.duplex:
                self._deliver_direct(event)
            if self.transport is not None:  # still there, unless the client was too slow for that event
                self.transport.close(code, reason)
            self.transport = None
        self.epoch += 1
        self.active = None
        if self._runner is not None:
            # Not cancelled: that would free the port while its worker thread still steps. The
            # runner's guard sees ``closed`` and ends at the next chunk boundary.
            await self._runner
        try:
            await self.port.call(self.stream.close)
        finally:
            self.manager.forget(self)
            log.info("session %s ended: %s", self.id, reason)

    # ------------------------------------------------------------ called by connections (on the loop)

    def submit(self, command: ev.ClientCommand, transport: Transport, frame_bytes: int) -> None:
        """Queue a decoded command (its frame had ``frame_bytes``); refuses at once (typed error)
        when the session is saturated."""
        self.lease.touch(time.monotonic())
        if self.mailbox.qsize() >= self.limits.max_pending_commands:
            self._refuse(command, "too many queued commands")
            return
        budgeted = frame_bytes if isinstance(command, _DATA_COMMANDS) else 0
        if budgeted:
            # The history's audio is not counted here: it makes room for new input (oldest first).
            taken = self._queued_bytes + len(self._buffer) + self._items_bytes
            if taken + budgeted > self.limits.input_bytes:
                self._refuse(
                    command,
                    f"the session's input budget is full: {taken} of input_bytes={self.limits.input_bytes} taken "
                    f"({self._queued_bytes} by queued commands, {len(self._buffer)} by uncommitted audio, "
                    f"{self._items_bytes} by conversation items), this frame has {budgeted}; "
                    "commit or clear the buffer, or delete items",
                )
                return
        pending = 0
        if isinstance(command, ev.InputAudioBufferAppend):
            pending = b64_decoded_len(command.audio)
            if self.pending_input_bytes + pending > self.limits.max_pending_input_bytes:
                self._refuse(command, f"{self.pending_input_bytes} bytes of input audio are still queued")
                if not self._refusing_input:
                    self._refusing_input = True
                    self.report_rate_limits()
                return
            self.pending_input_bytes += pending
        self._queued_bytes += budgeted
        self.mailbox.put_nowait(_Inbound(command, transport, pending, budgeted))

    def reject(self, error: ProtocolError, transport: Transport) -> None:
        """Answer a frame that did not decode, in order with the commands before it."""
        self.lease.touch(time.monotonic())
        self.mailbox.put_nowait(_Reject(error, transport))

    async def resume(self, command: ev.SessionResume, transport: Transport) -> None:
        future = asyncio.get_running_loop().create_future()
        self.mailbox.put_nowait(_Resume(command, transport, future))
        await future

    def detach(self, transport: Transport) -> None:
        if not self.closed:
            self.mailbox.put_nowait(_Detach(transport))

    def release(self, transport: Transport) -> None:
        """The connection moved to another session: end this one without telling it anything."""
        if not self.closed:
            self.mailbox.put_nowait(_Release(transport))

    async def stop(self, reason: str) -> None:
        """End the session (server shutdown), telling its client with ``session.closed``."""
        if not self.closed:
            self.mailbox.put_nowait(_Stop(reason))
        if self._task is not None:
            await self._task

    def tick(self) -> None:
        if not self.closed and not self._tick_queued:
            self._tick_queued = True
            self.mailbox.put_nowait(_Tick())

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

    def _dequeued(self, msg: _Inbound) -> None:
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
        while self._user_audio and (
            self._queued_bytes + len(self._buffer) + self._items_bytes + self._user_audio_bytes > budget
        ):
            dropped = len(self._user_audio.pop(next(iter(self._user_audio))))
            self._user_audio_bytes -= dropped
            self.ledgers.history_audio_dropped_bytes += dropped

    def _refuse(self, command: ev.ClientCommand, why: str) -> None:
        if isinstance(command, ev.InputAudioBufferAppend):
            self.ledgers.input.rejected_appends += 1
            self.ledgers.input.rejected_bytes += b64_decoded_len(command.audio)
        self.emit(_error_event(ProtocolError("input_backpressure", why, None, command.event_id)))

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
        self._stamp(event)
        self._send(transport or self.transport, event)  # type: ignore[arg-type]

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
            self.mailbox.put_nowait(_Lost())

    def _stamp(self, event: ev.ServerEvent) -> None:
        self._events += 1
        event.event_id = f"event_{self.id[5:13]}{self._events:06d}"

    # ------------------------------------------------------------ the owner's dispatch

    async def _handle(self, msg: Any) -> None:
        if isinstance(msg, _Inbound):
            if msg.transport is not self.transport:  # sent by a connection that has been replaced
                self._dequeued(msg)
                return
            handler = self._HANDLERS[type(msg.command)]
            self._handling = msg
            try:
                await handler(self, msg.command)
            except ProtocolError as err:
                err.event_id = err.event_id or msg.command.event_id
                raise
            except Exception as exc:  # a bug must not take the session down: report it typed, to its command
                log.exception("session %s failed on %s", self.id, msg.command.TYPE)
                raise ProtocolError(
                    "server_error", f"internal error: {type(exc).__name__}", None, msg.command.event_id
                ) from exc
            finally:
                self._handling = None
                self._dequeued(msg)
        elif isinstance(msg, _Reject):
            if msg.transport is self.transport:
                self.emit(_error_event(msg.error))
        elif isinstance(msg, _ReplyEnd):
            self._on_reply_end(msg)
        elif isinstance(msg, _Resume):
            self._on_resume(msg)
        elif isinstance(msg, _Detach):
            await self._on_detach(msg.transport)
        elif isinstance(msg, _Release):
            if msg.transport is self.transport:
                self.transport = None
                await self._shutdown(None, "superseded", CLOSE_NORMAL)
        elif isinstance(msg, _Stop):
            await self._stop(msg.reason)
        elif isinstance(msg, _Lost):
            await self._shutdown(None, "socket lost", CLOSE_NORMAL)
        elif isinstance(msg, _Open):
            await self._open(msg)
        elif isinstance(msg, _Tick):
            self._tick_queued = False
            await self._on_tick()

    # ------------------------------------------------------------ commands

    async def _session_update(self, cmd: ev.SessionUpdate) -> None:
        await self._apply_session(cmd.session)
        self.emit(ev.SessionUpdated(session=self._session_wire()))

    async def _apply_session(self, patch: dict) -> None:
        old, old_settings = self.config, self.settings
        if self.duplex:
            takes_voice = callable(getattr(self.stream, "upload_voice", None))  # a client's voice WAV (ref_audio)
            self.config, self.settings = apply_duplex(patch, old, self.settings, self.plugin.info.name, takes_voice)
        else:
            self.config = old.apply(patch)
        config = self.config
        if self.settings.ref_audio is not None:  # the client's own voice WAV, the stream's before it is the voice
            (name, wav), self.settings = self.settings.ref_audio, self.settings.handed_over()
            try:
                await self.port.call(self.stream.upload_voice, name, wav)
            except ConfigRefused as refused:
                self.config, self.settings = old, old_settings
                raise ProtocolError("invalid_value", str(refused), "session.ref_audio") from None
        if (config.instructions, config.voice) != (old.instructions, old.voice):
            try:  # the model's persona, ready when this returns (a model without one ignores it)
                await self.port.call(self.stream.configure, config.instructions, config.voice)
            except ConfigRefused as refused:
                self.config, self.settings = old, old_settings
                raise ProtocolError("invalid_value", str(refused), refused.param) from None
        self.input.set_format(config.input_format)
        # The VAD is rebuilt only when what it runs on changed: an update of anything else (a
        # client's tracing update, say) must not restart a turn mid-speech.
        if config.turn_detection != old.turn_detection or config.input_format.rate != old.input_format.rate:
            self._vad = self._new_vad(self._vad.samples if self._vad is not None else 0)
            self._vad_item_id = None

    async def _append(self, cmd: ev.InputAudioBufferAppend) -> None:
        loop = asyncio.get_running_loop()
        try:
            if cmd.video_frames:
                raise ProtocolError(
                    "unsupported_feature", f"video_frames are not served: {self.plugin.info.name} hears audio only",
                    "video_frames",
                )
            fmt = self.input.declared(cmd)
            data, frames, edges, resampled = await loop.run_in_executor(
                self.executor, self.input.ingest, cmd, fmt, self._vad
            )
        except ProtocolError as err:
            self.ledgers.input.rejected_appends += 1
            self.ledgers.input.rejected_bytes += getattr(err, "audio_bytes", 0)
            raise
        led = self.ledgers.input
        led.received_bytes += len(data)
        led.resampled_samples += resampled
        self._buffer += data
        self._kept()
        # Each VAD edge is handled where it falls in the append: a turn ends at its stop, with the
        # bytes and frames before it; those after go on into the next turn (and while a reply is in
        # progress, a duplex model's frames after the stop are the reply's next ones).
        fed = 0
        for edge, at_byte, at_frame in edges:
            await self._feed(frames[fed:at_frame])
            fed = at_frame
            await self._on_vad_edge(edge, after=len(data) - at_byte)
        await self._feed(frames[fed:])
        led.pending_samples = len(self.input.frame)

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

    async def _commit(self, cmd: ev.InputAudioBufferCommit | None = None, *, flush: bool = True, after: int = 0) -> str:
        """``flush``: close the turn on a whole native frame (a commit of the client's, which says no
        more audio of the turn is coming). A turn the server VAD ended does not: the audio after its
        end keeps coming, and the partial frame goes on into the next one. ``after``: the bytes at
        the buffer's end that came after the turn's end (the rest of the append its VAD stop fell
        in): they stay in the buffer, for the next turn."""
        turn = len(self._buffer) - after
        if turn <= 0:
            raise ProtocolError("input_audio_buffer_commit_empty", "the input audio buffer is empty")
        if flush:
            await self._flush_frame()
        item_id = self._vad_item_id or _new_id("item")
        self._vad_item_id = None
        self.turn_id += 1
        data = bytes(self._buffer[:turn])
        del self._buffer[:turn]
        self.ledgers.input.committed_bytes += len(data)
        previous = self.history[-1]["id"] if self.history else None
        item = {
            "id": item_id,
            "object": "realtime.item",
            "type": "message",
            "role": "user",
            "status": "completed",
            "content": [{"type": "input_audio", "transcript": None}],
        }
        self._user_audio[item_id] = data
        self._user_audio_bytes += len(data)
        self.emit(
            ev.InputAudioBufferCommitted(
                item_id=item_id, previous_item_id=previous, turn_id=self.turn_id, audio_bytes=len(data)
            )
        )
        self._add_item(item, previous)
        return item_id

    async def _client_commit(self, cmd: ev.InputAudioBufferCommit) -> None:
        """The client's commit. ``final`` (the default) closes the turn on a whole frame; a non-final
        one leaves the partial frame for the rest of the turn. A response follows when
        ``response_create`` asks for one, or, without it, after a final commit in a session with
        ``extra_body.auto_response`` on (unless one is in progress: an asked-for one is then refused)."""
        final = cmd.final is not False
        respond = cmd.response_create if cmd.response_create is not None else final and self.settings.auto_response
        await self._commit(cmd, flush=final)
        if not respond:
            return
        if self.active is not None and cmd.response_create is None:
            return
        await self._response_create(flush=False)

    async def _clear(self, cmd: ev.InputAudioBufferClear | ev.InputCancel) -> None:
        cleared = len(self._buffer)
        self._buffer.clear()
        led = self.ledgers.input
        led.cleared_bytes += cleared
        led.discarded_samples += self.input.discard()
        led.pending_samples = 0
        await self.port.call(self.stream.clear_input)
        if self._vad is not None:
            self._vad = self._new_vad(self._vad.samples)
        self._vad_item_id = None
        self.emit(ev.InputAudioBufferCleared(audio_bytes=cleared))

    async def _item_create(self, cmd: ev.ConversationItemCreate) -> None:
        item = dict(cmd.item)
        if any(i["id"] == item.get("id") for i in self.history):
            raise ProtocolError("item_create_duplicate_item_id", f"Item with id {quoted(item['id'])} already exists.", "item.id")
        previous = cmd.previous_item_id
        if previous is not None and previous != "root" and self._find(previous) is None:
            raise ProtocolError("item_not_found", f"no item {quoted(previous)}", "previous_item_id")
        item.setdefault("id", _new_id("item"))
        item["object"] = "realtime.item"
        item.setdefault("status", "completed")
        self._kept()
        if previous is None:
            previous = self.history[-1]["id"] if self.history else None
        elif previous == "root":  # GA: insert at the start of the conversation
            previous = None
        self._add_item(item, previous)

    async def _item_retrieve(self, cmd: ev.ConversationItemRetrieve) -> None:
        item = self._require_item(cmd.item_id, "retrieve")
        if cmd.item_id in self._user_audio:
            audio = wire_audio.b64encode(self._user_audio[cmd.item_id])
            item = {**item, "content": [{"type": "input_audio", "transcript": None, "audio": audio}]}
        self.emit(ev.ConversationItemRetrieved(item=item))

    async def _item_truncate(self, cmd: ev.ConversationItemTruncate) -> None:
        self._require_item(cmd.item_id, "truncate")
        response = next((r for r in self.responses.values() if r.item_id == cmd.item_id), None)
        if response is None:
            raise ProtocolError("invalid_value", "only assistant audio items can be truncated", "item_id")
        if cmd.content_index != 0:
            raise ProtocolError("invalid_value", "assistant audio items have one content part", "content_index")
        played_ms = response.output_format.ms(response.out_samples)
        if cmd.audio_end_ms > played_ms:
            raise ProtocolError(
                "invalid_value", f"audio_end_ms {cmd.audio_end_ms} is past the item's {played_ms} ms", "audio_end_ms"
            )
        self.ledgers.playback.truncated_ms += played_ms - cmd.audio_end_ms
        self.emit(ev.ConversationItemTruncated(item_id=cmd.item_id, content_index=0, audio_end_ms=cmd.audio_end_ms))

    async def _item_delete(self, cmd: ev.ConversationItemDelete) -> None:
        item = self._require_item(cmd.item_id, "delete")
        self.history.remove(item)
        self._user_audio_bytes -= len(self._user_audio.pop(cmd.item_id, b""))
        self._items_bytes -= self._item_bytes.pop(cmd.item_id)
        self.ledgers.history_items = len(self.history)
        self.emit(ev.ConversationItemDeleted(item_id=cmd.item_id))

    async def _response_create(self, cmd: ev.ResponseCreate | None = None, *, flush: bool = True) -> None:
        params = ResponseParams.parse(None if cmd is None else cmd.response, self.config, self.duplex)
        if self.active is not None:
            raise ProtocolError(
                "conversation_already_has_active_response",
                f"Conversation already has an active response in progress: {self.active.id}. "
                "Wait until the response is finished before creating a new one.",
            )
        if flush:
            await self._flush_frame()
        await self.port.call(self.stream.begin_response)
        response_id = _new_id("resp")
        item_id = f"item_{response_id}"  # the reply's item, named as vLLM-Omni's clients expect
        previous = self.history[-1]["id"] if self.history else None
        resp = _Response(
            id=response_id,
            item_id=item_id,
            epoch=self.epoch,
            turn_id=self.turn_id,
            params=params,
            previous_item_id=previous,
        )
        self.active = resp
        self.responses[resp.id] = resp
        self.last_response_id = resp.id
        self.ledgers.responses.created += 1
        self.emit(
            ev.ResponseCreated(
                response=self._response_wire(resp, "in_progress", []),
                response_id=resp.id,
                epoch=resp.epoch,
                turn_id=resp.turn_id,
                instructions=params.instructions,
            )
        )
        item = _assistant_item(item_id, "in_progress", [])
        self.emit(ev.ResponseOutputItemAdded(response_id=resp.id, output_index=0, item=item))
        if params.in_conversation:
            self._add_item(item, previous, done=False)
        self.emit(
            ev.ResponseContentPartAdded(
                response_id=resp.id,
                item_id=item_id,
                output_index=0,
                content_index=0,
                part={"type": "audio", "transcript": ""},
            )
        )
        self._runner = asyncio.get_running_loop().create_task(self._run_reply(resp), name=f"reply {resp.id}")

    async def _response_cancel(self, cmd: ev.ResponseCancel) -> None:
        if self.active is None or (cmd.response_id is not None and cmd.response_id != self.active.id):
            # OpenAI's wording: clients match on its prefix ("Cancellation failed").
            raise ProtocolError("response_cancel_not_active", "Cancellation failed: no active response found", "response_id")
        await self._cancel("client_cancelled")

    async def _output_clear(self, cmd: ev.OutputAudioBufferClear) -> None:
        if self.active is not None:
            response_id = self.active.id
            await self._cancel("client_cancelled")
        elif self.last_response_id is not None:
            response_id = self.last_response_id
        else:
            raise ProtocolError("response_cancel_not_active", "no response has produced audio")
        self.emit(ev.OutputAudioBufferCleared(response_id=response_id))

    async def _event_ack(self, cmd: ev.SessionEventAck) -> None:
        assert self.journal is not None
        self.journal.ack(cmd.server_event_seq)

    async def _playback_ack(self, cmd: ev.PlaybackAck) -> None:
        response_id = cmd.response_id or (self.active.id if self.active is not None else self.last_response_id)
        response = self.responses.get(response_id) if response_id is not None else None
        if response is None:
            why = f"no response {quoted(cmd.response_id)}" if cmd.response_id else "no response has been created"
            raise ProtocolError("invalid_value", why, "response_id")
        delivered_ms = response.output_format.ms(response.out_samples)
        played = ack_played_ms(cmd, response.id, response.item_id, delivered_ms)
        if played > response.acked_ms:
            self.ledgers.playback.acked_ms += played - response.acked_ms
            response.acked_ms = played

    async def _heartbeat(self, cmd: ev.SessionHeartbeat) -> None:
        """A client heartbeat renews the lease (``submit`` already touched it), and is answered
        with ``session.heartbeat_ack`` (not journaled: it says the connection is alive now)."""
        self._deliver_direct(ev.SessionHeartbeatAck(session_id=self.id))

    async def _input_text(self, cmd: ev.InputTextAppend) -> None:
        raise ProtocolError(
            "unsupported_feature", f"text input is not served: {self.plugin.info.name} hears audio only", "type"
        )

    async def _barge_in(self, cmd: ev.BargeInCommand) -> None:
        """The client's barge-in: as the VAD's, the reply is cancelled and ``barge_in`` announces it,
        at the input received so far."""
        if self.active is None:
            raise ProtocolError("response_cancel_not_active", "Barge-in failed: no active response found", "type")
        received = self.ledgers.input.received_bytes // self.config.input_format.bytes_per_sample
        self.emit(ev.BargeIn(response_id=self.active.id, audio_start_ms=self.config.input_format.ms(received),
                             epoch=self.epoch + 1))
        await self._cancel("client_barge_in")

    async def _turn_signal(self, cmd: ev.TurnSignal) -> None:
        """The command ``cmd.event`` names, with the fields in its ``payload``."""
        inner = signalled_command(cmd)
        await self._HANDLERS[type(inner)](self, inner)

    async def _close(self, cmd: ev.SessionClose) -> None:
        await self._shutdown(
            ev.SessionClosed(session_id=self.id, reason="client_closed"), "client_closed", CLOSE_NORMAL
        )

    _HANDLERS: dict[type, Callable[..., Any]] = {
        ev.SessionUpdate: _session_update,
        ev.InputAudioBufferAppend: _append,
        ev.InputAudioBufferCommit: _client_commit,
        ev.InputAudioBufferClear: _clear,
        ev.ConversationItemCreate: _item_create,
        ev.ConversationItemRetrieve: _item_retrieve,
        ev.ConversationItemTruncate: _item_truncate,
        ev.ConversationItemDelete: _item_delete,
        ev.ResponseCreate: _response_create,
        ev.ResponseCancel: _response_cancel,
        ev.OutputAudioBufferClear: _output_clear,
        ev.SessionEventAck: _event_ack,
        ev.PlaybackAck: _playback_ack,
        ev.SessionHeartbeat: _heartbeat,
        ev.SessionClose: _close,
        ev.InputTextAppend: _input_text,
        ev.InputCancel: _clear,
        ev.BargeInCommand: _barge_in,
        ev.TurnSignal: _turn_signal,
    }

    # ------------------------------------------------------------ VAD

    def _new_vad(self, start_sample: int) -> EnergyVad | None:
        td = self.config.turn_detection
        return None if td is None else EnergyVad(self.config.input_format.rate, td, start_sample)

    async def _on_vad_edge(self, edge: Any, after: int = 0) -> None:
        """``after``: the bytes of the append that came after the edge (for a stop, `_commit`'s)."""
        td = self.config.turn_detection
        if td is None:
            return
        if edge.kind == "started":
            self._vad_item_id = _new_id("item")
            self.emit(ev.InputAudioBufferSpeechStarted(audio_start_ms=edge.ms, item_id=self._vad_item_id))
            listen_only = self.settings.overlap_policy == "listen_only"
            if self.active is not None and td.interrupt_response and not listen_only:
                if self.duplex:
                    self.emit(ev.BargeIn(response_id=self.active.id, audio_start_ms=edge.ms, epoch=self.epoch + 1))
                await self._cancel("turn_detected")
        else:
            item_id = self._vad_item_id or _new_id("item")
            self._vad_item_id = item_id
            self.emit(ev.InputAudioBufferSpeechStopped(audio_end_ms=edge.ms, item_id=item_id))
            await self._commit(flush=False, after=after)
            if td.create_response and self.active is None:
                await self._response_create(flush=False)

    # ------------------------------------------------------------ responses

    async def _run_reply(self, resp: _Response) -> None:
        resampler = StreamResampler(self.plugin.info.output_rate, resp.output_format.rate)

        def current() -> bool:
            return self.epoch == resp.epoch and not self.closed

        # Pacing (Limits.reply_lead_s): the reply's playback clock starts at its first chunk; a
        # chunk is computed only once the audio handed out is at most ``lead`` ahead of it.
        lead, rate = self.limits.reply_lead_s, self.plugin.info.output_rate
        clock: float | None = None
        handed_s = last_s = 0.0
        try:
            while True:
                ahead = 0.0 if clock is None else handed_s - (time.monotonic() - clock)
                if lead and ahead > lead:
                    self._reply_paused = True
                    try:
                        await asyncio.sleep(ahead - lead)
                    finally:
                        self._reply_paused = False
                    ahead = lead
                # The next call follows this one at once unless the chunk it brings puts the reply past its lead.
                follows = not lead or ahead + last_s <= lead
                rendered = await self.port.call(
                    self._render, resampler, resp.output_format, guard=current, follows=follows
                )
                if rendered is None:
                    break
                self._on_chunk(_Chunk(resp.epoch, resp.id, *rendered))
                clock = time.monotonic() if clock is None else clock
                last_s = rendered[0] / rate
                handed_s += last_s
            self.mailbox.put_nowait(_ReplyEnd(resp.epoch, resp.id, None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("model failed in response %s", resp.id)
            self.mailbox.put_nowait(_ReplyEnd(resp.epoch, resp.id, f"{type(exc).__name__}: {exc}"))

    def _render(self, resampler: StreamResampler, fmt: wire_audio.AudioFormat) -> tuple[int, bytes, str] | None:
        """Worker thread: one native chunk, converted to the output format, and its text."""
        chunk = self.stream.step()
        if chunk is None:
            return None
        text = self._take_text() if self._take_text is not None else ""
        return len(chunk), wire_audio.encode_samples(resampler.process(chunk), fmt), text

    def _on_chunk(self, msg: _Chunk) -> None:
        playback = self.ledgers.playback
        playback.generated_samples += msg.model_samples
        resp = self.active
        if resp is None or msg.epoch != self.epoch or resp.id != msg.response_id:
            playback.dropped_samples += msg.model_samples
            return
        playback.delivered_samples += msg.model_samples
        playback.delivered_bytes += len(msg.data)
        if self.duplex and not resp.spoke:
            resp.spoke = True
            self.emit(ev.ResponseSpeak(response_id=resp.id, item_id=resp.item_id))
        offset = resp.out_samples
        resp.out_samples += resp.output_format.samples(len(msg.data))
        self.emit(
            ev.ResponseOutputAudioDelta(
                response_id=resp.id,
                item_id=resp.item_id,
                output_index=0,
                content_index=0,
                delta=wire_audio.b64encode(msg.data),
                epoch=resp.epoch,
                turn_id=resp.turn_id,
                audio_offset=offset,
                format=wire_audio.BETA_NAME[resp.output_format.encoding],
                sample_rate_hz=resp.output_format.rate,
            )
        )
        if msg.text:
            resp.transcript += msg.text
            self.emit(ev.ResponseOutputAudioTranscriptDelta(
                response_id=resp.id, item_id=resp.item_id, output_index=0, content_index=0, delta=msg.text
            ))

    def _on_reply_end(self, msg: _ReplyEnd) -> None:
        resp = self.active
        if resp is None or msg.epoch != self.epoch or resp.id != msg.response_id:
            return
        self.active = None
        if msg.error is None:
            self._finish(resp, "completed", None)
        else:
            details = {
                "type": "failed",
                "error": {"type": "server_error", "code": "server_error", "message": msg.error},
            }
            self._finish(resp, "failed", details)

    async def _cancel(self, reason: str) -> None:
        resp = self.active
        assert resp is not None
        self.active = None
        self.epoch += 1
        self._finish(resp, "cancelled", {"type": "cancelled", "reason": reason})
        await self.port.call(self.stream.cancel)

    def _finish(self, resp: _Response, status: str, details: dict | None) -> None:
        """The terminal events of ``resp``; after these nothing of its epoch is emitted."""
        counts = self.ledgers.responses
        setattr(counts, status, getattr(counts, status) + 1)
        item_status = "completed" if status == "completed" else "incomplete"
        item = _assistant_item(resp.item_id, item_status, [{"type": "output_audio", "transcript": resp.transcript}])
        stored = self._find(resp.item_id)
        if stored is not None:
            stored.update(item)
            self._measure(stored)
        common = {"response_id": resp.id, "item_id": resp.item_id, "output_index": 0, "content_index": 0}
        if self.duplex and not resp.spoke:  # not a sample of audio: the model listened
            listening = {"object": "realtime.response", "id": resp.id, "status": "listening", "metadata": None}
            self.emit(ev.ResponseListen(response_id=resp.id, response=listening))
        self.emit(ev.ResponseOutputAudioDone(**common, epoch=resp.epoch))
        if self._take_text is not None:
            self.emit(ev.ResponseOutputAudioTranscriptDone(**common, transcript=resp.transcript))
        self.emit(ev.ResponseContentPartDone(**common, part={"type": "audio", "transcript": resp.transcript}))
        self.emit(ev.ResponseOutputItemDone(response_id=resp.id, output_index=0, item=item))
        if resp.params.in_conversation:
            self.emit(ev.ConversationItemDone(item=item, previous_item_id=resp.previous_item_id))
        playback = {
            "audio_samples": resp.out_samples,
            "audio_ms": resp.output_format.ms(resp.out_samples),
            "format": resp.output_format.to_wire(),
        }
        self.emit(
            ev.ResponseDone(
                response=self._response_wire(resp, status, [item], details),
                response_id=resp.id,
                epoch=resp.epoch,
                turn_id=resp.turn_id,
                playback=playback,
            )
        )

    # ------------------------------------------------------------ lease, resume, detach

    def _on_resume(self, msg: _Resume) -> None:
        cmd, transport = msg.command, msg.transport
        assert self.journal is not None
        if not self.lease.token_matches(cmd.resume_token):
            msg.future.set_exception(
                ProtocolError("invalid_resume_token", "resume token does not match", "resume_token")
            )
            return
        if cmd.generation is not None and cmd.generation != self.lease.generation:
            msg.future.set_exception(
                ProtocolError(
                    "generation_mismatch",
                    f"session is at generation {self.lease.generation}, not {cmd.generation}",
                    "generation",
                )
            )
            return
        old = self.transport
        if old is not None and old is not transport:
            self._deliver_direct(ev.SessionReplaced(session_id=self.id))
            old.close(CLOSE_REPLACED, "session replaced")
        self.transport = transport
        self.lease.attach(time.monotonic())
        token = self.lease.issue_token()
        replay = self.journal.since(cmd.seen)
        self._deliver_direct(
            ev.SessionResumed(
                session_id=self.id,
                resume_token=token,
                generation=self.lease.generation,
                last_server_event_seq=self.journal.last_seq,
                replayed=0 if replay is None else len(replay),
                session=self._session_wire(),
            )
        )
        if replay is None:
            self._deliver_direct(
                ev.SessionResyncRequired(
                    session_id=self.id,
                    requested_seq=cmd.seen,
                    oldest_available_seq=self.journal.oldest_seq,
                    last_server_event_seq=self.journal.last_seq,
                    session=self._session_wire(),
                    item_ids=[item["id"] for item in self.history],
                    active_response_id=None if self.active is None else self.active.id,
                )
            )
        else:
            transport.replay(replay)
        msg.future.set_result(None)

    async def _on_detach(self, transport: Transport) -> None:
        if transport is not self.transport:
            return
        self.transport = None
        if self.duplex:
            self.lease.detach(time.monotonic())
        else:
            await self._shutdown(None, "disconnected", CLOSE_NORMAL)

    async def _on_tick(self) -> None:
        now = time.monotonic()
        reason = self.lease.expiry(now, busy=self.active is not None)
        if reason is not None:
            await self._shutdown(
                ev.SessionExpired(session_id=self.id, reason=reason), f"expired: {reason}", CLOSE_EXPIRED
            )
            return
        beat = self.limits.heartbeat_s
        if beat and self.duplex and self.transport is not None and now - self._last_heartbeat >= beat:
            self._last_heartbeat = now
            assert self.journal is not None
            self._deliver_direct(
                ev.SessionHeartbeatEvent(
                    last_server_event_seq=self.journal.last_seq, server_time_ms=int(time.time() * 1000)
                )
            )

    # ------------------------------------------------------------ wire helpers

    def _session_wire(self) -> dict:
        wire = self.config.to_wire(self.id, self.expires_at)
        if self.duplex:
            wire.update(duplex_session_fields(self.config, self.settings, self.capabilities))
            wire["audio"]["input"]["sample_rate_hz"] = self.config.input_format.rate
            wire["audio"]["output"]["sample_rate_hz"] = self.config.output_format.rate
        return wire

    def _response_wire(self, resp: _Response, status: str, output: list, details: dict | None = None) -> dict:
        return {
            "id": resp.id,
            "object": "realtime.response",
            "status": status,
            "status_details": details,
            "output": output,
            "conversation_id": self.conversation_id if resp.params.in_conversation else None,
            "output_modalities": ["audio"],
            "max_output_tokens": "inf",
            "audio": {"output": {"format": resp.output_format.to_wire(), "voice": resp.params.voice}},
            "usage": None,
            "metadata": resp.params.metadata,
        }

    def _add_item(self, item: dict, previous: str | None, done: bool = True) -> None:
        index = 0 if previous is None else self.history.index(self._find(previous)) + 1  # type: ignore[arg-type]
        self.history.insert(index, item)
        self._measure(item)
        self.ledgers.history_items = len(self.history)
        self.emit(ev.ConversationItemAdded(item=item, previous_item_id=previous))
        if done:
            self.emit(ev.ConversationItemDone(item=item, previous_item_id=previous))

    def _measure(self, item: dict) -> None:
        """Count ``item``'s JSON against the input budget (again, when it has changed)."""
        size = len(json.dumps(item, separators=(",", ":")))
        self._items_bytes += size - self._item_bytes.get(item["id"], 0)
        self._item_bytes[item["id"]] = size

    def _find(self, item_id: str) -> dict | None:
        return next((item for item in self.history if item["id"] == item_id), None)

    def _require_item(self, item_id: str, verb: str) -> dict:
        """The item, or OpenAI's error for ``verb`` (retrieve, truncate, delete) on a missing one."""
        item = self._find(item_id)
        if item is None:
            raise ProtocolError(
                f"item_{verb}_invalid_item_id",
                f"Error {verb.removesuffix('e')}ing item: the item with id {quoted(item_id)} does not exist.",
                "item_id",
            )
        return item


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(8)}"


def _assistant_item(item_id: str, status: str, content: list) -> dict:
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def _error_event(err: ProtocolError) -> ev.Error:
    return ev.Error(
        error={"type": err.type, "code": err.code, "message": err.message, "param": err.param, "event_id": err.event_id}
    )
