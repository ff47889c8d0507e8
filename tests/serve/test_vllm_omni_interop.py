"""vLLM-Omni 0.30.0's own ``DuplexClient``, unmodified, in realistic sessions against the service.

The client is the wheel's (``.ci/install``; imported through ``vllm_omni_shim``), with its default
configuration and its PersonaPlex and MiniCPM-o 4.5 presets. Each session opens as the client
does (``?duplex=1&model=...&autostart=0``, then ``session.update``), streams a spoken question,
commits, reads the response's audio through the client's response handles and acks its playback;
the default session also barges in, cancels, has its TCP connection dropped mid-reply (by a proxy
between the two, so the client sees a real connection loss) and resumes, and closes. Every session
ends with 0 errors, and where the protocol fixes the events, their exact sequence is asserted.
"""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest
import vllm_omni_shim as vo
from servekit import (
    COMMIT,
    RESPONSE_HEAD,
    RESPONSE_TAIL,
    Server,
    TalkingTone,
    running,
    tone_reply_pcm,
    types_of,
    wav_pcm,
)

from cadence_fx.serve.app import background_server
from cadence_fx.serve.plugins.moshi import MoshiPlugin
from cadence_fx.serve.protocol import StreamResampler
from cadence_fx.serve.protocol import audio as wire_audio
from cadence_fx.serve.session import Limits

QUESTION = wire_audio.decode_samples(wav_pcm("question_24k.wav"), wire_audio.PCM24K)
QUESTION_16K = wire_audio.encode_samples(
    StreamResampler(24_000, 16_000).process(QUESTION), wire_audio.AudioFormat("pcm16", 16_000)
)
REPLY_CHUNKS = 56  # the tone model's reply to the question (test_server_flow.py)
# Events that are not the session's history: the connection's own, and the client's synthetic one.
CONNECTION_EVENTS = {
    "session.heartbeat",
    "session.heartbeat_ack",
    "session.resumed",
    "connection.resumed",
    "session.closed",
    "rate_limits.updated",
    "session.updated",
}


class DroppingProxy:
    """A TCP proxy in front of the server whose ``drop`` aborts every connection through it: the
    client sees its socket die mid-stream, as on a network failure."""

    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self.writers: list[asyncio.StreamWriter] = []
        self.connections = 0
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"ws://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        self.writers += [writer, up_writer]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            with contextlib.suppress(Exception):
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def drop(self) -> None:
        for writer in self.writers:
            writer.transport.abort()
        self.writers.clear()

    async def stop(self) -> None:
        self.drop()
        if self._server is not None:
            self._server.close()


async def next_response(client) -> object:
    async for handle in client.responses():
        return handle
    raise AssertionError("the session ended without a response")


async def play(client, handle, ack: bool = True) -> bytes:
    """The response's audio, acked as the client would while playing it."""
    chunks = []
    async for chunk in handle.audio():
        chunks.append(chunk)
        if ack:
            await client.ack_playback(handle.played_ms, response_id=handle.response_id)
    return b"".join(chunks)


async def settled(server: Server, read, expected, timeout: float = 10.0):
    """``read()`` on the server's loop, polled until it gives ``expected`` (the client's last
    commands may still be in flight) or ``timeout`` passes; the last value read."""
    deadline = asyncio.get_running_loop().time() + timeout
    while (value := server.on_loop(read)) != expected and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)
    return value


def journaled(events: list[dict]) -> list[dict]:
    return [e for e in events if e["type"] not in CONNECTION_EVENTS]


def turns(events: list[dict]) -> list[list[dict]]:
    """The history split at each commit (one turn each)."""
    out: list[list[dict]] = []
    for event in journaled(events):
        if event["type"] == "input_audio_buffer.committed":
            out.append([])
        out[-1].append(event)
    return out


def status_of(turn: list[dict]) -> tuple[str, dict | None]:
    done = turn[-1]["response"]
    return done["status"], done["status_details"]


