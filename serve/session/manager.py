"""The session manager: allocation, admission, lookup for resume, the reaper, and the drain."""

from __future__ import annotations

import asyncio
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from ..plugins import ModelPlugin, SlotsFull
from ..protocol import ProtocolError, client_commands, quoted
from .codes import CLOSE_GOING_AWAY
from .ledger import Ledgers
from .limits import Limits
from .session import Session
from .transport import Transport

_KEEP_ENDED_LEDGERS = 256
# After the drain, how long the sessions get to end (a model call in flight finishes first), and
# then their sockets to send what they hold and their close.
_STOP_S = 5.0


class ConnectionView(Protocol):
    """What the manager reads of a client connection (``connection.Connection``, which imports
    this module: the manager never imports it back)."""

    transport: Transport
    session: Session | None


class SessionManager:
    def __init__(self, plugin: ModelPlugin, limits: Limits, session_prefix: str = "sess_") -> None:
        self.plugin = plugin
        self.limits = limits
        # What every session id this manager allocates starts with: a scaled-out service names the
        # replica there, so a resume can be routed to the replica that holds the session.
        self.session_prefix = session_prefix
        self.executor = ThreadPoolExecutor(max(1, limits.workers), thread_name_prefix="cadence-serve")
        # A model call holds its thread for as long as the model takes, and a session has at most
        # one in flight: one thread per session slot, so that no session's model call waits for
        # another's to free a thread, and none holds up decoding.
        self.model_executor = ThreadPoolExecutor(max(1, limits.max_sessions), thread_name_prefix="cadence-model")
        self.sessions: dict[str, Session] = {}
        self.connections: set[ConnectionView] = set()
        self.draining = False
        self.ended = 0
        # The final ledgers of the latest ended sessions, for audits and tests.
        self.ended_ledgers: dict[str, Ledgers] = {}
        self._reaper: asyncio.Task | None = None
        self._full = False  # as the sessions were last told
        # How late the reaper wakes, over its wakes: the event loop's lag, which a loop too busy
        # with its sessions shows first (``/health``).
        self.lag_wakes, self.lag_total_s, self.lag_max_s = 0, 0.0, 0.0

    async def start(self) -> None:
        self._reaper = asyncio.get_running_loop().create_task(self._reap(), name="session reaper")

    async def drain(self) -> None:
        """Graceful shutdown, before the sockets close: no new session; responses in progress get
        up to ``Limits.drain_s`` to end; then every session ends with ``session.closed``
        (``server_shutdown``) and 1001, and every socket gets a little while to send what it holds.
        Runs once; later calls return at once."""
        if self.draining:
            return
        self.draining = True
        deadline = time.monotonic() + self.limits.drain_s
        while any(s.active is not None for s in self.sessions.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for connection in list(self.connections):
            if connection.session is None:
                connection.transport.close(CLOSE_GOING_AWAY, "server_shutdown")
        stops = [asyncio.ensure_future(s.stop("server_shutdown")) for s in list(self.sessions.values())]
        if stops:
            await asyncio.wait(stops, timeout=_STOP_S)
        flushed = [asyncio.ensure_future(c.transport.finished.wait()) for c in list(self.connections)]
        if flushed:
            await asyncio.wait(flushed, timeout=_STOP_S)
            for waiter in flushed:
                waiter.cancel()

    async def stop(self) -> None:
        await self.drain()
        if self._reaper is not None:
            self._reaper.cancel()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.model_executor.shutdown(wait=False, cancel_futures=True)

    def create(
        self, transport: Transport, duplex: bool, client: str, opening: client_commands.SessionUpdate | None = None
    ) -> Session:
        """A new session with a server-allocated, unguessable id (``session_prefix`` and 18 random
        bytes), or ``resource_exhausted``; ``opening``: its first command (``Session.start``)."""
        limits = self.limits
        if self.draining:
            raise ProtocolError("resource_exhausted", "the server is shutting down")
        if len(self.sessions) >= limits.max_sessions:
            raise ProtocolError("resource_exhausted", f"all {limits.max_sessions} session slots are in use")
        if self.plugin.free_slots() == 0:
            raise ProtocolError(
                "resource_exhausted",
                f"every slot of {self.plugin.info.name} is taken (its batch's, or its lanes' room; "
                f"max_sessions={limits.max_sessions} is not reached): a session needs a free slot",
            )
        held = sum(1 for s in self.sessions.values() if s.client == client)
        if held >= limits.max_sessions_per_client:
            raise ProtocolError(
                "resource_exhausted",
                f"this client ({quoted(client)}) holds {held} sessions, max_sessions_per_client={limits.max_sessions_per_client}",
            )
        session_id = self.session_prefix + secrets.token_urlsafe(18)
        try:
            session = Session(self, session_id, self.plugin, self.limits, self.executor, duplex, client)
        except SlotsFull as full:
            raise ProtocolError("resource_exhausted", f"{full}") from None
        self.sessions[session_id] = session
        session.start(transport, opening)
        self._admission_changed(besides=session)
        return session

    def remaining(self) -> int:
        """Sessions the server admits now: the session limit's room, and the model's free slots
        when it has a fixed number (``ModelPlugin.free_slots``)."""
        room = self.limits.max_sessions - len(self.sessions)
        free = self.plugin.free_slots()
        return room if free is None else min(room, free)

    async def resume(self, command: client_commands.SessionResume, transport: Transport) -> Session:
        session = self.sessions.get(command.session_id)
        if session is None or not session.duplex or session.closed:
            raise ProtocolError("session_not_found", "no resumable session with that id", "session_id")
        await session.resume(command, transport)
        return session

    def forget(self, session: Session) -> None:
        """Called once the session's stream has closed (its slot, if the model has slots, is free)."""
        if self.sessions.pop(session.id, None) is not None:
            self._admission_changed()
            self.ended += 1
            self.ended_ledgers[session.id] = session.ledgers
            while len(self.ended_ledgers) > _KEEP_ENDED_LEDGERS:
                del self.ended_ledgers[next(iter(self.ended_ledgers))]

    def _admission_changed(self, besides: Session | None = None) -> None:
        """When the server fills up or stops being full, every session but ``besides`` learns it."""
        full = self.remaining() == 0
        if full != self._full:
            self._full = full
            self._report_rate_limits(besides)

    def _report_rate_limits(self, besides: Session | None = None) -> None:
        """Every session but `besides` is told the server's session slots changed."""
        for other in self.sessions.values():
            if other is not besides:
                other.report_rate_limits()

    async def _reap(self) -> None:
        while True:
            asleep = time.monotonic()
            await asyncio.sleep(self.limits.reap_interval_s)
            lag = max(0.0, time.monotonic() - asleep - self.limits.reap_interval_s)
            self.lag_wakes += 1
            self.lag_total_s += lag
            self.lag_max_s = max(self.lag_max_s, lag)
            for session in list(self.sessions.values()):
                session.tick()
