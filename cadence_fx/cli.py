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


def _reference(family: str, depth: str):
    """A family's reference model (real vendor code or the in-repo encoder, random weights)."""
    if family == "token2wav":
        from cadence_fx.models.token2wav_carry import reference_flow

        flow, contract, _ = reference_flow(depth)
        return flow, contract
    if family == "freeze_omni":
        from cadence_fx.models.freeze_omni_carry import reference_encoder

        return reference_encoder(depth)
    raise ValueError(f"the diff builds reference models for 'token2wav' and 'freeze_omni' only, got {family!r}")


def _diff(args: argparse.Namespace) -> int:
    from cadence_fx.diff import diff_graphs, render_html, render_text

    from cadence_fx.transform import transform

    print(f"building the {args.family} reference model ({args.depth} depth, random weights)...", file=sys.stderr)
    model, contract = _reference(args.family, args.depth)
    print("transforming (state rule, carry pass, capture of the hot operators)...", file=sys.stderr, flush=True)
    _, report = transform(model, contract, replay=False)
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

    from cadence_fx.models.token2wav_carry import reference_flow
    from cadence_fx.transform import transform

    print(f"building the vendor Token2Wav flow ({args.depth} depth, random weights)...", file=sys.stderr, flush=True)
    flow, contract, prompt_tokens = reference_flow(args.depth)
    print("transforming (state rule, carry pass, replay of the CFM loop)...", file=sys.stderr, flush=True)
    transformed, report = transform(flow, contract, audit=True)
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


def _bench(args: argparse.Namespace) -> int:
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / f"{args.family}.py"
    if not script.is_file():
        raise ValueError(f"no benchmark {script}: benchmarks run from a checkout of the repository")
    sys.argv = [str(script), *args.options]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def _serve(args: argparse.Namespace) -> int:
    import os

    from cadence_fx.serve.access import Access
    from cadence_fx.serve.app import run_server
    from cadence_fx.serve.session import Limits

    limits = Limits(
        max_sessions=args.max_sessions,
        max_sessions_per_client=args.max_sessions_per_client,
        idle_ttl_s=args.idle_ttl,
        grace_s=args.grace,
    )
    api_key = args.api_key if args.api_key is not None else os.environ.get("CADENCE_FX_API_KEY")
    access = Access(api_key=api_key, allowed_origins=tuple(args.allow_origin), docs=args.docs)
    print(f"serving {args.model} on ws://{args.host}:{args.port}/v1/realtime", file=sys.stderr, flush=True)
    run_server(args.host, args.port, args.model, limits, access)
    return 0


def _client(args: argparse.Namespace) -> int:
    from cadence_fx.serve.client import run_client

    run_client(args.url, args.wav, args.out)
    return 0


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

    bench = commands.add_parser("bench", help="run a family's benchmark (bench/FAMILY.py); options pass through")
    bench.add_argument("family", choices=("token2wav", "moshi"))
    bench.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's own options, e.g. --out PATH")
    bench.set_defaults(run=_bench)

    from cadence_fx.serve.plugins import DEFAULT_PLUGIN, plugin_names

    serve = commands.add_parser("serve", help="the duplex service (OpenAI Realtime over WebSocket)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=_positive_int, default=8000)
    serve.add_argument("--model", choices=plugin_names(), default=DEFAULT_PLUGIN, help="the model plugin to serve")
    serve.add_argument("--max-sessions", type=_positive_int, default=16)
    serve.add_argument(
        "--max-sessions-per-client", type=_positive_int, default=4, help="live sessions one client address may hold"
    )
    serve.add_argument("--idle-ttl", type=float, default=300.0, help="seconds without traffic before a session expires")
    serve.add_argument("--grace", type=float, default=30.0, help="seconds a disconnected session waits for a resume")
    serve.add_argument(
        "--api-key",
        metavar="KEY",
        help="key every route but /health asks for (default: $CADENCE_FX_API_KEY, which keeps it out of the "
        "process list); without one the service is open",
    )
    serve.add_argument(
        "--allow-origin",
        metavar="ORIGIN",
        action="append",
        default=[],
        help="a browser origin (scheme://host:port) allowed besides the server's own; repeatable; '*' allows any",
    )
    serve.add_argument("--docs", action="store_true", help="serve /docs and /openapi.json")
    serve.set_defaults(run=_serve)

    client = commands.add_parser("client", help="stream a WAV file through a session in real time, write the reply")
    client.add_argument("--url", default="ws://127.0.0.1:8000")
    client.add_argument("--wav", required=True, help="input WAV (16-bit PCM, mono)")
    client.add_argument("--out", required=True, help="where to write the reply WAV")
    client.set_defaults(run=_client)
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
