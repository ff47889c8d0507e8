"""The service on Ray Serve: many replicas, one ingress, sessions routed to where they live.

A duplex session is stateful (its slot, journal, lease and resume token live in one process), so
every connection of a session must reach the replica that holds it. Ray Serve's router spreads
requests over the replicas of a deployment as it likes and cannot be told "this one", so:

* **One deployment per replica** (``replica-0``, ``replica-1``, ..., each ``num_replicas=1`` and,
  on GPUs, one GPU): a ``SessionReplica`` runs the cadence-fx server itself (``create_app`` under
  the same uvicorn configuration as ``cadence-fx serve``) on a port of its node, with its own plugin,
  ``SessionManager`` and ``Limits``. Its session ids name it: ``sess_r1_...`` was allocated by
  replica 1 (``session_prefix``, ``replica_of``).
* **One ingress** (``SessionRouter``, Ray Serve's FastAPI ingress behind Ray's HTTP proxy) serves
  the same routes as one server. A WebSocket is bridged frame by frame to one replica's own
  socket: a connection opened with ``?session_id=`` (a resume, a takeover, a ``/v1/duplex``
  reconnect) goes to the replica its id names; a new session goes to the replica with the most
  free slots, asked through the deployments' handles (``SessionReplica.health``), counting the
  sessions it has just placed that a replica's answer may not count yet. ``/health`` and
  ``/v1/models`` gather every replica's.
* **A replica that dies** drops its sockets without a close frame. The ingress then ends each of
  its sessions as a server that goes away does, with its own reason: ``session.closed``
  (``replica_lost``, duplex connections only) and close code 1001 ``replica_lost``. A resume of
  such a session finds its replica down (the same signal) or restarted by Ray Serve without it
  (``session_not_found``). The other replicas' sessions do not notice.

``cadence-fx serve --ray`` starts it; ``serve run cadence_fx.serve.ray:app`` too (``app`` is an
application builder: ``serve run cadence_fx.serve.ray:app model=tone replicas=2``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import signal
import ssl
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from urllib.parse import urlencode

import ray
import websockets
from fastapi import FastAPI, WebSocket
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.websockets import WebSocketDisconnect
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from cadence_fx.memory import DeviceMemory

from .access import Access, AccessMiddleware
from .app import STATIC, BackgroundServer, Tls, background_server, health_of, model_list
from .plugins import DEFAULT_PLUGIN, load_plugin
from .protocol import ProtocolError, encode_event
from .protocol import events as ev
from .session import Limits
from .session.codes import CLOSE_GOING_AWAY, CLOSE_TRY_AGAIN, error_event

log = logging.getLogger("cadence_fx.serve.ray")

APP_NAME = "cadence-fx"  # the Ray Serve application ``cadence-fx serve --ray`` runs
REPLICA_LOST = "replica_lost"
_SESSION_ID = re.compile(r"sess_r(\d+)_")
# A replica that does not answer its probe within this is down (for this connection).
PROBE_S = 2.0
CONNECT_S = 10.0
# Server events that name the session a connection holds: the first frame of each on the wire.
_NAMING_EVENTS = ('{"type":"session.created"', '{"type":"session.resumed"')
_SENDABLE_CLOSE = frozenset({1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011, 1012, 1013, 1014})


def session_prefix(replica: int) -> str:
    """What the session ids replica ``replica`` allocates start with."""
    return f"sess_r{replica}_"


def replica_of(session_id: str) -> int | None:
    """The replica a session id names, or None for an id no replica allocated."""
    match = _SESSION_ID.match(session_id)
    return None if match is None else int(match.group(1))


@dataclass(frozen=True)
class RaySpec:
    """What ``cadence-fx serve --ray`` deploys: ``replicas`` servers of ``model``, each with its own
    ``limits`` (``max_sessions`` is per replica) and ``gpus_per_replica`` GPUs."""

    model: str = DEFAULT_PLUGIN
    replicas: int = 2
    limits: Limits = field(default_factory=Limits)
    access: Access = field(default_factory=Access)
    plugin_options: dict[str, object] = field(default_factory=dict)
    gpus_per_replica: float = 0.0
    cpus_per_replica: float = 1.0
    start_timeout_s: float = 600.0  # a replica's plugin startup (a full-size model loads for minutes)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas={self.replicas}: a deployment needs at least one replica")


@serve.deployment(num_replicas=1, max_ongoing_requests=256, health_check_period_s=2.0)
class SessionReplica:
    """One cadence-fx server (its plugin, ``SessionManager`` and uvicorn) on a port of this node.
    The ingress bridges WebSockets to that port; handle calls report on it."""

    def __init__(self, replica: int, spec: RaySpec) -> None:
        self.replica = replica
        # Started before the model loads: the device footprint it reports is this replica's own.
        self.memory = DeviceMemory.of_process()
        self._stack = contextlib.ExitStack()
        host = ray.util.get_node_ip_address()
        self.server: BackgroundServer = self._stack.enter_context(
            background_server(
                lambda: load_plugin(spec.model, **spec.plugin_options),
                spec.limits,
                host=host,
                start_timeout_s=spec.start_timeout_s,
                access=spec.access,
                session_prefix=session_prefix(replica),
                # The ingress names the client in X-Forwarded-For: the per-client limit counts it.
                forwarded_allow_ips="*",
                settle_heap=True,  # the replica's actor process is its own
            )
        )
        self.actor = ray.get_runtime_context().get_actor_name()

    async def health(self) -> dict:
        """This server's ``/health``, with where its sockets are (``url``) and its Ray actor."""
        report = await asyncio.to_thread(self.server.call, lambda: health_of(self.server.manager))
        return {"replica": self.replica, "url": self.server.ws_url, "actor": self.actor, **report}

    async def models(self) -> dict:
        plugin = self.server.manager.plugin
        return model_list(plugin, await asyncio.to_thread(plugin.describe), self.memory.record())

    async def audit(self, session_id: str) -> dict | None:
        """A session's ledgers (``Ledgers.to_dict``) and, while it lives, the client address it
        counts against; None for a session neither live nor among the latest ended."""

        def read() -> dict | None:
            manager = self.server.manager
            session = manager.sessions.get(session_id)
            ledgers = session.ledgers if session is not None else manager.ended_ledgers.get(session_id)
            if ledgers is None:
                return None
            client = None if session is None else session.client
            return {"live": session is not None, "client": client, "ledgers": ledgers.to_dict()}

        return await asyncio.to_thread(self.server.call, read)

    def check_health(self) -> None:
        """Ray Serve's probe: the replica is unhealthy once its server thread has ended."""
        if not self.server.thread.is_alive():
            raise RuntimeError(f"replica {self.replica}: its uvicorn server has stopped")

    def __del__(self) -> None:
        # A graceful stop (serve.shutdown, a redeploy): the sessions drain as a server's do.
        self._stack.close()


