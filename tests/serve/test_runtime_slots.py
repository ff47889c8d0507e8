"""``SlotScheduler``: admission is a free slot, a tick runs one frame of every waiting slot in one
call, a slot's requests queue in order, a slot's next session joins at its first tick, and every failure is named."""

from __future__ import annotations

import threading

import pytest

from cadence_fx.serve.runtime import SlotScheduler, SlotsFull
from cadence_fx.serve.runtime.slots import TickRecord


class Model:
    """A batched model double: each output is (tick index, slot, frame); a tick can be held."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict, tuple]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.fail: BaseException | None = None

    def __call__(self, frames: dict, joins: tuple) -> dict:
        self.entered.set()
        self.gate.wait(10)
        self.calls.append((dict(frames), joins))
        if self.fail is not None:
            raise self.fail
        return {slot: (len(self.calls) - 1, slot, frame) for slot, frame in frames.items()}


@pytest.fixture
def model():
    return Model()


@pytest.fixture
def scheduler(model):
    slots = SlotScheduler(3, model, name="double", gather_s=0, record=True)
    yield slots
    slots.close()


def test_admission_hands_out_the_lowest_free_slot_and_refuses_when_none_is_left(scheduler):
    assert [scheduler.acquire() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(SlotsFull) as full:
        scheduler.acquire()
    assert str(full.value) == "double: all 3 slots are taken; a session needs a free slot"
    scheduler.release(1)
    assert (scheduler.free, scheduler.acquire(), scheduler.free) == (1, 1, 0)


def test_a_request_of_k_frames_rides_k_ticks_and_its_session_joins_at_the_first(scheduler, model):
    slot = scheduler.acquire()
    assert scheduler.submit(slot, ["a0", "a1", "a2"]).result(5) == [(0, 0, "a0"), (1, 0, "a1"), (2, 0, "a2")]
    assert scheduler.submit(slot, ["a3"]).result(5) == [(3, 0, "a3")]
    assert model.calls == [({0: "a0"}, (0,)), ({0: "a1"}, ()), ({0: "a2"}, ()), ({0: "a3"}, ())]
    assert scheduler.history == [TickRecord(frames, joins) for frames, joins in model.calls]
    assert (scheduler.ticks, scheduler.frames) == (4, 4)


def test_requests_that_arrive_during_a_tick_ride_the_next_one_together(scheduler, model):
    a, b, c = (scheduler.acquire() for _ in range(3))
    model.gate.clear()
    first = scheduler.submit(a, ["a0", "a1"])
    assert model.entered.wait(5)  # tick 0 runs a0 and is held
    second, third = scheduler.submit(b, ["b0"]), scheduler.submit(c, ["c0", "c1", "c2"])
    model.gate.set()
    assert first.result(5) == [(0, 0, "a0"), (1, 0, "a1")]
    assert second.result(5) == [(1, 1, "b0")]
    assert third.result(5) == [(1, 2, "c0"), (2, 2, "c1"), (3, 2, "c2")]
    assert model.calls == [
        ({0: "a0"}, (0,)),
        ({0: "a1", 1: "b0", 2: "c0"}, (1, 2)),
        ({2: "c1"}, ()),
        ({2: "c2"}, ()),
    ]


def test_a_slot_s_requests_queue_in_order_and_the_next_rides_the_tick_after_the_last(scheduler, model):
    a, b = scheduler.acquire(), scheduler.acquire()
    model.gate.clear()
    first = scheduler.submit(a, ["a0", "a1"])
    assert model.entered.wait(5)  # tick 0 runs a0 and is held
    second, other = scheduler.submit(a, ["a2"]), scheduler.submit(b, ["b0"])
    third = scheduler.submit(a, ["a3", "a4"])
    model.gate.set()
    assert first.result(5) == [(0, 0, "a0"), (1, 0, "a1")]
    assert second.result(5) == [(2, 0, "a2")]
    assert third.result(5) == [(3, 0, "a3"), (4, 0, "a4")]
    assert other.result(5) == [(1, 1, "b0")]
    assert model.calls == [
        ({0: "a0"}, (0,)),
        ({0: "a1", 1: "b0"}, (1,)),
        ({0: "a2"}, ()),
        ({0: "a3"}, ()),
        ({0: "a4"}, ()),
    ]


def test_queued_counts_a_slot_s_frames_not_yet_done_the_running_one_included(scheduler, model):
    a, b = scheduler.acquire(), scheduler.acquire()
    assert scheduler.queued(a) == 0
    model.gate.clear()
    first = scheduler.submit(a, ["a0", "a1"])
    assert model.entered.wait(5)  # tick 0 runs a0 and is held
    second = scheduler.submit(a, ["a2"])
    assert (scheduler.queued(a), scheduler.queued(b)) == (3, 0)  # a0 running, a1 and a2 waiting
    model.gate.set()
    assert (first.result(5), second.result(5)) == ([(0, 0, "a0"), (1, 0, "a1")], [(2, 0, "a2")])
    assert scheduler.queued(a) == 0
    scheduler.release(b)
    with pytest.raises(ValueError, match=r"slot 1 is not taken"):
        scheduler.queued(b)


def test_a_failed_tick_fails_every_request_of_its_slots_queued_behind(scheduler, model):
    slot = scheduler.acquire()
    model.gate.clear()
    model.fail = RuntimeError("device lost")
    first, behind = scheduler.submit(slot, ["x"]), scheduler.submit(slot, ["y"])
    model.gate.set()
    for request in (first, behind):
        with pytest.raises(RuntimeError, match="device lost"):
            request.result(5)
    model.fail = None
    assert scheduler.submit(slot, ["z"]).result(5) == [(1, 0, "z")]
    assert model.calls == [({0: "x"}, (0,)), ({0: "z"}, (0,))]


def test_a_released_slot_s_next_session_joins_again(scheduler, model):
    slot = scheduler.acquire()
    scheduler.submit(slot, ["old"]).result(5)
    scheduler.release(slot)
    assert scheduler.acquire() == slot
    scheduler.submit(slot, ["new"]).result(5)
    assert model.calls == [({0: "old"}, (0,)), ({0: "new"}, (0,))]


def test_a_tick_waits_for_the_slots_of_the_last_one_that_said_they_follow():
    model = Model()
    scheduler = SlotScheduler(3, model, name="double", gather_s=30.0)
    try:
        a, b, c = (scheduler.acquire() for _ in range(3))
        model.gate.clear()
        scheduler.submit(a, ["a0"], follows=True)
        assert model.entered.wait(5)  # tick 0: a0 alone, held
        second = scheduler.submit(b, ["b0"])
        model.gate.set()
        threading.Event().wait(0.3)
        assert not second.done()  # b0 waits for a, which said it follows; c was not in tick 0
        third = scheduler.submit(a, ["a1"], follows=True)
        assert second.result(5) == [(1, 1, "b0")] and third.result(5) == [(1, 0, "a1")]
        fourth = scheduler.submit(b, ["b1"])
        threading.Event().wait(0.3)
        assert not fourth.done()  # held for a, which said it follows tick 1 too; b did not
        scheduler.release(a)  # a's session is gone: nothing to wait for
        assert fourth.result(5) == [(2, 1, "b1")]
        assert model.calls == [({0: "a0"}, (0,)), ({0: "a1", 1: "b0"}, (1,)), ({1: "b1"}, ())]
        assert scheduler.follow_misses == 0
    finally:
        scheduler.close()


def test_follow_makes_a_slot_s_last_request_in_flight_say_it_follows():
    model = Model()
    scheduler = SlotScheduler(2, model, name="double", gather_s=30.0)
    try:
        a, b = scheduler.acquire(), scheduler.acquire()
        model.gate.clear()
        first = scheduler.submit(a, ["a0"])
        assert model.entered.wait(5)  # tick 0: a0 alone, held
        scheduler.follow(a)  # its session now asks again as soon as a0 is answered
        scheduler.follow(b)  # nothing of b in flight: nothing to do
        second = scheduler.submit(b, ["b0"])
        model.gate.set()
        assert first.result(5) == [(0, 0, "a0")]
        threading.Event().wait(0.3)
        assert not second.done()  # b0 waits for a
        third = scheduler.submit(a, ["a1"])
        assert second.result(5) == [(1, 1, "b0")] and third.result(5) == [(1, 0, "a1")]
        assert scheduler.submit(b, ["b1"]).result(5) == [(2, 1, "b1")]  # a1 did not say it follows
        with pytest.raises(ValueError, match=r"double: slot 5 is not taken"):
            scheduler.follow(5)
    finally:
        scheduler.close()


def test_a_slot_that_did_not_say_it_follows_holds_no_tick_up():
    model = Model()
    scheduler = SlotScheduler(2, model, name="double", gather_s=30.0)
    try:
        a, b = scheduler.acquire(), scheduler.acquire()
        assert scheduler.submit(a, ["a0"]).result(5) == [(0, 0, "a0")]
        assert scheduler.submit(b, ["b0"]).result(5) == [(1, 1, "b0")]  # at once: a was in tick 0, a listener
        assert model.calls == [({0: "a0"}, (0,)), ({1: "b0"}, (1,))]
    finally:
        scheduler.close()


def test_a_tick_runs_without_a_following_slot_once_gather_s_is_out_and_counts_it():
    model = Model()
    scheduler = SlotScheduler(2, model, name="double", gather_s=0.05)
    try:
        a, b = scheduler.acquire(), scheduler.acquire()
        assert scheduler.submit(a, ["a0"], follows=True).result(5) == [(0, 0, "a0")]
        assert scheduler.submit(b, ["b0"]).result(5) == [(1, 1, "b0")]  # a never came back
        assert scheduler.submit(b, ["b1"]).result(5) == [(2, 1, "b1")]  # a is not waited for twice
        assert (scheduler.follow_misses, scheduler.ticks, scheduler.frames) == (1, 3, 3)
    finally:
        scheduler.close()


def test_a_failed_tick_fails_each_of_its_requests_and_the_joins_are_retried(scheduler, model):
    slot = scheduler.acquire()
    model.fail = RuntimeError("device lost")
    with pytest.raises(RuntimeError, match="device lost"):
        scheduler.submit(slot, ["x", "y"]).result(5)
    model.fail = None
    assert scheduler.submit(slot, ["z"]).result(5) == [(1, 0, "z")]
    assert model.calls == [({0: "x"}, (0,)), ({0: "z"}, (0,))]


def test_a_tick_that_leaves_out_a_slot_fails_naming_it():
    scheduler = SlotScheduler(2, lambda frames, joins: {}, name="double", gather_s=0)
    try:
        with pytest.raises(RuntimeError) as failed:
            scheduler.submit(scheduler.acquire(), ["x"]).result(5)
        assert str(failed.value) == "double: the tick returned no output for slots [0]"
    finally:
        scheduler.close()


def test_misuse_is_refused_by_name(scheduler, model):
    with pytest.raises(ValueError) as untaken:
        scheduler.submit(2, ["x"])
    assert str(untaken.value) == "double: slot 2 is not taken (slots 0..2, taken [])"
    slot = scheduler.acquire()
    model.gate.clear()
    pending = scheduler.submit(slot, ["x"]), scheduler.submit(slot, ["y"])
    with pytest.raises(RuntimeError) as early:
        scheduler.release(slot)
    assert str(early.value) == "double: slot 0 is released with 2 request(s) in flight"
    model.gate.set()
    [p.result(5) for p in pending]
    assert scheduler.submit(slot, []).result(0) == []
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match=r"double: slots must be a positive number of sessions, got "):
            SlotScheduler(bad, model, name="double")
    with pytest.raises(ValueError, match=r"double: gather_s must be a non-negative number of seconds, got -1"):
        SlotScheduler(1, model, name="double", gather_s=-1)


def test_closing_fails_what_still_waits_and_refuses_what_comes(model):
    scheduler = SlotScheduler(2, model, name="double", gather_s=0)
    a, b = scheduler.acquire(), scheduler.acquire()
    model.gate.clear()
    running = scheduler.submit(a, ["a0"])
    assert model.entered.wait(5)
    waiting = scheduler.submit(b, ["b0"])
    closer = threading.Thread(target=scheduler.close)
    closer.start()
    while not scheduler.closed:
        threading.Event().wait(0.01)
    model.gate.set()
    closer.join(5)
    assert running.result(5) == [(0, 0, "a0")]
    with pytest.raises(RuntimeError, match="double closed with the request waiting"):
        waiting.result(5)
    with pytest.raises(RuntimeError, match="double is closed"):
        scheduler.acquire()
