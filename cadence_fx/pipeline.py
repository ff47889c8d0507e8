"""The one pipeline behind `transform(model, contract, binding)`, for models cadence-fx has never seen.

For each bound operator, per class (a catalog class, its regimes' components and its modes), at
the class's first visit:

1. **check and guard**: the call's state sites (found by the binding's paths) have the contract's
   shapes, and the call (its new units against its retained extent) is a class of the catalog;
   every host value the program may depend on (`cadence_fx.guards`) keys the class, so other
   values are another program (a variant, at most `VARIANTS`); anything else runs the stock
   call, counted by reason (fail closed);
2. **capture**: the call as an explicit-state step ``step(inputs, sites) -> (outputs, sites)`` is
   exported with `torch.export` (non-strict) on a copy of the state objects, so the model's own
   state never holds a traced value;
3. **retention rewrite**: the window pass (`passes/window.py`) finds each site's concat-then-trim on
   the exported graph (a sliding window's tail, or a prompt-plus-history's head and tail) and
   rewrites it into in-place writes into the site's carry, a view of its
   region's buffer allocated once at the derived bound (the state rule). A region of one fixed
   extent (`RingCache`, `InPlace`: preallocated, written in place) needs no rewrite: the carry is
   the state. State the step writes in place that the binding does not declare is refused by path
   (a graph would freeze it as a constant);
4. **verify**: the first `binding.verify` visits of the class (and a second value of a counter a
   regime spans) also run the stock call (on clones of the state, the RNG rewound between runs):
   the exported step and the stock call must run the same ATen program (`cadence_fx.program`),
   then the rewritten graph must give every output and every retained tensor bit for bit; a
   difference refuses the class for good (the stock result is kept);
5. **replay**: verified classes run through one `ExactShapeReplay` per operator, the sites
   aliased (one address for the life of the stream), the copied inputs staged; without CUDA the
   engine runs the rewritten graph eager and counts why (`no_cuda`).

A graph runs no Python, so the host-side values the stock call moves (the binding's `counters`:
lengths, positions, flags) are moved by the transformed call exactly as the stock call of the same
class moved them when it was verified; a class whose stock calls moved them differently is refused.
A host value the call only reads to choose what it computes (the binding's `modes`: a decoding
switch) is part of the class: each value its own graphs.
A counter that is a tensor (a device-side length the step advances in place) is state like a
region's: kept at one address, passed to the graph, aliased by the replay.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import inspect
import itertools
import math
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch.utils import _pytree as pytree

from .binding import (
    RETURN,
    SELF,
    Binding,
    BindingError,
    OperatorBinding,
    Place,
    Places,
    Site,
    get_path,
    method_of,
    operator_regions,
    place,
    resolve,
    set_path,
    sites,
)
from .capture import without_stack_traces
from .catalog import Catalog, CatalogClass
from .contract import DTYPES, Contract, PromptPlusHistory, carry_axis, fixed_extent
from .determinism import RngState
from .guards import HOST_SCALARS, ModuleSettings, Regime, Unread, guard_key, host_values
from .program import OpTrace, first_difference
from .passes.carry import RetentionSite, shared_memo
from .passes.hoist import HostConstantHoist
from .passes.state import Resize
from .passes.window import CarryCounters, Window, WindowCarry, WindowError, rewrite_windows
from .replay import ExactShapeReplay, Signature
from .replay.signature import is_dense
from .report import format_bytes
from .transformed import Transformed

__all__ = ["BoundModel", "BoundOperator", "OperatorCounters", "class_name", "transform_bound"]

#: Signatures (host values, layouts) captured per catalog class at most; more run the stock code.
VARIANTS = 4


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
class _Class:
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


class _Hosts:
    """The guarded host values of one call: its arguments' by path, and the model's as a list
    aligned with its settings' paths (thousands, read on every call); `as_dict()` joins them
    when they are needed by path (a capture, a verification, a message)."""

    __slots__ = ("arguments", "paths", "values", "_joined")

    def __init__(self, arguments: dict[str, Any], paths: tuple[str, ...], values: list) -> None:
        self.arguments, self.paths, self.values, self._joined = arguments, paths, values, None

    def as_dict(self) -> dict[str, Any]:
        if self._joined is None:
            self._joined = {**self.arguments, **dict(zip(self.paths, self.values))}
        return self._joined


class _Step(torch.nn.Module):
    """The operator's call with its state made explicit: the sites come in as arguments and go
    out as results, on `roots`, a private copy of the state objects. The output's tensors are
    returned flat; `_structure` of a stock output rebuilds it."""

    def __init__(self, model: Any, method, roots: dict[str, Any], sites: list[Site], trims: dict[int, tuple[int, int, int]]):
        super().__init__()
        if isinstance(model, torch.nn.Module):
            # Registered, so the export lifts the model's weights as parameters the graphs share
            # with it; unregistered, every class's graph would hold a copy of them as constants.
            self.model = model
        self.method, self.roots, self.sites, self.trims = method, roots, sites, trims

    def forward(self, inputs: dict[str, Any], state: list):
        for site, value in zip(self.sites, state):
            set_path(self.roots, site.path, value)
        out = _caller_trimmed(self.method(**inputs, **_arguments(self.roots)), self.sites, self.trims)
        leaves, _ = _structure(out, self.roots)
        return [x for x in leaves if isinstance(x, torch.Tensor)], _new_state(self.sites, self.roots, out)


def _caller_trim(value: torch.Tensor, axis: int, keep: int, head: int) -> torch.Tensor:
    """A region's retention of a returned state, as its caller cuts it: the whole state while it is
    no longer than `keep`, else its last `keep` units, or its first `head` and last `keep - head`
    (negative slices, the form the window pass reads)."""
    if value.shape[axis] <= keep:
        return value
    index = (slice(None),) * axis
    tail = value[index + (slice(head - keep, None),)]
    return torch.cat([value[index + (slice(None, head),)], tail], dim=axis) if head else tail


def _caller_trimmed(out: Any, sites: list[Site], trims: dict[int, tuple[int, int, int]]) -> Any:
    """The call's output with each state its caller trims (`trims`: (axis, keep, head) by site
    index, the binding's `caller_trims` regions) cut to the region's retention."""
    if not trims:
        return out
    holder = {RETURN: out}
    for i, (axis, keep, head) in trims.items():
        set_path(holder, sites[i].out, _caller_trim(get_path(holder, sites[i].out), axis, keep, head))
    return holder[RETURN]


def _arguments(roots: dict[str, Any]) -> dict[str, Any]:
    """The state roots that are the method's arguments (not the model itself)."""
    return {name: value for name, value in roots.items() if name != SELF}


def _private(roots: dict[str, Any], shared: list[torch.Tensor]) -> dict[str, Any]:
    """A copy of the state roots for a trace: state objects copied whole, the model's modules copied
    around the very same weight and buffer tensors (a traced write lands on the copy's attribute).
    `shared` (the sites' tensors) are not copied either: the step puts its traced inputs in their
    place before the method runs, and a copy of a cache would cost its size (a batch's rings: GBs)."""
    memo: dict[int, Any] = {id(t): t for t in shared}
    model = roots.get(SELF)
    if isinstance(model, torch.nn.Module):
        memo.update({id(t): t for t in (*model.parameters(), *model.buffers())})
    return copy.deepcopy(roots, memo)


