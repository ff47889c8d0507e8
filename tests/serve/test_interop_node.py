"""The Node clients of bench/interop (the openai npm client, @openai/agents-realtime), each run
against a real server over wss:// with a self-signed certificate. .ci/install puts their pinned
packages into bench/interop/node_modules; the heavier Python clients run in bench/interop.py."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from tlskit import self_signed

from cadence_fx.serve.app import background_server
from cadence_fx.serve.plugins import ToneModel
from cadence_fx.serve.session import Limits

INTEROP = Path(__file__).resolve().parents[2] / "bench" / "interop"

EXPECTED = {
    "openai_npm.mjs": [
        "connects over wss:// (TLS)",
        "session.update accepted",
        "manual turn answered with audio",
        "response.metadata echoed",
        "cancel with nothing active: OpenAI's wording",
    ],
    "agents_realtime.mjs": [
        "default session.update (semantic_vad, transcription) and the tracing update accepted",
        "spoken turn answered with audio",
        "one speech_started per spoken turn (no VAD restart)",
    ],
}


@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_node_client_runs_its_checks_over_wss(script, tmp_path):
    tls = self_signed(tmp_path)
    # Paced at real time, as a model on a GPU: one 40 ms chunk per 40 ms.
    with background_server(lambda: ToneModel(step_delay_s=0.04), Limits(max_sessions=4), tls=tls) as handle:
        env = {**os.environ, "INTEROP_WSS": handle.ws_url, "INTEROP_MODEL": "tone", "NODE_EXTRA_CA_CERTS": tls.certfile}
        done = subprocess.run(["node", script], cwd=INTEROP, env=env, capture_output=True, text=True, timeout=90)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, done.stderr
    result = json.loads(lines[-1])
    assert (result["failed"], result["passed"]) == ({}, EXPECTED[script])
    assert done.returncode == 0
