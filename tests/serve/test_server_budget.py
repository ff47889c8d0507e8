"""The per-session byte budget: input (queued data commands, uncommitted audio, kept history),
outbound queue and journal; and what a client gets at each limit."""

from __future__ import annotations

import contextlib
import json

import pytest
import websockets
from servekit import COMMIT, check_event, run, running, silence, types_of

from cadence_fx.serve.protocol import audio as wire_audio
from cadence_fx.serve.session import Limits

# 100,000 input bytes; events up to 4/3 of that (a retrieved turn) must fit the outbound queue,
# and the journal must hold that queue and one more of them (166,104 bytes).
SMALL = Limits(
    max_sessions_per_client=64,
    input_bytes=100_000,
    max_frame_bytes=16_384,
    outbound_bytes=200_000,
    journal_bytes=400_000,
)


def _append(pcm: bytes, event_id: str) -> str:
    return json.dumps({"type": "input_audio_buffer.append", "event_id": event_id, "audio": wire_audio.b64encode(pcm)})


def test_uncommitted_input_is_bounded_by_the_input_budget():
    frame = _append(silence(200), "a10")  # 9,600 bytes of audio

    async def scenario(server):
        sock = await server.connect("/v1/duplex")
        await sock.no_vad()
        answers = []
        for i in range(12):
            await sock.send(_append(silence(200), f"a{i:02d}"))
            answers.append(await sock.update({}))  # a barrier: the append has been handled
        ledger = server.on_loop(lambda: server.session(sock.session_id).ledgers.input)
        await sock.send({"type": "input_audio_buffer.commit"})
        committed = await sock.recv_until("input_audio_buffer.committed")
        await sock.close()
        return answers, sock.received, ledger, committed

    with running(SMALL) as server:
        answers, received, ledger, committed = run(scenario(server))
    errors = [e for e in received if e["type"] == "error"]
    # Ten appends fit (96,000 bytes); the eleventh would take 96,000 + its frame past 100,000.
    assert [e["error"]["event_id"] for e in errors] == ["a10", "a11"]
    assert {e["error"]["code"] for e in errors} == {"input_backpressure"}
    assert errors[0]["error"]["message"] == (
        f"the session's input budget is full: 96000 of input_bytes=100000 taken (0 by queued commands, "
        f"96000 by uncommitted audio, 0 by conversation items), this frame has {len(frame)}; "
        "commit or clear the buffer, or delete items"
    )
    assert (ledger.received_bytes, ledger.rejected_bytes, ledger.rejected_appends) == (96_000, 19_200, 2)
    assert committed[-1]["audio_bytes"] == 96_000


def test_the_oldest_turns_audio_makes_room_and_its_item_stays():
    turn = silence(500)  # 24,000 bytes

    async def scenario(server):
        sock = await server.connect("/v1/duplex")
        await sock.no_vad()
        ids = []
        for _ in range(5):
            for half in (turn[:12_000], turn[12_000:]):
                await sock.append(half)
                await sock.update({})  # nothing queued: only what the session keeps counts
            await sock.send({"type": "input_audio_buffer.commit"})
            ids.append((await sock.recv_until("input_audio_buffer.committed"))[-1]["item_id"])
            await sock.recv_until("conversation.item.done")
        retrieved = []
        for item_id in ids:
            await sock.send({"type": "conversation.item.retrieve", "item_id": item_id})
            retrieved.append((await sock.recv())["item"])
        dropped = server.on_loop(lambda: server.session(sock.session_id).ledgers.history_audio_dropped_bytes)
        await sock.close()
        return retrieved, dropped

    with running(SMALL) as server:
        retrieved, dropped = run(scenario(server))
    # Four turns of 24,000 bytes and their items fit in 100,000 bytes; half of a fifth does not:
    # the first turn's audio goes.
    assert ["audio" in item["content"][0] for item in retrieved] == [False, True, True, True, True]
    assert retrieved[1]["content"][0]["audio"] == wire_audio.b64encode(turn)
    assert dropped == 24_000


def test_conversation_items_count_against_the_input_budget():
    text = "x" * 12_000

    def create(n: int) -> dict:
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
        return {"type": "conversation.item.create", "event_id": f"c{n}", "item": item}

    async def scenario(server):
        sock = await server.connect("/v1/duplex")
        answers = []
        for n in range(9):
            await sock.send(create(n))
            answers.append((await sock.recv())["type"])
            if answers[-1] == "conversation.item.added":
                await sock.recv_until("conversation.item.done")
        first = sock.received[2]["item"]["id"]
        await sock.send({"type": "conversation.item.delete", "item_id": first})
        deleted = await sock.recv()
        await sock.send(create(9))
        after = await sock.recv()
        await sock.close()
        return answers, deleted, after

    with running(SMALL) as server:
        answers, deleted, after = run(scenario(server))
    # Each item is about 12,100 bytes of JSON: eight fit in 100,000 bytes, the ninth does not.
    assert answers == ["conversation.item.added"] * 8 + ["error"]
    assert deleted["type"] == "conversation.item.deleted" and after["type"] == "conversation.item.added"


