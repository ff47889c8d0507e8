"""Sessions over a real uvicorn server on loopback: exact event sequences, bytes and samples.
Every event received is checked against OpenAI's GA schema by CheckedSocket."""

from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np
from servekit import (
    COMMIT,
    RESPONSE_HEAD,
    RESPONSE_TAIL,
    Server,
    deltas_of,
    run,
    running,
    silence,
    tone_reply_pcm,
    types_of,
    wav_pcm,
)

from cadence_fx.serve.app import background_server
from cadence_fx.serve.plugins import ToneModel, tone
from cadence_fx.serve.plugins.tone import ToneStream
from cadence_fx.serve.protocol import PCM24K, PCMA, PCMU, StreamResampler
from cadence_fx.serve.protocol import audio as wire_audio
from cadence_fx.serve.session import Limits

QUESTION_BYTES = 212_658  # question_24k.wav: 106,329 samples
QUESTION_REPLY_CHUNKS = 56  # 70,886 samples at 16 kHz -> 222 frames -> 53,280 reply samples -> 56 chunks


def test_manual_turn_gives_the_exact_ga_event_sequence(server, question_pcm):
    async def scenario():
        sock = await server.connect("/v1/duplex")
        updated = await sock.no_vad()
        await sock.append(question_pcm)
        await sock.send({"type": "input_audio_buffer.commit"})
        await sock.send({"type": "response.create"})
        events = await sock.recv_until("response.done")
        session = server.on_loop(lambda: server.session(sock.session_id).ledgers.to_dict())
        await sock.close()
        return updated, events, session

    updated, events, ledgers = run(scenario())
    # A duplex connection hears the decision (vLLM-Omni's response.speak) once, before the first audio.
    assert types_of(events, skip_deltas=False) == (
        COMMIT + RESPONSE_HEAD + ["response.speak"] + ["response.output_audio.delta"] * QUESTION_REPLY_CHUNKS + RESPONSE_TAIL
    )
    assert [e["server_event_seq"] for e in [updated, *events]] == list(range(1, len(events) + 2))
    assert events[0]["audio_bytes"] == QUESTION_BYTES and events[0]["turn_id"] == 1
    assert deltas_of(events) == tone_reply_pcm(QUESTION_REPLY_CHUNKS)
    deltas = [e for e in events if e["type"] == "response.output_audio.delta"]
    assert [d["audio_offset"] for d in deltas] == list(range(0, 960 * QUESTION_REPLY_CHUNKS, 960))
    done = events[-1]
    assert (done["response"]["status"], done["epoch"], done["turn_id"]) == ("completed", 0, 1)
    assert done["playback"] == {
        "audio_samples": 53_760,
        "audio_ms": 2_240,
        "format": {"type": "audio/pcm", "rate": 24000},
    }
    assert ledgers["input"] == {
        "received_bytes": QUESTION_BYTES,
        "committed_bytes": QUESTION_BYTES,
        "cleared_bytes": 0,
        "rejected_bytes": 0,
        "rejected_appends": 0,
        "resampled_samples": 70_886,
        "fed_samples": 71_040,
        "padded_samples": 154,
        "discarded_samples": 0,
        "pending_samples": 0,
        "buffered_bytes": 0,
    }
    assert ledgers["playback"]["delivered_samples"] == ledgers["playback"]["generated_samples"] == 53_760


def test_realtime_route_speaks_tier1_only(server, question_pcm):
    async def scenario():
        sock = await server.connect("/v1/realtime")
        await sock.no_vad()
        await sock.append(question_pcm)
        await sock.send({"type": "input_audio_buffer.commit"})
        await sock.send({"type": "response.create"})
        events = await sock.recv_until("response.done")
        await sock.send({"type": "session.heartbeat"})
        refused = await sock.recv()
        await sock.close()
        return sock.received, events, refused

    received, events, refused = run(scenario())
    # CheckedSocket(duplex=False) already failed on any non-GA field; no seq, no Tier 3 event.
    assert all("server_event_seq" not in e for e in received)
    assert deltas_of(events) == tone_reply_pcm(QUESTION_REPLY_CHUNKS)
    assert refused["error"]["code"] == "unsupported_in_realtime_mode"


