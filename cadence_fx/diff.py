"""What a transform did, for a person: the text diff of each graph for the terminal
(`render_text`), and what the transform saves: per class the host launches of a replayed call
against the operators an eager one dispatches (`launches`), per region the stock state's bytes
against its carry's (`region_memory`); `render_savings` prints both for the terminal. The HTML
page is `cadence_fx.diff_page.render_html`.
"""

from __future__ import annotations

import difflib
import operator
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import networkx
import torch
import torch.fx

from .catalog import Catalog
from .report import format_bytes, format_table
from .tracing import node_shape

if TYPE_CHECKING:
    from .transform import TransformReport

__all__ = [
    "GraphDiff",
    "Launches",
    "RegionMemory",
    "diff_graphs",
    "eager_dispatches",
    "launches",
    "readable",
    "region_memory",
    "render_savings",
    "render_text",
]


def node_op(node: torch.fx.Node) -> str:
    if node.op == "call_method":
        return f".{node.target}"
    if node.op == "call_function":
        if isinstance(node.target, torch._ops.OpOverload):  # aten.cat.default -> cat
            return node.target._schema.name.split("::")[-1]
        return getattr(node.target, "__name__", str(node.target)).split(".")[-1]
    if node.op == "call_module":
        return f"module {node.target}"
    if node.op == "get_attr":
        return f"attr {node.target}"
    return node.op


def node_line(node: torch.fx.Node) -> str:
    """`name = op(args)  # shape`, runnable-looking, the shape from the capture."""
    args = ", ".join([_arg(a) for a in node.args] + [f"{k}={_arg(v)}" for k, v in node.kwargs.items()])
    shape = node_shape(node)
    if node.op == "placeholder":
        text = f"{node.name}: input"
    elif node.op == "output":
        text = f"return {args}"
    else:
        text = f"{node.name} = {node_op(node)}({args})"
    return text + (f"  # {shape}" if shape else "")


def readable(gm: torch.fx.GraphModule) -> list[str]:
    """One line per node, in graph order."""
    return [node_line(node) for node in gm.graph.nodes]


def _arg(arg) -> str:
    if isinstance(arg, torch.fx.Node):
        return arg.name
    if isinstance(arg, (list, tuple)):
        inner = ", ".join(_arg(a) for a in arg)
        return f"[{inner}]" if isinstance(arg, list) else f"({inner})"
    if isinstance(arg, slice):
        return f"{'' if arg.start is None else arg.start}:{'' if arg.stop is None else arg.stop}"
    return repr(arg)


def as_networkx(gm: torch.fx.GraphModule) -> networkx.DiGraph:
    graph: networkx.DiGraph[str] = networkx.DiGraph()
    for node in gm.graph.nodes:
        graph.add_node(node.name, op=node_op(node))
        for user in node.users:
            graph.add_edge(node.name, user.name)
    return graph


@dataclass(frozen=True)
class GraphDiff:
    name: str
    before: list[str]
    after: list[str]
    removed: Counter  # op -> count of nodes gone
    added: Counter  # op -> count of nodes new
    summary: dict  # networkx: nodes, edges, critical path length, before and after

    @property
    def changed(self) -> bool:
        return bool(self.removed or self.added) or self.before != self.after


def _structure(gm: torch.fx.GraphModule) -> dict:
    graph = as_networkx(gm)
    return {
        "nodes": graph.number_of_nodes(),
        "edges": graph.number_of_edges(),
        "critical_path": networkx.dag_longest_path_length(graph),
    }


def diff_graphs(name: str, before: torch.fx.GraphModule, after: torch.fx.GraphModule) -> GraphDiff:
    ops_before = Counter(node_op(n) for n in before.graph.nodes)
    ops_after = Counter(node_op(n) for n in after.graph.nodes)
    return GraphDiff(
        name,
        readable(before),
        readable(after),
        ops_before - ops_after,
        ops_after - ops_before,
        {"before": _structure(before), "after": _structure(after)},
    )


def summary_lines(d: GraphDiff) -> list[str]:
    removed = ", ".join(f"{op} x{n}" for op, n in sorted(d.removed.items())) or "none"
    added = ", ".join(f"{op} x{n}" for op, n in sorted(d.added.items())) or "none"
    b, a = d.summary["before"], d.summary["after"]
    return [
        f"removed nodes: {removed}",
        f"added nodes:   {added}",
        f"structure (networkx): nodes {b['nodes']} -> {a['nodes']}, edges {b['edges']} -> {a['edges']}, "
        f"critical path {b['critical_path']} -> {a['critical_path']}",
    ]


def render_text(diffs: list[GraphDiff], *, context: int = 2) -> str:
    out = []
    for d in diffs:
        out.append(f"=== {d.name} ===")
        out.extend(summary_lines(d))
        lines = list(difflib.unified_diff(d.before, d.after, "before", "after", n=context, lineterm=""))
        out.extend(lines if lines else ["(graphs print identically)"])
        out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# What the transform saves: host launches per replayed class, bytes per region