def test_a_client_that_reads_nothing_is_closed_with_4008_and_resumes_without_a_loss(question_pcm):
    """A client asks for a large item again and again and reads nothing: the server holds at most
    outbound_bytes for it, closes it (4008), and its resume replays exactly what it missed."""
    limits = Limits(
        max_sessions_per_client=64,
        input_bytes=512 << 10,  # room for the whole question, appended at once
        max_frame_bytes=16 << 10,
        outbound_bytes=1 << 20,
        journal_bytes=32 << 20,
    )

    async def scenario(server):
        sock = await server.connect("/v1/duplex", stalls=True)
        await sock.no_vad()
        await sock.append(question_pcm)
        await sock.send({"type": "input_audio_buffer.commit"})
        item_id = (await sock.recv_until("input_audio_buffer.committed"))[-1]["item_id"]
        await sock.recv_until("conversation.item.done")
        for _ in range(60):  # 60 x 283 KB: more than the socket buffers and the outbound budget
            await sock.send({"type": "conversation.item.retrieve", "item_id": item_id})
        # Blocking this loop is the stall: the client reads nothing until the server gave up on it.
        detached = server.eventually(lambda: server.session(sock.session_id).transport is None, timeout=20)
        before = []
        with contextlib.suppress(websockets.ConnectionClosed):
            while True:
                before.append(await sock.recv())
        back = await server.connect(f"/v1/duplex?session_id={sock.session_id}", created=False)
        await back.send(
            {
                "type": "session.resume",
                "session_id": sock.session_id,
                "resume_token": sock.resume_token,
                "last_server_event_seq": before[-1]["server_event_seq"],
            }
        )
        resumed = await back.recv()
        after = [await back.recv() for _ in range(resumed["replayed"])]
        await back.close()
        return detached, sock.received, before, (sock.ws.close_code, sock.ws.close_reason), resumed, after

    with running(limits) as server:
        detached, received, before, closed, resumed, after = run(scenario(server))
    assert detached and closed == (4008, "slow consumer")
    events = [e for e in received if "server_event_seq" in e] + after
    assert [e["server_event_seq"] for e in events] == list(range(1, resumed["last_server_event_seq"] + 1))
    retrieved = [e for e in before + after if e["type"] == "conversation.item.retrieved"]
    # Events 1-4 are the update and the commit; every retrieve handled before the close was answered.
    assert resumed["replayed"] > 0 and len(retrieved) == resumed["last_server_event_seq"] - 4
    assert {e["item"]["content"][0]["audio"] for e in retrieved} == {wire_audio.b64encode(question_pcm)}


def test_a_client_detached_across_thousands_of_events_gets_every_one_on_resume():
    """4,500 events pile up while the client reads nothing, then it disconnects: all of them are
    within the journal's bytes, so its resume replays every one, in order, once."""

    async def scenario(server):
        sock = await server.connect("/v1/duplex")
        for i in range(4_500):
            await sock.send({"type": "response.cancel", "event_id": f"c{i}"})
        assert server.eventually(lambda: server.session(sock.session_id).journal.last_seq == 4_500, timeout=30)
        sock.ws.transport.abort()  # the connection drops: every event is lost to this socket
        await sock.ws.wait_closed()
        back = await server.connect(f"/v1/duplex?session_id={sock.session_id}", created=False)
        await back.send(
            {
                "type": "session.resume",
                "session_id": sock.session_id,
                "resume_token": sock.resume_token,
                "last_server_event_seq": 0,
            }
        )
        resumed = await back.recv()
        # Read raw: the 4,500 errors are one kind of event, checked against the schema once.
        replayed = [json.loads(await back.ws.recv()) for _ in range(resumed["replayed"])]
        check_event(replayed[-1], duplex=True)
        await back.close()
        return resumed, replayed

    with running() as server:
        resumed, replayed = run(scenario(server))
    assert (resumed["replayed"], resumed["last_server_event_seq"]) == (4_500, 4_500)
    assert [e["server_event_seq"] for e in replayed] == list(range(1, 4_501))
    assert {e["type"] for e in replayed} == {"error"}


