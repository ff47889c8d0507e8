"""`SlidingWindow`: keep the newest `window` units (a convolution's left context, an attention
window). Rewritten by the window pass: the concat-then-trim becomes writes into the carry."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import ClassVar

import sympy

from cadence_fx.catalog import T
from cadence_fx.contract import ContractError, Region, Retention


@dataclass(frozen=True)
class SlidingWindow(Retention):
    """Keep the newest `window` units. The retained extent starts at `initial`."""

    window: int
    initial: int = 0

    counts: ClassVar[tuple[str, ...]] = ("window", "initial")
    caller_trims: ClassVar[bool] = True

    def check(self, path: str, region: Region, symbols: Mapping[str, int | Fraction]) -> None:
        super().check(path, region, symbols)
        # A sliding window may keep less than a chunk (a convolution's left context, a vocoder's overlap).
        if self.initial > self.window:
            raise ContractError(f"{path}.retention.initial", "C2", "initial extent exceeds the window")

    def retained(self, region: Region) -> sympy.Expr:
        return sympy.Min(self.initial + region.stride * T, self.window)
