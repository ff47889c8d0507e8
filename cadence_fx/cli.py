"""The `cadence-fx` command line."""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["SERVICE", "build_parser", "main", "non_negative_int", "positive_int"]

# The service's parts the core runs, by "module:attribute": the core imports neither models nor
# serve (dependencies point one way: serve -> models -> passes -> core), so what it needs from the
# service is named here, once, and imported when used; model families are found through their
# registry (cadence_fx.families). `commands` adds `serve`, `prompt` and `client` to the parser;
# `reference` writes the generated blocks of docs/service.md (`python -m cadence_fx.docs`).
SERVICE = {
    "commands": "cadence_fx.serve.commands:add_commands",
    "reference": "cadence_fx.serve.reference:service_blocks",
}


def _catalog(args: argparse.Namespace) -> int:
    from cadence_fx.catalog import derive
    from cadence_fx.families import family, load
    from cadence_fx.report import catalog_table

    catalog = derive(load(family(args.family).contract)(), budget=args.budget)
    print(json.dumps(catalog.to_dict(), indent=2) if args.json else catalog_table(catalog))
    return 0


def _reference(name: str, depth: str, device: str):
    """A family's reference model (random weights) on `device`, its contract, and a short stream
    through its transformed model: `stream(transformed, chunks)` runs `chunks` chunks and says what it ran."""
    from cadence_fx.families import families, family, load

    declared = family(name).reference
    if declared is None:
        having = sorted(n for n, f in families().items() if f.reference)
        raise ValueError(f"the diff builds reference models for {having} only, got {name!r}")
    model, contract, stream = load(declared)(depth, device)
    return model, contract, None, stream


def _own_model(reference: str, device: str):
    """A user's model: MODULE:FACTORY names `factory(device) -> (model, contract, binding, stream)`,
    `stream(transformed, chunks)` running `chunks` calls through the transformed model and saying what it ran."""
    from cadence_fx.binding import Binding
    from cadence_fx.contract import Contract
    from cadence_fx.families import load

    module, sep, attribute = reference.partition(":")
    if not (module and sep and attribute):
        raise ValueError(f"--binding: expected MODULE:FACTORY, got {reference!r}")
    try:
        factory = load(reference)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"--binding {reference}: {error}") from None
    built = factory(device)
    if not isinstance(built, tuple) or len(built) != 4:
        returned = f"a tuple of {len(built)}" if isinstance(built, tuple) else f"a {type(built).__name__}"
        raise ValueError(
            f"--binding {reference}: the factory returned {returned}, expected a tuple (model, contract, binding, stream)"
        )
    model, contract, binding, stream = built
    for what, value, expected in (("contract", contract, Contract), ("binding", binding, Binding)):
        if not isinstance(value, expected):
            raise ValueError(
                f"--binding {reference}: the factory's {what} is a {type(value).__name__}, expected a "
                f"cadence_fx.{expected.__name__}"
            )
    if not callable(stream):
        raise ValueError(
            f"--binding {reference}: the factory's stream is a {type(stream).__name__}, expected "
            "stream(transformed, chunks) -> str"
        )
    return model, contract, binding, stream


def _device(requested: str | None) -> str:
    import torch

    if requested is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here (torch.cuda.is_available() is False); use --device cpu")
    return requested


def _diff(args: argparse.Namespace) -> int:
    from cadence_fx.diff import diff_graphs, render_savings, render_text
    from cadence_fx.diff_page import render_html
    from cadence_fx.transform import transform

    if (args.family is None) == (args.binding is None):
        raise ValueError("give a FAMILY or --binding MODULE:FACTORY (one of them)")
    if args.binding is not None and args.depth is not None:
        raise ValueError("--depth sizes a family's reference model; a --binding factory builds its own")
    if args.binding is not None and not args.chunks:
        raise ValueError(
            "--binding: a bound model exports each class at its first call, so without a stream there "
            "is no graph to show; give --chunks N (N calls)"
        )
    device = _device(args.device)
    if args.binding is None:
        depth = args.depth or "reduced"
        print(
            f"building the {args.family} reference model ({depth} depth, random weights) on {device}...",
            file=sys.stderr,
            flush=True,
        )
        model, contract, binding, stream = _reference(args.family, depth, device)
    else:
        print(f"building the model of {args.binding} on {device}...", file=sys.stderr, flush=True)
        model, contract, binding, stream = _own_model(args.binding, device)
    print("transforming (state rule, carry pass, capture of the hot operators)...", file=sys.stderr, flush=True)
    transformed, report = transform(model, contract, binding, audit=args.audit)
    streamed = None
    if args.chunks:
        print(f"streaming {args.chunks} chunks through the transformed model...", file=sys.stderr, flush=True)
        streamed = stream(transformed, args.chunks)
    diffs = [diff_graphs(name, before, after) for name, (before, after) in report.graphs.items()]
    print(f"on {device}")
    print(report)
    print()
    print(render_text(diffs))
    print(render_savings(report, report.catalog))
    if args.html:
        title = f"cadence-fx diff: {args.family or args.binding}"
        with open(args.html, "w", encoding="utf-8") as page:
            page.write(render_html(report, report.catalog, title=title, stream=streamed, device=device))
        print(f"wrote {args.html}", file=sys.stderr)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from cadence_fx.families import families, family, load

    declared = family(args.family).demo
    if declared is None:
        having = sorted(n for n, f in families().items() if f.demo)
        raise ValueError(f"the demo streams families with a demo only ({having}), got {args.family!r}")
    return 0 if load(declared)(args.depth, args.blocks, args.chunks) else 1


