"""uvicorn's HTTP protocol (httptools) with a deadline for each request to arrive whole.

uvicorn 0.54 times a connection out only while it idles between requests (``timeout_keep_alive``),
never while a request is on its way: a client that sends half a request line, half its headers, or
nothing at all held its socket for good, and 300 of them used up the process's open files, so that
``/health`` itself failed (issue 41). No setting of uvicorn's covers it, hence this subclass of its
protocol class, handed to ``uvicorn.Config(http=...)`` (``app.uvicorn_config``); it needs nothing
of the ASGI app.

The deadline: ``request_timeout_s`` from the socket's opening, from the first byte of a request,
or from the end of the previous response, to the request's end (its line, headers and any body;
for a WebSocket handshake, its headers, after which the socket belongs to the WebSocket protocol and
no deadline applies). Missed, a request whose headers had not all come is answered ``408 Request
Timeout`` (``Connection: close``); one whose headers had come may have been answered already, and
its socket is closed without another answer. A response being computed is never timed nor cut: the
deadline stops once the request is whole, waits while a response is under way, and restarts when it
is done.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class RequestTimeoutProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, request_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.request_timeout_s = request_timeout_s
        self._deadline: asyncio.TimerHandle | None = None
        self._headers_complete = False  # those of the request being read

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    # httptools' parser callbacks

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._headers_complete = False
        self._arm()  # the request's first byte: it has the whole deadline from here

    def on_headers_complete(self) -> None:
        self._headers_complete = True
        if self.parser.should_upgrade() and self._should_upgrade():  # a WebSocket handshake is whole with its headers
            self._disarm()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        idle = not self.pipeline  # else the next request, already whole, starts now
        super().on_response_complete()
        if idle and not self.transport.is_closing():
            self._arm()

    # the deadline

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.request_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # A whole request is being answered (a later one, pipelined, is still coming): neither
            # a 408 nor a close may cut into its response. The deadline restarts when it is done.
            return
        if not self._headers_complete:
            body = (
                f"the request did not arrive whole within request_timeout_s={self.request_timeout_s:g} s: "
                "send its line, headers and body at once"
            ).encode()
            head = [b"HTTP/1.1 408 Request Timeout\r\n"]
            head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
            head += [
                b"content-type: text/plain; charset=utf-8\r\n",
                b"content-length: " + str(len(body)).encode() + b"\r\n",
                b"connection: close\r\n\r\n",
            ]
            self.transport.write(b"".join(head) + body)
        self.transport.close()
