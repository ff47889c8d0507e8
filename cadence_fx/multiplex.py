"""One interface for every transformed model: its report, and streams time-multiplexed over one
set of graphs.

A transformed model's graphs read and write fixed addresses (the carries), so N streams share one
set of graphs by taking turns: each stream owns a `SessionState` (its carries' contents, their
host-side counters and its RNG state); `swap_in` writes a stream's state into the addresses the
graphs read before its call, `swap_out` takes what the call wrote back into the stream's state.
The device RNG state belongs to the stream: a model that draws noise (a vocoder) then draws the
same noise for a stream whatever ran between its calls.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SessionState", "Transformed", "rng_get", "rng_seeded", "rng_set"]


@dataclass
class SessionState:
    """One stream's share of a transformed model: its resident tensors, their host-side counters,
    and its RNG state."""

    tensors: list[torch.Tensor]
    counters: list[int]
    rng: torch.Tensor

    @property
    def nbytes(self) -> int:
        """What one more stream costs: its copy of the resident tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors)


def rng_get(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def rng_set(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def rng_seeded(device: torch.device, seed: int) -> torch.Tensor:
    """The generator state `seed` gives on `device` (what `manual_seed(seed)` gives the process's
    generator there), from a generator of its own: the process's generators are never touched, so
    another thread may draw from them meanwhile (`cadence_fx.lanes.RngSection`)."""
    return torch.Generator(device).manual_seed(seed).get_state()


class Transformed(abc.ABC):
    """What `transform` returns, whatever the model: `report`, and the stream-multiplexing calls."""

    report: Any

    @abc.abstractmethod
    def device(self) -> torch.device:
        """Where the resident state lives."""

    @abc.abstractmethod
    def resident(self) -> tuple[list[torch.Tensor], list[int]]:
        """The tensors the graphs read and write in place, and their host-side counters."""

    @abc.abstractmethod
    def set_counters(self, counters: list[int]) -> None:
        """Write the host-side counters `resident` reads."""

    def session_state(self, seed: int) -> SessionState:
        """A new stream's state: the resident state as it is now (a fresh model's, or after a
        reset), and the RNG state `seed` gives."""
        tensors, counters = self.resident()
        return SessionState([t.clone() for t in tensors], list(counters), rng_seeded(self.device(), seed))

    def swap_in(self, state: SessionState, *, rng: bool = True) -> None:
        """Before a stream's call: its state into the addresses the graphs read. `rng=False` leaves
        the process's generator alone, for a caller that hands the stream's RNG state to the calls
        that draw (`cadence_fx.lanes.RngSection`: lanes in several threads share one generator)."""
        tensors, _ = self.resident()
        for resident, own in zip(tensors, state.tensors, strict=True):
            resident.copy_(own)
        self.set_counters(state.counters)
        if rng:
            rng_set(self.device(), state.rng)

    def swap_out(self, state: SessionState, *, rng: bool = True) -> None:
        """After a stream's call: what the call wrote, back into the stream's own state."""
        tensors, counters = self.resident()
        for resident, own in zip(tensors, state.tensors, strict=True):
            own.copy_(resident)
        state.counters = list(counters)
        if rng:
            state.rng = rng_get(self.device())
