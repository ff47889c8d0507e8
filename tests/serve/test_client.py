"""``run_client``: stream a WAV file in real time through a session and write the reply WAV."""

from __future__ import annotations

import wave

from servekit import AUDIO, running, tone_reply_pcm

from cadence_fx.serve.client import run_client


def test_run_client_streams_a_question_and_writes_the_reply(tmp_path, capsys):
    out = tmp_path / "reply.wav"
    with running() as server:
        report = run_client(server.handle.ws_url, AUDIO / "question_24k.wav", out)
    with wave.open(str(out)) as wav:
        params = (wav.getnchannels(), wav.getsampwidth(), wav.getframerate())
        pcm = wav.readframes(wav.getnframes())
    # The last word ends near 4.07 s; 500 ms of silence later VAD commits the turn at the end of the
    # 100 ms append that reaches 4.6 s: 73,600 samples at 16 kHz -> 230 frames -> 58 reply chunks.
    assert params == (1, 2, 24_000) and pcm == tone_reply_pcm(58)
    assert (report.turns, report.responses_done, report.errors) == (1, 1, [])
    assert report.session_id.startswith("sess_") and len(report.first_audio_latency_s) == 1
    progress = capsys.readouterr().err
    assert "sent   5.4/5.4 s | turns 1 | replies 1 | reply audio  2.32 s" in progress
