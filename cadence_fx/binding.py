"""The binding: where a contract's regions live in a model, and which callables are its hot operators.

A contract says what a model does (clocks, retention, catalog); a binding says where: for each
region, the paths of the tensors that hold its state, and for each operator, the method that runs
it, the argument axis that carries a call's new units and the host-side values the call moves.
Like a contract, a binding is data (frozen dataclasses); `transform(model, contract, binding)` reads
it and runs one pipeline (`cadence_fx.pipeline`) whatever the model.

Paths are dotted, rooted at an argument of the operator's method by its parameter name, or at
``self``, the model itself (``"self.layers.*.attn.k_cache"``: a buffer the model reassigns):
``"cache.layers.*.keys"`` is attribute ``keys`` of every element of ``cache.layers``. A segment is
an attribute name, a mapping key or a sequence index; a segment of digits names a mapping's int
key when the mapping has no such string key (``"cache.is_updated.0"``: Whisper's flags, keyed by
layer index); ``*`` matches every index of a sequence, in
order, and a slice ``[start:stop:step]`` every index it selects (``buffer.[0::2]``: the even
elements); ``**`` matches every module below a module, itself included, that has the rest of the
path (``"self.encoder.**._streaming_state.previous"``: every streaming convolution's buffer,
whatever the depth), in `named_modules()` order. A region bound at several paths (``keys`` and
``values``) lays them out along one more leading dimension, after the wildcards': site
``layers.3.values`` is ``region[3, 1]``. A value of None on the way (a cache not filled yet) is
state not retained yet.

Where the call mutates its state argument (a cache object), `at` is all it takes. Where it returns
the new state instead (a functional step), `out` gives the matching paths rooted at ``return``,
the call's result (``"return.1.[0::2].0"``); the caller then threads the returned state back in.
A path may be a whole argument (``"state"``, with ``out=("return.1",)``: a step that takes its
state as a tensor and returns the new one); an argument left at its default (None) is no state yet.
A ring the operator allocates inside every call and drops on return is bound ``per_call=True``,
with no paths: there is nothing to keep between calls.

A region the model writes in place, where every call writes only positions it writes before it
reads them (a ring written at its offset, then attended; a static cache written at its positions),
may say so: ``write_before_read=True``. Verification then runs the stock call and the graph on the
region itself, one after the other with the counters rewound, instead of on a copy (the second call
rewrites what the first wrote before reading it), and compares the region through the outputs it
feeds, not byte for byte; no other step copies it either. It is what a region too large to copy
needs (a batch's rings: tens of GB); the report says which regions were verified so.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .contract import Contract, fixed_extent, policies
from .guards import Regime

__all__ = ["Binding", "BindingError", "OperatorBinding", "RegionBinding", "Site", "check_binding", "resolve"]

WILDCARD = "*"
DEEP = "**"  # every module below (itself included) that has the rest of the path, in `named_modules()` order


class BindingError(ValueError):
    """A binding that does not fit its contract or its model. `field` is the path into the binding."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"binding.{field}: {message}")


@dataclass(frozen=True)
class RegionBinding:
    """Region `region` of the contract lives at `at` (one or more paths, see the module docstring).

    `per_call`: the operator allocates the region inside each call and drops it on return (a
    vendor that enters a fresh streaming state per call), so nothing is kept between calls: no
    paths (`at` empty), no carry; each call sees the region at its derived extent, and the graph
    allocates it as the stock call does.

    `write_before_read`: every call writes the region in place, only at positions it writes before
    it reads them; verified without a copy (see the module docstring).

    `caller_trims`: the call returns (`out`) the region grown by its new units, and its caller, not
    the call, cuts it to the region's retention (a vendor's streaming loop keeping
    ``cat([c[..., :P], c[..., -H:]])``). The transformed call returns the retention itself, copied
    into the carry, so the caller's trim finds nothing more to cut; it is verified against the
    retention of the stock call's state.

    `operators`: the operators that keep the region. By default every bound operator whose method
    takes the arguments its paths start at; name them where two methods take arguments of one name
    that hold different regions (two vendor modules' ``att_cache``)."""

    region: str
    at: tuple[str, ...] = ()
    out: tuple[str, ...] = ()
    per_call: bool = False
    write_before_read: bool = False
    caller_trims: bool = False
    operators: tuple[str, ...] = ()


