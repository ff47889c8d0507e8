"""Who may use the service: an API key, checked on every route but ``/health``, and the browser
origins allowed to open sockets.

A client presents the key as ``Authorization: Bearer KEY`` or, from a browser (which cannot set
headers on a WebSocket), as the subprotocol ``openai-insecure-api-key.KEY`` among those it
offers, as OpenAI's browser clients do. A request that carries an ``Origin`` (browsers always do on
a WebSocket) is refused unless that origin is the server's own or one allowed; a request without
one comes from no browser page and needs only the key. Refusals are plain HTTP answers (a
WebSocket is refused before it opens): 401 for a missing or wrong key, 403 for an origin.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from .protocol.errors import quoted

KEY_SUBPROTOCOL = "openai-insecure-api-key."
# The browser page holds no secret and must load before its user can type the key; the routes it
# then calls ask for the key like any other.
OPEN_ROUTES = frozenset({"/health", "/"})
OPEN_PREFIXES = ("/static/",)


@dataclass(frozen=True)
class Access:
    api_key: str | None = None  # None: the service is open (and says so at start-up)
    allowed_origins: tuple[str, ...] = ()  # browser origins besides the server's own; "*" allows any
    docs: bool = False  # serve /docs and /openapi.json

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key must not be empty (leave it unset for an open service)")

    def open_notice(self, host: str, port: int) -> str | None:
        """What the server says at start-up when it has no key, else None."""
        if self.api_key is not None:
            return None
        return (
            f"no API key (--api-key or CADENCE_FX_API_KEY): the service on {host}:{port} is open to anyone "
            "who can reach that address"
        )

    def refusal(self, scope: Scope) -> tuple[int, str, str] | None:
        """(HTTP status, error code, message) refusing this request, or None to let it through."""
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        if self.api_key is not None and not self._key_matches(_presented_keys(headers, scope["type"])):
            return 401, "invalid_api_key", "a valid API key is required (Authorization: Bearer KEY)"
        origin = headers.get("origin")
        if origin is not None and not self._origin_allowed(origin, headers.get("host", "")):
            return 403, "origin_not_allowed", f"origin {quoted(origin)} is not allowed"
        return None

    def _key_matches(self, presented: list[str]) -> bool:
        expected = self.api_key.encode()  # type: ignore[union-attr]
        # Every presented key is compared, in constant time each, so timing tells nothing.
        return any([hmac.compare_digest(key.encode("utf-8", "surrogatepass"), expected) for key in presented])

    def _origin_allowed(self, origin: str, host: str) -> bool:
        if "*" in self.allowed_origins or origin in self.allowed_origins:
            return True
        return urlsplit(origin).netloc.lower() == host.lower() != ""  # the server's own pages


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
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_ROUTES or scope["path"].startswith(OPEN_PREFIXES):
            await self.app(scope, receive, send)
            return
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
