"""The service's commands of `cadence-fx`: `serve`, `prompt` (a served voice's speaker prompt) and
`client`. The core's command line (`cadence_fx/cli.py`) imports no service code: it names this
module's `add_commands` in its `SERVICE` table and calls it when it builds its parser."""

from __future__ import annotations

import argparse
import json
import sys

from cadence_fx.cli import positive_int

__all__ = ["add_commands", "plugin_option"]


def _serve(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    from cadence_fx.serve.access import Access
    from cadence_fx.serve.app import Tls, run_server
    from cadence_fx.serve.plugins import has_lanes, has_slots, loads_weights, plugin_names, takes_prompt
    from cadence_fx.serve.session import Limits

    if args.replicas is not None and not args.ray:
        raise ValueError("--replicas goes with --ray (without it, one server process serves every session)")
    if args.trusted_proxy and args.ray:
        raise ValueError(
            "--trusted-proxy does not go with --ray: there Ray Serve's HTTP proxy takes the client's address, "
            "and the replicas trust only the ingress's word for it"
        )
    options = dict(args.plugin_option)
    for flag, value, accepts, what in (
        ("--weights", args.weights, loads_weights, "loads no checkpoint"),
        ("--prompt", args.prompt, takes_prompt, "takes no speaker prompt"),
        ("--slots", args.slots, has_slots, "has no batch of slots"),
        ("--lanes", args.lanes, has_lanes, "has no replay lanes"),
    ):
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
    access = Access(
        api_key=api_key,
        allowed_origins=tuple(args.allow_origin),
        docs=args.docs,
        allowed_hosts=tuple(args.allowed_host),
        trusted_proxies=tuple(args.trusted_proxy),
    )
    weights = f" with the weights of {args.weights}" if args.weights else ""
    print(f"loading {args.model}{weights}...", file=sys.stderr, flush=True)

    def ready(base: str, health: dict) -> None:
        ws = base.replace("http", "ws", 1)
        replicas = f" over {len(health['replicas'])} replicas" if "replicas" in health else ""
        print(
            f"ready: {health['model']} on {ws}/v1/realtime ({health['max_sessions']} session slots{replicas}); page at {base}/",
            file=sys.stderr,
            flush=True,
        )

    if args.ray:
        from cadence_fx.serve.ray import RaySpec, run_ray

        spec = RaySpec(model=args.model, limits=limits, access=access, plugin_options=options)
        run_ray(args.host, args.port, spec, args.replicas, tls, on_ready=ready)
        return 0
    run_server(args.host, args.port, args.model, limits, access, tls, on_ready=ready, plugin_options=options)
    return 0


def _prompt(args: argparse.Namespace) -> int:
    from cadence_fx.models import token2wav_checkpoint as checkpoint

    found = checkpoint.locate_checkpoint(args.weights, checkpoint.PREPARE_FILES, reference_voice=args.wav is None)
    wav = args.wav or found.reference_voice
    assert wav is not None, "without a WAV, locate_checkpoint(reference_voice=True) refuses a checkpoint without one"
    print(f"preparing the prompt state of {wav} with {found.assets}...", file=sys.stderr, flush=True)
    prompt = checkpoint.prepare_prompt(found, wav)
    checkpoint.save_prompt(prompt, args.out, source=str(wav))
    print(
        f"wrote {args.out}: {prompt.tokens.shape[1]} speech tokens, {prompt.mels.shape[1]} mel frames, "
        f"a {prompt.spk.shape[1]}-dim speaker embedding"
    )
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


def plugin_option(text: str) -> tuple[str, object]:
    """NAME=VALUE, the value read as JSON where it parses (numbers, true/false) and as text otherwise."""
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        return name, json.loads(value)
    except ValueError:
        return name, value


def add_commands(commands: argparse._SubParsersAction) -> None:
    """Add `serve`, `prompt` and `client` to the `cadence-fx` parser's commands."""
    from cadence_fx.serve.plugins import DEFAULT_PLUGIN, plugin_names

    serve = commands.add_parser("serve", help="the duplex service (OpenAI Realtime over WebSocket)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=positive_int, default=8000)
    serve.add_argument("--model", choices=plugin_names(), default=DEFAULT_PLUGIN, help="the model plugin to serve")
    serve.add_argument(
        "--weights",
        metavar="DIR_OR_REPO",
        help="a published checkpoint to serve instead of random weights: a local directory or a "
        "Hugging Face hub repo id (moshi-full: kyutai/moshiko-pytorch-bf16; token2wav-full: "
        "openbmb/MiniCPM-o-4_5)",
    )
    serve.add_argument("--max-sessions", type=positive_int, help="live sessions at once (default: --slots when given, else 16)")
    serve.add_argument(
        "--slots",
        type=positive_int,
        metavar="B",
        help="moshi-*: the batch of each tick place, the sessions it ticks in one call; admission "
        "is a free slot (default: the batch follows --max-sessions). token2wav*: the sessions as the "
        "rows of one batch of B under the batch-invariant envelope, instead of replay lanes (default: lanes)",
    )
    serve.add_argument(
        "--lanes",
        type=positive_int,
        metavar="L",
        help="token2wav*: replay lanes, each its own copy of the flow and graphs on its own thread and "
        "CUDA stream, warmed at startup; sessions spread over them, ceil(--max-sessions / L) on "
        "each (default: 8 on token2wav-full, 1 on token2wav)",
    )
    serve.add_argument(
        "--max-sessions-per-client", type=positive_int, default=4, help="live sessions one client address may hold"
    )
    serve.add_argument("--idle-ttl", type=float, default=300.0, help="seconds without traffic before a session expires")
    serve.add_argument("--grace", type=float, default=30.0, help="seconds a disconnected session waits for a resume")
    serve.add_argument(
        "--reply-lead",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="compute a reply at most this far ahead of its playback (0: as fast as the model goes)",
    )
    serve.add_argument(
        "--prompt",
        metavar="FILE",
        help="token2wav's speaker prompt: a file written by `cadence-fx prompt`, or a WAV "
        "(default with --weights: the model's reference voice)",
    )
    serve.add_argument(
        "--plugin-option",
        metavar="NAME=VALUE",
        type=plugin_option,
        action="append",
        default=[],
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
    serve.add_argument(
        "--allowed-host",
        metavar="NAME",
        action="append",
        default=[],
        help="a host name (or address) clients reach the server by, besides its own address and localhost, "
        "127.0.0.1, ::1: a request whose Host names anything else is refused (421), so no other site's page "
        "whose DNS name was rebound to this address can use it; repeatable; '*' allows any",
    )
    serve.add_argument(
        "--trusted-proxy",
        metavar="ADDRESS",
        action="append",
        default=[],
        help="a reverse proxy (an IP address, or a network such as 10.0.0.0/8) whose X-Forwarded-For names the "
        "client, as the per-client session limit counts it; repeatable; '*' trusts any peer (default: none, "
        "and the header is ignored)",
    )
    serve.add_argument("--docs", action="store_true", help="serve /docs and /openapi.json")
    serve.add_argument(
        "--ray",
        action="store_true",
        help="serve on Ray Serve (RAY_ADDRESS's cluster, else a local one): replicas of this server behind one "
        "ingress that routes each session to its replica; --max-sessions is per replica (docs/deployment.md)",
    )
    serve.add_argument(
        "--replicas",
        type=positive_int,
        help="with --ray: how many replicas, one GPU each where the cluster has GPUs (default: one per GPU, or 2 without GPUs)",
    )
    serve.set_defaults(run=_serve)

    prompt = commands.add_parser("prompt", help="prepare MiniCPM-o Token2Wav's speaker prompt from a WAV and save it")
    prompt.add_argument(
        "--weights",
        required=True,
        metavar="DIR_OR_REPO",
        help="the checkpoint whose speech tokenizer and speaker model prepare it (a folder or a hub id)",
    )
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
