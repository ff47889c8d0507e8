"""What a bound operator keeps of each class it meets (`OperatorClass`) and counts of its calls
(`OperatorCounters`), and how a class is named."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..binding import (
    Places,
)
from ..catalog import CatalogClass


@dataclass
class OperatorCounters:
    """What a bound operator did with its calls, and why."""

    calls: int = 0
    graph_calls: int = 0  # rewritten graph, eager or replayed
    verified: int = 0  # calls run beside the stock call and found bit-identical
    stock: int = 0  # calls that ran the stock code
    adopted: int = 0  # sites whose tensor was not the carry's and was copied into it
    evicted: int = 0  # sites copied out of the carries to another stream's state object before this stream's call
    stock_by_reason: dict[str, int] = field(default_factory=dict)

    def fallback(self, reason: str) -> None:
        self.stock += 1
        self.stock_by_reason[reason] = self.stock_by_reason.get(reason, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        """The counters; `evicted` only where a stream's state was ever copied out (streams interleaved
        without session states, which most users never do)."""
        counts = {k: v for k, v in vars(self).items() if k != "stock_by_reason" and (k != "evicted" or v)}
        return {**counts, "stock_by_reason": dict(self.stock_by_reason)}


@dataclass
class OperatorClass:
    """One catalog class of an operator, as met in traffic."""

    name: str
    call: CatalogClass
    graph: torch.fx.GraphModule | None = None
    outputs: tuple | None = None  # (treespec, non-tensor leaves by position) of the method's output
    effects: dict[str, tuple[str, Any]] | None = None  # counter path -> ("add", delta) or ("set", value)
    effect_places: Places | None = None  # where the effects' counters are (None: one lies under another)
    verify_left: int = 0
    verified: int = 0  # calls verified beside the stock call
    refused: str | None = None
    capture_ms: float = 0.0
    calls: int = 0  # calls this class ran through its rewritten graph (verified, eager or replayed)
    exported: torch.fx.GraphModule | None = None  # the step as exported, before the retention rewrite
    hosts: dict[str, Any] = field(default_factory=dict)  # the guarded host values at capture, by path
    spanning: tuple[str, ...] = ()  # counters whose regime maps more than one value to this class
    seen: set = field(default_factory=set)  # the spanning counters' values verified so far
    inputs: tuple = ()  # the input tensors' shapes at capture (an int `units` is checked against them)


def class_name(operator: str, units: int, extent: int, flush: bool = False, modes: dict[str, Any] | None = None) -> str:
    """The name of an operator's catalog class in reports, stamps and certificates (with the
    binding's modes, the values it was captured at)."""
    return (
        f"{operator}[n={units},L={extent}]"
        + ("(flush)" if flush else "")
        + (f"{{{', '.join(f'{p}={v!r}' for p, v in modes.items())}}}" if modes else "")
    )


#: Signatures (host values, layouts) captured per catalog class at most; more run the stock code.
VARIANTS = 4
