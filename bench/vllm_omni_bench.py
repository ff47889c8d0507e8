"""vLLM-Omni's own duplex benchmark (``vllm bench omni-duplex-eval generate``, vllm-omni 0.30.0)
against ``cadence-fx serve`` on this machine, on a local audio-only manifest; its ttfp, rtf and
stream_ttfp as its code computes them, in bench/results/vllm_omni_bench_cpu.json.

    python bench/vllm_omni_bench.py                       # personaplex-tiny, 5 samples of 2 to 4 s
    python bench/vllm_omni_bench.py --model moshi-tiny --out /tmp/moshi.json   # refused: see below

What it needs besides .ci/install (the benchmark is not in CI):

    pip install av==18.0.0 prettytable==3.19.0

Their code runs unmodified, from the installed wheel, through their own argument parser and ``run``.
What stands in for what is not installed:

* ``vllm.entrypoints.cli.types.CLISubcommand`` (the base class of their CLI subcommand) is a stub
  class: vllm is not installed, and the class only registers the subcommand with ``vllm bench``.
* ``vllm_omni``, ``vllm_omni.entrypoints.cli`` and ``vllm_omni.metrics`` are registered as bare
  packages over the wheel's folders, so their ``__init__`` does not run (it imports torch's CUDA
  paths, vllm's benchmark patches and ``vllm.logger``; none of which ``generate`` uses). Their
  modules import as shipped (``tests/serve/vllm_omni_shim.py`` does the first for the interop test).
* PyAV (``av``) is their media decoder and prettytable is imported by ``vllm_omni.metrics.utils``:
  both are declared dependencies of the wheel, which .ci/install installs ``--no-deps``.

Why personaplex-tiny, not moshi-tiny: their ``generate`` requires ``--ref-audio`` and always sends it
as the session's ``ref_audio`` (a voice to clone); PersonaPlex takes a client's voice WAV, Moshi has
none, and the service refuses ``ref_audio`` by name for a model without voice cloning (run it with
``--model moshi-tiny`` to see the refusal; the record then has the error and the script exits 1).

The manifest: their loader wants a ``video`` per sample. Each sample's ``video`` is its own question
WAV, a media file with no picture stream: their ``iter_jpegs`` then finds no frame (PyAV: no video
stream; they log a warning) and every append goes out without ``video_frames``, which the service
would refuse by name (it hears audio only). The record counts what the client sent (appends, appends
carrying ``video_frames``) and every ``error`` event the server sent, from the websockets library's
debug log of each frame (their runner keeps its events to itself). Each sample's audio is
speech-like (a voiced tone with a syllable envelope over noise), 16 kHz mono PCM16, the rate their
runner sends. The dataset's hub copy and the ``evaluate`` step (an LLM judge) are not used.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import logging
import os
import platform
import shlex
import sys
import tempfile
import time
import types
import wave
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "serve"), str(REPO / "tests")]  # the shim and the speech-like audio: test kits
import vllm_omni_shim  # noqa: E402,F401  (registers the bare vllm_omni package)
from personaplex_kit import speechlike  # noqa: E402
from websockets.frames import Opcode  # noqa: E402

from cadence_fx.report import measured_commit  # noqa: E402
from cadence_fx.serve.app import free_port, server_process  # noqa: E402
from cadence_fx.serve.protocol import StreamResampler  # noqa: E402
from cadence_fx.serve.protocol import audio as wire_audio  # noqa: E402

INPUT_RATE = 16_000  # their runner's PCM16_SAMPLE_RATE: what every append says it carries
VOICE_SECONDS = 1.0
WHY_MODEL = (
    "not moshi-tiny: their generate step requires --ref-audio and always sends it as the session's ref_audio; "
    "moshi-tiny has no voice cloning and the service refuses ref_audio by name (unsupported_feature, "
    "session.ref_audio), after which no response comes (--model moshi-tiny shows it); personaplex-tiny takes "
    "a client's voice WAV"
)
MANIFEST_NOTE = (
    "a JSON manifest, one row a sample: id, split 'local_audio_only', family 'rtd', question_audio (a 16 kHz "
    "mono PCM16 WAV of speech-like audio) and video (the same WAV: no picture stream, so their iter_jpegs "
    "finds no frame and no append carries video_frames, which the service refuses by name); the voice "
    "(--ref-audio): 1 s of speech-like audio, 24 kHz PCM16"
)


def _bare_package(name: str) -> None:
    """``name`` registered over the wheel's folder without running its ``__init__``."""
    parent_name, _, leaf = name.rpartition(".")
    parent = importlib.import_module(parent_name)
    package = types.ModuleType(name)
    package.__path__ = [os.path.join(parent.__path__[0], leaf)]
    sys.modules[name] = package
    setattr(parent, leaf, package)


