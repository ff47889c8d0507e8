"""Stage 1, check and guard: every host value a call's program may depend on, read per call and
keyed per class (`cadence_fx.guards`); regimes resolved to the paths they cover; the value to
blame when a call matches no captured variant."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..binding import (
    SELF,
    get_path,
    resolve,
)
from ..guards import HOST_SCALARS, Regime, Unread, guard_key, host_values
from .records import OperatorClass
from .step import input_shapes, root_arguments

if TYPE_CHECKING:
    from .operator import BoundOperator


class Hosts:
    """The guarded host values of one call: its arguments' by path, and the model's as a list
    aligned with its settings' paths (thousands, read on every call); `as_dict()` joins them
    when they are needed by path (a capture, a verification, a message)."""

    __slots__ = ("arguments", "paths", "values", "_joined")

    def __init__(self, arguments: dict[str, Any], paths: tuple[str, ...], values: list) -> None:
        self.arguments, self.paths, self.values = arguments, paths, values
        self._joined: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        if self._joined is None:
            self._joined = {**self.arguments, **dict(zip(self.paths, self.values))}
        return self._joined


def read_guards(op: BoundOperator, roots: dict[str, Any]) -> tuple[Hosts, tuple, tuple]:
    """Every host value the call's program may depend on, those in its state arguments and in the
    model's modules (`cadence_fx.guards`), by path; the components of those a regime keys (the
    class is theirs, as it is its catalog class's); and the key the others make, each by its
    value and type (True and 1 are not the same program)."""
    arguments = host_values(root_arguments(roots))
    regimes = argument_regimes(op, arguments, roots)
    counted = tuple(
        (p, regimes[p].component(arguments[p])) for p in regimes if p in arguments and not isinstance(regimes[p], Unread)
    )
    key = guard_key({p: v for p, v in arguments.items() if p not in regimes}, regimes)
    if op._settings is None:
        return Hosts(arguments, (), []), counted, (key,)
    values = op._settings.read()
    if op._settings_version != op._settings.version:
        op._settings_version = op._settings.version
        everything = {SELF: op.model}
        found = {
            concrete: regime
            for regime in op.ob.regimes
            if not isinstance(regime, Unread) and regime.path.split(".")[0] == SELF
            for concrete in resolved_paths(op, everything, regime)
        }
        op._settings_regimes = [(i, found[p]) for i, p in enumerate(op._settings.paths) if p in found]
    components = list(values)
    for i, regime in op._settings_regimes:
        components[i] = None  # keyed by its regime, in `counted`
        counted += ((op._settings.paths[i], regime.component(values[i])),)
    return (
        Hosts(arguments, op._settings.paths, values),
        counted,
        (key, op._settings_version, tuple(components), tuple(map(type, values))),
    )


def resolved_paths(op: BoundOperator, roots: dict[str, Any], regime: Regime) -> set[str]:
    """The concrete paths `regime` reaches on `roots` now (none where its path does not resolve:
    a streaming state not entered yet)."""
    try:
        return {concrete for _, concrete, _ in resolve(roots[regime.path.split(".")[0]], regime.path)}
    except (AttributeError, KeyError, IndexError, TypeError):
        return set()


def unread_paths(op: BoundOperator) -> frozenset[str]:
    """The model's paths an `Unread` regime covers (the settings walk skips them and what is under them)."""
    return frozenset(
        p
        for regime in op.ob.regimes
        if isinstance(regime, Unread) and regime.path.split(".")[0] == SELF
        for p in resolved_paths(op, {SELF: op.model}, regime)
    )


def argument_regimes(op: BoundOperator, hosts: dict[str, Any], roots: dict[str, Any]) -> dict[str, Regime]:
    """The binding's regimes by the concrete paths they reach among the arguments' host values
    (resolved again only when their paths change: a cache's layers made at its first call)."""
    if not op.ob.regimes:
        return {}
    if op._regime_paths != hosts.keys():
        op._regime_paths = set(hosts)
        op._regime_of = {}
        for regime in op.ob.regimes:
            if regime.path.split(".")[0] == SELF:
                continue
            # A regime covers its path and every value under it (a list of names, a state object).
            found = resolved_paths(op, roots, regime)
            prefixes = tuple(f"{concrete}." for concrete in found)
            op._regime_of.update({path: regime for path in hosts if path in found or path.startswith(prefixes)})
    return op._regime_of


def all_regimes(op: BoundOperator) -> dict[str, Regime]:
    """Every regime by the concrete path it covers now, in the arguments and the model."""
    return (
        {**op._regime_of, **{op._settings.paths[i]: r for i, r in op._settings_regimes}} if op._settings else dict(op._regime_of)
    )


def unseen_value(op: BoundOperator, cls: OperatorClass, hosts: Hosts, roots: dict[str, Any]) -> bool:
    """A class whose regime spans several values of a counter is verified at two of them: this
    call brings one not verified yet, while fewer than two have been."""
    if not cls.spanning or len(cls.seen) >= 2:
        return False
    return spanned_values(op, cls, hosts.as_dict(), roots) not in cls.seen


def spanned_values(op: BoundOperator, cls: OperatorClass, hosts: dict[str, Any], roots: dict[str, Any]) -> tuple:
    """The values of the counters `cls` spans (an `Unread` one read where it is: no guard holds it)."""
    everything = {SELF: op.model, **roots}
    values = (hosts[p] if p in hosts else get_path(everything, p) for p in cls.spanning)
    return tuple(v if isinstance(v, HOST_SCALARS) else type(v).__name__ for v in values)


def nearest_guard(
    op: BoundOperator, variants: list[OperatorClass], hosts: dict[str, Any], regimes: dict[str, Regime], signature
) -> tuple[str, str]:
    """The path by which this call differs from the captured variant nearest to it, and how."""
    best: tuple[OperatorClass, list[str]] | None = None
    for cls in variants:
        differing = [
            p
            for p in hosts.keys() | cls.hosts.keys()
            if guard_key({p: hosts.get(p)}, regimes) != guard_key({p: cls.hosts.get(p)}, regimes)
        ]
        if best is None or len(differing) < len(best[1]):
            best = (cls, sorted(differing))
    if best is None:
        raise ValueError(f"{op.ob.operator}: no captured variant to compare the call with")
    cls, differing = best
    if not differing:
        return "signature", f"its inputs, layouts or modes ({signature.describe()})"
    path = differing[0]
    return path, f"{path} is {hosts.get(path)!r}, {cls.name} was captured at {cls.hosts.get(path)!r}" + (
        f", and {len(differing) - 1} more value(s)" if len(differing) > 1 else ""
    )


def units_mismatch(op: BoundOperator, classes: list[OperatorClass], staged: dict[str, Any]) -> str | None:
    """An int `units` says every call brings as many units: a call whose input tensors have other
    shapes than the first class of those units captured (a 12-frame prefill met as a 4-frame
    step) is not one of them."""
    if not isinstance(op.ob.units, int) or not classes:
        return None
    shapes = input_shapes(staged)
    first = classes[0].inputs
    if shapes == first:
        return None
    differing = [f"{path} {a} (the class was captured at {b})" for (path, a), (_, b) in zip(shapes, first) if a != b]
    return (
        f"{op.ob.operator}: the binding's units={op.ob.units} says every call brings {op.ob.units} units, "
        f"but this call's inputs differ: {', '.join(differing) or shapes}; bind units as (argument, axis)"
    )