def _holds_region(values: list[Any], shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> bool:
    """The model's tensors at a region's sites already are its carries: each distinct, dense, of the
    site's derived shape and the region's dtype, on the model's device."""
    return all(isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(shape) and v.dtype == dtype
               and v.device == device and v.is_contiguous() for v in values) and len({v.data_ptr() for v in values}) == len(values)


def _new_state(sites: list[Site], roots: dict[str, Any], out: Any) -> list:
    """Each site's state after a call: in the state object it mutated, or in what it returned."""
    return [get_path({RETURN: out}, s.out) if s.out else get_path(roots, s.path) for s in sites]


class OpaqueOutput(TypeError):
    """The method returns an object holding tensors that torch's pytree cannot flatten."""


def _holds_tensors(value: Any) -> bool:
    if isinstance(value, type):
        return False
    names = [f.name for f in dataclasses.fields(value)] if dataclasses.is_dataclass(value) else list(getattr(value, "__dict__", ()))
    return any(isinstance(getattr(value, name, None), torch.Tensor) for name in names)


def _structure(out: Any, roots: dict[str, Any]) -> tuple[list, tuple]:
    """The output's leaves (the state objects kept whole) and (treespec, its non-tensor leaves by
    position, a state object by its argument name)."""
    leaves, spec = pytree.tree_flatten(out, is_leaf=lambda x: any(x is r for r in roots.values()))
    others = {}
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            root = next((name for name, r in roots.items() if r is leaf), None)
            if root is None and _holds_tensors(leaf):
                # Kept whole, it would be the first call's object, its tensors returned by every later call.
                kind = type(leaf)
                raise OpaqueOutput(f"the call returns an object of type {kind.__name__} holding tensors, which torch's pytree does not "
                                   f"flatten; register it (torch.utils._pytree.register_dataclass({kind.__name__}) for a "
                                   "dataclass) or return a tuple, list or dict")
            others[i] = ("root", root) if root is not None else ("value", leaf)
    return leaves, (spec, others)


def _reference(value: Any) -> Callable[[], Any]:
    """A weak reference to a stream's state object where it takes one (a stream that is over lets
    it go), else a strong one (a list or tuple of tensors)."""
    try:
        return weakref.ref(value)
    except TypeError:
        return lambda: value


def _input_shapes(inputs: dict[str, Any]) -> tuple:
    """The input tensors' shapes, by path."""
    return tuple((pytree.keystr(path), tuple(leaf.shape)) for path, leaf in pytree.tree_flatten_with_path(inputs)[0]
                 if isinstance(leaf, torch.Tensor))


def _writes_in_place(node: torch.fx.Node) -> bool:
    """Whether `node` calls an in-place (mutable-schema) op, which writes its first argument."""
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and schema.is_mutable and bool(node.args)


def class_name(operator: str, units: int, extent: int, flush: bool = False, modes: dict[str, Any] | None = None) -> str:
    """The name of an operator's catalog class in reports, stamps and certificates (with the
    binding's modes, the values it was captured at)."""
    return (f"{operator}[n={units},L={extent}]" + ("(flush)" if flush else "")
            + (f"{{{', '.join(f'{p}={v!r}' for p, v in modes.items())}}}" if modes else ""))


def _undeclared_state(program, roots: dict[str, Any], sites: list[Site]) -> list[str]:
    """Paths of the tensors in the state objects (not the bound sites) that the step writes in place
    but the export lifted as constants: a graph would start every call from their value at capture."""
    written = set()
    for spec in program.graph_signature.input_specs:
        if spec.kind.name != "CONSTANT_TENSOR":
            continue
        node = next(n for n in program.graph.nodes if n.op == "placeholder" and n.name == spec.arg.name)
        if any(_writes_in_place(user) and user.args[0] is node for user in node.users):
            written.add(spec.target)
    lifted = {id(program.constants[target]) for target in written}
    if not lifted:
        return []
    bound = {s.path for s in sites}
    found, seen = [], set()

    def walk(value, path, depth):
        if id(value) in seen or depth > 8:
            return
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            if id(value) in lifted and path not in bound:
                found.append(path)
            return
        if isinstance(value, torch.nn.Module):
            children = {k: v for k, v in vars(value).items() if not k.startswith("_")} | dict(value._modules)
        elif isinstance(value, dict):
            children = value
        elif isinstance(value, (list, tuple)):
            children = dict(enumerate(value))
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            children = vars(value)
        else:
            return
        for key, child in children.items():
            walk(child, f"{path}.{key}", depth + 1)

    for name, root in roots.items():
        walk(root, name, 0)
    return found


def _viewed(node: Any) -> Any:
    """The tensor `node` is a view of (through view ops: select, slice, view...), or `node` itself."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.args:
        schema = getattr(node.target, "_schema", None)
        if schema is None or schema.is_mutable or not schema.returns or schema.returns[0].alias_info is None:
            break
        node = node.args[0]
    return node


def _ring_site(gm: torch.fx.GraphModule, graph: str, site: Site, axis: int, output: int, placeholder: str | None) -> RetentionSite:
    """A ring region's site needs no rewrite when the step writes it in place (its output is its
    input, through in-place ops): the carry is then the ring, one address for the stream. A step
    that returns a new tensor instead still runs exact: its result is copied into the carry."""
    node = pytree.tree_leaves(next(n for n in gm.graph.nodes if n.op == "output").args)[output]
    leaf = node
    while _writes_in_place(node) and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    if node.op == "placeholder" and node.name == placeholder:
        writes = [n for n in gm.graph.nodes if _writes_in_place(n) and _viewed(n.args[0]) is node]
        if not writes:  # another operator's ring, which this step only passes on
            return RetentionSite(graph, leaf.name, site.region, axis, "ring", False,
                                 f"{site.path}: not written by the step: passed through at its address")
        writer = leaf if leaf is not node else writes[-1]
        return RetentionSite(graph, writer.name, site.region, axis, "ring", False,
                             f"{site.path}: written in place by the step ({writer.name}): the carry is the ring, nothing to rewrite")
    return RetentionSite(graph, leaf.name, site.region, axis, "ring", False,
                         f"{site.path}: returned anew by the step ({leaf.name}): copied into its carry after every call")


def _staged(inputs: dict[str, Any]) -> dict[str, Any]:
    """The copied inputs as the graphs take them: a view that is not dense (a slice of a longer
    signal) copied to a contiguous tensor, values unchanged, so a replay can stage it; the stock
    call keeps the caller's own, and verification compares the two."""
    return {name: value.contiguous() if isinstance(value, torch.Tensor) and not is_dense(value) else value
            for name, value in inputs.items()}


def _equal(a: Any, b: Any, names: tuple[str, ...] = ()) -> str | None:
    """None when every tensor leaf of `a` equals `b`'s bit for bit (same shape and dtype), else
    where not: the leaf's path (under `names`, one per top-level part) and by how much."""
    la, lb = pytree.tree_flatten_with_path(a)[0], pytree.tree_leaves(b)
    ta = [(path, x) for path, x in la if isinstance(x, torch.Tensor)]
    tb = [x for x in lb if isinstance(x, torch.Tensor)]
    if len(ta) != len(tb):
        return f"{len(ta)} tensors against the stock call's {len(tb)}"
    for (path, x), y in zip(ta, tb):
        if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x, y):
            where = pytree.keystr(path)
            if names and path and isinstance(path[0], pytree.SequenceKey) and path[0].idx < len(names):
                where = names[path[0].idx] + pytree.keystr(path[1:])
            how = ""
            if x.shape == y.shape and x.dtype == y.dtype and x.is_floating_point():
                diff = (x.double() - y.double()).abs()
                how = f", {int((x != y).sum())} element(s) differ, by up to {diff.max().item():.3g}"
            return f"{where}: {tuple(x.shape)} {x.dtype}, the stock call's {tuple(y.shape)} {y.dtype}{how}"
    return None


def _program_hint(cls: "_Class", hosts: dict[str, Any], counters: list[str]) -> str:
    """What to change when the programs differ."""
    moving = [p for p in counters if p in hosts and hosts[p] != cls.hosts.get(p)]
    if moving:
        return (f"the class was captured at {', '.join(f'{p}={cls.hosts[p]!r}' for p in moving)} and this call has "
                f"{', '.join(f'{p}={hosts[p]!r}' for p in moving)}: the computation reads the counter beyond its "
                "declared regime; declare a regime that keeps these values apart, or pass the value as a tensor")
    return ("the export took another code path than the stock call (a model that branches on whether it is being "
            "traced); an attention implementation that does not (`eager`) or the stock path's own inputs avoid it")


