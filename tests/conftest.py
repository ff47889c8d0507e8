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


@pytest.fixture(autouse=True)
def _deterministic_kernels_for_cuda_tests(request):
    """A transform pins no kernel switch (the caller does, before any stream): every cuda test
    compares against eager under the deterministic envelope, pinned here for the test's scope."""
    if request.node.get_closest_marker("cuda") is None:
        yield
        return
    from cadence_fx.determinism import deterministic

    with deterministic():
        yield
