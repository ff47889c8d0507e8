"""The lifetime piece of a ``Session``: its lease across connections (detach, resume with the
journal's replay, expiry, heartbeats) and its end (shutdown, server stop)."""

from __future__ import annotations

import logging
import time

from ..protocol import ProtocolError, client_commands
from ..protocol import events as ev
from .codes import CLOSE_EXPIRED, CLOSE_GOING_AWAY, CLOSE_NORMAL, CLOSE_REPLACED
from .messages import Resume
from .transport import Transport
from .turns import InputTurns

log = logging.getLogger("cadence_fx.serve")


class Lifetime(InputTurns):
    def _on_resume(self, msg: Resume) -> None:
        cmd, transport = msg.command, msg.transport
        assert self.journal is not None
        if not self.lease.token_matches(cmd.resume_token):
            msg.future.set_exception(ProtocolError("invalid_resume_token", "resume token does not match", "resume_token"))
            return
        if cmd.generation is not None and cmd.generation != self.lease.generation:
            msg.future.set_exception(
                ProtocolError(
                    "generation_mismatch",
                    f"session is at generation {self.lease.generation}, not {cmd.generation}",
                    "generation",
                )
            )
            return
        old = self.transport
        if old is not None and old is not transport:
            self._deliver_direct(ev.SessionReplaced(session_id=self.id))
            old.close(CLOSE_REPLACED, "session replaced")
        self.transport = transport
        self.lease.attach(time.monotonic())
        token = self.lease.issue_token()
        replay = self.journal.since(cmd.seen)
        self._deliver_direct(
            ev.SessionResumed(
                session_id=self.id,
                resume_token=token,
                generation=self.lease.generation,
                last_server_event_seq=self.journal.last_seq,
                replayed=0 if replay is None else len(replay),
                session=self._session_wire(),
            )
        )
        if replay is None:
            self._deliver_direct(
                ev.SessionResyncRequired(
                    session_id=self.id,
                    requested_seq=cmd.seen,
                    oldest_available_seq=self.journal.oldest_seq,
                    last_server_event_seq=self.journal.last_seq,
                    session=self._session_wire(),
                    item_ids=[item["id"] for item in self.history],
                    active_response_id=None if self.active is None else self.active.id,
                )
            )
        else:
            transport.replay(replay)
        msg.future.set_result(None)

    async def _on_detach(self, transport: Transport) -> None:
        if transport is not self.transport:
            return
        self.transport = None
        if self.duplex:
            self.lease.detach(time.monotonic())
        else:
            await self._shutdown(None, "disconnected", CLOSE_NORMAL)

    async def _on_tick(self) -> None:
        now = time.monotonic()
        reason = self.lease.expiry(now, busy=self.active is not None)
        if reason is not None:
            await self._shutdown(ev.SessionExpired(session_id=self.id, reason=reason), f"expired: {reason}", CLOSE_EXPIRED)
            return
        beat = self.limits.heartbeat_s
        if beat and self.duplex and self.transport is not None and now - self._last_heartbeat >= beat:
            self._last_heartbeat = now
            assert self.journal is not None
            self._deliver_direct(
                ev.SessionHeartbeatEvent(last_server_event_seq=self.journal.last_seq, server_time_ms=int(time.time() * 1000))
            )

    async def _event_ack(self, cmd: client_commands.SessionEventAck) -> None:
        assert self.journal is not None
        self.journal.ack(cmd.server_event_seq)

    async def _heartbeat(self, cmd: client_commands.SessionHeartbeat) -> None:
        """A client heartbeat renews the lease (``submit`` already touched it), and is answered
        with ``session.heartbeat_ack`` (not journaled: it says the connection is alive now)."""
        self._deliver_direct(ev.SessionHeartbeatAck(session_id=self.id))

    async def _stop(self, reason: str) -> None:
        """Server shutdown: a response still running fails (``server_shutdown``), then the client is
        told (``session.closed`` on duplex connections) and its socket closed with 1001."""
        if self.active is not None:
            resp, self.active = self.active, None
            self.epoch += 1
            message = "the server shut down before the response ended"
            error = {"type": "server_error", "code": reason, "message": message}
            self._finish(resp, "failed", {"type": "failed", "error": error})
        await self._shutdown(ev.SessionClosed(session_id=self.id, reason=reason), reason, CLOSE_GOING_AWAY)

    async def _shutdown(self, event: ev.ServerEvent | None, reason: str, code: int) -> None:
        self.closed = True
        if self.transport is not None:
            if event is not None and self.duplex:
                self._deliver_direct(event)
            if self.transport is not None:  # still there, unless the client was too slow for that event
                self.transport.close(code, reason)
            self.transport = None
        self.epoch += 1
        self.active = None
        if self._runner is not None:
            # Not cancelled: that would free the port while its worker thread still steps. The
            # runner's guard sees ``closed`` and ends at the next chunk boundary.
            await self._runner
        try:
            await self.port.call(self.stream.close)
        finally:
            self.manager.forget(self)
            log.info("session %s ended: %s", self.id, reason)
