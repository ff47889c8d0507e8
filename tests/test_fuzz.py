"""The differential fuzzer's CI tier (`tests/fuzzkit.py`): random schedules at fixed seeds over
every subject (`fuzz_subjects.py`: the counter-branching models, every probe and example the tests
bind, the families at their tiny depths), each call's output, retained state and host counters
compared with a stock copy's: no wrong output, whatever the order of arrival. Then what the
pipeline did with the calls, exactly: where it admits the model's classes, some calls ran the
graphs; where the program comparison refuses every class by design, every call ran the stock code.

A transformers subject exports a graph per class it meets (a second or two each on a CPU), so
the probes and families run one short schedule here; `bench/fuzz.py` runs the long ones."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fuzz_subjects import SUBJECTS
from fuzzkit import TOYS, run, schedule
from test_byom_probe import MORE_DECODERS

# (seeds, steps) a subject: the toys every opening (long first, pings first, primed first) many
# times; the rest one short schedule (each class an export): seed 4 opens with pings and short
# streams, then an odd-length call mid-stream, a second stream, and back to the first. The 16
# decoders of one binding, and the costliest models, stop after the pings; Token2Wav's stock chunk
# (its vendor envelopes) takes seconds on a CPU: two chunks and a turn reset between them.
TIERS = {
    **dict.fromkeys(TOYS, (range(6), 40)),
    **dict.fromkeys([*MORE_DECODERS, "hf_mimi", "moshi_mimi"], ((4,), 6)),
    "token2wav": ((4,), 3),
}
SHORT = ((4,), 12)

# Every class refused by the program comparison (the stock call's ATen program is not the exported
# step's: transformers' mixtures of experts run `aten._grouped_mm` stock and a fallback traced;
# BART's and T5's positions, Kyutai's and CSM's, another code path traced): every call runs stock.
REFUSED_WHOLE = frozenset({"mixtral", "qwen2_moe", "deepseek_v3", "bart", "t5", "kyutai", "csm"})


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The subjects are tiny: torch's intra-op threads only wait on each other (two threads took
    2.5 times the CPU time of one here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _served(subject) -> int:
    """Calls the bound operators answered from their graphs, not the stock code."""
    return sum(op.counters.calls - op.counters.stock for op in subject.report.operators.values())


@pytest.mark.parametrize("name", sorted(SUBJECTS))
def test_random_schedules_never_give_a_wrong_output(name):
    subject = SUBJECTS[name]()
    seeds, steps = TIERS.get(name, SHORT)
    before = {name: op.counters.calls for name, op in subject.report.operators.items()}
    served = _served(subject)  # a family's warm-up ran some at its transform
    total = 0
    for seed in seeds:
        outcome = run(subject, schedule(seed, steps, odd=bool(subject.odd), none=subject.takes_none), seed)
        assert (outcome.wrong, outcome.first_wrong) == (0, None), outcome.as_dict()
        total += outcome.calls
    # each call of the schedule is one call of every operator (a family's glue calls each once);
    # Token2Wav's first turn setup runs the prompt through each of its operators (stock) once more
    calls = total + (name == "token2wav")
    assert {name: op.counters.calls - before[name] for name, op in subject.report.operators.items()} == dict.fromkeys(
        before, calls
    )
    classes = [cls for op in subject.report.operators.values() for cls in op.classes.values()]
    if name in REFUSED_WHOLE:
        assert _served(subject) == 0 and classes
        assert all(
            cls.refused.startswith("verification: program: the exported step is not the program the stock call runs")
            for cls in classes
        ), {cls.name: cls.refused for cls in classes}
    else:
        assert _served(subject) > served


def test_the_schedules_cover_every_kind_of_step_and_every_opening():
    kinds, openings = set(), set()
    for seed in range(12):
        steps = schedule(seed, 40, odd=True, none=True)
        kinds |= {kind for kind, _ in steps}
        openings.add(tuple(steps[:3]))
    assert kinds == {"call", "odd", "reset", "none"}
    assert {("call", 0), ("odd", 0)} <= {opening[0] for opening in openings}
    assert len(openings) >= 3


_PROCESS = """
import json, sys
sys.path.insert(0, {tests!r})
from fuzzkit import TOYS, run, schedule
from test_byom_probe import MORE_DECODERS
subject = TOYS["rolling"]()
for seed in {history}:  # this process's history first
    run(subject, schedule(seed, 30, odd=True, none=True), seed)
outcome = run(subject, schedule(99, 30, odd=True, none=True), 99)
print(json.dumps(outcome.wrong))
"""


def test_two_processes_with_different_histories_are_both_exact():
    tests = str(Path(__file__).parent)
    wrong = []
    for history in ([], [5, 6, 7]):
        out = subprocess.run(
            [sys.executable, "-c", _PROCESS.format(tests=tests, history=history)], capture_output=True, text=True, check=True
        )
        wrong.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert wrong == [0, 0]
