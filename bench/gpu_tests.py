"""Run the `cuda`-marked tests and record the run as data: which tests, device, pass/fail.

    python bench/gpu_tests.py bench/results/gpu_tests.json tests/test_token2wav_cuda.py ...
"""

from __future__ import annotations

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
            self.results[report.nodeid] = {"outcome": "skipped" if report.skipped else "failed", "seconds": 0.0,
                                           "reason": str(report.longrepr)[-500:]}


def main(out: str, paths: list[str]) -> int:
    recorder = _Recorder()
    code = pytest.main([*paths, "-q", "-m", "cuda", "-p", "no:cacheprovider"], plugins=[recorder])
    outcomes = [r["outcome"] for r in recorder.results.values()]
    commit = measured_commit()
    record = {
        "command": " ".join([sys.executable, *sys.argv]),
        "commit": commit,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "determinism": settings(),
        "passed": outcomes.count("passed"),
        "failed": outcomes.count("failed"),
        "skipped": outcomes.count("skipped"),
        "exit_code": int(code),
        "tests": recorder.results,
        "measured": {name: dict(module.MEASURED) for name, module in sorted(sys.modules.items())
                     if name.startswith(("test_", "tests.")) and isinstance(getattr(module, "MEASURED", None), dict)},
    }
    with open(out, "w") as f:
        json.dump(record, f, indent=2, default=str)
    return int(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
