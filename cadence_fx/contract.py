"""The contract: what a model family declares about itself, and the static checks C1-C3.

A contract is data. Every class here is a frozen dataclass; `Contract.__post_init__` runs the
static checks, so an unfit declaration never exists as an object. A violation raises
`ContractError` naming the field path (``regions[0].retention.history``) and the rule it breaks
(``C1``, ``C2``, ``C3`` or ``declaration`` for plain schema errors).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass, field
from fractions import Fraction
from typing import Any, ClassVar, TypeGuard

import networkx
import sympy
import torch

__all__ = [
    "Admission",
    "Clock",
    "ClockKind",
    "Contract",
    "ContractError",
    "DeviceConstant",
    "Effect",
    "Interactivity",
    "Lifetime",
    "Operator",
    "Rate",
    "Region",
    "Retention",
    "RETENTION_POLICIES",
    "DTYPES",
    "carry_axis",
    "fixed_extent",
    "policies",
    "region_clock",
]


class ContractError(ValueError):
    """A declaration that breaks a rule. `field` is the path into the contract, `rule` the rule."""

    def __init__(self, field: str, rule: str, message: str):
        self.field = field
        self.rule = rule
        super().__init__(f"{field}: {message} (rule {rule})")


class ClockKind(enum.Enum):
    TOKENS = "tokens"
    FRAMES = "frames"
    SAMPLES = "samples"
    SOLVER_STEPS = "solver_steps"
    CODEBOOKS = "codebooks"
    TURNS = "turns"
    CALLS = "calls"


class Lifetime(enum.Enum):
    PER_STREAM = "per_stream"
    PER_TURN = "per_turn"
    IMMUTABLE_PROMPT = "immutable_prompt"


class Effect(enum.Enum):
    NONE = "none"
    DEVICE_RNG = "device_rng"
    HOST_RNG = "host_rng"


DTYPES: Mapping[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


@dataclass(frozen=True)
class Clock:
    """A quantity along which execution advances (LLM tokens, mel frames, solver steps, ...)."""

    name: str
    kind: ClockKind


@dataclass(frozen=True)
class Rate:
    """`value` units of `clock` per one unit of `per`, fixed by configuration (C1).

    A named rate can be used in region dimensions: ``Rate("solver_step", "chunk", 10,
    name="n_steps")`` makes ``n_steps`` a symbol worth 10.
    """

    clock: str
    per: str
    value: int | Fraction
    name: str | None = None


#: Every retention policy by name, in the order they were defined: each registers itself here by
#: subclassing `Retention` (one file each, in `passes/retention/`). The core reads a region's
#: policy through `Retention` alone and never imports one.
RETENTION_POLICIES: dict[str, type[Retention]] = {}


class Retention:
    """How a region's extent stays bounded (C2): the base of every retention policy.

    A policy is a frozen dataclass subclassing this, one file in `passes/retention/`; defining it
    registers it in `RETENTION_POLICIES`. What the core asks of it:

    - `counts`: its fields that are counts (non-negative ints), which `check` checks;
    - `chunk_bound`: the field that must hold at least one whole chunk (the region's stride);
    - `check(path, region, symbols)`: its rules on its region, raising `ContractError`;
    - `retained(region)`: r(t), the extent retained after t calls (a sympy expression of
      `cadence_fx.catalog.T`);
    - `fixed`: its shape never changes (written in place: its carry is the state, nothing rewritten);
    - `clocked`: its region advances along a clock (one that does not declares no clock, axis or
      stride);
    - `caller_trims`: a caller may cut a returned state to it (the binding's `caller_trims`);
    - `head`: the units it keeps at the front, rewritten with the tail (a prompt).
    """

    counts: ClassVar[tuple[str, ...]] = ()
    chunk_bound: ClassVar[str | None] = None
    fixed: ClassVar[bool] = False
    clocked: ClassVar[bool] = True
    caller_trims: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        RETENTION_POLICIES[cls.__name__] = cls

    @property
    def head(self) -> int:
        return 0

    def check(self, path: str, region: Region, symbols: Mapping[str, int | Fraction]) -> None:
        for attr in self.counts:
            value = getattr(self, attr)
            if not _is_count(value) or value < 0:
                raise ContractError(f"{path}.retention.{attr}", "C2", f"must be a non-negative int, got {value!r}")
        # An attention context (a ring, a prompt plus its history) must hold at least one whole chunk.
        if self.chunk_bound is not None and getattr(self, self.chunk_bound) < region.stride:
            raise ContractError(
                f"{path}.retention.{self.chunk_bound}",
                "C2",
                f"retention bound {getattr(self, self.chunk_bound)} is below the chunk (stride {region.stride})",
            )

    def retained(self, region: Region) -> sympy.Expr:
        raise NotImplementedError(f"{type(self).__name__} declares no retained extent")


def policies(predicate: Callable[[type[Retention]], bool] = lambda policy: True) -> str:
    """The registered policies that satisfy `predicate`, named for a message in the order of their
    names ("InPlace or RingCache"), whatever order they were imported in."""
    return " or ".join(sorted(name for name, policy in RETENTION_POLICIES.items() if predicate(policy)))


@dataclass(frozen=True)
class Region:
    """A persistent state region.

    `dims` are expressions (strings or ints) over the contract's quantities, its named rates and
    the region's own `clock`, which stands for the region's extent along its retention `axis`.
    `stride` is s_r: the units of `clock` each steady call appends. `retention=None` declares
    state that grows with the session (it can never satisfy C2). `holds_call` says the region
    also holds the call's new units while the call runs (concat-then-trim retention, as in an
    attention K/V cache); a convolution's left context holds only what it retains. `stock_dims`
    is the shape the stock code provisions, when the adapter declares it: it gives the
    over-reservation ratio. A region whose policy is not `clocked` (`InPlace`) has one fixed
    shape and no clock, axis or stride.
    Every field after `dims` is passed by keyword.
    """

    name: str
    dims: tuple[str | int, ...]
    _: KW_ONLY
    dtype: str
    lifetime: Lifetime
    retention: Retention | None
    axis: int | None = None
    clock: str | None = None
    stride: int = 0
    address_stable: bool = True
    holds_call: bool = True
    stock_dims: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Admission:
    """The admission predicate: at most `max_per_call` units of `clock` per call."""

    clock: str
    max_per_call: int

    def admits(self, units) -> bool:
        return 0 < units <= self.max_per_call


@dataclass(frozen=True)
class Operator:
    """A hot operator: called once per call of `region`'s stream, with `steady` new units per
    steady call and one of `flush` units on a stream's final call.

    A stream's final call follows its steady state unless `early_flush` declares that a stream
    may end before its retention window fills; an undeclared early flush is a catalog miss, which
    runs eager (fail closed) and is counted.
    """

    name: str
    region: str
    steady: int
    flush: tuple[int, ...] = ()
    early_flush: bool = False
    effect: Effect = Effect.NONE


@dataclass(frozen=True)
class DeviceConstant:
    """A host-computed, configuration-only value the stock code copies to the device each call.

    `site` names where the stock code builds it (``module.Class.method``); a pass hoists it into
    a device buffer computed once exactly as the stock code computes it.
    """

    name: str
    site: str
    description: str = ""


@dataclass(frozen=True)
class Interactivity:
    """C3: one interactive session whose stages run in sequence, never batched inside it."""

    stages: tuple[str, ...]
    single_session: bool = True
    batch_per_session: int = 1


@dataclass(frozen=True)
class Contract:
    family: str
    clocks: tuple[Clock, ...]
    rates: tuple[Rate, ...]
    regions: tuple[Region, ...]
    operators: tuple[Operator, ...]
    admission: Admission
    interactivity: Interactivity
    quantities: Mapping[str, int] = field(default_factory=dict)
    constants: tuple[DeviceConstant, ...] = ()

    def __post_init__(self) -> None:
        check(self)

    def region(self, name: str) -> Region:
        for region in self.regions:
            if region.name == name:
                return region
        raise KeyError(f"contract {self.family!r} declares no region {name!r}")

    def symbols(self) -> dict[str, int | Fraction]:
        """Every name a region dimension may use besides its own clock, with its value (a named
        rate's may be a Fraction)."""
        values: dict[str, int | Fraction] = dict(self.quantities)
        values.update({rate.name: rate.value for rate in self.rates if rate.name})
        return values


def fixed_extent(retention: Retention | None) -> bool:
    """Whether a region's shape never changes: a ring or an in-place buffer, written in place
    (nothing to rewrite: its carry is the state itself)."""
    return retention is not None and retention.fixed


def carry_axis(region: Region) -> int:
    """The axis a region's carry measures its extent along: the retention axis, or for an
    `InPlace` region (no axis) its last dim, which never changes."""
    if not _clocked(region):
        return len(region.dims) - 1
    if region.axis is None:
        raise ContractError(f"{region.name}.axis", "declaration", "a clocked region declares its retention axis")
    return region.axis


def region_clock(region: Region) -> str:
    """The clock a clocked region advances along (an `InPlace` region names none)."""
    if region.clock is None:
        raise ContractError(f"{region.name}.clock", "declaration", "a clocked region declares its clock")
    return region.clock


def _clocked(region: Region) -> bool:
    """Whether the region advances along a clock: any but a policy that says it does not (a value
    that is no policy is checked as a clocked region's, then refused by `_check_retention`)."""
    return not isinstance(region.retention, Retention) or region.retention.clocked


def _is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_clocks(contract: Contract) -> set[str]:
    names = [clock.name for clock in contract.clocks]
    for i, clock in enumerate(contract.clocks):
        if not isinstance(clock.kind, ClockKind):
            raise ContractError(f"clocks[{i}].kind", "C1", f"{clock.kind!r} is not a ClockKind")
        if names.count(clock.name) > 1:
            raise ContractError(f"clocks[{i}].name", "declaration", f"clock {clock.name!r} declared twice")
    if len(names) < 2:
        raise ContractError("clocks", "C1", f"needs two or more clocks, got {len(names)}")
    linked: set[str] = set()
    for i, rate in enumerate(contract.rates):
        for attr in ("clock", "per"):
            if getattr(rate, attr) not in names:
                raise ContractError(f"rates[{i}].{attr}", "C1", f"undeclared clock {getattr(rate, attr)!r}; declared: {names}")
        if rate.clock == rate.per:
            raise ContractError(f"rates[{i}]", "C1", f"a rate relates two clocks, got {rate.clock!r} twice")
        if not (_is_count(rate.value) or isinstance(rate.value, Fraction)):
            raise ContractError(
                f"rates[{i}].value", "C1", f"must be an int or Fraction fixed by configuration, got {rate.value!r}"
            )
        if rate.value <= 0:
            raise ContractError(f"rates[{i}].value", "C1", f"must be positive, got {rate.value}")
        linked.update((rate.clock, rate.per))
    if len(linked) < 2:
        raise ContractError("rates", "C1", "no configuration-fixed rate links two clocks")
    return set(names)


def _check_retention(path: str, region: Region, symbols: Mapping[str, int | Fraction]) -> None:
    retention = region.retention
    if retention is None:
        return
    if not isinstance(retention, Retention):
        raise ContractError(
            f"{path}.retention", "C2", f"unknown retention policy {type(retention).__name__}; registered: {policies()}"
        )
    retention.check(path, region, symbols)


def _check_regions(contract: Contract, clocks: set[str]) -> None:
    if not contract.regions:
        raise ContractError("regions", "C2", "declares no state region")
    symbols = contract.symbols()
    seen: set[str] = set()
    for i, region in enumerate(contract.regions):
        path = f"regions[{i}]"
        if region.name in seen:
            raise ContractError(f"{path}.name", "declaration", f"region {region.name!r} declared twice")
        seen.add(region.name)
        if region.dtype not in DTYPES:
            raise ContractError(f"{path}.dtype", "declaration", f"unknown dtype {region.dtype!r}; known: {sorted(DTYPES)}")
        if not isinstance(region.lifetime, Lifetime):
            raise ContractError(f"{path}.lifetime", "declaration", f"{region.lifetime!r} is not a Lifetime")
        if not _clocked(region):
            _check_retention(path, region, symbols)
            if region.stock_dims is not None and len(region.stock_dims) != len(region.dims):
                raise ContractError(f"{path}.stock_dims", "declaration", "rank differs from dims")
            continue
        if region.clock not in clocks:
            raise ContractError(f"{path}.clock", "C1", f"undeclared clock {region.clock!r}; declared: {sorted(clocks)}")
        if not _is_count(region.stride):
            raise ContractError(f"{path}.stride", "C2", f"must be an integer, got {region.stride!r}")
        if region.stride <= 0:
            raise ContractError(f"{path}.stride", "C2", f"must be positive, got {region.stride}")
        if not _is_count(region.axis) or not 0 <= region.axis < len(region.dims):
            raise ContractError(f"{path}.axis", "declaration", f"axis {region.axis} outside dims of rank {len(region.dims)}")
        for j, dim in enumerate(region.dims):
            names = {str(s) for s in sympy.sympify(dim).free_symbols}
            unknown = names - set(symbols) - {region.clock}
            if unknown:
                raise ContractError(
                    f"{path}.dims[{j}]",
                    "C1",
                    f"depends on undeclared clock or quantity {sorted(unknown)}; "
                    f"usable: {sorted(symbols)} and the region's clock {region.clock!r}",
                )
        if str(sympy.sympify(region.dims[region.axis])) != region.clock:
            raise ContractError(
                f"{path}.dims[{region.axis}]", "declaration", f"the retention axis must be the region's clock {region.clock!r}"
            )
        if region.stock_dims is not None and len(region.stock_dims) != len(region.dims):
            raise ContractError(f"{path}.stock_dims", "declaration", "rank differs from dims")
        _check_retention(path, region, symbols)
    if all(region.retention is None for region in contract.regions):
        raise ContractError(
            "regions", "C2", "no region declares a retention policy that bounds its extent independently of session length"
        )


def _check_operators(contract: Contract) -> None:
    names = {region.name for region in contract.regions}
    admission = contract.admission
    for i, op in enumerate(contract.operators):
        path = f"operators[{i}]"
        if op.region not in names:
            raise ContractError(f"{path}.region", "declaration", f"undeclared region {op.region!r}")
        if not isinstance(op.effect, Effect):
            raise ContractError(f"{path}.effect", "declaration", f"{op.effect!r} is not an Effect")
        region = contract.region(op.region)
        # An operator's units are counted in its region's clock; an InPlace region has none, so
        # in the admission's.
        in_place = not _clocked(region)
        clock = admission.clock if in_place else region_clock(region)
        if not in_place and op.steady != region.stride:
            raise ContractError(
                f"{path}.steady", "C2", f"steady call of {op.steady} differs from the region stride {region.stride}"
            )
        for j, units in enumerate((op.steady, *op.flush)):
            field_path = f"{path}.steady" if j == 0 else f"{path}.flush[{j - 1}]"
            if not _is_count(units):
                raise ContractError(field_path, "declaration", f"must be an int, got {units!r}")
            try:
                in_admission_clock = rate_between(contract, clock, admission.clock, path=field_path) * units
            except ContractError:
                raise ContractError(
                    field_path,
                    "C1",
                    f"no declared rate converts {region.clock!r} into {admission.clock!r}: "
                    f"the call is counted in the clock of the operator's region "
                    f"{region.name!r}, the admission in {admission.clock!r}; declare a "
                    "Rate that links them",
                ) from None
            if not admission.admits(in_admission_clock):
                raise ContractError(
                    field_path,
                    "declaration",
                    f"{units} {clock} per call is {in_admission_clock} {admission.clock}, outside the admission "
                    f"predicate 0 < n <= {admission.max_per_call}",
                )
        if not in_place and len(op.flush) > region.stride:
            raise ContractError(f"{path}.flush", "C2", f"{len(op.flush)} flush sizes exceed the stride bound {region.stride}")


def rate_between(contract: Contract, src: str, dst: str, *, path: str = "rates") -> Fraction:
    """Units of `dst` per unit of `src`, multiplied along the declared rates (either direction)."""
    graph: networkx.DiGraph[str] = networkx.DiGraph()
    graph.add_nodes_from(clock.name for clock in contract.clocks)
    for rate in contract.rates:
        graph.add_edge(rate.per, rate.clock, factor=Fraction(rate.value))
        graph.add_edge(rate.clock, rate.per, factor=1 / Fraction(rate.value))
    try:
        hops = networkx.shortest_path(graph, src, dst)
    except (networkx.NetworkXNoPath, networkx.NodeNotFound):
        raise ContractError(path, "C1", f"no declared rate converts {src!r} into {dst!r}") from None
    factor = Fraction(1)
    for a, b in zip(hops, hops[1:]):
        factor *= graph.edges[a, b]["factor"]
    return factor


def check(contract: Contract) -> None:
    """Run the static checks; raise `ContractError` on the first violation."""
    clocks = _check_clocks(contract)
    for name, value in contract.quantities.items():
        if not _is_count(value) or value <= 0:
            raise ContractError(f"quantities.{name}", "declaration", f"must be a positive int, got {value!r}")
    adm = contract.admission
    if adm.clock not in clocks:
        raise ContractError("admission.clock", "C1", f"undeclared clock {adm.clock!r}")
    if not _is_count(adm.max_per_call) or adm.max_per_call <= 0:
        raise ContractError("admission.max_per_call", "C2", f"must be a positive int, got {adm.max_per_call!r}")
    _check_regions(contract, clocks)
    _check_operators(contract)
    inter = contract.interactivity
    if not inter.single_session:
        raise ContractError("interactivity.single_session", "C3", "the contract covers one interactive session")
    if inter.batch_per_session != 1:
        raise ContractError("interactivity.batch_per_session", "C3", f"no intra-session batching, got {inter.batch_per_session}")
    if not inter.stages:
        raise ContractError("interactivity.stages", "C3", "declare the session's sequential stages")
