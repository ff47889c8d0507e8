"""Sessions in process: typed commands in, typed events out, no socket and no JSON on the way.

The third consumer of a session, beside the WebSocket route and the plugins: ``DuplexService``
runs the same ``SessionManager`` the server runs (admission, limits, the reaper, the drain), and
each handle is a ``Connection`` whose transport takes the events themselves instead of their
text. So a session opened here is the same session, command for command and event for event,
as one opened over ``/v1/duplex`` (or ``/v1/realtime`` with ``duplex=False``)::

    import asyncio, numpy as np
    from cadence_fx.serve.inprocess import DuplexService
    from cadence_fx.serve.plugins import ToneModel
    from cadence_fx.serve.protocol import PCM24K, audio, client_commands, events as ev

    async def main() -> bytes:
        pcm = audio.encode_samples(0.1 * np.sin(np.arange(24_000) / 8).astype(np.float32), PCM24K)
        async with DuplexService(ToneModel()) as service:
            session = await service.open_session()
            await session.submit(client_commands.SessionUpdate(session={"audio": {"input": {"turn_detection": None}}}))
            await session.submit(client_commands.InputAudioBufferAppend(audio=audio.b64encode(pcm)))
            await session.submit(client_commands.InputAudioBufferCommit(response_create=True))
            reply = b""
            async for event in session.events():
                if isinstance(event, ev.ResponseOutputAudioDelta):
                    reply += audio.b64decode(event.delta)
                if isinstance(event, ev.ResponseDone):
                    return reply

    asyncio.run(main())

A handle that goes away without ``close`` (``detach``) leaves a duplex session waiting for a
resume for ``Limits.grace_s``, as a dropped socket does; ``service.resume_session`` takes it
back with the handle's ``session_id``, ``resume_token`` and the last ``server_event_seq`` it
read, and the events it missed are replayed. An event is a copy of what the session sent, taken
when it sent it (the session keeps changing its items; an event shows them as they were, as the
socket's text does); the journal a resume replays from keeps its events encoded (its budget is in
bytes), so replayed events are decoded from it. A command's input budget counts what its frame would be: an append's
base64, another data command's encoding.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from typing import Any

from .plugins import ModelPlugin
from .protocol import client_commands, decode_event, encode_command
from .protocol import events as ev
from .session import Connection, Limits, SessionManager, Transport
from .session.messages import DATA_COMMANDS
from .session.transport import CLOSE_SLOW_CONSUMER


class SessionClosedError(Exception):
    """The session's handle was closed by the server: ``code`` and ``reason`` as a socket's close."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(f"session closed ({code}): {reason}")
        self.code, self.reason = code, reason


class _Closed:
    def __init__(self, code: int, reason: str) -> None:
        self.code, self.reason = code, reason


class EventTransport(Transport):
    """A transport that queues the events themselves for ``SessionHandle.events``. Bounded as a
    socket's is, by events instead of bytes: a handle whose reader lets ``max_events`` pile up is
    closed as a slow consumer (4008), and a duplex session then waits for its resume."""

    def __init__(self, max_events: int) -> None:
        super().__init__(max_bytes=0)
        self.max_events = max_events
        self._events: asyncio.Queue[ev.ServerEvent | _Closed] = asyncio.Queue()

    def send(self, event: ev.ServerEvent, text: str | None, duplex: bool) -> None:
        if self._closing:
            return
        if self._events.qsize() >= self.max_events:
            self._abort(CLOSE_SLOW_CONSUMER, "slow consumer")
            return
        self._events.put_nowait(copy.deepcopy(event))

    def deliver(self, text: str) -> None:
        raise AssertionError("an in-process transport takes events, not text (Transport.send)")

    def replay(self, texts: list[str]) -> None:
        if not self._closing:
            for text in texts:
                self._events.put_nowait(decode_event(text))

    def close(self, code: int, reason: str) -> None:
        if not self._closing:
            self._closing = True
            self._events.put_nowait(_Closed(code, reason))
            self.finished.set()

    def _abort(self, code: int, reason: str) -> None:
        while not self._events.empty():
            self._events.get_nowait()
        self.close(code, reason)

    async def next(self) -> ev.ServerEvent | _Closed:
        return await self._events.get()


