"""vLLM-Omni's duplex extension field by field, on raw sockets (serve/protocol/duplex.py,
serve/session/input_path.py): each field applied exactly, or refused by name; the GA route as it
was. test_vllm_omni_interop.py runs vLLM-Omni's own client over the same fields."""

from __future__ import annotations

import numpy as np
from servekit import COMMIT, RESPONSE_HEAD, RESPONSE_TAIL, Server, TalkingTone, run, running, silence, types_of, wav_pcm

from cadence_fx.serve.app import background_server
from cadence_fx.serve.plugins import ToneModel
from cadence_fx.serve.protocol import PCM24K, StreamResampler
from cadence_fx.serve.protocol import audio as wire_audio
from cadence_fx.serve.session import Limits

PCM16K = wire_audio.AudioFormat("pcm16", 16_000)
QUESTION = wire_audio.decode_samples(wav_pcm("question_24k.wav"), PCM24K)


async def _answer(sock, command: dict) -> dict:
    await sock.send(command)
    return await sock.recv()


def _error(event: dict) -> tuple[str, str, str | None]:
    assert event["type"] == "error", event
    return event["error"]["code"], event["error"]["message"], event["error"]["param"]


def test_the_ga_route_refuses_the_extension_fields_as_before(server):
    async def scenario():
        sock = await server.connect("/v1/realtime")
        answers = [
            await _answer(sock, {"type": "session.update", "session": {"sample_rate_hz": 16_000}}),
            await _answer(sock, {"type": "session.update", "session": {"extra_body": {}}}),
            await _answer(sock, {"type": "session.update", "session": {"input_audio_format": "pcm_f32le"}}),
            await _answer(sock, {"type": "barge_in"}),
        ]
        await sock.close()
        return answers

    answers = [_error(a) for a in run(scenario())]
    assert answers == [
        ("unknown_parameter", "Unknown parameter: 'session.sample_rate_hz'.", "session.sample_rate_hz"),
        ("unknown_parameter", "Unknown parameter: 'session.extra_body'.", "session.extra_body"),
        ("unsupported_audio_format", "unsupported audio format 'pcm_f32le'", "session.input_audio_format"),
        ("unsupported_in_realtime_mode", "barge_in needs a duplex connection (?duplex=1)", "type"),
    ]


def test_session_fields_are_applied_or_refused_by_name(server):
    async def scenario():
        sock = await server.connect("/v1/duplex")
        applied = await sock.update(
            {
                "input_audio_format": "pcm_f32le",
                "sample_rate_hz": 16_000,
                "audio": {"input": {"sample_rate_hz": 16_000}, "output": {"sample_rate_hz": 48_000}},
                "overlap_policy": "listen_only",
                "playback_commit_policy": "ack_only",
                "extra_body": {"auto_response": True, "force_listen_count": 0},
            }
        )
        refused = [
            await _answer(sock, {"type": "session.update", "session": patch})
            for patch in (
                {"ref_audio": "data:audio/wav;base64,AAAA"},
                {"temperature": 0.7},
                {"idle_timeout_s": 30},
                {"extra_body": {"top_p": 0.9}},
                {"extra_body": {"force_listen_count": 2}},
                {"sample_rate_hz": 11_025},
                {"sample_rate_hz": 16_000, "audio": {"input": {"sample_rate_hz": 24_000}}},
                {"overlap_policy": "talk_over"},
                {"input_audio_format": "opus"},
            )
        ]
        await sock.close()
        return applied["session"], refused

    session, refused = run(scenario())
    assert session["audio"]["input"]["format"] == {"type": "audio/pcm_f32le", "rate": 16_000}
    assert session["audio"]["output"]["format"] == {"type": "audio/pcm", "rate": 48_000}
    assert (session["input_audio_format"], session["output_audio_format"], session["sample_rate_hz"]) == (
        "pcm_f32le",
        "pcm16",
        16_000,
    )
    assert (session["overlap_policy"], session["playback_commit_policy"]) == ("listen_only", "ack_only")
    assert session["extra_body"] == {"auto_response": True, "force_listen_count": 0}
    assert session["capabilities"]["chunk_period_ms"] == 20
    assert [_error(r)[0::2] for r in refused] == [
        ("unsupported_feature", "session.ref_audio"),
        ("unsupported_feature", "session.temperature"),
        ("unsupported_feature", "session.idle_timeout_s"),
        ("unknown_parameter", "session.extra_body.top_p"),
        ("unsupported_feature", "session.extra_body.force_listen_count"),
        ("unsupported_audio_format", "session.audio.input.format"),
        ("invalid_value", "session.audio.input.sample_rate_hz"),
        ("invalid_value", "session.overlap_policy"),
        ("unsupported_audio_format", "session.audio.input.format"),
    ]


