"""Load benchmark of the duplex service: N concurrent sessions streaming speech-like audio in real
time for S seconds over loopback, against a server in its own process.

Reports, per run: whether every appended input byte was committed and every response's audio
arrived contiguous and complete (wire-level accounting, tests/serve/loadgen.py), the p50/p95 time from
the append that ended a user turn to the first audio delta of its reply, and each reply's playback
stall (how long a client playing the reply from its first delta would wait for a late delta; 0 when
the server keeps real time). The plugin's own counters (``/v1/models``) are recorded after the
run. Run it from outside the repository's folders (``bench/moshi.py`` would shadow the vendor's
``moshi`` package on ``sys.path``):

    python bench/serve_load.py --sessions 8 --seconds 60                      # tone: bench/results/serve_load.json
    python bench/serve_load.py --plugin moshi-tiny     # bench/results/serve_load_moshi.json
    python bench/serve_load.py --plugin moshi-full --sessions 2 --seconds 30  # a GPU: serve_load_moshi_full.json
    python bench/serve_load.py --plugin moshi-full --sessions 128 --ray 2     # 2 GPUs: serve_load_moshi_full_ray2.json

``--tick-double S`` (a moshi plugin) replaces each batched tick by a sleep of S seconds that returns
silence, in the server process: the sessions, the scheduler and the server are the real ones, so it
measures the service's own part of a tick's cycle at N sessions on any machine (with 0.05, about a
full-size tick on the H200):

    python bench/serve_load.py --plugin moshi-tiny --tick-double 0.05 --sessions 64 --seconds 20

``--lanes L`` serves a Token2Wav plugin on L replay lanes (``cadence-fx serve --lanes``; default the
plugin's own). For a plugin on lanes the report adds how many lanes there were, how many ran a
session's chunk, and each lane's sessions and chunks (``lanes``), and the plugin's own start-up
time (``plugin_startup_seconds``: building the model and warming every lane, within
``server_startup_seconds``, which runs until ``/health`` answers). ``server_memory`` is the server
process's peak allocated, reserved and device footprint (``torch.cuda.mem_get_info``, less what
was in use when the service started; ``cadence_fx.memory``), read after the run.

    python bench/serve_load.py --sessions 24 --seconds 60 --plugin token2wav-full --lanes 8   # an H200

``--runs N`` runs the load N times in a row on the one server: one 60 s run's tail varies (first
audio p95 from 301 to 398 ms over three runs of the same code at 64 ``moshi-full`` sessions), so
a verdict on a target wants several. The record's figures are over all runs; ``runs`` has each
run's own.

    python bench/serve_load.py --sessions 64 --seconds 60 --plugin moshi-full --runs 3   # an H200

``--staggered`` replaces the synchronised sessions (the default, so older records stay
comparable: every session starts at once and streams the same pattern, 0.8 s tone bursts and
0.7 s pauses, so every turn of every session ends at the same instant: a worst case) by sessions
that start apart and talk at their own rhythm, from ``--seed``:

* session i starts after a delay drawn uniformly from [0, ``--stagger-window``] seconds (default
  half of ``--seconds``), then streams ``--seconds`` of audio, so the run lasts up to
  ``--seconds`` plus the window;
* its audio alternates turns and pauses: each turn (a 220 Hz tone burst, speech to the energy
  VAD) lasts uniformly 0.6 to 3.0 s; each pause 0.7 s (the synchronised pattern's, long enough for
  the VAD to end a turn) plus an exponential of mean 1.5 s, at most 8 s in all;
* every session draws its own delay, turns and pauses from ``random.Random(seed * 1000 + i)``.

    python bench/serve_load.py --plugin token2wav --sessions 2 --seconds 30 --staggered   # serve_load_token2wav_staggered.json

``--role TEXT`` and ``--voice NAME`` give every session a persona with its first
``session.update`` (``instructions`` and ``voice``; a model without one, such as ``tone``, ignores
them); ``{session}`` in the role is replaced by the session's number, so each session has a role of
its own and primes its own prompt state (the worst case of PersonaPlex's prompt phase):

    python bench/serve_load.py --plugin personaplex-tiny --sessions 8 --role "You are agent {session} of a bicycle shop."

Every run records, per session, the time from opening its WebSocket to ``session.created``, to
ready (the ``session.updated`` that answers its first update: for PersonaPlex, once its prompt
state exists) and to its first reply's first audio delta (tests/serve/loadgen.py), and the
machine's load averages (1, 5, 15 min) before and after the load.

With ``--ray N`` the server is ``cadence-fx serve --ray --replicas N`` (docs/deployment.md): N
replicas, one GPU each where there are GPUs, ``--sessions`` spread over them by the ingress, each
replica with room for its share; the report adds each replica's sessions and plugin counters.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np

from cadence_fx.report import latency_stats, measured_commit
from cadence_fx.serve.app import free_port, server_process
from cadence_fx.serve.commands import plugin_option

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "serve"))  # the load generator: a test kit
from loadgen import drive_session, run_load, speech_pattern  # noqa: E402

from cadence_fx.serve.plugins import has_lanes, plugin_names
from cadence_fx.serve.protocol import PCM24K
from cadence_fx.serve.protocol import audio as wire_audio

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[1]


# ``--tick-double S``: each batched tick of a moshi plugin's place replaced by a sleep of S seconds
# (the interpreter free meanwhile, as while a GPU works) that returns silence for every slot. The
# sessions, the scheduler and the server are the real ones: what it measures is the service's own
# part of a tick's cycle at N sessions, on any machine.
TICK_DOUBLE = """
import time, numpy as np
import cadence_fx.serve.plugins.moshi as moshi
import cadence_fx.serve.plugins.moshi_worker as moshi_worker

