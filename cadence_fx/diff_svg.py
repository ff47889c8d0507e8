"""The report page's graph drawings: for one graph before and after the transform, which nodes it
removed, added or rewired, which hold a carry and which are retention sites, and which site each
rewritten node implements (`graph_marks`); the rewritten nodes and their direct neighbours
(`focus_subgraph`), drawn top to bottom as inline SVG (`draw_svg`, laid out by networkx).

`cadence_fx.diff_page` puts the drawings on the page, beside its tables.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass

import networkx
import torch
import torch.fx
from torch.utils import _pytree as pytree

from .diff import as_networkx, node_line, node_op

__all__ = ["Marks", "anchor", "draw_svg", "focus_subgraph", "graph_marks"]


@dataclass(frozen=True)
class Marks:
    """One side (before or after) of one graph: marks and site links per node name."""

    marks: dict[str, tuple[str, ...]]  # node -> of "removed", "added", "changed", "carry", "site"
    links: dict[str, str]  # node -> anchor of the retention site it belongs to


def anchor(*parts: str) -> str:
    """An HTML id from names that may hold brackets or '=' (``encoder_chunk[L=0]``), one-to-one."""
    return "-".join(re.sub(r"[^A-Za-z0-9_]", lambda m: f".{ord(m.group()):x}", p) for p in parts)


def _resolve(gm: torch.fx.GraphModule, target: str) -> object:
    """What a get_attr `target` names on `gm` (None where nothing is)."""
    held: object = gm
    for part in target.split("."):
        held = getattr(held, part, None)
    return held


def _carry_nodes(gm: torch.fx.GraphModule, carries: dict) -> dict[str, str]:
    """The get_attr nodes of `gm` that hold a carry of the report (or a view of one, as a
    per-site window carry is): node name -> region."""
    storages = {c.buffer.untyped_storage().data_ptr(): region for region, c in carries.items()}
    found = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        held = _resolve(gm, node.target)
        buffer = getattr(held, "buffer", None) if isinstance(held, torch.nn.Module) else None
        if isinstance(buffer, torch.Tensor):
            region = storages.get(buffer.untyped_storage().data_ptr())
            if region is not None:
                found[node.name] = region
    return found


def _output_leaves(gm: torch.fx.GraphModule) -> list:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    return pytree.tree_leaves(output.args)


def graph_marks(
    name: str, before: torch.fx.GraphModule, after: torch.fx.GraphModule, sites: list, carries: dict
) -> tuple[Marks, Marks]:
    """Removed, added and changed nodes (a changed node prints differently: new arguments, a new
    shape), the carry nodes, the site nodes, and which site each rewritten node implements.

    A rewritten site's retention output sits at one position of the step's outputs; in the
    rewritten graph the same position holds the op that writes the carry, whose first argument is
    the carry: that op, the carry and every op on the carry belong to the site."""
    lines_before = {n.name: node_line(n) for n in before.graph.nodes}
    lines_after = {n.name: node_line(n) for n in after.graph.nodes}
    carry_nodes = _carry_nodes(after, carries)
    after_nodes = {n.name: n for n in after.graph.nodes}
    leaves_before, leaves_after = _output_leaves(before), _output_leaves(after)
    links_before: dict[str, str] = {}
    links_after: dict[str, str] = {}
    site_nodes = set()
    for site in sites:
        if site.graph != name:
            continue
        target = anchor("site", site.graph, site.node)
        site_nodes.add(site.node)
        links_before.setdefault(site.node, target)
        if site.node in after_nodes:
            links_after.setdefault(site.node, target)
        positions = [i for i, leaf in enumerate(leaves_before) if isinstance(leaf, torch.fx.Node) and leaf.name == site.node]
        if not site.rewritten or not positions or len(leaves_before) != len(leaves_after):
            continue
        kept = leaves_after[positions[0]]
        carry = kept.args[0] if isinstance(kept, torch.fx.Node) and kept.args else None
        if isinstance(carry, torch.fx.Node) and carry.name in carry_nodes:
            links_after[kept.name] = target
            links_after[carry.name] = target
            for user in carry.users:
                links_after.setdefault(user.name, target)

    def side(lines: dict[str, str], other: dict[str, str], gone: str, carries: set[str], links: dict[str, str]) -> Marks:
        marks = {}
        for node, line in lines.items():
            found = [gone] if node not in other else ["changed"] if other[node] != line else []
            found += ["carry"] * (node in carries) + ["site"] * (node in site_nodes)
            if found:
                marks[node] = tuple(found)
        return Marks(marks, links)

    return (
        side(lines_before, lines_after, "removed", set(), links_before),
        side(lines_after, lines_before, "added", set(carry_nodes), links_after),
    )


# ---------------------------------------------------------------------------------------------
# Drawing

_BOX_W, _BOX_H, _COLUMN, _ROW, _MARGIN = 196, 38, 212, 66, 12
_LABEL = 30  # characters that fit in a box at the page's font size


def _clip(text: str) -> str:
    return text if len(text) <= _LABEL else text[: _LABEL - 1] + "\u2026"


def focus_subgraph(gm: torch.fx.GraphModule, focus: set[str]) -> list[str]:
    """The focus nodes and their direct neighbours, in graph order."""
    keep = set(focus)
    for node in gm.graph.nodes:
        if node.name in focus:
            keep.update(n.name for n in node.all_input_nodes)
            keep.update(n.name for n in node.users)
    return [n.name for n in gm.graph.nodes if n.name in keep]


def _untangle(graph: networkx.DiGraph, layers: dict[int, list[str]]) -> None:
    """Fewer crossing edges: each layer ordered by the mean position of its inputs in the layer
    above (the barycenter heuristic), then the first layer by the mean position of its users."""

    def by_mean(layer: list[str], neighbours, placed: dict[str, int]) -> list[str]:
        def key(name: str) -> tuple[float, int]:
            ranks = [placed[n] for n in neighbours(name) if n in placed]
            return (sum(ranks) / len(ranks) if ranks else float("inf"), layer.index(name))

        return sorted(layer, key=key)

    depths = sorted(layers)
    for above, depth in zip(depths, depths[1:]):
        placed = {n: i for i, n in enumerate(layers[above])}
        layers[depth] = by_mean(layers[depth], graph.predecessors, placed)
    if len(depths) > 1:
        placed = {n: i for i, n in enumerate(layers[depths[1]])}
        layers[depths[0]] = by_mean(layers[depths[0]], graph.successors, placed)


def draw_svg(gm: torch.fx.GraphModule, names: list[str], side: Marks, svg_id: str) -> str:
    """The subgraph on `names`, top to bottom: each node one row below its deepest input."""
    graph = as_networkx(gm).subgraph(names)
    lines = {n.name: node_line(n) for n in gm.graph.nodes}
    ops = {n.name: node_op(n) for n in gm.graph.nodes}
    depth: dict[str, int] = {}
    layers: dict[int, list[str]] = {}
    for name in names:  # graph order is a topological order
        depth[name] = max((depth[p] + 1 for p in graph.predecessors(name)), default=0)
        layers.setdefault(depth[name], []).append(name)
    _untangle(graph, layers)
    pos = networkx.multipartite_layout(graph, subset_key=layers, align="horizontal")
    # The layout rescales unit steps between layers and between neighbours to one common length.
    rows = sorted({round(float(p[1]), 9) for p in pos.values()})
    columns = sorted({round(float(p[0]), 9) for p in pos.values()})
    unit = rows[1] - rows[0] if len(rows) > 1 else columns[1] - columns[0] if len(columns) > 1 else 1.0
    left, top = columns[0], rows[0]
    xy = {
        n: (_MARGIN + (float(p[0]) - left) / unit * _COLUMN, _MARGIN + (float(p[1]) - top) / unit * _ROW) for n, p in pos.items()
    }
    width = max(x for x, _ in xy.values()) + _BOX_W + _MARGIN
    height = max(y for _, y in xy.values()) + _BOX_H + _MARGIN
    out = [
        f'<svg id="{svg_id}" class="graph" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" role="img">',
        f'<defs><marker id="{svg_id}-arrow" viewBox="0 0 8 8" refX="8" refY="4" markerWidth="7" markerHeight="7" '
        'orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="#777"/></marker></defs>',
    ]
    for a, b in graph.edges:
        x1, y1 = xy[a][0] + _BOX_W / 2, xy[a][1] + _BOX_H
        x2, y2 = xy[b][0] + _BOX_W / 2, xy[b][1]
        bend = (y2 - y1) / 2
        out.append(
            f'<path class="edge" d="M{x1:.1f},{y1:.1f} C{x1:.1f},{y1 + bend:.1f} {x2:.1f},{y2 - bend:.1f} '
            f'{x2:.1f},{y2:.1f}" marker-end="url(#{svg_id}-arrow)"/>'
        )
    for name in names:
        x, y = xy[name]
        marks = side.marks.get(name, ())
        box = (
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{_BOX_W}" height="{_BOX_H}" rx="5"/>'
            f'<text x="{x + 6:.1f}" y="{y + 15:.1f}" class="name">{html.escape(_clip(name))}</text>'
            f'<text x="{x + 6:.1f}" y="{y + 30:.1f}">{html.escape(_clip(ops[name]))}</text>'
        )
        if name in side.links:
            box = f'<a href="#{side.links[name]}">{box}</a>'
        out.append(
            f'<g class="{" ".join(("node", *marks))}" data-node="{html.escape(name)}">'
            f"<title>{html.escape(lines[name])}</title>{box}</g>"
        )
    out.append("</svg>")
    return "".join(out)