def eager_dispatches(gm: torch.fx.GraphModule) -> int:
    """The operators one eager run of `gm` dispatches from the host: its call nodes, except
    `operator.getitem` (a tuple index) and torch.export's input guard `_guards_fn` (a Python
    check). A carry write (`window_append`, ...) counts once, though it issues its own copies."""
    return sum(
        1
        for n in gm.graph.nodes
        if n.op in ("call_function", "call_method", "call_module")
        and n.target is not operator.getitem
        and not (n.op == "call_module" and n.target == "_guards_fn")
    )


@dataclass(frozen=True)
class Launches:
    """What one call of a captured class costs the host, eager against replayed.

    `eager`: `eager_dispatches` of the class's rewritten graph, the callable the replay engine
    captures (None where that callable is none of the report's graphs). A replayed call launches
    `graphs` CUDA graphs (one per captured segment), runs the `cuts` operators eagerly between
    them, copies each of the `staged` arguments into the graph's static inputs and each of the
    `written_back` ones out again; an output clone (`output_rule="clone"`) is not counted.
    `captured` is False where no graph was captured (`status` says why): every call ran eagerly."""

    shape_class: str
    eager: int | None
    status: str
    captured: bool = False
    graphs: int = 0
    cuts: int = 0
    staged: int = 0
    written_back: int = 0

    @property
    def replay(self) -> int | None:
        return self.graphs + self.cuts + self.staged + self.written_back if self.captured else None

    @property
    def saved(self) -> int | None:
        return None if self.eager is None or self.replay is None else self.eager - self.replay


def launches(report: TransformReport) -> list[Launches]:
    """Per class: each replay engine's certified classes, then the classes of a bound operator
    (`transform(model, contract, binding)`) that have not reached its engine, or have none."""
    found: dict[str, Launches] = {}
    for engine in report.replays.values():
        for name, cert in engine.certificates.items():
            graph = report.graphs.get(name)
            found[name] = Launches(
                name,
                None if graph is None else eager_dispatches(graph[1]),
                cert.reason,
                cert.captured,
                cert.segments,
                sum(c.count for c in cert.cuts),
                len(cert.copied),
                len(cert.written_back),
            )
    for op in report.operators.values():
        for cls in op.classes.values():
            if cls.name in found:
                continue
            if cls.refused is not None:
                status = f"refused: {cls.refused}"
            elif op.replay is None:
                status = "no replay engine in this transform (replay off, or under audit): runs its graph eagerly"
            elif cls.verify_left > 0:
                status = f"being verified against the stock call: replays after {cls.verify_left} more visit(s)"
            else:
                status = "verified; not called since"
            found[cls.name] = Launches(cls.name, None if cls.graph is None else eager_dispatches(cls.graph), status)
    return list(found.values())


@dataclass(frozen=True)
class RegionMemory:
    """One region's bytes before and after. `stock`: what the stock code holds for it, as the
    transform recorded the stock state it replaced (`report.resizes`), else the envelope the
    contract declares, else None; `source` says which. `carry`: the bytes of the region's carry."""

    region: str
    stock: int | None
    source: str
    carry: int | None

    @property
    def saved(self) -> int | None:
        return None if self.stock is None or self.carry is None else self.stock - self.carry


def region_memory(report: TransformReport, catalog: Catalog) -> list[RegionMemory]:
    out = []
    for r in catalog.regions:
        measured = [z.stock_bytes for z in report.resizes if z.region == r.name]
        if measured:
            stock, source = sum(measured), "the stock state the transform replaced"
        elif r.stock_bytes is not None:
            stock, source = r.stock_bytes, "the contract's stock envelope"
        else:
            stock, source = None, "not declared"
        carry = report.carries.get(r.name)
        out.append(
            RegionMemory(r.name, stock, source, None if carry is None else carry.buffer.numel() * carry.buffer.element_size())
        )
    return out


def count_or_dash(n: int | None) -> str:
    return "-" if n is None else str(n)


def bytes_or_dash(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def render_savings(report: TransformReport, catalog: Catalog) -> str:
    """`launches` and `region_memory` as two text tables, for the terminal."""
    rows = [
        [
            x.shape_class,
            count_or_dash(x.eager),
            count_or_dash(x.replay),
            count_or_dash(x.saved),
            "replayed" if x.captured else x.status,
        ]
        for x in launches(report)
    ]
    memory = [
        [m.region, bytes_or_dash(m.stock), m.source, bytes_or_dash(m.carry), bytes_or_dash(m.saved)]
        for m in region_memory(report, catalog)
    ]
    return "\n".join(
        [
            "host launches per call (eager: operator dispatches of the class's graph; replay: graph launches, cut "
            "operators, staging and write-back copies)",
            format_table(["class", "eager", "replay", "saved", "status"], rows) if rows else "(no class has been called)",
            "",
            "memory per region",
            format_table(["region", "stock", "stock from", "carry", "saved"], memory),
        ]
    )


# ---------------------------------------------------------------------------------------------
# What the page marks in one graph