def test_duplex_query_flag_on_the_realtime_route(server):
    async def scenario():
        sock = await server.connect("/v1/realtime?duplex=1")
        updated = await sock.no_vad()
        await sock.close()
        return updated

    assert run(scenario())["server_event_seq"] == 1


def test_server_vad_cuts_the_recording_into_two_turns(server):
    turns = wav_pcm("turns_24k.wav")
    split = 6_600 * 48  # bytes: the first turn ends (VAD) at 6,050 ms

    async def scenario():
        sock = await server.connect("/v1/duplex")
        await sock.append(turns[:split])
        first = await sock.recv_until("response.done")
        await sock.append(turns[split:])
        second = await sock.recv_until("response.done")
        tail = await sock.recv_all()
        await sock.close()
        return first, second, tail

    first, second, tail = run(scenario())
    vad_turn = [
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
        *COMMIT,
        *RESPONSE_HEAD,
        *RESPONSE_TAIL,
    ]
    assert types_of(first) == vad_turn and types_of(second) == vad_turn and tail == []
    assert [(e["audio_start_ms"], e["item_id"]) for e in (first[0], second[0])] == [
        (1210, first[2]["item_id"]),
        (7130, second[2]["item_id"]),
    ]
    assert [e["audio_end_ms"] for e in (first[1], second[1])] == [6050, 11330]
    # Each turn is committed at its stop, inside the 200 ms append where VAD saw it: 6,050 ms, then
    # the 5,280 ms from there to 11,330 ms (48 bytes a millisecond).
    assert [e["audio_bytes"] for e in (first[2], second[2])] == [6_050 * 48, 5_280 * 48]
    # The frames wholly before each stop are the turn's (the one across it goes on into the next):
    # 6,050 ms is 302.5 frames of 20 ms at 16 kHz -> 302 frames (96,640 samples) -> 72,480 reply
    # samples -> 76 chunks of 960; the second turn holds frames 302 to 565 (11,330 ms is 566.5
    # frames): 264 frames (84,480 samples) -> 63,360 reply samples -> 66 chunks.
    assert deltas_of(first) == tone_reply_pcm(76) and deltas_of(second) == tone_reply_pcm(66)