@serve.deployment(num_replicas=1, max_ongoing_requests=100_000, ray_actor_options={"num_cpus": 0})
@serve.ingress()
class SessionRouter:
    """The ingress: the routes of one server, each connection bridged to the replica its session
    lives on (or, for a new session, the one with the most free slots)."""

    def __init__(self, replicas: list[DeploymentHandle], spec: RaySpec) -> None:
        self.replicas = replicas
        self.spec = spec
        self.placement = Placement(len(replicas))

    def __serve_build_asgi_app__(self) -> FastAPI:
        return router_app(self)

    async def probe(self, replica: int) -> dict:
        """``SessionReplica.health`` of one replica, or ``{"replica", "status": "down", "reason"}``."""
        try:
            return await asyncio.wait_for(self.replicas[replica].health.remote(), PROBE_S)  # type: ignore[arg-type]
        except Exception as exc:  # a dead actor, one being restarted, a timeout: down, and why
            reason = f"no answer within {PROBE_S:g} s" if isinstance(exc, TimeoutError) else type(exc).__name__
            return {"replica": replica, "status": "down", "reason": reason}

    async def health(self) -> dict:
        probes = await asyncio.gather(*(self.probe(i) for i in range(len(self.replicas))))
        live = [p for p in probes if p["status"] == "ok"]
        counted = ("sessions", "connections", "max_sessions", "sessions_ended")
        status = "down" if not live else "ok" if len(live) == len(probes) else "degraded"
        return {
            "status": status,
            "model": self.spec.model,
            **{key: sum(p[key] for p in live) for key in counted},
            "replicas": [{k: v for k, v in p.items() if k not in ("url", "actor")} for p in probes],
        }

    async def models(self) -> JSONResponse:
        """The model list of the first replica up, with every live replica's plugin description and
        memory figures."""
        listed = []
        for replica, handle in enumerate(self.replicas):
            with contextlib.suppress(Exception):
                listed.append((replica, await asyncio.wait_for(handle.models.remote(), PROBE_S)))  # type: ignore[arg-type]
        if not listed:
            error = {"type": "server_error", "code": REPLICA_LOST, "message": "no replica is up"}
            return JSONResponse({"error": error}, status_code=503)
        first = listed[0][1]
        first["data"][0]["replicas"] = [
            {"replica": r, "plugin": m["data"][0]["plugin"], "memory": m["data"][0]["memory"]} for r, m in listed
        ]
        return JSONResponse(first)

    async def candidates(self, session_id: str | None) -> list[dict]:
        """The live replicas this connection may go to, best first: the one a session id names
        (whatever its free slots: the session is there), else by most free slots, then index."""
        owner = None if session_id is None else replica_of(session_id)
        if owner is not None and owner < len(self.replicas):
            probe = await self.probe(owner)
            return [probe] if probe["status"] == "ok" else []
        asked = time.monotonic()
        probes = await asyncio.gather(*(self.probe(i) for i in range(len(self.replicas))))
        return self.placement.order(probes, asked, time.monotonic())

    async def bridge(self, ws: WebSocket, duplex: bool, session_id: str | None) -> None:
        """Carries one client WebSocket to a replica's and back, frame for frame, until either
        side closes; a replica lost on the way ends the client's session (``replica_lost``)."""
        path = "/v1/duplex" if ws.url.path == "/v1/duplex" else "/v1/realtime"
        query = urlencode(ws.query_params.multi_items())
        headers = {"x-forwarded-for": ws.client.host if ws.client else "unknown"}
        if "authorization" in ws.headers:
            headers["authorization"] = ws.headers["authorization"]
        # Only a duplex connection opened with a session id creates no session (it resumes one).
        link = Link(duplex, session_id if duplex else None)
        upstream = None
        for target in await self.candidates(link.session_id):
            self.placement.forget(link)
            if link.session_id is None:
                self.placement.place(link, target["replica"])
            try:
                upstream = await websockets.connect(
                    f"{target['url']}{path}?{query}",
                    subprotocols=ws.scope.get("subprotocols") or None,
                    additional_headers=headers,
                    open_timeout=CONNECT_S,
                    max_size=None,  # the replica's own frames; the client's are limited by the replica
                    user_agent_header=None,
                )
                break
            except (OSError, InvalidHandshake, TimeoutError) as exc:
                log.warning("replica %s refused a connection: %s", target["replica"], exc)
        if upstream is None:
            self.placement.forget(link)
            await self._refuse(ws, link)
            return
        await ws.accept(subprotocol=upstream.subprotocol)
        pumps = {asyncio.create_task(self._to_client(upstream, ws, link)), asyncio.create_task(_to_replica(ws, upstream))}
        try:
            done, _ = await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            client_code = next(iter(done)).result()
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            self.placement.forget(link)
        if client_code is not None:
            await upstream.close(client_code)
            return
        received = upstream.protocol.close_rcvd
        with contextlib.suppress(Exception):  # the client may be gone too
            if received is not None:  # the replica closed the session's socket: passed on as it is
                await ws.close(received.code, received.reason)
            else:  # the replica went without a close frame: it died
                log.warning("lost the replica of session %s", link.session_id)
                await _end_lost(ws, link)

    async def _to_client(self, upstream: ClientConnection, ws: WebSocket, link: Link) -> int | None:
        """Replica frames to the client; None once the replica's socket has ended, or the close
        code to pass on if the client left first. Learns which session the connection holds."""
        try:
            async for frame in upstream:
                if isinstance(frame, str) and frame.startswith(_NAMING_EVENTS):
                    link.session_id = _named_session(frame)
                    if link.announced is None:
                        link.announced = time.monotonic()
                try:
                    await (ws.send_text(frame) if isinstance(frame, str) else ws.send_bytes(frame))
                except (WebSocketDisconnect, RuntimeError, OSError):
                    return 1000
        except ConnectionClosed:
            pass
        return None

    @staticmethod
    async def _refuse(ws: WebSocket, link: Link) -> None:
        """No replica for this connection: the session it resumes is lost with its replica, or no
        replica is up for a new one (``resource_exhausted``, 1013)."""
        await ws.accept(subprotocol="realtime" if "realtime" in ws.scope.get("subprotocols", []) else None)
        if link.session_id is not None and replica_of(link.session_id) is not None:
            await _end_lost(ws, link)
            return
        error = error_event(ProtocolError("resource_exhausted", "no replica is up"))
        error.event_id = "event_unbound000001"
        await ws.send_text(encode_event(error, duplex=link.duplex))
        await ws.close(CLOSE_TRY_AGAIN, "resource exhausted")