def test_an_append_in_another_format_is_converted_to_the_sessions_exactly(server):
    """A 24 kHz pcm16 session; appends that declare 16 kHz pcm16 and 16 kHz float32 are read in what
    they declare and resampled to 24 kHz, and the committed item holds exactly that."""
    x16 = StreamResampler(24_000, 16_000).process(QUESTION[:16_000])
    first, second = x16[:4000], x16[4000:]

    async def scenario():
        sock = await server.connect("/v1/duplex")
        await sock.no_vad()
        await sock.send(
            {
                "type": "input_audio_buffer.append",
                "format": "pcm16",
                "sample_rate_hz": 16_000,
                "audio": wire_audio.b64encode(wire_audio.encode_samples(first, PCM16K)),
                "duration_ms": 250,
            }
        )
        await sock.send(
            {
                "type": "input_audio_buffer.append",
                "format": "pcm_f32le",
                "sample_rate_hz": 16_000,
                "audio": wire_audio.b64encode(second.astype("<f4").tobytes()),
            }
        )
        await sock.send({"type": "input_audio_buffer.commit"})
        committed = (await sock.recv_until("conversation.item.done"))[0]
        retrieved = await _answer(sock, {"type": "conversation.item.retrieve", "item_id": committed["item_id"]})
        await sock.close()
        return retrieved["item"]["content"][0]["audio"]

    held = wire_audio.b64decode(run(scenario()))
    pcm16_at_16k = wire_audio.decode_samples(wire_audio.encode_samples(first, PCM16K), PCM16K)
    expected = wire_audio.encode_samples(
        StreamResampler(16_000, 24_000).process(pcm16_at_16k), PCM24K
    ) + wire_audio.encode_samples(StreamResampler(16_000, 24_000).process(second), PCM24K)
    assert held == expected


def test_appends_that_cannot_be_read_as_declared_are_refused(server):
    async def scenario():
        sock = await server.connect("/v1/duplex")
        pcm = wire_audio.encode_samples(QUESTION[:2400], PCM24K)
        answers = [
            await _answer(sock, {"type": "input_audio_buffer.append", "audio": wire_audio.b64encode(pcm), "duration_ms": 150}),
            await _answer(
                sock, {"type": "input_audio_buffer.append", "audio": wire_audio.b64encode(pcm), "sample_rate_hz": 12_345}
            ),
            await _answer(
                sock,
                {
                    "type": "input_audio_buffer.append",
                    "format": "pcm_f32le",
                    "audio": wire_audio.b64encode(np.array([0.5, np.nan], "<f4").tobytes()),
                },
            ),
            await _answer(sock, {"type": "input_audio_buffer.append", "audio": "AAAA", "video_frames": ["/9j/"]}),
        ]
        ledger = server.on_loop(lambda: server.session(sock.session_id).ledgers.input.received_bytes)
        await sock.close()
        return answers, ledger

    answers, received = run(scenario())
    assert [_error(a) for a in answers] == [
        (
            "invalid_value",
            "duration_ms 150 does not match the audio: 4800 bytes of pcm16 at 24000 Hz are 100.0 ms",
            "duration_ms",
        ),
        (
            "unsupported_audio_format",
            "sample rate 12345 Hz is not served; served rates: 8000, 16000, 22050, 24000, 32000, 44100, 48000",
            "sample_rate_hz",
        ),
        ("invalid_value", "pcm_f32le sample 1 is nan: samples must be finite and within [-1, 1]", "audio"),
        ("unsupported_feature", "video_frames are not served: tone hears audio only", "video_frames"),
    ]
    assert received == 0


