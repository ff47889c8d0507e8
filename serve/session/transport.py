"""The session layer's view of a client connection; the app supplies a WebSocket one."""

from __future__ import annotations

from abc import ABC, abstractmethod


class Transport(ABC):
    @abstractmethod
    def deliver(self, text: str) -> None:
        """Queue one encoded event; never blocks; order is kept."""

    @abstractmethod
    def close(self, code: int, reason: str) -> None:
        """Close after everything queued so far has been sent."""
