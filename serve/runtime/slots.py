"""Sessions as the slots of one batched model.

A model that runs B sessions as the rows of one batch (Moshi's ``models/moshi_slots.py``) is
called once per tick for all of them. ``SlotScheduler`` stands between the sessions and that
call:

* **admission is a free slot.** ``acquire`` hands out the lowest free slot or raises
  ``SlotsFull``; ``release`` gives it back. A slot's next session **joins** at the first tick
  that runs it: the call is told so (``joins``), so the model resets that slot (and that slot
  alone) right before its first frame.
* **a tick runs every slot that has a frame waiting, one frame each, in one call.** A session
  submits its frames (``submit``); a slot's requests queue in the order they came, so a session
  need not wait for one request's answer before it sends the next (a listener's next frames are
  then waiting when its last ones ran, and it misses no tick in between). The scheduler's thread
  takes the next frame of every waiting slot, calls ``run(frames, joins)`` once, and hands each
  slot its output; a request of k frames is answered after the k ticks that ran them. Slots with
  nothing waiting are left out of the call (the model masks them). The thread ticks as soon as
  anything waits and for as long as anything does: requests that arrive while a tick runs ride
  the next one together, so the more sessions wait, the more each call carries.
* **a tick waits a moment for the slots that said they come right back.** A session asks for
  its next frame only once the last one came back (a reply is computed frame by frame), so right
  after a tick such slots come back one by one, each after its session's host work (the event
  loop of a busy server takes milliseconds per session). Ticking on the first would split them
  into groups, each paying a whole call (a batched call costs about the same at any fill). A
  request says whether its session asks again as soon as it is answered (``follows``: a reply's
  frame, say); a tick waits up to ``gather_s`` for every such slot of the previous tick, still
  taken, to have a frame waiting again. Slots whose request did not say so (a listener, whose
  next frame comes when its user sends it) hold nothing up; ``follow_misses`` counts the slots
  a tick ran without because ``gather_s`` ran out first.

Ticks run in arrival order on one thread, so a slot's frames run in the order its session sent
them. ``record=True`` keeps every tick's frames and joins (``history``), for checking a run
against a reference that replays the same schedule. ``seconds`` says where the thread's time
went (``TickSeconds``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SlotScheduler", "SlotsFull", "TickRecord", "TickSeconds"]


class SlotsFull(RuntimeError):
    """Every slot is taken: the session is refused, nothing waits."""


@dataclass(frozen=True)
class TickRecord:
    """One tick as it was called: each live slot's frame, and the slots that joined there."""

    frames: dict[int, Any]
    joins: tuple[int, ...]


@dataclass
class TickSeconds:
    """The scheduler thread's time, summed over its ticks: ``gather`` waiting for the slots that
    come right back, ``run`` in the batched call, ``handout`` answering the requests a tick ended.
    Its time asleep with nothing waiting is none of these."""

    gather: float = 0.0
    run: float = 0.0
    handout: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {"gather": round(self.gather, 3), "run": round(self.run, 3), "handout": round(self.handout, 3)}


@dataclass
class _Request:
    frames: Sequence[Any]
    future: Future
    follows: bool
    outputs: list[Any] = field(default_factory=list)


