"""Stage 3, retention rewrite: each site of an exported step onto its carry (the window pass
for concat-then-trim retention; nothing for a region of one fixed extent, written in place)."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree

from ..binding import (
    Site,
)
from ..catalog import CatalogClass
from ..contract import DTYPES, carry_axis, fixed_extent
from ..passes.carry import RetentionSite
from ..passes.state import Resize
from ..passes.window import Window, WindowError, rewrite_windows
from .records import OperatorClass
from .state import site_shape_error
from .step import writes_in_place

if TYPE_CHECKING:
    from .operator import BoundOperator


def viewed_base(node: Any) -> Any:
    """The tensor `node` is a view of (through view ops: select, slice, view...), or `node` itself."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.args:
        schema = getattr(node.target, "_schema", None)
        if schema is None or schema.is_mutable or not schema.returns or schema.returns[0].alias_info is None:
            break
        node = node.args[0]
    return node


def ring_site(
    gm: torch.fx.GraphModule, graph: str, site: Site, region: str, axis: int, output: int, placeholder: str | None
) -> RetentionSite:
    """A ring region's site needs no rewrite when the step writes it in place (its output is its
    input, through in-place ops): the carry is then the ring, one address for the stream. A step
    that returns a new tensor instead still runs exact: its result is copied into the carry."""
    node = pytree.tree_leaves(next(n for n in gm.graph.nodes if n.op == "output").args)[output]
    leaf = node
    while writes_in_place(node) and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    if node.op == "placeholder" and node.name == placeholder:
        writes = [n for n in gm.graph.nodes if writes_in_place(n) and viewed_base(n.args[0]) is node]
        if not writes:  # another operator's ring, which this step only passes on
            return RetentionSite(
                graph,
                leaf.name,
                region,
                axis,
                "ring",
                False,
                f"{site.path}: not written by the step: passed through at its address",
            )
        writer = leaf if leaf is not node else writes[-1]
        return RetentionSite(
            graph,
            writer.name,
            region,
            axis,
            "ring",
            False,
            f"{site.path}: written in place by the step ({writer.name}): the carry is the ring, nothing to rewrite",
        )
    return RetentionSite(
        graph,
        leaf.name,
        region,
        axis,
        "ring",
        False,
        f"{site.path}: returned anew by the step ({leaf.name}): copied into its carry after every call",
    )


def rewrite_class(
    op: BoundOperator,
    cls: OperatorClass,
    gm: torch.fx.GraphModule,
    inputs,
    example,
    modes: dict[str, Any],
    call: CatalogClass,
    name: str,
    started: float,
) -> OperatorClass:
    """The exported step `gm` of class `cls`, its retention rewritten onto the carries."""
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    positions = {}
    for i, (path, _) in enumerate(pytree.tree_flatten_with_path(((inputs, example), {}))[0]):
        positions[pytree.keystr(path)] = placeholders[i]
    out_spec = gm._out_spec
    if out_spec is None:
        raise ValueError(f"{name}: the exported step has no output spec; an exported program's module always has one")
    out_leaves = pytree.tree_unflatten(list(range(out_spec.num_leaves)), out_spec)[1]
    returned = pytree.tree_leaves(next(n for n in gm.graph.nodes if n.op == "output").args)
    windows, rings = [], []
    for i, site in enumerate(op.sites):
        if site.region is None:  # a device-side counter: the step moves it in place, nothing to rewrite
            continue
        # A first call (no state yet) is where a wrong contract shape would first show, inside the graph.
        value = returned[out_leaves[i]].meta.get("val")
        error = site_shape_error(op, site, value) if isinstance(value, torch.Tensor) else None
        if error is not None:
            raise ValueError(f"{op.ob.operator}: after the call {error}")
        region, derived = op.contract.region(site.region), op.catalog.region(site.region)
        if fixed_extent(region.retention):
            axis = op.carries[site.path].axis
            rings.append(ring_site(gm, name, site, site.region, axis, out_leaves[i], positions.get(f"[0][1][{i}]")))
            continue
        retention = region.retention
        if retention is None:
            raise ValueError(f"region {site.region!r} declares no retention: nothing bounds its carry")
        keep = derived.kept()
        # Another region's extent is its own (a sliding window still filling beside a growing
        # cache): what this call brings, not its bound.
        retained = (
            call.extent
            if site.region == op.op.region
            else (0 if example[i] is None else example[i].shape[op.carries[site.path].axis])
        )
        windows.append(
            Window(
                site=site.path,
                region=site.region,
                output=out_leaves[i],
                input=None if example[i] is None else positions.get(f"[0][1][{i}]"),
                axis=op.carries[site.path].axis,
                keep=keep,
                # Each region advances by its own units: the operator's call on its own region,
                # another region's stride on that one (a downsampled path beside the main one).
                live=retained + (call.call if site.region == op.op.region else region.stride),
                held=region.holds_call,
                head=retention.head,
                copy=site.out is not None,
            )
        )
    grid = op.op_catalog.grid
    if grid is None:
        raise ValueError(f"{op.ob.operator}: its catalog enumerates no classes ({op.op_catalog.verdict}): nothing to rewrite")
    if call.extent == max(grid) and not call.flush:
        account_pinned(op, windows)
    try:
        after, found, stamp = rewrite_windows(gm, tuple(windows), op.carries, graph=name)
    except WindowError as error:
        cls.refused = f"retention rewrite: {error}"
        op.report.stamps.append(f"{name}: refused, {cls.refused}")
        return cls
    found = rings + found
    cls.graph = after
    cls.exported = gm
    cls.capture_ms = (time.perf_counter() - started) * 1e3
    op.report.sites.extend(found)
    op.report.graphs[name] = (gm, after)
    op.report.stamps.append(f"{stamp}; capture and rewrite of {name} took {cls.capture_ms:.0f} ms")
    return cls


def account_pinned(op: BoundOperator, windows: list[Window]) -> None:
    """The state rule's account, at the steady class: each stock retained slice is a view of its
    call's concat, so the stock code pins the whole operand (retained + new units) until the
    next call, against the carry's derived demand."""
    done = {r.region for r in op.report.resizes}
    for rb in op.regions:
        live = {w.live for w in windows if w.region == rb.region}
        if rb.region in done or len(live) != 1:
            continue
        region, derived = op.contract.region(rb.region), op.catalog.region(rb.region)
        shape, demand_bytes = derived.demand()
        stock = tuple(live.pop() if i == carry_axis(region) else d for i, d in enumerate(shape))
        op.report.resizes.append(
            Resize(
                " + ".join(rb.at),
                rb.region,
                stock,
                DTYPES[region.dtype].itemsize * math.prod(stock),
                shape,
                demand_bytes,
            )
        )
