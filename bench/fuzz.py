"""The differential fuzzer's longer run, recorded as data: every subject of `tests/fuzzkit.py`,
many schedules each, every call compared with the stock model's.

    python bench/fuzz.py --seeds 16 --steps 80 --out bench/results/fuzz_cpu.json

The record holds, per subject: calls, wrong outputs (must be 0; the first one's step when not),
classes, stock calls by reason (guard failures by path among them), refused classes with why,
and the guard check's cost per call (the operator's `_guarded` timed over the run).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from fuzzkit import SUBJECTS, run, schedule  # noqa: E402

from cadence_fx.pipeline import operator as driver  # noqa: E402


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=16, help="schedules per subject")
    parser.add_argument("--steps", type=int, default=80, help="steps per schedule")
    parser.add_argument("--subjects", default=",".join(sorted(SUBJECTS)), help=f"comma-separated, of {sorted(SUBJECTS)}")
    parser.add_argument("--out", type=Path, help="where to write the record (JSON)")
    args = parser.parse_args()
    names = [n for n in args.subjects.split(",") if n]
    unknown = sorted(set(names) - set(SUBJECTS))
    if unknown:
        parser.error(f"unknown subject(s) {unknown}; expected some of {sorted(SUBJECTS)}")
    if args.seeds < 1 or args.steps < 1:
        parser.error(f"--seeds and --steps must be at least 1, got {args.seeds} and {args.steps}")
    guards = _timed_guards()
    subjects = {}
    for name in names:
        subject = SUBJECTS[name]()
        before = dict(guards)
        calls = wrong = 0
        first = None
        started = time.perf_counter()
        for seed in range(args.seeds):
            outcome = run(subject, schedule(seed, args.steps, odd=bool(subject.odd), none=subject.takes_none), seed)
            calls, wrong = calls + outcome.calls, wrong + outcome.wrong
            first = first or (outcome.first_wrong and f"seed {seed}, {outcome.first_wrong}")
        checks = guards["calls"] - before["calls"]
        subjects[name] = {
            **{k: v for k, v in outcome.as_dict().items() if k not in ("calls", "wrong", "first_wrong")},
            "calls": calls, "wrong": wrong, "first_wrong": first,
            "guard_us_per_call": round(1e6 * (guards["seconds"] - before["seconds"]) / max(checks, 1), 1),
            "seconds": round(time.perf_counter() - started, 1),
        }
        print(f"{name}: {calls} calls, {wrong} wrong, {subjects[name]['classes']} classes, "
              f"stock {subjects[name]['stock_by_reason']}, guards {subjects[name]['guard_us_per_call']} us a call",
              flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    record = {
        "benchmark": "fuzz", "commit": commit, "date": time.strftime("%Y-%m-%d"),
        "command": "python " + " ".join([str(Path(sys.argv[0]).relative_to(ROOT)) if Path(sys.argv[0]).is_absolute() else sys.argv[0], *sys.argv[1:]]),
        "device": f"cpu ({platform.processor() or platform.machine()}), torch {torch.__version__}",
        "seeds": args.seeds, "steps": args.steps, "subjects": subjects,
        "wrong": sum(s["wrong"] for s in subjects.values()),
    }
    if args.out:
        args.out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 1 if record["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
