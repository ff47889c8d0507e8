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


@pytest.fixture(scope="module")
def one_torch_thread():
    """A module's tests on one torch thread, the reference and the runtime alike (a plugin's worker
    ticks on one): kernels may split a reduction by thread count, and the machine's cores are shared.
    A module asks for it with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