def _bench(args: argparse.Namespace) -> int:
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / f"{args.family}.py"
    if not script.is_file():
        raise ValueError(f"no benchmark {script}: benchmarks run from a checkout of the repository")
    sys.argv = [str(script), *args.options]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def _integer_at_least(text: str, minimum: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a {what} integer, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected a {what} integer, got {value}")
    return value


def positive_int(text: str) -> int:
    """A positive integer."""  # the CLI reference (cadence_fx/docs.py) shows a type by its docstring
    return _integer_at_least(text, 1, "positive")


def non_negative_int(text: str) -> int:
    """A non-negative integer."""
    return _integer_at_least(text, 0, "non-negative")


def build_parser() -> argparse.ArgumentParser:
    from cadence_fx.families import families, load

    parser = argparse.ArgumentParser(prog="cadence-fx", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    catalog = commands.add_parser("catalog", help="derive a family's extents, bounds, bytes and shape classes")
    catalog.add_argument("family", choices=sorted(families()))
    catalog.add_argument("--budget", type=positive_int, default=64, help="widest catalog still captured (classes)")
    catalog.add_argument("--json", action="store_true", help="print the derivation as JSON")
    catalog.set_defaults(run=_catalog)

    diff = commands.add_parser(
        "diff",
        help="transform a family's reference model, or your own, and show the before/after graphs and what the transform saves",
    )
    diff.add_argument(
        "family", nargs="?", choices=sorted(families()), help="a family's reference model (random weights); or give --binding"
    )
    diff.add_argument(
        "--binding",
        metavar="MODULE:FACTORY",
        help="your own model instead of a family's: factory(device) returns (model, contract, binding, "
        "stream), stream(transformed, chunks) runs chunks calls and says what it ran; "
        "needs --chunks",
    )
    diff.add_argument("--depth", choices=("reduced", "full"), help="a family's reference model's size (default: reduced)")
    diff.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        help="where the model is built and streamed (default: cuda when available, else cpu); "
        "graphs are captured and certificates replayed only on cuda",
    )
    diff.add_argument("--html", metavar="PATH", help="also write the report as one self-contained HTML page")
    diff.add_argument(
        "--chunks",
        type=non_negative_int,
        default=0,
        help="stream this many chunks through the transformed model first, so the report shows "
        "replay certificates and counters (0: none)",
    )
    diff.add_argument(
        "--audit", action="store_true", help="attach the shadow auditor (Freeze-Omni then runs its step without replay)"
    )
    diff.set_defaults(run=_diff)

    demo = commands.add_parser("demo", help="stream a family's reference model stock and transformed, side by side")
    demo.add_argument(
        "family",
        nargs="?",
        default="token2wav",
        choices=sorted(n for n, f in families().items() if f.demo),
        help="a family whose registry entry has a demo",
    )
    demo.add_argument(
        "--depth",
        choices=("tiny", "reduced", "full"),
        default="tiny",
        help="the flow's size: tiny (1 DiT block, the default), reduced (2) or full (MiniCPM-o 4.5's)",
    )
    demo.add_argument("--blocks", type=positive_int, default=2, help="turns, with a reset between them")
    demo.add_argument("--chunks", type=positive_int, default=4, help="chunks per turn (the last one flushes)")
    demo.set_defaults(run=_demo)

    bench = commands.add_parser("bench", help="run a family's benchmark (bench/FAMILY.py); options pass through")
    bench.add_argument("family", choices=("token2wav", "moshi", "moshi_slots"))
    bench.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's own options, e.g. --out PATH")
    bench.set_defaults(run=_bench)

    load(SERVICE["commands"])(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ValueError as error:
        print(f"cadence-fx {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
