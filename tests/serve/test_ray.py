"""The service on Ray Serve (serve/ray.py): a local Ray cluster, two replicas of the tone model,
every client talking to the ingress only. The replica-killing test runs last: Ray Serve restarts
the replica it kills, a fresh one without its sessions."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass

import httpx
import pytest
import ray
import websockets
from ray import serve
from servekit import COMMIT, RESPONSE_HEAD, RESPONSE_TAIL, Server, deltas_of, run, tone_reply_pcm, types_of

from cadence_fx.serve.app import free_port
from cadence_fx.serve.ray import (
    PROBE_S,
    REPLICA_LOST,
    Link,
    Placement,
    RaySpec,
    application,
    replica_of,
    session_prefix,
    sized,
)
from cadence_fx.serve.ray import app as builder
from cadence_fx.serve.session import Limits

APP = "cadence-fx-test"
LIMITS = Limits(max_sessions=8, max_sessions_per_client=8, idle_ttl_s=60, grace_s=60, reap_interval_s=0.05)
START_S = 240.0  # two CPU cores shared with other work: a Ray cluster takes a while to start


@dataclass(frozen=True)
class Ingress:
    """Where the tests' clients connect (servekit.Server's handle)."""

    port: int

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"


def _start(port: int) -> None:
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    spec = RaySpec(model="tone", replicas=2, limits=LIMITS, plugin_options={"step_delay_s": 0.02})
    serve.run(application(spec), name=APP, route_prefix="/")


@pytest.fixture(scope="module")
def ingress():
    port = free_port()
    failed: list[BaseException] = []
    # On this thread: Ray's local processes die with the thread that started them.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

    def start() -> None:
        try:
            _start(port)
        except BaseException as exc:  # reported below, on the test's thread
            failed.append(exc)

    # serve.run waits for every replica without a limit of its own; the thread bounds it.
    starter = threading.Thread(target=start, name="ray-start", daemon=True)
    starter.start()
    starter.join(START_S)
    try:
        if starter.is_alive():
            raise RuntimeError(f"the Ray Serve application was not up within {START_S:g} s")
        if failed:
            raise failed[0]
        _wait_until_every_replica_answers(Ingress(port))
        yield Server(Ingress(port))
    finally:
        serve.shutdown()
        ray.shutdown()


def _wait_until_every_replica_answers(where: Ingress) -> None:
    """The ingress's first calls on its handles are slow (on shared CPU cores, seconds)."""
    deadline = time.monotonic() + START_S
    while httpx.get(where.http_url + "/health", timeout=30).json()["status"] != "ok":
        if time.monotonic() > deadline:
            raise RuntimeError(f"the replicas did not all answer /health within {START_S:g} s")
        time.sleep(0.5)


def _replica(index: int):
    return serve.get_deployment_handle(f"replica-{index}", app_name=APP)


async def _audit(index: int, session_id: str) -> dict | None:
    return await asyncio.wait_for(_replica(index).audit.remote(session_id), 30)


async def _until_closed(sock):
    """The events a socket still holds, then its end."""
    with contextlib.suppress(websockets.ConnectionClosed):
        while True:
            yield await sock.recv(timeout=30)


def _resume(sock, last_seq: int) -> dict:
    return {
        "type": "session.resume",
        "session_id": sock.session_id,
        "resume_token": sock.resume_token,
        "last_server_event_seq": last_seq,
    }


def test_session_ids_name_the_replica_that_allocated_them():
    assert [replica_of(session_prefix(i) + "x-_y") for i in (0, 1, 12)] == [0, 1, 12]
    assert [replica_of(s) for s in ("sess_abc", "sess_rx_abc", "r1_abc")] == [None, None, None]


def _probe(replica: int, sessions: int, max_sessions: int = 8, status: str = "ok") -> dict:
    return {"replica": replica, "status": status, "sessions": sessions, "max_sessions": max_sessions}


