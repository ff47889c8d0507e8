"""A short load run (8 sessions x 3 s, real time): every input byte and output sample accounted.
The 8 x 60 s run with latency percentiles is bench/serve_load.py."""

from __future__ import annotations

import numpy as np
import pytest
from loadgen import run_load, speech_pattern
from servekit import run, running, tone_reply_pcm

from cadence_fx.serve.plugins import tone
from cadence_fx.serve.protocol import PCM24K
from cadence_fx.serve.protocol import audio as wire_audio
from cadence_fx.serve.session import Limits


def test_eight_sessions_for_three_seconds_lose_nothing():
    pcm = speech_pattern(3.0)  # bursts at 0-0.8 s and 1.5-2.3 s; VAD ends them at 1.3 s and 2.8 s

    with running(Limits(max_sessions=8, max_sessions_per_client=8)) as server:
        results = run(run_load(server.handle.ws_url + "/v1/duplex", pcm, sessions=8))
        assert server.eventually(lambda: not server.handle.manager.sessions)
        ledgers = server.on_loop(lambda: dict(server.handle.manager.ended_ledgers))
    for result in results:
        ledger = ledgers[result.session_id]
        ledger.check()
        assert (ledger.input.received_bytes, ledger.input.committed_bytes, ledger.input.rejected_bytes) == (
            144_000,
            144_000,
            0,
        )
        # 3 s at 16 kHz is exactly 150 frames; nothing padded, nothing dropped.
        assert (ledger.input.fed_samples, ledger.input.padded_samples, ledger.input.discarded_samples) == (48_000, 0, 0)
        assert (ledger.playback.generated_samples, ledger.playback.delivered_samples) == (36 * 960, 36 * 960)
        assert (ledger.playback.dropped_samples, ledger.responses.completed, ledger.responses.cancelled) == (0, 2, 0)
        assert result.errors == []
        assert result.accounted
        assert (result.turns, result.turns_ended_during_a_reply) == (2, 0)
        assert result.appended_bytes == result.committed_bytes == len(pcm) == 144_000
        # Each turn is committed at its VAD stop, inside the 200 ms append that saw it: 1.3 s and
        # 1.5 s of audio (both whole 20 ms frames, all fed to the turn); the last 0.2 s at the end.
        assert [r.turn_bytes for r in result.replies] == [62_400, 72_000]
        chunks = [tone.reply_chunks(reply.turn_bytes // 2 * 2 // 3) for reply in result.replies]
        assert chunks == [17, 19]
        assert [bytes(reply.audio) for reply in result.replies] == [tone_reply_pcm(n) for n in chunks]


def test_a_turn_that_ends_while_the_last_reply_plays_is_counted_and_gets_no_response_of_its_own():
    # Speech 0-2.0 s, then 0.3 s more at 2.6 s: the VAD ends the turns at 2.5 s and 3.4 s. The first
    # reply (2.5 s of tone) is paced to real time (reply_lead_s), so it still plays at 3.4 s.
    rate = PCM24K.rate
    t = np.arange(4 * rate) / rate
    on = (t < 2.0) | ((t >= 2.6) & (t < 2.9))
    pcm = wire_audio.encode_samples((0.1 * np.sin(2 * np.pi * 220 * t) * on).astype(np.float32), PCM24K)

    with running(Limits(max_sessions=1, reply_lead_s=0.1)) as server:
        (result,) = run(run_load(server.handle.ws_url + "/v1/duplex", pcm, sessions=1))
    assert result.errors == [] and result.accounted
    assert (result.turns, result.turns_ended_during_a_reply, len(result.replies)) == (2, 1, 1)


def test_a_session_the_server_refuses_fails_the_load_saying_what_the_server_said():
    async def scenario(server):
        held = await server.connect("/v1/duplex")
        try:
            await run_load(server.handle.ws_url + "/v1/duplex", speech_pattern(1.0), sessions=1)
        finally:
            await held.send({"type": "session.close"})
            await held.recv_until("session.closed")

    with running(Limits(max_sessions=1)) as server:
        with pytest.raises(RuntimeError) as refused:
            run(scenario(server))
    message = str(refused.value)
    assert message.startswith("the server did not open a session: its first event was {'type': 'error', ")
    assert "'code': 'resource_exhausted'" in message and "all 1 session slots are in use" in message