@dataclass(frozen=True)
class OperatorBinding:
    """Operator `operator` of the contract is `method` of the model (a dotted attribute path).

    `units` = (path, axis): the argument axis whose size is a call's new units on the operator's
    region (``("input_ids", 1)``: one unit per token), or an int when every call brings as many.
    `counters` are the values the call moves besides the regions (positions, lengths, flags): a
    host value (an int, a bool) is moved by the transformed call as the stock call of its class
    moved it; a tensor (a device-side position the step advances in place) is state of its own,
    kept at one address and aliased like a region. Every other argument is a copied input.

    `modes` are host values the call reads but never moves that choose what it computes (a
    decoding switch, ``"self.use_sampling"``): a graph would freeze the value it was captured with,
    so each value they take is a class of its own, captured and verified apart, and a call is
    admitted to the graphs of the values it finds.

    `flush`: the path of the host flag that marks a stream's last call (a vendor's ``last_chunk``),
    for an operator whose `units` is an int: a call with the flag set brings the contract's flush
    units (the operator's one `flush` size) and is matched against the catalog's flush classes.

    `regimes`: how a host counter's value keys the classes (`cadence_fx.guards`). Every host value
    the call can reach is guarded by equality (each value its own class) unless a regime says the
    computation reads it only as min(n, at) (`Saturating`), n mod period (`Periodic`) or not at
    all (`Unread`); each class is then verified at two values of it where it spans several.
    """

    operator: str
    method: str = "forward"
    units: tuple[str, int] | int = ("input_ids", 1)
    counters: tuple[str, ...] = ()
    modes: tuple[str, ...] = ()
    flush: str | None = None
    regimes: tuple[Regime, ...] = ()


@dataclass(frozen=True)
class Binding:
    """`regions` and `operators` of one model. `verify`: the first visits of each catalog class
    that run the stock call beside the transformed one and compare every output bit for bit."""

    regions: tuple[RegionBinding, ...]
    operators: tuple[OperatorBinding, ...]
    verify: int = 2

    def region(self, name: str) -> RegionBinding:
        for binding in self.regions:
            if binding.region == name:
                return binding
        raise KeyError(name)


@dataclass(frozen=True)
class Site:
    """One tensor of a region: its concrete path and its index in the region's leading dimensions."""

    region: str | None  # None: a device-side counter the operator binds, not a region's tensor
    path: str
    index: tuple[int, ...]
    out: str | None = None  # where the call returns the site's new state, when it returns it


def _segments(path: str) -> list[str]:
    return path.split(".")


SELF = "self"  # a path rooted at the model itself: its modules' buffers and attributes
_SLICE = re.compile(r"^\[(-?\d*):(-?\d*)(?::(-?\d*))?\]$")
RETURN = "return"


def _is_pattern(segment: str) -> bool:
    return segment in (WILDCARD, DEEP) or _SLICE.match(segment) is not None


def _selected(segment: str, length: int) -> range:
    if segment == WILDCARD:
        return range(length)
    match = _SLICE.match(segment)
    if match is None:
        raise ValueError(f"path segment {segment!r} is neither {WILDCARD!r} nor a slice like '[2:]' or '[::2]'")
    start, stop, step = (int(x) if x else None for x in match.groups())
    return range(length)[slice(start, stop, step)]


def _key(mapping: dict, segment: str) -> Any:
    """The key `segment` names in `mapping`: itself, or the int its digits spell when the mapping
    has that int key and not the string (paths are text, a layer index is often an int key)."""
    if segment not in mapping and segment.isdigit() and int(segment) in mapping:
        return int(segment)
    return segment