class SlotScheduler:
    """``slots`` slots over one ``run(frames: {slot: frame}, joins: (slot, ...)) -> {slot: output}``;
    see the module docstring. ``run`` must return an output for every slot in ``frames``."""

    def __init__(
        self,
        slots: int,
        run: Callable[[dict[int, Any], tuple[int, ...]], Mapping[int, Any]],
        *,
        name: str,
        gather_s: float = 0.02,
        record: bool = False,
    ) -> None:
        if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
            raise ValueError(f"{name}: slots must be a positive number of sessions, got {slots!r}")
        if not gather_s >= 0:
            raise ValueError(f"{name}: gather_s must be a non-negative number of seconds, got {gather_s!r}")
        self.slots, self.name, self.gather_s, self._run = slots, name, gather_s, run
        self.ticks = 0  # calls of ``run``
        self.frames = 0  # frames they ran, all slots together
        self.follow_misses = 0  # slots that said they come right back, left out of a tick after gather_s
        self.seconds = TickSeconds()
        self.history: list[TickRecord] | None = [] if record else None
        self._taken: set[int] = set()
        self._joining: set[int] = set()  # taken, not yet run since
        self._waiting: dict[int, deque[_Request]] = {}  # each slot's requests, oldest first
        self._following: set[int] = set()  # slots whose last answered request said it follows
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name=f"{name}-slots", daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def free(self) -> int:
        with self._cond:
            return self.slots - len(self._taken)

    def acquire(self) -> int:
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self.name} is closed")
            free = [slot for slot in range(self.slots) if slot not in self._taken]
            if not free:
                raise SlotsFull(f"{self.name}: all {self.slots} slots are taken; a session needs a free slot")
            self._taken.add(free[0])
            self._joining.add(free[0])
            return free[0]

    def release(self, slot: int) -> None:
        with self._cond:
            self._check_taken(slot)
            if slot in self._waiting:
                raise RuntimeError(f"{self.name}: slot {slot} is released with {len(self._waiting[slot])} request(s) in flight")
            self._taken.discard(slot)
            self._following.discard(slot)
            self._cond.notify()  # a tick gathering for this slot need not wait for it

    def submit(self, slot: int, frames: Sequence[Any], *, follows: bool = False) -> Future:
        """A future of ``frames``' outputs, in order; they run after the slot's requests already
        in flight. An empty request is answered at once. ``follows``: the session submits again as
        soon as this is answered (the next tick waits for it, up to ``gather_s``)."""
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self.name} is closed")
            self._check_taken(slot)
            if not frames:
                future.set_result([])
                return future
            self._waiting.setdefault(slot, deque()).append(_Request(list(frames), future, follows))
            self._cond.notify()
        return future

    def follow(self, slot: int) -> None:
        """The session submits again as soon as ``slot``'s last request in flight is answered: that
        request now says ``follows`` (a reply that opens with the output of a frame fed before it
        began, say). Nothing in flight: nothing to do."""
        with self._cond:
            self._check_taken(slot)
            queue = self._waiting.get(slot)
            if queue:
                queue[-1].follows = True

    def queued(self, slot: int) -> int:
        """How many of ``slot``'s frames are not done yet: those waiting for a tick, and its frame
        in the tick that runs now, if any."""
        with self._cond:
            self._check_taken(slot)
            return sum(len(request.frames) - len(request.outputs) for request in self._waiting.get(slot, ()))

    def close(self) -> None:
        """Stop ticking; requests still waiting fail."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def _check_taken(self, slot: int) -> None:
        if slot not in self._taken:
            raise ValueError(f"{self.name}: slot {slot!r} is not taken (slots 0..{self.slots - 1}, taken {sorted(self._taken)})")

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                gathering = time.perf_counter()
                deadline = time.monotonic() + self.gather_s
                while not self._closed and self._following - self._waiting.keys():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                if self._closed:
                    waiting = [request for queue in self._waiting.values() for request in queue]
                    self._waiting = {}
                    break
                self.follow_misses += len(self._following - self._waiting.keys())
                self._following.clear()
                requests = {slot: self._waiting[slot][0] for slot in sorted(self._waiting)}
                frames = {slot: request.frames[len(request.outputs)] for slot, request in requests.items()}
                joins = tuple(slot for slot in frames if slot in self._joining)
                self._joining.difference_update(joins)
            running = time.perf_counter()
            self.seconds.gather += running - gathering
            try:
                outputs = self._run(frames, joins)
                missing = [slot for slot in frames if slot not in outputs]
                if missing:
                    raise RuntimeError(f"{self.name}: the tick returned no output for slots {missing}")
            except BaseException as error:  # noqa: BLE001 - every request of the tick's slots learns why
                with self._cond:
                    self._joining.update(joins)  # a reset is idempotent: the next session's first tick resets again
                    # A slot's later requests would run on a state that missed this tick: they fail too.
                    failed = [request for slot in frames for request in self._waiting.pop(slot)]
                for request in failed:
                    request.future.set_exception(error)
                continue
            handing_out = time.perf_counter()
            self.seconds.run += handing_out - running
            done = []
            with self._cond:
                self.ticks += 1
                self.frames += len(frames)
                if self.history is not None:
                    self.history.append(TickRecord(frames, joins))
                for slot, request in requests.items():
                    request.outputs.append(outputs[slot])
                    if len(request.outputs) == len(request.frames):
                        queue = self._waiting[slot]
                        queue.popleft()
                        done.append(request)
                        if queue:
                            continue
                        del self._waiting[slot]
                        if request.follows:
                            self._following.add(slot)
            for request in done:
                request.future.set_result(request.outputs)
            self.seconds.handout += time.perf_counter() - handing_out
        for request in waiting:
            request.future.set_exception(RuntimeError(f"{self.name} closed with the request waiting"))
