"""``run_client`` and ``cadence-fx client``: stream a WAV file through a session, write the reply
WAV, say in one sentence why a connection failed, keep whatever reply arrived."""

from __future__ import annotations

import asyncio
import threading
import wave
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from servekit import AUDIO, running, tone_reply_pcm
from tlskit import self_signed

from cadence_fx.cli import main
from cadence_fx.serve.app import background_server, free_port
from cadence_fx.serve.client import ClientError, route_url, run_client, stream_wav
from cadence_fx.serve.plugins import ToneModel
from cadence_fx.serve.session import Limits

# The question's last word ends near 4.05 s; 500 ms of silence later VAD ends the turn at 4,550 ms,
# which is 227.5 frames of 20 ms at 16 kHz: the 227 frames wholly before it (72,640 samples) give
# 54,480 reply samples, 57 tone chunks of 960 (2.28 s).
QUESTION_REPLY_CHUNKS = 57


def _wav(path) -> tuple[tuple[int, int, int], bytes]:
    with wave.open(str(path)) as wav:
        return (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()), wav.readframes(wav.getnframes())


def test_run_client_streams_a_question_and_writes_the_reply(tmp_path, capsys):
    out = tmp_path / "reply.wav"
    with running() as server:
        report = run_client(server.handle.ws_url, AUDIO / "question_24k.wav", out)
    params, pcm = _wav(out)
    assert params == (1, 2, 24_000) and pcm == tone_reply_pcm(QUESTION_REPLY_CHUNKS)
    assert (report.turns, report.responses_done, report.errors, report.failure) == (1, 1, [], None)
    assert report.session_id.startswith("sess_") and len(report.first_audio_latency_s) == 1
    progress = capsys.readouterr().err
    assert "sent   5.4/5.4 s | turns 1 | replies 1 | reply audio  2.28 s" in progress


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("ws://h:1", ("ws://h:1/v1/duplex", True)),
        ("http://h:1/", ("ws://h:1/v1/duplex", True)),
        ("https://h:1", ("wss://h:1/v1/duplex", True)),
        ("wss://h:1/v1/realtime", ("wss://h:1/v1/realtime", False)),
        ("ws://h:1/v1/realtime?duplex=1", ("ws://h:1/v1/realtime?duplex=1", True)),
        ("ws://h:1/v1/duplex/", ("ws://h:1/v1/duplex", True)),
    ],
)
def test_either_routes_url_or_the_servers_base_is_accepted(given, expected):
    assert route_url(given) == expected


@pytest.mark.parametrize(
    ("given", "sentence"),
    [
        ("ftp://h:1", "'ftp://h:1' is not a server URL: expected ws://HOST:PORT (or wss://, http://, https://)"),
        ("127.0.0.1:8000", "'127.0.0.1:8000' is not a server URL: expected ws://HOST:PORT (or wss://, http://, https://)"),
        (
            "ws://h:1/v1/models",
            "'ws://h:1/v1/models' names no realtime route: expected the server's base URL, "
            "or one ending in /v1/realtime or /v1/duplex",
        ),
    ],
)
def test_a_wrong_url_is_one_sentence(given, sentence):
    with pytest.raises(ClientError) as info:
        route_url(given)
    assert str(info.value) == sentence


def test_the_realtime_route_runs_a_tier1_session_to_the_end(tmp_path):
    out = tmp_path / "reply.wav"
    with running() as server:
        report = run_client(server.handle.http_url + "/v1/realtime", AUDIO / "question_24k.wav", out)
    assert _wav(out)[1] == tone_reply_pcm(QUESTION_REPLY_CHUNKS) and (report.responses_done, report.errors) == (1, [])


def test_a_refused_connection_is_one_sentence_and_exit_code_1(tmp_path, capsys):
    port = free_port()
    code = main(
        ["client", "--url", f"ws://127.0.0.1:{port}", "--wav", str(AUDIO / "question_24k.wav"), "--out", str(tmp_path / "r.wav")]
    )
    err = capsys.readouterr().err
    assert code == 1 and err == (
        f"cadence-fx client: could not connect to ws://127.0.0.1:{port}/v1/duplex: connection refused "
        "(is `cadence-fx serve` running there?)\n"
    )


