"""Close codes and the typed error event: what a session, a connection and the Ray front door
(``serve/ray.py``) send when they refuse or end something."""

from __future__ import annotations

from ..protocol import ProtocolError
from ..protocol import events as ev

CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001  # server shutdown
CLOSE_POLICY = 1008  # too many failed resumes
CLOSE_TRY_AGAIN = 1013
CLOSE_EXPIRED = 4001
CLOSE_REPLACED = 4002


def error_event(err: ProtocolError) -> ev.Error:
    return ev.Error(
        error={"type": err.type, "code": err.code, "message": err.message, "param": err.param, "event_id": err.event_id}
    )
