"""Sessions as the slots of one batched model.

A model that runs B sessions as the rows of one batch (Moshi's ``models/moshi_slots.py``) is
called once per tick for all of them. ``SlotScheduler`` stands between the sessions and that
call:

* **admission is a free slot.** ``acquire`` hands out the lowest free slot or raises
  ``SlotsFull``; ``release`` gives it back. A slot's next session **joins** at the first tick
  that runs it: the call is told so (``joins``), so the model resets that slot (and that slot
  alone) right before its first frame.
* **a tick runs every slot that has a frame waiting, one frame each, in one call.** A session
  submits its frames (``submit``, one request in flight per slot); the scheduler's thread takes
  the next frame of every waiting slot, launches one batched call on them (``launch(frames,
  joins)``), later collects its outputs (``collect``) and hands each slot its own; a request of
  k frames is answered after the k ticks that ran them. Slots with nothing waiting are left out
  of the call (the model masks them). The thread ticks as soon as anything waits and for as long
  as anything does: requests that arrive while a tick runs ride the next one together, so the
  more sessions wait, the more each call carries.
* **the next tick is launched while this one runs.** A model that computes on a device launches
  a tick (its inputs staged, its work enqueued, its outputs' copy to the host enqueued) and
  returns; ``collect`` waits for them. The thread gathers and launches tick t+1 before it
  collects tick t and hands it out, so the device has t+1 queued when t ends, and the thread's
  host work (gathering, handing out, the launch's enqueueing) runs while the device computes. A
  model without a device (``collect`` None) computes in ``launch``; the order is the same.
* **but not past a slot that comes right back.** A session asks for its next frame only once the
  last one came back (a reply is computed frame by frame), so right after a tick such slots come
  back one by one, each after its session's host work (the event loop of a busy server takes
  milliseconds per session). A request says whether its session asks again as soon as it is
  answered (``follows``: a reply's frame, say). When a tick answers such a request, the next tick
  is not launched ahead of it (it would leave that slot out, and the slot would ride every other
  tick): the thread collects the tick, hands it out, and the next tick waits up to ``gather_s``
  for every such slot, still taken, to have a frame waiting again. Ticking on the first would
  split them into groups, each paying a whole call (a batched call costs about the same at any
  fill). Slots whose request did not say so (a listener, whose next frame comes when its user
  sends it) hold nothing up; ``follow_misses`` counts the slots a tick ran without because
  ``gather_s`` ran out first, ``ahead`` the ticks launched while the previous one still ran.

Ticks are launched and collected in order on one thread, so a slot's frames run in the order its
session sent them and a slot joins at exactly the first tick that runs it. ``record=True`` keeps
every tick's frames and joins (``history``), for checking a run against a reference that replays
the same schedule. ``seconds`` says where the thread's time went (``TickSeconds``).
"""

from __future__ import annotations

import threading
import time
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
    come right back, ``launch`` in the model's launch (a device's model returns once its work is
    enqueued, or sooner: a place that launches on a thread of its own), ``collect`` waiting for a
    tick's outputs (on a device, mostly for the device), ``handout`` answering the requests a tick
    ended. Its time asleep with nothing waiting is none of these."""

    gather: float = 0.0
    launch: float = 0.0
    collect: float = 0.0
    handout: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {name: round(getattr(self, name), 3) for name in ("gather", "launch", "collect", "handout")}


@dataclass
class _Request:
    frames: Sequence[Any]
    future: Future
    follows: bool
    launched: int = 0  # frames in ticks launched so far
    outputs: list[Any] = field(default_factory=list)

    @property
    def answered(self) -> bool:
        return self.future.done()


@dataclass
class _Launched:
    """A tick launched and not yet collected: what ``launch`` returned (or raised), and the
    request each of its slots' frames came from."""

    frames: dict[int, Any]
    joins: tuple[int, ...]
    requests: dict[int, _Request]
    handle: Any = None
    error: BaseException | None = None

    @property
    def ends_a_follower(self) -> bool:
        """Whether a request this tick answers says its session asks again at once."""
        return any(r.follows and r.launched == len(r.frames) for r in self.requests.values())