def test_placement_prefers_the_most_free_slots_then_the_lowest_index():
    placement = Placement(3)
    probes = [_probe(0, 3), _probe(1, 1), _probe(2, 0, status="down")]
    assert [p["replica"] for p in placement.order(probes, asked=0.0, now=0.0)] == [1, 0]
    even = [_probe(0, 2), _probe(1, 6, max_sessions=12)]
    assert [p["replica"] for p in placement.order(even, asked=0.0, now=0.0)] == [0, 1]


def test_placement_counts_each_placed_session_once_until_every_probe_sees_it():
    placement = Placement(2)
    first, second = Link(duplex=True, session_id=None), Link(duplex=True, session_id=None)
    empty = [_probe(0, 0), _probe(1, 0)]
    placement.place(first, placement.order(empty, asked=10.0, now=10.0)[0]["replica"])
    # A second connection, whose probes were asked before the first session existed.
    placement.place(second, placement.order(empty, asked=10.0, now=10.1)[0]["replica"])
    assert (first.placed, second.placed) == (0, 1)
    first.announced = 10.5
    # Asked after the first was announced, the probe of replica 0 counts it and placement does not;
    # the second, not announced yet, placement counts: a tie, so replica 0 (counted twice, the
    # first would send this one to replica 1).
    seen = [_probe(0, 1), _probe(1, 0)]
    assert [p["replica"] for p in placement.order(seen, asked=11.0, now=11.0)] == [0, 1]
    second.announced = 10.6
    both = [_probe(0, 1), _probe(1, 1)]
    # Asked between the two announcements: the probe of replica 1 may have missed the second session, so
    # placement counts it (a tie, so replica 0; counted by nobody, replica 1 would look emptier).
    between = [_probe(0, 1), _probe(1, 0)]
    assert [p["replica"] for p in placement.order(between, asked=10.55, now=11.0)] == [0, 1]
    # Once no probe still in use can have missed them, they are forgotten.
    placement.order(both, asked=15.0, now=10.6 + 2 * PROBE_S + 0.1)
    assert placement.placed == {0: [], 1: []}
    third = Link(duplex=False, session_id=None)
    placement.place(third, 1)
    placement.forget(third)
    assert (placement.placed, third.placed) == ({0: [], 1: []}, None)


def test_a_deployment_takes_one_replica_per_gpu_or_two_without(monkeypatch):
    import cadence_fx.serve.ray as on_ray

    spec = RaySpec(model="tone")
    monkeypatch.setattr(on_ray, "visible_gpus", lambda: 0)
    assert [(s.replicas, s.gpus_per_replica) for s in (sized(spec, None), sized(spec, 3))] == [(2, 0.0), (3, 0.0)]
    monkeypatch.setattr(on_ray, "visible_gpus", lambda: 4)
    assert [(s.replicas, s.gpus_per_replica) for s in (sized(spec, None), sized(spec, 2))] == [(4, 1.0), (2, 1.0)]
    with pytest.raises(ValueError, match=r"^replicas=5: the Ray cluster has 4 GPUs, and each replica takes one$"):
        sized(spec, 5)


def test_the_serve_run_builder_refuses_an_unknown_argument():
    assert isinstance(builder({"model": "tone", "replicas": "2", "max_sessions": "4"}), serve.Application)
    with pytest.raises(ValueError, match=r"^unknown argument\(s\) modle; expected some of max_sessions, model, replicas$"):
        builder({"modle": "tone"})


def test_new_sessions_go_to_the_replica_with_the_most_free_slots(ingress):
    async def scenario():
        socks = [await ingress.connect("/v1/duplex") for _ in range(4)]
        health = httpx.get(ingress.handle.http_url + "/health", timeout=30).json()
        for sock in socks:
            await sock.send({"type": "session.close"})
            await sock.recv_until("session.closed")
        return [replica_of(s.session_id) for s in socks], health

    placed, health = run(scenario())
    assert placed == [0, 1, 0, 1]
    assert (health["status"], health["model"], health["sessions"], health["max_sessions"]) == ("ok", "tone", 4, 16)
    assert [(r["replica"], r["status"], r["sessions"]) for r in health["replicas"]] == [(0, "ok", 2), (1, "ok", 2)]