class _LoggedTone(ToneModel):
    """Tone streams that log the session's calls: each frame fed, and each reply begun."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[str] = []

    def open_stream(self) -> ToneStream:
        log, stream = self.log, super().open_stream()
        feed, begin = stream.feed, stream.begin_response
        stream.feed = lambda frame: (log.append("feed"), feed(frame))[1]
        stream.begin_response = lambda: (log.append("begin_response"), begin())[1]
        return stream


def test_a_vad_turn_ends_at_its_stop_inside_an_append():
    """One append of 0.4 s of speech and 0.7 s of silence: VAD ends the turn at 0.9 s (0.5 s of
    silence). The turn is the 0.9 s before its stop: its bytes are committed, its 45 frames (20 ms
    at 16 kHz) are fed, then its reply begins; the append's 10 frames after the stop are fed after
    that (a duplex model's reply starts with them) and stay uncommitted, for the next turn."""
    rate = PCM24K.rate
    t = np.arange(int(1.1 * rate)) / rate
    pcm = wire_audio.encode_samples((0.1 * np.sin(2 * np.pi * 220 * t) * (t < 0.4)).astype(np.float32), PCM24K)
    plugin = _LoggedTone()

    async def scenario(server):
        sock = await server.connect("/v1/duplex")
        await sock.append(pcm, chunk_bytes=len(pcm))
        events = await sock.recv_until("response.done")
        await sock.close()
        return events

    with background_server(lambda: plugin, Limits(max_sessions=4)) as handle:
        events = run(scenario(Server(handle)))
    stopped = next(e for e in events if e["type"] == "input_audio_buffer.speech_stopped")
    committed = next(e for e in events if e["type"] == "input_audio_buffer.committed")
    assert (stopped["audio_end_ms"], committed["audio_bytes"]) == (900, 900 * 48)
    assert plugin.log == ["feed"] * 45 + ["begin_response"] + ["feed"] * 10
    assert deltas_of(events) == tone_reply_pcm(tone.reply_chunks(45 * 320))


def test_barge_in_cancels_the_response_and_fences_its_epoch(question_pcm):
    interrupt = wav_pcm("interrupt_24k.wav")

    async def scenario(server):
        sock = await server.connect("/v1/duplex")
        await sock.append(question_pcm + silence(600))
        before = await sock.recv_until("response.output_audio.delta")
        await sock.append(interrupt[:9600])
        during = await sock.recv_until("response.done")
        await sock.append(interrupt[9600:] + silence(600))
        after = await sock.recv_until("response.done")
        tail = await sock.recv_all()
        await sock.close()
        return before, during, after, tail

    with running(step_delay_s=0.05) as server:
        before, during, after, tail = run(scenario(server))
    old = before[-1]["response_id"]
    assert types_of(during) == ["input_audio_buffer.speech_started", "barge_in", *RESPONSE_TAIL]
    barge, done = during[-6], during[-1]
    # Speech begins where the interrupt starts, 4,430 + 600 ms in, less 300 ms of prefix padding.
    assert (barge["response_id"], barge["epoch"], barge["audio_start_ms"]) == (old, 1, 4730)
    assert done["response"]["status_details"] == {"type": "cancelled", "reason": "turn_detected"}
    assert (done["response"]["status"], done["epoch"]) == ("cancelled", 0)
    assert types_of(after) == ["input_audio_buffer.speech_stopped", *COMMIT, *RESPONSE_HEAD, *RESPONSE_TAIL]
    assert after[4]["epoch"] == 1 and after[-1]["response"]["status"] == "completed"
    assert all(e.get("response_id") != old for e in after + tail)


def test_response_cancel_stops_at_a_chunk_boundary(question_pcm):
    async def scenario(server):
        sock = await server.connect("/v1/duplex")
        await sock.no_vad()
        await sock.append(question_pcm)
        await sock.send({"type": "input_audio_buffer.commit"})
        await sock.send({"type": "response.create"})
        head = await sock.recv_until("response.output_audio.delta")
        await sock.send({"type": "response.cancel", "response_id": head[-1]["response_id"]})
        rest = await sock.recv_until("response.done")
        tail = await sock.recv_all(0.5)
        await sock.send({"type": "response.cancel"})
        again = await sock.recv()
        ledgers = server.on_loop(lambda: server.session(sock.session_id).ledgers)
        await sock.close()
        return head, rest, tail, again, ledgers

    with running(step_delay_s=0.05) as server:
        head, rest, tail, again, ledgers = run(scenario(server))
    assert types_of(rest) == RESPONSE_TAIL and tail == []
    assert rest[-1]["response"]["status_details"]["reason"] == "client_cancelled"
    delivered = deltas_of(head + rest)
    assert delivered == tone_reply_pcm(QUESTION_REPLY_CHUNKS)[: len(delivered)]
    assert rest[-1]["playback"]["audio_samples"] * 2 == len(delivered)
    playback = ledgers.playback
    assert playback.delivered_bytes == len(delivered)
    assert playback.generated_samples == playback.delivered_samples + playback.dropped_samples
    assert (ledgers.responses.cancelled, again["error"]["code"]) == (1, "response_cancel_not_active")


def test_g711_in_and_out_with_exact_byte_counts(server, question_pcm):
    samples = wire_audio.decode_samples(question_pcm, PCM24K)
    pcmu = wire_audio.encode_samples(StreamResampler(24_000, 8_000).process(samples), PCMU)

    async def scenario():
        sock = await server.connect("/v1/duplex")
        updated = await sock.update(
            {
                "audio": {
                    "input": {"format": {"type": "audio/pcmu"}, "turn_detection": None},
                    "output": {"format": {"type": "audio/pcma"}},
                }
            }
        )
        await sock.append(pcmu, chunk_bytes=1600)
        await sock.send({"type": "input_audio_buffer.commit"})
        await sock.send({"type": "response.create"})
        events = await sock.recv_until("response.done")
        await sock.close()
        return updated, events

    updated, events = run(scenario())
    assert updated["session"]["audio"]["output"]["format"] == {"type": "audio/pcma"}
    assert events[0]["audio_bytes"] == len(pcmu) == 35_443
    # 35,443 samples at 8 kHz -> 70,886 at 16 kHz: the same 56-chunk reply, sent at 8 kHz A-law.
    expected = wire_audio.encode_samples(
        StreamResampler(24_000, 8_000).process(wire_audio.decode_samples(tone_reply_pcm(56), PCM24K)), PCMA
    )
    assert deltas_of(events) == expected and len(expected) == 56 * 320
    assert events[-1]["playback"] == {"audio_samples": 17_920, "audio_ms": 2_240, "format": {"type": "audio/pcma"}}


def test_conversation_items_create_retrieve_truncate_delete(server, question_pcm):
    async def scenario():
        sock = await server.connect("/v1/duplex")
        await sock.no_vad()
        await sock.send(
            {
                "type": "conversation.item.create",
                "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            }
        )
        created = await sock.recv_until("conversation.item.done")
        await sock.append(question_pcm[:48_000])
        await sock.send({"type": "input_audio_buffer.commit"})
        await sock.send({"type": "response.create"})
        turn = await sock.recv_until("response.done")
        user_id, assistant_id = turn[0]["item_id"], turn[-1]["response"]["output"][0]["id"]
        await sock.send({"type": "conversation.item.retrieve", "item_id": user_id})
        retrieved = await sock.recv()
        await sock.send({"type": "conversation.item.truncate", "item_id": assistant_id, "content_index": 0, "audio_end_ms": 200})
        truncated = await sock.recv()
        await sock.send(
            {"type": "conversation.item.truncate", "item_id": assistant_id, "content_index": 0, "audio_end_ms": 60_000}
        )
        too_far = await sock.recv()
        await sock.send({"type": "conversation.item.delete", "item_id": user_id})
        deleted = await sock.recv()
        await sock.send({"type": "conversation.item.delete", "item_id": user_id})
        missing = await sock.recv()
        await sock.close()
        return created, turn, retrieved, truncated, too_far, deleted, missing

    created, turn, retrieved, truncated, too_far, deleted, missing = run(scenario())
    assert types_of(created) == ["conversation.item.added", "conversation.item.done"]
    text_id = created[0]["item"]["id"]
    assert turn[0]["previous_item_id"] == text_id
    assert retrieved["item"]["content"][0]["audio"] == wire_audio.b64encode(question_pcm[:48_000])
    assert (truncated["type"], truncated["audio_end_ms"]) == ("conversation.item.truncated", 200)
    assert (too_far["error"]["code"], too_far["error"]["param"]) == ("invalid_value", "audio_end_ms")
    assert (deleted["type"], deleted["item_id"]) == ("conversation.item.deleted", turn[0]["item_id"])
    assert (missing["error"]["code"], missing["error"]["message"]) == (
        "item_delete_invalid_item_id",
        f"Error deleting item: the item with id '{turn[0]['item_id']}' does not exist.",
    )


def test_clear_discards_the_buffer_and_is_accounted(server, question_pcm):
    async def scenario():
        sock = await server.connect("/v1/duplex")
        await sock.no_vad()
        await sock.append(question_pcm[: 10_001 * 2])
        await sock.send({"type": "input_audio_buffer.clear"})
        cleared = await sock.recv()
        await sock.send({"type": "input_audio_buffer.commit"})
        empty = await sock.recv()
        await sock.send({"type": "response.create"})
        events = await sock.recv_until("response.done")
        ledgers = server.on_loop(lambda: server.session(sock.session_id).ledgers.to_dict()["input"])
        await sock.close()
        return cleared, empty, events, ledgers

    cleared, empty, events, ledgers = run(scenario())
    assert cleared["audio_bytes"] == 20_002 and empty["error"]["code"] == "input_audio_buffer_commit_empty"
    assert deltas_of(events) == tone_reply_pcm(1)  # the cleared turn left nothing: minimal reply
    # 10,001 samples -> 6,668 at 16 kHz: 20 frames fed, 268 pending dropped by the clear.
    assert (ledgers["cleared_bytes"], ledgers["fed_samples"], ledgers["discarded_samples"]) == (20_002, 6_400, 268)


def test_models_route_shows_each_plugins_describe():
    async def scenario(server):
        sock = await server.connect("/v1/duplex")
        await sock.close()

    with running(Limits(max_sessions=4), step_delay_s=0.01) as server:
        run(scenario(server))
        with httpx.Client(base_url=server.handle.http_url) as http:
            models = http.get("/v1/models").json()
    assert [m["plugin"] for m in models["data"]] == [{"model": "tone", "streams": 1, "feed_delay_s": 0.0, "step_delay_s": 0.01}]


def test_models_and_health_routes(server):
    with httpx.Client(base_url=server.handle.http_url) as http:
        models = http.get("/v1/models").json()
        health = http.get("/health").json()
    assert [m["id"] for m in models["data"]] == ["tone"]
    assert models["data"][0]["description"].startswith("test double")
    assert (health["status"], health["model"], health["max_sessions"]) == ("ok", "tone", 64)
    assert (health["free_slots"], health["admits"]) == (None, 64 - health["sessions"])  # the tone has no slots
    assert sorted(health) == [
        "admits",
        "connections",
        "free_slots",
        "gc",
        "loop_lag_ms",
        "max_sessions",
        "model",
        "sessions",
        "sessions_ended",
        "status",
    ]
    assert sorted(health["loop_lag_ms"]) == ["max", "mean", "wakes"]
    assert sorted(health["gc"]) == ["frozen_objects", "generations"]
    assert [sorted(g) for g in health["gc"]["generations"]] == [["collections", "max_ms", "total_ms"]] * 3


def test_admission_limit_refuses_with_resource_exhausted():
    async def scenario(server):
        held = [await server.connect("/v1/duplex") for _ in range(2)]
        refused = await server.connect("/v1/duplex", created=False)
        error = await refused.recv()
        await refused.ws.wait_closed()
        await held[0].send({"type": "session.close"})
        await held[0].recv_until("session.closed")
        admitted = await server.connect("/v1/duplex")
        return error, refused.ws.close_code, admitted.session_id

    with running(Limits(max_sessions=2)) as server:
        error, code, admitted = run(scenario(server))
    assert (error["error"]["code"], code) == ("resource_exhausted", 1013)
    assert admitted.startswith("sess_")


def test_a_paced_reply_is_the_same_audio_handed_out_no_further_ahead_of_playback_than_its_lead(question_pcm):
    """The question's reply is 2.24 s of audio in 40 ms chunks; with a lead of 0.2 s each chunk
    leaves the server no earlier than its play time (from the first chunk) less the lead."""

    async def scenario(server):
        sock = await server.connect("/v1/duplex")
        await sock.no_vad()
        await sock.append(question_pcm)
        await sock.send({"type": "input_audio_buffer.commit"})
        await sock.send({"type": "response.create"})
        arrivals, events = [], []
        while not events or events[-1]["type"] != "response.done":
            events.append(await sock.recv())
            arrivals.append(time.monotonic())
        await sock.close()
        return events, arrivals

    with running(Limits(max_sessions=4, reply_lead_s=0.2)) as server:
        events, arrivals = run(scenario(server))
    assert types_of(events, skip_deltas=False) == (
        COMMIT + RESPONSE_HEAD + ["response.speak"] + ["response.output_audio.delta"] * QUESTION_REPLY_CHUNKS + RESPONSE_TAIL
    )
    assert deltas_of(events) == tone_reply_pcm(QUESTION_REPLY_CHUNKS)
    delivered = [at for at, e in zip(arrivals, events) if e["type"] == "response.output_audio.delta"]
    # Chunk k is computed once the k chunks before it (40 ms each) are at most 0.2 s ahead of the
    # clock that started at the first; 0.1 s of slack for the first chunk's own way to this client
    # (unpaced, every chunk would be here within a few milliseconds of the first).
    early = [k for k, at in enumerate(delivered) if at - delivered[0] < 0.04 * k - 0.2 - 0.1]
    assert early == []


class SlottedTone(ToneModel):
    """The tone with a fixed number of streams, as a batch's slots: ``free_slots`` counts those
    not closed."""

    def __init__(self, slots: int) -> None:
        super().__init__()
        self.slots, self.open = slots, 0

    def open_stream(self) -> ToneStream:
        plugin = self

        class SlotStream(ToneStream):
            def close(self) -> None:
                plugin.open -= 1

        self.open += 1
        return SlotStream(self.feed_delay_s, self.step_delay_s)

    def free_slots(self) -> int:
        return self.slots - self.open


def test_admission_is_a_free_slot_and_rate_limits_count_free_slots():
    async def scenario(server):
        first = await server.connect("/v1/duplex")
        second = await server.connect("/v1/duplex")
        told = await first.recv()  # the server is full now: the first session learns it
        refused = await server.connect("/v1/duplex", created=False)
        error = await refused.recv()
        await refused.ws.wait_closed()
        health_full = await asyncio.to_thread(httpx.get, server.handle.http_url + "/health")
        await second.send({"type": "session.close"})
        await second.recv_until("session.closed")
        freed = await first.recv()  # a slot is free again
        return first.rate_limits, second.rate_limits, told, error, refused.ws.close_code, health_full.json(), freed

    with background_server(lambda: SlottedTone(2), Limits(max_sessions=4, max_sessions_per_client=4)) as handle:
        first, second, told, error, code, health, freed = run(scenario(Server(handle)))
    requests = [
        [(r["name"], r["limit"], r["remaining"]) for r in limits if r["name"] == "requests"]
        for limits in (first, second, told["rate_limits"], freed["rate_limits"])
    ]
    assert requests == [[("requests", 4, 1)], [("requests", 4, 0)], [("requests", 4, 0)], [("requests", 4, 1)]]
    assert (told["type"], freed["type"]) == ("rate_limits.updated", "rate_limits.updated")
    assert (error["error"]["code"], code) == ("resource_exhausted", 1013)
    assert error["error"]["message"] == (
        "every slot of tone is taken (its batch's, or its lanes' room; max_sessions=4 is not reached): a session "
        "needs a free slot"
    )
    assert (health["sessions"], health["max_sessions"], health["free_slots"], health["admits"]) == (2, 4, 0, 0)


def test_input_backpressure_refuses_appends_beyond_the_bound_accounts_them_and_updates_rate_limits(question_pcm):
    async def scenario(server):
        sock = await server.connect("/v1/duplex")
        await sock.no_vad()
        await sock.append(question_pcm[: 10 * 9600])
        refused = [await sock.recv() for _ in range(9)]
        await sock.send({"type": "input_audio_buffer.commit"})
        committed = await sock.recv_until("input_audio_buffer.committed")
        ledgers = server.on_loop(lambda: server.session(sock.session_id).ledgers.input)
        await sock.close()
        return sock.rate_limits, refused, committed, ledgers

    # Each 200 ms append takes 10 frames x 50 ms = 0.5 s to feed: two fit under 20,000 bytes.
    with running(Limits(max_pending_input_bytes=20_000), feed_delay_s=0.05) as server:
        opening, refused, committed, ledgers = run(scenario(server))
    assert [e["error"]["code"] for e in refused if e["type"] == "error"] == ["input_backpressure"] * 8
    assert committed[-1]["audio_bytes"] == 2 * 9600
    assert (ledgers.received_bytes, ledgers.rejected_bytes, ledgers.rejected_appends) == (19_200, 76_800, 8)
    requests = {"name": "requests", "limit": 16, "remaining": 15}
    assert opening == [requests, {"name": "tokens", "limit": 20_000, "remaining": 20_000}]
    # The first refusal flips the session to refusing input (two appends, 19,200 bytes, queued) ...
    assert types_of(refused) == ["error", "rate_limits.updated"] + ["error"] * 7
    assert refused[1]["rate_limits"] == [requests, {"name": "tokens", "limit": 20_000, "remaining": 800}]
    # ... and the queue draining flips it back, before the commit queued behind the appends.
    assert types_of(committed) == ["rate_limits.updated", "input_audio_buffer.committed"]
    assert committed[0]["rate_limits"] == [requests, {"name": "tokens", "limit": 20_000, "remaining": 20_000}]


def test_rate_limits_tell_every_session_when_the_server_fills_up_and_frees_a_slot():
    async def scenario(server):
        first = await server.connect("/v1/duplex")
        second = await server.connect("/v1/duplex")
        full = await first.recv()
        refused = await server.connect("/v1/duplex", created=False)
        await refused.recv()
        await first.send({"type": "session.close"})
        closed = await first.recv_until("session.closed")
        freed = await second.recv()
        third = await server.connect("/v1/realtime")
        full_again = await second.recv()
        quiet = await second.recv_all() + await third.recv_all()
        await second.close()
        await third.close()
        return first.rate_limits, second.rate_limits, full, closed, freed, third.rate_limits, full_again, quiet

    with running(Limits(max_sessions=2)) as server:
        first, second, full, closed, freed, third, full_again, quiet = run(scenario(server))

    def requests(remaining: int) -> list[dict]:
        return [
            {"name": "requests", "limit": 2, "remaining": remaining},
            {"name": "tokens", "limit": 1 << 20, "remaining": 1 << 20},
        ]

    assert (first, second, third) == (requests(1), requests(0), requests(0))
    assert (full["type"], full["rate_limits"]) == ("rate_limits.updated", requests(0))
    assert types_of(closed) == ["session.closed"]
    assert (freed["type"], freed["rate_limits"]) == ("rate_limits.updated", requests(1))
    assert (full_again["type"], full_again["rate_limits"]) == ("rate_limits.updated", requests(0))
    assert quiet == []
    assert "server_event_seq" not in full  # a snapshot, not journaled


def test_output_audio_buffer_clear_cuts_the_reply_and_acks_are_ledgered(question_pcm):
    async def scenario(server):
        sock = await server.connect("/v1/duplex")
        await sock.no_vad()
        await sock.append(question_pcm)
        await sock.send({"type": "input_audio_buffer.commit"})
        await sock.send({"type": "response.create"})
        head = await sock.recv_until("response.output_audio.delta")
        response_id = head[-1]["response_id"]
        await sock.send({"type": "output_audio_buffer.clear"})
        rest = await sock.recv_until("output_audio_buffer.cleared")
        played = rest[-2]["playback"]["audio_ms"]
        await sock.send({"type": "playback.ack", "response_id": response_id, "audio_end_ms": 20})
        await sock.send({"type": "playback.ack", "response_id": response_id, "audio_end_ms": 10})  # never goes back
        await sock.send({"type": "playback.ack", "response_id": response_id, "audio_end_ms": 60_000})  # capped
        await sock.update({})
        acked = server.on_loop(lambda: server.session(sock.session_id).ledgers.playback.acked_ms)
        await sock.close()
        return rest, played, acked

    with running(step_delay_s=0.05) as server:
        rest, played, acked = run(scenario(server))
    assert types_of(rest) == [*RESPONSE_TAIL, "output_audio_buffer.cleared"]
    assert rest[-2]["response"]["status"] == "cancelled"
    assert acked == played and played % 40 == 0 and played > 0
