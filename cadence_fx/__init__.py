"""cadence-fx: lossless compiler passes for full-duplex speech models.

Public API: declare a model's `Contract` and its `Binding` (where each region lives, which methods
are hot), derive its `Catalog` before any traffic, `transform(model, contract, binding)` (state
rule, carry, shadow audit, exact-shape replay), and read the report it returns. A `transformers`
model's contract and binding can be derived instead (`derive_transformers`, or `transform(model)`).
"""

from .audit import AuditMismatch, ShadowAuditor
from .binding import Binding, BindingError, OperatorBinding, RegionBinding
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
    Rate,
    Region,
    Retention,
)
from .hf import DeriveError, derive_transformers
from .passes.retention import InPlace, PromptPlusHistory, RingCache, SlidingWindow
from .replay import Certificate, ExactShapeReplay, ShapeClass, Signature
from .transform import TransformReport, transform

__all__ = [
    "Binding",
    "BindingError",
    "OperatorBinding",
    "RegionBinding",
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
    "Retention",
    "InPlace",
    "RingCache",
    "SlidingWindow",
    "derive",
    "DeriveError",
    "derive_transformers",
]
