"""Faults: disconnect and resume, journal overflow, takeover, and lease expiry."""

from __future__ import annotations

import asyncio
import json

import httpx
import websockets
from servekit import COMMIT, RESPONSE_HEAD, RESPONSE_TAIL, deltas_of, run, running, tone_reply_pcm, types_of

from cadence_fx.serve.protocol import PCM24K, PCMU, StreamResampler
from cadence_fx.serve.protocol import audio as wire_audio
from cadence_fx.serve.session import Limits

QUICK = dict(idle_ttl_s=30, grace_s=30, reap_interval_s=0.05, max_sessions=64, max_sessions_per_client=64)


def _resume(sock, last_seq: int, token: str | None = None, **extra) -> dict:
    return {
        "type": "session.resume",
        "session_id": sock.session_id,
        "resume_token": token or sock.resume_token,
        "last_server_event_seq": last_seq,
        **extra,
    }


async def _start_reply(server, question_pcm, deltas_before: int = 5, input_format: dict | None = None):
    """A duplex session streaming its first reply; returns the socket and what it has seen."""
    sock = await server.connect("/v1/duplex")
    if input_format is None:
        await sock.no_vad()
        await sock.append(question_pcm)
    else:
        await sock.update({"audio": {"input": {"format": input_format, "turn_detection": None}}})
        # One append at a time: only the audio, never a queue of frames, takes the input budget.
        session = server.session(sock.session_id)
        for i in range(0, len(question_pcm), 1600):
            await sock.append(question_pcm[i : i + 1600])
            assert server.eventually(lambda: session.pending_input_bytes == 0)
    await sock.send({"type": "input_audio_buffer.commit"})
    await sock.send({"type": "response.create"})
    seen = []
    while sum(e["type"] == "response.output_audio.delta" for e in seen) < deltas_before:
        seen.append(await sock.recv())
    # sock.received: session.created, rate_limits.updated, session.updated, then the turn.
    return sock, [sock.received[2], *seen]


def test_disconnect_mid_response_then_resume_delivers_every_event_exactly_once(question_pcm):
    async def scenario(server):
        sock, before = await _start_reply(server, question_pcm)
        await sock.close()  # no session.close: a disconnect
        await asyncio.sleep(0.3)  # the reply goes on into the journal meanwhile
        back = await server.connect(f"/v1/duplex?session_id={sock.session_id}", created=False)
        back.session_id = sock.session_id
        await back.send(_resume(sock, before[-1]["server_event_seq"]))
        resumed = await back.recv()
        after = await back.recv_until("response.done")
        stale = await server.connect("/v1/duplex")
        await stale.send(_resume(sock, 0))
        refused = await stale.recv()
        await back.close()
        await stale.close()
        return before, resumed, after, refused

    with running(Limits(**QUICK), step_delay_s=0.02) as server:
        before, resumed, after, refused = run(scenario(server))
    events = before + after
    assert [e["server_event_seq"] for e in events] == list(range(1, len(events) + 1))
    assert (
        types_of(events[1:], skip_deltas=False)
        == COMMIT + RESPONSE_HEAD + ["response.speak"] + ["response.output_audio.delta"] * 56 + RESPONSE_TAIL
    )
    assert deltas_of(events) == tone_reply_pcm(56)
    assert resumed["type"] == "session.resumed" and resumed["generation"] == 2
    assert resumed["replayed"] > 0 and resumed["last_server_event_seq"] >= before[-1]["server_event_seq"] + resumed["replayed"]
    assert refused["error"]["code"] == "invalid_resume_token"  # the old token was rotated away


