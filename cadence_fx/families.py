"""The one registry of model families: the `cadence_fx.families` entry points.

A family is found by name, never imported by the core: each entry point names a `Family`, whose
parts are "module:attribute" references imported only when used, so listing the families (for the
CLI's choices) loads no vendor code. cadence-fx's own families are declared in pyproject.toml
(`models/entry_points.py`); another package adds one by declaring an entry point in the same group.
A model that is no family at all needs none of this: `transform(model, contract, binding)`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import lru_cache
from importlib.metadata import entry_points
from typing import Any

__all__ = ["Family", "families", "family", "load"]

GROUP = "cadence_fx.families"


@dataclass(frozen=True)
class Family:
    """`contract`: the default contract's factory. How `transform(model, contract)` runs without a
    binding: `binding`, ``binding(model, contract) -> Binding`` (it may refuse a model that does not
    fit the contract), puts the family on the one pipeline; `compose`, for a family whose model is
    several models (``compose(model, contract, *, audit, replay, budget) -> (transformed, report)``),
    transforms each part from its own binding on the same pipeline and assembles them, with the
    family's named hooks (sizing a vendor's envelopes, installing bound operators in its glue). `reference`: builds the
    reference model at a depth
    on a device, for the CLI's diff (``reference(depth, device) -> (model, contract, stream)``,
    ``stream(transformed, chunks) -> str`` running a short stream and saying what it ran); `demo`:
    the CLI's demo, the stock and transformed models streamed side by side
    (``demo(depth, blocks, chunks) -> bool``, True when every chunk was bit-identical)."""

    name: str
    contract: str
    binding: str | None = None
    compose: str | None = None
    reference: str | None = None
    demo: str | None = None


def load(reference: str) -> Any:
    """The object a "module:attribute" reference names."""
    module, _, attribute = reference.partition(":")
    return getattr(importlib.import_module(module), attribute)


@lru_cache(maxsize=1)
def families() -> dict[str, Family]:
    found = {}
    for point in entry_points(group=GROUP):
        declared = point.load()
        if not isinstance(declared, Family) or declared.name != point.name:
            raise TypeError(f"entry point {point.name} = {point.value} in {GROUP} must name a Family called {point.name!r}")
        found[point.name] = declared
    return found


def family(name: str) -> Family:
    known = families()
    if name not in known:
        raise ValueError(f"unknown model family {name!r}; registered ({GROUP} entry points): {sorted(known)}")
    return known[name]
