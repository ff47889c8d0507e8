"""The session layer's parts on their own: journal, lease, VAD, ledgers, limits."""

from __future__ import annotations

import numpy as np
import pytest
from servekit import AUDIO

from cadence_fx.serve.client import read_wav
from cadence_fx.serve.protocol import TurnDetection
from cadence_fx.serve.session import Ledgers, Limits
from cadence_fx.serve.session.journal import Journal
from cadence_fx.serve.session.lease import Lease
from cadence_fx.serve.session.vad import EnergyVad, VadEdge


def _journal(n: int, max_bytes: int = 10_000) -> Journal:
    journal = Journal(max_bytes)
    for _ in range(n):
        seq = journal.next_seq()
        journal.append(seq, f"e{seq}")
    return journal


def test_journal_replays_everything_after_the_last_seen_seq():
    journal = _journal(5)
    assert journal.since(2) == ["e3", "e4", "e5"]
    assert journal.since(5) == []
    assert journal.since(0) == ["e1", "e2", "e3", "e4", "e5"]


def test_journal_refuses_a_seq_from_the_future():
    assert _journal(5).since(6) is None


def test_journal_overflow_makes_the_evicted_range_unreplayable():
    journal = _journal(10, max_bytes=9)  # "e1".."e9" are 2 bytes, "e10" 3
    assert (journal.oldest_seq, journal.evicted, journal.bytes) == (7, 6, 9)
    assert journal.since(6) == ["e7", "e8", "e9", "e10"]
    assert journal.since(5) is None


def test_acknowledged_events_leave_the_journal():
    journal = _journal(5)
    journal.ack(3)
    assert (journal.oldest_seq, journal.evicted, journal.since(3)) == (4, 0, ["e4", "e5"])


def test_resume_token_is_kept_hashed_and_rotates():
    lease = Lease(0.0, idle_ttl_s=10, grace_s=5, max_session_s=100)
    first = lease.issue_token()
    assert first.encode() not in repr(vars(lease)).encode()
    assert lease.token_matches(first) and not lease.token_matches(first + "x")
    second = lease.issue_token()
    assert lease.token_matches(second) and not lease.token_matches(first)
    assert not lease.token_matches("\udcff")


def test_lease_expiry_reasons():
    lease = Lease(0.0, idle_ttl_s=10, grace_s=5, max_session_s=100)
    lease.attach(0.0)
    assert lease.expiry(9.9, busy=False) is None
    assert lease.expiry(10.0, busy=False) == "idle"
    assert lease.expiry(10.0, busy=True) is None
    lease.detach(20.0)
    assert lease.expiry(24.9, busy=False) is None
    assert lease.expiry(25.0, busy=False) == "grace"
    lease.attach(24.0)
    assert (lease.generation, lease.expiry(30.0, busy=False)) == (2, None)
    assert lease.expiry(100.0, busy=True) == "max_duration"


def test_vad_finds_the_two_turns_of_the_test_recording():
    samples, rate = read_wav(AUDIO / "turns_24k.wav")
    edges = EnergyVad(rate, TurnDetection()).process(samples)
    assert edges == [
        VadEdge("started", 1210),
        VadEdge("stopped", 6050),
        VadEdge("started", 7130),
        VadEdge("stopped", 11330),
    ]


def test_vad_edges_do_not_depend_on_chunking():
    samples, rate = read_wav(AUDIO / "turns_24k.wav")
    vad = EnergyVad(rate, TurnDetection())
    edges = [e for i in range(0, len(samples), 777) for e in vad.process(samples[i : i + 777])]
    assert edges == EnergyVad(rate, TurnDetection()).process(samples)


def test_vad_ignores_digital_silence_and_honours_silence_duration():
    rate = 24_000
    tone = (0.1 * np.sin(np.arange(rate // 2) * 0.2)).astype(np.float32)
    gap = np.zeros(rate * 400 // 1000, dtype=np.float32)  # 400 ms < 500 ms of silence: one turn
    edges = EnergyVad(rate, TurnDetection()).process(np.concatenate([gap, tone, gap, tone, gap, gap]))
    assert edges == [VadEdge("started", 100), VadEdge("stopped", 2300)]


def test_ledger_invariants_hold_and_catch_a_lost_sample():
    ledgers = Ledgers()
    ledgers.input.received_bytes, ledgers.input.committed_bytes = 10, 6
    ledgers.input.resampled_samples, ledgers.input.fed_samples, ledgers.input.pending_samples = 700, 640, 60
    ledgers.check()
    assert ledgers.to_dict()["input"]["buffered_bytes"] == 4
    ledgers.playback.generated_samples = 1
    with pytest.raises(AssertionError):
        ledgers.check()


def test_limits_refuse_negative_bounds():
    with pytest.raises(ValueError, match="Limits.grace_s must not be negative"):
        Limits(grace_s=-1)


def test_limits_refuse_a_request_timeout_of_zero():
    with pytest.raises(ValueError) as info:
        Limits(request_timeout_s=0)
    assert str(info.value) == "Limits.request_timeout_s must be above 0 (seconds a request may take to arrive whole), got 0"