class Placement:
    """Where new sessions go: the live replica with the most free slots (then the lowest index).
    A probe's ``sessions`` may miss the sessions placed just before it answered, so placement
    counts them itself: each placed session until its replica announces it (``session.created``),
    and after that for any probe asked before the announcement. ``forget_after_s``: how long an
    answer may be in use after it was asked (``PROBE_S``, as a probe answers within it)."""

    def __init__(self, replicas: int, forget_after_s: float = PROBE_S) -> None:
        self.placed: dict[int, list[Link]] = {i: [] for i in range(replicas)}
        self.forget_after_s = forget_after_s

    def order(self, probes: list[dict], asked: float, now: float) -> list[dict]:
        """The live replicas among ``probes`` (asked at ``asked``), best first."""
        live = [p for p in probes if p["status"] == "ok"]
        taken = {p["replica"]: p["sessions"] + self._uncounted(p["replica"], asked, now) for p in live}
        return sorted(live, key=lambda p: (taken[p["replica"]] - p["max_sessions"], p["replica"]))

    def place(self, link: Link, replica: int) -> None:
        link.placed = replica
        self.placed[replica].append(link)

    def forget(self, link: Link) -> None:
        """The connection is over (or goes elsewhere): its session is no longer counted."""
        if link.placed is not None:
            with contextlib.suppress(ValueError):
                self.placed[link.placed].remove(link)
            link.placed = None

    def _uncounted(self, replica: int, asked: float, now: float) -> int:
        links = self.placed[replica]
        links[:] = [link for link in links if link.announced is None or link.announced > now - 2 * self.forget_after_s]
        return sum(link.announced is None or link.announced >= asked for link in links)


