"""Writes docs/results.md, the index of the current benchmark records.

    python bench/results_index.py           # (re)writes docs/results.md
    python bench/results_index.py --check   # writes nothing; exits 1 when docs/results.md differs

A current record is a JSON file directly in bench/results/: one per benchmark, model, size and arm
set, the newest commit of them. Older runs and run variants are kept in bench/results/history/ and
are not indexed. For each record the page lists its headline figures (read from the record, never
typed in), the command that wrote it, its commit, the device and the commit's date (the record's
`date`, the date of its commit, written into each current record so a shallow clone indexes it
too; from git for a record without one). tests/test_results_index.py regenerates the page and fails
when the committed one differs, so a record added or moved without running this script fails CI.

Every record must carry "commit", "command" and "device" (bench/soak.py names the device
"machine"); one that lacks any is an error naming the record and the field. NOT_RECORDED names the
records whose script never wrote a field, and the page says "not recorded" for it.

So that a page can cite a current record by a name that outlives the next run, the script refuses
(naming the file) a top-level file whose name carries a commit hash (7 to 40 hex digits between
`_`, `-` or `.`), two current records of one key, and a current record whose name is also a record's
in history/. The key is read from the record's contents (`key`): the benchmark, whether it ran on
a GPU, and the parts KEYS names for it (model, size, arms, and the load point where a benchmark's
runs at several are cited side by side: a serve_load record's sessions, a capacity run's streams).
A record it replaces moves to history/ with its commit in its name (history/moshi_7b5a062.json).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "results.md"
REQUIRED = ("commit", "command", "device")
ALIASES = {"device": ("machine",)}  # bench/soak.py writes the machine as "machine"
# record -> the fields its script never wrote (shown as "not recorded", never filled in by hand)
NOT_RECORDED = {"interop.json": ("command", "device")}  # bench/interop.py writes only the commit


class RecordError(ValueError):
    """A record the index cannot describe; the message names the record and what it lacks."""


# ---------------------------------------------------------------------------------------------
# Formatting


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f} ms"


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def _gb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e9:.2f} GB"


def _n(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _yes(flag: object) -> str:
    return {True: "yes", False: "no"}.get(flag, str(flag))  # type: ignore[arg-type]


def _stats(s: dict | None) -> str:
    """p50 / p95 of a stats dict, in ms."""
    if not s:
        return "-"
    return f"p50 {s['p50']:,.1f} / p95 {s['p95']:,.1f} ms"


# ---------------------------------------------------------------------------------------------
# Headline figures, one function per benchmark


def _token2wav(r: dict) -> list[str]:
    out = []
    for name, arm in (r.get("arms") or {}).items():
        line = f"`{name}`: steady chunk {_stats(arm.get('chunk_stats_ms'))}"
        if arm.get("cfm_loop_stats_ms"):
            line += f", CFM loop p50 {_ms(arm['cfm_loop_stats_ms']['p50'])}"
        line += f"; peak allocated {_gib(arm.get('peak_allocated_bytes'))}"
        line += (
            f"; mel {arm.get('mel_equal_chunks')}/{arm.get('chunks')} and PCM "
            f"{arm.get('pcm_equal_chunks')}/{arm.get('chunks')} chunks bit-identical to "
            f"`{arm.get('compared_with') or 'eager'}`"
        )
        out.append(line)
    capacity = r.get("capacity")
    if capacity:
        lanes = capacity.get("lanes")
        where = f"{lanes} replay lanes" if lanes else "one set of graphs"
        rounds = "; ".join(
            f"{_n(x['sessions'], 'stream')}: round p50 {_ms(x['round_ms_steady']['p50'])}, "
            f"{'real time' if x['keeps_real_time'] else 'behind real time'}"
            + (f", {x['streams_exact']}/{x['streams_checked']} streams exact" if "streams_exact" in x else "")
            for x in capacity["rounds"]
        )
        largest = capacity.get("largest_real_time_N") or "none of those run"
        out.append(
            f"capacity on {where} ({capacity['chunks_per_stream']} chunks a stream): largest N in real "
            f"time **{largest}**; {rounds}"
        )
    return out


def _token2wav_setup(r: dict) -> list[str]:
    lanes = "; ".join(
        f"lane {x['lane']}: {x['transform_s']:.1f} s ({x['exported']} classes exported, {x['reused']} reused)" for x in r["lanes"]
    )
    return [
        f"transform at {r['depth']} size: {lanes}",
        f"last lane's mel: {r['last_lane_mel_equal_chunks']}/{r['chunks']} chunks equal to the stock flow",
    ]


def _token2wav_batch_probe(r: dict) -> list[str]:
    return [
        "; ".join(
            f"{n} streams batched: {s['streams_bit_identical']} of {s['of']} bit-identical "
            f"(max difference {s['max_abs_difference']:.1e})"
            for n, s in r["streams"].items()
        )
    ]


def _token2wav_batch_memory(r: dict) -> list[str]:
    return [
        f"{size} (predicted): "
        + "; ".join(
            f"{t['streams']} streams at capacity {t['capacity']}: {t['device_gib']} GiB "
            f"on the device, {t['host_pinned_gib']} GiB pinned host"
            for t in s["streams"]
        )
        for size, s in r["sizes"].items()
    ]


def _moshi(r: dict) -> list[str]:
    out = []
    for name, arm in r["arms"].items():
        eq = arm.get("streams_equal_to_eager", {})
        same = ", ".join(f"{mode} {v['tokens']}/{v['of']} tokens and {v['pcm']}/{v['of']} PCM" for mode, v in eq.items())
        out.append(f"`{name}`: steady frame {_stats(arm['frame_ms_steady'])}; equal to eager: {same}")
    summary = r.get("summary") or {}
    if "cadence_over_vendor_p50" in summary:
        out.append(f"cadence-fx over the vendor's CUDA graphs (frame p50): **{summary['cadence_over_vendor_p50']:.2f}x**")
    return out


def _moshi_slots(r: dict) -> list[str]:
    out = []
    for b, size in r["slots"].items():
        parts = []
        for name, arm in size["arms"].items():
            part = f"`{name}` tick {_stats(arm.get('tick_ms_steady'))}"
            eq = arm.get("slots_equal_to_eager")
            if eq:
                part += (
                    f", {eq['tokens_equal_slots']}/{eq['of']} slots' tokens and "
                    f"{eq['pcm_equal_slots']}/{eq['of']} PCM equal to eager"
                )
            if name == "cadence":
                part += f", peak allocated {_gb(arm.get('peak_allocated_bytes'))}"
            parts.append(part)
        out.append(f"B = {b}: " + "; ".join(parts))
    return out


def _serve_load(r: dict) -> list[str]:
    first = r.get("turn_end_to_first_audio_ms") or {}
    stall = r.get("reply_playback_stall_ms") or {}
    runs = len(r.get("runs") or []) or 1
    line = (
        f"{r['plugin']}: {r['sessions']} sessions x {r['audio_seconds_per_session']:g} s"
        + (f", {runs} runs" if runs > 1 else "")
        + f"; {r.get('responses')} replies; turn end to first audio p50 {_ms(first.get('p50'))} / "
        f"p95 {_ms(first.get('p95'))}; {r.get('replies_that_stalled')} replies stalled, stall p95 "
        f"{_ms(stall.get('p95'))}"
    )
    ledger = (
        f"every appended byte committed: {_yes(r.get('all_input_accounted'))}; every reply complete and "
        f"in order: {_yes(r.get('all_output_complete_and_in_order'))}; errors: {r.get('errors')}"
    )
    ready, audio = r.get("session_start_to_ready_ms"), r.get("session_start_to_first_audio_ms")
    if not (ready and audio):  # records before the loadgen timed each session's start
        return [line, ledger]
    start = (
        f"session start to ready p50 {_ms(ready['p50'])} / p95 {_ms(ready['p95'])} / max {_ms(ready['max'])}; "
        f"to first audio p50 {_ms(audio['p50'])} / p95 {_ms(audio['p95'])} / max {_ms(audio['max'])}"
    )
    return [line, ledger, start]


def _gpu_tests(r: dict) -> list[str]:
    files = sorted({name.split("::")[0] for name in r["tests"]})
    out = [
        f"**{r['passed']} passed, {r['failed']} failed, {r['skipped']} skipped** over {len(files)} test files "
        f"(torch {r.get('torch')})"
    ]
    for test, figures in (r.get("measured") or {}).items():
        out.append(f"`{test}`: " + ", ".join(f"{k} {v:,.2f}" for k, v in figures.items()))
    return out


def _interop(r: dict) -> list[str]:
    return [f"{x['client']} {x['version']}: {len(x['passed'])} checks passed, {len(x['failed'])} failed" for x in r["results"]]


def _soak(r: dict) -> list[str]:
    t = r["totals"]
    return [
        f"{r['sessions']} sessions for {r['minutes']:g} minutes ({r['model']}): {t['events']:,} events, "
        f"{t['resumes']:,} resumes, {r['lost_events']} lost; server errors {r['server_errors']}; "
        f"input accounted: {_yes(r['input_accounted'])}; memory flat: {_yes(r['memory']['memory_flat'])}"
    ]


def _binding_wide(r: dict) -> list[str]:
    streams = ", ".join(f"{s['seconds']:.2f} s" for s in r["streams"])
    exact = all(s["bit_identical"] for s in r["streams"])
    return [
        f"{r['classes_met']} of {r['catalog_width']} catalog classes met; streams of {r['calls_per_stream']} "
        f"calls took {streams} (stock {r['stock_stream_seconds']:.2f} s); all bit-identical: {_yes(exact)}"
    ]


def _fuzz(r: dict) -> list[str]:
    subjects = r["subjects"]
    calls = sum(s["calls"] for s in subjects.values())
    answered = sum(s.get("graph_answered", 0) for s in subjects.values())
    guards = sorted(s["guard_us_per_call"] for s in subjects.values())
    schedules = f"{r['seeds']} schedules of {r['steps']} steps each"
    if "model_seeds" in r:
        schedules = f"the counter-branching models {schedules}, the others {r['model_seeds']} of {r['model_steps']}"
    return [
        f"{calls} calls over {len(subjects)} models ({schedules}): {r['wrong']} wrong outputs; "
        f"{answered} answered from the graphs; guard check per call {guards[0]:g} to {guards[-1]:g} us"
    ]


def _fallback(r: dict) -> list[str]:
    out = []
    for model, cases in r["models"].items():
        out.append(
            f"{model}: "
            + "; ".join(
                f"{case} {c['bound_cpu_ms_median']:.2f} ms through the bound model, {c['stock_cpu_ms_median']:.2f} ms stock "
                f"(CPU time, median of {c['calls']})"
                for case, c in cases.items()
            )
        )
    return out


def _personaplex_prompt(r: dict) -> list[str]:
    p, stepped, restored = r["prompt"], r["vendor_priming"], r["restore"]
    return [
        f"a {p['voice_seconds']:g} s voice and {p['role_tokens']} role tokens ({p['steps']} steps, {r['config']}): "
        f"the vendor steps them in {stepped['wall_ms_median']:.1f} ms ({stepped['cpu_ms_median']:.1f} ms of CPU), a "
        f"prompt state of {p['state_bytes']} B is copied in in {restored['wall_ms_median']:.3f} ms (medians); "
        f"in a slot, {r['slots_ticks_to_prime']} "
        f"ticks at {r['slots_prompt_rate']} steps a tick"
    ]


def _vllm_omni_bench(r: dict) -> list[str]:
    s = r["summary"]
    ttfp, rtf, stream = s["ttfp_ms"], s["rtf"], s["stream_ttfp_ms"]
    return [
        f"vLLM-Omni's duplex benchmark (generate) on {r['model']}, {len(r['samples'])} samples: ttfp p50 "
        f"{_ms(ttfp['p50'])} (mean {_ms(ttfp['mean'])}), rtf p50 {rtf['p50']:.3f} (mean {rtf['mean']:.3f}), "
        f"stream_ttfp p50 {_ms(stream['p50'])} (mean {_ms(stream['mean'])}), their definitions",
        f"errors: {r['errors']}; appends with video frames: {r['appends_with_video_frames']} of {r['appends']}; "
        f"load average {r['load_average_start'][0]:g} at start, {r['load_average_end'][0]:g} at end",
    ]


def _pipeline_host(r: dict) -> list[str]:
    host = [run["host_ms"]["p50"] for run in r["runs"]]
    return [f"host time a frame, p50 over {len(host)} runs: {min(host):.2f} to {max(host):.2f} ms ({r['config']})"]


def _symbolic_export(r: dict) -> list[str]:
    out = []
    for model, classes in r["models"].items():
        outcomes: dict[str, int] = {}
        for c in classes:
            outcomes[c["symbolic"]["outcome"]] = outcomes.get(c["symbolic"]["outcome"], 0) + 1
        out.append(
            f"{model}: {len(classes)} classes exported again symbolically: "
            + ", ".join(f"{n} {o}" for o, n in sorted(outcomes.items()))
        )
    return out


HEADLINES: dict[str, Callable[[dict], list[str]]] = {
    "binding_wide": _binding_wide,
    "fallback": _fallback,
    "fuzz": _fuzz,
    "gpu_tests": _gpu_tests,
    "interop": _interop,
    "moshi": _moshi,
    "moshi_slots": _moshi_slots,
    "personaplex_prompt": _personaplex_prompt,
    "pipeline_host": _pipeline_host,
    "serve_load": _serve_load,
    "soak": _soak,
    "symbolic_export": _symbolic_export,
    "token2wav": _token2wav,
    "token2wav_batch_memory": _token2wav_batch_memory,
    "token2wav_batch_probe": _token2wav_batch_probe,
    "token2wav_setup": _token2wav_setup,
    "vllm_omni_bench": _vllm_omni_bench,
}


def kind(record: dict) -> str | None:
    """The benchmark that wrote a record (bench/gpu_tests.py and bench/interop.py do not name it)."""
    if record.get("benchmark"):
        return record["benchmark"]
    if "tests" in record and "passed" in record:
        return "gpu_tests"
    if "results" in record and "node" in record:
        return "interop"
    return None


# ---------------------------------------------------------------------------------------------
# One current record per key

COMMIT_IN_NAME = re.compile(r"(?:^|[_.-])([0-9a-f]{7,40})(?=[_.-]|$)")


def _arms(names: Iterable[str]) -> str:
    """A record's arms, in its order (a list of names, or a dict of arms by name)."""
    return ", ".join(names) or "none"


