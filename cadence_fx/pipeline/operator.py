"""The driver: `BoundOperator` runs a call through the stages (check and guard, capture, rewrite,
verify, replay), or the stock code, counted by reason."""

from __future__ import annotations

import copy
import inspect
import itertools
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..binding import (
    SELF,
    Binding,
    OperatorBinding,
    Places,
    Site,
    get_path,
    method_of,
    operator_regions,
    place,
    sites,
)
from ..catalog import Catalog, CatalogClass
from ..contract import Contract
from ..guards import ModuleSettings, Regime
from ..passes.window import WindowCarry
from ..replay import ExactShapeReplay, Signature
from .export import capture_class
from .guard import all_regimes, nearest_guard, read_guards, units_mismatch, unread_paths, unseen_value
from .records import VARIANTS, OperatorClass, OperatorCounters, class_name
from .state import allocate, carry_view, commit_state, region_extent, site_places, site_shape_error, switch_stream
from .step import root_arguments, staged_inputs
from .verify import verify_class


class BoundOperator:
    """One hot operator of a bound model: call it as the stock method. It binds the regions whose
    paths start at its method's arguments (or the model itself)."""

    def __init__(
        self,
        model: Any,
        contract: Contract,
        catalog: Catalog,
        binding: Binding,
        ob: OperatorBinding,
        signature: inspect.Signature,
        report,
        *,
        replay: bool,
        shared: dict[tuple[str, tuple[int, ...]], WindowCarry],
    ):
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
            p.split(".")[0] for p in ob.counters if "." in p
        } - {SELF}
        self.counters = OperatorCounters()
        self.classes: dict[tuple, OperatorClass] = {}
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
        self._by_name: dict[str, OperatorClass] = {}
        self._owner: tuple | None = None  # (identity, references) of the last call's state objects
        self._current: OperatorClass | None = None
        self._unbounded: set[tuple[int, int, str]] = set()  # (units, extent, guard path) said once
        self._settings = ModuleSettings(model, lambda: unread_paths(self)) if isinstance(model, torch.nn.Module) else None
        self._settings_version = 0
        self._settings_regimes: list[tuple[int, Regime]] = []  # (leaf index, regime) of the settings' counters
        self._regime_paths: set[str] | None = None
        self._regime_of: dict[str, Regime] = {}

    def __deepcopy__(self, memo: dict) -> BoundOperator:
        """Itself: a handle on graphs and carries that a state object may hold (a vendor's step
        calling it), shared by a trace's private copy of that state, never copied."""
        return self

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
        switch_stream(self, roots)
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
            allocate(self, roots)
        places = site_places(self).at(roots)  # each module on the sites' paths walked once a call
        values = [place.get() for place in places]  # each site read once a call
        extent = region_extent(self, values)
        units = self._units(arguments)
        call = self._catalog_class(units, extent)
        if call is None:
            return self._stock(roots, inputs, "not_in_catalog")
        extent = call.extent  # the class's, which `region_extent` found: an int
        state = [carry_view(self, place, site, value) for place, site, value in zip(places, self.sites, values)]
        staged = staged_inputs(inputs)
        try:
            # The inputs' key: shapes, layouts and every non-tensor input.
            signature = Signature.of(staged)
        except TypeError:
            return self._stock(roots, inputs, "unkeyable")
        # The state's layouts (carry views, held counters, or the stock's own tensors).
        shapes = tuple(None if v is None else (tuple(v.shape), v.stride(), v.dtype, v.device, v.layout) for v in state)
        # A mode by its type and repr: values equal to Python (True and 1, 0.0 and -0.0) are not the same program.
        mode_key = tuple((path, type(value).__name__, repr(value)) for path, value in modes.items())
        hosts, counted, guards = read_guards(self, roots)
        key = (units, extent, counted, shapes, mode_key, signature.catalog_key, guards)
        cls = self.classes.get(key)
        if cls is None:
            # A class is its catalog class, its regimes' components and its modes (all in its name);
            # its variants are the programs the other values make (at most VARIANTS).
            variants = [c for k, c in self.classes.items() if k[:3] == key[:3] and k[4] == mode_key]
            mismatch = units_mismatch(self, [c for k, c in self.classes.items() if k[0] == units], staged)
            if mismatch is not None:
                return self._stock(roots, inputs, "units", mismatch)
            if len(variants) >= VARIANTS:
                # A host value that changes every call would make every call a new graph: fail
                # closed, counted by the value that differs, instead of exporting without end.
                path, why = nearest_guard(self, variants, hosts.as_dict(), all_regimes(self), signature)
                if (units, extent, path) not in self._unbounded:
                    self._unbounded.add((units, extent, path))
                    self.report.stamps.append(
                        f"{class_name(self.ob.operator, units, extent)}: {VARIANTS} variants captured and this call differs "
                        f"from each ({why}): runs the stock code from here; pass a value that changes every call as a "
                        "tensor, or declare the counter's regime in the binding (`OperatorBinding.regimes`)"
                    )
                return self._stock(roots, inputs, "variants" if path == "signature" else f"guard:{path}")
            cls = self.classes[key] = capture_class(
                self, roots, staged, state, call, modes, hosts.as_dict(), counted, guards, len(variants)
            )
        if cls.refused is not None:
            return self._stock(roots, inputs, "refused")
        if cls.verify_left > 0 or unseen_value(self, cls, hosts, roots):
            return verify_class(self, cls, roots, inputs, staged, state, hosts.as_dict())
        if cls.graph is None or cls.effects is None:
            raise RuntimeError(f"{cls.name}: run before its verification recorded its graph and effects")
        self._current = cls
        # The class's name keys the engine's call: each class its own graphs, whatever its signature.
        outputs, new_state = self.replay(staged, state, modes, cls.name) if self.replay is not None else cls.graph(staged, state)
        self.counters.graph_calls += 1
        cls.calls += 1
        commit_state(self, places, new_state, state)
        # Found all at once where no counter lies under another; else each after the writes before
        # it (a value set may replace the object another counter is in).
        wheres = cls.effect_places.at(roots) if cls.effect_places is not None else None
        for i, (path, (kind, value)) in enumerate(cls.effects.items()):
            where = place(roots, path) if wheres is None else wheres[i]
            # each call its own copy of a value set, never one object shared by every stream
            where.set(where.get() + value if kind == "add" else copy.deepcopy(value))
        return self._rebuild(cls, outputs, roots)

    def _arguments(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The call's arguments by name, extra keywords (a method's ``**kwargs``) flattened in."""
        arguments = {}
        for name, value in self.signature.bind(*args, **kwargs).arguments.items():
            kind = self.signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                arguments.update(value)
            elif kind is inspect.Parameter.VAR_POSITIONAL:
                if value:
                    raise TypeError(
                        f"{self.ob.operator}: {len(value)} extra positional argument(s) for *{name}: "
                        f"a bound call names its arguments; pass them by keyword"
                    )
            else:
                arguments[name] = value
        return arguments

    def _device(self) -> torch.device:
        if not isinstance(self.model, torch.nn.Module):
            return torch.device("cpu")
        first = next(itertools.chain(self.model.parameters(), self.model.buffers()), None)
        return torch.device("cpu") if first is None else first.device

    def _modes(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """The binding's modes as this call finds them, by path (read, never traced: a path at
        ``self`` reads the model without making it a root of the call's state)."""
        modes = {}
        for path in self.ob.modes:
            value = get_path({SELF: self.model, **arguments}, path)
            if not isinstance(value, (bool, int, float, str, type(None))):
                raise TypeError(
                    f"{self.ob.operator}: mode {path!r} is {type(value).__name__}; a mode is a host value "
                    "(bool, int, float, str or None) that chooses what the call computes"
                )
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

    def _catalog_class(self, units: int, extent: int | None) -> CatalogClass | None:
        for call in self.op_catalog.classes:
            if call.call == units and call.extent == extent:
                return call
        return None

    def _stock_call(self, roots, inputs):
        with torch.no_grad():
            return self.method(**inputs, **root_arguments(roots))

    def _stock(self, roots, inputs, reason: str, detail: str | None = None) -> Any:
        """Fail closed: the stock call on the state as it is (nothing copied), its retained state
        then taken into the carries. `detail` is said once in the report."""
        if detail is not None and reason not in self.counters.stock_by_reason:
            self.report.stamps.append(f"{self.ob.operator}: runs the stock code ({reason}): {detail}")
        out = self._stock_call(roots, inputs)
        if self.sites and all(roots[name] is not None for name in roots):
            for site, where in zip(self.sites, site_places(self).at(roots)):
                value = where.get()
                if (
                    site.out is None
                    and value is not None
                    and (site.region is None or site_shape_error(self, site, value) is None)
                ):
                    carry_view(self, where, site, value)
        self.counters.fallback(reason)
        return out

    def _rebuild(self, cls: OperatorClass, tensors: list, roots: dict[str, Any]) -> Any:
        if cls.outputs is None:
            raise RuntimeError(f"{cls.name}: its output structure was never recorded (a class is verified first)")
        spec, others = cls.outputs
        leaves, it = [], iter(tensors)
        for i in range(spec.num_leaves):
            if i in others:
                kind, value = others[i]
                leaves.append(roots[value] if kind == "root" else value)
            else:
                leaves.append(next(it))
        return pytree.tree_unflatten(leaves, spec)

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
