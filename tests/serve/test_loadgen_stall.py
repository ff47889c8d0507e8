"""The load generator's playback stall (``tests/serve/loadgen.py``, ``Reply.take``): a client that
starts playing a reply at its first delta, with no further buffering, waits whenever a delta comes
after its play time, and plays on from there; a reply's stall is all those waits together, and
``stall_at`` is when the delta that ended the last of them arrived."""

from __future__ import annotations

import pytest
from loadgen import Reply

FRAME = bytes(2 * 1920)  # 80 ms of PCM16 at 24 kHz


def _played(arrivals: list[float]) -> Reply:
    reply = Reply("resp_1", 0)
    for i, now in enumerate(arrivals):
        reply.take(FRAME, i * 1920, now)
    return reply


def test_deltas_that_come_before_their_play_time_stall_nothing():
    reply = _played([10.0, 10.0, 10.05, 10.16, 10.24])  # each at or before first + 80 ms x its index
    assert (reply.stall_s, reply.stall_at) == (0.0, None)


def test_two_waits_add_up_and_the_one_that_ended_last_is_when():
    # Plays 10.00-10.08; the 2nd comes at 10.18 (waited 0.10), plays to 10.26; the 3rd is there
    # already (10.20); the 4th, due at 10.34, comes at 10.40 (waited 0.06 more).
    reply = _played([10.0, 10.18, 10.20, 10.40])
    assert reply.stall_s == pytest.approx(0.16, abs=1e-9)
    assert reply.stall_at == 10.40


def test_a_late_delta_after_a_wait_counts_only_what_it_adds():
    # Waited 0.10 for the 2nd; the 3rd comes 0.10 after its first play time, when the client is
    # still playing the 2nd (delayed by 0.10): no more wait.
    reply = _played([10.0, 10.18, 10.26])
    assert reply.stall_s == pytest.approx(0.10, abs=1e-9)
    assert reply.stall_at == 10.18
