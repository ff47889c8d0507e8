"""The `cadence-fx` command line."""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["main"]


def _catalog(args: argparse.Namespace) -> int:
    from cadence_fx.catalog import derive
    from cadence_fx.families import family, load
    from cadence_fx.report import catalog_table

    catalog = derive(load(family(args.family).contract)(), budget=args.budget)
    print(json.dumps(catalog.to_dict(), indent=2) if args.json else catalog_table(catalog))
    return 0


def _reference(name: str, depth: str):
    """A family's reference model (random weights), its contract, and a short stream through its
    transformed model: `stream(transformed, chunks)` runs `chunks` chunks and says what it ran."""
    from cadence_fx.families import families, family, load

    declared = family(name).reference
    if declared is None:
        having = sorted(n for n, f in families().items() if f.reference)
        raise ValueError(f"the diff builds reference models for {having} only, got {name!r}")
    return load(declared)(depth)


def _diff(args: argparse.Namespace) -> int:
    from cadence_fx.diff import diff_graphs, render_html, render_text
    from cadence_fx.transform import transform

    print(f"building the {args.family} reference model ({args.depth} depth, random weights)...", file=sys.stderr)
    model, contract, stream = _reference(args.family, args.depth)
    print("transforming (state rule, carry pass, capture of the hot operators)...", file=sys.stderr, flush=True)
    transformed, report = transform(model, contract, audit=args.audit)
    streamed = None
    if args.chunks:
        print(f"streaming {args.chunks} chunks through the transformed model...", file=sys.stderr, flush=True)
        streamed = stream(transformed, args.chunks)
    diffs = [diff_graphs(name, before, after) for name, (before, after) in report.graphs.items()]
    print(report)
    print()
    print(render_text(diffs))
    if args.html:
        with open(args.html, "w", encoding="utf-8") as page:
            page.write(render_html(report, report.catalog, title=f"cadence-fx diff: {args.family}", stream=streamed))
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
    from pathlib import Path

    from cadence_fx.serve.access import Access
    from cadence_fx.serve.app import Tls, run_server
    from cadence_fx.serve.plugins import has_slots, loads_weights, plugin_names, takes_prompt
    from cadence_fx.serve.session import Limits

    options = dict(args.plugin_option)
    for flag, value, accepts, what in (("--weights", args.weights, loads_weights, "loads no checkpoint"),
                                       ("--prompt", args.prompt, takes_prompt, "takes no speaker prompt"),
                                       ("--slots", args.slots, has_slots, "has no batch of slots")):
        if value is None:
            continue
        if not accepts(args.model):
            takers = [name for name in plugin_names() if accepts(name)]
            raise ValueError(f"{flag}: {args.model} {what}; the models that do: {', '.join(takers)}")
        key = flag.removeprefix("--")
        if key in options:
            raise ValueError(f"{flag} and --plugin-option {key}=... both set {key}: give one")
        options[key] = value
    tls = None
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together: give both (PEM files) or neither")
    if args.ssl_keyfile is not None:
        for path in (args.ssl_keyfile, args.ssl_certfile):
            if not Path(path).is_file():
                raise ValueError(f"no such file {path!r} (expected a PEM key or certificate)")
        tls = Tls(args.ssl_keyfile, args.ssl_certfile)
    limits = Limits(
        # More sessions than the places' slots hold is refused at startup (the plugin's reserve).
        max_sessions=args.max_sessions or args.slots or 16,
        max_sessions_per_client=args.max_sessions_per_client,
        idle_ttl_s=args.idle_ttl,
        grace_s=args.grace,
        reply_lead_s=args.reply_lead,
    )
    api_key = args.api_key if args.api_key is not None else os.environ.get("CADENCE_FX_API_KEY")
    access = Access(api_key=api_key, allowed_origins=tuple(args.allow_origin), docs=args.docs)
    weights = f" with the weights of {args.weights}" if args.weights else ""
    print(f"loading {args.model}{weights}...", file=sys.stderr, flush=True)

    def ready(base: str, health: dict) -> None:
        ws = base.replace("http", "ws", 1)
        print(
            f"ready: {health['model']} on {ws}/v1/realtime ({health['max_sessions']} session slots); page at {base}/",
            file=sys.stderr,
            flush=True,
        )

    run_server(args.host, args.port, args.model, limits, access, tls, on_ready=ready, plugin_options=options)
    return 0


def _prompt(args: argparse.Namespace) -> int:
    from cadence_fx.models import token2wav_checkpoint as checkpoint

    found = checkpoint.locate_checkpoint(args.weights, checkpoint.PREPARE_FILES, reference_voice=args.wav is None)
    wav = args.wav or found.reference_voice
    print(f"preparing the prompt state of {wav} with {found.assets}...", file=sys.stderr, flush=True)
    prompt = checkpoint.prepare_prompt(found, wav)
    checkpoint.save_prompt(prompt, args.out, source=str(wav))
    print(f"wrote {args.out}: {prompt.tokens.shape[1]} speech tokens, {prompt.mels.shape[1]} mel frames, "
          f"a {prompt.spk.shape[1]}-dim speaker embedding")
    return 0


