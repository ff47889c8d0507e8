"""PersonaPlex's ticks and priming take turns (``serve/plugins/personaplex_turns.py``): never
both at once; one asking while the other runs goes next, so two that keep asking alternate; one
alone runs again at once."""

from __future__ import annotations

import threading
import time

import pytest

from cadence_fx.serve.plugins.personaplex_turns import PRIME, TICK, Turns


def _asking(turns: Turns, who: str) -> None:
    """Until ``who`` waits for its turn (the test's threads are ordered by it)."""
    deadline = time.monotonic() + 10
    while not turns._asking[who]:
        assert time.monotonic() < deadline, f"{who} never asked"
        time.sleep(0.001)


def test_one_alone_steps_on_without_waiting():
    turns = Turns()
    turns.enter(PRIME)
    for _ in range(3):
        turns.step(PRIME)
    turns.leave(PRIME)
    with turns.turn(TICK):
        pass
    assert turns.waits == {TICK: 0, PRIME: 0}


def test_a_tick_asking_during_a_prompt_step_runs_before_the_next_step_and_then_they_alternate():
    turns, order = Turns(), []
    turns.enter(PRIME)
    order.append("step 1")

    def ticks() -> None:
        for i in (1, 2):
            with turns.turn(TICK):
                order.append(f"tick {i}")

    ticker = threading.Thread(target=ticks)
    ticker.start()
    _asking(turns, TICK)
    turns.step(PRIME)  # gives way to the tick that waits, then waits for it
    order.append("step 2")
    _asking(turns, TICK)  # the second tick waits for this step
    turns.leave(PRIME)
    ticker.join(10)
    assert order == ["step 1", "tick 1", "step 2", "tick 2"]
    assert turns.waits == {TICK: 2, PRIME: 1}


def test_a_turn_is_a_tick_or_a_prompt_step_and_is_left_by_who_holds_it():
    turns = Turns()
    with pytest.raises(ValueError, match=r"^a turn is 'tick' or 'prime', got 'decode'$"):
        turns.enter("decode")
    with pytest.raises(RuntimeError, match=r"^'tick' leaves a turn it does not hold \(running: None\)$"):
        turns.leave(TICK)
    turns.enter(TICK)
    with pytest.raises(RuntimeError, match=r"^'tick' asks for a turn while its own runs$"):
        turns.enter(TICK)
