"""The engine, the device gate and the lanes on the CPU: what several host threads may do.

Issue 14: an engine stepped from a second thread refused HiFT as `autograd` (grad mode is per
thread) without anyone noticing, and two engines stepped from two threads at once crashed once and
hung once. On the CPU nothing is captured, so what is tested here is the host side: the gate's
exact order of events, one thread per engine, the grad mode a lane's thread runs under, refusals
that name their thread, and per-session device-RNG state through an `RngSection`.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from cadence_fx.lanes import Lane, RngSection
from cadence_fx.memory import DeviceMemory
from cadence_fx.multiplex import SessionState, rng_seeded
from cadence_fx.replay import ExactShapeReplay, ReplayError, ShapeClass, Signature
from cadence_fx.replay.gate import DeviceGate


def _affine() -> tuple[torch.nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    return torch.nn.Linear(8, 8).eval(), torch.randn(4, 8)


def _in_thread(fn, name: str = "worker"):
    result: dict = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            result["error"] = e

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), f"thread {name} did not finish"
    if "error" in result:
        raise result["error"]
    return result["value"]


def test_a_refusal_in_a_thread_is_certified_and_logged_with_the_thread(caplog):
    m, x = _affine()
    engine = ExactShapeReplay(m, [ShapeClass("B=4", Signature.of(x))], name="affine")
    with caplog.at_level(logging.WARNING, logger="cadence_fx.replay"):
        out = _in_thread(lambda: engine(x))  # a new thread starts in grad mode
    assert torch.equal(out, m(x))
    assert engine.counters.fallbacks == {"autograd": 1}
    cert = engine.certificates["B=4"]
    assert (cert.admitted, cert.thread) == (False, "worker")
    assert "on thread 'worker'" in cert.reason and "inference=True" in cert.reason
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["affine"]
    assert "class B=4 refused on thread 'worker'" in caplog.records[0].getMessage()


def test_an_inference_engine_admits_a_call_from_a_thread_in_grad_mode():
    m, x = _affine()
    with torch.no_grad():
        expected = m(x)
        engine = ExactShapeReplay(m, [ShapeClass("B=4", Signature.of(x))], inference=True)
    out = _in_thread(lambda: (torch.is_grad_enabled(), engine(x)))
    assert out[0] is True
    assert torch.equal(out[1], expected) and not out[1].requires_grad
    assert engine.counters.fallbacks == {"no_cuda": 1}
    assert engine.certificates["B=4"].admitted and engine.certificates["B=4"].thread == "worker"


def test_an_engine_entered_by_a_second_thread_while_busy_raises():
    inside, release = threading.Event(), threading.Event()

    def slow(x: torch.Tensor) -> torch.Tensor:
        inside.set()
        release.wait(timeout=30)
        return x + 1

    x = torch.zeros(2)
    engine = ExactShapeReplay(slow, [Signature.of(x)], name="slow")
    first = threading.Thread(target=engine, args=(x,), name="first")
    first.start()
    assert inside.wait(timeout=30)
    with pytest.raises(ReplayError, match="slow: called from thread 'MainThread' while another thread is inside it"):
        engine(x)
    release.set()
    first.join(timeout=30)
    assert engine.counters.calls == 1


def test_the_gate_lets_an_exclusive_holder_in_only_when_no_thread_holds_it_shared():
    gate, events = DeviceGate(), []
    holding, waiting = threading.Event(), threading.Event()

    def reader() -> None:
        with gate.shared():
            events.append("reader in")
            holding.set()
            waiting.wait(timeout=30)
            events.append("reader out")

    def writer() -> None:
        holding.wait(timeout=30)
        waiting.set()
        with gate.exclusive():
            events.append("writer in")

    threads = [threading.Thread(target=reader), threading.Thread(target=writer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert events == ["reader in", "reader out", "writer in"]
    assert gate.holders() == (None, {})


def test_two_shared_holders_that_both_need_exclusive_do_not_deadlock():
    gate, events, lock = DeviceGate(), [], threading.Lock()
    both_in = threading.Barrier(2, timeout=30)

    def lane(name: str) -> None:
        with gate.shared():
            both_in.wait()  # both hold it shared, then both ask for it exclusive
            with gate.exclusive():
                owner, shared = gate.holders()
                with lock:
                    events.append((name, owner == threading.get_ident(), shared))
            assert gate.holders()[1].get(threading.get_ident()) == 1  # its shared hold is back

    threads = [threading.Thread(target=lane, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert sorted(events) == [("a", True, {}), ("b", True, {})]
    assert gate.holders() == (None, {})


def test_a_lane_runs_its_tasks_in_the_grad_mode_of_the_thread_that_made_it():
    with torch.no_grad():
        lane = Lane("quiet", "cpu")
    loud = Lane("loud", "cpu")
    try:
        assert lane.submit(torch.is_grad_enabled).result(timeout=30) is False
        assert loud.submit(torch.is_grad_enabled).result(timeout=30) is True
        assert lane.submit(lambda: threading.current_thread().name).result(timeout=30).startswith("quiet")
    finally:
        lane.close()
        loud.close()


def test_an_rng_section_draws_for_each_session_what_it_draws_alone():
    device = torch.device("cpu")
    alone = []
    for seed in (1, 2):
        torch.set_rng_state(rng_seeded(device, seed))
        alone.append([torch.rand(3) for _ in range(3)])
    section = RngSection(device)
    sessions = [SessionState([], [], rng_seeded(device, seed)) for seed in (1, 2)]
    torch.manual_seed(99)  # whatever the process's generator holds does not matter
    drawn: list[list[torch.Tensor]] = [[], []]
    for _ in range(3):
        for i in (1, 0):  # interleaved, in the other order
            drawn[i].append(section.call(sessions[i], torch.rand, 3))
    assert all(torch.equal(a, b) for i in (0, 1) for a, b in zip(drawn[i], alone[i], strict=True))
    assert section.calls == 6


def test_seeding_a_session_never_touches_the_process_generator(monkeypatch):
    """A lane seeds a new session while another lane's `RngSection` call may be drawing from the
    process's generator: the seeding must neither seed nor restore that generator."""
    device, touched = torch.device("cpu"), []
    monkeypatch.setattr(torch, "manual_seed", lambda *args: touched.append("manual_seed"))
    monkeypatch.setattr(torch, "set_rng_state", lambda *args: touched.append("set_rng_state"))
    state = rng_seeded(device, 7)
    monkeypatch.undo()
    assert touched == []
    torch.manual_seed(7)
    assert torch.equal(state, torch.get_rng_state())  # what seeding the process's generator gives


def test_device_memory_without_cuda_measures_nothing():
    memory = DeviceMemory("cpu")
    memory.sample()
    assert memory.footprint() is None
    assert memory.record() == {
        "peak_allocated_bytes": None,
        "reserved_bytes_end": None,
        "reserved_bytes_max": None,
        "device_footprint_bytes_end": None,
        "device_footprint_bytes_max": None,
        "device_used_at_start_bytes": None,
    }
