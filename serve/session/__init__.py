"""Sessions: one owner task per session, its lease, journal, ledgers and VAD."""

from .connection import Connection
from .ledger import Ledgers
from .limits import Limits
from .manager import SessionManager
from .session import Session
from .transport import Transport

__all__ = ["Connection", "Ledgers", "Limits", "Session", "SessionManager", "Transport"]
