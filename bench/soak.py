"""Fault soak of the duplex service (tests/serve/soakkit.py): N sessions for M minutes against a
server in its own process (the tone model, on 2 CPU cores), ended by SIGTERM; records the
ledgers, the verdicts and the server's resident memory over the run as JSON:

    python bench/soak.py                                  # 16 sessions x 10 min: bench/results/soak.json
    python bench/soak.py --sessions 4 --minutes 1 --out /tmp/soak.json

Exits non-zero unless the run lost nothing, balanced every ledger, met no server error, drained
every session on SIGTERM and kept its memory flat (see ``memory_flat``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

from cadence_fx.report import measured_commit
from cadence_fx.serve.app import free_port, server_process

KITS = Path(__file__).resolve().parents[1] / "tests" / "serve"  # the soak's driver: a test kit (soakkit.py)
sys.path.insert(0, str(KITS))
from soakkit import run_soak, soak_limits, summarize  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[1]
SAMPLE_S = 5.0
# Memory is flat when the second half's peak resident size is within this of the first half's
# (after a minute of warm-up): Python's allocator keeps arenas, so the peak, not the mean, is what
# a leak would move.
FLAT_TOLERANCE = 0.05

_SERVE = """
import sys
sys.path.insert(0, sys.argv[3])
from cadence_fx.serve.app import Server, create_app, uvicorn_config
from soakkit import soak_limits, soak_model
limits = soak_limits(int(sys.argv[2]))
Server(uvicorn_config(create_app(soak_model, limits), "127.0.0.1", int(sys.argv[1]), limits)).run()
"""


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def _cpu_model() -> str:
    with open("/proc/cpuinfo") as cpuinfo:
        names = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
    return names[0] if names else platform.processor() or "cpu"


def _commit() -> str | None:
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        return measured_commit()
    finally:
        os.chdir(cwd)


def _memory(samples: list[tuple[float, int]], seconds: float) -> dict:
    warm = [rss for t, rss in samples if t >= 60.0] or [rss for _, rss in samples]
    half = len(warm) // 2
    first, second = max(warm[: half or 1]), max(warm[half:] or warm)
    return {
        "samples_every_s": SAMPLE_S,
        "rss_mib": [[round(t, 1), round(rss / 2**20, 1)] for t, rss in samples],
        "peak_first_half_mib": round(first / 2**20, 1),
        "peak_second_half_mib": round(second / 2**20, 1),
        "memory_flat": second <= first * (1 + FLAT_TOLERANCE),
        "rule": f"after the first minute, the second half's peak RSS within {FLAT_TOLERANCE:.0%} of the first half's",
    }


async def _soak(port: int, proc: subprocess.Popen, sessions: int, seconds: float, seed: int) -> tuple:
    samples: list[tuple[float, int]] = []
    started = time.monotonic()
    sampling = True

    async def sample() -> None:
        while sampling:
            samples.append((time.monotonic() - started, _rss_bytes(proc.pid)))
            await asyncio.sleep(SAMPLE_S)

    async def sigterm() -> None:
        proc.send_signal(signal.SIGTERM)

    sampler = asyncio.create_task(sample())
    ledgers = await run_soak(f"ws://127.0.0.1:{port}", sessions, seconds, seed, sigterm)
    sampling = False
    await sampler
    return ledgers, samples, time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    args = parser.parse_args()

    port = free_port()
    server = server_process(_SERVE, port, timeout_s=300, args=(str(port), str(args.sessions), str(KITS)))
    load_before = os.getloadavg()
    try:
        ledgers, samples, wall_s = asyncio.run(_soak(port, server, args.sessions, 60.0 * args.minutes, args.seed))
        exit_code = server.wait(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
    summary = summarize(ledgers)
    memory = _memory(samples, wall_s)
    limits = soak_limits(args.sessions)
    report = {
        "benchmark": "soak",
        "commit": _commit(),
        "worktree_dirty": bool(
            subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"], capture_output=True, text=True).stdout.strip()
        ),
        "command": " ".join(["python", "bench/soak.py", *sys.argv[1:]]),
        "machine": f"CPU: {_cpu_model()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "platform": platform.platform(),
        "model": "tone (test double, not a model), a 40 ms chunk every 40 ms",
        "sessions": args.sessions,
        "minutes": args.minutes,
        "seed": args.seed,
        "wall_seconds": round(wall_s, 1),
        "load_average_1min_before_and_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "limits": {
            name: getattr(limits, name)
            for name in ("max_frame_bytes", "input_bytes", "outbound_bytes", "journal_bytes", "drain_s")
        },
        **summary,
        "server_exit_code_after_sigterm": exit_code,
        "memory": memory,
        "sessions_ledgers": [ledger.to_dict() for ledger in ledgers],
    }
    passed = (
        not summary["violations"]
        and summary["lost_events"] == 0
        and summary["server_errors"] == 0
        and summary["input_accounted"]
        and summary["output_samples_accounted"]
        and summary["shutdown"] == {"session.closed server_shutdown, close 1001": args.sessions}
        and memory["memory_flat"]
    )
    report["passed"] = passed
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k not in ("sessions_ledgers", "memory")}, indent=2))
    print(json.dumps({k: v for k, v in memory.items() if k != "rss_mib"}, indent=2))
    if not passed:
        sys.exit(1)


if __name__ == "__main__":
    main()