def test_default_client_session_append_commit_ack_barge_in_cancel_drop_resume_close():
    async def scenario(server: Server):
        proxy = DroppingProxy(server.handle.host, server.handle.port)
        url = await proxy.start()
        collector = vo.duplex.EventCollector()
        client = vo.duplex.DuplexClient(url, model="tone", heartbeat_interval_s=0.2)
        async with client:
            consumer = asyncio.create_task(collector.consume(client))
            session_id = client.session_id
            # 1: a whole reply, played and acked.
            await client.stream_pcm(QUESTION_16K, realtime=False)
            await client.commit()
            handle = await next_response(client)
            whole = await play(client, handle)
            acked = await settled(server, lambda: server.session(session_id).ledgers.playback.acked_ms, 2_240)
            # 2: the client barges in after the reply's first chunk.
            await client.stream_pcm(QUESTION_16K, realtime=False)
            await client.commit()
            barged = await next_response(client)
            async for _ in barged.audio():
                await client.send({"type": "barge_in"})
                break
            await barged.wait(5)
            # 3: the client cancels after the first chunk.
            await client.stream_pcm(QUESTION_16K, realtime=False)
            await client.commit()
            cancelled = await next_response(client)
            async for _ in cancelled.audio():
                await client.cancel_response()
                break
            await cancelled.wait(5)
            # 4: the TCP connection drops mid-reply; the client resumes on its own and the reply
            # plays on, whole.
            await client.stream_pcm(QUESTION_16K, realtime=False)
            await client.commit()
            resumed = await next_response(client)
            chunks = []
            async for chunk in resumed.audio():
                chunks.append(chunk)
                if len(chunks) == 3:
                    proxy.drop()
            await client.ack_playback(resumed.played_ms, committed_ms=resumed.played_ms)
            await asyncio.sleep(0.5)  # a few heartbeats on the resumed connection
            info = client.session_info
            await client.close()
        await consumer
        await proxy.stop()
        return (
            session_id,
            client.session_id,
            whole,
            acked,
            handle,
            barged,
            cancelled,
            resumed,
            b"".join(chunks),
            collector.events,
            info,
            proxy.connections,
        )

    with running(step_delay_s=0.02) as server:
        (opened, kept, whole, acked, first, barged, cancelled, resumed, after_drop, events, info, connections) = asyncio.run(
            asyncio.wait_for(scenario(server), 60)
        )
        server.eventually(lambda: server.handle.manager.ended == 1, timeout=30)  # the close, on the server's loop
        ended = server.handle.manager.ended
        # counted once the close reached the server's loop (counted inside the scenario, it came late under load)
        left = server.on_loop(lambda: len(server.handle.manager.sessions))
    assert [e for e in events if e["type"] == "error"] == []
    assert kept == opened and connections == 2 and ended == 1 and left == 0  # one session, resumed, closed
    assert whole == after_drop == tone_reply_pcm(REPLY_CHUNKS)
    assert acked == 2_240  # the client's acks: {played_ms, committed_ms, response_id}
    assert (first.decision, barged.decision, cancelled.decision, resumed.decision) == ("speak",) * 4
    history = turns(events)
    assert [types_of(turn) for turn in history] == [
        COMMIT + RESPONSE_HEAD + RESPONSE_TAIL,
        COMMIT + RESPONSE_HEAD + ["barge_in"] + RESPONSE_TAIL,
        COMMIT + RESPONSE_HEAD + RESPONSE_TAIL,
        COMMIT + RESPONSE_HEAD + RESPONSE_TAIL,
    ]
    for turn in history:  # response.speak, once, just before the first audio
        kinds = [e["type"] for e in turn]
        assert kinds.count("response.speak") == 1
        assert kinds[kinds.index("response.speak") + 1] == "response.output_audio.delta"
    assert [status_of(turn) for turn in history] == [
        ("completed", None),
        ("cancelled", {"type": "cancelled", "reason": "client_barge_in"}),
        ("cancelled", {"type": "cancelled", "reason": "client_cancelled"}),
        ("completed", None),
    ]
    # Every journaled event reached the client once, in order, across the drop.
    seqs = [e["server_event_seq"] for e in events if "server_event_seq" in e]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    kinds = [e["type"] for e in events]
    assert (kinds.count("connection.resumed"), kinds.count("session.resumed"), kinds[-1]) == (1, 1, "session.closed")
    assert kinds.count("session.heartbeat_ack") >= 2
    deltas = [e for e in events if e["type"] == "response.output_audio.delta"]
    assert {(d["format"], d["sample_rate_hz"]) for d in deltas} == {("pcm16", 24_000)}
    # The session the client holds: its 16 kHz input, and the frame it paces its units by.
    assert vo.duplex.chunk_period_ms([{"session": info}]) == 20  # the tone model's frame
    assert (info["sample_rate_hz"], info["audio"]["input"]["format"]) == (16_000, {"type": "audio/pcm", "rate": 16_000})
    assert (info["audio"]["output"]["sample_rate_hz"], info["extra_body"]) == (24_000, {"auto_response": True})


