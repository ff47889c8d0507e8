"""`RingCache`: a preallocated ring written in place (a static attention cache, a cross-attention
memory): its shape never changes, so its carry is the ring itself and nothing is rewritten."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import sympy

from cadence_fx.contract import Region, Retention


@dataclass(frozen=True)
class RingCache(Retention):
    """A preallocated ring of `capacity` units written in place: the shape never changes."""

    capacity: int

    counts: ClassVar[tuple[str, ...]] = ("capacity",)
    fixed: ClassVar[bool] = True
    chunk_bound: ClassVar[str | None] = "capacity"

    def retained(self, region: Region) -> sympy.Expr:
        return sympy.Integer(self.capacity)
