"""The `cadence-fx` command line."""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["main"]


def _catalog(args: argparse.Namespace) -> int:
    from cadence_fx.catalog import derive
    from cadence_fx.models import family_contract
    from cadence_fx.report import catalog_table

    catalog = derive(family_contract(args.family), budget=args.budget)
    print(json.dumps(catalog.to_dict(), indent=2) if args.json else catalog_table(catalog))
    return 0


def _transform_reference(family: str, depth: str, *, audit: bool):
    from cadence_fx.transform import transform

    if family != "token2wav":
        raise ValueError(f"family {family!r} has a contract but no transform adapter yet; transformable: ['token2wav']")
    from cadence_fx.models.token2wav_carry import reference_flow

    print(f"building the vendor Token2Wav flow ({depth} depth, random weights)...", file=sys.stderr, flush=True)
    flow, contract, prompt_tokens = reference_flow(depth)
    print("transforming (state rule, carry pass, capture of the hot operators)...", file=sys.stderr, flush=True)
    transformed, report = transform(flow, contract, audit=audit)
    return flow, transformed, report, prompt_tokens


def _diff(args: argparse.Namespace) -> int:
    from cadence_fx.diff import diff_graphs, render_html, render_text

    _, _, report, _ = _transform_reference(args.family, args.depth, audit=False)
    diffs = [diff_graphs(name, before, after) for name, (before, after) in report.graphs.items()]
    print(report)
    print()
    print(render_text(diffs))
    if args.html:
        with open(args.html, "w", encoding="utf-8") as page:
            page.write(render_html(diffs, f"cadence-fx diff: {args.family}"))
        print(f"wrote {args.html}", file=sys.stderr)
    return 0


def _demo(args: argparse.Namespace) -> int:
    import torch

    from cadence_fx.models.token2wav_carry import CarryStream
    from cadence_fx.models.token2wav_stream import StockStream, random_chunks, random_prompt
    from cadence_fx.report import format_bytes

    flow, transformed, report, prompt_tokens = _transform_reference("token2wav", args.depth, audit=True)
    prompt = random_prompt(0, n_tokens=prompt_tokens)
    stock, carried = StockStream(flow, None, prompt), CarryStream(transformed, prompt)
    exact = True
    for block in range(args.blocks):
        for stream in (stock, carried):
            stream.setup() if block == 0 else stream.reset_turn()
        chunks = random_chunks(block, args.chunks)
        for i, tokens in enumerate(chunks):
            mels = [stream.flow_chunk(tokens, last_chunk=i == len(chunks) - 1) for stream in (stock, carried)]
            same = torch.equal(*mels)
            exact &= same
            address = carried.stream_cache["estimator_att_cache"].data_ptr()
            print(f"block {block} chunk {i}: mel {tuple(mels[1].shape)} bit-identical={same} carry at {address:#x}", flush=True)
    print()
    print(report)
    before, after = sum(b for b, _ in report.managed_bytes().values()), sum(a for _, a in report.managed_bytes().values())
    print(f"\nall {args.blocks * args.chunks} chunks bit-identical to the vendor stream: {exact}; "
          f"managed state {format_bytes(before)} -> {format_bytes(after)}")
    return 0 if exact else 1


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from cadence_fx.models import FAMILIES

    parser = argparse.ArgumentParser(prog="cadence-fx", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    catalog = commands.add_parser("catalog", help="derive a family's extents, bounds, bytes and shape classes")
    catalog.add_argument("family", choices=sorted(FAMILIES))
    catalog.add_argument("--budget", type=_positive_int, default=64, help="widest catalog still captured (classes)")
    catalog.add_argument("--json", action="store_true", help="print the derivation as JSON")
    catalog.set_defaults(run=_catalog)

    diff = commands.add_parser("diff", help="transform a family's reference model and show the before/after graphs")
    diff.add_argument("family", choices=sorted(FAMILIES))
    diff.add_argument("--depth", choices=("reduced", "full"), default="reduced")
    diff.add_argument("--html", metavar="PATH", help="also write a self-contained HTML page")
    diff.set_defaults(run=_diff)

    demo = commands.add_parser("demo", help="stream the vendor Token2Wav flow stock and transformed, side by side")
    demo.add_argument("--depth", choices=("reduced", "full"), default="reduced")
    demo.add_argument("--blocks", type=_positive_int, default=2, help="turns, with a reset between them")
    demo.add_argument("--chunks", type=_positive_int, default=4, help="chunks per turn (the last one flushes)")
    demo.set_defaults(run=_demo)
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
