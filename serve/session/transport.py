"""The session layer's view of a client connection: the events waiting for its socket, which the
socket's writer (the app's) drains."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ..protocol import encode_event
from ..protocol import events as ev

log = logging.getLogger("cadence_fx.serve")

CLOSE_SLOW_CONSUMER = 4008


@dataclass(frozen=True)
class _Text:
    text: str
    counted: int  # bytes counted against the outbound budget (0 for replayed texts)


@dataclass(frozen=True)
class _Close:
    code: int
    reason: str


class Transport:
    """Events waiting for one socket, at most ``max_bytes`` of them (replays aside), drained in
    order by ``pump``; never blocks the session. A client that lets more pile up is disconnected
    with 4008 at once: what was queued is dropped, and so is the event that did not fit (a duplex
    client gets them back from the journal when it resumes, since ``Limits.journal_bytes`` is at
    least ``Limits.outbound_bytes`` plus the largest event, ``Limits.min_journal_bytes``)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.queued_bytes = 0
        self._queue: asyncio.Queue[_Text | _Close] = asyncio.Queue()
        self._closing = False
        self.finished = asyncio.Event()  # the writer is done: the close went out or the peer is gone

    @property
    def closed(self) -> bool:
        """Closing or closed: nothing delivered from now on is sent."""
        return self._closing

    def send(self, event: ev.ServerEvent, text: str | None, duplex: bool) -> None:
        """Queue ``event``; ``text`` is its encoding when the session already made it (for the
        journal). A socket sends text; an in-process handle (``serve/inprocess.py``) takes the
        event itself."""
        self.deliver(text if text is not None else encode_event(event, duplex=duplex))

    def deliver(self, text: str) -> None:
        """Queue one encoded event, in order. A client too slow to take it is disconnected
        (``closed`` turns true) and the event dropped."""
        if self._closing:
            return
        if self.queued_bytes + len(text) > self.max_bytes:
            self._abort(CLOSE_SLOW_CONSUMER, "slow consumer")
            return
        self.queued_bytes += len(text)
        self._queue.put_nowait(_Text(text, len(text)))

    def replay(self, texts: list[str]) -> None:
        """Queue a resume's replay. The journal holds these texts already, so they count against
        its budget, not the outbound one."""
        if not self._closing:
            for text in texts:
                self._queue.put_nowait(_Text(text, 0))

    def close(self, code: int, reason: str) -> None:
        """Close after everything queued so far has been sent."""
        if not self._closing:
            self._closing = True
            self._queue.put_nowait(_Close(code, reason))

    def _abort(self, code: int, reason: str) -> None:
        log.info("closing a socket, %d bytes queued (outbound_bytes=%d): %s", self.queued_bytes, self.max_bytes, reason)
        while not self._queue.empty():
            self._queue.get_nowait()
        self.queued_bytes = 0
        self.close(code, reason)

    async def pump(self, send: Callable[[str], Awaitable[None]], close: Callable[[int, str], Awaitable[None]]) -> None:
        """The socket's writer: sends every queued event, then the close. Ends early, quietly, when
        a send fails (the peer is gone; the reader sees the disconnect too)."""
        try:
            while True:
                item = await self._queue.get()
                if isinstance(item, _Close):
                    await close(item.code, item.reason)
                    return
                self.queued_bytes -= item.counted
                await send(item.text)
        except Exception as exc:  # whatever the socket raised, it is closed now
            log.debug("socket writer stopped: %s: %s", type(exc).__name__, exc)
            self._closing = True
        finally:
            self.finished.set()
