"""One session: its owner task, its mailbox, and the table of what each command does.

Everything that changes session state runs in the owner task, one mailbox message at a time, so
commands take effect in arrival order. Slow work (base64, G.711, resampling, VAD energy, model
calls) runs on the shared executor; model calls go through a ``ModelPort`` (port.py) that keeps
them in session order, never lets two of them overlap, and runs them on the manager's model
executor.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from ..plugins import ConfigRefused
from ..protocol import ProtocolError, client_commands
from ..protocol import events as ev
from ..protocol.duplex import apply_duplex, signalled_command
from .codes import CLOSE_NORMAL, error_event
from .conversation import Conversation
from .fence import ResponseFence
from .lifetime import Lifetime
from .messages import (
    DATA_COMMANDS,
    Detach,
    Inbound,
    Lost,
    Open,
    Reject,
    Release,
    ReplyEnd,
    Resume,
    Stop,
    Tick,
    b64_decoded_len,
)
from .transport import Transport
from .turns import InputTurns

log = logging.getLogger("cadence_fx.serve")


class Session(Lifetime):
    """One client's conversation with one model stream, alive across connections (a duplex one
    resumes). It is one object whose methods are grouped, by concern, in a line of classes, each
    calling only those below it:

    - ``SessionBase`` (base.py): every field, emission (stamp, journal, send), the input budget,
      and input frames to the model;
    - ``Conversation`` (conversation.py): the history's items and the conversation.item.* commands;
    - ``ResponseFence`` (fence.py): a response from creation to its terminal events, the reply's
      paced task, and the epoch that drops a cancelled reply's late chunks;
    - ``InputTurns`` (turns.py): appends, the server VAD's edges, commit and clear;
    - ``Lifetime`` (lifetime.py): detach, resume and the journal's replay, expiry, heartbeats, the end;
    - ``Session`` (here): start, the owner task and its dispatch, what connections call (on the
      event loop), session.update, and the command table.

    The mailbox messages are in messages.py, the close codes in codes.py, input decoding in
    input_path.py, the VAD in vad.py, the ack check in playback.py.
    """

    # ------------------------------------------------------------ lifecycle

    def start(self, transport: Transport, opening: client_commands.SessionUpdate | None = None) -> None:
        """Announce the session (``session.created``, ``rate_limits.updated``) and start its owner.
        ``opening``: the connection's first command, a ``session.update`` (``autostart=0``): it is
        applied first, so ``session.created`` already carries it (vLLM-Omni's client keeps the
        session object of ``session.created``), and answered with ``session.updated`` after."""
        self.transport = transport
        self.lease.attach(time.monotonic())
        if opening is None:
            self._announce()
        else:
            self.mailbox.put_nowait(Open(opening))
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

    async def _open(self, msg: Open) -> None:
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
                    self.emit(error_event(err))
                except Exception as exc:  # a bug must not take the session down: report it typed
                    log.exception("session %s failed on %s", self.id, type(msg).__name__)
                    self.emit(error_event(ProtocolError("server_error", f"internal error: {type(exc).__name__}")))
                # The socket's writer runs between two messages, so a burst of events reaches the
                # network as it is made and only a client that does not read fills the outbound budget.
                await asyncio.sleep(0)
        finally:
            if not self.closed:
                await self._shutdown(None, "owner_failed", CLOSE_NORMAL)
            while not self.mailbox.empty():
                msg = self.mailbox.get_nowait()
                if isinstance(msg, Resume) and not msg.future.done():
                    msg.future.set_exception(ProtocolError("session_not_found", "session has ended", "session_id"))

    # ------------------------------------------------------------ called by connections (on the loop)

    def submit(self, command: client_commands.ClientCommand, transport: Transport, frame_bytes: int) -> None:
        """Queue a decoded command (its frame had ``frame_bytes``); refuses at once (typed error)
        when the session is saturated."""
        self.lease.touch(time.monotonic())
        if self.mailbox.qsize() >= self.limits.max_pending_commands:
            self._refuse(command, "too many queued commands")
            return
        budgeted = frame_bytes if isinstance(command, DATA_COMMANDS) else 0
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
        if isinstance(command, client_commands.InputAudioBufferAppend):
            pending = b64_decoded_len(command.audio)
            if self.pending_input_bytes + pending > self.limits.max_pending_input_bytes:
                self._refuse(command, f"{self.pending_input_bytes} bytes of input audio are still queued")
                if not self._refusing_input:
                    self._refusing_input = True
                    self.report_rate_limits()
                return
            self.pending_input_bytes += pending
        self._queued_bytes += budgeted
        self.mailbox.put_nowait(Inbound(command, transport, pending, budgeted))

    def reject(self, error: ProtocolError, transport: Transport) -> None:
        """Answer a frame that did not decode, in order with the commands before it."""
        self.lease.touch(time.monotonic())
        self.mailbox.put_nowait(Reject(error, transport))

    async def resume(self, command: client_commands.SessionResume, transport: Transport) -> None:
        future = asyncio.get_running_loop().create_future()
        self.mailbox.put_nowait(Resume(command, transport, future))
        await future

    def detach(self, transport: Transport) -> None:
        if not self.closed:
            self.mailbox.put_nowait(Detach(transport))

    def release(self, transport: Transport) -> None:
        """The connection moved to another session: end this one without telling it anything."""
        if not self.closed:
            self.mailbox.put_nowait(Release(transport))

    async def stop(self, reason: str) -> None:
        """End the session (server shutdown), telling its client with ``session.closed``."""
        if not self.closed:
            self.mailbox.put_nowait(Stop(reason))
        if self._task is not None:
            await self._task

    def tick(self) -> None:
        if not self.closed and not self._tick_queued:
            self._tick_queued = True
            self.mailbox.put_nowait(Tick())

    # ------------------------------------------------------------ the owner's dispatch

    async def _handle(self, msg: Any) -> None:
        if isinstance(msg, Inbound):
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
                raise ProtocolError("server_error", f"internal error: {type(exc).__name__}", None, msg.command.event_id) from exc
            finally:
                self._handling = None
                self._dequeued(msg)
        elif isinstance(msg, Reject):
            if msg.transport is self.transport:
                self.emit(error_event(msg.error))
        elif isinstance(msg, ReplyEnd):
            self._on_reply_end(msg)
        elif isinstance(msg, Resume):
            self._on_resume(msg)
        elif isinstance(msg, Detach):
            await self._on_detach(msg.transport)
        elif isinstance(msg, Release):
            if msg.transport is self.transport:
                self.transport = None
                await self._shutdown(None, "superseded", CLOSE_NORMAL)
        elif isinstance(msg, Stop):
            await self._stop(msg.reason)
        elif isinstance(msg, Lost):
            await self._shutdown(None, "socket lost", CLOSE_NORMAL)
        elif isinstance(msg, Open):
            await self._open(msg)
        elif isinstance(msg, Tick):
            self._tick_queued = False
            await self._on_tick()

    # ------------------------------------------------------------ commands not in a piece

    async def _session_update(self, cmd: client_commands.SessionUpdate) -> None:
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
            upload_voice = getattr(self.stream, "upload_voice", None)
            assert callable(upload_voice), "apply_duplex takes a ref_audio only for a stream with upload_voice"
            try:
                await self.port.call(upload_voice, name, wav)
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

    async def _input_text(self, cmd: client_commands.InputTextAppend) -> None:
        raise ProtocolError("unsupported_feature", f"text input is not served: {self.plugin.info.name} hears audio only", "type")

    async def _turn_signal(self, cmd: client_commands.TurnSignal) -> None:
        """The command ``cmd.event`` names, with the fields in its ``payload``."""
        inner = signalled_command(cmd)
        await self._HANDLERS[type(inner)](self, inner)

    async def _close(self, cmd: client_commands.SessionClose) -> None:
        await self._shutdown(ev.SessionClosed(session_id=self.id, reason="client_closed"), "client_closed", CLOSE_NORMAL)

    _HANDLERS: dict[type, Callable[..., Any]] = {
        client_commands.SessionUpdate: _session_update,
        client_commands.InputAudioBufferAppend: InputTurns._append,
        client_commands.InputAudioBufferCommit: InputTurns._client_commit,
        client_commands.InputAudioBufferClear: InputTurns._clear,
        client_commands.ConversationItemCreate: Conversation._item_create,
        client_commands.ConversationItemRetrieve: Conversation._item_retrieve,
        client_commands.ConversationItemTruncate: Conversation._item_truncate,
        client_commands.ConversationItemDelete: Conversation._item_delete,
        client_commands.ResponseCreate: ResponseFence._response_create,
        client_commands.ResponseCancel: ResponseFence._response_cancel,
        client_commands.OutputAudioBufferClear: ResponseFence._output_clear,
        client_commands.SessionEventAck: Lifetime._event_ack,
        client_commands.PlaybackAck: ResponseFence._playback_ack,
        client_commands.SessionHeartbeat: Lifetime._heartbeat,
        client_commands.SessionClose: _close,
        client_commands.InputTextAppend: _input_text,
        client_commands.InputCancel: InputTurns._clear,
        client_commands.BargeInCommand: ResponseFence._barge_in,
        client_commands.TurnSignal: _turn_signal,
    }
