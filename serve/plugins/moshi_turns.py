"""A session's conversation with Moshi: its turns mapped onto the model's one clock (``MoshiStream``).

How a duplex model maps onto the session's turns:

* ``feed``: one tick on the user's frame. Moshi speaks while it listens; what it says during the
  user's turn belongs to no response and is dropped (``listened`` frames), but for its last frame
  (below). While a reply is in progress (the user talks over it and no barge-in cancelled it), it
  is the reply's next frame. A turn the server VAD ends inside an append ends at its stop: the
  append's frames after the stop are fed after ``begin_response``, as the reply's next frames.
* ``begin_response``: the reply lasts as many frames as the user's turn (the frames fed since the
  last ``begin_response``), at least 1 and at most ``max_reply_frames``. A duplex model never ends
  a turn by itself; it talks for as long as its clock runs, so the plugin sets the length. The
  reply **opens with what Moshi said on the last frame its slot ticked before the reply** (as a
  rule the turn's last frame). The reply is a window onto Moshi's one stream of speech, which runs
  on the same clock as what it hears; the window starts at the frame where the turn ended (for a
  server VAD turn, inside the trailing silence that ended it), not one frame after it: the frame
  Moshi's own timeline pairs with the turn's last input frame (the vendor's codebook delays spread
  what one tick reads and samples over neighbouring frames). So the first audio waits
  only for the turn's own frames still queued on the slot, not for one more tick after them; the
  reply's next frames are queued behind that one at its first ``step``. A turn that fed nothing (a
  reply asked for on an empty turn, or after ``clear_input``) opens with a tick of its own, as
  does a stream's very first tick, which says nothing (the acoustic delay). An opening output
  already computed when the reply begins (the turn's frames all ticked) is handed out with the
  frame after it: at once, a client playing it would wait for that frame, up to two ticks away.
* ``step``: the reply's next frame, one computed by a ``feed`` if there is one, else a tick on
  80 ms of silence (the user listens while Moshi speaks); None once the reply's frames are out.
  While nothing fed brings the reply's next frames, ``step`` ticks them ahead on silence before it
  returns (``REPLY_AHEAD_FRAMES``, never past the reply's length), so they ride the slot's next
  ticks while the session hands this one out: the model's clock runs at most that many frames
  ahead of the session's, and a frame fed meanwhile comes after them.
* ``take_text``: the text of the token Moshi sampled with the frame ``step`` handed out last (each
  output is its PCM and that token's id, ``moshi_worker.Spoken``), which the session sends as the
  reply's transcript; "" after a ``step`` that returned None.
* ``cancel``: the rest of the reply is dropped. The model keeps its state: it has said what it
  said, and the clock goes on from there.
* ``clear_input``: the cleared frames stop counting toward the turn. The model heard them as they
  arrived and keeps them: a duplex model absorbs its input tick by tick and cannot unhear it.

"""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ..runtime.slots import SlotScheduler
from .base import ModelStream
from .moshi_worker import Spoken

if TYPE_CHECKING:
    from cadence_fx.models.moshi_tokenizer import TextPieces

log = logging.getLogger(__name__)

FRAME_SAMPLES = 1920  # 80 ms at 24 kHz: one tick
# How many of a reply's next frames ``step`` keeps ticking ahead on silence when nothing fed brings them.
REPLY_AHEAD_FRAMES = 2
SILENCE = np.zeros(FRAME_SAMPLES, dtype=np.float32)


class StreamPlace(Protocol):
    """What a ``MoshiStream`` and its plugin ask of the place whose batch holds the stream's slot
    (Moshi's places, ``moshi_places.py``; PersonaPlex's one place)."""

    index: int
    streams: int  # open streams placed here
    scheduler: SlotScheduler | None  # its slots, once its batch was started


class StreamPlugin(Protocol):
    """What a ``MoshiStream`` asks of its plugin (``MoshiPlugin``, ``PersonaPlexPlugin``)."""

    max_reply_frames: int
    text: TextPieces

    def _count(self, listened: int = 0, replied: int = 0, silence: int = 0) -> None: ...

    def _count_reply_start(self, queued: int) -> None: ...

    def _placed_off(self, place: StreamPlace, slot: int) -> None: ...


