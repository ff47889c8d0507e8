"""Lease: who may hold a session and until when.

The resume token is a bearer secret: only its SHA-256 is kept, it is compared in constant time,
and every successful resume rotates it and advances the generation, so a stale token or a client
racing on an old generation loses (compare-and-set).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets


class Lease:
    def __init__(self, now: float, idle_ttl_s: float, grace_s: float, max_session_s: float) -> None:
        self.idle_ttl_s = idle_ttl_s
        self.grace_s = grace_s
        self.created_at = now
        self.max_until = now + max_session_s
        self.last_activity = now
        self.detached_at: float | None = None
        self.generation = 0
        self._token_hash = b""

    def issue_token(self) -> str:
        token = secrets.token_urlsafe(32)
        self._token_hash = hashlib.sha256(token.encode()).digest()
        return token

    def token_matches(self, token: str) -> bool:
        given = hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()
        return bool(self._token_hash) and hmac.compare_digest(given, self._token_hash)

    def attach(self, now: float) -> None:
        self.generation += 1
        self.detached_at = None
        self.last_activity = now

    def detach(self, now: float) -> None:
        self.detached_at = now

    def touch(self, now: float) -> None:
        self.last_activity = now

    def expiry(self, now: float, busy: bool) -> str | None:
        """Why the session is over at ``now`` (``grace``, ``idle``, ``max_duration``), else None."""
        if now >= self.max_until:
            return "max_duration"
        if self.detached_at is not None:
            return "grace" if now >= self.detached_at + self.grace_s else None
        if not busy and now >= self.last_activity + self.idle_ttl_s:
            return "idle"
        return None
