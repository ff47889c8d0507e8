"""One client connection: frames in, commands routed to the session the connection holds.

A connection normally opens by creating a session. A duplex connection opened with a
``session_id`` creates none (so a client at the admission limit can still come back): it is
unbound until its ``session.resume`` succeeds, and is closed (4001) if that has not happened
within ``Limits.bind_timeout_s``. A duplex connection opened with ``autostart=0`` (vLLM-Omni's
client opens every connection so, and reconnects the same way to resume) creates its session at
its first command, unless that command is a ``session.resume``; it too is closed (4001) if no
command has come within ``Limits.bind_timeout_s``. A connection whose resumes fail ``Limits.max_resume_failures``
times (a wrong token, an unknown session) is closed (1008).
"""

from __future__ import annotations

import asyncio

from ..protocol import ProtocolError, client_commands, decode_command
from .codes import CLOSE_EXPIRED, CLOSE_POLICY, CLOSE_TRY_AGAIN, error_event
from .manager import SessionManager
from .session import Session
from .transport import Transport

# Resume failures that a client with the right token never sees (a generation race is not one).
_RESUME_FAILURES = {"invalid_resume_token", "session_not_found"}


class Connection:
    def __init__(self, manager: SessionManager, transport: Transport, duplex: bool, client: str) -> None:
        self.manager = manager
        self.transport = transport
        self.duplex = duplex
        self.client = client  # the peer's address: the per-client session limit counts by it
        self.session: Session | None = None
        self._errors = 0
        self._resume_failures = 0
        self._bind_timer: asyncio.TimerHandle | None = None
        self._deferred = False  # autostart=0: the session is created at the first command
        manager.connections.add(self)

    def open(self, resume: bool = False, autostart: bool = True) -> bool:
        """Create this connection's session (unless resuming, or deferred by ``autostart=0`` on a
        duplex connection); False if admission refused it."""
        if self.duplex and (resume or not autostart):
            self._deferred = not resume
            timeout = self.manager.limits.bind_timeout_s
            self._bind_timer = asyncio.get_running_loop().call_later(timeout, self._bind_expired, timeout)
            return True
        return self._create()

    def _create(self, opening: client_commands.SessionUpdate | None = None) -> bool:
        try:
            self.session = self.manager.create(self.transport, self.duplex, self.client, opening)
        except ProtocolError as err:
            self._send_unbound(err)
            self.transport.close(CLOSE_TRY_AGAIN, "resource exhausted")
            return False
        return True

    async def submit(self, command: client_commands.ClientCommand, frame_bytes: int) -> None:
        """A command already decoded (an in-process handle's, ``serve/inprocess.py``), its frame
        counted as ``frame_bytes``: routed as ``receive`` routes a frame's."""
        try:
            await self._route(command, frame_bytes)
        except ProtocolError as err:
            err.event_id = err.event_id or command.event_id
            self._fail(err)

    async def receive(self, frame: str | bytes) -> None:
        size = len(frame.encode()) if isinstance(frame, str) else len(frame)  # UTF-8 bytes, as on the wire
        limit = self.manager.limits.max_frame_bytes
        if size > limit:
            self._fail(ProtocolError("frame_too_large", f"frame of {size} bytes exceeds max_frame_bytes={limit}"))
            return
        try:
            command = decode_command(frame)
        except ProtocolError as err:
            self._fail(err)
            return
        await self.submit(command, size)

    def closed(self) -> None:
        self.manager.connections.discard(self)
        if self._bind_timer is not None:
            self._bind_timer.cancel()
        if self.session is not None:
            self.session.detach(self.transport)

    async def _route(self, command: client_commands.ClientCommand, frame_bytes: int) -> None:
        if command.TIER == 3 and not self.duplex:
            raise ProtocolError("unsupported_in_realtime_mode", f"{command.TYPE} needs a duplex connection (?duplex=1)", "type")
        if isinstance(command, client_commands.SessionResume):
            await self._resume(command)
            return
        if self.session is None and self._deferred:
            self._deferred = False
            if self._bind_timer is not None:
                self._bind_timer.cancel()
            # A session.update opens the session with it (Session.start); another command is
            # handled once the session is there.
            opening = command if isinstance(command, client_commands.SessionUpdate) else None
            if not self._create(opening) or opening is not None:
                return
        if self.session is None:
            raise ProtocolError("session_not_bound", "send session.resume first", "type")
        if command.session_id is not None and command.session_id != self.session.id:
            raise ProtocolError("session_mismatch", "command names a session this connection does not hold", "session_id")
        self.session.submit(command, self.transport, frame_bytes)

    async def _resume(self, command: client_commands.SessionResume) -> None:
        try:
            target = await self.manager.resume(command, self.transport)
        except ProtocolError as err:
            if err.code not in _RESUME_FAILURES:
                raise
            self._resume_failures += 1
            if self._resume_failures < self.manager.limits.max_resume_failures:
                raise
            # The error goes straight out, ahead of the close (a session's mailbox would be too late).
            err.event_id = command.event_id
            self._send_unbound(err)
            self.transport.close(CLOSE_POLICY, "too many failed resumes")
            return
        if self._bind_timer is not None:
            self._bind_timer.cancel()
        self._deferred = False
        if self.session is not None and self.session is not target:
            self.session.release(self.transport)
        self.session = target

    def _bind_expired(self, timeout: float) -> None:
        if self.session is None:
            what = "command" if self._deferred else "session.resume"
            self.transport.close(CLOSE_EXPIRED, f"no {what} within {timeout:g} s")

    def _fail(self, err: ProtocolError) -> None:
        if self.session is None:
            self._send_unbound(err)
        else:
            self.session.reject(err, self.transport)

    def _send_unbound(self, err: ProtocolError) -> None:
        self._errors += 1
        event = error_event(err)
        event.event_id = f"event_unbound{self._errors:06d}"
        self.transport.send(event, None, self.duplex)