class _NotFound(BaseHTTPRequestHandler):
    """An HTTP/1.1 server with no routes at all."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.send_error(404)

    def log_message(self, *args) -> None:
        pass


def test_a_server_without_the_route_is_one_sentence(tmp_path, capsys):
    port = free_port()
    http = ThreadingHTTPServer(("127.0.0.1", port), _NotFound)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        code = main(
            [
                "client",
                "--url",
                f"ws://127.0.0.1:{port}",
                "--wav",
                str(AUDIO / "question_24k.wav"),
                "--out",
                str(tmp_path / "r.wav"),
            ]
        )
    finally:
        http.shutdown()
        http.server_close()
    assert code == 1 and capsys.readouterr().err == (
        f"cadence-fx client: ws://127.0.0.1:{port}/v1/duplex refused the WebSocket handshake with HTTP 404 "
        "(no such route: is a cadence-fx serve listening there?)\n"
    )


def test_plain_ws_against_a_tls_server_and_an_untrusted_certificate_are_one_sentence_each(tmp_path, capsys):
    tls = self_signed(tmp_path)
    with background_server(lambda: ToneModel(), Limits(max_sessions=4), tls=tls) as handle:
        plain = handle.ws_url.replace("wss://", "ws://")
        codes = [
            main(["client", "--url", url, "--wav", str(AUDIO / "question_24k.wav"), "--out", str(tmp_path / "r.wav")])
            for url in (plain, handle.ws_url)
        ]
    lines = capsys.readouterr().err.splitlines()
    assert codes == [1, 1] and len(lines) == 2
    assert lines[0].startswith(f"cadence-fx client: {plain}/v1/duplex did not answer as a WebSocket server (")
    assert lines[0].endswith("): ws:// against a TLS server?")
    assert lines[1] == (
        f"cadence-fx client: the certificate of {handle.ws_url}/v1/duplex is not trusted (self-signed certificate); "
        "SSL_CERT_FILE=cert.pem trusts a self-signed one"
    )


def test_wss_with_a_trusted_self_signed_certificate_and_the_cli_summary(tmp_path, capsys, monkeypatch):
    tls = self_signed(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", tls.certfile)
    out = tmp_path / "reply.wav"
    with background_server(lambda: ToneModel(), Limits(max_sessions=4), tls=tls) as handle:
        code = main(["client", "--url", handle.ws_url, "--wav", str(AUDIO / "question_24k.wav"), "--out", str(out)])
    last = capsys.readouterr().err.splitlines()[-1]
    assert code == 0 and _wav(out)[1] == tone_reply_pcm(QUESTION_REPLY_CHUNKS)
    assert last.startswith(f"wrote {out}: 1 replies, 2.28 s of reply audio; first audio ")
    assert last.endswith(" ms after the turn ended (median of 1)")


def test_a_session_that_ends_mid_reply_still_writes_what_arrived(tmp_path):
    out = tmp_path / "reply.wav"
    # The reply takes 57 x 50 ms; the session may live 1.5 s: it expires mid-reply.
    with running(Limits(max_sessions=4, max_session_s=1.5), step_delay_s=0.05) as server:
        report = asyncio.run(stream_wav(server.handle.ws_url, AUDIO / "question_24k.wav", out, realtime=False, progress=None))
    pcm = _wav(out)[1]
    assert 0 < len(pcm) < len(tone_reply_pcm(QUESTION_REPLY_CHUNKS)) and tone_reply_pcm(QUESTION_REPLY_CHUNKS).startswith(pcm)
    assert report.failure == "the server closed the connection (4001)" and report.responses_done == 0
    assert report.summary(out).endswith("; ended early: the server closed the connection (4001)")
