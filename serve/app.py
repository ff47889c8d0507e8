"""The FastAPI app: OpenAI Realtime over WebSocket, served by uvicorn.

Routes: ``/v1/realtime`` (WebSocket; Tier 1 only, or the duplex extensions with ``?duplex=1``),
``/v1/duplex`` (WebSocket, always duplex), ``/v1/models``, ``/health``, and the browser page at
``/`` (its files under ``/static``, shipped in the package). Every route answers only to the
server's own host names, and every route but ``/health`` and the page asks for the API key when
the server has one (``access.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import uvicorn
from fastapi import FastAPI, WebSocket
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from starlette.websockets import WebSocketDisconnect

from cadence_fx.memory import DeviceMemory

from .access import KEY_SUBPROTOCOL, Access, AccessMiddleware
from .plugins import ModelPlugin, load_plugin
from .request_timeout import RequestTimeoutProtocol
from .runtime.heap import PAUSES, settle
from .session import Connection, Limits, SessionManager, Transport

log = logging.getLogger("cadence_fx.serve")

STATIC = Path(__file__).resolve().parent / "static"
# OpenAI's browser clients offer these subprotocols (a browser cannot set headers on a WebSocket);
# the handshake must echo "realtime". The key entry ("openai-insecure-api-key.<key>") is checked by
# the access layer (access.py), and echoed only when it is all that was offered (selected_subprotocol).
REALTIME_SUBPROTOCOL = "realtime"
# ``?autostart=`` values that defer a duplex connection's session to its first command (vLLM-Omni's
# client sends autostart=0 on every connection).
_FALSE = ("0", "false", "no", "off")
T = TypeVar("T")  # what a function run on the server's loop (BackgroundServer.call) returns


def selected_subprotocol(offered: list[str]) -> str | None:
    """The subprotocol the handshake answers with: ``realtime`` when offered; else, for an offer of
    only the key entry (a page that sends its key alone), that entry: a browser fails a handshake
    whose answer is none of what it offered, and the entry is the client's own, back on its own
    connection. Anything else: none."""
    if REALTIME_SUBPROTOCOL in offered:
        return REALTIME_SUBPROTOCOL
    if len(offered) == 1 and offered[0].startswith(KEY_SUBPROTOCOL):
        return offered[0]
    return None


@dataclass
class _Started:
    """What the app's lifespan builds at startup (its device memory baseline, the plugin, the
    session manager), which its routes use."""

    parts: tuple[DeviceMemory, ModelPlugin, SessionManager] | None = None

    def get(self) -> tuple[DeviceMemory, ModelPlugin, SessionManager]:
        if self.parts is None:
            raise RuntimeError("the service's lifespan has not started: serve the app through uvicorn (run_server)")
        return self.parts


def create_app(
    plugin_factory: Callable[[], ModelPlugin],
    limits: Limits | None = None,
    access: Access | None = None,
    session_prefix: str = "sess_",
    settle_heap: bool = False,
) -> FastAPI:
    """The service app. ``plugin_factory`` builds the model plugin once, at startup.
    ``session_prefix``: what its session ids start with (a Ray replica's names the replica).
    ``settle_heap``: the app owns its process (``run_server``, a Ray replica), so once the plugin
    is loaded, everything then alive is left out of later garbage collections (``runtime.heap.settle``)."""
    limits = limits or Limits()
    access = access or Access()
    state = _Started()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Started before the model loads: the device footprint it reports is the service's own.
        memory = DeviceMemory.of_process()
        plugin = plugin_factory()
        plugin.reserve(limits.max_sessions)  # before the first session, which then never waits for it
        if settle_heap:
            settle()
        PAUSES.watch()  # the collections while it serves
        manager = SessionManager(plugin, limits, session_prefix)
        await manager.start()
        state.parts = (memory, plugin, manager)
        app.state.manager = manager
        app.state.loop = asyncio.get_running_loop()
        try:
            yield
        finally:
            await manager.stop()
            plugin.close()

    app = FastAPI(title="cadence-fx duplex service", lifespan=lifespan, **access.docs_routes())
    app.add_middleware(AccessMiddleware, access=access)

    async def serve_socket(ws: WebSocket, duplex: bool, session_id: str | None, autostart: str = "1") -> None:
        _, _, manager = state.get()
        await ws.accept(subprotocol=selected_subprotocol(ws.scope.get("subprotocols", [])))
        transport = Transport(limits.outbound_bytes)
        writer = asyncio.create_task(transport.pump(ws.send_text, ws.close))
        connection = Connection(manager, transport, duplex, ws.client.host if ws.client else "unknown")
        try:
            if connection.open(resume=session_id is not None, autostart=autostart.lower() not in _FALSE):
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
    async def realtime(ws: WebSocket, duplex: str = "0", session_id: str | None = None, autostart: str = "1") -> None:
        await serve_socket(ws, duplex.lower() in ("1", "true", "yes", "on"), session_id, autostart)

    @app.websocket("/v1/duplex")
    async def duplex_alias(ws: WebSocket, session_id: str | None = None, autostart: str = "1") -> None:
        await serve_socket(ws, True, session_id, autostart)

    @app.get("/v1/models")
    async def models() -> dict:
        memory, plugin, _ = state.get()
        return model_list(plugin, await asyncio.to_thread(plugin.describe), memory.record())

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/health")
    async def health() -> dict:
        return health_of(state.get()[2])

    return app


def model_list(plugin: ModelPlugin, described: dict, memory: dict) -> dict:
    """``/v1/models``: the served model as an OpenAI model list; ``described``: ``plugin.describe()``;
    ``memory``: this process's peak allocated, reserved and device footprint (`cadence_fx.memory`)."""
    info = plugin.info
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
                "memory": memory,
            }
        ],
    }