def test_personaplex_preset_streams_float32_at_24k_and_hears_it_exactly():
    config = vo.personaplex.create_duplex_session_config()

    async def scenario(server: Server):
        collector = vo.duplex.EventCollector()
        async with vo.duplex.DuplexClient(server.handle.ws_url, model="tone", config=config) as client:
            consumer = asyncio.create_task(collector.consume(client))
            await client.stream_pcm(QUESTION.astype("<f4").tobytes(), realtime=False)
            await client.commit()
            handle = await next_response(client)
            audio = await play(client, handle)
            info = client.session_info
            received = server.on_loop(lambda: server.session(client.session_id).ledgers.input.received_bytes)
            await client.close()
        await consumer
        return audio, info, received, collector.events

    with running() as server:
        audio, info, received, events = asyncio.run(asyncio.wait_for(scenario(server), 60))
    assert [e for e in events if e["type"] == "error"] == []
    # float32 samples equal to the int16 question's: the model hears the same audio, so the same reply.
    assert audio == tone_reply_pcm(REPLY_CHUNKS)
    assert received == 4 * len(QUESTION)
    assert (info["input_audio_format"], info["audio"]["input"]["format"]) == (
        "pcm_f32le",
        {"type": "audio/pcm_f32le", "rate": 24_000},
    )
    assert (info["audio"]["output"]["voice"], info["instructions"]) == ("NATF2.pt", "")
    assert [types_of(turn) for turn in turns(events)] == [COMMIT + RESPONSE_HEAD + RESPONSE_TAIL]


def test_minicpmo_preset_with_ack_only_playback_and_collected_acks():
    config = vo.minicpmo.create_duplex_session_config()

    async def scenario(server: Server):
        collector = vo.duplex.EventCollector()
        async with vo.duplex.DuplexClient(server.handle.ws_url, model="tone", config=config) as client:
            consumer = asyncio.create_task(collector.consume(client))
            for _ in range(2):
                await client.stream_pcm(QUESTION_16K, realtime=False)
                await client.commit()
                handle = await next_response(client)
                await play(client, handle, ack=False)
                await vo.duplex.wait_for_condition(
                    lambda: collector.response_is_done(handle.response_id), timeout_s=10, label="the collector"
                )
                # The benchmark's shorthand: every collected response acked, naming its item.
                await vo.duplex.acknowledge_collected_playback(client, collector)
            acked = await settled(server, lambda: server.session(client.session_id).ledgers.playback.acked_ms, 4_480)
            info = client.session_info
            await client.close()
        await consumer
        return acked, info, collector.events

    with running() as server:
        acked, info, events = asyncio.run(asyncio.wait_for(scenario(server), 60))
    assert [e for e in events if e["type"] == "error"] == []
    assert acked == 2 * 2_240
    assert (info["overlap_policy"], info["playback_commit_policy"]) == ("listen_only", "ack_only")
    assert info["extra_body"] == {"auto_response": True, "force_listen_count": 0}
    assert [types_of(turn) for turn in turns(events)] == [COMMIT + RESPONSE_HEAD + RESPONSE_TAIL] * 2


