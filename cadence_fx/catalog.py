"""Catalog derivation: pure functions from a contract to every extent, bound, byte count and
shape class, computed with sympy before any traffic.

Vocabulary (docs/method.md): after t calls a region retains r(t) units along its clock; a
call that appends f units sees a live extent of r(t) + f (a ring cache is written in place, so
its live extent is its capacity). The bound A_r = sup_t live(t), the lower extent A_r^- = r(0),
the window W_r = sup_t r(t) - r(0), and an operator over the region sees K_r = ceil(W_r / s_r) + 1
distinct retained extents in steady state (W_r / s_r + 1 when the stride divides the window).
Each flush size adds one class at the steady extent (one per extent when the operator declares
early flushes), so partial flushes add at most s_r classes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import sympy

from .contract import DTYPES, Contract, Operator, Region, fixed_extent, rate_between, region_clock

__all__ = [
    "Catalog",
    "CatalogClass",
    "OperatorCatalog",
    "RegionDerivation",
    "DEFAULT_BUDGET",
    "derive",
    "retained_extent",
]

#: Widest steady catalog an operator may have and still be captured (one graph per class).
DEFAULT_BUDGET = 64

#: The call index: r(t) is the extent retained after t calls of a stream.
T = sympy.Symbol("t", integer=True, nonnegative=True)


def retained_extent(region: Region) -> sympy.Expr:
    """r(t): the units the region retains between calls after t calls (its policy's; with no
    policy, all it was ever given: s*t)."""
    if region.retention is None:
        return region.stride * T
    return region.retention.retained(region)


def call_units(contract: Contract, region: Region) -> int:
    """The most units one call appends to the region: over its operators (steady or flush), or,
    with no operator declared on it, the most the admission predicate lets a call bring."""
    sizes = [units for op in contract.operators if op.region == region.name for units in (op.steady, *op.flush)]
    if sizes:
        return max(sizes)
    admission = contract.admission
    return math.floor(rate_between(contract, admission.clock, region_clock(region)) * admission.max_per_call)


def live_extent(contract: Contract, region: Region) -> sympy.Expr:
    """The extent the region holds during call t: retained plus the call's own units."""
    if fixed_extent(region.retention) or not region.holds_call:
        return retained_extent(region)
    return retained_extent(region) + call_units(contract, region)


@dataclass(frozen=True)
class RegionDerivation:
    name: str
    retained: sympy.Expr  # r(t)
    live: sympy.Expr  # r(t) + f during a call
    lower: int  # A^- = r(0)
    bound: int | None  # A = sup live(t); None when unbounded
    window: int | None  # W = sup r(t) - r(0)
    stride: int
    dtype: str
    shape: tuple[int, ...] | None  # allocation at the bound
    bytes: int | None
    stock_shape: tuple[int, ...] | None
    stock_bytes: int | None
    rho: sympy.Rational | None  # prod(stock) / prod(demand)

    def demand(self) -> tuple[tuple[int, ...], int]:
        """(shape, bytes) of the allocation at the bound; an unbounded region has none: ValueError."""
        if self.shape is None or self.bytes is None:
            raise ValueError(f"region {self.name!r} is unbounded: no allocation holds it (its retention policy bounds it)")
        return self.shape, self.bytes

    def kept(self) -> int:
        """The most units the region retains between calls, A^- + W; an unbounded region has no such
        number: ValueError."""
        if self.window is None:
            raise ValueError(f"region {self.name!r} is unbounded: it retains without bound (its retention policy bounds it)")
        return self.lower + self.window

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "retained": str(self.retained),
            "live": str(self.live),
            "lower": self.lower,
            "bound": self.bound,
            "window": self.window,
            "stride": self.stride,
            "dtype": self.dtype,
            "shape": list(self.shape) if self.shape else None,
            "bytes": self.bytes,
            "stock_shape": list(self.stock_shape) if self.stock_shape else None,
            "stock_bytes": self.stock_bytes,
            "rho": None if self.rho is None else float(self.rho),
            "rho_exact": None if self.rho is None else str(self.rho),
        }


@dataclass(frozen=True, order=True)
class CatalogClass:
    """One reachable call shape: `call` new units against a retained `extent`."""

    call: int
    extent: int
    flush: bool = False


