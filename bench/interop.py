"""The clients people already use, each running automated turns against a real `cadence-fx serve`.

    bash bench/interop/install.sh          # pipecat-ai, livekit-agents + plugin, the npm clients
    python bench/interop.py                # writes bench/results/interop.json

Two servers are started from the CLI: one on ws:// for the Python clients and one on wss://, with
a self-signed certificate made here, for the Node clients (the openai npm client speaks only
wss://). Each client runs as its own process (bench/interop/<client>) and prints one JSON line:
its version and its named checks, passed or failed with the reason. The default model is the
``tone`` test double paced at real time (one 40 ms chunk per 40 ms, as a real model on a GPU), so a
reply is still playing when the user talks over it; ``--model moshi-tiny`` serves Moshi TINY on the
CPU, which keeps real time only on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "bench" / "interop"
sys.path.insert(0, str(ROOT / "tests" / "serve"))
from tlskit import self_signed  # noqa: E402  (the tests' certificate maker, one place for it)

from cadence_fx.serve.app import free_port  # noqa: E402

# client name -> the command that runs its scenario, and whether it talks TLS.
CLIENTS = {
    "openai-python": ([sys.executable, "openai_python.py"], False),
    "pipecat-ai": ([sys.executable, "pipecat_ai.py"], False),
    "livekit-agents": ([sys.executable, "livekit_agents.py"], False),
    "openai-npm": (["node", "openai_npm.mjs"], True),
    "agents-realtime": (["node", "agents_realtime.mjs"], True),
}


def serve(model: str, options: list[str], tls: list[str], log: Path) -> tuple[subprocess.Popen, int]:
    """A `cadence-fx serve` process, once its ready line is out."""
    port = free_port()
    command = [sys.executable, "-m", "cadence_fx.cli", "serve", "--model", model, "--port", str(port), *options, *tls]
    with log.open("w") as sink:
        proc = subprocess.Popen(command, stderr=sink, cwd=ROOT)
    deadline = time.monotonic() + 180
    while "ready: " not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"cadence-fx serve did not get ready:\n{log.read_text()}")
        time.sleep(0.2)
    return proc, port


def run_client(name: str, env: dict[str, str], timeout_s: float) -> dict:
    command, _ = CLIENTS[name]
    try:
        done = subprocess.run(command, cwd=HERE, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"client": name, "version": None, "passed": [], "failed": {"run": f"no result within {timeout_s:g} s"}}
    except FileNotFoundError as exc:
        return {"client": name, "version": None, "passed": [], "failed": {"run": f"cannot run: {exc}"}}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"client": name, "version": None, "passed": [], "failed": {"run": " | ".join(tail)}}
    return json.loads(lines[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tone")
    parser.add_argument("--clients", nargs="+", choices=sorted(CLIENTS), default=list(CLIENTS))
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "interop.json"))
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per client")
    args = parser.parse_args()
    options = ["--max-sessions", "4"]
    if args.model == "tone":
        options += ["--plugin-option", "step_delay_s=0.04"]

    with tempfile.TemporaryDirectory() as folder:
        tls = self_signed(Path(folder))
        plain, plain_port = serve(args.model, options, [], Path(folder) / "plain.log")
        secure, secure_port = serve(
            args.model,
            options,
            ["--ssl-keyfile", tls.keyfile, "--ssl-certfile", tls.certfile],
            Path(folder) / "tls.log",
        )
        env = {
            **os.environ,
            "INTEROP_WS": f"ws://127.0.0.1:{plain_port}",
            "INTEROP_WSS": f"wss://127.0.0.1:{secure_port}",
            "INTEROP_MODEL": args.model,
            "SSL_CERT_FILE": tls.certfile,  # Python clients trust the self-signed certificate
            "NODE_EXTRA_CA_CERTS": tls.certfile,  # and so do the Node ones
        }
        results = []
        try:
            for name in args.clients:
                result = run_client(name, env, args.timeout)
                results.append(result)
                print(
                    f"{name}: {len(result['passed'])} passed, {len(result['failed'])} failed"
                    + "".join(f"\n  FAILED {k}: {v}" for k, v in result["failed"].items()),
                    flush=True,
                )
        finally:
            for proc in (plain, secure):
                proc.terminate()
                proc.wait(timeout=30)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    node = subprocess.run(["node", "--version"], capture_output=True, text=True)
    record = {
        "commit": commit.stdout.strip() or None,
        "model": args.model,
        "cadence_fx": version("cadence-fx"),
        "python": platform.python_version(),
        "node": node.stdout.strip() or None,
        "results": results,
    }
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    passed = sum(len(r["passed"]) for r in results)
    failed = sum(len(r["failed"]) for r in results)
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
