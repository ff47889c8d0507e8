"""``cadence-fx serve``: its ready line comes once the model is loaded and /health answers, over
plain HTTP or TLS; bad TLS options are one sentence."""

from __future__ import annotations

import ssl
import subprocess
import sys

import httpx
import pytest
from tlskit import self_signed

from cadence_fx.cli import main
from cadence_fx.serve.app import free_port


def _serve_until_ready(*options: str) -> tuple[list[str], dict]:
    """Starts the CLI server, reads stderr up to its ready line, asks /health, stops it."""
    port = free_port()
    command = [sys.executable, "-m", "cadence_fx.cli", "serve", "--model", "tone", "--port", str(port), *options]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        while not (lines and lines[-1].startswith("ready: ")):
            line = proc.stderr.readline()
            assert line, f"serve exited before its ready line: {lines}"
            lines.append(line.rstrip("\n"))
        scheme = "https" if options else "http"
        verify = ssl.create_default_context(cafile=options[-1]) if options else True
        health = httpx.get(f"{scheme}://127.0.0.1:{port}/health", verify=verify, timeout=5).json()
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    return [line.replace(str(port), "PORT") for line in lines], health


def test_ready_line_comes_once_health_answers():
    lines, health = _serve_until_ready()
    assert lines == [
        "loading tone...",
        "cadence-fx serve: no API key (--api-key or CADENCE_FX_API_KEY): the service on 127.0.0.1:PORT is open to "
        "anyone who can reach that address",
        "ready: tone on ws://127.0.0.1:PORT/v1/realtime (16 session slots); page at http://127.0.0.1:PORT/",
    ]
    assert (health["status"], health["model"], health["max_sessions"]) == ("ok", "tone", 16)
    # The server owns its process: once the plugin was loaded, what was alive left the collections.
    assert health["gc"]["frozen_objects"] > 0


def test_ready_line_over_tls(tmp_path):
    tls = self_signed(tmp_path)
    lines, health = _serve_until_ready("--ssl-keyfile", tls.keyfile, "--ssl-certfile", tls.certfile)
    assert lines[-1] == "ready: tone on wss://127.0.0.1:PORT/v1/realtime (16 session slots); page at https://127.0.0.1:PORT/"
    assert health["model"] == "tone"


@pytest.mark.parametrize(
    ("options", "sentence"),
    [
        (["--ssl-keyfile", "key.pem"], "--ssl-keyfile and --ssl-certfile go together: give both (PEM files) or neither"),
        (
            ["--ssl-keyfile", "nokey.pem", "--ssl-certfile", "nocert.pem"],
            "no such file 'nokey.pem' (expected a PEM key or certificate)",
        ),
        (["--replicas", "2"], "--replicas goes with --ray (without it, one server process serves every session)"),
        (
            ["--ray", "--trusted-proxy", "10.0.0.1"],
            "--trusted-proxy does not go with --ray: there Ray Serve's HTTP "
            "proxy takes the client's address, and the replicas trust only the ingress's word for it",
        ),
        (
            ["--allowed-host", "https://voice.example"],
            "allowed host 'https://voice.example' must be a host name or "
            "address, without a scheme, port or path (voice.example, 10.0.0.5, ::1), or '*'",
        ),
    ],
)
def test_bad_tls_options_are_one_sentence(options, sentence, capsys):
    assert main(["serve", "--model", "tone", *options]) == 2
    assert capsys.readouterr().err == f"cadence-fx serve: error: {sentence}\n"


def test_plugin_options_are_read_as_json_values_or_text(capsys):
    from cadence_fx.cli import build_parser

    args = build_parser().parse_args(
        ["serve", "--plugin-option", "step_delay_s=0.04", "--plugin-option", "threads=2", "--plugin-option", "size=tiny"]
    )
    assert args.plugin_option == [("step_delay_s", 0.04), ("threads", 2), ("size", "tiny")]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--plugin-option", "step_delay_s"])
    assert "expected NAME=VALUE, got 'step_delay_s'" in capsys.readouterr().err


def test_serve_ray_deploys_the_options_as_a_ray_spec(monkeypatch):
    import cadence_fx.serve.ray as on_ray

    called = []
    monkeypatch.setattr(on_ray, "run_ray", lambda *args, **kwargs: called.append((args, kwargs)))
    options = ["--ray", "--replicas", "3", "--max-sessions", "5", "--plugin-option", "step_delay_s=0.04"]
    assert main(["serve", "--model", "tone", "--port", "9000", *options]) == 0
    [((host, port, spec, replicas, tls), kwargs)] = called
    assert (host, port, replicas, tls) == ("127.0.0.1", 9000, 3, None)
    assert (spec.model, spec.limits.max_sessions, spec.plugin_options) == ("tone", 5, {"step_delay_s": 0.04})
    assert list(kwargs) == ["on_ready"]


def test_slots_is_the_batch_of_a_slotted_model_and_the_default_session_limit(monkeypatch):
    import cadence_fx.serve.app as app

    served = []
    monkeypatch.setattr(
        app,
        "run_server",
        lambda host, port, model, limits, access, tls, on_ready, plugin_options: served.append(
            (model, limits.max_sessions, plugin_options)
        ),
    )
    assert main(["serve", "--model", "moshi-tiny", "--slots", "4"]) == 0
    assert main(["serve", "--model", "moshi-full", "--slots", "64", "--max-sessions", "32"]) == 0
    assert main(["serve", "--model", "moshi-tiny"]) == 0
    assert main(["serve", "--model", "token2wav", "--slots", "3"]) == 0
    assert served == [
        ("moshi-tiny", 4, {"slots": 4}),
        ("moshi-full", 32, {"slots": 64}),
        ("moshi-tiny", 16, {}),
        ("token2wav", 3, {"slots": 3}),
    ]


def test_slots_for_a_model_without_slots_is_one_sentence(capsys):
    assert main(["serve", "--model", "tone", "--slots", "4"]) == 2
    assert capsys.readouterr().err == (
        "cadence-fx serve: error: --slots: tone has no batch of slots; the models that do: moshi-full, moshi-small, "
        "moshi-tiny, personaplex-full, personaplex-tiny, token2wav, token2wav-full\n"
    )


def test_lanes_go_to_a_model_with_replay_lanes_and_nowhere_else(monkeypatch, capsys):
    import cadence_fx.serve.app as app

    served = []
    monkeypatch.setattr(
        app,
        "run_server",
        lambda host, port, model, limits, access, tls, on_ready, plugin_options: served.append(
            (model, limits.max_sessions, plugin_options)
        ),
    )
    assert main(["serve", "--model", "token2wav-full", "--lanes", "8", "--max-sessions", "24"]) == 0
    assert main(["serve", "--model", "token2wav"]) == 0
    assert served == [("token2wav-full", 24, {"lanes": 8}), ("token2wav", 16, {})]
    capsys.readouterr()
    assert main(["serve", "--model", "moshi-tiny", "--lanes", "2"]) == 2
    assert capsys.readouterr().err == (
        "cadence-fx serve: error: --lanes: moshi-tiny has no replay lanes; the models that do: token2wav, token2wav-full\n"
    )
    with pytest.raises(SystemExit):
        main(["serve", "--model", "token2wav", "--lanes", "0"])
    assert capsys.readouterr().err.endswith("cadence-fx serve: error: argument --lanes: expected a positive integer, got 0\n")