def _child(value: Any, segment: str) -> Any:
    if value is None:
        return None
    if isinstance(value, torch.nn.Module):
        # A submodule straight from the module's own table: what `getattr` finds there too, without
        # going through `Module.__getattr__` (Python code, on every segment of every path, every call).
        module = value._modules.get(segment)
        return module if module is not None else getattr(value, segment)
    if isinstance(value, dict):
        return value[_key(value, segment)]
    if isinstance(value, (list, tuple)) and segment.lstrip("-").isdigit():
        return value[int(segment)]
    return getattr(value, segment)


def resolve(root: Any, path: str) -> Iterator[tuple[tuple[int, ...], str, Any]]:
    """Every (wildcard indices, concrete path, value) that `path` (its argument segment already
    applied: `root` is that argument) reaches."""

    def walk(value, rest, indices, concrete):
        if not rest:
            yield indices, concrete, value
            return
        head, tail = rest[0], rest[1:]
        if head == DEEP:
            if not isinstance(value, torch.nn.Module):
                raise TypeError(f"{DEEP!r} after {concrete!r} needs a module, found {type(value).__name__}")
            found = []
            for name, module in value.named_modules():
                try:  # a module without the rest of the path is no match
                    found.append(list(walk(module, tail, (), f"{concrete}.{name}" if name else concrete)))
                except (AttributeError, KeyError):
                    continue
            for i, matches in enumerate(found):
                for more, where, leaf in matches:
                    yield indices + (i,) + more, where, leaf
        elif _is_pattern(head):
            if value is None:  # a sequence not there yet (a legacy `past_key_values` before the first call): no sites
                return
            if not isinstance(value, (list, tuple, torch.nn.ModuleList)):
                raise TypeError(f"{head!r} after {concrete!r} needs a sequence, found {type(value).__name__}")
            for i, position in enumerate(_selected(head, len(value))):
                yield from walk(value[position], tail, indices + (i,), f"{concrete}.{position}")
        else:
            yield from walk(_child(value, head), tail, indices, f"{concrete}.{head}")

    first, *rest = _segments(path)
    yield from walk(root, rest, (), first)


class Place:
    """Where `path` leads on one call's `roots`: the object that holds its value (its parent) and
    the last segment. Reading or writing through a place walks the path once, not on every access.
    `place(roots, path)` finds one; `Places` finds many, sharing the walk of their common prefixes."""

    __slots__ = ("roots", "path", "parent_path", "last", "parent")

    def __init__(self, roots: dict[str, Any], path: str, parent_path: str | None, last: str, parent: Any) -> None:
        self.roots, self.path, self.parent_path, self.last, self.parent = roots, path, parent_path, last, parent

    def get(self) -> Any:
        return _child(self.parent, self.last)

    def set(self, value: Any) -> None:
        parent, last = self.parent, self.last
        if parent is None:
            if value is None:  # no state there yet, and none to put
                return
            raise ValueError(f"{self.path!r}: cannot place state under a None")
        if isinstance(parent, dict):
            parent[_key(parent, last)] = value
        elif isinstance(parent, list) and last.isdigit():
            parent[int(last)] = value
        elif isinstance(parent, tuple) and last.isdigit():
            # A tuple cannot be written: a new one, the element replaced, takes its place in its own
            # parent (a legacy `past_key_values`, an LSTM's `(h, c)`); the caller's tuple stays as it was.
            # Read afresh: a write through a sibling's place may have replaced the tuple since.
            assert self.parent_path is not None  # only the roots (a dict) have no parent path
            parent = get_path(self.roots, self.parent_path)
            items = list(parent)
            items[int(last)] = value
            self.parent = type(parent)(*items) if hasattr(parent, "_fields") else tuple(items)
            set_path(self.roots, self.parent_path, self.parent)
        else:
            setattr(parent, last, value)


def place(roots: dict[str, Any], path: str) -> Place:
    """The `Place` of one `path` on `roots`."""
    first, *rest = _segments(path)
    if not rest:
        return Place(roots, path, None, first, roots)
    parent_path = ".".join([first, *rest[:-1]])
    return Place(roots, path, parent_path, rest[-1], get_path(roots, parent_path))