@pytest.mark.usefixtures("one_torch_thread")  # the reference and the worker on one thread
def test_default_client_against_moshi_tiny_with_a_dropped_connection():
    from test_moshi_plugin_text import spoken, vendor_slot

    async def scenario(server: Server):
        proxy = DroppingProxy(server.handle.host, server.handle.port)
        url = await proxy.start()
        collector = vo.duplex.EventCollector()
        async with vo.duplex.DuplexClient(url, model="moshi-tiny") as client:
            consumer = asyncio.create_task(collector.consume(client))
            await client.stream_pcm(QUESTION_16K, realtime=False)
            await client.commit()
            handle = await next_response(client)
            chunks = []
            async for chunk in handle.audio():
                chunks.append(chunk)
                if len(chunks) == 2:
                    proxy.drop()
                await client.ack_playback(handle.played_ms, response_id=handle.response_id)
            info = client.session_info
            await client.close()
        await consumer
        await proxy.stop()
        return b"".join(chunks), info, collector.events, proxy.connections

    served = MoshiPlugin(max_reply_frames=8, record=True)
    with background_server(lambda: served, Limits(max_sessions=2)) as handle:
        audio, info, events, connections = asyncio.run(asyncio.wait_for(scenario(Server(handle)), 120))
        # the client's close reaches the server's loop after the client returns (later under load)
        Server(handle).eventually(lambda: handle.manager.ended == 1, timeout=30)
        ended = handle.manager.ended
    said = [text for text in spoken(vendor_slot(served)[2][-8:]) if text]  # the reply's text, frame by frame
    assert [e for e in events if e["type"] == "error"] == []
    assert (connections, ended) == (2, 1)
    assert len(audio) == 8 * 1920 * 2  # 8 reply frames of 80 ms at 24 kHz, pcm16
    assert vo.duplex.chunk_period_ms([{"session": info}]) == 80
    transcript = ["response.output_audio_transcript.delta"] * len(said)
    tail = RESPONSE_TAIL[:1] + ["response.output_audio_transcript.done"] + RESPONSE_TAIL[1:]
    assert [types_of(turn) for turn in turns(events)] == [COMMIT + RESPONSE_HEAD + transcript + tail]
    assert [e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta"] == said
    seqs = [e["server_event_seq"] for e in events if "server_event_seq" in e]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


def test_the_client_reads_the_transcript_of_a_model_that_speaks_text():
    async def scenario(server: Server):
        async with vo.duplex.DuplexClient(server.handle.ws_url, model="tone") as client:
            await client.stream_pcm(QUESTION_16K, realtime=False)
            await client.commit()
            handle = await next_response(client)
            audio = await play(client, handle)
            await client.close()
        return audio, handle.transcript

    with background_server(TalkingTone, Limits(max_sessions=2)) as handle:
        audio, transcript = asyncio.run(asyncio.wait_for(scenario(Server(handle)), 60))
    assert audio == tone_reply_pcm(REPLY_CHUNKS)
    assert transcript == "".join(f" w{i}" for i in range(REPLY_CHUNKS))


@pytest.mark.usefixtures("one_torch_thread")  # the reference and the worker on one thread
def test_the_client_reads_moshi_tinys_transcript_the_text_of_its_tokens():
    from test_moshi_plugin_text import spoken, vendor_slot

    async def scenario(server: Server):
        async with vo.duplex.DuplexClient(server.handle.ws_url, model="moshi-tiny") as client:
            await client.stream_pcm(QUESTION_16K, realtime=False)
            await client.commit()
            handle = await next_response(client)
            audio = await play(client, handle)
            await client.close()
        return audio, handle.transcript

    served = MoshiPlugin(max_reply_frames=8, record=True)
    with background_server(lambda: served, Limits(max_sessions=2)) as handle:
        audio, transcript = asyncio.run(asyncio.wait_for(scenario(Server(handle)), 120))
    _, want_pcm, tokens = vendor_slot(served)
    assert audio == wire_audio.encode_samples(np.concatenate(want_pcm[-8:]), wire_audio.PCM24K)  # the reply: the last 8 frames
    assert transcript == "".join(spoken(tokens[-8:]))
    assert transcript != ""
