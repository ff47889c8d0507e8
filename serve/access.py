"""Who may use the service: the host names it answers to, an API key, checked on every route but
``/health`` and the browser page, the browser origins allowed to open sockets, and the proxies
whose ``X-Forwarded-For`` names the client.

Every request's ``Host`` must name the server: its own address (the one the connection came in
on, or the name it was started on), a loopback name (``localhost``, ``127.0.0.1``, ``::1``), or one
of ``allowed_hosts``. Otherwise a page of another site whose DNS name was rebound to the server's
address could talk to it as its own origin (DNS rebinding: its ``Origin`` matches its ``Host``).
A client presents the key as ``Authorization: Bearer KEY`` or, from a browser (which cannot set
headers on a WebSocket), as the subprotocol ``openai-insecure-api-key.KEY`` among those it
offers, as OpenAI's browser clients do. A request that carries an ``Origin`` (browsers always do on
a WebSocket) is refused unless that origin is the server's own (its ``Host``, checked first) or
one allowed; a request without one comes from no browser page and needs only the key. Refusals are
plain HTTP answers (a WebSocket is refused before it opens): 421 (Misdirected Request) for a host,
401 for a missing or wrong key, 403 for an origin.

``X-Forwarded-For`` is read only from ``trusted_proxies`` (none by default): from anyone else it
would let one client name a new address on each connection, past the per-client session limit.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from dataclasses import dataclass, replace
from typing import TypedDict
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from .protocol.errors import quoted

KEY_SUBPROTOCOL = "openai-insecure-api-key."
# The browser page holds no secret and must load before its user can type the key; the routes it
# then calls ask for the key like any other.
OPEN_ROUTES = frozenset({"/health", "/"})
OPEN_PREFIXES = ("/static/",)
# The names of this machine's loopback, which no other site's page can be served from: a DNS name
# rebound to 127.0.0.1 still arrives with that name as its Host.
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
# A server bound to every interface has no one address of its own: its Host is checked against the
# address each connection came in on.
_ANY_ADDRESS = frozenset({"", "0.0.0.0", "::"})


class DocsRoutes(TypedDict, total=False):
    """FastAPI's keyword arguments for its documentation routes: none (its own) or all three off."""

    docs_url: None
    redoc_url: None
    openapi_url: None


@dataclass(frozen=True)
class Access:
    api_key: str | None = None  # None: the service is open (and says so at start-up)
    allowed_origins: tuple[str, ...] = ()  # browser origins besides the server's own; "*" allows any
    docs: bool = False  # serve /docs and /openapi.json
    # Host names served besides the server's own address and loopback; "*" allows any (and with it
    # any DNS name rebound to the server's address).
    allowed_hosts: tuple[str, ...] = ()
    # Peers (IP addresses, networks) whose X-Forwarded-For names the client; "*" trusts any peer.
    trusted_proxies: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key must not be empty (leave it unset for an open service)")
        names = []
        for name in self.allowed_hosts:
            # Kept as a Host header's name is compared: lower case, no brackets, no final dot.
            bare = name.strip().lower()
            bare = (bare[1:-1] if bare.startswith("[") and bare.endswith("]") else bare).rstrip(".")
            if name != "*" and not _is_host(bare):
                raise ValueError(
                    f"allowed host {quoted(name)} must be a host name or address, without a scheme, port or "
                    "path (voice.example, 10.0.0.5, ::1), or '*'"
                )
            names.append(name if name == "*" else bare)
        object.__setattr__(self, "allowed_hosts", tuple(names))
        for proxy in self.trusted_proxies:
            try:
                if proxy != "*":  # uvicorn's own reading: a network has a slash; a host bit set is an error
                    ipaddress.ip_network(proxy) if "/" in proxy else ipaddress.ip_address(proxy)
            except ValueError:
                raise ValueError(
                    f"trusted proxy {quoted(proxy)} must be an IP address (10.0.0.5), a network (10.0.0.0/8) or '*'"
                ) from None

    def serving(self, host: str) -> Access:
        """This access for a server started on ``host``: a name (not an address of every
        interface) is one more host it answers to."""
        name = _host_name(host)
        if name in _ANY_ADDRESS or name in LOOPBACK_HOSTS or name in self.allowed_hosts:
            return self
        return replace(self, allowed_hosts=(*self.allowed_hosts, name))

    @property
    def forwarded_allow_ips(self) -> str | None:
        """uvicorn's ``forwarded_allow_ips`` for ``trusted_proxies`` (None: none, read no header)."""
        if not self.trusted_proxies:
            return None
        return "*" if "*" in self.trusted_proxies else ",".join(self.trusted_proxies)

    def docs_routes(self) -> DocsRoutes:
        """FastAPI's keyword arguments for /docs, /redoc and /openapi.json: its own with ``docs``, else all off."""
        if self.docs:
            return {}
        return {"docs_url": None, "redoc_url": None, "openapi_url": None}

    def open_notice(self, host: str, port: int) -> str | None:
        """What the server says at start-up when it has no key, else None."""
        if self.api_key is not None:
            return None
        return (
            f"no API key (--api-key or CADENCE_FX_API_KEY): the service on {host}:{port} is open to anyone "
            "who can reach that address"
        )

    def host_refusal(self, scope: Scope) -> tuple[int, str, str] | None:
        """(HTTP status, error code, message) refusing a request whose Host is not one this server
        answers to, or None. A request without a Host (HTTP/1.0) comes from no browser."""
        host = next((value.decode("latin-1") for name, value in scope["headers"] if name == b"host"), None)
        if host is None or "*" in self.allowed_hosts:
            return None
        name = _host_name(host)
        own = scope.get("server")  # the address the connection came in on
        if name in LOOPBACK_HOSTS or name in self.allowed_hosts or (own is not None and name == _host_name(own[0])):
            return None
        return (
            421,
            "host_not_allowed",
            f"host {quoted(name)} is not allowed: this server answers only to its own address, localhost, "
            f"127.0.0.1, ::1 and the names given with --allowed-host; to allow this one, start it with "
            f"--allowed-host {quoted(name)}",
        )

    def refusal(self, scope: Scope) -> tuple[int, str, str] | None:
        """(HTTP status, error code, message) refusing this request for its key or origin, or None
        to let it through (its Host was checked first, ``host_refusal``)."""
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        if self.api_key is not None and not self._key_matches(_presented_keys(headers, scope["type"])):
            return 401, "invalid_api_key", "a valid API key is required (Authorization: Bearer KEY)"
        origin = headers.get("origin")
        if origin is not None and not self._origin_allowed(origin, headers.get("host", "")):
            return 403, "origin_not_allowed", f"origin {quoted(origin)} is not allowed"
        return None

    def _key_matches(self, presented: list[str]) -> bool:
        assert self.api_key is not None, "asked only of an access with a key"
        expected = self.api_key.encode()
        # Every presented key is compared, in constant time each, so timing tells nothing.
        return any([hmac.compare_digest(key.encode("utf-8", "surrogatepass"), expected) for key in presented])

    def _origin_allowed(self, origin: str, host: str) -> bool:
        if "*" in self.allowed_origins or origin in self.allowed_origins:
            return True
        return urlsplit(origin).netloc.lower() == host.lower() != ""  # the server's own pages


