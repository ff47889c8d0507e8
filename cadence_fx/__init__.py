"""cadence-fx: lossless compiler passes for full-duplex speech models.

Public API: declare a family's `Contract`, derive its `Catalog` before any traffic, `transform`
a model under it (state rule, carry, shadow audit), replay hot operators with `ExactShapeReplay`.
"""

from .audit import AuditMismatch, ShadowAuditor
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
from .replay import Certificate, ExactShapeReplay, ShapeClass, Signature
from .transform import TransformReport, transform

__all__ = [
    "AuditMismatch",
    "Certificate",
    "ExactShapeReplay",
    "ShapeClass",
    "Signature",
    "ShadowAuditor",
    "TransformReport",
    "transform",
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
