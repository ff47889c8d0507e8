"""The device gate: which host threads may touch the device while a graph is being captured.

A CUDA graph capture is process-wide in ways a replay is not: the engine turns on the process's
sync-debug mode (a host sync then raises before it reaches CUDA), turns off the garbage collector,
rewinds the process's RNGs after its probe, and runs its probes, warm-ups and captures on one side
stream per device. Two captures at once, or a capture while another thread syncs, breaks all of
that (on an H200: a segfault once, a hang of more than 500 s another time). So:

* every engine call holds the gate *shared* (any number of threads at once: replays on their own
  streams run concurrently);
* a class's certification and capture hold it *exclusive*: it waits until no other thread holds it
  shared, and no new shared holder enters meanwhile (writer preference, so captures are not
  starved by a busy replay loop).

A thread that holds the gate shared and then needs it exclusive (an engine capturing inside a
lane's step) first steps aside: its shared holds are released while it waits and restored after,
so two such threads cannot deadlock. A thread that holds it shared and must wait for a lock of its
own (`cadence_fx.lanes.RngSection`) steps aside while it waits (`step_aside`), or a capture inside
that lock would wait for it forever. Code that syncs or allocates between engine calls in a
thread of its own (a lane's glue around the model) holds `shared()` around that work too.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["DeviceGate", "GATE"]


class DeviceGate:
    """A reentrant shared/exclusive lock with writer preference (module docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared: dict[int, int] = {}  # thread ident -> shared depth
        self._owner: int | None = None  # thread holding it exclusive
        self._depth = 0
        self._waiting = 0  # threads waiting to hold it exclusive

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:  # exclusive already covers this thread
                entered = False
            else:
                # A thread that already holds it shared re-enters at once; a new one waits for
                # captures in progress or waiting.
                while me not in self._shared and (self._owner is not None or self._waiting):
                    self._cond.wait()
                self._shared[me] = self._shared.get(me, 0) + 1
                entered = True
        try:
            yield
        finally:
            if entered:
                with self._cond:
                    self._shared[me] -= 1
                    if not self._shared[me]:
                        del self._shared[me]
                    self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                stepped_aside = 0
            else:
                stepped_aside = self._shared.pop(me, 0)
                self._waiting += 1
                self._cond.notify_all()
                while self._owner is not None or self._shared:
                    self._cond.wait()
                self._waiting -= 1
                self._owner, self._depth = me, 1
        try:
            yield
        finally:
            with self._cond:
                self._depth -= 1
                if not self._depth:
                    self._owner = None
                    if stepped_aside:
                        self._shared[me] = stepped_aside
                self._cond.notify_all()

    @contextlib.contextmanager
    def step_aside(self) -> Iterator[None]:
        """Release this thread's shared holds for the scope (while it waits for a lock that a thread
        about to capture may hold), and take them back after, as a new holder would."""
        me = threading.get_ident()
        with self._cond:
            depth = 0 if self._owner == me else self._shared.pop(me, 0)
            self._cond.notify_all()
        try:
            yield
        finally:
            if depth:
                with self._cond:
                    while self._owner is not None or self._waiting:
                        self._cond.wait()
                    self._shared[me] = depth

    def holders(self) -> tuple[int | None, dict[int, int]]:
        """(exclusive owner, shared depth by thread): for tests and error messages."""
        with self._cond:
            return self._owner, dict(self._shared)


GATE = DeviceGate()