def test_commit_final_and_response_create(server):
    pcm = wire_audio.encode_samples(QUESTION[:24_010], PCM24K)  # 1 s and 10 samples: a partial frame

    async def scenario():
        sock = await server.connect("/v1/duplex")
        await sock.update({"audio": {"input": {"turn_detection": None}}, "extra_body": {"auto_response": True}})
        await sock.append(pcm)
        await sock.send({"type": "input_audio_buffer.commit", "final": False})
        partial = await sock.recv_until("conversation.item.done")
        led = server.on_loop(lambda: server.session(sock.session_id).ledgers.to_dict()["input"])
        await sock.append(pcm)
        await sock.send({"type": "input_audio_buffer.commit"})  # final, auto_response
        auto = await sock.recv_until("response.done")
        await sock.append(pcm)
        await sock.send({"type": "input_audio_buffer.commit", "response_create": False})
        quiet = await sock.recv_until("conversation.item.done")
        await sock.send({"type": "session.heartbeat"})
        ack = await sock.recv()
        await sock.close()
        return partial, led, auto, quiet, ack

    partial, led, auto, quiet, ack = run(scenario())
    assert types_of(partial) == COMMIT and types_of(quiet) == COMMIT
    # Not final: the partial frame waits for the rest of the turn, unpadded.
    assert (led["padded_samples"], led["pending_samples"]) == (0, -(-24_010 * 16_000 // 24_000) % 320)
    assert types_of(auto) == COMMIT + RESPONSE_HEAD + RESPONSE_TAIL
    assert (ack["type"], set(ack)) == ("session.heartbeat_ack", {"type", "event_id", "session_id"})


class _Mute(ToneModel):
    """A model that answers with no audio at all (it listened)."""

    def open_stream(self):
        stream = super().open_stream()
        stream.step = lambda: None
        return stream


def test_a_response_without_audio_is_a_listen_decision(question_pcm):
    async def scenario(server):
        sock = await server.connect("/v1/duplex")
        events = await sock.reply_to(question_pcm, timeout=20)
        await sock.close()
        return events

    with background_server(_Mute, Limits(max_sessions=2)) as handle:
        events = run(scenario(Server(handle)))
    assert types_of(events, skip_deltas=False) == COMMIT + RESPONSE_HEAD + ["response.listen"] + RESPONSE_TAIL
    listen = events[len(COMMIT + RESPONSE_HEAD)]
    assert listen["response"] == {
        "object": "realtime.response",
        "id": listen["response_id"],
        "status": "listening",
        "metadata": None,
    }
    assert events[-1]["response"]["status"] == "completed"


def test_barge_in_input_cancel_text_and_turn_signal_commands(server):
    async def scenario():
        sock = await server.connect("/v1/duplex")
        await sock.no_vad()
        answers = [
            await _answer(sock, {"type": "barge_in", "event_id": "b1"}),
            await _answer(sock, {"type": "input.text.append", "text": "hello"}),
            await _answer(sock, {"type": "turn.signal", "event": "session.heartbeat"}),
            await _answer(sock, {"type": "turn.signal", "event": "nope"}),
        ]
        await sock.append(wav_pcm("question_24k.wav")[:9600])
        cleared = await _answer(sock, {"type": "input.cancel"})
        signalled = await _answer(
            sock, {"type": "turn.signal", "event": "session.update", "payload": {"session": {"instructions": "by signal"}}}
        )
        await sock.close()
        return answers, cleared, signalled

    answers, cleared, signalled = run(scenario())
    assert [_error(a) for a in answers] == [
        ("response_cancel_not_active", "Barge-in failed: no active response found", "type"),
        ("unsupported_feature", "text input is not served: tone hears audio only", "type"),
        (
            "unsupported_feature",
            "turn.signal does not carry 'session.heartbeat'; it carries barge_in, input.cancel, "
            "response.cancel, session.update, conversation.item.create, conversation.item.delete, "
            "conversation.item.truncate, conversation.item.retrieve",
            "event",
        ),
        ("unknown_event_type", "unknown event type 'nope'", "payload.type"),
    ]
    assert (cleared["type"], cleared["audio_bytes"]) == ("input_audio_buffer.cleared", 9600)
    assert (signalled["type"], signalled["session"]["instructions"]) == ("session.updated", "by signal")


def test_listen_only_keeps_the_reply_playing_over_speech(question_pcm):
    interrupt = wav_pcm("interrupt_24k.wav")

    async def scenario(server, policy):
        sock = await server.connect("/v1/duplex")
        await sock.update({"overlap_policy": policy})
        await sock.append(question_pcm + silence(600))
        await sock.recv_until("response.output_audio.delta")
        await sock.append(interrupt[:9600])
        during = await sock.recv_until("response.done", timeout=20)
        await sock.close()
        return during

    with running(step_delay_s=0.05) as server:
        kept = run(scenario(server, "listen_only"))
        cut = run(scenario(server, "barge_in_on_speech"))
    assert types_of(kept) == ["input_audio_buffer.speech_started", *RESPONSE_TAIL]
    assert kept[-1]["response"]["status"] == "completed"
    assert types_of(cut) == ["input_audio_buffer.speech_started", "barge_in", *RESPONSE_TAIL]


def test_autostart_0_creates_the_session_at_the_first_command_and_none_for_a_resume(server):
    async def scenario():
        first = await server.connect("/v1/realtime?duplex=1&model=tone&autostart=0", created=False)
        with_nothing = await first.recv_all(0.3)
        await first.send({"type": "session.update", "session": {"instructions": "hi"}})
        opened = [await first.recv() for _ in range(3)]
        session_id, token = opened[0]["session"]["id"], opened[0]["resume_token"]
        await first.close()
        count = server.on_loop(lambda: len(server.handle.manager.sessions))
        back = await server.connect("/v1/realtime?duplex=1&model=tone&autostart=0", created=False)
        await back.send(
            {"type": "session.resume", "session_id": session_id, "resume_token": token, "last_received_server_event_seq": 1}
        )
        resumed = await back.recv()
        after = server.on_loop(lambda: len(server.handle.manager.sessions))
        await back.send({"type": "session.close"})
        await back.recv_until("session.closed")
        await back.close()
        return with_nothing, opened, resumed, count, after

    await_nothing, opened, resumed, count, after = run(scenario())
    assert await_nothing == []
    assert [e["type"] for e in opened] == ["session.created", "rate_limits.updated", "session.updated"]
    # The opening update is applied before the session is announced: session.created carries it.
    assert opened[0]["session"] == opened[2]["session"] and opened[0]["session"]["instructions"] == "hi"
    assert (resumed["type"], resumed["replayed"], resumed["session"]["instructions"]) == ("session.resumed", 0, "hi")
    assert after == count


def test_playback_ack_in_either_shape(server, question_pcm):
    async def scenario():
        sock = await server.connect("/v1/duplex")
        done = (await sock.reply_to(question_pcm, timeout=20))[-1]
        rid = done["response_id"]
        item = done["response"]["output"][0]["id"]
        answers = [
            await _answer(sock, {"type": "playback.ack", "played_ms": 500, "committed_ms": 600}),
            await _answer(sock, {"type": "playback.ack", "played_ms": 500, "item_id": "item_other"}),
            await _answer(sock, {"type": "playback.ack", "played_ms": 500, "audio_end_ms": 400}),
            await _answer(sock, {"type": "playback.ack", "response_id": rid}),
        ]
        for ack in (
            {"played_ms": 700, "committed_ms": 650, "item_id": item},
            {"response_id": rid, "audio_end_ms": 900},
            {"played_ms": 99_999.5},
        ):
            await sock.send({"type": "playback.ack", **ack})
        server.eventually(lambda: server.session(sock.session_id).ledgers.playback.acked_ms == 2_240)
        acked = server.on_loop(lambda: server.session(sock.session_id).ledgers.playback.acked_ms)
        await sock.close()
        return rid, item, answers, acked

    rid, item, answers, acked = run(scenario())
    assert item == f"item_{rid}"
    assert [_error(a) for a in answers] == [
        ("invalid_value", "committed_ms 600 is past played_ms 500", "committed_ms"),
        ("invalid_value", f"item 'item_other' is not response '{rid}''s ('{item}')", "item_id"),
        ("invalid_value", "audio_end_ms 400 and played_ms 500 disagree", "played_ms"),
        ("missing_field", "playback.ack requires field 'audio_end_ms' (or 'played_ms')", "audio_end_ms"),
    ]
    assert acked == 2_240  # capped at the response's audio


def test_text_a_stream_produces_is_sent_as_its_transcript(question_pcm):
    async def scenario(server, path):
        sock = await server.connect(path)
        events = await sock.reply_to(question_pcm, timeout=20)
        await sock.close()
        return events

    with background_server(TalkingTone, Limits(max_sessions=2)) as handle:
        duplex = run(scenario(Server(handle), "/v1/duplex"))
        plain = run(scenario(Server(handle), "/v1/realtime"))
    said = "".join(f" w{i}" for i in range(56))
    for events in (duplex, plain):
        kinds = [e["type"] for e in events if e["type"] != "response.speak"]
        reply = kinds[kinds.index("response.content_part.added") + 1 : kinds.index("response.output_audio.done")]
        assert reply == ["response.output_audio.delta", "response.output_audio_transcript.delta"] * 56
        assert "".join(e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta") == said
        assert types_of(events)[-len(RESPONSE_TAIL) - 1 :] == [
            "response.output_audio.done",
            "response.output_audio_transcript.done",
            *RESPONSE_TAIL[1:],
        ]
        done = next(e for e in events if e["type"] == "response.output_audio_transcript.done")
        assert done["transcript"] == events[-1]["response"]["output"][0]["content"][0]["transcript"] == said