def test_journal_overflow_yields_resync_required(question_pcm):
    # The question as 8 kHz mu-law (35,443 bytes) fits a 38,000-byte input budget, appended a
    # frame at a time; its 56-chunk reply (24 kHz PCM, about 157 KB of events) outgrows a journal
    # of 144,000 bytes, about the least these budgets allow (72,000 outbound plus the largest
    # event, 71,148).
    pcmu = wire_audio.encode_samples(
        StreamResampler(24_000, 8_000).process(wire_audio.decode_samples(question_pcm, PCM24K)), PCMU
    )
    limits = Limits(**QUICK, input_bytes=38_000, max_frame_bytes=4096, outbound_bytes=72_000, journal_bytes=144_000)

    async def scenario(server):
        sock, before = await _start_reply(server, pcmu, deltas_before=1, input_format={"type": "audio/pcmu"})
        await sock.close()
        await asyncio.sleep(0.3)  # the reply goes on into the journal meanwhile, and outgrows it
        back = await server.connect(f"/v1/duplex?session_id={sock.session_id}", created=False)
        back.session_id = sock.session_id
        await back.send(_resume(sock, before[-1]["server_event_seq"]))
        resumed, resync = await back.recv(), await back.recv()
        journal = server.on_loop(lambda: server.session(sock.session_id).journal)
        kept = (journal.bytes, journal.evicted, journal.oldest_seq)
        alive = await back.update({"instructions": "after resync"})
        await back.close()
        return before, resumed, resync, kept, alive

    with running(limits) as server:
        before, resumed, resync, (kept_bytes, evicted, oldest), alive = run(scenario(server))
    last = resync["last_server_event_seq"]
    assert (resumed["type"], resumed["replayed"], resync["type"]) == ("session.resumed", 0, "session.resync_required")
    assert (resync["requested_seq"], resync["oldest_available_seq"]) == (before[-1]["server_event_seq"], oldest)
    # Nothing was acknowledged: every event before the oldest kept was dropped for room, and the
    # newest ones kept fill the journal's bytes.
    assert evicted == oldest - 1 > before[-1]["server_event_seq"] and 144_000 - 3_000 < kept_bytes <= 144_000
    assert resync["active_response_id"] is None and len(resync["item_ids"]) == 2
    assert last == 1 + 3 + 4 + 1 + 56 + 5  # session.updated, the commit, the reply (its speak, its audio)
    assert alive["server_event_seq"] == last + 1


def test_acknowledged_events_cannot_be_replayed(server):
    async def scenario():
        sock = await server.connect("/v1/duplex")
        await sock.no_vad()
        await sock.update({"instructions": "two"})
        await sock.send({"type": "session.event_ack", "server_event_seq": 2})
        await sock.close()
        back = await server.connect(f"/v1/duplex?session_id={sock.session_id}", created=False)
        back.session_id = sock.session_id
        await back.send(_resume(sock, 1))
        resumed, resync = await back.recv(), await back.recv()
        await back.close()
        return resumed, resync

    resumed, resync = run(scenario())
    assert (resync["type"], resync["requested_seq"], resync["oldest_available_seq"]) == (
        "session.resync_required",
        1,
        3,
    )


def test_takeover_tells_the_old_connection_and_closes_it(server):
    async def scenario():
        first = await server.connect("/v1/duplex")
        await first.no_vad()
        second = await server.connect(f"/v1/duplex?session_id={first.session_id}", created=False)
        second.session_id = first.session_id
        await second.send(_resume(first, 1, generation=1))
        resumed = await second.recv()
        replaced = await first.recv()
        await first.ws.wait_closed()
        alive = await second.update({"instructions": "taken over"})
        await second.close()
        return resumed, replaced, first.ws.close_code, alive

    resumed, replaced, code, alive = run(scenario())
    assert (resumed["type"], resumed["replayed"], resumed["generation"]) == ("session.resumed", 0, 2)
    assert (replaced["type"], replaced["session_id"], code) == ("session.replaced", resumed["session_id"], 4002)
    assert alive["server_event_seq"] == 2


def test_resume_checks_the_expected_generation(server):
    async def scenario():
        sock = await server.connect("/v1/duplex")
        await sock.send(_resume(sock, 0, generation=5))
        wrong = await sock.recv()
        await sock.send(_resume(sock, 1, generation=1))
        right = await sock.recv()
        await sock.close()
        return wrong, right

    wrong, right = run(scenario())
    assert (wrong["error"]["code"], wrong["error"]["param"]) == ("generation_mismatch", "generation")
    assert (right["type"], right["generation"]) == ("session.resumed", 2)


def test_resuming_from_a_connection_with_its_own_session_releases_that_session(server):
    async def scenario():
        owner = await server.connect("/v1/duplex")
        other = await server.connect("/v1/duplex")
        await owner.close()
        await other.send(_resume(owner, 0))
        resumed = await other.recv()
        released = server.eventually(lambda: server.session(other.session_id) is None)
        await other.close()
        return resumed, released

    resumed, released = run(scenario())
    assert resumed["type"] == "session.resumed" and released


def test_unbound_connection_refuses_commands_until_resumed(server):
    async def scenario():
        sock = await server.connect("/v1/duplex?session_id=sess_whatever", created=False)
        await sock.send({"type": "input_audio_buffer.commit"})
        unbound = await sock.recv()
        await sock.close()
        return unbound

    assert run(scenario())["error"]["code"] == "session_not_bound"


def test_idle_session_expires():
    async def scenario(server):
        sock = await server.connect("/v1/duplex")
        expired = await sock.recv(timeout=5)
        await sock.ws.wait_closed()
        return sock, expired

    with running(Limits(**{**QUICK, "idle_ttl_s": 0.3})) as server:
        sock, expired = run(scenario(server))
        gone = server.on_loop(lambda: server.session(sock.session_id) is None)
    assert (expired["type"], expired["reason"], sock.ws.close_code, gone) == ("session.expired", "idle", 4001, True)