class _DoubleBatch:
    def __init__(self, slots):
        self.slots = slots
        self.report = type("Report", (), {{"stamps": ["tick double: {seconds} s sleep"]}})()
    def counters(self): return {{}}
    def close(self): pass

def _start(self, slots): self.runtime = _DoubleBatch(slots)
def _tick(self, frames, joins):
    time.sleep({seconds}); self.ticks += 1
    return {{slot: (np.zeros(moshi.FRAME_SAMPLES, np.float32), 0) for slot in frames}}  # (pcm, text id 0: no text)
moshi_worker._Engine.start, moshi_worker._Engine.tick = _start, _tick
"""


#: ``--staggered``'s distributions (seconds), as the module's docstring states them.
TURN_S = (0.6, 3.0)  # uniform
PAUSE_MIN_S, PAUSE_MEAN_EXTRA_S, PAUSE_MAX_S = 0.7, 1.5, 8.0  # 0.7 + exponential(mean 1.5), capped


def staggered_session(seed: int, session: int, seconds: float, window_s: float) -> tuple[float, bytes, list[tuple[float, float]]]:
    """One ``--staggered`` session: its start delay, its audio (24 kHz PCM16) and its turns
    ((start, length) in seconds of its audio)."""
    rand = random.Random(seed * 1000 + session)
    delay = rand.uniform(0.0, window_s)
    rate = PCM24K.rate
    samples = np.zeros(int(seconds * rate), np.float32)
    turns, at = [], 0.0
    while True:
        length = rand.uniform(*TURN_S)
        if at + length > seconds:
            break
        start = int(at * rate)
        t = np.arange(int(length * rate)) / rate
        samples[start : start + t.size] = 0.1 * np.sin(2 * np.pi * 220 * t)
        turns.append((round(at, 3), round(length, 3)))
        at += length + min(PAUSE_MAX_S, PAUSE_MIN_S + rand.expovariate(1.0 / PAUSE_MEAN_EXTRA_S))
    return delay, wire_audio.encode_samples(samples, PCM24K), turns


async def run_staggered(
    url: str,
    sessions: int,
    seconds: float,
    window_s: float,
    seed: int,
    *,
    patience_s: float,
    chunk_ms: int,
    personas: list[dict] | None = None,
) -> tuple[list, list[dict]]:
    """Every session of ``--staggered`` at its own start, with its own turns; returns the sessions'
    loads and what each was given (delay, turns)."""
    plans = [staggered_session(seed, i, seconds, window_s) for i in range(sessions)]

    async def one(delay: float, pcm: bytes, persona: dict | None):
        await asyncio.sleep(delay)
        return await drive_session(url, pcm, chunk_ms=chunk_ms, patience_s=patience_s, persona=persona)

    results = await asyncio.gather(
        *(one(delay, pcm, None if personas is None else personas[i]) for i, (delay, pcm, _) in enumerate(plans))
    )
    return list(results), [{"start_delay_s": round(delay, 3), "turns": turns} for delay, _, turns in plans]


def _start_server(
    port: int,
    plugin: str,
    sessions: int,
    reply_lead_s: float,
    timeout_s: float,
    replicas: int,
    options: dict[str, object],
    tick_double_s: float | None = None,
) -> subprocess.Popen:
    """The server in its own process, once ``/health`` answers (the plugin's startup, its batch
    included, prints its progress on stderr meanwhile). ``replicas``: 0 for one server process,
    else ``cadence-fx serve --ray`` with that many replicas, each with room for its share.
    ``tick_double_s``: a moshi plugin's ticks replaced by a sleep (``TICK_DOUBLE``), in the server process."""
    if replicas == 0:
        code = (
            (TICK_DOUBLE.format(seconds=tick_double_s) if tick_double_s is not None else "")
            + "from cadence_fx.serve.app import run_server; from cadence_fx.serve.session import Limits; "
            f"run_server('127.0.0.1', {port}, {plugin!r}, "
            f"Limits(max_sessions={sessions}, max_sessions_per_client={sessions}, reply_lead_s={reply_lead_s!r}), "
            f"plugin_options={options!r})"
        )
    else:
        share = -(-sessions // replicas)
        argv = [
            "serve",
            "--ray",
            "--replicas",
            str(replicas),
            "--model",
            plugin,
            "--port",
            str(port),
            "--max-sessions",
            str(share),
            "--max-sessions-per-client",
            str(sessions),
            "--reply-lead",
            str(reply_lead_s),
        ]
        argv += [
            f"--lanes={value}" if name == "lanes" else f"--plugin-option={name}={json.dumps(value)}"
            for name, value in options.items()
        ]
        code = f"import sys; from cadence_fx.cli import main; sys.exit(main({argv!r}))"
    return server_process(code, port, timeout_s=timeout_s)


def _commit() -> str | None:
    """``measured_commit`` of this repository, wherever the benchmark was started from."""
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        return measured_commit()
    finally:
        os.chdir(cwd)


def _cpu_model() -> str:
    with open("/proc/cpuinfo") as cpuinfo:
        names = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
    return names[0] if names else platform.processor() or "cpu"


def _gpu() -> str | None:
    """The first NVIDIA GPU's name, from nvidia-smi (this process does not touch the device)."""
    try:
        query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
        names = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.split("\n")
    except (OSError, subprocess.TimeoutExpired):
        return None
    return names[0].strip() or None


def _cpu_seconds(pid: int) -> float | None:
    """A process's CPU time so far (user + system, all its threads; Linux's ``/proc``), else None."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _stats_ms(seconds: list[float]) -> dict | None:
    stats = latency_stats([1e3 * s for s in seconds])
    if stats is None:
        return None
    return {key: round(value, 2) if isinstance(value, float) else value for key, value in stats.items()} | {
        "max": round(1e3 * max(seconds), 2)
    }


def _model_load(plugin: dict, wall_s: float, sessions: int) -> dict | None:
    """For a plugin that ticks in tick places (``moshi-*``: worker processes on a CPU, a thread of
    the server on a GPU), each place's sessions the slots of one batch: how busy the places were,
    what a batched tick cost and how many session frames it carried, against what real time asks
    (12.5 frames/s per session). On a CPU a tick's cost is its time on a core; on a GPU it is its
    wall time (the device's work is not on the thread's clock)."""
    if "tick_cpu_seconds_per_process" not in plugin:
        return None
    ticks = sum(plugin["batched_ticks_per_process"])
    frames = plugin["frames"]["ticks"]
    cpu_ms_per_tick = 1e3 * sum(plugin["tick_cpu_seconds_per_process"]) / ticks
    wall_ms_per_tick = 1e3 * sum(plugin["tick_seconds_per_process"]) / ticks
    cost_ms = cpu_ms_per_tick if plugin["device"] == "cpu" else wall_ms_per_tick

    def per_tick_ms(parts: list[dict[str, float]]) -> dict[str, float]:
        return {name: round(1e3 * sum(part[name] for part in parts) / ticks, 2) for name in parts[0]}

    return {
        "batched_ticks": ticks,
        "session_frames": frames,
        "frames_per_tick": round(frames / ticks, 2),
        "slots_per_process": plugin["slots_per_process"],
        "worker_busy_fraction": [round(busy / wall_s, 3) for busy in plugin["tick_seconds_per_process"]],
        "cpu_ms_per_tick": round(cpu_ms_per_tick, 2),
        "wall_ms_per_tick": round(wall_ms_per_tick, 2),
        "frames_per_s_at_that_cost_and_fill": (
            round(len(plugin["tick_seconds_per_process"]) * frames / ticks * 1e3 / cost_ms, 1) if cost_ms > 0 else None
        ),
        "frames_per_s_real_time_needs": sessions * 12.5,
        # Where a tick's time went: on the place's ticking thread (the frames made tensors, the
        # batched call, its outputs to the host and split into rows) and on the scheduler's
        # thread in the server (gathering the slots that come right back, the round trip to the
        # place, answering the sessions); and the slots ticks ran without for want of time.
        "place_ms_per_tick": per_tick_ms(plugin["tick_phase_seconds_per_process"]),
        "scheduler_ms_per_tick": per_tick_ms(plugin["scheduler_seconds_per_process"]),
        "follow_misses": sum(plugin["follow_misses_per_process"]),
    }


def _batch_ticks(plugin: dict | None, wall_s: float) -> dict | None:
    """For a plugin that ticks its batch in the server process and times it (``personaplex-*``):
    ticks per second against the 12.5 real time needs, and a tick's wall and CPU time against
    the 80 ms a frame lasts."""
    if not plugin or "tick_cpu_seconds" not in plugin or not plugin["batched_ticks"]:
        return None
    ticks = plugin["batched_ticks"]
    return {
        "batched_ticks": ticks,
        "ticks_per_s": round(ticks / wall_s, 2),
        "session_frames_per_tick": round(plugin["frames"]["ticks"] / ticks, 2),
        "wall_ms_per_tick": round(1e3 * plugin["tick_seconds"] / ticks, 2),
        "cpu_ms_per_tick": round(1e3 * plugin["tick_cpu_seconds"] / ticks, 2),
        "torch_threads": plugin["torch_threads"],
    }


def _stall_timeline(results, plugin: dict | None, zero: float) -> dict:
    """When the replies stalled, against what the server's batch was doing then: each stalled
    reply's first audio and the arrival of the delta that ended its last wait, and, for a plugin
    that times them (``personaplex-*``, on the same monotonic clock), its ticks longer than a frame
    and the spans its prompt bank primed a role. Seconds from the start of the load."""

    def at(t: float) -> float:
        return round(t - zero, 3)

    stalled = sorted(
        (
            {
                "session": i,
                "first_audio_s": at(reply.first_delta_at),
                "stall_at_s": at(reply.stall_at),
                "stall_ms": round(1e3 * reply.stall_s, 1),
            }
            for i, r in enumerate(results)
            for reply in r.replies
            if reply.stall_s > 0
        ),
        key=lambda row: row["stall_at_s"],
    )
    timeline: dict = {"stalled_replies": stalled}
    if plugin and "slow_ticks" in plugin:
        spans = [[at(a), at(b)] for a, b in plugin["priming_spans"]]
        timeline["priming_spans_s"] = [span for span in spans if span[1] >= 0]
        timeline["slow_ticks"] = [dict(tick, at=at(tick["at"])) for tick in plugin["slow_ticks"] if tick["at"] >= zero]
        timeline["tick_wall_while_priming"] = plugin["tick_wall_while_priming"]
        # A stall's waits fall between the reply's first audio and its stall_at.
        timeline["stalled_replies_overlapping_a_priming"] = sum(
            any(a <= row["stall_at_s"] and b >= row["first_audio_s"] for a, b in spans) for row in stalled
        )
    return timeline


def _lanes(plugin: dict | None) -> dict | None:
    """For a plugin on replay lanes (``token2wav*``): how many, how many ran a session's chunk, and
    each lane's sessions and chunks, its warm-up and the classes it captured."""
    if not plugin or "lanes" not in plugin:
        return None
    lanes = plugin["lanes"]
    return {
        "lanes": len(lanes),
        "lanes_used": plugin["lanes_used"],
        "room_per_lane": lanes[0]["room"],
        "sessions_per_lane": [lane["streams_served"] for lane in lanes],
        "chunks_per_lane": [lane["chunks"] for lane in lanes],
        "warm_seconds_per_lane": [lane["warm_seconds"] for lane in lanes],
        "classes_captured_per_lane": [lane["classes_captured"] for lane in lanes],
    }


def _error_kinds(results) -> dict[str, int]:
    """How many error events of each kind the sessions got: "type/code: message" (the message's
    first 160 characters), so a failed run says why."""
    return dict(
        Counter(
            f"{error.get('type')}/{error.get('code')}: {str(error.get('message'))[:160]}"
            for result in results
            for error in result.errors
        )
    )


def _wait_for_no_sessions(port: int, patience_s: float) -> None:
    """Until the server holds no session (``/health``): a closed session's slot is free only then."""
    deadline = time.monotonic() + patience_s
    while (sessions := httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).json()["sessions"]) > 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server still holds {sessions} session(s) {patience_s:g} s after the last run ended")
        time.sleep(0.1)