def _moshi_key(r: dict) -> dict[str, object]:
    return {"config": r.get("config"), "arms": _arms(r.get("arms") or [])}


def _moshi_slots_key(r: dict) -> dict[str, object]:
    slots = r.get("slots") or {}
    arms = dict.fromkeys(arm for size in slots.values() for arm in size.get("arms", {}))
    return {"config": r.get("config"), "slots": ",".join(slots), "arms": _arms(arms)}


def _token2wav_key(r: dict) -> dict[str, object]:
    """A capacity run's streams and lanes are part of its key: the sweeps are cited side by side."""
    capacity = r.get("capacity") or {}
    streams = ",".join(str(x["sessions"]) for x in capacity.get("rounds") or [])
    return {
        "depth": r.get("depth"),
        "arms": _arms(r.get("arms") or []),
        "capacity": f"{streams} streams on {capacity.get('lanes') or 1} lane(s)" if streams else "none",
    }


def _token2wav_setup_key(r: dict) -> dict[str, object]:
    return {"depth": r.get("depth"), "lanes": len(r.get("lanes") or [])}


def _serve_load_key(r: dict) -> dict[str, object]:
    """The plugin names model and size (a test double says so in it); sessions, lanes, Ray replicas
    and staggered arrivals are load points cited side by side, and so is a Token2Wav plugin's batched
    mode (its ``slots``: the sessions as the rows of one batch instead of lanes). Run options (--runs,
    --append-ms, --reply-lead, other plugin options) are not: a run with another is a variant, kept in
    history/."""
    lanes = r.get("lanes")
    slots = (r.get("plugin_options") or {}).get("slots") if str(r.get("plugin")).startswith("token2wav") else None
    return {
        "plugin": r.get("plugin"),
        "sessions": r.get("sessions"),
        "lanes": lanes.get("lanes", 1) if isinstance(lanes, dict) else 1,
        "replicas": len(r.get("replicas") or []) or 1,
        "staggered": bool(r.get("staggered")),
        **({"rows of one batch of": slots} if slots is not None else {}),
    }


