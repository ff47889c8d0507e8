"""The session manager: allocation, admission, lookup for resume, and the reaper."""

from __future__ import annotations

import asyncio
import secrets
from concurrent.futures import ThreadPoolExecutor

from ..plugins import ModelPlugin
from ..protocol import ProtocolError
from ..protocol import events as ev
from .ledger import Ledgers
from .limits import Limits
from .session import Session
from .transport import Transport

_KEEP_ENDED_LEDGERS = 256


class SessionManager:
    def __init__(self, plugin: ModelPlugin, limits: Limits) -> None:
        self.plugin = plugin
        self.limits = limits
        self.executor = ThreadPoolExecutor(max(1, limits.workers), thread_name_prefix="cadence-serve")
        # A model call holds its thread for as long as the model takes, and a session has at most
        # one in flight: one thread per session slot, so that no session's model call waits for
        # another's to free a thread, and none holds up decoding.
        self.model_executor = ThreadPoolExecutor(max(1, limits.max_sessions), thread_name_prefix="cadence-model")
        self.sessions: dict[str, Session] = {}
        self.ended = 0
        # The final ledgers of the latest ended sessions, for audits and tests.
        self.ended_ledgers: dict[str, Ledgers] = {}
        self._reaper: asyncio.Task | None = None

    async def start(self) -> None:
        self._reaper = asyncio.get_running_loop().create_task(self._reap(), name="session reaper")

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        tasks = [session.stop("server_shutdown") for session in list(self.sessions.values())]
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=5.0)
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.model_executor.shutdown(wait=False, cancel_futures=True)

    def create(self, transport: Transport, duplex: bool) -> Session:
        """A new session with a server-allocated, unguessable id, or ``resource_exhausted``."""
        if len(self.sessions) >= self.limits.max_sessions:
            raise ProtocolError("resource_exhausted", f"all {self.limits.max_sessions} session slots are in use")
        session_id = "sess_" + secrets.token_urlsafe(18)
        session = Session(self, session_id, self.plugin, self.limits, self.executor, duplex)
        self.sessions[session_id] = session
        session.start(transport)
        if len(self.sessions) == self.limits.max_sessions:  # now full: the others learn it
            self._report_rate_limits(besides=session)
        return session

    async def resume(self, command: ev.SessionResume, transport: Transport) -> Session:
        session = self.sessions.get(command.session_id)
        if session is None or not session.duplex or session.closed:
            raise ProtocolError("session_not_found", "no resumable session with that id", "session_id")
        await session.resume(command, transport)
        return session

    def forget(self, session: Session) -> None:
        was_full = len(self.sessions) == self.limits.max_sessions
        if self.sessions.pop(session.id, None) is not None:
            if was_full:  # a slot is free again
                self._report_rate_limits()
            self.ended += 1
            self.ended_ledgers[session.id] = session.ledgers
            while len(self.ended_ledgers) > _KEEP_ENDED_LEDGERS:
                del self.ended_ledgers[next(iter(self.ended_ledgers))]

    def _report_rate_limits(self, besides: Session | None = None) -> None:
        """Every session but `besides` is told the server's session slots changed."""
        for other in self.sessions.values():
            if other is not besides:
                other.report_rate_limits()

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(self.limits.reap_interval_s)
            for session in list(self.sessions.values()):
                session.tick()
