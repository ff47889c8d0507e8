"""Load benchmark of the duplex service: N concurrent sessions streaming speech-like audio in real
time for S seconds over loopback, against a server in its own process.

Reports, per run: whether every appended input byte was committed and every response's audio
arrived contiguous and complete (wire-level accounting, serve/loadgen.py), and the p50/p95 time
from the append that ended a user turn to the first audio delta of its reply.

    python bench/serve_load.py --sessions 8 --seconds 60   # writes bench/results/serve_load.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from cadence_fx.serve.app import free_port
from cadence_fx.serve.loadgen import run_load, speech_pattern

RESULTS = Path(__file__).resolve().parent / "results"


def _start_server(port: int, plugin: str, sessions: int) -> subprocess.Popen:
    code = (
        "from cadence_fx.serve.app import run_server; from cadence_fx.serve.session import Limits; "
        f"run_server('127.0.0.1', {port}, {plugin!r}, Limits(max_sessions={sessions}))"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    for _ in range(300):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("server did not come up")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--plugin", default="tone")
    parser.add_argument("--out", type=Path, default=RESULTS / "serve_load.json")
    args = parser.parse_args()

    port = free_port()
    server = _start_server(port, args.plugin, args.sessions)
    try:
        pcm = speech_pattern(args.seconds)
        started = time.monotonic()
        results = asyncio.run(run_load(f"ws://127.0.0.1:{port}/v1/duplex", pcm, args.sessions))
        wall_s = time.monotonic() - started
    finally:
        server.terminate()
        server.wait(timeout=10)

    latencies = np.array([x for r in results for x in r.latencies_s]) * 1000
    report = {
        "plugin": args.plugin + (" (test double, not a model)" if args.plugin == "tone" else ""),
        "sessions": args.sessions,
        "audio_seconds_per_session": args.seconds,
        "wall_seconds": round(wall_s, 2),
        "all_input_accounted": all(r.appended_bytes == r.committed_bytes for r in results),
        "all_output_complete_and_in_order": all(r.accounted for r in results),
        "errors": sum(len(r.errors) for r in results),
        "appended_bytes": sum(r.appended_bytes for r in results),
        "committed_bytes": sum(r.committed_bytes for r in results),
        "responses": sum(len(r.replies) for r in results),
        "reply_audio_bytes": sum(len(reply.audio) for r in results for reply in r.replies),
        "turn_end_to_first_audio_ms": {
            "count": int(latencies.size),
            "p50": round(float(np.percentile(latencies, 50)), 2) if latencies.size else None,
            "p95": round(float(np.percentile(latencies, 95)), 2) if latencies.size else None,
            "max": round(float(latencies.max()), 2) if latencies.size else None,
        },
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    if not (report["all_input_accounted"] and report["all_output_complete_and_in_order"] and report["errors"] == 0):
        sys.exit(1)


if __name__ == "__main__":
    main()