def _soak_key(r: dict) -> dict[str, object]:
    return {"model": r.get("model"), "sessions": r.get("sessions")}


def _config_key(r: dict) -> dict[str, object]:
    return {"config": r.get("config")}


def _model_key(r: dict) -> dict[str, object]:
    return {"model": r.get("model")}


# benchmark -> the parts of its key beyond the benchmark and the device; one not named here has one
# current record per device (its script takes no model, size or arms)
KEYS: dict[str, Callable[[dict], dict[str, object]]] = {
    "moshi": _moshi_key,
    "moshi_slots": _moshi_slots_key,
    "personaplex_prompt": _config_key,
    "pipeline_host": _config_key,
    "serve_load": _serve_load_key,
    "soak": _soak_key,
    "token2wav": _token2wav_key,
    "token2wav_setup": _token2wav_setup_key,
    "vllm_omni_bench": _model_key,
}


def key(record: dict) -> tuple[tuple[str, object], ...]:
    """The (benchmark, model, size, arms) a record is the current one of, read from its contents.
    Where it ran is part of it (a CPU run and a GPU run are different arms: bench/fuzz.py --device)."""
    bench = kind(record)
    device = f"{record.get('device') or ''} {record.get('machine') or ''}"
    parts = {"benchmark": bench, "on a GPU": bool(re.search(r"nvidia|gpu|cuda", device, re.I))}
    return tuple({**parts, **(KEYS[bench](record) if bench in KEYS else {})}.items())