class BoundOperator:
    """One hot operator of a bound model: call it as the stock method. It binds the regions whose
    paths start at its method's arguments (or the model itself)."""

    def __init__(self, model: Any, contract: Contract, catalog: Catalog, binding: Binding, ob: OperatorBinding,
                 signature: inspect.Signature, report, *, replay: bool,
                 shared: dict[tuple[str, tuple[int, ...]], WindowCarry]):
        self.model, self.contract, self.catalog, self.binding, self.ob = model, contract, catalog, binding, ob
        self.method = method_of(model, ob.method)
        self.signature = signature
        self.report = report
        self.op = next(op for op in contract.operators if op.name == ob.operator)
        self.op_catalog = catalog.operator(ob.operator)
        self.regions = operator_regions(binding, ob, signature)
        # A region the operator allocates inside each call: no sites, the same extent every call.
        self.per_call = binding.region(self.op.region).per_call
        # Every operator's carries by (region, site index): operators that bind the same region (a
        # cache two methods read and write) keep one carry per site, so each sees what the other
        # retained; the region's buffer is `report.carries[region].buffer` (none for a region kept
        # in the model's own tensors: `region_tensors`).
        self.shared = shared
        self.roots = {p.split(".")[0] for rb in self.regions for p in rb.at} | {p.split(".")[0] for p in ob.counters}
        # The arguments the binding's paths go through (a state object, not a site itself).
        self._through = {p.split(".")[0] for rb in self.regions for p in rb.at if "." in p} | {
            p.split(".")[0] for p in ob.counters if "." in p} - {SELF}
        self.counters = OperatorCounters()
        self.classes: dict[tuple, _Class] = {}
        self.carries: dict[str, WindowCarry] = {}
        self.held: dict[str, torch.Tensor] = {}  # device-side counters (tensors), each at one address
        # Per bound region, the tensors that hold it: its one buffer, or (a region written before it
        # is read, already in the model at its derived shape) the model's own tensors, one per site.
        self.region_tensors: dict[str, list[torch.Tensor]] = {}
        self.sites: list[Site] = []  # the regions' sites, then the device-side counters (region None)
        self.trims: dict[int, tuple[int, int, int]] = {}  # site index -> (axis, keep, head): its caller trims it
        self._places = Places([])  # where the sites are, found on each call's roots
        self._holder = torch.nn.Module()  # owns the carries, so the replay engine rewinds their buffers
        self._replay_wanted = replay
        self.replay: ExactShapeReplay | None = None
        self._by_name: dict[str, _Class] = {}
        self._owner: tuple | None = None  # (identity, references) of the last call's state objects
        self._current: _Class | None = None
        self._unbounded: set[tuple[int, int, str]] = set()  # (units, extent, guard path) said once
        self._settings = ModuleSettings(model, self._unread) if isinstance(model, torch.nn.Module) else None
        self._settings_version = 0
        self._settings_regimes: list[tuple[int, Regime]] = []  # (leaf index, regime) of the settings' counters
        self._regime_paths: set[str] | None = None
        self._regime_of: dict[str, Regime] = {}

    def __deepcopy__(self, memo: dict) -> BoundOperator:
        """Itself: a handle on graphs and carries that a state object may hold (a vendor's step
        calling it), shared by a trace's private copy of that state, never copied."""
        return self

    # -- the call ----------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The stock method's call. Inference only: it runs under `torch.no_grad()` whatever the
        caller's grad mode (a carry written in place cannot take part in autograd)."""
        with torch.no_grad():
            return self._call(*args, **kwargs)

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        self.counters.calls += 1
        arguments = self._arguments(args, kwargs)
        roots = {name: arguments[name] for name in self.roots if name in arguments}
        for name in self.roots - set(roots) - {SELF}:
            default = self.signature.parameters[name].default
            if default is not inspect.Parameter.empty:  # a state argument left at its default (None: no state yet)
                roots[name] = default
        if SELF in self.roots:
            roots[SELF] = self.model
        missing = self.roots - set(roots)
        if missing:
            raise TypeError(f"{self.ob.operator}: the call passes no {sorted(missing)}, where the binding keeps its state")
        self._switch(roots)
        inputs = {k: v for k, v in arguments.items() if k not in self.roots}
        modes = self._modes(arguments)
        if any(roots[name] is None for name in self._through if name in roots):
            # No state object yet (the stock call makes it), whether or not a stream ran before; an
            # argument that is itself a site is its state, None while nothing is retained (L = 0).
            return self._stock(roots, inputs, "no_state_yet")
        if not self.carries:
            if any(not sites(rb, roots) for rb in self.regions):
                # A wildcard met None (no state yet, the stock call makes it): the sites cannot be counted
                return self._stock(roots, inputs, "no_state_yet")
            self._allocate(roots)
        places = self._site_places().at(roots)  # each module on the sites' paths walked once a call
        values = [place.get() for place in places]  # each site read once a call
        extent = self._retained(values)
        units = self._units(arguments)
        call = self._catalog_class(units, extent)
        if call is None:
            return self._stock(roots, inputs, "not_in_catalog")
        state = [self._carry_view(place, site, value) for place, site, value in zip(places, self.sites, values)]
        staged = _staged(inputs)
        try:
            # The inputs' key: shapes, layouts and every non-tensor input.
            signature = Signature.of(staged)
        except TypeError:
            return self._stock(roots, inputs, "unkeyable")
        # The state's layouts (carry views, held counters, or the stock's own tensors).
        shapes = tuple(None if v is None else (tuple(v.shape), v.stride(), v.dtype, v.device, v.layout) for v in state)
        # A mode by its type and repr: values equal to Python (True and 1, 0.0 and -0.0) are not the same program.
        mode_key = tuple((path, type(value).__name__, repr(value)) for path, value in modes.items())
        hosts, counted, guards = self._guarded(roots)
        key = (units, extent, counted, shapes, mode_key, signature.catalog_key, guards)
        cls = self.classes.get(key)
        if cls is None:
            # A class is its catalog class, its regimes' components and its modes (all in its name);
            # its variants are the programs the other values make (at most VARIANTS).
            variants = [c for k, c in self.classes.items() if k[:3] == key[:3] and k[4] == mode_key]
            mismatch = self._units_mismatch([c for k, c in self.classes.items() if k[0] == units], staged)
            if mismatch is not None:
                return self._stock(roots, inputs, "units", mismatch)
            if len(variants) >= VARIANTS:
                # A host value that changes every call would make every call a new graph: fail
                # closed, counted by the value that differs, instead of exporting without end.
                path, why = self._nearest_guard(variants, hosts.as_dict(), self._regimes(), signature)
                if (units, extent, path) not in self._unbounded:
                    self._unbounded.add((units, extent, path))
                    self.report.stamps.append(
                        f"{class_name(self.ob.operator, units, extent)}: {VARIANTS} variants captured and this call differs "
                        f"from each ({why}): runs the stock code from here; pass a value that changes every call as a "
                        "tensor, or declare the counter's regime in the binding (`OperatorBinding.regimes`)")
                return self._stock(roots, inputs, "variants" if path == "signature" else f"guard:{path}")
            cls = self.classes[key] = self._capture(roots, staged, state, call, modes, hosts.as_dict(), counted, guards,
                                                    len(variants))
        if cls.refused is not None:
            return self._stock(roots, inputs, "refused")
        if cls.verify_left > 0 or self._unseen(cls, hosts, roots):
            return self._verify(cls, roots, inputs, staged, state, hosts.as_dict())
        self._current = cls
        # The class's name keys the engine's call: each class its own graphs, whatever its signature.
        outputs, new_state = (self.replay(staged, state, modes, cls.name) if self.replay is not None else cls.graph(staged, state))
        self.counters.graph_calls += 1
        cls.calls += 1
        self._commit(places, new_state, state)
        # Found all at once where no counter lies under another; else each after the writes before
        # it (a value set may replace the object another counter is in).
        wheres = cls.effect_places.at(roots) if cls.effect_places is not None else None
        for i, (path, (kind, value)) in enumerate(cls.effects.items()):
            where = place(roots, path) if wheres is None else wheres[i]
            # each call its own copy of a value set, never one object shared by every stream
            where.set(where.get() + value if kind == "add" else copy.deepcopy(value))
        return self._rebuild(cls, outputs, roots)

    def _switch(self, roots: dict[str, Any]) -> None:
        """Another stream's state objects than the last call's: the last stream's state that is the
        carries' (its objects hold their views) is copied out to it first, so the carries can take
        this stream's without overwriting the other's (two caches interleaved on one model, no
        session states swapped). State a call returns (`out`) is the caller's to keep apart."""
        owner = tuple((name, id(value)) for name, value in roots.items() if name != SELF)
        last = self._owner
        if last is not None and last[0] == owner and all(last[1][name]() is value for name, value in roots.items()
                                                         if name != SELF):
            return  # the same objects as the last call's (every steady call; an id reused is not)
        self._owner = (owner, {name: _reference(value) for name, value in roots.items() if name != SELF})
        if last is None or not self.carries:
            return
        previous = {name: ref() for name, ref in last[1].items()}
        if any(value is None for value in previous.values()):
            return  # the other stream's state is gone (or was None): nothing to keep for it
        for site in self.sites:
            if site.out is not None or site.path.split(".")[0] == SELF:
                continue
            try:
                where = place(previous, site.path)
                value = where.get()
            except (AttributeError, KeyError, IndexError, TypeError):
                continue  # the other stream's object no longer has the site: nothing of ours in it
            held = self.held.get(site.path) if site.region is None else None
            if isinstance(value, torch.Tensor) and ((held is not None and value is held)
                                                    or (site.region is not None and self.carries[site.path].holds(value))):
                where.set(value.clone())
                self.counters.evicted += 1

    def _arguments(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The call's arguments by name, extra keywords (a method's ``**kwargs``) flattened in."""
        arguments = {}
        for name, value in self.signature.bind(*args, **kwargs).arguments.items():
            kind = self.signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                arguments.update(value)
            elif kind is inspect.Parameter.VAR_POSITIONAL:
                if value:
                    raise TypeError(f"{self.ob.operator}: {len(value)} extra positional argument(s) for *{name}: "
                                    f"a bound call names its arguments; pass them by keyword")
            else:
                arguments[name] = value
        return arguments

    # -- state -------------------------------------------------------------------------------

    def _device(self) -> torch.device:
        if not isinstance(self.model, torch.nn.Module):
            return torch.device("cpu")
        first = next(itertools.chain(self.model.parameters(), self.model.buffers()), None)
        return torch.device("cpu") if first is None else first.device

    def _allocate(self, roots: dict[str, Any]) -> None:
        """The state rule: each bound region's buffer at its derived bound, one carry per site."""
        device = self._device()
        for rb in self.regions:
            region, derived = self.contract.region(rb.region), self.catalog.region(rb.region)
            found = sites(rb, roots)
            lead = len(found[0].index) if found else 0
            leading = derived.shape[:lead]
            if not found or [s.index for s in found] != list(itertools.product(*map(range, leading))):
                raise ValueError(f"region {rb.region!r}: the binding's paths {rb.at} reach {len(found)} tensors "
                                 f"({[s.path for s in found][:4]}...), the contract's leading dims "
                                 f"{leading} ask for {math.prod(leading)}")
            axis = carry_axis(region)
            if axis < lead:
                raise ValueError(f"region {rb.region!r}: its retention axis {axis} is one of the {lead} "
                                 "leading dims the binding's paths index; bind the tensors that hold the axis")
            allocated = rb.region in self.report.carries or any(key[0] == rb.region for key in self.shared)
            values = [get_path(roots, site.path) for site in found]
            # A region written before it is read that the model already holds at its derived shape
            # stays where it is: a new buffer and a copy would cost its size again (a batch's rings).
            by_reference = not allocated and rb.write_before_read and _holds_region(
                values, derived.shape[lead:], DTYPES[region.dtype], device)
            if not allocated and not by_reference:
                # Never an inference tensor (a first call under a vendor's `torch.inference_mode()`):
                # the carry is written in place outside it too (a turn reset, a swap).
                with torch.inference_mode(False):
                    buffer = torch.zeros(derived.shape, dtype=DTYPES[region.dtype], device=device)
                self.report.carries[rb.region] = WindowCarry(rb.region, rb.region, buffer, axis)
            for site, value in zip(found, values):
                key = (rb.region, site.index)
                if key not in self.shared:
                    home = value if by_reference else self.report.carries[rb.region].buffer[site.index]
                    # Named by its path; by its region too where the binding names the region's operators
                    # (two methods' arguments of one name, such as two vendor modules' `att_cache`).
                    name = f"{rb.region}:{site.path}" if rb.operators else site.path
                    self.shared[key] = WindowCarry(name, rb.region, home, axis - lead, auditor=self.report.auditor)
                carry = self.carries[site.path] = self.shared[key]
                self._holder.add_module(f"carry{len(self.sites)}", carry)
                if rb.caller_trims:
                    retention = region.retention
                    head = retention.prompt if isinstance(retention, PromptPlusHistory) else 0
                    self.trims[len(self.sites)] = (carry.axis, derived.lower + derived.window, head)
                self.sites.append(site)
            self.region_tensors[rb.region] = ([self.report.carries[rb.region].buffer] if rb.region in self.report.carries
                                              else [self.shared[(rb.region, site.index)].buffer for site in found])
            if not allocated:
                where = (f"kept where the model holds it ({len(found)} tensor{'s' if len(found) > 1 else ''}), none allocated"
                         if by_reference
                         else f"{len(found)} sites at one address each")
                self.report.stamps.append(
                    f"state rule: {rb.region} at {'x'.join(map(str, derived.shape))} ({format_bytes(derived.bytes)}), {where}"
                    + ("; written before read (the binding says so): never copied, verified through the outputs it feeds"
                       if rb.write_before_read else ""))
        for path in self._counter_paths(roots):
            value = get_path(roots, path)
            if isinstance(value, torch.Tensor):  # a device-side counter: state of its own, at one address
                with torch.inference_mode(False):
                    self.held[path] = value.detach().clone()
                self.sites.append(Site(None, path, ()))
        if self._replay_wanted and self.report.auditor is None:  # without CUDA the engine runs eager and says so
            self.replay = ExactShapeReplay(self._run, self._admit, name=self.ob.operator, aliased=[1],
                                           modules=[self.model, self._holder] if isinstance(self.model, torch.nn.Module) else [self._holder],
                                           host_counters=CarryCounters(list(self.carries.values())),
                                           hooks=(HostConstantHoist(),),
                                           write_before_read=[t for rb in self.regions if rb.write_before_read
                                                              for t in self.region_tensors[rb.region]])
            self.report.replays[self.ob.operator] = self.replay

    def _site_places(self) -> Places:
        """Where the sites are, as `Places` (built again whenever sites were found since)."""
        if len(self._places.paths) != len(self.sites):
            self._places = Places([site.path for site in self.sites])
        return self._places

    def _site_shape_error(self, site: Site, value: torch.Tensor) -> str | None:
        carry = self.carries[site.path]
        expected = list(carry.buffer.shape)
        actual = list(value.shape)
        if value.dtype != carry.buffer.dtype or len(actual) != len(expected) or any(
                a != e for i, (a, e) in enumerate(zip(actual, expected)) if i != carry.axis):
            return (f"{site.path} holds {value.dtype} {tuple(actual)}, the contract declares {carry.buffer.dtype} "
                    f"{tuple(expected[:carry.axis])} x extent x {tuple(expected[carry.axis + 1:])}")
        return None

    def _retained(self, values: list[Any]) -> int | None:
        """The operator region's retained extent (0 before any state), from the sites' `values`;
        None when its sites disagree."""
        if self.per_call:
            return self.catalog.region(self.op.region).bound
        extents = set()
        for value, site in zip(values, self.sites):
            if site.region != self.op.region:
                continue
            if value is None:
                extents.add(0)
                continue
            carry = self.carries[site.path]
            if carry.holds(value):  # the carry's own view (every steady call): its shape is the contract's
                extents.add(carry.extent)
                continue
            error = self._site_shape_error(site, value)
            if error is not None:
                raise ValueError(f"{self.ob.operator}: {error}")
            extents.add(value.shape[self.carries[site.path].axis])
        return extents.pop() if len(extents) == 1 else None

    def _carry_view(self, place: Place, site: Site, value: Any) -> torch.Tensor | None:
        """The site's state `value` (what `place` holds: the caller has just read or written it
        there) as its carry's view: adopted into the carry when it is another tensor."""
        if value is None:
            return None
        if site.region is None:
            view = self.held[site.path]
            if value is not view:
                if value.shape != view.shape or value.dtype != view.dtype:
                    raise ValueError(f"{self.ob.operator}: counter {site.path} holds {value.dtype} {tuple(value.shape)}, "
                                     f"it held {view.dtype} {tuple(view.shape)} at the first call")
                if value.device != view.device:  # moved by the model (a cache placed lazily at its first call)
                    view = self.held[site.path] = value.detach().clone()
                view.copy_(value)
                place.set(view)
                self.counters.adopted += 1
            return view
        carry = self.carries[site.path]
        if carry.holds(value):  # the carry's view already (every steady call)
            return value
        if value.shape[carry.axis] > carry.capacity:
            # The stock code retained more than the contract's bound (a model that does not trim as
            # declared): no class of the catalog has this extent, so the state stays the stock's own.
            return value
        if value.untyped_storage().data_ptr() == carry.buffer.untyped_storage().data_ptr() and not carry._aliases(value):
            # The stock code kept a view of the carry at another offset (a stock fallback cuts its
            # input): copied out first, as the carry's own writes may overlap it.
            value = value.clone()
        view = carry.adopt(value)
        if site.out is None:  # a returned state is the caller's to thread: their object stays as it is
            place.set(view)
        self.counters.adopted += 1
        return view

    def _commit(self, places: list[Place], new_state: list, current: list | None = None) -> None:
        """Mutated state objects get the carry views back; returned state is in the output already.
        A ring the step returns anew (Whisper's cross-attention keys, computed by a stream's first
        call) is taken into its carry now, so the state object holds the carry from this call on.
        `current`: what the places held when the graph ran (the state passed to it); a site whose
        new state is that very tensor has nothing to commit: a ring written in place, a counter kept
        in its held tensor, and on a replay every site of a steady class (the graph's outputs come
        back as the same objects every call)."""
        for i, (place, site, value) in enumerate(zip(places, self.sites, new_state)):
            if current is not None and value is current[i]:
                continue
            if site.out is None:
                held = self.held.get(site.path) if site.region is None else None
                if held is not None and value is not None and value is not held:
                    # A device-side counter the step rebinds (`state.first = torch.where(...)`):
                    # its new value written into the one tensor it is kept at.
                    held.copy_(value)
                    value = held
                place.set(value)
                if site.region is not None and value is not None and not self.carries[site.path].holds(value):
                    self._carry_view(place, site, value)

    def _counter_paths(self, roots: dict[str, Any]) -> list[str]:
        found = []
        for j, path in enumerate(self.ob.counters):
            try:
                found += [concrete for _, concrete, _ in resolve(roots[path.split(".")[0]], path)]
            except (AttributeError, KeyError, IndexError, TypeError) as error:
                field = f"operators[{self.binding.operators.index(self.ob)}].counters[{j}]"
                raise BindingError(field, f"{path!r} does not resolve on this call's arguments: {error}") from None
        return found

    def _host_counter_paths(self, roots: dict[str, Any]) -> list[str]:
        """The counters that are host values (ints, flags): a graph cannot move them, the pipeline does."""
        return [path for path in self._counter_paths(roots) if path not in self.held]

    def _modes(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """The binding's modes as this call finds them, by path (read, never traced: a path at
        ``self`` reads the model without making it a root of the call's state)."""
        modes = {}
        for path in self.ob.modes:
            value = get_path({SELF: self.model, **arguments}, path)
            if not isinstance(value, (bool, int, float, str, type(None))):
                raise TypeError(f"{self.ob.operator}: mode {path!r} is {type(value).__name__}; a mode is a host value "
                                "(bool, int, float, str or None) that chooses what the call computes")
            modes[path] = value
        return modes

    def _units(self, arguments: dict[str, Any]) -> int:
        if isinstance(self.ob.units, int):
            if self.ob.flush is not None and get_path(self._with_defaults(arguments), self.ob.flush) is True:
                return self.op.flush[0]
            return self.ob.units
        path, axis = self.ob.units
        value = get_path(arguments, path)
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{self.ob.operator}: units path {path!r} is {type(value).__name__}, expected a tensor")
        return int(value.shape[axis])

    def _with_defaults(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """The call's arguments, those it left out at their defaults (a `last_chunk=False` not passed)."""
        defaults = {name: p.default for name, p in self.signature.parameters.items() if p.default is not inspect.Parameter.empty}
        return {**defaults, **arguments}

    # -- guards ------------------------------------------------------------------------------

    def _guarded(self, roots: dict[str, Any]) -> tuple[_Hosts, tuple, tuple]:
        """Every host value the call's program may depend on, those in its state arguments and in the
        model's modules (`cadence_fx.guards`), by path; the components of those a regime keys (the
        class is theirs, as it is its catalog class's); and the key the others make, each by its
        value and type (True and 1 are not the same program)."""
        arguments = host_values(_arguments(roots))
        regimes = self._argument_regimes(arguments, roots)
        counted = tuple((p, regimes[p].component(arguments[p])) for p in regimes if p in arguments
                        and not isinstance(regimes[p], Unread))
        key = guard_key({p: v for p, v in arguments.items() if p not in regimes}, regimes)
        if self._settings is None:
            return _Hosts(arguments, (), []), counted, (key,)
        values = self._settings.read()
        if self._settings_version != self._settings.version:
            self._settings_version = self._settings.version
            everything = {SELF: self.model}
            found = {concrete: regime for regime in self.ob.regimes if not isinstance(regime, Unread)
                     and regime.path.split(".")[0] == SELF for concrete in self._resolved(everything, regime)}
            self._settings_regimes = [(i, found[p]) for i, p in enumerate(self._settings.paths) if p in found]
        components = list(values)
        for i, regime in self._settings_regimes:
            components[i] = None  # keyed by its regime, in `counted`
            counted += ((self._settings.paths[i], regime.component(values[i])),)
        return (_Hosts(arguments, self._settings.paths, values), counted,
                (key, self._settings_version, tuple(components), tuple(map(type, values))))

    def _resolved(self, roots: dict[str, Any], regime: Regime) -> set[str]:
        """The concrete paths `regime` reaches on `roots` now (none where its path does not resolve:
        a streaming state not entered yet)."""
        try:
            return {concrete for _, concrete, _ in resolve(roots[regime.path.split(".")[0]], regime.path)}
        except (AttributeError, KeyError, IndexError, TypeError):
            return set()

    def _unread(self) -> frozenset[str]:
        """The model's paths an `Unread` regime covers (the settings walk skips them and what is under them)."""
        return frozenset(p for regime in self.ob.regimes if isinstance(regime, Unread) and regime.path.split(".")[0] == SELF
                         for p in self._resolved({SELF: self.model}, regime))

    def _argument_regimes(self, hosts: dict[str, Any], roots: dict[str, Any]) -> dict[str, Regime]:
        """The binding's regimes by the concrete paths they reach among the arguments' host values
        (resolved again only when their paths change: a cache's layers made at its first call)."""
        if not self.ob.regimes:
            return {}
        if self._regime_paths != hosts.keys():
            self._regime_paths = set(hosts)
            self._regime_of = {}
            for regime in self.ob.regimes:
                if regime.path.split(".")[0] == SELF:
                    continue
                # A regime covers its path and every value under it (a list of names, a state object).
                found = self._resolved(roots, regime)
                prefixes = tuple(f"{concrete}." for concrete in found)
                self._regime_of.update({path: regime for path in hosts if path in found or path.startswith(prefixes)})
        return self._regime_of

    def _regimes(self) -> dict[str, Regime]:
        """Every regime by the concrete path it covers now, in the arguments and the model."""
        return {**self._regime_of, **{self._settings.paths[i]: r for i, r in self._settings_regimes}} if self._settings else dict(self._regime_of)

    def _unseen(self, cls: _Class, hosts: _Hosts, roots: dict[str, Any]) -> bool:
        """A class whose regime spans several values of a counter is verified at two of them: this
        call brings one not verified yet, while fewer than two have been."""
        if not cls.spanning or len(cls.seen) >= 2:
            return False
        return self._spanned(cls, hosts.as_dict(), roots) not in cls.seen

    def _spanned(self, cls: _Class, hosts: dict[str, Any], roots: dict[str, Any]) -> tuple:
        """The values of the counters `cls` spans (an `Unread` one read where it is: no guard holds it)."""
        everything = {SELF: self.model, **roots}
        values = (hosts[p] if p in hosts else get_path(everything, p) for p in cls.spanning)
        return tuple(v if isinstance(v, HOST_SCALARS) else type(v).__name__ for v in values)

    def _units_mismatch(self, classes: list[_Class], staged: dict[str, Any]) -> str | None:
        """An int `units` says every call brings as many units: a call whose input tensors have other
        shapes than the first class of those units captured (a 12-frame prefill met as a 4-frame
        step) is not one of them."""
        if not isinstance(self.ob.units, int) or not classes:
            return None
        shapes = _input_shapes(staged)
        first = classes[0].inputs
        if shapes == first:
            return None
        differing = [f"{path} {a} (the class was captured at {b})" for (path, a), (_, b) in zip(shapes, first) if a != b]
        return (f"{self.ob.operator}: the binding's units={self.ob.units} says every call brings {self.ob.units} units, "
                f"but this call's inputs differ: {', '.join(differing) or shapes}; bind units as (argument, axis)")

    def _nearest_guard(self, variants: list[_Class], hosts: dict[str, Any], regimes: dict[str, Regime],
                       signature) -> tuple[str, str]:
        """The path by which this call differs from the captured variant nearest to it, and how."""
        best = None
        for cls in variants:
            differing = [p for p in hosts.keys() | cls.hosts.keys()
                         if guard_key({p: hosts.get(p)}, regimes) != guard_key({p: cls.hosts.get(p)}, regimes)]
            if best is None or len(differing) < len(best[1]):
                best = (cls, sorted(differing))
        cls, differing = best
        if not differing:
            return "signature", f"its inputs, layouts or modes ({signature.describe()})"
        path = differing[0]
        return path, f"{path} is {hosts.get(path)!r}, {cls.name} was captured at {cls.hosts.get(path)!r}" + (
            f", and {len(differing) - 1} more value(s)" if len(differing) > 1 else "")

    def _catalog_class(self, units: int, extent: int | None) -> CatalogClass | None:
        for call in self.op_catalog.classes:
            if call.call == units and call.extent == extent:
                return call
        return None

    # -- capture, verification, fallback -----------------------------------------------------

    def _capture(self, roots, inputs, state, call: CatalogClass, modes: dict[str, Any], hosts: dict[str, Any],
                 counted: tuple, guards: tuple, variant: int) -> _Class:
        # Unique per program: a class by its regimes' components, a second program of one class
        # (other host values) by its number.
        name = (class_name(self.ob.operator, call.call, call.extent, call.flush, modes)
                + "".join(f"<{path}~{component!r}>" for path, component in counted) + (f"#{variant + 1}" if variant else ""))
        regimes = self._regimes()
        spanning = tuple(p for p, r in regimes.items() if p in hosts and r.spans(r.component(hosts[p])))
        everything = {SELF: self.model, **roots}
        spanning += tuple(sorted(p for p in self._unread() if isinstance(get_path(everything, p), HOST_SCALARS)))
        cls = _Class(name, call, verify_left=self.binding.verify, hosts=dict(hosts), spanning=spanning,
                     inputs=_input_shapes(inputs))
        self._by_name[name] = cls
        started = time.perf_counter()
        example = list(state)  # the export traces fake copies of them: the carries are not written
        key = self._export_key(inputs, example, modes, (counted, guards))
        gm = _reused_export(key, self.model)
        if gm is not None:
            self.report.stamps.append(f"{name}: the export of a model of the same structure reused, rebound to this model's tensors")
            return self._rewrite(cls, gm, inputs, example, modes, call, name, started)
        at_sites = [get_path(roots, s.path) for s in self.sites]  # the carries, or a returned state's own tensors
        private = _private(roots, [v for v in (*state, *at_sites) if isinstance(v, torch.Tensor)])
        method = method_of(private[SELF], self.ob.method) if SELF in private else self.method
        step = _Step(self.model, method, private, self.sites, self.trims)
        try:
            with torch.no_grad(), without_stack_traces(), warnings.catch_warnings():
                # The step writes the sites into its private copy of the state: expected, not a bug.
                warnings.filterwarnings("ignore", "The tensor attributes? .* (was|were) assigned during export", UserWarning)
                program = torch.export.export(step, (inputs, example), strict=False)
        except OpaqueOutput as error:
            cls.refused = str(error)
            self.report.stamps.append(f"{name}: refused, {cls.refused}")
            return cls
        except Exception as error:  # the model does not export at this class: it runs stock, and says why
            cls.refused = f"torch.export failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
            self.report.stamps.append(f"{name}: refused, {cls.refused}")
            return cls
        frozen = _undeclared_state(program, private, self.sites)
        if frozen:
            cls.refused = (f"the step reads {', '.join(frozen)}: state the binding does not declare, which a graph "
                           "would freeze as a constant; bind it (a region's `at`, or the operator's `counters` for a "
                           "position or length the step moves)")
            self.report.stamps.append(f"{name}: refused, {cls.refused}")
            return cls
        gm = program.module()
        _keep_export(key, gm)
        return self._rewrite(cls, gm, inputs, example, modes, call, name, started)

    def _export_key(self, inputs, example, modes, guards: tuple) -> tuple | None:
        """What an export of this operator's step depends on: the model's structure (its class, every
        weight's and buffer's name, shape, dtype and device, every module's other attributes), the
        method, the sites and their trims, and the class's signature (shapes, layouts, host values,
        grad and autocast modes). None for a model that is no module (its weights would be constants)."""
        if not isinstance(self.model, torch.nn.Module):
            return None
        tensors = tuple((name, tuple(t.shape), t.dtype, t.device) for name, t in itertools.chain(
            self.model.named_parameters(remove_duplicate=False), self.model.named_buffers(remove_duplicate=False)))
        # Every other attribute of every module by type and repr (0.0 and -0.0, True and 1 are not the
        # same program), read now: a setting may have changed since the last class (a mode the binding
        # declares). An object whose repr is its address differs from any other: no reuse.
        settings = tuple((name, tuple(sorted((k, type(v).__name__, _setting(v)) for k, v in vars(module).items()
                                             if k not in _STRUCTURE_KEPT_APART
                                             and not isinstance(v, (torch.Tensor, torch.nn.Module)))))
                         for name, module in self.model.named_modules())
        try:
            signature = Signature.of(inputs, example, modes).catalog_key
        except TypeError:
            return None
        mode_key = tuple((path, type(value).__name__, repr(value)) for path, value in modes.items())
        # The guards: the host values frozen into the export (a cache's length), by regime.
        return ((type(self.model), tensors, settings), self.ob.method, tuple(self.sites), tuple(sorted(self.trims.items())),
                signature, mode_key, guards)

    def _rewrite(self, cls: _Class, gm: torch.fx.GraphModule, inputs, example, modes: dict[str, Any], call: CatalogClass,
                 name: str, started: float) -> _Class:
        """The exported step `gm` of class `cls`, its retention rewritten onto the carries."""
        placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        positions = {}
        for i, (path, _) in enumerate(pytree.tree_flatten_with_path(((inputs, example), {}))[0]):
            positions[pytree.keystr(path)] = placeholders[i]
        out_leaves = pytree.tree_unflatten(list(range(gm._out_spec.num_leaves)), gm._out_spec)[1]
        returned = pytree.tree_leaves(next(n for n in gm.graph.nodes if n.op == "output").args)
        windows, rings = [], []
        for i, site in enumerate(self.sites):
            if site.region is None:  # a device-side counter: the step moves it in place, nothing to rewrite
                continue
            # A first call (no state yet) is where a wrong contract shape would first show, inside the graph.
            value = returned[out_leaves[i]].meta.get("val")
            error = self._site_shape_error(site, value) if isinstance(value, torch.Tensor) else None
            if error is not None:
                raise ValueError(f"{self.ob.operator}: after the call {error}")
            region, derived = self.contract.region(site.region), self.catalog.region(site.region)
            if fixed_extent(region.retention):
                rings.append(_ring_site(gm, name, site, self.carries[site.path].axis, out_leaves[i],
                                        positions.get(f"[0][1][{i}]")))
                continue
            keep = derived.lower + derived.window
            # Another region's extent is its own (a sliding window still filling beside a growing
            # cache): what this call brings, not its bound.
            retained = call.extent if site.region == self.op.region else (
                0 if example[i] is None else example[i].shape[self.carries[site.path].axis])
            windows.append(Window(
                site=site.path, region=site.region, output=out_leaves[i],
                input=None if example[i] is None else positions.get(f"[0][1][{i}]"),
                axis=self.carries[site.path].axis, keep=keep,
                # Each region advances by its own units: the operator's call on its own region,
                # another region's stride on that one (a downsampled path beside the main one).
                live=retained + (call.call if site.region == self.op.region else region.stride),
                held=region.holds_call,
                head=region.retention.prompt if isinstance(region.retention, PromptPlusHistory) else 0,
                copy=site.out is not None,
            ))
        if call.extent == max(self.op_catalog.grid) and not call.flush:
            self._pinned(windows)
        try:
            after, found, stamp = rewrite_windows(gm, tuple(windows), self.carries, graph=name)
        except WindowError as error:
            cls.refused = f"retention rewrite: {error}"
            self.report.stamps.append(f"{name}: refused, {cls.refused}")
            return cls
        found = rings + found
        cls.graph = after
        cls.exported = gm
        cls.capture_ms = (time.perf_counter() - started) * 1e3
        self.report.sites.extend(found)
        self.report.graphs[name] = (gm, after)
        self.report.stamps.append(f"{stamp}; capture and rewrite of {name} took {cls.capture_ms:.0f} ms")
        return cls

    def _pinned(self, windows: list[Window]) -> None:
        """The state rule's account, at the steady class: each stock retained slice is a view of its
        call's concat, so the stock code pins the whole operand (retained + new units) until the
        next call, against the carry's derived demand."""
        done = {r.region for r in self.report.resizes}
        for rb in self.regions:
            live = {w.live for w in windows if w.region == rb.region}
            if rb.region in done or len(live) != 1:
                continue
            region, derived = self.contract.region(rb.region), self.catalog.region(rb.region)
            stock = tuple(live.pop() if i == carry_axis(region) else d for i, d in enumerate(derived.shape))
            self.report.resizes.append(Resize(" + ".join(rb.at), rb.region, stock, DTYPES[region.dtype].itemsize * math.prod(stock),
                                              derived.shape, derived.bytes))

    def _stock_call(self, roots, inputs):
        with torch.no_grad():
            return self.method(**inputs, **_arguments(roots))

    def _verify(self, cls: _Class, roots, inputs, staged, state, hosts: dict[str, Any]) -> Any:
        """The program first, then the values. The exported step and the stock call (on a private
        copy of the state objects) run under `OpTrace`, on the caller's inputs and on clones of
        the same state, the RNG rewound between them: they must run the same ATen program
        (`cadence_fx.program`), and, being the same program on the same inputs, give the same
        bits (else the stock call does not repeat itself). Then the stock call runs untraced on
        the stream's own state objects, and the rewritten graph (on the staged inputs, on the
        carries) must give its outputs, retained state and host values bit for bit."""
        counters_before = {p: get_path(roots, p) for p in self._host_counter_paths(roots)}
        hosts_before = host_values(_arguments(roots))
        spanned = self._spanned(cls, hosts, roots)
        originals = [get_path(roots, s.path) for s in self.sites]
        rng = RngState.capture()
        with OpTrace() as graph_trace:
            exported = cls.exported(inputs, [self._clone(site, value) for site, value in zip(self.sites, state)])
        rng.restore()
        # The stock call's program, traced on a private copy of the state objects (its host values
        # move there, not on the stream's): a dispatch mode may change which kernel an op picks
        # (SDPA's backend on CUDA), so the values are the untraced stock call's, below.
        at_sites = [get_path(roots, site.path) for site in self.sites]
        private = _private(roots, [v for v in (*state, *at_sites) if isinstance(v, torch.Tensor)])
        for site, value in zip(self.sites, state):
            set_path(private, site.path, self._clone(site, value))
        method = method_of(private[SELF], self.ob.method) if SELF in private else self.method
        with torch.no_grad(), OpTrace() as stock_trace:
            traced = _caller_trimmed(method(**inputs, **_arguments(private)), self.sites, self.trims)
        traced = ([x for x in _structure(traced, private)[0] if isinstance(x, torch.Tensor)],
                  _new_state(self.sites, private, traced))
        del private
        rng.restore()
        for site, value in zip(self.sites, state):
            set_path(roots, site.path, self._clone(site, value))
        expected = _caller_trimmed(self._stock_call(roots, inputs), self.sites, self.trims)
        if cls.outputs is None:
            cls.outputs = _structure(expected, roots)[1]
        expected_state = _new_state(self.sites, roots, expected)
        # A host value the stock call moves that the binding leaves out (a cache's `is_initialized`)
        # is one no graph call would move: a later stock call would then read a stale value.
        hosts_after, declared = host_values(_arguments(roots)), tuple(self._counter_paths(roots))
        moved = [f"{p} ({hosts_before.get(p)!r} -> {hosts_after.get(p)!r})" for p in sorted(hosts_before.keys() | hosts_after.keys())
                 if hosts_before.get(p) != hosts_after.get(p) and not any(p == d or p.startswith(d + ".") for d in declared)]
        effects = {}
        for path, before in counters_before.items():
            after = get_path(roots, path)
            # A value set is kept as a copy: the object itself (a dict of flags) is this stream's.
            effects[path] = (("set", copy.deepcopy(after)) if isinstance(after, bool) or not isinstance(after, int)
                             else ("add", after - before))
        counters_after = {p: get_path(roots, p) for p in counters_before}
        rng.restore()
        for site, value, original in zip(self.sites, state, originals):
            set_path(roots, site.path, value if site.out is None else original)
        outputs, new_state = cls.graph(staged, state)
        self.counters.graph_calls += 1
        cls.calls += 1
        self._commit(self._site_places().at(roots), new_state, state)
        for path, value in counters_after.items():
            set_path(roots, path, value)
        actual = self._rebuild(cls, outputs, roots)
        stock_leaves = [x for x in _structure(expected, roots)[0] if isinstance(x, torch.Tensor)]
        why = None
        program = first_difference(stock_trace.records, graph_trace.records)
        if program is not None:
            why = (f"program: the exported step is not the program the stock call runs: {program}; "
                   + _program_hint(cls, hosts, self._host_counter_paths(roots)))
        if why is None:
            repeat = _equal(exported, traced, ("output", "state"))
            if repeat is not None:
                why = (f"the stock call does not repeat itself: the same program on the same inputs gave other bits "
                       f"({repeat}); pin deterministic kernels (cadence_fx.determinism.pin_deterministic)")
        if why is None:
            why = _equal((outputs, new_state), (stock_leaves, expected_state), ("output", "state"))
            if why is not None:
                why = f"the rewritten graph differs from the stock call: {why}"
        returned = _structure(expected, roots)[1]
        if why is None and returned != cls.outputs:
            why = (f"the call returned host values {returned[1]}, an earlier call of the class returned "
                   f"{cls.outputs[1]}: a graph would return the first ones every call")
        if why is None and moved:
            why = (f"the stock call moved host values the binding does not declare: {', '.join(moved)}; a graph would "
                   "not move them: bind them as the operator's counters")
        if why is None and cls.effects is not None and cls.effects != effects:
            why = f"host counters moved {effects}, an earlier call of the class moved them {cls.effects}"
        if why is not None:
            cls.refused = f"verification: {why}"
            self.report.stamps.append(f"{cls.name}: refused, {cls.refused}")
            for site, value in zip(self.sites, expected_state):
                if site.out is None:
                    where = place(roots, site.path)
                    where.set(value)
                    self._carry_view(where, site, value)
            for path, value in counters_after.items():
                set_path(roots, path, value)
            self.counters.fallback("verification")
            return expected
        cls.effects = effects
        nested = any(inner.startswith(outer + ".") for outer in effects for inner in effects)
        cls.effect_places = None if nested else Places(list(effects))
        cls.verify_left = max(cls.verify_left - 1, 0)
        cls.verified += 1
        if cls.spanning:
            cls.seen.add(spanned)
        self.counters.verified += 1
        return actual

    def _clone(self, site: Site, value: Any) -> Any:
        """A copy of a site's state for a stock or traced call; a region written before it is read is
        never copied (every call writes what it reads first)."""
        return value if value is None or self._uncopied(site) else value.clone()

    def _uncopied(self, site: Site) -> bool:
        """A site of a region the binding says is written before it is read: never copied."""
        return site.region is not None and self.binding.region(site.region).write_before_read

    def _stock(self, roots, inputs, reason: str, detail: str | None = None) -> Any:
        """Fail closed: the stock call on the state as it is (nothing copied), its retained state
        then taken into the carries. `detail` is said once in the report."""
        if detail is not None and reason not in self.counters.stock_by_reason:
            self.report.stamps.append(f"{self.ob.operator}: runs the stock code ({reason}): {detail}")
        out = self._stock_call(roots, inputs)
        if self.sites and all(roots[name] is not None for name in roots):
            for site, where in zip(self.sites, self._site_places().at(roots)):
                value = where.get()
                if site.out is None and value is not None and (site.region is None or self._site_shape_error(site, value) is None):
                    self._carry_view(where, site, value)
        self.counters.fallback(reason)
        return out

    def _rebuild(self, cls: _Class, tensors: list, roots: dict[str, Any]) -> Any:
        spec, others = cls.outputs
        leaves, it = [], iter(tensors)
        for i in range(spec.num_leaves):
            if i in others:
                kind, value = others[i]
                leaves.append(roots[value] if kind == "root" else value)
            else:
                leaves.append(next(it))
        return pytree.tree_unflatten(leaves, spec)

    # -- replay ------------------------------------------------------------------------------

    def _run(self, inputs, state, modes, name):
        """What the replay engine captures: the graph of class `name` (`modes` and `name` key the
        engine's call, so each class has graphs of its own)."""
        return self._by_name[name].graph(inputs, state)

    def _admit(self, signature: Signature):
        """The engine's class for a call: the pipeline's class, by the name the call carries."""
        name = signature.leaves[-1]
        return name[2] if name[0] == "S" and name[2] in self._by_name else None

    def explain(self) -> str:
        lines = [f"{self.ob.operator}: {self.counters.as_dict()}"]
        for cls in self.classes.values():
            status = f"refused: {cls.refused}" if cls.refused else f"verified {cls.verified} call(s)"
            lines.append(f"  {cls.name}: capture {cls.capture_ms:.0f} ms, {status}")
        return "\n".join(lines)


#: Exported steps by `BoundOperator._export_key`, their model's weights and buffers stripped (meta
#: tensors). Another model of the same structure calling the same method at the same class (a
#: serving lane's copy of a flow, or a second flow with weights of its own) takes a copy rebound to
#: its own weights and buffers by name instead of tracing again (a full-size Token2Wav CFM loop
#: takes minutes to export). That is sound because torch.export traces the weights and buffers as
#: fake tensors: a graph cannot depend on their values (a step that reads one on the host fails
#: its export). Only an export whose every tensor is the model's own weight or buffer is kept (a
#: constant's value is in the graph); verification still runs the stock call beside the graph in
#: every transform.
_EXPORTS: collections.OrderedDict[tuple, torch.fx.GraphModule] = collections.OrderedDict()
#: How many exports the process keeps, the least recently used dropped first. Each is kept with its tensors
#: on meta, so it costs its graph only; 256 keeps a Token2Wav flow's exports while many other models export.
EXPORTS_KEPT = 256
#: Module attributes the export key leaves out: the weights, buffers and submodules (keyed by name,
#: shape, dtype and device), and which buffers are saved with the model (not a program's business).
_STRUCTURE_KEPT_APART = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})
_MODEL = "model."  # where `_Step` registers the model: its tensors' names in an export


