"""Run the `cuda`-marked tests and record the run as data: which tests, device, pass/fail.

    python bench/gpu_tests.py bench/results/gpu_tests.json tests/test_token2wav_cuda.py ...

A run longer than one sitting on the GPU machine allows is made in parts: ``--after EARLIER.json``
(a record of the same commit on the same device; repeated for parts that ran side by side) adds this
part's tests to those records', and the record lists each part's command (``parts``):

    python bench/gpu_tests.py part1.json tests/test_token2wav_cuda.py
    python bench/gpu_tests.py bench/results/gpu_tests.json --after part1.json tests/test_moshi_cuda.py ...
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# Run as a script, this file's folder is sys.path[0], where `import moshi` would find
# bench/moshi.py instead of the vendor's package.
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != Path(__file__).resolve().parent]

import pytest  # noqa: E402
import torch  # noqa: E402

from cadence_fx.determinism import settings  # noqa: E402
from cadence_fx.report import measured_commit  # noqa: E402


class _Recorder:
    def __init__(self) -> None:
        self.results: dict[str, dict] = {}

    def pytest_runtest_logreport(self, report) -> None:
        entry = self.results.setdefault(report.nodeid, {"outcome": "passed", "seconds": 0.0})
        entry["seconds"] = round(entry["seconds"] + report.duration, 3)
        if report.failed:
            entry["outcome"] = "failed"
            entry["error"] = str(report.longrepr)[-2000:]
        elif report.skipped and entry["outcome"] == "passed":
            entry["outcome"] = "skipped"
            entry["reason"] = str(report.longrepr)[-500:]

    def pytest_collectreport(self, report) -> None:
        """A whole module skipped or broken at collection counts too (e.g. a missing package)."""
        if report.skipped or report.failed:
            self.results[report.nodeid] = {
                "outcome": "skipped" if report.skipped else "failed",
                "seconds": 0.0,
                "reason": str(report.longrepr)[-500:],
            }


def _earlier(path: str, commit: str | None, device: str) -> dict:
    """The record a part continues: of the same commit, on the same device."""
    with open(path) as f:
        earlier = json.load(f)
    if (earlier.get("commit"), earlier.get("device")) != (commit, device):
        raise SystemExit(
            f"--after {path}: that record is of commit {earlier.get('commit')} on {earlier.get('device')}; "
            f"this run is of commit {commit} on {device}: a record's parts are of one commit on one device"
        )
    return earlier


def _merged(records: list[dict]) -> dict | None:
    """Earlier parts as one record: their parts, tests and measured figures together."""
    if not records:
        return None
    parts = [p for r in records for p in (r.get("parts") or [{"command": r["command"], "exit_code": r["exit_code"]}])]
    return {
        "parts": parts,
        "tests": {k: v for r in records for k, v in r["tests"].items()},
        "measured": {k: v for r in records for k, v in r.get("measured", {}).items()},
    }


def main(out: str, paths: list[str], after: list[str] | None = None) -> int:
    commit = measured_commit()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    earlier = _merged([_earlier(path, commit, device) for path in after or []])
    recorder = _Recorder()
    code = pytest.main([*paths, "-q", "-m", "cuda", "-p", "no:cacheprovider"], plugins=[recorder])
    part = {"command": " ".join([sys.executable, *sys.argv]), "exit_code": int(code)}
    parts = (earlier["parts"] if earlier else []) + [part]
    tests = (earlier["tests"] if earlier else {}) | recorder.results
    measured = {
        name: dict(module.MEASURED)
        for name, module in sorted(sys.modules.items())
        if name.startswith(("test_", "tests.")) and isinstance(getattr(module, "MEASURED", None), dict)
    }
    outcomes = [r["outcome"] for r in tests.values()]
    record = {
        "command": part["command"] if len(parts) == 1 else " && ".join(p["command"] for p in parts),
        "parts": parts,
        "commit": commit,
        "device": device,
        "torch": torch.__version__,
        "determinism": settings(),
        "passed": outcomes.count("passed"),
        "failed": outcomes.count("failed"),
        "skipped": outcomes.count("skipped"),
        "exit_code": max(p["exit_code"] for p in parts),
        "tests": tests,
        "measured": (earlier["measured"] if earlier else {}) | measured,
    }
    with open(out, "w") as f:
        json.dump(record, f, indent=2, default=str)
    return int(code)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the record to write (JSON)")
    parser.add_argument("paths", nargs="+", help="test files or folders")
    parser.add_argument(
        "--after",
        metavar="EARLIER.json",
        action="append",
        help="an earlier part's record of the same commit and device (repeatable)",
    )
    args = parser.parse_args()
    sys.exit(main(args.out, args.paths, args.after))