def _client(args: argparse.Namespace) -> int:
    from cadence_fx.serve.client import ClientError, run_client

    try:
        report = run_client(args.url, args.wav, args.out)
    except ClientError as error:
        print(f"cadence-fx client: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the streamer wrote what had arrived on its way out
        print(f"cadence-fx client: interrupted; {args.out} holds the reply audio that had arrived", file=sys.stderr)
        return 130
    print(report.summary(args.out), file=sys.stderr)
    return 1 if report.failure else 0


def _integer_at_least(text: str, minimum: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a {what} integer, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected a {what} integer, got {value}")
    return value


def _positive_int(text: str) -> int:
    """A positive integer."""  # the CLI reference (cadence_fx/docs.py) shows a type by its docstring
    return _integer_at_least(text, 1, "positive")


def _non_negative_int(text: str) -> int:
    """A non-negative integer."""
    return _integer_at_least(text, 0, "non-negative")


def _plugin_option(text: str) -> tuple[str, object]:
    """NAME=VALUE, the value read as JSON where it parses (numbers, true/false) and as text otherwise."""
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        return name, json.loads(value)
    except ValueError:
        return name, value


def build_parser() -> argparse.ArgumentParser:
    from cadence_fx.families import families

    parser = argparse.ArgumentParser(prog="cadence-fx", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    catalog = commands.add_parser("catalog", help="derive a family's extents, bounds, bytes and shape classes")
    catalog.add_argument("family", choices=sorted(families()))
    catalog.add_argument("--budget", type=_positive_int, default=64, help="widest catalog still captured (classes)")
    catalog.add_argument("--json", action="store_true", help="print the derivation as JSON")
    catalog.set_defaults(run=_catalog)

    diff = commands.add_parser("diff", help="transform a family's reference model and show the before/after graphs")
    diff.add_argument("family", choices=sorted(families()))
    diff.add_argument("--depth", choices=("reduced", "full"), default="reduced")
    diff.add_argument("--html", metavar="PATH", help="also write the report as one self-contained HTML page")
    diff.add_argument("--chunks", type=_non_negative_int, default=0,
                      help="stream this many chunks through the transformed model first, so the report shows "
                      "replay certificates and counters (0: none)")
    diff.add_argument("--audit", action="store_true",
                      help="attach the shadow auditor (Freeze-Omni then runs its step without replay)")
    diff.set_defaults(run=_diff)

    demo = commands.add_parser("demo", help="stream the vendor Token2Wav flow stock and transformed, side by side")
    demo.add_argument("--depth", choices=("reduced", "full"), default="reduced")
    demo.add_argument("--blocks", type=_positive_int, default=2, help="turns, with a reset between them")
    demo.add_argument("--chunks", type=_positive_int, default=4, help="chunks per turn (the last one flushes)")
    demo.set_defaults(run=_demo)

    bench = commands.add_parser("bench", help="run a family's benchmark (bench/FAMILY.py); options pass through")
    bench.add_argument("family", choices=("token2wav", "moshi", "moshi_slots"))
    bench.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's own options, e.g. --out PATH")
    bench.set_defaults(run=_bench)

    from cadence_fx.serve.plugins import DEFAULT_PLUGIN, plugin_names

    serve = commands.add_parser("serve", help="the duplex service (OpenAI Realtime over WebSocket)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=_positive_int, default=8000)
    serve.add_argument("--model", choices=plugin_names(), default=DEFAULT_PLUGIN, help="the model plugin to serve")
    serve.add_argument("--weights", metavar="DIR_OR_REPO",
                       help="a published checkpoint to serve instead of random weights: a local directory or a "
                            "Hugging Face hub repo id (moshi-full: kyutai/moshiko-pytorch-bf16; token2wav-full: "
                            "openbmb/MiniCPM-o-4_5)")
    serve.add_argument("--max-sessions", type=_positive_int,
                       help="live sessions at once (default: --slots when given, else 16)")
    serve.add_argument("--slots", type=_positive_int, metavar="B",
                       help="moshi-*: the batch of each tick place, the sessions it ticks in one call; admission "
                            "is a free slot (default: the batch follows --max-sessions)")
    serve.add_argument(
        "--max-sessions-per-client", type=_positive_int, default=4, help="live sessions one client address may hold"
    )
    serve.add_argument("--idle-ttl", type=float, default=300.0, help="seconds without traffic before a session expires")
    serve.add_argument("--grace", type=float, default=30.0, help="seconds a disconnected session waits for a resume")
    serve.add_argument("--reply-lead", type=float, default=0.0, metavar="SECONDS",
                       help="compute a reply at most this far ahead of its playback (0: as fast as the model goes)")
    serve.add_argument("--prompt", metavar="FILE",
                       help="token2wav's speaker prompt: a file written by `cadence-fx prompt`, or a WAV "
                            "(default with --weights: the model's reference voice)")
    serve.add_argument(
        "--plugin-option", metavar="NAME=VALUE", type=_plugin_option, action="append", default=[],
        help="a keyword argument of the model plugin (repeatable), e.g. step_delay_s=0.04 for tone",
    )
    serve.add_argument("--ssl-keyfile", metavar="PEM", help="serve https:// and wss:// with this private key")
    serve.add_argument("--ssl-certfile", metavar="PEM", help="... and this certificate (chain)")
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

    prompt = commands.add_parser("prompt", help="prepare MiniCPM-o Token2Wav's speaker prompt from a WAV and save it")
    prompt.add_argument("--weights", required=True, metavar="DIR_OR_REPO",
                        help="the checkpoint whose speech tokenizer and speaker model prepare it (a folder or a hub id)")
    prompt.add_argument("--wav", help="the prompt's audio (default: the model's reference voice)")
    prompt.add_argument("--out", required=True, help="where to write the prompt file (safetensors)")
    prompt.set_defaults(run=_prompt)

    client = commands.add_parser("client", help="stream a WAV file through a session in real time, write the reply")
    client.add_argument(
        "--url", default="ws://127.0.0.1:8000", help="the server (ws://HOST:PORT) or a route: .../v1/realtime, .../v1/duplex"
    )
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