def health_of(manager: SessionManager) -> dict:
    """``/health`` (read on the server's event loop, where the sessions live)."""
    return {
        "status": "ok",
        "model": manager.plugin.info.name,
        "sessions": len(manager.sessions),
        "connections": len(manager.connections),  # sockets open, a session's or not yet
        "max_sessions": manager.limits.max_sessions,
        "free_slots": manager.plugin.free_slots(),  # None: the model has no fixed slots
        "admits": manager.remaining(),  # sessions a new connection may still get
        "sessions_ended": manager.ended,
        "loop_lag_ms": {  # how late the session reaper woke: the event loop's lag
            "wakes": manager.lag_wakes,
            "mean": round(1e3 * manager.lag_total_s / max(1, manager.lag_wakes), 2),
            "max": round(1e3 * manager.lag_max_s, 2),
        },
        "gc": PAUSES.record(),  # this process's garbage collections: a full one holds the event loop
    }


def frame_ceiling(limits: Limits) -> int:
    """The largest frame uvicorn hands to the app (its ``ws_max_size``): four times the app's
    ``max_frame_bytes`` plus 64 KiB. A frame over ``max_frame_bytes`` up to this size is answered
    with a typed ``frame_too_large`` and the session goes on; uvicorn closes the connection on a
    larger one (code 1009) before the app sees it."""
    return 4 * limits.max_frame_bytes + (1 << 16)


@dataclass(frozen=True)
class Tls:
    """The PEM files uvicorn serves ``https://`` and ``wss://`` with."""

    keyfile: str
    certfile: str


def uvicorn_config(
    app: FastAPI, host: str, port: int, limits: Limits, tls: Tls | None = None, forwarded_allow_ips: str | None = None
) -> uvicorn.Config:
    """The one uvicorn configuration of every server this package starts (``run_server``,
    ``cadence-fx serve``, ``background_server``). ``forwarded_allow_ips``: the peers whose
    ``X-Forwarded-For`` names the client, as uvicorn reads it (``Access.forwarded_allow_ips``);
    None: no peer's, and the header is not read at all. (uvicorn's own default trusts 127.0.0.1,
    so any local process, or a proxy on the host that passes the header through, could name a
    new client on each connection, past the per-client session limit: issue 41.)"""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        # uvicorn's HTTP protocol, with a deadline for each request to arrive whole (Limits.request_timeout_s).
        # uvicorn annotates `http` as a class but only calls it, as asyncio calls any protocol factory.
        http=functools.partial(RequestTimeoutProtocol, request_timeout_s=limits.request_timeout_s),  # type: ignore[arg-type]
        ws="websockets-sansio",
        ws_max_size=frame_ceiling(limits),
        # No permessage-deflate: the events are mostly base64 audio, which deflates by a quarter at
        # best, and deflating every event took a third of the event loop's time serving 8 Moshi
        # sessions (measured, issue 13): time a busy server needs to answer its sessions.
        ws_per_message_deflate=False,
        log_level="warning",
        lifespan="on",
        ssl_keyfile=None if tls is None else tls.keyfile,
        ssl_certfile=None if tls is None else tls.certfile,
        proxy_headers=forwarded_allow_ips is not None,
        forwarded_allow_ips=forwarded_allow_ips,
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
    host: str,
    port: int,
    plugin_name: str,
    limits: Limits | None = None,
    access: Access | None = None,
    tls: Tls | None = None,
    on_ready: Callable[[str, dict], None] | None = None,
    plugin_options: dict[str, object] | None = None,
) -> None:
    """Serve until interrupted (``cadence-fx serve``); SIGTERM and SIGINT drain the sessions first.
    ``on_ready(base_url, health)`` is called once the model is loaded and ``/health`` answers."""
    limits, access = limits or Limits(), (access or Access()).serving(host)
    notice = access.open_notice(host, port)
    if notice is not None:
        print(f"cadence-fx serve: {notice}", file=sys.stderr, flush=True)
    app = create_app(lambda: load_plugin(plugin_name, **(plugin_options or {})), limits, access, settle_heap=True)
    server = Server(uvicorn_config(app, host, port, limits, tls, access.forwarded_allow_ips))
    if on_ready is not None:
        base = f"{'https' if tls else 'http'}://{f'[{host}]' if ':' in host else host}:{port}"
        threading.Thread(target=_announce, args=(server, base, on_ready, access), name="ready", daemon=True).start()
    server.run()


