"""The transform report as one self-contained HTML page (`render_html`), built from the
`TransformReport` and the `Catalog` alone, so it serves any model the transform accepts.

It tabulates the regions (stock against demand), the carries, the sites, the catalog classes with
their replay signatures, each class's certificate, the counters, and what the transform saves
(`cadence_fx.diff`: `launches`, `region_memory`); beside them, each graph's rewritten subgraph
before and after, its removed, added and rewired nodes and its carries marked, every rewritten node
and carry linked to the retention site it implements (`cadence_fx.diff_svg` draws them).
"""

from __future__ import annotations

import difflib
import html
from typing import TYPE_CHECKING

from .catalog import Catalog
from .diff import (
    bytes_or_dash,
    count_or_dash,
    diff_graphs,
    launches,
    region_memory,
    summary_lines,
)
from .diff_svg import anchor, draw_svg, focus_subgraph, graph_marks
from .report import format_bytes

if TYPE_CHECKING:
    from .replay import Certificate, ExactShapeReplay
    from .transform import TransformReport

__all__ = ["render_html"]


def _e(value) -> str:
    return html.escape(str(value))


def _shape(shape) -> str:
    return "-" if shape is None else "x".join(map(str, shape))


def _table(header: list[str], rows: list[tuple[dict[str, str], list[str]]], css: str = "") -> str:
    """Cells are HTML already; each row comes with its attributes (id, data-*)."""
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = []
    for attrs, cells in rows:
        attributes = "".join(f' {k}="{_e(v)}"' for k, v in attrs.items())
        body.append(f"<tr{attributes}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return f'<table class="{css}"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def _link(kind: str, name: str) -> str:
    return f'<a href="#{anchor(kind, name)}">{_e(name)}</a>'


def _regions(report: TransformReport, catalog: Catalog) -> str:
    rows = []
    for r in catalog.regions:
        rows.append(
            (
                {"id": anchor("region", r.name), "data-region": r.name},
                [
                    f"<b>{_e(r.name)}</b>",
                    _e(r.dtype),
                    _e(r.retained),
                    _e(r.lower),
                    "unbounded" if r.bound is None else _e(r.bound),
                    _e(_shape(r.stock_shape)),
                    _e(format_bytes(r.stock_bytes)),
                    _e(_shape(r.shape)),
                    _e(format_bytes(r.bytes)),
                    "-" if r.rho is None else f"{float(r.rho):.2f}",
                ],
            )
        )
    derived = _table(
        ["region", "dtype", "retained r(t)", "A-", "A", "stock shape", "stock", "demand shape", "demand", "rho"], rows
    )
    resized = _table(
        ["buffer", "region", "stock shape", "stock", "demand shape", "demand", "stock / demand"],
        [
            (
                {"data-buffer": z.path},
                [
                    _e(z.path),
                    _link("region", z.region),
                    _e(_shape(z.stock_shape)),
                    _e(format_bytes(z.stock_bytes)),
                    _e(_shape(z.demand_shape)),
                    _e(format_bytes(z.demand_bytes)),
                    f"{z.stock_bytes / z.demand_bytes:.2f}" if z.demand_bytes else "-",
                ],
            )
            for z in report.resizes
        ],
    )
    before = sum(z.stock_bytes for z in report.resizes)
    after = sum(z.demand_bytes for z in report.resizes)
    carries = _table(
        ["carry of region", "shape", "bytes", "address", "writes"],
        [
            (
                {"id": anchor("carry", region), "data-carry": region},
                [
                    _link("region", region),
                    _e(_shape(tuple(c.buffer.shape))),
                    _e(format_bytes(c.buffer.numel() * c.buffer.element_size())),
                    f"{c.address:#x}",
                    _e(c.writes),
                ],
            )
            for region, c in report.carries.items()
        ],
    )
    return (
        "<h2>Regions</h2><p>Derived from the contract alone: the extent each region retains after t calls, "
        "its lower extent A- and its bound A, the shape and bytes the stock code provisions (where the contract "
        "declares it) against the demand at the bound, and their ratio rho.</p>"
        + derived
        + "<h3>State rule: what the stock model holds, and what it holds now</h3>"
        + resized
        + f"<p>Contract-managed state: <b>{_e(format_bytes(before))} &rarr; {_e(format_bytes(after))}</b>.</p>"
        + "<h3>Carries</h3><p>Each carry is one buffer at one address for the life of a stream; every retention "
        "writes into it in place.</p>" + carries
    )


def _sites(report: TransformReport, catalog: Catalog) -> str:
    rows = [
        (
            {"id": anchor("site", s.graph, s.node), "data-site": f"{s.graph}:{s.node}"},
            [
                f'<a href="#{anchor("graph", s.graph)}">{_e(s.graph)}</a>',
                f"<code>{_e(s.node)}</code>",
                _link("region", s.region) if s.region in {r.name for r in catalog.regions} else _e(s.region),
                _e(s.axis),
                _e(s.kind),
                "yes" if s.rewritten else "no",
                _e(s.reason),
            ],
        )
        for s in report.sites
    ]
    return (
        "<h2>Retention sites</h2><p>Every concatenation along a region's axis the passes found, and what they "
        "did with it.</p>" + _table(["graph", "node", "region", "axis", "kind", "rewritten", "why"], rows)
    )


def _graphs(report: TransformReport) -> str:
    sections = [
        "<h2>Graphs, before and after</h2><p>The rewritten subgraph: every node the transform removed "
        '(<span class="key removed">red</span>), added (<span class="key added">green</span>) or rewired '
        '(<span class="key changed">yellow</span>: new arguments or a new shape), every carry '
        '(<span class="key carry">blue</span>) and every retention site (<span class="key site">dashed</span>), '
        "with their direct neighbours. A rewritten node links to its retention site; hover for the "
        "node's line of code.</p>"
    ]
    for name, (before, after) in report.graphs.items():
        d = diff_graphs(name, before, after)
        marks_before, marks_after = graph_marks(name, before, after, report.sites, report.carries)
        focus_before, focus_after = set(marks_before.marks), set(marks_after.marks)
        text = "\n".join(difflib.unified_diff(d.before, d.after, "before", "after", n=2, lineterm=""))
        summary = "".join(f"<li>{_e(line)}</li>" for line in summary_lines(d))
        if focus_before or focus_after:
            drawings = (
                f"<figure><figcaption>before</figcaption>"
                f"{draw_svg(before, focus_subgraph(before, focus_before), marks_before, anchor('svg', name, 'before'))}</figure>"
                f"<figure><figcaption>after</figcaption>"
                f"{draw_svg(after, focus_subgraph(after, focus_after), marks_after, anchor('svg', name, 'after'))}</figure>"
            )
        else:
            drawings = "<p>Nothing in this graph was rewritten.</p>"
        sections.append(
            f'<section id="{anchor("graph", name)}" data-graph="{_e(name)}"><h3>{_e(name)}</h3><ul>{summary}</ul>'
            f"{drawings}<details><summary>the code, diffed</summary><pre>{_e(text or '(graphs print identically)')}"
            "</pre></details></section>"
        )
    return "".join(sections)


def _certificate(cert: Certificate) -> str:
    verdict = "admitted" if cert.admitted else "refused"
    if cert.captured:
        verdict += f", captured as {cert.segments} graph segment(s)"
    elif cert.admitted:
        verdict += ", not captured"
    rng = ", ".join(f"+{a}" for a in cert.device_rng_advance if a) or "none"
    facts = [
        ("verdict", verdict),
        ("why", cert.reason),
        ("checked", ", ".join(cert.checks)),
        ("aliased (passed by address)", ", ".join(cert.aliased) or "none"),
        ("copied (staged per call)", ", ".join(cert.copied) or "none"),
        ("written in place", ", ".join(cert.writes) or "none"),
        ("written back after replay", ", ".join(cert.written_back) or "none"),
        ("host RNG read", ", ".join(cert.host_rng) or "none"),
        ("device RNG Philox offset per call", rng),
        ("host constants hoisted", "; ".join(map(str, cert.host_constants)) or "none"),
        ("run eagerly between segments", "; ".join(map(str, cert.cuts)) or "none"),
    ]
    if cert.pool_reserved_bytes is not None:  # measured over the capture (CUDA only)
        facts.append(
            (
                "device memory of the capture",
                f"staged inputs {bytes_or_dash(cert.staged_bytes)} (the memory model's charge); graph pool grew "
                f"{bytes_or_dash(cert.pool_reserved_bytes)}; reserved grew {bytes_or_dash(cert.reserved_bytes)} "
                "over the whole capture phase",
            )
        )
    items = "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in facts)
    return f'<dl class="certificate {"admitted" if cert.admitted else "refused"}">{items}</dl>'


def _catalog(report: TransformReport, catalog: Catalog, stream: str | None) -> str:
    out = [
        f"<h2>Catalog</h2><p>Every call shape each hot operator can see, derived before any traffic "
        f"(budget {catalog.budget} classes per operator). Where the transform replays an operator, its replay "
        "engine holds one exact signature per class and writes a certificate when a class is first called: "
        "what it checked, which arguments it passes by address and which it copies, how far the device RNG "
        "moves. Without CUDA an admitted class runs eagerly (counted <code>no_cuda</code>) and no graph is "
        "captured.</p>"
    ]
    if stream is not None:
        out.append(f'<p class="note">Certificates and counters after a short stream: {_e(stream)}.</p>')
    if report.replays and not any(engine.counters.calls for engine in report.replays.values()):
        out.append(
            '<p class="note">No replayed operator has been called yet (no stream ran before this page was '
            "written): there are no certificates, and the counters are zero.</p>"
        )
    names = {op.name for op in catalog.operators}
    for op in catalog.operators:
        rows = [
            (
                {"data-class": f"{op.name}:{c.call}@{c.extent}{':flush' if c.flush else ''}"},
                [_e(c.call), _e(c.extent), "flush" if c.flush else "steady"],
            )
            for c in op.classes
        ]
        out.append(
            f'<section id="{anchor("operator", op.name)}" data-operator="{_e(op.name)}"><h3>{_e(op.name)}</h3>'
            f"<p>over region {_link('region', op.region)}; K = {_e('-' if op.width is None else op.width)}; "
            f"{_e(op.verdict)}</p>" + _table(["new units per call", "retained extent", "call"], rows)
        )
        engine = report.replays.get(op.name)
        out.append(_bound(report, op.name))
        out.append(_engine(engine) if engine is not None else "<p>No replay engine for this operator in this transform.</p>")
        out.append("</section>")
    for name, engine in report.replays.items():
        if name not in names:
            out.append(
                f'<section data-operator="{_e(name)}"><h3>{_e(name)} (replayed, not a catalog operator)</h3>'
                f"{_engine(engine)}</section>"
            )
    return "".join(out)


def _engine(engine: ExactShapeReplay) -> str:
    certificates = engine.certificates
    listed = {sc.name for sc in engine.shape_classes}
    rows = []
    for sc in engine.shape_classes:
        cert = certificates.get(sc.name)
        rows.append(
            (
                {"data-replay-class": sc.name},
                [
                    f"<b>{_e(sc.name)}</b>",
                    f"<code>{_e(sc.signature.describe())}</code>",
                    _certificate(cert) if cert else "no certificate: not called in this run",
                ],
            )
        )
    for name, cert in certificates.items():
        if name not in listed:
            rows.append(
                (
                    {"data-replay-class": name},
                    [f"<b>{_e(name)}</b>", f"<code>{_e(cert.signature.describe())}</code>", _certificate(cert)],
                )
            )
    counters = engine.counters.as_dict()
    fallbacks = ", ".join(f"{k} {v}" for k, v in counters["fallbacks"].items()) or "none"
    return (
        f"<h4>Replay: {_e(engine.name)}</h4>"
        + _table(["class", "signature", "certificate"], rows, "classes")
        + f'<p class="counters">calls {counters["calls"]}, captures {counters["captures"]}, replays '
        f"{counters['replays']}, eager {counters['eager']} (by reason: {_e(fallbacks)}), invalidations "
        f"{counters['invalidations']}</p>"
    )


def _savings(report: TransformReport, catalog: Catalog) -> str:
    rows = [
        (
            {"data-launches": f"{x.shape_class}:{count_or_dash(x.eager)}:{count_or_dash(x.replay)}:{count_or_dash(x.saved)}"},
            [
                f"<b>{_e(x.shape_class)}</b>",
                _e(count_or_dash(x.eager)),
                _e(
                    f"{x.replay} = {x.graphs} graph(s) + {x.cuts} cut operator(s) + {x.staged} staged + {x.written_back} "
                    "written back"
                )
                if x.captured
                else "-",
                _e(count_or_dash(x.saved)),
                _e("replayed" if x.captured else x.status),
            ],
        )
        for x in launches(report)
    ]
    memory = [
        (
            {"data-memory": f"{m.region}:{count_or_dash(m.stock)}:{count_or_dash(m.carry)}:{count_or_dash(m.saved)}"},
            [
                _link("region", m.region),
                _e(bytes_or_dash(m.stock)),
                _e(m.source),
                _e(bytes_or_dash(m.carry)),
                _e(bytes_or_dash(m.saved)),
            ],
        )
        for m in region_memory(report, catalog)
    ]
    launched = (
        _table(["class", "eager: operator dispatches", "replay: host launches", "saved", "status"], rows, "launches")
        if rows
        else "<p>No class has been called yet: nothing to count.</p>"
    )
    return (
        "<h2>What it saves</h2><h3>Host launches per call</h3><p>Eager: the operators one call of the class's "
        "rewritten graph dispatches from the host (its call nodes, less <code>getitem</code> and the export's "
        "input guard; a carry write counts once). Replay: what the host issues instead, from the class's "
        "certificate: one launch per captured graph segment, the operators cut between segments, one copy per "
        "staged argument and one per argument written back (an output clone is not counted). Saved is the "
        "difference, per call; a class that was not captured saves nothing.</p>"
        + launched
        + "<h3>Memory per region</h3><p>What the stock code holds for each region against the bytes of its "
        "carry. The device memory each captured class took (its staged inputs, and how much the graph pool and "
        "the reserved memory grew over its capture) is in its certificate, on a GPU.</p>"
        + _table(["region", "stock", "stock from", "carry", "saved"], memory, "memory")
    )


def _bound(report: TransformReport, name: str) -> str:
    """A bound operator's counters (`transform(model, contract, binding)`), if `name` is one."""
    op = report.operators.get(name)
    if op is None:
        return ""
    c = op.counters.as_dict()
    stock = ", ".join(f"{k} {v}" for k, v in c["stock_by_reason"].items()) or "none"
    return (
        f'<p class="counters" data-bound="{_e(name)}">bound operator: calls {c["calls"]}, rewritten-graph calls '
        f"{c['graph_calls']}, verified against the stock call {c['verified']}, stock calls {c['stock']} (by reason: "
        f"{_e(stock)}), states adopted into a carry {c['adopted']}</p>"
    )


def _audit(report: TransformReport) -> str:
    if report.auditor is None:
        return (
            "<h2>Shadow audit</h2><p>Not attached to this transform (<code>transform(..., audit=True)</code> "
            "runs the stock retention beside every carry write and compares elementwise).</p>"
        )
    counters = report.auditor.counters()
    addresses = ", ".join(f"{site}: {n}" for site, n in counters["distinct_carry_addresses"].items()) or "none yet"
    return (
        f"<h2>Shadow audit</h2><p>The stock retention, evaluated beside every carry write and compared "
        f"elementwise: {counters['retentions']} retentions checked, {counters['applications']} of them "
        f"evicting, <b>{counters['mismatches']} mismatches</b>. Distinct carry addresses per site: "
        f"{_e(addresses)}.</p>"
    )


_STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1em;font-size:13px}
th,td{border:1px solid #ccc;padding:3px 6px;text-align:left;vertical-align:top}
th{background:#f2f2f2} tr:target{background:#fff3c4}
code,pre{font-family:ui-monospace,monospace;font-size:12px} pre{background:#f7f7f7;padding:.5em;overflow:auto}
figure{margin:0 0 1em;overflow-x:auto}
figcaption{font-weight:bold;margin-bottom:.3em}
svg.graph{font-family:ui-monospace,monospace;font-size:11px;background:#fcfcfc;border:1px solid #ddd}
.edge{fill:none;stroke:#999;stroke-width:1.2}
.node rect{fill:#fff;stroke:#999}.node text.name{font-weight:bold}
.removed rect{fill:#fbc4c4}.added rect{fill:#c8efc8}.changed rect{fill:#fbe7a1}
.carry rect{fill:#a9d2f5;stroke:#1d5d99;stroke-width:2}.site rect{stroke:#c25e00;stroke-width:2;stroke-dasharray:5 3}
.key{padding:0 .3em;border:1px solid #999}.key.removed{background:#fbc4c4}.key.added{background:#c8efc8}
.key.changed{background:#fbe7a1}.key.carry{background:#a9d2f5}.key.site{border:2px dashed #c25e00}
dl.certificate{display:grid;grid-template-columns:max-content auto;gap:0 .8em;margin:0}
dl.certificate dt{color:#555} dl.certificate dd{margin:0} dl.refused dd:first-of-type{color:#b00;font-weight:bold}
.note{background:#eef4fb;border-left:4px solid #1d5d99;padding:.4em .8em}
"""


def render_html(
    report: TransformReport, catalog: Catalog, *, title: str | None = None, stream: str | None = None, device: str | None = None
) -> str:
    """The report page of one transform: `report` (a `TransformReport`) and the `catalog` it was
    derived under. `stream` says what ran through the transformed model before the page was
    written, if anything did (certificates are written on a class's first call); `device`, where
    the model ran.

    Self-contained: inline CSS and SVG, no script, no request to anywhere."""
    title = title or f"cadence-fx transform report: {report.family}"
    stamps = "".join(f"<li>{_e(s)}</li>" for s in report.stamps)
    rewritten = sum(s.rewritten for s in report.sites)
    determinism = ", ".join(f"{k}={v}" for k, v in report.determinism.items()) or "not recorded"
    body = (
        f"<h1>{_e(title)}</h1>"
        f"<p>{rewritten} of {len(report.sites)} retention sites rewritten onto {len(report.carries)} carries; "
        f"{len(report.resizes)} stock buffers resized to demand; {len(report.replays)} operators under "
        f"exact-shape replay.</p>"
        + (f'<p class="note" data-device="{_e(device)}">Built and run on <b>{_e(device)}</b>.</p>' if device else "")
        + f"<h2>What ran</h2><ul>{stamps}</ul>"
        f"<p>Kernel settings pinned for the run: <code>{_e(determinism)}</code></p>"
        + _regions(report, catalog)
        + _sites(report, catalog)
        + _graphs(report)
        + _catalog(report, catalog, stream)
        + _savings(report, catalog)
        + _audit(report)
    )
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
        f"<style>{_STYLE}</style></head><body>{body}</body></html>\n"
    )
