"""The seam between the session layer and a model.

A ``ModelPlugin`` is built once per server and holds what sessions share (weights, captured
graph bindings). Each session opens its own ``ModelStream``, which holds only that session's
lightweight state (carry, counters, RNG offsets) and advances on the model's native clock: it is fed
whole native input frames and produces output one native chunk at a time, so a cancel takes effect
at the next chunk boundary.

Stream methods block and run in a worker thread; the session guarantees that no two calls on one
stream overlap and that they arrive in session order.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..runtime import SlotsFull as SlotsFull  # what ``open_stream`` raises when a plugin with slots has none free


class ConfigRefused(ValueError):
    """What ``ModelStream.configure`` raises for a value it refuses: the message names what is wrong
    and what was expected, ``param`` the session field (a dotted path). The session answers it as
    an ``invalid_value`` error and keeps its configuration as it was."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class PluginInfo:
    name: str
    input_rate: int  # Hz of the float32 frames ``feed`` takes
    output_rate: int  # Hz of the float32 chunks ``step`` returns
    frame_samples: int  # native input frame, in input-rate samples
    description: str


class ModelStream(ABC):
    """One session's running model.

    Two seams are optional, and a stream has them by defining them (the session looks): a stream
    that speaks text defines ``take_text()``, the text of its latest ``step`` (``serve/runtime/text.py``;
    Moshi, PersonaPlex), and one that takes a client's voice WAV defines ``upload_voice(name, wav)``,
    raising ``ConfigRefused`` for a WAV it refuses (PersonaPlex; over the duplex route, ``ref_audio``).
    """

    #: Set by the session for each call, before it starts: True when the session makes its next
    #: call as soon as this one returns (the next frame of a reply it computes ahead of playback).
    #: A plugin that ticks sessions together may wait a moment for such a stream's next call.
    follows: bool = False

    @abstractmethod
    def feed(self, frame: np.ndarray) -> None:
        """Take one native frame of user audio: float32, exactly ``frame_samples`` long."""

    def feed_frames(self, frames: list[np.ndarray]) -> None:
        """``feed`` each frame, in order. A plugin whose every call costs a round trip (to another
        process, say) feeds them all in one."""
        for frame in frames:
            self.feed(frame)

    @abstractmethod
    def clear_input(self) -> None:
        """Forget the input fed since the last ``begin_response`` (the client cleared its buffer)."""

    @abstractmethod
    def begin_response(self) -> None:
        """The user's turn is over (everything fed since the last call): prepare its reply."""

    @abstractmethod
    def step(self) -> np.ndarray | None:
        """The reply's next chunk (float32 at ``output_rate``), or None once the reply is over."""

    @abstractmethod
    def cancel(self) -> None:
        """Drop the reply in progress; the next ``step`` returns None. Fed input is kept."""

    def configure(self, instructions: str, voice: str) -> None:
        """The session's ``instructions`` and ``voice`` changed (``session.update``): a model with a
        persona (a role prompt, a voice prompt) takes them, ready when this returns, or raises
        ``ConfigRefused`` naming what it refuses. The others have none and ignore them."""

    def close(self) -> None:
        """Release per-session state."""


class ModelPlugin(ABC):
    info: PluginInfo

    @abstractmethod
    def open_stream(self) -> ModelStream:
        """A fresh stream for one session; called on the event loop, must be cheap. A plugin with
        a fixed number of streams (``free_slots``) raises ``SlotsFull`` when none is free."""

    def reserve(self, sessions: int) -> None:
        """Build now whatever ``sessions`` concurrent streams will need, so that none waits for it
        later. The server calls it once at startup with its session limit."""

    def free_slots(self) -> int | None:
        """How many more streams ``open_stream`` admits now, for a plugin with a fixed number of
        them (a batch's slots); None when only the server's session limit bounds them."""
        return None

    def describe(self) -> dict[str, Any]:
        """What the plugin runs and its counters, for ``/v1/models`` (blocking: the app calls it off
        the event loop)."""
        return {"model": self.info.name}

    def close(self) -> None:
        """Release shared state at server shutdown."""


def add_counters(total: dict[str, Any], counters: dict[str, Any]) -> None:
    """Add nested counters into ``total`` (several engines' or processes' replay counters, summed)."""
    for key, value in counters.items():
        if isinstance(value, dict):
            add_counters(total.setdefault(key, {}), value)
        else:
            total[key] = total.get(key, 0) + value
