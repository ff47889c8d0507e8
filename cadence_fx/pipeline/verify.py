"""Stage 4, verify: the exported step and the stock call must run the same ATen program, the
stock call must repeat itself, and the rewritten graph must give the stock call's outputs,
retained state and host values bit for bit; else the class is refused, naming why."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree

from ..binding import (
    SELF,
    Places,
    get_path,
    method_of,
    place,
    set_path,
)
from ..determinism import RngState
from ..guards import host_values
from ..program import OpTrace, first_difference
from .guard import spanned_values
from .records import OperatorClass
from .state import carry_view, clone_site, commit_state, counter_paths, host_counter_paths, site_places
from .step import caller_trimmed, output_structure, private_roots, root_arguments, state_after

if TYPE_CHECKING:
    from .operator import BoundOperator


def bitwise_difference(a: Any, b: Any, names: tuple[str, ...] = ()) -> str | None:
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


def program_hint(cls: OperatorClass, hosts: dict[str, Any], counters: list[str]) -> str:
    """What to change when the programs differ."""
    moving = [p for p in counters if p in hosts and hosts[p] != cls.hosts.get(p)]
    if moving:
        return (
            f"the class was captured at {', '.join(f'{p}={cls.hosts[p]!r}' for p in moving)} and this call has "
            f"{', '.join(f'{p}={hosts[p]!r}' for p in moving)}: the computation reads the counter beyond its "
            "declared regime; declare a regime that keeps these values apart, or pass the value as a tensor"
        )
    return (
        "the export took another code path than the stock call (a model that branches on whether it is being "
        "traced); an attention implementation that does not (`eager`) or the stock path's own inputs avoid it"
    )


def verify_class(op: BoundOperator, cls: OperatorClass, roots, inputs, staged, state, hosts: dict[str, Any]) -> Any:
    """The program first, then the values. The exported step and the stock call (on a private
    copy of the state objects) run under `OpTrace`, on the caller's inputs and on clones of
    the same state, the RNG rewound between them: they must run the same ATen program
    (`cadence_fx.program`), and, being the same program on the same inputs, give the same
    bits (else the stock call does not repeat itself). Then the stock call runs untraced on
    the stream's own state objects, and the rewritten graph (on the staged inputs, on the
    carries) must give its outputs, retained state and host values bit for bit."""
    if cls.exported is None or cls.graph is None:
        raise RuntimeError(f"{cls.name}: verified before its step was exported and rewritten")
    counters_before = {p: get_path(roots, p) for p in host_counter_paths(op, roots)}
    hosts_before = host_values(root_arguments(roots))
    spanned = spanned_values(op, cls, hosts, roots)
    originals = [get_path(roots, s.path) for s in op.sites]
    rng = RngState.capture()
    with OpTrace() as graph_trace:
        exported = cls.exported(inputs, [clone_site(op, site, value) for site, value in zip(op.sites, state)])
    rng.restore()
    # The stock call's program, traced on a private copy of the state objects (its host values
    # move there, not on the stream's): a dispatch mode may change which kernel an op picks
    # (SDPA's backend on CUDA), so the values are the untraced stock call's, below.
    at_sites = [get_path(roots, site.path) for site in op.sites]
    private = private_roots(roots, [v for v in (*state, *at_sites) if isinstance(v, torch.Tensor)])
    for site, value in zip(op.sites, state):
        set_path(private, site.path, clone_site(op, site, value))
    method = method_of(private[SELF], op.ob.method) if SELF in private else op.method
    with torch.no_grad(), OpTrace() as stock_trace:
        traced = caller_trimmed(method(**inputs, **root_arguments(private)), op.sites, op.trims)
    traced = (
        [x for x in output_structure(traced, private)[0] if isinstance(x, torch.Tensor)],
        state_after(op.sites, private, traced),
    )
    del private
    rng.restore()
    for site, value in zip(op.sites, state):
        set_path(roots, site.path, clone_site(op, site, value))
    expected = caller_trimmed(op._stock_call(roots, inputs), op.sites, op.trims)
    if cls.outputs is None:
        cls.outputs = output_structure(expected, roots)[1]
    expected_state = state_after(op.sites, roots, expected)
    # A host value the stock call moves that the binding leaves out (a cache's `is_initialized`)
    # is one no graph call would move: a later stock call would then read a stale value.
    hosts_after, declared = host_values(root_arguments(roots)), tuple(counter_paths(op, roots))
    moved = [
        f"{p} ({hosts_before.get(p)!r} -> {hosts_after.get(p)!r})"
        for p in sorted(hosts_before.keys() | hosts_after.keys())
        if hosts_before.get(p) != hosts_after.get(p) and not any(p == d or p.startswith(d + ".") for d in declared)
    ]
    effects = {}
    for path, before in counters_before.items():
        after = get_path(roots, path)
        # A value set is kept as a copy: the object itself (a dict of flags) is this stream's.
        effects[path] = (
            ("set", copy.deepcopy(after)) if isinstance(after, bool) or not isinstance(after, int) else ("add", after - before)
        )
    counters_after = {p: get_path(roots, p) for p in counters_before}
    rng.restore()
    for site, value, original in zip(op.sites, state, originals):
        set_path(roots, site.path, value if site.out is None else original)
    outputs, new_state = cls.graph(staged, state)
    op.counters.graph_calls += 1
    cls.calls += 1
    commit_state(op, site_places(op).at(roots), new_state, state)
    for path, value in counters_after.items():
        set_path(roots, path, value)
    actual = op._rebuild(cls, outputs, roots)
    stock_leaves = [x for x in output_structure(expected, roots)[0] if isinstance(x, torch.Tensor)]
    why = None
    program = first_difference(stock_trace.records, graph_trace.records)
    if program is not None:
        why = f"program: the exported step is not the program the stock call runs: {program}; " + program_hint(
            cls, hosts, host_counter_paths(op, roots)
        )
    if why is None:
        repeat = bitwise_difference(exported, traced, ("output", "state"))
        if repeat is not None:
            why = (
                f"the stock call does not repeat itself: the same program on the same inputs gave other bits "
                f"({repeat}); pin deterministic kernels (cadence_fx.determinism.pin_deterministic)"
            )
    if why is None:
        why = bitwise_difference((outputs, new_state), (stock_leaves, expected_state), ("output", "state"))
        if why is not None:
            why = f"the rewritten graph differs from the stock call: {why}"
    returned = output_structure(expected, roots)[1]
    if why is None and returned != cls.outputs:
        why = (
            f"the call returned host values {returned[1]}, an earlier call of the class returned "
            f"{cls.outputs[1]}: a graph would return the first ones every call"
        )
    if why is None and moved:
        why = (
            f"the stock call moved host values the binding does not declare: {', '.join(moved)}; a graph would "
            "not move them: bind them as the operator's counters"
        )
    if why is None and cls.effects is not None and cls.effects != effects:
        why = f"host counters moved {effects}, an earlier call of the class moved them {cls.effects}"
    if why is not None:
        cls.refused = f"verification: {why}"
        op.report.stamps.append(f"{cls.name}: refused, {cls.refused}")
        for site, value in zip(op.sites, expected_state):
            if site.out is None:
                where = place(roots, site.path)
                where.set(value)
                carry_view(op, where, site, value)
        for path, value in counters_after.items():
            set_path(roots, path, value)
        op.counters.fallback("verification")
        return expected
    cls.effects = effects
    nested = any(inner.startswith(outer + ".") for outer in effects for inner in effects)
    cls.effect_places = None if nested else Places(list(effects))
    cls.verify_left = max(cls.verify_left - 1, 0)
    cls.verified += 1
    if cls.spanning:
        cls.seen.add(spanned)
    op.counters.verified += 1
    return actual