def describe(k: tuple[tuple[str, object], ...]) -> str:
    return "; ".join(f"{name} {_yes(value) if isinstance(value, bool) else value}" for name, value in k)


def check_name(name: str, results: Path) -> None:
    """A RecordError naming a top-level file whose name carries a commit, or that a record in
    history/ has too."""
    found = COMMIT_IN_NAME.search(Path(name).stem)
    if found:
        raise RecordError(
            f"bench/results/{name}: its name carries the commit {found.group(1)}; name a current record by its "
            f"benchmark, model, size and arms only (its commit is inside it), and an older one in bench/results/history/"
        )
    if (results / "history" / name).exists():
        raise RecordError(
            f"bench/results/{name} has the name of bench/results/history/{name}; put the older record's commit in "
            f"its name (git mv it to history/{Path(name).stem}_<commit>{Path(name).suffix})"
        )


# ---------------------------------------------------------------------------------------------
# Provenance


def provenance(name: str, record: dict) -> dict[str, str | None]:
    """commit, command and device of a record, or a RecordError naming what it lacks."""
    found: dict[str, str | None] = {}
    missing = []
    for field in REQUIRED:
        value = record.get(field)
        for alias in ALIASES.get(field, ()):
            value = value if value else record.get(alias)
        if not value and field not in NOT_RECORDED.get(name, ()):
            missing.append(field)
        found[field] = value or None
    if missing:
        raise RecordError(
            f"bench/results/{name} lacks {', '.join(repr(f) for f in missing)}: every current record must carry "
            f"commit, command and device (rerun its benchmark, or move the record to bench/results/history/)"
        )
    return found