def _setting(value: Any) -> Any:
    """A module attribute as the export key holds it: its repr; for an operator this pipeline bound
    on the model, its name; for a NumPy array (whose repr elides the middle of a long one), its
    dtype, shape and bytes."""
    if isinstance(value, BoundOperator):
        return f"bound operator {value.ob.operator}"
    if isinstance(value, np.ndarray):
        return (str(value.dtype), value.shape, value.tobytes())
    return repr(value)


def _rebound(gm: torch.fx.GraphModule, tensor_for) -> torch.fx.GraphModule | None:
    """A copy of `gm` (sharing its nodes' metadata and specs) whose model tensors are
    `tensor_for(name, tensor)`; None when `gm` holds a tensor that is not the model's (a constant)."""
    memo = shared_memo(gm)
    named = dict(itertools.chain(gm.named_parameters(remove_duplicate=False), gm.named_buffers(remove_duplicate=False)))
    owned = {id(t) for t in named.values()}
    if any(isinstance(v, torch.Tensor) and id(v) not in owned for m in gm.modules() for v in vars(m).values()):
        return None
    for name, tensor in named.items():
        if not name.startswith(_MODEL):
            return None
        memo[id(tensor)] = tensor_for(name[len(_MODEL):], tensor)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning)
        return copy.deepcopy(gm, memo)


