"""The FastAPI app: OpenAI Realtime over WebSocket, served by uvicorn.

Routes: ``/v1/realtime`` (WebSocket; Tier 1 only, or the duplex extensions with ``?duplex=1``),
``/v1/duplex`` (WebSocket, always duplex), ``/v1/models``, ``/health``. Every route but ``/health``
asks for the API key when the server has one (``access.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI, WebSocket
from starlette.websockets import WebSocketDisconnect

from .access import Access, AccessMiddleware
from .plugins import ModelPlugin, load_plugin
from .session import Connection, Limits, SessionManager, Transport

log = logging.getLogger("cadence_fx.serve")


def create_app(
    plugin_factory: Callable[[], ModelPlugin], limits: Limits | None = None, access: Access | None = None
) -> FastAPI:
    """The service app. ``plugin_factory`` builds the model plugin once, at startup."""
    limits = limits or Limits()
    access = access or Access()
    state: dict[str, object] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        plugin = plugin_factory()
        plugin.reserve(limits.max_sessions)  # before the first session, which then never waits for it
        manager = SessionManager(plugin, limits)
        await manager.start()
        state["plugin"], state["manager"] = plugin, manager
        app.state.manager = manager
        app.state.loop = asyncio.get_running_loop()
        try:
            yield
        finally:
            await manager.stop()
            plugin.close()

    docs = {} if access.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="cadence-fx duplex service", lifespan=lifespan, **docs)
    app.add_middleware(AccessMiddleware, access=access)

    async def serve_socket(ws: WebSocket, duplex: bool, session_id: str | None) -> None:
        manager: SessionManager = state["manager"]  # type: ignore[assignment]
        await ws.accept()
        transport = Transport(limits.outbound_bytes)
        writer = asyncio.create_task(transport.pump(ws.send_text, ws.close))
        connection = Connection(manager, transport, duplex, ws.client.host if ws.client else "unknown")
        try:
            if connection.open(resume=session_id is not None):
                while True:
                    message = await ws.receive()
                    if message["type"] == "websocket.disconnect":
                        break
                    frame = message.get("text")
                    await connection.receive(frame if frame is not None else message.get("bytes") or b"")
        except (WebSocketDisconnect, RuntimeError):
            pass
        finally:
            connection.closed()
            transport.close(1000, "")
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer, timeout=5.0)

    @app.websocket("/v1/realtime")
    async def realtime(ws: WebSocket, duplex: str = "0", session_id: str | None = None) -> None:
        await serve_socket(ws, duplex.lower() in ("1", "true", "yes", "on"), session_id)

    @app.websocket("/v1/duplex")
    async def duplex_alias(ws: WebSocket, session_id: str | None = None) -> None:
        await serve_socket(ws, True, session_id)

    @app.get("/v1/models")
    async def models() -> dict:
        plugin: ModelPlugin = state["plugin"]  # type: ignore[assignment]
        info = plugin.info
        described = await asyncio.to_thread(plugin.describe)
        return {
            "object": "list",
            "data": [
                {
                    "id": info.name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "cadence-fx",
                    "input_rate": info.input_rate,
                    "output_rate": info.output_rate,
                    "frame_samples": info.frame_samples,
                    "description": info.description,
                    "plugin": described,
                }
            ],
        }

    @app.get("/health")
    async def health() -> dict:
        manager: SessionManager = state["manager"]  # type: ignore[assignment]
        return {
            "status": "ok",
            "model": manager.plugin.info.name,
            "sessions": len(manager.sessions),
            "connections": len(manager.connections),  # sockets open, a session's or not yet
            "max_sessions": limits.max_sessions,
            "sessions_ended": manager.ended,
        }

    return app


def frame_ceiling(limits: Limits) -> int:
    """The largest frame uvicorn hands to the app (its ``ws_max_size``): four times the app's
    ``max_frame_bytes`` plus 64 KiB. A frame over ``max_frame_bytes`` up to this size is answered
    with a typed ``frame_too_large`` and the session goes on; uvicorn closes the connection on a
    larger one (code 1009) before the app sees it."""
    return 4 * limits.max_frame_bytes + (1 << 16)


def uvicorn_config(app: FastAPI, host: str, port: int, limits: Limits) -> uvicorn.Config:
    """The one uvicorn configuration of every server this package starts (``run_server``,
    ``cadence-fx serve``, ``background_server``)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        ws="websockets-sansio",
        ws_max_size=frame_ceiling(limits),
        log_level="warning",
        lifespan="on",
    )


class Server(uvicorn.Server):
    """uvicorn, draining the sessions before its own shutdown, which closes every socket with 1012
    before the app hears of it: clients get their ``session.closed`` and 1001 instead."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()  # no new connection while the sessions drain
        await self.config.app.state.manager.drain()  # type: ignore[union-attr]
        await super().shutdown(sockets)


def run_server(
    host: str, port: int, plugin_name: str, limits: Limits | None = None, access: Access | None = None
) -> None:
    """Serve until interrupted (``cadence-fx serve``); SIGTERM and SIGINT drain the sessions first."""
    limits, access = limits or Limits(), access or Access()
    notice = access.open_notice(host, port)
    if notice is not None:
        print(f"cadence-fx serve: {notice}", file=sys.stderr, flush=True)
    app = create_app(lambda: load_plugin(plugin_name), limits, access)
    Server(uvicorn_config(app, host, port, limits)).run()


@dataclass
class BackgroundServer:
    """A uvicorn server on a loopback port in a thread (tests and benchmarks)."""

    server: Server
    thread: threading.Thread
    host: str
    port: int

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://{self.host}:{self.port}"

    @property
    def manager(self) -> SessionManager:
        return self.server.config.app.state.manager  # type: ignore[union-attr]

    def call(self, fn: Callable[[], object], timeout: float = 5.0) -> object:
        """Run ``fn`` on the server's event loop (where session state lives) and return its result."""

        async def run() -> object:
            return fn()

        loop = self.server.config.app.state.loop  # type: ignore[union-attr]
        return asyncio.run_coroutine_threadsafe(run(), loop).result(timeout)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def background_server(
    plugin_factory: Callable[[], ModelPlugin],
    limits: Limits | None = None,
    host: str = "127.0.0.1",
    start_timeout_s: float = 120.0,
    access: Access | None = None,
    port: int | None = None,
) -> Iterator[BackgroundServer]:
    """``start_timeout_s`` covers the plugin's startup (its ``reserve``), which a model may take a
    while over. ``port``: a free one unless given."""
    limits = limits or Limits()
    port = port or free_port(host)
    server = Server(uvicorn_config(create_app(plugin_factory, limits, access), host, port, limits))
    thread = threading.Thread(target=server.run, name=f"uvicorn:{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("uvicorn failed to start")
        if time.monotonic() > deadline:
            raise RuntimeError(f"uvicorn did not start within {start_timeout_s:g} s")
        threading.Event().wait(0.01)
    handle = BackgroundServer(server, thread, host, port)
    try:
        yield handle
    finally:
        handle.stop()