def test_limits_keep_the_journal_able_to_hold_the_outbound_queue_and_the_largest_event():
    # 1,000 input bytes: the largest event is 4 * 334 + 1,000 + 16,384 = 18,720 bytes.
    with pytest.raises(
        ValueError,
        match=r"^Limits.journal_bytes \(2000000\) must be at least Limits.outbound_bytes \(2000000\) plus the "
        r"largest event \(18720 bytes\), 2018720: at a 4008 close the socket's queue and the event that did not "
        r"fit are dropped, and the journal must still hold all of them for the resume$",
    ):
        Limits(input_bytes=1000, max_frame_bytes=1000, outbound_bytes=2_000_000, journal_bytes=2_000_000)
    assert Limits(input_bytes=1000, max_frame_bytes=1000, outbound_bytes=2_000_000, journal_bytes=2_018_720)
    with pytest.raises(ValueError, match=r"Limits.outbound_bytes \(100000\) must hold the largest event .* 150720"):
        Limits(input_bytes=100_000, max_frame_bytes=1000, outbound_bytes=100_000, journal_bytes=300_000)
    defaults = Limits()
    assert defaults.largest_event_bytes == 4 * 2_796_203 + (1 << 20) + (16 << 10) <= defaults.outbound_bytes
    assert defaults.journal_bytes == 24 << 20 >= defaults.outbound_bytes + defaults.largest_event_bytes


def test_a_slow_consumer_closed_behind_two_of_the_largest_events_resumes_without_a_loss():
    """Issue 41: the default budgets, and retrieve answers of about 9 MB each (a 6.75 MB turn in
    base64). At the 4008 close the queue held one of them and the one that did not fit was
    dropped with it: 18 MB that the journal must still hold, and a journal of only the outbound
    budget (16 MiB then) kept the newer one alone (resync_required: oldest 17, asked 15)."""
    turn = bytes(6_750_000)  # 140.6 s of 24 kHz PCM16; its retrieve answer is 9,000,000 characters of base64

    async def scenario(server):
        sock = await server.connect("/v1/duplex", stalls=True)
        await sock.no_vad()
        session = server.session(sock.session_id)
        for i in range(0, len(turn), 700_000):  # each append under max_frame_bytes and max_pending_input_bytes
            await sock.send(_append(turn[i : i + 700_000], f"a{i // 700_000}"))
            # The next append only once this one is in the buffer: its 933 kB frame may still be on
            # its way (nothing pending yet), and two appends pending at once pass 1 MiB.
            taken = min(i + 700_000, len(turn))
            assert server.eventually(
                lambda: session.ledgers.input.received_bytes == taken and session.pending_input_bytes == 0, timeout=10
            )
        await sock.send({"type": "input_audio_buffer.commit"})
        assert server.eventually(lambda: session.journal.last_seq == 4, timeout=60)  # session.updated and the commit's three
        item_id = session.history[0]["id"]
        # One retrieve at a time, each handled before the next is sent; the client reads nothing
        # meanwhile (these waits block its loop), until the server closes it for reading too slowly.
        asked = 0
        while server.on_loop(lambda: session.transport) is not None and asked < 12:
            asked += 1
            await sock.send({"type": "conversation.item.retrieve", "item_id": item_id})
            assert server.eventually(lambda: session.journal.last_seq == 4 + asked, timeout=10)
        before = []
        with contextlib.suppress(websockets.ConnectionClosed):
            while True:
                before.append(await sock.recv(timeout=20))
        back = await server.connect(f"/v1/duplex?session_id={sock.session_id}", created=False)
        await back.send(
            {
                "type": "session.resume",
                "session_id": sock.session_id,
                "resume_token": sock.resume_token,
                "last_server_event_seq": before[-1]["server_event_seq"],
            }
        )
        resumed = await back.recv()
        after = [await back.recv(timeout=20) for _ in range(resumed["replayed"])]
        await back.close()
        return asked, sock.received, before, (sock.ws.close_code, sock.ws.close_reason), resumed, after

    with running() as server:
        asked, received, before, closed, resumed, after = run(scenario(server))
    assert closed == (4008, "slow consumer")
    assert resumed["type"] == "session.resumed" and resumed["last_server_event_seq"] == 4 + asked
    # The queued answer and the one that did not fit, at least: both replayed, nothing lost.
    assert resumed["replayed"] >= 2
    events = [e for e in received if "server_event_seq" in e] + after
    assert [e["server_event_seq"] for e in events] == list(range(1, 5 + asked))
    assert types_of(events) == ["session.updated", *COMMIT] + ["conversation.item.retrieved"] * asked
    assert {len(e["item"]["content"][0]["audio"]) for e in events[4:]} == {9_000_000}