def _host_name(host: str) -> str:
    """The name of a Host header (or of an address): lower case, without its port, brackets or a
    final dot. What is not a well-formed host keeps its odd form, which no allowed name matches."""
    host = host.strip().lower()
    if host.startswith("["):  # an IPv6 literal, maybe with a port
        end = host.find("]")
        rest = host[end + 1 :]
        if end > 0 and (not rest or (rest.startswith(":") and rest[1:].isdigit())):
            return host[1:end]
        return host
    name, sep, port = host.partition(":")
    if sep and ":" not in port:  # name:port (an address of IPv6 without brackets has more colons)
        return name.rstrip(".") if port.isdigit() else host
    return host.rstrip(".")


def _is_host(name: str) -> bool:
    """A host name (letters, digits, dots, hyphens) or an IP address, as ``_host_name`` gives it."""
    if ":" in name:  # only an IPv6 address has a colon left
        try:
            return isinstance(ipaddress.ip_address(name), ipaddress.IPv6Address)
        except ValueError:
            return False
    return bool(name) and all(c.isascii() and (c.isalnum() or c in "-._") for c in name)


def _presented_keys(headers: dict[str, str], kind: str) -> list[str]:
    keys = []
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        keys.append(token.strip())
    if kind == "websocket":
        offered = [p.strip() for p in headers.get("sec-websocket-protocol", "").split(",")]
        keys += [p[len(KEY_SUBPROTOCOL) :] for p in offered if p.startswith(KEY_SUBPROTOCOL)]
    return keys


class AccessMiddleware:
    """Applies an ``Access`` to every HTTP request and WebSocket handshake but the open routes."""

    def __init__(self, app: ASGIApp, access: Access) -> None:
        self.app = app
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        # The host on every route: the open ones too, so no other site's page can read them.
        refusal = self.access.host_refusal(scope)
        if refusal is None and not (scope["path"] in OPEN_ROUTES or scope["path"].startswith(OPEN_PREFIXES)):
            refusal = self.access.refusal(scope)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        status, code, message = refusal
        body = json.dumps({"error": {"type": "invalid_request_error", "code": code, "message": message}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
        elif "websocket.http.response" in scope.get("extensions", {}):
            await receive()  # the handshake's websocket.connect comes first
            await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
            await send({"type": "websocket.http.response.body", "body": body})
        else:  # a server without the extension answers a refused handshake with a bare 403
            await receive()
            await send({"type": "websocket.close", "code": 1008})