class SessionHandle:
    """One in-process session: ``submit`` commands, iterate ``events``."""

    def __init__(self, connection: Connection, transport: EventTransport) -> None:
        self._connection = connection
        self._transport = transport
        self.session_id: str | None = None
        self.resume_token: str | None = None
        self.last_server_event_seq = 0  # the newest journaled event read from ``events``

    async def submit(self, command: client_commands.ClientCommand) -> None:
        """Hand ``command`` to the session, in order with the ones before it; a refused one is
        answered with an ``ev.Error`` event, as on the wire."""
        await self._connection.submit(command, _frame_bytes(command))

    async def events(self) -> AsyncIterator[ev.ServerEvent]:
        """The session's events, in order, until it closes (then ``SessionClosedError`` unless the
        close was a normal one, 1000) or the handle is detached."""
        while True:
            item = await self._transport.next()
            if isinstance(item, _Closed):
                if item.code != 1000:
                    raise SessionClosedError(item.code, item.reason)
                return
            self._note(item)
            yield item

    async def next_event(self, timeout: float | None = None) -> ev.ServerEvent:
        """The next event (``SessionClosedError`` if the session closes first)."""
        item = await asyncio.wait_for(self._transport.next(), timeout)
        if isinstance(item, _Closed):
            raise SessionClosedError(item.code, item.reason)
        self._note(item)
        return item

    def _note(self, event: ev.ServerEvent) -> None:
        if isinstance(event, (ev.SessionCreated, ev.SessionResumed)):
            self.resume_token = event.resume_token
            self.session_id = event.session_id if isinstance(event, ev.SessionResumed) else event.session["id"]
        if event.server_event_seq is not None:
            self.last_server_event_seq = event.server_event_seq

    def detach(self) -> None:
        """Let go of the session without closing it (a dropped socket, in process)."""
        self._connection.closed()
        self._transport.close(1000, "detached")

    async def close(self) -> None:
        """End the session (``session.close``; a plain session ends with its handle)."""
        if self._connection.duplex:
            await self.submit(client_commands.SessionClose())
        else:
            self.detach()


class DuplexService:
    """The service's session layer in this process, for ``plugin``: an async context manager
    that starts a ``SessionManager`` and drains it on exit."""

    def __init__(self, plugin: ModelPlugin, limits: Limits | None = None, max_events: int = 4096) -> None:
        self.plugin = plugin
        self.limits = limits or Limits()
        self.max_events = max_events
        self.manager: SessionManager | None = None

    async def __aenter__(self) -> DuplexService:
        self.plugin.reserve(self.limits.max_sessions)
        self.manager = SessionManager(self.plugin, self.limits)
        await self.manager.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self.manager is not None:
            await self.manager.stop()

    def _handle(self, duplex: bool) -> SessionHandle:
        assert self.manager is not None, "use DuplexService as `async with`"
        transport = EventTransport(self.max_events)
        return SessionHandle(Connection(self.manager, transport, duplex, "in-process"), transport)

    async def open_session(self, duplex: bool = True) -> SessionHandle:
        """A new session (its first events, ``session.created`` and ``rate_limits.updated``, are
        the first ``events``); ``SessionClosedError`` (1013) if admission refuses it."""
        handle = self._handle(duplex)
        if not handle._connection.open():
            closed = await handle._transport.next()
            while not isinstance(closed, _Closed):
                closed = await handle._transport.next()
            raise SessionClosedError(closed.code, closed.reason)
        return handle

    async def resume_session(self, session_id: str, resume_token: str, last_server_event_seq: int) -> SessionHandle:
        """A handle on a detached duplex session: its first events are ``session.resumed`` and the
        replay after ``last_server_event_seq`` (or ``session.resync_required``), else an ``ev.Error``."""
        handle = self._handle(True)
        handle._connection.open(resume=True)
        await handle.submit(
            client_commands.SessionResume(
                session_id=session_id, resume_token=resume_token, last_server_event_seq=last_server_event_seq
            )
        )
        return handle


def _frame_bytes(command: client_commands.ClientCommand) -> int:
    """What the command's frame would count against the input budget (``Session.submit``)."""
    if isinstance(command, client_commands.InputAudioBufferAppend):
        return len(command.audio)
    if isinstance(command, DATA_COMMANDS):
        return len(encode_command(command))
    return 0