@dataclass(eq=False)
class Link:
    """One bridged connection: the session it holds (as the replica names it, once known); for a
    new session, the replica it was placed on and when that replica announced it."""

    duplex: bool
    session_id: str | None
    placed: int | None = None
    announced: float | None = None


async def _to_replica(ws: WebSocket, upstream: ClientConnection) -> int | None:
    """Client frames to the replica; the close code to pass on once the client has left, or None
    if the replica's socket ended first."""
    while True:
        try:
            message = await ws.receive()
        except (WebSocketDisconnect, RuntimeError):
            return 1000
        if message["type"] == "websocket.disconnect":
            code = message.get("code", 1000)
            return code if code in _SENDABLE_CLOSE or 3000 <= code < 5000 else 1000
        text = message.get("text")
        try:
            await upstream.send(text if text is not None else message.get("bytes") or b"")
        except ConnectionClosed:
            return None


async def _end_lost(ws: WebSocket, link: Link) -> None:
    """A session lost with its replica ends as a server going away ends it, with its own reason:
    ``session.closed`` (``replica_lost``; duplex connections only), then 1001 ``replica_lost``."""
    if link.duplex and link.session_id is not None:
        closed = ev.SessionClosed(session_id=link.session_id, reason=REPLICA_LOST, event_id="event_replica_lost")
        await ws.send_text(encode_event(closed, duplex=True))
    await ws.close(CLOSE_GOING_AWAY, REPLICA_LOST)


def router_app(router: SessionRouter) -> FastAPI:
    """The ingress's routes, each served by ``router``. Built here, at module level, rather than in
    the deployment class: Ray ships that class by value, and FastAPI resolves the routes'
    annotations in the globals of the function that defines them."""
    access = router.spec.access
    app = FastAPI(title="cadence-fx duplex service (Ray Serve)", **access.docs_routes())
    app.add_middleware(AccessMiddleware, access=access)

    @app.websocket("/v1/realtime")
    async def realtime(ws: WebSocket, duplex: str = "0", session_id: str | None = None) -> None:
        await router.bridge(ws, duplex.lower() in ("1", "true", "yes", "on"), session_id)

    @app.websocket("/v1/duplex")
    async def duplex_alias(ws: WebSocket, session_id: str | None = None) -> None:
        await router.bridge(ws, True, session_id)

    @app.get("/health")
    async def health() -> JSONResponse:
        report = await router.health()
        return JSONResponse(report, status_code=200 if report["status"] != "down" else 503)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return await router.models()

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


def _named_session(frame: str) -> str:
    """The session id of a ``session.created`` or ``session.resumed`` frame."""
    decoded = json.loads(frame)
    return decoded["session"]["id"] if decoded["type"] == "session.created" else decoded["session_id"]


