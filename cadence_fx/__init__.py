"""cadence-fx: lossless compiler passes for full-duplex speech models.

Public API: declare a family's `Contract`, derive its `Catalog` before any traffic.
"""

from .catalog import Catalog, CatalogClass, OperatorCatalog, RegionDerivation, derive
from .contract import (
    Admission,
    Clock,
    ClockKind,
    Contract,
    ContractError,
    DeviceConstant,
    Effect,
    Interactivity,
    Lifetime,
    Operator,
    PromptPlusHistory,
    Rate,
    Region,
    RingCache,
    SlidingWindow,
)

__all__ = [
    "Admission",
    "Catalog",
    "CatalogClass",
    "Clock",
    "ClockKind",
    "Contract",
    "ContractError",
    "DeviceConstant",
    "Effect",
    "Interactivity",
    "Lifetime",
    "Operator",
    "OperatorCatalog",
    "PromptPlusHistory",
    "Rate",
    "Region",
    "RegionDerivation",
    "RingCache",
    "SlidingWindow",
    "derive",
]
