"""Suite-wide rule: only tests marked `cuda` may skip; any other skip is a failure, with its reason.

A package the install provides is imported, never `importorskip`ped, so a missing one fails too.
"""

from __future__ import annotations

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and item.get_closest_marker("cuda") is None and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"{item.nodeid} skipped without the `cuda` marker (only cuda tests may skip): {reason}"


def pytest_collectreport(report):
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"{report.nodeid} was skipped at import (only cuda tests may skip): {reason}"