def _meta(name: str, tensor: torch.Tensor) -> torch.Tensor:
    meta = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
    return torch.nn.Parameter(meta, requires_grad=False) if isinstance(tensor, torch.nn.Parameter) else meta


def _keep_export(key: tuple | None, gm: torch.fx.GraphModule) -> None:
    if key is None:
        return
    stripped = _rebound(gm, _meta)
    if stripped is not None:
        _EXPORTS[key] = stripped
        while len(_EXPORTS) > EXPORTS_KEPT:
            _EXPORTS.popitem(last=False)


def _reused_export(key: tuple | None, model: torch.nn.Module) -> torch.fx.GraphModule | None:
    kept = _EXPORTS.get(key) if key is not None else None
    if kept is None:
        return None
    _EXPORTS.move_to_end(key)
    found = dict(itertools.chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)))
    return _rebound(kept, lambda name, _: found[name])


class BoundModel(Transformed):
    """A model transformed from its contract and binding: call it as the stock model (its one
    bound operator), or each operator through `operators[name]`. Several streams share its graphs
    through `session_state` / `swap_in` / `swap_out` (`cadence_fx.transformed`)."""

    def __init__(self, model: Any, operators: dict[str, BoundOperator], report):
        self.model = model
        self.operators = operators
        self.report = report
        self._methods = {op.ob.method: op for op in operators.values()}

    def __getattr__(self, name: str) -> Any:
        """A drop-in for the model: a bound method is its operator, anything else the model's own."""
        if name.startswith("_") or name in ("model", "operators", "report", "carries", "calls"):
            raise AttributeError(name)
        if name in self._methods:
            return self._methods[name]
        return getattr(self.model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(self.operators) != 1:
            raise TypeError(f"this model binds {len(self.operators)} operators: call operators[name], one of {sorted(self.operators)}")
        return next(iter(self.operators.values()))(*args, **kwargs)

    def explain(self) -> str:
        return "\n".join(op.explain() for op in self.operators.values())

    @property
    def carries(self) -> dict[str, WindowCarry]:
        """Every site's carry, by its name: the site's concrete path (with its region where the binding
        names the region's operators: two methods' `att_cache`); empty before the first call."""
        return {carry.site: carry for op in self.operators.values() for carry in op.carries.values()}

    @property
    def calls(self) -> dict[str, int]:
        """Calls per catalog class met so far, by class name, that ran the rewritten graph."""
        return {cls.name: cls.calls for op in self.operators.values() for cls in op.classes.values()}

    def device(self) -> torch.device:
        return next(iter(self.operators.values()))._device()

    def _carries(self) -> list[WindowCarry]:
        if not all(op.carries for op in self.operators.values()):
            raise RuntimeError("the carries are allocated at each operator's first call: call the model once "
                               "before taking or swapping session states")
        carries = [carry for op in self.operators.values() for carry in op.carries.values()]
        return list({id(c): c for c in carries}.values())  # operators binding one region share its carries

    def resident(self) -> tuple[list[torch.Tensor], list[int]]:
        """The carries and held counters (read by `session_state`, `swap_in` and `swap_out`): the
        caller swapping streams' states decides what the carries hold from here, so no operator
        copies a stream's state out of them on its own when the next call's objects differ."""
        for op in self.operators.values():
            op._owner = None
        carries = self._carries()
        buffers = [t for op in self.operators.values() for rb in op.regions for t in op.region_tensors[rb.region]]
        buffers += [t for op in self.operators.values() for t in op.held.values()]
        return list({id(b): b for b in buffers}.values()), CarryCounters(carries).read()

    def set_counters(self, counters: list[int]) -> None:
        CarryCounters(self._carries()).write(counters)

    def reset(self) -> None:
        """A fresh stream: every carry empty (before the first call they are not even allocated)."""
        if not all(op.carries for op in self.operators.values()):
            return
        for carry in self._carries():
            carry.reset()
        for buffer in self.resident()[0]:
            buffer.zero_()


def transform_bound(model: Any, contract: Contract, binding: Binding, catalog: Catalog, report, *, replay: bool) -> BoundModel:
    from .binding import check_binding

    signatures = check_binding(model, contract, binding)
    for op in catalog.operators:
        if op.name in signatures and not op.in_scope:
            raise ValueError(f"operator {op.name!r}: {op.verdict}; raise the budget (transform(..., budget=N), "
                             f"`--budget N` on the CLI) to capture all {op.width} classes")
    shared: dict[tuple[str, tuple[int, ...]], WindowCarry] = {}
    operators = {ob.operator: BoundOperator(model, contract, catalog, binding, ob, signatures[ob.operator], report,
                                            replay=replay, shared=shared)
                 for ob in binding.operators}
    report.stamps.append(f"binding: {len(binding.regions)} region(s), {len(binding.operators)} operator(s); classes are "
                         f"captured at their first visit and verified against the stock call on {binding.verify}")
    report.operators = operators
    return BoundModel(model, operators, report)
