"""`PromptPlusHistory`: keep the first `prompt` units (a prompt, attention sinks) and the newest
`history`. Rewritten by the window pass, the head kept in place and the tail rolled:
``cat([x[..., :P], x[..., -H:]])``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import sympy

from cadence_fx.catalog import T
from cadence_fx.contract import Region, Retention


@dataclass(frozen=True)
class PromptPlusHistory(Retention):
    """Keep the first `prompt` units plus the newest `history` generated units."""

    prompt: int
    history: int

    counts: ClassVar[tuple[str, ...]] = ("prompt", "history")
    caller_trims: ClassVar[bool] = True
    chunk_bound: ClassVar[str | None] = "history"

    @property
    def head(self) -> int:
        return self.prompt

    def retained(self, region: Region) -> sympy.Expr:
        return self.prompt + sympy.Min(region.stride * T, self.history)