def application(spec: RaySpec) -> serve.Application:
    """The Ray Serve application: ``spec.replicas`` deployments ``replica-<i>`` and the ingress."""
    options = {"num_cpus": spec.cpus_per_replica, "num_gpus": spec.gpus_per_replica}
    # `@serve.deployment` makes each class a Deployment, whose `.options` mypy (seeing the class) cannot see.
    replicas = [
        SessionReplica.options(name=f"replica-{i}", ray_actor_options=options).bind(i, spec)  # type: ignore[attr-defined]
        for i in range(spec.replicas)
    ]
    return SessionRouter.options(name="router").bind(replicas, spec)  # type: ignore[attr-defined]


def visible_gpus() -> int:
    """The GPUs of the Ray cluster this process is connected to, else of this machine."""
    if ray.is_initialized():
        return int(ray.cluster_resources().get("GPU", 0))
    import torch

    return torch.cuda.device_count()


def sized(spec: RaySpec, replicas: int | None) -> RaySpec:
    """``spec`` sized to the cluster: ``replicas`` replicas (None: one per GPU, or two without
    GPUs), each with one GPU where the cluster has GPUs."""
    gpus = visible_gpus()
    count = replicas if replicas is not None else gpus or 2
    if gpus and count > gpus:
        raise ValueError(f"replicas={count}: the Ray cluster has {gpus} GPUs, and each replica takes one")
    return replace(spec, replicas=count, gpus_per_replica=1.0 if gpus else 0.0)


def app(args: dict[str, str]) -> serve.Application:
    """The application builder of ``serve run cadence_fx.serve.ray:app [model=M] [replicas=N]
    [max_sessions=S]``: one replica per GPU, or two CPU replicas on a machine without one."""
    known = {"model", "replicas", "max_sessions"}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"unknown argument(s) {', '.join(unknown)}; expected some of {', '.join(sorted(known))}")
    replicas = int(args["replicas"]) if "replicas" in args else None
    limits = Limits(max_sessions=int(args.get("max_sessions", Limits().max_sessions)))
    return application(sized(RaySpec(model=args.get("model", DEFAULT_PLUGIN), limits=limits), replicas))


def run_ray(
    host: str,
    port: int,
    spec: RaySpec,
    replicas: int | None = None,
    tls: Tls | None = None,
    on_ready: Callable[[str, dict], None] | None = None,
) -> None:
    """Serve on Ray Serve until interrupted (``cadence-fx serve --ray``): joins the Ray cluster
    ``RAY_ADDRESS`` names, else starts a local one; Ray's HTTP proxy listens on ``host:port``.
    ``replicas``: as in ``sized``.
    On SIGINT or SIGTERM the application is shut down: each replica drains its sessions as a
    server does (``session.closed``, ``server_shutdown``)."""
    notice = spec.access.open_notice(host, port)
    if notice is not None:
        print(f"cadence-fx serve: {notice}", file=sys.stderr, flush=True)
    spec = replace(spec, access=spec.access.serving(host))  # the ingress answers to the name it was started on
    ray.init(include_dashboard=False)  # on this thread: Ray's local processes die with the thread that started them
    try:
        spec = sized(spec, replicas)
        http: dict[str, object] = {"host": host, "port": port}
        if tls is not None:
            http |= {"ssl_keyfile": tls.keyfile, "ssl_certfile": tls.certfile}
        serve.start(http_options=http)
        serve.run(application(spec), name=APP_NAME, route_prefix="/")
        base = f"{'https' if tls else 'http'}://{f'[{host}]' if ':' in host else host}:{port}"
        if on_ready is not None:
            on_ready(base, _ready_health(base))
        signal.signal(signal.SIGTERM, _interrupt)
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()
    finally:
        serve.shutdown()
        ray.shutdown()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _ready_health(base: str, timeout_s: float = 120.0) -> dict:
    """The ingress's ``/health`` once every replica answers it (their first calls are slow)."""
    probe = base.replace("://0.0.0.0:", "://127.0.0.1:").replace("://[::]:", "://[::1]:") + "/health"
    context = ssl._create_unverified_context() if probe.startswith("https") else None  # this very process
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError, ValueError):
            with urllib.request.urlopen(probe, timeout=10, context=context) as answer:
                health = json.load(answer)
                if health["status"] == "ok":
                    return health
        if time.monotonic() > deadline:
            raise RuntimeError(f"the replicas did not all answer {probe} within {timeout_s:g} s")
        time.sleep(0.5)
