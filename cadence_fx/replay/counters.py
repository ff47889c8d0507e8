"""The counters of one binding: calls, captures, replays, eager calls by reason, invalidations."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ReplayCounters:
    """`replays` counts calls whose outputs came from graph replay, the capturing call included."""

    calls: int = 0
    captures: int = 0
    replays: int = 0
    eager: int = 0
    invalidations: int = 0
    fallbacks: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "captures": self.captures,
            "replays": self.replays,
            "eager": self.eager,
            "invalidations": self.invalidations,
            "fallbacks": dict(sorted(self.fallbacks.items())),
        }
