"""The differential fuzzer's longer run, recorded as data: every subject of `tests/fuzz_subjects.py`
(the counter-branching models, every probe and example the tests bind, the families at their tiny
depths), many schedules each, every call compared with a stock copy's.

    python bench/fuzz.py --seeds 16 --steps 80 --model-seeds 2 --model-steps 16 --jobs 3 --out bench/results/fuzz_cpu.json
    python bench/fuzz.py --device cuda --seeds 4 --steps 40 --model-seeds 1 --model-steps 16 --jobs 4 \\
        --out bench/results/fuzz_cuda.json

On CUDA every subject is built and streamed on the GPU (`torch.set_default_device`), where its
verified classes replay as CUDA graphs. The `transformers` models transformed from their config
alone (tests/test_derive_transformers_fuzz.py, `derived_*`) are subjects too; `--subjects` picks.
A subject that cannot be built or streamed on the device is recorded with its error, and fails the run.

`--seeds`/`--steps` are the counter-branching models' schedules (no export: cheap); every other
subject exports a graph per class it meets, and runs `--model-seeds` schedules of `--model-steps`.
The record holds, per subject: calls, wrong outputs (must be 0; the first one's step when not),
classes, calls the graphs answered, guard failures by path, the other stock calls by reason,
refused classes counted by reason and each one's message, and the guard check's cost per call
(the operator's `_guarded` timed over the run).
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import platform
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# bench/ itself off the path (bench/moshi.py would shadow the vendor's `moshi`), the tests' kits on it
sys.path[:] = [str(ROOT / "tests"), *(p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench")]

from derive_kit import CASES  # noqa: E402
from fuzz_subjects import SUBJECTS as TESTED  # noqa: E402
from fuzzkit import TOYS, run, schedule  # noqa: E402
from test_derive_transformers_fuzz import subject as derived  # noqa: E402

from cadence_fx.pipeline import operator as driver  # noqa: E402

SUBJECTS = {**TESTED, **{f"derived_{name}": functools.partial(derived, name) for name in CASES}}


def _timed_guards() -> dict[str, float]:
    """Wraps the guard read of every bound operator, adding its seconds to the returned total."""
    total = {"seconds": 0.0, "calls": 0}
    guarded = driver.read_guards

    def timed(op, roots):
        started = time.perf_counter()
        try:
            return guarded(op, roots)
        finally:
            total["seconds"] += time.perf_counter() - started
            total["calls"] += 1

    driver.read_guards = timed
    return total


def _served(subject) -> int:
    """Calls the bound operators answered from their graphs so far, not the stock code."""
    return sum(op.counters.calls - op.counters.stock for op in subject.report.operators.values())


def _by_reason(refused: dict[str, str]) -> dict[str, int]:
    """Refused classes counted by the reason's first two parts ("verification: program")."""
    counts: dict[str, int] = {}
    for why in refused.values():
        reason = ":".join(why.split(":")[:2])
        counts[reason] = counts.get(reason, 0) + 1
    return dict(sorted(counts.items()))


_GUARDS: dict[str, float] | None = None
# Token2Wav's stock chunk runs the vendor's envelopes (seconds a chunk on a CPU): at most this many
# steps a schedule. The costliest subjects start first, so that `--jobs` processes end together.
CAPPED = {"token2wav": 8}
FIRST = ("token2wav", "hf_mimi", "moshi_mimi", "moshi_lm", "freeze_omni")


def fuzz(name: str, seeds: int, steps: int, device: str = "cpu") -> dict:
    """One subject's record: `seeds` schedules of `steps` steps, every call compared with stock;
    where the subject cannot be built or streamed on `device`, its error."""
    torch.set_default_device(device)
    try:
        return _fuzz(name, seeds, steps)
    except Exception as error:  # recorded and counted: the run fails
        print(f"{name}: error: {type(error).__name__}: {error}", flush=True)
        return {"seeds": seeds, "steps": steps, "calls": 0, "wrong": 0, "error": f"{type(error).__name__}: {str(error)[:500]}"}