def _summary(results, wall_s: float) -> dict:
    """One run's own figures (``--runs``): what varies from one run to the next."""
    replies = [reply for r in results for reply in r.replies]
    stalls = [reply.stall_s for reply in replies]
    return {
        "wall_seconds": round(wall_s, 2),
        "accounted": all(r.appended_bytes == r.committed_bytes and r.accounted for r in results),
        "errors": sum(len(r.errors) for r in results),
        "responses": len(replies),
        # A turn that ends while the reply to an earlier one is still in progress gets no response
        # of its own (barge-in off, one response at a time): responses = turns - these.
        "turns": sum(r.turns for r in results),
        "turns_ended_during_a_reply": sum(r.turns_ended_during_a_reply for r in results),
        "turn_end_to_first_audio_ms": _stats_ms([x for r in results for x in r.latencies_s]),
        # Per session, from opening its WebSocket (tests/serve/loadgen.py): session.created, ready
        # (the session.updated answering its first update: its persona's prompt state in place),
        # its first reply's first audio (ready + its first turn + the reply's latency).
        **{
            f"session_start_to_{name}_ms": _stats_ms([t for r in results if (t := getattr(r, f"start_to_{name}_s")) is not None])
            for name in ("created", "ready", "first_audio")
        },
        "reply_playback_stall_ms": _stats_ms(stalls),
        "replies_that_stalled": sum(stall > 0 for stall in stalls),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--plugin", default="tone")
    parser.add_argument(
        "--out",
        type=Path,
        help="default: results/serve_load.json (tone), serve_load_moshi.json (moshi-tiny), serve_load_<plugin>.json (any other)",
    )
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for the server to come up")
    parser.add_argument("--patience", type=float, default=120.0, help="seconds a session waits for any one answer")
    parser.add_argument(
        "--ray",
        type=int,
        default=0,
        metavar="N",
        help="serve through cadence-fx serve --ray with N replicas (default 0: one server process)",
    )
    parser.add_argument(
        "--append-ms",
        type=int,
        default=200,
        help="milliseconds of audio in each input_audio_buffer.append a session sends (default 200)",
    )
    parser.add_argument(
        "--reply-lead",
        type=float,
        default=0.0,
        help="the server's Limits.reply_lead_s: how far ahead of playback a reply is computed (0: as fast as it goes)",
    )
    parser.add_argument(
        "--tick-double",
        type=float,
        metavar="SECONDS",
        help="moshi-*: each batched tick replaced by a sleep of SECONDS returning silence, ticking in "
        "the server process (a test double of the device: the service's own overhead at N sessions)",
    )
    parser.add_argument(
        "--plugin-option",
        metavar="NAME=VALUE",
        type=plugin_option,
        action="append",
        default=[],
        help="a keyword argument of the model plugin (repeatable), as cadence-fx serve takes it, e.g. slots=32 for moshi-*",
    )
    parser.add_argument(
        "--lanes",
        type=int,
        metavar="L",
        help="token2wav*: the plugin's replay lanes (cadence-fx serve --lanes; default: the plugin's own)",
    )
    parser.add_argument(
        "--runs",
        type=int,
        default=1,
        metavar="N",
        help="the load N times in a row on the one server (default 1); the record's figures are "
        "over all of them, and each run's own are under runs",
    )
    parser.add_argument(
        "--staggered",
        action="store_true",
        help="sessions start apart and talk at their own rhythm (default: all start together with one "
        "pattern): start delay uniform in [0, --stagger-window] s; turns uniform 0.6 to 3.0 s; "
        "pauses 0.7 s + exponential(mean 1.5 s), at most 8 s; per session from --seed",
    )
    parser.add_argument(
        "--stagger-window", type=float, metavar="SECONDS", help="--staggered: the latest start delay (default: half of --seconds)"
    )
    parser.add_argument("--seed", type=int, default=0, help="--staggered: the seed of every session's draws (default 0)")
    parser.add_argument(
        "--role",
        metavar="TEXT",
        help="every session's instructions (PersonaPlex: its role prompt), set with its first update; "
        "{session} is replaced by the session's number",
    )
    parser.add_argument("--voice", metavar="NAME", help="every session's voice, set with its first update")
    args = parser.parse_args()
    if args.stagger_window is not None and not args.staggered:
        parser.error("--stagger-window takes --staggered")
    window_s = args.stagger_window if args.stagger_window is not None else args.seconds / 2
    if args.staggered and not (window_s >= 0 and args.seconds >= TURN_S[1]):
        parser.error(
            f"--staggered needs --stagger-window >= 0 and --seconds >= {TURN_S[1]} (one turn at least); "
            f"got --stagger-window {window_s}, --seconds {args.seconds}"
        )
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    if args.lanes is not None and not has_lanes(args.plugin):
        parser.error(
            f"--lanes: {args.plugin} has no replay lanes; the models that do: "
            f"{', '.join(name for name in plugin_names() if has_lanes(name))}"
        )
    if not 10 <= args.append_ms <= 1000:
        parser.error(f"--append-ms must be 10 to 1000 milliseconds of audio per append, got {args.append_ms}")
    if args.lanes is not None and args.lanes < 1:
        parser.error(f"--lanes must be at least 1, got {args.lanes}")
    if args.tick_double is not None and (not args.plugin.startswith("moshi") or args.ray or not args.tick_double >= 0):
        parser.error(
            f"--tick-double takes a moshi plugin, one server process and a non-negative number of seconds; "
            f"got --plugin {args.plugin}, --ray {args.ray}, --tick-double {args.tick_double}"
        )
    options = dict(args.plugin_option)
    for flag, key, value in (("--lanes", "lanes", args.lanes), ("--tick-double", "processes", args.tick_double)):
        if value is not None and key in options:
            parser.error(f"{flag} and --plugin-option {key}=... both set {key}: give one")
    if args.lanes is not None:
        options["lanes"] = args.lanes
    if args.tick_double is not None:
        options["processes"] = 0  # the double replaces the ticks of the server process's own place
    named = {"tone": "serve_load.json", "moshi-tiny": "serve_load_moshi.json"}
    out = args.out or RESULTS / named.get(args.plugin, f"serve_load_{args.plugin.replace('-', '_')}.json")
    if args.out is None and args.ray:
        out = out.with_name(f"{out.stem}_ray{args.ray}.json")
    if args.out is None and args.tick_double is not None:
        out = RESULTS / f"serve_load_{args.plugin.replace('-', '_')}_tick_double_{args.sessions}.json"
    if args.out is None:  # a run with other appends or plugin options never replaces the default run's record
        extra = (
            ([f"append{args.append_ms}"] if args.append_ms != 200 else [])
            + [f"{name}_{value}" for name, value in args.plugin_option]
            + ([f"runs{args.runs}"] if args.runs > 1 else [])
        )
        out = out.with_name("_".join([out.stem, *extra]) + ".json") if extra else out

    personas = None
    if args.role is not None or args.voice is not None:
        personas = [
            {"instructions": (args.role or "").replace("{session}", str(i)), "voice": args.voice or "default"}
            for i in range(args.sessions)
        ]
    load_at_start = os.getloadavg()
    port = free_port()
    started = time.monotonic()
    server = _start_server(
        port, args.plugin, args.sessions, args.reply_lead, args.startup_timeout, args.ray, options, args.tick_double
    )
    startup_s = time.monotonic() - started
    load_before = os.getloadavg()
    try:
        pcm = speech_pattern(args.seconds)
        server_cpu, load_cpu = _cpu_seconds(server.pid), time.process_time()
        runs = []  # each run's sessions and its wall time
        load_started = time.monotonic()  # the zero of the stall timeline (``_stall_timeline``)
        schedule = None
        url = f"ws://127.0.0.1:{port}/v1/duplex"
        for run in range(args.runs):
            if run:
                _wait_for_no_sessions(port, args.patience)  # the last run's sessions end after their close
            started = time.monotonic()
            if args.staggered:
                loads, schedule = asyncio.run(
                    run_staggered(
                        url,
                        args.sessions,
                        args.seconds,
                        window_s,
                        args.seed + run,
                        patience_s=args.patience,
                        chunk_ms=args.append_ms,
                        personas=personas,
                    )
                )
            else:
                loads = asyncio.run(
                    run_load(url, pcm, args.sessions, patience_s=args.patience, chunk_ms=args.append_ms, personas=personas)
                )
            runs.append((loads, time.monotonic() - started))
            if args.runs > 1:
                print(f"run {run + 1} of {args.runs}: {_summary(*runs[-1])}", file=sys.stderr, flush=True)
        results = [result for run_results, _ in runs for result in run_results]
        wall_s = sum(seconds for _, seconds in runs)
        server_cpu_after, load_cpu = _cpu_seconds(server.pid), time.process_time() - load_cpu
        server_cpu = None if server_cpu is None or server_cpu_after is None else server_cpu_after - server_cpu
        load_after = os.getloadavg()
        model = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()["data"][0]
        plugin, server_memory = model["plugin"], model.get("memory")  # through Ray: per replica, below
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).json()
    finally:
        server.terminate()
        server.wait(timeout=30)

    replies = [reply for r in results for reply in r.replies]
    overall = _summary(results, wall_s)
    report = {
        "benchmark": "serve_load",
        "commit": _commit(),
        "worktree_dirty": bool(
            subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"], capture_output=True, text=True).stdout.strip()
        ),
        "command": shlex.join(["python", "bench/serve_load.py", *sys.argv[1:]]),
        "device": f"CPU: {_cpu_model()}, {os.cpu_count()} cores" + (f"; GPU: {_gpu()}" if _gpu() else ""),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "plugin": args.plugin
        + (" (test double, not a model)" if args.plugin == "tone" else "")
        + (
            f" (ticks replaced by a {args.tick_double:g} s sleep: a test double of the device)"
            if args.tick_double is not None
            else ""
        ),
        "sessions": args.sessions,
        "audio_seconds_per_session": args.seconds,
        "append_ms": args.append_ms,
        # None: every session started at once with the one pattern (0.8 s bursts, 0.7 s pauses)
        "staggered": {
            "seed": args.seed,
            "stagger_window_s": window_s,
            "distributions": {
                "start_delay_s": f"uniform(0, {window_s:g})",
                "turn_s": f"uniform({TURN_S[0]}, {TURN_S[1]})",
                "pause_s": f"min({PAUSE_MAX_S}, {PAUSE_MIN_S} + exponential(mean {PAUSE_MEAN_EXTRA_S}))",
            },
            "sessions": schedule,
        }
        if args.staggered
        else None,
        "plugin_options": dict(args.plugin_option),
        "reply_lead_s": args.reply_lead,
        "server_startup_seconds": round(startup_s, 2),
        "plugin_startup_seconds": plugin.get("startup_seconds") if plugin else None,
        "wall_seconds": round(wall_s, 2),
        # With --runs N: the figures below are over all N runs (N x sessions sessions, one after
        # another on the one server), and each run's own are here.
        "runs": [_summary(*run) for run in runs],
        "load_average_1min_before_and_after": [round(load_before[0], 2), round(load_after[0], 2)],
        # The machine's 1, 5 and 15 min load averages (os.getloadavg): before the server started,
        # when the load began and when it ended; other work on the machine shows here.
        "load_average_1_5_15min": {
            "before_server": [round(x, 2) for x in load_at_start],
            "load_start": [round(x, 2) for x in load_before],
            "load_end": [round(x, 2) for x in load_after],
        },
        "all_input_accounted": all(r.appended_bytes == r.committed_bytes for r in results),
        "all_output_complete_and_in_order": all(r.accounted for r in results),
        "errors": overall["errors"],
        "error_kinds": _error_kinds(results),
        "appended_bytes": sum(r.appended_bytes for r in results),
        "committed_bytes": sum(r.committed_bytes for r in results),
        "responses": overall["responses"],
        "turns": overall["turns"],
        "turns_ended_during_a_reply": overall["turns_ended_during_a_reply"],
        "reply_audio_bytes": sum(len(reply.audio) for reply in replies),
        "turn_end_to_first_audio_ms": overall["turn_end_to_first_audio_ms"],
        "session_start_to_created_ms": overall["session_start_to_created_ms"],
        "session_start_to_ready_ms": overall["session_start_to_ready_ms"],
        "session_start_to_first_audio_ms": overall["session_start_to_first_audio_ms"],
        "personas": personas,
        "reply_playback_stall_ms": overall["reply_playback_stall_ms"],
        "replies_that_stalled": overall["replies_that_stalled"],
        "stall_timeline": _stall_timeline(results, plugin, load_started),
        "model_load": _model_load(plugin, wall_s, args.sessions),
        "batch_ticks": _batch_ticks(plugin, wall_s),
        "lanes": _lanes(plugin),
        # the server process's peak allocated, reserved and device footprint (cadence_fx.memory), after the run;
        # a model in a worker process (moshi-full) has its own in plugin_after_run.memory_per_process
        "server_memory": server_memory,
        "server_loop_lag_ms": health.get("loop_lag_ms"),  # the whole server life, startup's wakes included
        # the server process's garbage collections since it was ready, per generation (serve/runtime/heap.py);
        # a model's worker process has its own in plugin_after_run.gc_per_process
        "server_gc": health.get("gc"),
        # CPU seconds during the load, all threads: the server process (its event loop, sessions and
        # schedulers; not a worker process's ticks) and this process (the load generator's sessions).
        # One Python process's interpreter runs one thread at a time: near 1 s per second it is the limit.
        "cpu_seconds_during_load": {
            "server_process": None if server_cpu is None else round(server_cpu, 2),
            "load_generator": round(load_cpu, 2),
            "wall": round(wall_s, 2),
        },
        "plugin_after_run": plugin,
    }
    if args.ray:
        # Per replica: the sessions it served (all ended by now) and its plugin's counters.
        share = -(-args.sessions // args.ray)
        report["model_load"] = None
        report["batch_ticks"] = None
        report["lanes"] = None
        report["plugin_startup_seconds"] = None
        report["server_memory"] = None
        report["plugin_after_run"] = None
        report["replicas"] = [
            {
                "replica": r["replica"],
                "status": r["status"],
                "sessions_served": r.get("sessions_ended"),
                "model_load": _model_load(m["plugin"], wall_s, share),
                "lanes": _lanes(m["plugin"]),
                "plugin_startup_seconds": m["plugin"].get("startup_seconds"),
                "server_memory": m["memory"],
                "plugin_after_run": m["plugin"],
            }
            for r, m in zip(health["replicas"], model["replicas"], strict=True)
        ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    if not (report["all_input_accounted"] and report["all_output_complete_and_in_order"] and report["errors"] == 0):
        sys.exit(1)


if __name__ == "__main__":
    main()