def test_models_lists_the_model_once_with_every_replica(ingress):
    models = httpx.get(ingress.handle.http_url + "/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["tone"]
    assert [r["replica"] for r in models["data"][0]["replicas"]] == [0, 1]
    figures = [
        "device_footprint_bytes_end",
        "device_footprint_bytes_max",
        "device_used_at_start_bytes",
        "peak_allocated_bytes",
        "reserved_bytes_end",
        "reserved_bytes_max",
    ]
    assert [sorted(r["memory"]) for r in models["data"][0]["replicas"]] == [figures, figures]  # each replica's own


def test_a_resume_through_the_ingress_lands_on_the_owner_and_loses_nothing(ingress, question_pcm):
    async def scenario():
        filler = await ingress.connect("/v1/duplex")  # replica 0, so the session below is on replica 1
        sock = await ingress.connect("/v1/duplex")
        await sock.no_vad()
        await sock.append(question_pcm)
        await sock.send({"type": "input_audio_buffer.commit"})
        await sock.send({"type": "response.create"})
        before = [sock.received[2]]
        while sum(e["type"] == "response.output_audio.delta" for e in before) < 5:
            before.append(await sock.recv())
        await sock.close()  # a disconnect: the reply goes on into the journal
        await asyncio.sleep(0.3)
        # Replica 0 now has the more free slots; the resume still goes where the session is.
        back = await ingress.connect(f"/v1/duplex?session_id={sock.session_id}", created=False)
        await back.send(_resume(sock, before[-1]["server_event_seq"]))
        resumed = await back.recv()
        after = await back.recv_until("response.done", timeout=30)
        audits = [await _audit(i, sock.session_id) for i in (0, 1)]
        for s in (back, filler):
            await s.send({"type": "session.close"})
            await s.recv_until("session.closed")
        return filler, sock, before, resumed, after, audits

    filler, sock, before, resumed, after, (on_0, on_1) = run(scenario())
    assert (replica_of(filler.session_id), replica_of(sock.session_id)) == (0, 1)
    events = before + after
    assert [e["server_event_seq"] for e in events] == list(range(1, len(events) + 1))
    assert (
        types_of(events[1:], skip_deltas=False)
        == COMMIT + RESPONSE_HEAD + ["response.speak"] + ["response.output_audio.delta"] * 56 + RESPONSE_TAIL
    )
    assert (resumed["type"], resumed["session_id"], resumed["generation"]) == ("session.resumed", sock.session_id, 2)
    reply = tone_reply_pcm(56)
    assert deltas_of(events) == reply
    # Every byte accounted on the owner, and only there: the question committed whole, the reply
    # generated, delivered and dropped nowhere; the client counted by its own address.
    assert on_0 is None and on_1["live"] and on_1["client"] == "127.0.0.1"
    ledgers = on_1["ledgers"]
    assert (ledgers["input"]["received_bytes"], ledgers["input"]["committed_bytes"]) == (len(question_pcm),) * 2
    playback = ledgers["playback"]
    assert (playback["delivered_bytes"], playback["dropped_samples"]) == (len(reply), 0)
    assert playback["generated_samples"] == playback["delivered_samples"] > 0


def test_a_takeover_through_the_ingress_replaces_the_owners_connection(ingress):
    async def scenario():
        first = await ingress.connect("/v1/duplex")
        await first.no_vad()
        second = await ingress.connect(f"/v1/duplex?session_id={first.session_id}", created=False)
        await second.send({**_resume(first, 1), "generation": 1})
        resumed = await second.recv()
        replaced = await first.recv()
        await first.ws.wait_closed()
        alive = await second.update({"instructions": "taken over"})
        await second.send({"type": "session.close"})
        await second.recv_until("session.closed")
        return resumed, replaced, (first.ws.close_code, first.ws.close_reason), alive

    resumed, replaced, closed, alive = run(scenario())
    assert (resumed["type"], resumed["replayed"], resumed["generation"]) == ("session.resumed", 0, 2)
    assert (replaced["type"], replaced["session_id"], closed) == (
        "session.replaced",
        resumed["session_id"],
        (4002, "session replaced"),
    )
    assert alive["server_event_seq"] == 2


def test_killing_a_replica_ends_its_sessions_and_spares_the_others(ingress, question_pcm):
    async def scenario():
        kept, doomed = await ingress.connect("/v1/duplex"), await ingress.connect("/v1/duplex")
        plain_kept, plain_doomed = await ingress.connect("/v1/realtime"), await ingress.connect("/v1/realtime")
        await doomed.no_vad()
        health = await asyncio.wait_for(_replica(replica_of(doomed.session_id)).health.remote(), 30)
        actor = health["actor"]
        ray.kill(ray.get_actor(actor, namespace="serve"), no_restart=True)
        ended = await doomed.recv(timeout=30)
        await doomed.ws.wait_closed()
        await plain_doomed.ws.wait_closed()
        plain_after = [event async for event in _until_closed(plain_doomed)]
        plain_alive = await plain_kept.update({"instructions": "still here"})
        health = httpx.get(ingress.handle.http_url + "/health", timeout=30).json()
        turn = await kept.reply_to(question_pcm, timeout=30)
        back = await ingress.connect(f"/v1/duplex?session_id={doomed.session_id}", created=False)
        with contextlib.suppress(websockets.ConnectionClosed):  # a replica still down ends it at once
            await back.send(_resume(doomed, 1))
        late = await back.recv(timeout=30)
        audit = await _audit(replica_of(kept.session_id), kept.session_id)
        await kept.send({"type": "session.close"})
        await kept.recv_until("session.closed")
        await plain_kept.close()
        plain = (plain_kept, plain_doomed, plain_after, plain_alive)
        return kept, doomed, ended, health, turn, late, audit, plain

    kept, doomed, ended, health, turn, late, audit, plain = run(scenario())
    plain_kept, plain_doomed, plain_after, plain_alive = plain
    placed = [replica_of(s.session_id) for s in (kept, doomed, plain_kept, plain_doomed)]
    assert placed == [0, 1, 0, 1]
    assert ended == {
        "type": "session.closed",
        "event_id": "event_replica_lost",
        "session_id": doomed.session_id,
        "reason": REPLICA_LOST,
    }
    assert (doomed.ws.close_code, doomed.ws.close_reason) == (1001, REPLICA_LOST)
    # A plain Realtime connection gets no Tier 3 event: its socket just closes, 1001 replica_lost.
    assert (plain_after, plain_doomed.ws.close_code, plain_doomed.ws.close_reason) == ([], 1001, REPLICA_LOST)
    assert plain_alive["type"] == "session.updated"
    # Replica 1 is down, or already restarted by Ray Serve without the session; replica 0 serves on.
    zero, one = health["replicas"]
    assert (zero["status"], zero["sessions"]) == ("ok", 2)
    assert one["status"] == "down" or one["sessions"] == 0
    assert types_of(turn) == [*COMMIT, *RESPONSE_HEAD, *RESPONSE_TAIL]
    assert deltas_of(turn) == tone_reply_pcm(56)
    journaled = [e["server_event_seq"] for e in kept.received if "server_event_seq" in e]
    assert journaled == list(range(1, len(journaled) + 1))
    assert audit["ledgers"]["input"]["committed_bytes"] == len(question_pcm)
    assert audit["ledgers"]["playback"]["delivered_bytes"] == len(tone_reply_pcm(56))
    # Resuming the lost session: its replica is still down (the same end), or it was restarted
    # without the session.
    if late["type"] == "error":
        assert late["error"]["code"] == "session_not_found"
    else:
        assert (late["type"], late["reason"]) == ("session.closed", REPLICA_LOST)