@dataclass(frozen=True)
class OperatorCatalog:
    name: str
    region: str
    width: int | None  # K, None when unbounded
    grid: tuple[int, ...] | None  # retained extents in steady state; None when not enumerated
    classes: tuple[CatalogClass, ...]  # steady classes then flush classes
    in_scope: bool
    verdict: str

    @property
    def flush_classes(self) -> tuple[CatalogClass, ...]:
        return tuple(c for c in self.classes if c.flush)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "region": self.region,
            "K": self.width,
            "grid": list(self.grid) if self.grid is not None else None,
            "classes": [{"call": c.call, "extent": c.extent, "flush": c.flush} for c in self.classes],
            "in_scope": self.in_scope,
            "verdict": self.verdict,
        }


@dataclass(frozen=True)
class Catalog:
    family: str
    budget: int
    regions: tuple[RegionDerivation, ...]
    operators: tuple[OperatorCatalog, ...]

    def region(self, name: str) -> RegionDerivation:
        return next(r for r in self.regions if r.name == name)

    def operator(self, name: str) -> OperatorCatalog:
        return next(o for o in self.operators if o.name == name)

    def to_dict(self) -> dict:
        return {
            "family": self.family,
            "budget": self.budget,
            "regions": [r.to_dict() for r in self.regions],
            "operators": [o.to_dict() for o in self.operators],
        }


def _sup(expr: sympy.Expr) -> int | None:
    value = expr.subs(T, sympy.oo)
    return None if value.is_infinite else int(value)


def _shape(contract: Contract, dims, clock: str | None, extent: int) -> tuple[int, ...]:
    values = {sympy.Symbol(k): v for k, v in contract.symbols().items()}
    if clock is not None:  # a region that advances along no clock (InPlace) names none
        values[sympy.Symbol(clock)] = extent
    return tuple(int(sympy.sympify(d).subs(values)) for d in dims)


def derive_region(contract: Contract, region: Region) -> RegionDerivation:
    symbols = {sympy.Symbol(k): v for k, v in contract.symbols().items()}
    retained = retained_extent(region).subs(symbols)
    live = live_extent(contract, region).subs(symbols)
    lower = int(retained.subs(T, 0))
    bound = _sup(live)
    top = _sup(retained)
    beta = DTYPES[region.dtype].itemsize
    shape = None if bound is None else _shape(contract, region.dims, region.clock, bound)
    stock_shape = region.stock_dims
    rho = None
    if stock_shape is not None and shape is not None:
        rho = sympy.Rational(math.prod(stock_shape), math.prod(shape))
    return RegionDerivation(
        name=region.name,
        retained=retained,
        live=live,
        lower=lower,
        bound=bound,
        window=None if top is None else top - lower,
        stride=region.stride,
        dtype=region.dtype,
        shape=shape,
        bytes=None if shape is None else beta * math.prod(shape),
        stock_shape=stock_shape,
        stock_bytes=None if stock_shape is None else beta * math.prod(stock_shape),
        rho=rho,
    )


def derive_operator(op: Operator, region: RegionDerivation, budget: int) -> OperatorCatalog:
    if region.window is None:
        return OperatorCatalog(
            op.name, op.region, None, None, (), False, f"outside lossless scope: region {region.name!r} is unbounded"
        )
    # A region of one fixed extent (an in-place buffer: no stride) is one class.
    width = 1 if region.window == 0 else int(sympy.ceiling(sympy.Rational(region.window, region.stride))) + 1
    if width > budget:
        return OperatorCatalog(
            op.name,
            op.region,
            width,
            None,
            (),
            False,
            f"outside lossless scope: K = {width} exceeds the budget of {budget} classes",
        )
    grid = tuple(sorted({int(region.retained.subs(T, t)) for t in range(width + 1)}))
    assert len(grid) == width, f"grid {grid} disagrees with K = {width}"
    steady = tuple(CatalogClass(op.steady, extent) for extent in grid)
    flush_extents = grid if op.early_flush else grid[-1:]
    flush = tuple(CatalogClass(units, extent, flush=True) for units in op.flush for extent in flush_extents)
    return OperatorCatalog(op.name, op.region, width, grid, steady + flush, True, f"in scope: K = {width} <= budget {budget}")


def derive(contract: Contract, budget: int = DEFAULT_BUDGET) -> Catalog:
    """Derive the whole catalog of a contract. Pure: the same contract gives the same catalog."""
    if budget < 1:
        raise ValueError(f"budget must be a positive number of classes, got {budget}")
    regions = tuple(derive_region(contract, region) for region in contract.regions)
    by_name = {r.name: r for r in regions}
    operators = tuple(derive_operator(op, by_name[op.region], budget) for op in contract.operators)
    return Catalog(contract.family, budget, regions, operators)