def _announce(server: uvicorn.Server, base: str, on_ready: Callable[[str, dict], None], access: Access) -> None:
    """Waits for uvicorn's startup (the plugin loads in the lifespan, before it), then for
    ``/health`` to answer over the server's own scheme, then calls ``on_ready``."""
    while not server.started:
        if server.should_exit:
            return
        time.sleep(0.05)
    probe = base.replace("://0.0.0.0:", "://127.0.0.1:").replace("://[::]:", "://[::1]:")
    context = None
    if base.startswith("https"):
        # The probe talks to this very process, whose certificate may be self-signed.
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    while not server.should_exit:
        try:
            with urllib.request.urlopen(probe + "/health", timeout=2, context=context) as answer:
                health = json.load(answer)
        except OSError:
            time.sleep(0.1)
            continue
        on_ready(base, health)
        return


@dataclass
class BackgroundServer:
    """A uvicorn server in a thread (tests, benchmarks and the Ray replicas, ``serve/ray.py``)."""

    server: Server
    thread: threading.Thread
    host: str
    port: int
    tls: Tls | None = None

    @property
    def http_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"{'wss' if self.tls else 'ws'}://{self.host}:{self.port}"

    @property
    def manager(self) -> SessionManager:
        return self.server.config.app.state.manager  # type: ignore[union-attr]

    def call(self, fn: Callable[[], T], timeout: float = 5.0) -> T:
        """Run ``fn`` on the server's event loop (where session state lives) and return its result."""

        async def run() -> T:
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


def server_process(code: str, port: int, *, timeout_s: float, args: tuple[str, ...] = ()) -> subprocess.Popen:
    """``python -c code *args``, a server on ``port`` in its own process, once ``/health`` answers
    (the benchmarks' servers: the load they measure runs in another process)."""
    proc = subprocess.Popen([sys.executable, "-c", code, *args])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before it answered /health")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as answer:
                if answer.status == 200:
                    return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server did not answer /health within {timeout_s:g} s")


@contextlib.contextmanager
def background_server(
    plugin_factory: Callable[[], ModelPlugin],
    limits: Limits | None = None,
    host: str = "127.0.0.1",
    start_timeout_s: float = 120.0,
    tls: Tls | None = None,
    access: Access | None = None,
    port: int | None = None,
    session_prefix: str = "sess_",
    forwarded_allow_ips: str | None = None,
    settle_heap: bool = False,
) -> Iterator[BackgroundServer]:
    """``start_timeout_s`` covers the plugin's startup (its ``reserve``), which a model may take a
    while over. ``port``: a free one unless given. ``session_prefix``, ``settle_heap`` and
    ``forwarded_allow_ips`` (by default ``access``'s): as in ``create_app`` and ``uvicorn_config``."""
    limits, access = limits or Limits(), (access or Access()).serving(host)
    port = port or free_port(host)
    app = create_app(plugin_factory, limits, access, session_prefix, settle_heap)
    if forwarded_allow_ips is None:
        forwarded_allow_ips = access.forwarded_allow_ips
    server = Server(uvicorn_config(app, host, port, limits, tls, forwarded_allow_ips))
    thread = threading.Thread(target=server.run, name=f"uvicorn:{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("uvicorn failed to start")
        if time.monotonic() > deadline:
            raise RuntimeError(f"uvicorn did not start within {start_timeout_s:g} s")
        threading.Event().wait(0.01)
    handle = BackgroundServer(server, thread, host, port, tls)
    try:
        yield handle
    finally:
        handle.stop()
