"""The batch's ticks and the prompt bank's priming take turns on the CPU, never running together.

Both are Python driving many small torch kernels, in one process: run together, each waits for
the interpreter lock at nearly every kernel the other one launches, and a tick of the batch
doubles in length (``personaplex-tiny`` at 8 sessions on 2 cores: 81 ms a tick against 47 ms
while no role was primed, and the replies of the sessions already talking stalled; the record in
bench/results/ keeps the timeline). So they take turns instead: a turn is one tick, or one prompt
step (the vendor's priming pauses before each, ``models/personaplex_prompt.py``'s
``checkpoint``). Whichever asks while the other runs goes next, so when both keep asking they
alternate: a tick waits at most one prompt step (a few ms at the tiny size), and a role is
primed at one step per tick at least, however busy the batch. When only one asks, it runs.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Turns"]

TICK, PRIME = "tick", "prime"


class Turns:
    """Turns between ``TICK`` and ``PRIME`` (see the module docstring); ``waits`` counts, for
    each, the turns that had to wait for the other's."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running: str | None = None
        self._last: str | None = None
        self._asking = {TICK: False, PRIME: False}
        self.waits = {TICK: 0, PRIME: 0}

    def _other(self, who: str) -> str:
        return PRIME if who == TICK else TICK

    def enter(self, who: str) -> None:
        """Returns once it is ``who``'s turn: nothing runs, and the other, if it asks too, ran last."""
        if who not in self._asking:
            raise ValueError(f"a turn is {TICK!r} or {PRIME!r}, got {who!r}")
        with self._cond:
            if self._running == who:
                raise RuntimeError(f"{who!r} asks for a turn while its own runs")
            self._asking[who] = True
            waited = False
            while self._running is not None or (self._asking[self._other(who)] and self._last == who):
                waited = True
                self._cond.wait()
            self._asking[who] = False
            self._running = who
            self.waits[who] += waited

    def leave(self, who: str) -> None:
        with self._cond:
            if self._running != who:
                raise RuntimeError(f"{who!r} leaves a turn it does not hold (running: {self._running!r})")
            self._running, self._last = None, who
            self._cond.notify_all()

    @contextmanager
    def turn(self, who: str) -> Iterator[None]:
        self.enter(who)
        try:
            yield
        finally:
            self.leave(who)

    def step(self, who: str) -> None:
        """Between two steps of ``who``'s: its turn given up and asked for again."""
        self.leave(who)
        self.enter(who)