def test_disconnected_session_expires_after_the_grace_period():
    async def scenario(server):
        sock = await server.connect("/v1/duplex")
        await sock.close()
        await asyncio.sleep(0.1)
        during = server.on_loop(lambda: server.session(sock.session_id) is not None)
        await asyncio.sleep(0.5)
        back = await server.connect(f"/v1/duplex?session_id={sock.session_id}", created=False)
        back.session_id = sock.session_id
        await back.send(_resume(sock, 0))
        late = await back.recv()
        await back.close()
        return during, late

    with running(Limits(**{**QUICK, "grace_s": 0.3})) as server:
        during, late = run(scenario(server))
    assert during and late["error"]["code"] == "session_not_found"


def test_realtime_session_ends_when_its_socket_closes(server):
    async def scenario():
        sock = await server.connect("/v1/realtime")
        await sock.close()
        return server.eventually(lambda: server.session(sock.session_id) is None)

    assert run(scenario())


def test_session_close_ends_the_session_at_once(server):
    async def scenario():
        sock = await server.connect("/v1/duplex")
        await sock.send({"type": "session.close"})
        closed = await sock.recv()
        await sock.ws.wait_closed()
        return closed, sock.ws.close_code

    closed, code = run(scenario())
    assert (closed["type"], closed["reason"], code) == ("session.closed", "client_closed", 1000)


def test_heartbeat_reports_the_last_seq():
    async def scenario(server):
        sock = await server.connect("/v1/duplex")
        await sock.no_vad()
        beat = await sock.recv(timeout=2)
        await sock.close()
        return beat

    with running(Limits(**QUICK, heartbeat_s=0.1)) as server:
        beat = run(scenario(server))
    assert (beat["type"], beat["last_server_event_seq"]) == ("session.heartbeat", 1)


def test_a_socket_opened_to_resume_that_never_binds_is_closed():
    async def scenario(server):
        sock = await server.connect("/v1/duplex?session_id=sess_whatever", created=False)
        health = httpx.get(server.handle.http_url + "/health").json()
        await sock.ws.wait_closed()
        assert server.eventually(lambda: not server.handle.manager.connections)
        after = httpx.get(server.handle.http_url + "/health").json()
        return sock.ws.close_code, sock.ws.close_reason, health, after

    with running(Limits(**QUICK, bind_timeout_s=0.5)) as server:
        code, reason, health, after = run(scenario(server))
    assert (code, reason) == (4001, "no session.resume within 0.5 s")
    assert [(h["sessions"], h["connections"]) for h in (health, after)] == [(0, 1), (0, 0)]


def test_a_socket_that_fails_to_resume_three_times_is_closed_and_the_owner_still_resumes(server):
    async def scenario():
        owner = await server.connect("/v1/duplex")
        await owner.close()
        guesser = await server.connect("/v1/duplex?session_id=" + owner.session_id, created=False)
        answers = []
        for token in ("guess-1", "guess-2", "guess-3"):
            await guesser.send(_resume(owner, 0, token=token))
            answers.append((await guesser.recv())["error"]["code"])
        await guesser.ws.wait_closed()
        back = await server.connect("/v1/duplex?session_id=" + owner.session_id, created=False)
        await back.send(_resume(owner, 0))
        resumed = await back.recv()
        await back.close()
        return answers, (guesser.ws.close_code, guesser.ws.close_reason), resumed

    answers, closed, resumed = run(scenario())
    assert answers == ["invalid_resume_token"] * 3
    assert closed == (1008, "too many failed resumes")
    assert resumed["type"] == "session.resumed"


def test_the_per_client_session_limit_refuses_one_address_and_not_another():
    async def scenario(server):
        held = [await server.connect("/v1/duplex") for _ in range(2)]
        refused = await server.connect("/v1/duplex", created=False)
        error = await refused.recv()
        await refused.ws.wait_closed()
        other = await websockets.connect(server.handle.ws_url + "/v1/duplex", local_addr=("127.0.0.2", 0))
        created = json.loads(await other.recv())
        await other.close()
        for sock in held:
            await sock.close()
        return error, refused.ws.close_code, created

    limits = Limits(**{**QUICK, "max_sessions_per_client": 2})
    with running(limits) as server:
        error, code, created = run(scenario(server))
    assert (error["error"]["code"], code) == ("resource_exhausted", 1013)
    assert error["error"]["message"] == "this client ('127.0.0.1') holds 2 sessions, max_sessions_per_client=2"
    assert created["type"] == "session.created"