class Places:
    """The `Place`s of a fixed list of paths, found afresh on each call's roots (the objects on a
    path may change between calls) with each prefix the paths share walked once: the layers of a
    model share everything up to the layer, so a call walks each module once, not once per path."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = list(paths)
        self._walk: list[tuple[str, str | None, str]] = []  # (prefix, its parent prefix, segment), parents first
        self._ends: list[tuple[str, str | None, str]] = []  # per path: (path, parent prefix, last segment)
        seen: set[str] = set()
        for path in self.paths:
            first, *rest = _segments(path)
            if not rest:
                self._ends.append((path, None, first))
                continue
            prefix, parent = first, None
            for segment in [first, *rest[:-1]]:
                prefix = segment if parent is None else f"{parent}.{segment}"
                if prefix not in seen:
                    seen.add(prefix)
                    self._walk.append((prefix, parent, segment))
                parent = prefix
            self._ends.append((path, prefix, rest[-1]))

    def at(self, roots: dict[str, Any]) -> list[Place]:
        found: dict[str, Any] = {}
        module = torch.nn.Module
        for prefix, parent, segment in self._walk:
            if parent is None:
                found[prefix] = roots[segment]
                continue
            value = found[parent]
            if isinstance(value, module):  # `_child`'s first case inlined: most segments are on modules, every call
                child = value._modules.get(segment)
                found[prefix] = child if child is not None else getattr(value, segment)
            else:
                found[prefix] = _child(value, segment)
        return [Place(roots, path, parent, last, roots if parent is None else found[parent]) for path, parent, last in self._ends]


def get_path(roots: dict[str, Any], path: str) -> Any:
    first, *rest = _segments(path)
    value = roots[first]
    for segment in rest:
        value = _child(value, segment)
    return value


def set_path(roots: dict[str, Any], path: str, value: Any) -> None:
    place(roots, path).set(value)


def method_of(model: Any, dotted: str):
    target = model
    for part in dotted.split("."):
        target = getattr(target, part)
    return target


def concrete_out(pattern: str, at: str, concrete_at: str) -> str:
    """The `out` path of one site: `pattern`'s wildcards and slices take the positions that the
    matching segments of `at` took in `concrete_at` (the patterns must select alike)."""
    positions = [c for a, c in zip(_segments(at)[1:], _segments(concrete_at)[1:]) if _is_pattern(a)]
    parts, taken = [], iter(positions)
    for segment in _segments(pattern):
        parts.append(next(taken) if _is_pattern(segment) else segment)
    return ".".join(parts)


def sites(binding: RegionBinding, roots: dict[str, Any]) -> list[Site]:
    """The concrete sites of a region in the current arguments, in region order."""
    found = []
    many = len(binding.at) > 1
    for j, path in enumerate(binding.at):
        for indices, concrete, _ in resolve(roots[_segments(path)[0]], path):
            out = concrete_out(binding.out[j], path, concrete) if binding.out else None
            found.append(Site(binding.region, concrete, indices + ((j,) if many else ()), out))
    return sorted(found, key=lambda s: s.index)


def operator_regions(binding: Binding, ob: OperatorBinding, signature: inspect.Signature) -> list[RegionBinding]:
    """The regions an operator binds: those whose every path starts at one of its method's arguments
    or at the model itself (its own region always does: `check_binding` checks it)."""
    parameters = set(signature.parameters) | {SELF}
    return [
        rb
        for rb in binding.regions
        if not rb.per_call
        and all(_segments(p)[0] in parameters for p in rb.at)
        and (not rb.operators or ob.operator in rb.operators)
    ]


def check_binding(model: Any, contract: Contract, binding: Binding) -> dict[str, inspect.Signature]:
    """Check the binding against the contract and the model; returns each operator's method signature.

    Raises `BindingError` naming the field and what was expected.
    """
    if not isinstance(binding, Binding):
        raise TypeError(f"binding must be a cadence_fx.Binding, got {type(binding).__name__}")
    regions = {r.name: r for r in contract.regions}
    for i, rb in enumerate(binding.regions):
        if rb.region not in regions:
            raise BindingError(
                f"regions[{i}].region", f"the contract declares no region {rb.region!r}; declared: {sorted(regions)}"
            )
        if rb.per_call:
            if rb.at or rb.out:
                raise BindingError(
                    f"regions[{i}]",
                    f"region {rb.region!r} is per_call (allocated inside each call): "
                    f"it has no paths to keep, got at={rb.at!r} out={rb.out!r}",
                )
            if not fixed_extent(regions[rb.region].retention):
                raise BindingError(
                    f"regions[{i}].per_call",
                    f"region {rb.region!r} retains by "
                    f"{type(regions[rb.region].retention).__name__}: only a region retained by "
                    f"{policies(lambda p: p.fixed)} (a fixed extent) can "
                    "be allocated afresh each call",
                )
            continue
        retention = regions[rb.region].retention
        if rb.caller_trims and (not rb.out or retention is None or not retention.caller_trims):
            raise BindingError(
                f"regions[{i}].caller_trims",
                f"region {rb.region!r}: a caller trims a state the call returns "
                f"(`out`) to a {policies(lambda p: p.caller_trims)} retention; got out={rb.out!r}, retention "
                f"{type(regions[rb.region].retention).__name__}",
            )
        if rb.write_before_read and (rb.out or not fixed_extent(regions[rb.region].retention)):
            raise BindingError(
                f"regions[{i}].write_before_read",
                f"region {rb.region!r}: only a region written in place "
                f"at a fixed extent (retained by {policies(lambda p: p.fixed)}, no `out`) is written before it is read; "
                "it retains by "
                f"{type(regions[rb.region].retention).__name__}" + (f" and is returned ({rb.out!r})" if rb.out else ""),
            )
        if not rb.at or not all(isinstance(p, str) and p and all(_segments(p)) for p in rb.at):
            raise BindingError(
                f"regions[{i}].at", f"needs one or more paths 'argument' or 'argument.attribute...', got {rb.at!r}"
            )
        if rb.out and any(DEEP in _segments(p) for p in rb.at):
            raise BindingError(
                f"regions[{i}].out",
                f"{DEEP!r} matches paths of any depth, so it has no `out` "
                f"counterpart; bind the returned state with '*' or slices, got {rb.at!r}",
            )
        if rb.out and (
            len(rb.out) != len(rb.at)
            or not all(
                isinstance(p, str)
                and _segments(p)[0] == RETURN
                and sum(map(_is_pattern, _segments(p))) == sum(map(_is_pattern, _segments(a)))
                for p, a in zip(rb.out, rb.at)
            )
        ):
            raise BindingError(
                f"regions[{i}].out",
                f"needs one path per `at` path, rooted at {RETURN!r} and with as many "
                f"wildcards or slices as it, got {rb.out!r} for {rb.at!r}",
            )
        if retention is None:
            raise BindingError(
                f"regions[{i}]",
                f"region {rb.region!r} has no retention policy (it grows with the "
                f"session): the binding pipeline takes a region whose extent is "
                f"bounded ({policies()})",
            )
    bound = {rb.region for rb in binding.regions}
    operators = {op.name: op for op in contract.operators}
    named = {ob.operator for ob in binding.operators}
    for i, rb in enumerate(binding.regions):
        for j, name in enumerate(rb.operators):
            if name not in named:
                raise BindingError(f"regions[{i}].operators[{j}]", f"{name!r} is not a bound operator; bound: {sorted(named)}")
    if not binding.operators:
        raise BindingError("operators", "binds no operator")
    signatures = {}
    for i, ob in enumerate(binding.operators):
        if ob.operator not in operators:
            raise BindingError(
                f"operators[{i}].operator", f"the contract declares no operator {ob.operator!r}; declared: {sorted(operators)}"
            )
        if operators[ob.operator].region not in bound:
            raise BindingError(f"operators[{i}]", f"its region {operators[ob.operator].region!r} is not bound in regions")
        try:
            method = method_of(model, ob.method)
        except AttributeError:
            raise BindingError(f"operators[{i}].method", f"{type(model).__name__} has no {ob.method!r}") from None
        if not callable(method):
            raise BindingError(f"operators[{i}].method", f"{ob.method!r} is not callable")
        signature = inspect.signature(method)
        parameters = set(signature.parameters) | {SELF}
        if not (
            isinstance(ob.units, int)
            and ob.units > 0
            or isinstance(ob.units, tuple)
            and len(ob.units) == 2
            and isinstance(ob.units[0], str)
            and isinstance(ob.units[1], int)
        ):
            raise BindingError(f"operators[{i}].units", f"must be (path, axis) or a positive int, got {ob.units!r}")
        units = [] if isinstance(ob.units, int) else [(f"operators[{i}].units", ob.units[0])]
        paths = units + [(f"operators[{i}].counters[{j}]", p) for j, p in enumerate(ob.counters)]
        paths += [(f"operators[{i}].modes[{j}]", p) for j, p in enumerate(ob.modes)]
        for j, regime in enumerate(ob.regimes):
            if not isinstance(regime, Regime) or type(regime) is Regime:
                raise BindingError(
                    f"operators[{i}].regimes[{j}]",
                    f"needs a Saturating, Periodic or Unread regime (cadence_fx.guards), got {regime!r}",
                )
            paths.append((f"operators[{i}].regimes[{j}]", regime.path))
        if ob.flush is not None:
            flush = operators[ob.operator].flush
            if not isinstance(ob.units, int) or len(flush) != 1:
                raise BindingError(
                    f"operators[{i}].flush",
                    f"a flush flag gives an int `units` the contract's one flush "
                    f"size; got units={ob.units!r}, the contract's flush sizes {flush}",
                )
            paths.append((f"operators[{i}].flush", ob.flush))
        own = binding.region(operators[ob.operator].region)
        if own.operators and ob.operator not in own.operators:
            raise BindingError(
                f"regions[{binding.regions.index(own)}].operators",
                f"{own.region!r} is operator "
                f"{ob.operator!r}'s own region, which it always keeps; name it too, got {own.operators!r}",
            )
        paths += [(f"regions[{binding.regions.index(own)}].at", p) for p in own.at]  # none when per_call
        for field, path in paths:
            if _segments(path)[0] not in parameters:
                raise BindingError(
                    field,
                    f"{path!r} starts at {_segments(path)[0]!r}, which is not an argument of "
                    f"{ob.method}; its arguments: {sorted(parameters)}",
                )
        for j, path in enumerate(ob.modes):
            if _segments(path)[0] == SELF:  # the model is here now: a misspelt mode fails at once, not at a call
                try:
                    get_path({SELF: model}, path)
                except (AttributeError, KeyError, IndexError, TypeError) as error:
                    raise BindingError(f"operators[{i}].modes[{j}]", f"{path!r} does not resolve on the model: {error}") from None
        signatures[ob.operator] = signature
    reached = {rb.region for ob in binding.operators for rb in operator_regions(binding, ob, signatures[ob.operator])}
    reached |= {operators[ob.operator].region for ob in binding.operators}  # a per_call region has no paths
    for i, rb in enumerate(binding.regions):
        if rb.region not in reached and rb.per_call:
            raise BindingError(
                f"regions[{i}].per_call",
                f"region {rb.region!r} is allocated inside each call of its operator, but no bound operator has it as its region",
            )
        if rb.region not in reached:
            arguments = {ob.method: sorted(signatures[ob.operator].parameters) for ob in binding.operators}
            raise BindingError(
                f"regions[{i}].at",
                f"{rb.at!r}: no operator's method takes the arguments these paths start "
                f"at, so no operator would keep this region; the methods' arguments: {arguments}",
            )
    if binding.verify < 1:
        raise BindingError(
            "verify", f"at least the first visit of each class is verified against the stock call; got {binding.verify}"
        )
    return signatures
