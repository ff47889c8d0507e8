"""Before/after graph-diff report of a transform: readable code with shapes, node changes, and a
structural summary computed with networkx; text for the terminal, a self-contained HTML page."""

from __future__ import annotations

import difflib
import html
from collections import Counter
from dataclasses import dataclass

import networkx
import torch.fx

from .capture import node_shape

__all__ = ["GraphDiff", "diff_graphs", "render_html", "render_text", "readable"]


def _op(node: torch.fx.Node) -> str:
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


def readable(gm: torch.fx.GraphModule) -> list[str]:
    """One line per node: `name = op(args)  # shape`, runnable-looking, shapes from the capture."""
    lines = []
    for node in gm.graph.nodes:
        args = ", ".join([_arg(a) for a in node.args] + [f"{k}={_arg(v)}" for k, v in node.kwargs.items()])
        shape = node_shape(node)
        if node.op == "placeholder":
            text = f"{node.name}: input"
        elif node.op == "output":
            text = f"return {args}"
        else:
            text = f"{node.name} = {_op(node)}({args})"
        lines.append(text + (f"  # {shape}" if shape else ""))
    return lines


def _arg(arg) -> str:
    if isinstance(arg, torch.fx.Node):
        return arg.name
    if isinstance(arg, (list, tuple)):
        inner = ", ".join(_arg(a) for a in arg)
        return f"[{inner}]" if isinstance(arg, list) else f"({inner})"
    if isinstance(arg, slice):
        return f"{'' if arg.start is None else arg.start}:{'' if arg.stop is None else arg.stop}"
    return repr(arg)


def _networkx(gm: torch.fx.GraphModule) -> networkx.DiGraph:
    graph = networkx.DiGraph()
    for node in gm.graph.nodes:
        graph.add_node(node.name, op=_op(node))
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
    graph = _networkx(gm)
    return {
        "nodes": graph.number_of_nodes(),
        "edges": graph.number_of_edges(),
        "critical_path": networkx.dag_longest_path_length(graph),
    }


def diff_graphs(name: str, before: torch.fx.GraphModule, after: torch.fx.GraphModule) -> GraphDiff:
    ops_before = Counter(_op(n) for n in before.graph.nodes)
    ops_after = Counter(_op(n) for n in after.graph.nodes)
    return GraphDiff(
        name,
        readable(before),
        readable(after),
        ops_before - ops_after,
        ops_after - ops_before,
        {"before": _structure(before), "after": _structure(after)},
    )


def render_text(diffs: list[GraphDiff], *, context: int = 2) -> str:
    out = []
    for d in diffs:
        out.append(f"=== {d.name} ===")
        removed = ", ".join(f"{op} x{n}" for op, n in sorted(d.removed.items())) or "none"
        added = ", ".join(f"{op} x{n}" for op, n in sorted(d.added.items())) or "none"
        b, a = d.summary["before"], d.summary["after"]
        out.append(f"removed nodes: {removed}")
        out.append(f"added nodes:   {added}")
        out.append(
            f"structure (networkx): nodes {b['nodes']} -> {a['nodes']}, edges {b['edges']} -> {a['edges']}, "
            f"critical path {b['critical_path']} -> {a['critical_path']}"
        )
        lines = list(difflib.unified_diff(d.before, d.after, "before", "after", n=context, lineterm=""))
        out.extend(lines if lines else ["(graphs print identically)"])
        out.append("")
    return "\n".join(out)


def render_html(diffs: list[GraphDiff], title: str) -> str:
    table = difflib.HtmlDiff(wrapcolumn=110)
    sections = []
    for d in diffs:
        b, a = d.summary["before"], d.summary["after"]
        sections.append(
            f"<h2>{html.escape(d.name)}</h2><p>removed: {html.escape(str(dict(d.removed)))}; added: "
            f"{html.escape(str(dict(d.added)))}; nodes {b['nodes']} &rarr; {a['nodes']}, critical path "
            f"{b['critical_path']} &rarr; {a['critical_path']}</p>"
            + table.make_table(d.before, d.after, "before", "after", context=True, numlines=2)
        )
    style = (
        "body{font-family:sans-serif} table.diff{font-family:monospace;font-size:12px;border:1px solid #ccc}"
        ".diff_add{background:#cfc}.diff_chg{background:#ffa}.diff_sub{background:#fbb}"
    )
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{style}</style></head><body><h1>{html.escape(title)}</h1>{''.join(sections)}</body></html>"
    )
