"""The differential fuzzer's CI tier (`tests/fuzzkit.py`): random schedules at fixed seeds over
every subject, each call's output, retained state and host counters compared with the stock
model's: no wrong output, whatever the order of arrival, and the graphs did run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fuzzkit import SUBJECTS, run, schedule

SEEDS = (0, 1, 2, 3)
STEPS = 40


@pytest.mark.parametrize("name", sorted(SUBJECTS))
def test_random_schedules_never_give_a_wrong_output(name):
    subject = SUBJECTS[name]()
    total = 0
    for seed in SEEDS:
        steps = schedule(seed, STEPS, odd=bool(subject.odd), none=subject.takes_none)
        outcome = run(subject, steps, seed)
        assert (outcome.wrong, outcome.first_wrong) == (0, None), outcome.as_dict()
        total += outcome.calls
    graph_calls = sum(op.counters.graph_calls for op in subject.report.operators.values())
    calls = sum(op.counters.calls for op in subject.report.operators.values())
    assert calls == total and graph_calls > 0


def test_the_schedules_cover_every_kind_of_step_and_every_opening():
    kinds, openings = set(), set()
    for seed in range(12):
        steps = schedule(seed, STEPS, odd=True, none=True)
        kinds |= {kind for kind, _ in steps}
        openings.add(tuple(steps[:3]))
    assert kinds == {"call", "odd", "reset", "none"}
    assert {("call", 0), ("odd", 0)} <= {opening[0] for opening in openings}
    assert len(openings) >= 3


_PROCESS = """
import json, sys
sys.path.insert(0, {tests!r})
from fuzzkit import SUBJECTS, run, schedule
subject = SUBJECTS["rolling"]()
for seed in {history}:  # this process's history first
    run(subject, schedule(seed, 30, odd=True, none=True), seed)
outcome = run(subject, schedule(99, 30, odd=True, none=True), 99)
print(json.dumps(outcome.wrong))
"""


def test_two_processes_with_different_histories_are_both_exact():
    tests = str(Path(__file__).parent)
    wrong = []
    for history in ([], [5, 6, 7]):
        out = subprocess.run([sys.executable, "-c", _PROCESS.format(tests=tests, history=history)],
                             capture_output=True, text=True, check=True)
        wrong.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert wrong == [0, 0]