def commit_date(name: str, commit: str, root: Path = ROOT) -> str:
    """The date (YYYY-MM-DD) of a record's commit, from git (for a record that does not carry its
    own `date`)."""
    done = subprocess.run(["git", "show", "-s", "--format=%cs", f"{commit}^{{commit}}"], cwd=root, capture_output=True, text=True)
    if done.returncode != 0 or not done.stdout.strip():
        raise RecordError(
            f"bench/results/{name}: commit {commit} is not in this repository's history "
            f"(git: {done.stderr.strip() or 'no output'})"
        )
    return done.stdout.strip()


# ---------------------------------------------------------------------------------------------
# The page


def entries(results: Path = RESULTS, root: Path = ROOT) -> list[dict]:
    """One entry per current record, sorted by benchmark then name."""
    found = []
    for path in sorted(p for p in results.iterdir() if p.is_file()):
        check_name(path.name, results)
    current: dict[tuple, str] = {}
    for path in sorted(results.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise RecordError(f"bench/results/{path.name} is not JSON: {exc}") from exc
        if not isinstance(record, dict):
            raise RecordError(f"bench/results/{path.name} is not a JSON object")
        bench = kind(record)
        if bench not in HEADLINES:
            raise RecordError(
                f"bench/results/{path.name}: no headline reader for benchmark {bench!r}; "
                f"add one to HEADLINES in bench/results_index.py"
            )
        prov = provenance(path.name, record)
        k = key(record)
        if k in current:
            raise RecordError(
                f"bench/results/{current[k]} and bench/results/{path.name} are both the current record of "
                f"{describe(k)}; keep the newer one and move the other to bench/results/history/ with its commit in its name"
            )
        current[k] = path.name
        try:
            figures = HEADLINES[bench](record)
        except (KeyError, TypeError) as exc:
            raise RecordError(f"bench/results/{path.name}: its {bench} figures lack {exc}") from exc
        found.append(
            {
                "name": path.name,
                "benchmark": bench,
                **prov,
                "date": record.get("date") or commit_date(path.name, prov["commit"], root),
                "figures": figures,
                "key": describe(k),
            }
        )
    return sorted(found, key=lambda e: (e["benchmark"], e["name"]))


def render(results: Path = RESULTS, root: Path = ROOT) -> str:
    records = entries(results, root)
    others = sorted(p.name for p in results.iterdir() if p.is_file() and p.suffix != ".json")
    lines = [
        "# Results index",
        "",
        "<!-- written by bench/results_index.py from bench/results/*.json; do not edit: run `python bench/results_index.py` -->",
        "",
        f"The {len(records)} current benchmark records in [bench/results/](../bench/results/): one per benchmark, "
        "model, size and arm set (read from the record: each section below names it), the newest commit of "
        "them, named by that key alone. Older runs and run variants are kept, their commits in their names, in "
        "[bench/results/history/](../bench/results/history/), and the pages that discuss them cite them "
        "there. Every figure below is read from its record by `bench/results_index.py`; the date is the "
        "recorded commit's, from git. [benchmarks.md](benchmarks.md) says how to run each benchmark on "
        "your own machine.",
        "",
        "| record | benchmark | commit | date | device |",
        "|---|---|---|---|---|",
    ]
    for e in records:
        lines.append(
            f"| [{e['name']}](../bench/results/{e['name']}) | {e['benchmark']} | "
            f"`{(e['commit'] or '')[:7]}` | {e['date']} | {e['device'] or 'not recorded'} |"
        )
    current = None
    for e in records:
        if e["benchmark"] != current:
            current = e["benchmark"]
            lines += ["", f"## {current}"]
        lines += ["", f"### {e['name']}", ""]
        lines += [f"- {figure}" for figure in e["figures"]]
        lines += [
            "",
            f"The current record of {e['key']}.",
            "",
            f"[Record](../bench/results/{e['name']}); commit `{e['commit']}` ({e['date']}); device: "
            f"{e['device'] or 'not recorded'}; command: " + (f"`{e['command']}`" if e["command"] else "not recorded") + ".",
        ]
    if others:
        lines += ["", "## Other files", "", "Figures the pages show, kept beside the records (not records themselves):", ""]
        lines += [f"- [{name}](../bench/results/{name})" for name in others]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if docs/results.md differs")
    args = parser.parse_args(argv)
    try:
        text = render()
    except RecordError as exc:
        print(f"results_index: {exc}", file=sys.stderr)
        return 2
    if args.check:
        same = PAGE.exists() and PAGE.read_text() == text
        print(f"{PAGE.relative_to(ROOT)} is {'up to date' if same else 'stale: run python bench/results_index.py'}")
        return 0 if same else 1
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)} ({text.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