class SlotScheduler:
    """``slots`` slots over one batched model, ``launch(frames: {slot: frame}, joins: (slot, ...))
    -> launched`` and ``collect(launched) -> {slot: output}`` (``collect`` None: ``launch``
    returns the outputs); see the module docstring. The outputs hold one for every slot in
    ``frames``."""

    def __init__(self, slots: int, launch: Callable[[dict[int, Any], tuple[int, ...]], Any],
                 collect: Callable[[Any], Mapping[int, Any]] | None = None, *,
                 name: str, gather_s: float = 0.02, record: bool = False) -> None:
        if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
            raise ValueError(f"{name}: slots must be a positive number of sessions, got {slots!r}")
        if not gather_s >= 0:
            raise ValueError(f"{name}: gather_s must be a non-negative number of seconds, got {gather_s!r}")
        self.slots, self.name, self.gather_s = slots, name, gather_s
        self._launch, self._collect = launch, collect
        self.ticks = 0  # ticks collected
        self.frames = 0  # frames they ran, all slots together
        self.follow_misses = 0  # slots that said they come right back, left out of a tick after gather_s
        self.ahead = 0  # ticks launched while the previous one was still to collect
        self.seconds = TickSeconds()
        self.history: list[TickRecord] | None = [] if record else None
        self._taken: set[int] = set()
        self._joining: set[int] = set()  # taken, not yet run since
        self._waiting: dict[int, _Request] = {}  # in flight: submitted, not yet answered
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
                raise RuntimeError(f"{self.name}: slot {slot} is released with a request in flight")
            self._taken.discard(slot)
            self._following.discard(slot)
            self._cond.notify()  # a tick gathering for this slot need not wait for it

    def submit(self, slot: int, frames: Sequence[Any], *, follows: bool = False) -> Future:
        """A future of ``frames``' outputs, in order. An empty request is answered at once.
        ``follows``: the session submits again as soon as this is answered (the next tick waits
        for it, up to ``gather_s``)."""
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self.name} is closed")
            self._check_taken(slot)
            if slot in self._waiting:
                raise RuntimeError(f"{self.name}: slot {slot} already has a request in flight; one at a time per slot")
            if not frames:
                future.set_result([])
                return future
            self._waiting[slot] = _Request(list(frames), future, follows)
            self._cond.notify()
        return future

    def close(self) -> None:
        """Stop ticking once the tick in flight is handed out; requests still waiting fail."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def _check_taken(self, slot: int) -> None:
        if slot not in self._taken:
            raise ValueError(f"{self.name}: slot {slot!r} is not taken (slots 0..{self.slots - 1}, taken {sorted(self._taken)})")

    def _ready(self) -> dict[int, _Request]:
        """The requests with a frame not yet launched, by slot."""
        return {slot: r for slot, r in sorted(self._waiting.items()) if r.launched < len(r.frames)}

    def _loop(self) -> None:
        running: _Launched | None = None  # launched, not yet handed out
        while True:
            if running is not None and (running.error is not None or running.ends_a_follower):
                self._hand_out(running)  # failed: its requests learn now; a follower: the next tick waits for it
                running = None
            tick = self._gather(block=running is None)
            if tick is None:  # closed, or nothing to launch while a tick runs: its outputs first
                if running is None:
                    break
                self._hand_out(running)
                running = None
                continue
            launching = time.perf_counter()
            try:
                tick.handle = self._launch(tick.frames, tick.joins)
            except BaseException as error:  # noqa: BLE001 - handed out as the tick's failure
                tick.error = error
            self.seconds.launch += time.perf_counter() - launching
            if running is not None:
                self.ahead += 1
                self._hand_out(running)
            running = tick
        with self._cond:
            waiting, self._waiting = list(self._waiting.values()), {}
        for request in waiting:
            request.future.set_exception(RuntimeError(f"{self.name} closed with the request waiting"))

    def _gather(self, block: bool) -> _Launched | None:
        """The next tick: one frame of every slot with one ready, once the slots that said they
        follow (of the last tick handed out) have theirs, or ``gather_s`` ran out. None when closed,
        or when nothing is ready and ``block`` is False (a tick runs: its outputs come first)."""
        with self._cond:
            while block and not self._ready() and not self._closed:
                self._cond.wait()
            if self._closed or not self._ready():
                return None
            gathering = time.perf_counter()
            deadline = time.monotonic() + self.gather_s
            while not self._closed and self._following - self._ready().keys():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            if self._closed:
                return None
            ready = self._ready()
            self.follow_misses += len(self._following - ready.keys())
            self._following.clear()
            frames = {slot: request.frames[request.launched] for slot, request in ready.items()}
            for request in ready.values():
                request.launched += 1
            joins = tuple(slot for slot in frames if slot in self._joining)
            self._joining.difference_update(joins)
            self.seconds.gather += time.perf_counter() - gathering
            return _Launched(frames, joins, ready)

    def _hand_out(self, tick: _Launched) -> None:
        """Collect a launched tick and answer the requests it ended, or fail every request it ran
        with what the model raised."""
        collecting = time.perf_counter()
        try:
            if tick.error is not None:
                raise tick.error
            outputs = tick.handle if self._collect is None else self._collect(tick.handle)
            missing = [slot for slot in tick.frames if slot not in outputs]
            if missing:
                raise RuntimeError(f"{self.name}: the tick returned no output for slots {missing}")
        except BaseException as error:  # noqa: BLE001 - every request in the tick learns why
            with self._cond:
                self._joining.update(tick.joins)  # a reset is idempotent: the next session's first tick resets again
                for slot, request in tick.requests.items():
                    if self._waiting.get(slot) is request:
                        del self._waiting[slot]
            for request in tick.requests.values():
                if not request.answered:  # failed already when an earlier tick of it did
                    request.future.set_exception(error)
            self.seconds.collect += time.perf_counter() - collecting
            return
        handing_out = time.perf_counter()
        self.seconds.collect += handing_out - collecting
        done = []
        with self._cond:
            self.ticks += 1
            self.frames += len(tick.frames)
            if self.history is not None:
                self.history.append(TickRecord(tick.frames, tick.joins))
            for slot, request in tick.requests.items():
                if request.answered:
                    continue
                request.outputs.append(outputs[slot])
                if len(request.outputs) == len(request.frames):
                    del self._waiting[slot]
                    done.append(request)
                    if request.follows:
                        self._following.add(slot)
        for request in done:
            request.future.set_result(request.outputs)
        self.seconds.handout += time.perf_counter() - handing_out