def their_cli() -> types.ModuleType:
    """Their ``omni_duplex_eval`` CLI module, with vllm's ``CLISubcommand`` a stub (the one vllm
    import on its path) and the two packages whose ``__init__`` imports vllm registered bare."""
    for name in ("vllm", "vllm.entrypoints", "vllm.entrypoints.cli", "vllm.entrypoints.cli.types"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["vllm.entrypoints.cli.types"].CLISubcommand = type("CLISubcommand", (), {})
    _bare_package("vllm_omni.entrypoints.cli")
    _bare_package("vllm_omni.metrics")
    return importlib.import_module("vllm_omni.entrypoints.cli.benchmark.omni_duplex_eval")


class WireLog(logging.Handler):
    """What went over the client's sockets, from the websockets library's debug log of each frame
    (``record.args[0]`` is the frame, decompressed): appends sent, those carrying ``video_frames``,
    and every ``error`` event received. One entry per connection, in the order they opened."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.connections: dict[int, dict] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg not in ("> %s", "< %s") or not record.args:
            return
        frame = record.args[0]
        if getattr(frame, "opcode", None) is not Opcode.TEXT:
            return
        event = json.loads(frame.data)
        conn = self.connections.setdefault(
            id(getattr(record, "websocket", None)), {"appends": 0, "appends_with_video_frames": 0, "errors": []}
        )
        if record.msg == "> %s" and event.get("type") == "input_audio_buffer.append":
            conn["appends"] += 1
            conn["appends_with_video_frames"] += bool(event.get("video_frames"))
        elif record.msg == "< %s" and event.get("type") == "error":
            conn["errors"].append(event.get("error"))


def write_wav(path: Path, samples: np.ndarray, rate: int) -> None:
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(wire_audio.encode_samples(samples.astype(np.float32), wire_audio.AudioFormat("pcm16", rate)))


def build_manifest(folder: Path, seconds: list[float]) -> tuple[Path, Path, list[dict]]:
    """The samples' WAVs (16 kHz), the voice WAV (24 kHz) and a JSON manifest of their fields."""
    rows = []
    for i, length in enumerate(seconds):
        audio = speechlike(length, seed=i).numpy().reshape(-1)
        wav = folder / f"q{i}.wav"
        write_wav(wav, StreamResampler(24_000, INPUT_RATE).process(audio), INPUT_RATE)
        # family "rtd": the plain question-answer family (their PR family wants a reminder task).
        rows.append({"id": f"q{i}", "split": "local_audio_only", "family": "rtd", "question_audio": str(wav), "video": str(wav)})
    voice = folder / "voice.wav"
    write_wav(voice, speechlike(VOICE_SECONDS, seed=99).numpy().reshape(-1), 24_000)
    manifest = folder / "manifest.json"
    manifest.write_text(json.dumps(rows, indent=1))
    return manifest, voice, rows


def _start_server(model: str, port: int, slots: int, timeout_s: float):
    argv = ["serve", "--model", model, "--port", str(port), "--max-sessions", str(slots), "--slots", str(slots)]
    code = f"import sys; from cadence_fx.cli import main; sys.exit(main({argv!r}))"
    return server_process(code, port, timeout_s=timeout_s), "cadence-fx " + shlex.join(argv)


def _cpu_model() -> str:
    with open("/proc/cpuinfo") as cpuinfo:
        names = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
    return names[0] if names else platform.processor() or "cpu"


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="personaplex-tiny", help="the model cadence-fx serves")
    parser.add_argument("--seconds", type=float, nargs="+", default=[2.0, 2.5, 3.0, 3.5, 4.0], help="each sample's length")
    parser.add_argument("--slots", type=int, default=1, help="the server's --slots and --max-sessions")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds for the server to answer /health")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "vllm_omni_bench_cpu.json"))
    args = parser.parse_args(argv)

    cli = their_cli()
    wire = WireLog()
    ws_logger = logging.getLogger("websockets.client")
    ws_logger.setLevel(logging.DEBUG)  # before a connection opens: each one reads the level once
    ws_logger.addHandler(wire)
    ws_logger.propagate = False
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")  # their frame-extraction warnings

    load_start = _load()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="vllm_omni_bench_") as tmp:
        folder = Path(tmp)
        manifest, voice, rows = build_manifest(folder, args.seconds)
        port = free_port()
        t0 = time.monotonic()
        server, serve_command = _start_server(args.model, port, args.slots, args.start_timeout)
        startup_s = time.monotonic() - t0
        generate_argv = [
            "generate",
            "--dataset",
            str(manifest),
            "--url",
            f"ws://127.0.0.1:{port}/v1/realtime?duplex=1",
            "--model",
            args.model,
            "--ref-audio",
            str(voice),
            "--response-root",
            str(folder / "responses"),
        ]
        their_parser = argparse.ArgumentParser(prog="vllm bench omni-duplex-eval")
        cli.OmniDuplexEvalSubcommand.add_cli_args(their_parser)
        t1 = time.monotonic()
        try:
            cli.OmniDuplexEvalSubcommand.cmd(their_parser.parse_args(generate_argv))
        finally:
            server.terminate()
            server.wait(timeout=60)
        generate_s = time.monotonic() - t1
        report = json.loads((folder / "responses" / "duplex_metrics.json").read_text())
        metas = {
            row["id"]: json.loads((folder / "responses" / row["split"] / f"{row['id']}.meta.json").read_text()) for row in rows
        }
        sentences = {
            row["id"]: json.loads((folder / "responses" / row["split"] / f"{row['id']}.json").read_text()) for row in rows
        }
    load_end = _load()

    from vllm_omni.clients.duplex import distribution_summary  # their summary of a list of values

    requests = report["duplex_request_metrics"]
    sessions = {s["sample_id"]: s for s in report["duplex_session_metrics"]}
    connections = list(wire.connections.values())
    errors = [error for conn in connections for error in conn["errors"]]
    samples = []
    for row, seconds, conn in zip(rows, args.seconds, connections + [None] * (len(rows) - len(connections)), strict=True):
        session = sessions.get(row["id"], {})
        meta = metas[row["id"]]
        samples.append(
            {
                "id": row["id"],
                "audio_seconds": seconds,
                "requests": [
                    {
                        k: r.get(k)
                        for k in ("response_id", "ttfp_ms", "ttft_ms", "rtf", "audio_generation_ms", "audio_duration_ms")
                    }
                    for r in requests
                    if r.get("sample_id") == row["id"]
                ],
                "session": {k: v for k, v in session.items() if k not in ("sample_id", "split", "stream_measurement_origin")},
                "response_done": meta["response_done"],
                "drain_timeout": meta["drain_timeout"],
                "close_timeout": meta["close_timeout"],
                "timed_sentences": len(sentences[row["id"]]),
                "wire": conn,
            }
        )
    record = {
        "benchmark": "vllm_omni_bench",
        "commit": measured_commit(),
        "command": "python " + shlex.join(["bench/vllm_omni_bench.py", *(sys.argv[1:] if argv is None else argv)]),
        "device": f"cpu ({_cpu_model()}, {os.cpu_count()} cores shared with other work)",
        "date": started[:10],
        "started": started,
        "load_average_start": load_start,
        "load_average_end": load_end,
        "model": args.model,
        "server": serve_command + " (in its own process)",
        "server_startup_s": round(startup_s, 1),
        "generate_s": round(generate_s, 1),
        "theirs": {
            "package": f"vllm-omni {importlib.metadata.version('vllm-omni')}",
            "step": "vllm bench omni-duplex-eval " + shlex.join(generate_argv).replace(str(folder), "$TMP"),
            "defaults": "pace realtime, clock media, mix question, fps 1.0, concurrency 1, unit 1000 ms of 16 kHz PCM16",
            "request_measurement_origin": (requests[0].get("measurement_origin") if requests else None),
            "stream_measurement_origin": next(iter(sessions.values()), {}).get("stream_measurement_origin"),
        },
        "why_this_model": WHY_MODEL if args.model != "moshi-tiny" else None,
        "manifest": MANIFEST_NOTE,
        "samples": samples,
        "summary": {
            "ttfp_ms": distribution_summary([r["ttfp_ms"] for r in requests if r.get("ttfp_ms") is not None], digits=3),
            "rtf": distribution_summary([r["rtf"] for r in requests if r.get("rtf") is not None], digits=6),
            "stream_ttfp_ms": report.get("duplex_stream_ttfp_ms"),
            "stream_rtf": report.get("duplex_stream_rtf"),
            "stream_ttft_ms": report.get("duplex_stream_ttft_ms"),
            "how": "ttfp and rtf: their distribution_summary over every response's own; stream_*: their duplex_metrics.json",
        },
        "appends": sum(c["appends"] for c in connections),
        "appends_with_video_frames": sum(c["appends_with_video_frames"] for c in connections),
        "errors": len(errors),
        "error_events": errors,
        "all_responses_done": all(s["response_done"] for s in samples),
    }
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record["summary"], indent=1))
    print(
        f"errors {record['errors']}, appends {record['appends']} "
        f"({record['appends_with_video_frames']} with video frames); wrote {args.out}"
    )
    return 0 if record["errors"] == 0 and record["all_responses_done"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