def _fuzz(name: str, seeds: int, steps: int) -> dict:
    global _GUARDS
    _GUARDS = _GUARDS or _timed_guards()
    guards = _GUARDS
    started = time.perf_counter()
    subject = SUBJECTS[name]()
    before = dict(guards)
    served = _served(subject)  # a family's warm-up runs some at its transform
    calls = wrong = 0
    first = None
    for seed in range(seeds):
        outcome = run(subject, schedule(seed, steps, odd=bool(subject.odd), none=subject.takes_none), seed)
        calls, wrong = calls + outcome.calls, wrong + outcome.wrong
        first = first or (outcome.first_wrong and f"seed {seed}, {outcome.first_wrong}")
    checks = guards["calls"] - before["calls"]
    reasons = outcome.stock_by_reason
    record = {
        "seeds": seeds,
        "steps": steps,
        "calls": calls,
        "wrong": wrong,
        "first_wrong": first,
        "classes": outcome.classes,
        "graph_answered": _served(subject) - served,
        "guard_failures": {k.removeprefix("guard:"): n for k, n in sorted(reasons.items()) if k.startswith("guard:")},
        "stock_by_reason": {k: n for k, n in sorted(reasons.items()) if not k.startswith("guard:")},
        "refusals_by_reason": _by_reason(outcome.refused),
        "refused": outcome.refused,
        "guard_us_per_call": round(1e6 * (guards["seconds"] - before["seconds"]) / max(checks, 1), 1),
        # on CUDA, each operator's replay engine: graph replays, eager calls by reason, invalidations
        "replay": {
            name: engine.counters.as_dict() for name, engine in sorted(subject.report.replays.items()) if engine is not None
        },
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(
        f"{name}: {calls} calls, {wrong} wrong, {outcome.classes} classes, {record['graph_answered']} from the graphs, "
        f"stock {reasons}, refused {record['refusals_by_reason']}, guards {record['guard_us_per_call']} us a call, "
        f"{record['seconds']} s",
        flush=True,
    )
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=16, help="schedules per counter-branching model")
    parser.add_argument("--steps", type=int, default=80, help="steps per schedule of a counter-branching model")
    parser.add_argument("--model-seeds", type=int, default=3, help="schedules per other subject")
    parser.add_argument("--model-steps", type=int, default=24, help="steps per schedule of another subject")
    parser.add_argument("--subjects", default=",".join(sorted(SUBJECTS)), help=f"comma-separated, of {sorted(SUBJECTS)}")
    parser.add_argument("--jobs", type=int, default=1, help="subjects fuzzed at a time, each in a process of its own")
    parser.add_argument("--device", default="cpu", help="where the subjects are built and streamed: cpu or cuda")
    parser.add_argument("--out", type=Path, help="where to write the record (JSON)")
    args = parser.parse_args()
    if args.device not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda, got {args.device!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    names = [n for n in args.subjects.split(",") if n]
    unknown = sorted(set(names) - set(SUBJECTS))
    if unknown:
        parser.error(f"unknown subject(s) {unknown}; expected some of {sorted(SUBJECTS)}")
    if min(args.seeds, args.steps, args.model_seeds, args.model_steps, args.jobs) < 1:
        parser.error(
            f"--seeds, --steps, --model-seeds, --model-steps and --jobs must be at least 1, got {args.seeds}, "
            f"{args.steps}, {args.model_seeds}, {args.model_steps} and {args.jobs}"
        )
    names = sorted(names, key=lambda name: (FIRST.index(name) if name in FIRST else len(FIRST), name))
    tiers = {
        name: (args.seeds, args.steps)
        if name in TOYS
        else (args.model_seeds, min(args.model_steps, CAPPED.get(name, args.model_steps)))
        for name in names
    }
    if args.jobs == 1:
        subjects = {name: fuzz(name, *tiers[name], args.device) for name in names}
    else:  # each subject in a process of its own, `--jobs` at a time
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            subjects = dict(zip(names, pool.map(fuzz, names, *zip(*tiers.values()), [args.device] * len(names))))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    record = {
        "benchmark": "fuzz",
        "commit": commit,
        "date": time.strftime("%Y-%m-%d"),
        "command": "python "
        + " ".join([str(Path(sys.argv[0]).relative_to(ROOT)) if Path(sys.argv[0]).is_absolute() else sys.argv[0], *sys.argv[1:]]),
        "device": (
            f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
            if args.device == "cuda"
            else f"cpu ({platform.processor() or platform.machine()}), torch {torch.__version__}"
        ),
        "seeds": args.seeds,
        "steps": args.steps,
        "model_seeds": args.model_seeds,
        "model_steps": args.model_steps,
        "jobs": args.jobs,
        "subjects": dict(sorted(subjects.items())),
        "wrong": sum(s["wrong"] for s in subjects.values()),
        "errors": sorted(name for name, s in subjects.items() if "error" in s),
    }
    if args.out:
        args.out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 1 if record["wrong"] or record["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