def scheduler_of(place: StreamPlace) -> SlotScheduler:
    """``place``'s slots: a plugin starts a place's batch before it places a stream there."""
    if place.scheduler is None:
        raise RuntimeError(f"place {place.index}: its batch is not started, it has no slots yet")
    return place.scheduler


class MoshiStream(ModelStream):
    """One session's conversation with Moshi: the turn bookkeeping here, the ticks in its slot
    of its place's batch. ``feed`` submits its frames and returns at once: their outputs are
    taken in order by the stream's next call that needs them (a ``step`` waits for the frames
    fed since its reply began, which are the reply's next frames), so a session's next append
    is queued on its slot before the last one's ticks are done and its slot misses no tick in
    between. A tick that failed raises from the first call that takes its outputs. A reply frame
    that a ``feed`` computed is handed out by ``step`` without a request of its own."""

    def __init__(self, plugin: StreamPlugin, place: StreamPlace, slot: int) -> None:
        self._plugin, self._place, self.slot = plugin, place, slot
        self._slots = scheduler_of(place)
        self._pending: deque[Spoken] = deque()  # reply frames computed by ``feed``
        # Frames ticking whose outputs are not taken yet: (their future, how many, the reply they
        # were fed in or ticked ahead for, else None; the reply their last output opens, else None).
        self._inflight: deque[tuple[Future, int, int | None, int | None]] = deque()
        self._heard: Spoken | None = None  # the slot's latest output when no reply took it: the next reply may open with it
        # How the current reply opens, until its first ``step``: with the output of a frame ticked
        # before it began, still "ticking" or "done" at its start; None: with a tick of its own.
        self._opening: str | None = None
        self._reply = 0  # which reply is current: begin_response and cancel move it on
        self._closed = False
        self._said: int | None = None  # the text token of the frame ``step`` handed out last
        self.budget = 0  # reply frames still to come out of ``step``
        self.turn_frames = 0  # user frames fed since the last ``begin_response``
        self.ticks = 0
        self.listened = 0  # output frames no reply handed out: said during the user's turn, or cut off by a cancel
        self.replied = 0  # output frames returned by ``step``

    def feed(self, frame: np.ndarray) -> None:
        self.feed_frames([frame])

    def feed_frames(self, frames: list[np.ndarray]) -> None:
        """All of them in one request to the slot: one frame per tick of the batch."""
        for frame in frames:
            if frame.shape != (FRAME_SAMPLES,) or frame.dtype != np.float32:
                raise ValueError(f"feed takes float32 frames of {FRAME_SAMPLES} samples, got {frame.dtype} {frame.shape}")
        self._take(wait=False)
        if not frames:
            return
        future = self._slots.submit(self.slot, frames, follows=self.follows)
        self._inflight.append((future, len(frames), self._reply if self.budget else None, None))
        self.turn_frames += len(frames)
        self.ticks += len(frames)

    def clear_input(self) -> None:
        self.turn_frames = 0

    def begin_response(self) -> None:
        self._take(wait=False)
        if self.budget or self._pending:
            raise RuntimeError(f"begin_response while a reply is in progress ({self.budget} frames still to come)")
        fed, self.budget = self.turn_frames > 0, min(max(self.turn_frames, 1), self._plugin.max_reply_frames)
        self.turn_frames = 0
        self._reply += 1
        if fed:  # the reply opens with the output of the last frame its slot was given
            if self._inflight:
                future, frames, reply, _ = self._inflight[-1]
                self._inflight[-1] = (future, frames, reply, self._reply)
                if self.budget > 1:  # ``step`` asks for the reply's next frame once this one is out
                    self._slots.follow(self.slot)
                self._opening = "ticking"
            elif self._heard is not None:
                self._pending.append(self._heard)
                self._heard = None
                self._opening = "done"
        # The reply's first frame is the last of the frames its slot still has to tick, one a tick
        # (or the tick after them, when the turn fed nothing).
        self._plugin._count_reply_start(self._slots.queued(self.slot))

    def step(self) -> np.ndarray | None:
        self._said = None
        if self.budget == 0:
            return None
        self._take(wait=False)
        if self._opening is not None:
            # The reply opens with an output of before it began: its next frames queue behind that one
            # now, not once the session has it and asks again. One computed already goes out with
            # the frame after it: at once, a client playing it would wait for that one (two ticks away).
            done, self._opening = self._opening == "done", None
            self._tick_ahead(len(self._pending) + self._coming() - 1, self.budget - 1)
            while done and len(self._pending) < min(self.budget, 2):
                self._take(wait=True, first=True)
        # Frames fed (or ticked ahead) since this reply began are its next frames: they come first.
        while not self._pending:  # a stream's first tick gives nothing: then one more
            if not self._coming():
                # The session asks for the reply's next frame at once (``follows``), unless this is the last.
                future = self._slots.submit(self.slot, [SILENCE], follows=self.follows and self.budget > 1)
                self._inflight.append((future, 1, self._reply, None))
                self.ticks += 1
                self._plugin._count(silence=1)
            self._take(wait=True, first=True)
        pcm, self._said = self._pending.popleft()
        self.budget -= 1
        self.replied += 1
        self._plugin._count(replied=1)
        self._tick_ahead(len(self._pending) + self._coming(), self.budget)
        return pcm

    def take_text(self) -> str:
        """The text Moshi sampled with the frame the latest ``step`` handed out ("" for none):
        the session's transcript delta (``serve/runtime/text.py``)."""
        return "" if self._said is None else self._plugin.text.text(self._said)

    def _tick_ahead(self, coming: int, budget: int) -> None:
        """The reply's next frames, ticked ahead on silence up to ``REPLY_AHEAD_FRAMES`` (never past
        its ``budget``) while ``coming`` frames already are: they ride the slot's next ticks while
        the session hands this one out, instead of waiting for it to ask for them."""
        while coming < min(budget, REPLY_AHEAD_FRAMES):
            self._inflight.append((self._slots.submit(self.slot, [SILENCE]), 1, self._reply, None))
            self.ticks += 1
            self._plugin._count(silence=1)
            coming += 1

    def cancel(self) -> None:
        self.budget = 0
        self._dropped(len(self._pending))  # computed, never handed out
        self._pending.clear()
        self._reply += 1
        self._opening = None

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.cancel()
            while self._inflight:  # the slot is released with nothing of it left in flight
                try:
                    self._take(wait=True)
                except Exception as error:  # noqa: BLE001 - the session is ending; its slot must still come back
                    log.warning("moshi slot %d: a tick of the closing stream failed: %s", self.slot, error)
            if self._heard is not None:  # no reply opens with it now
                self._heard = None
                self._dropped(1)
            self._plugin._placed_off(self._place, self.slot)

    @property
    def place(self) -> int:
        """The index of the place whose batch holds this stream's slot."""
        return self._place.index

    def _coming(self) -> int:
        """How many frames ticking now belong to the current reply (the one it opens with included)."""
        return sum(frames if reply == self._reply else int(opens == self._reply) for _, frames, reply, opens in self._inflight)

    def _take(self, *, wait: bool, first: bool = False) -> None:
        """The outputs of the frames ticking (fed, or silence for a reply), oldest first: those
        already computed (``wait`` False), all of them (``wait``), or only the oldest request's
        (``first``). Those of a frame fed or ticked for the current reply are its next frames, up to
        its budget, after the output it opens with; the others Moshi said while it was not replying:
        the latest is held (``_heard``) for the next reply to open with, and the ones before it are
        dropped."""
        listened = 0
        try:
            while self._inflight and (wait or self._inflight[0][0].done()):
                future, _, reply, opens = self._inflight.popleft()
                for out in future.result():
                    if self._heard is not None:  # a later output came: the one held opens no reply
                        self._heard = None
                        listened += 1
                    if out is None:
                        continue
                    if reply == self._reply and len(self._pending) < self.budget:
                        self._pending.append(out)
                    else:
                        self._heard = out
                if opens == self._reply and self._heard is not None:
                    self._pending.append(self._heard)
                    self._heard = None
                if first:
                    break
        finally:
            self._dropped(listened)

    def _dropped(self, frames: int) -> None:
        """``frames`` outputs no reply hands out, counted as listened here and in the plugin."""
        self.listened += frames
        self._plugin._count(listened=frames)
