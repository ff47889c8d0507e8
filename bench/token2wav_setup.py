"""How long Token2Wav's transform takes, lane after lane, on the one pipeline.

The service builds one transformed flow per replay lane (`serve/plugins/token2wav.py`), each from
the same stock flow. The first lane exports each class's whole CFM loop; every later lane is a
model of the same structure, so it takes those exports rebound to its own tensors
(`cadence_fx/pipeline/export.py`, `EXPORTS`). This builds `--lanes` transformed flows one after another,
records each one's wall time and how many of its classes were exported or reused, then streams one
turn through the last lane beside the stock flow and says whether every chunk's mel was
bit-identical.

    python bench/token2wav_setup.py --depth full --lanes 2 --out bench/results/token2wav_setup.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

# Run as a script, this file's folder is sys.path[0]: keep bench/ modules from shadowing packages.
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != Path(__file__).resolve().parent]

from cadence_fx import transform  # noqa: E402
from cadence_fx.determinism import pin_deterministic  # noqa: E402
from cadence_fx.models.token2wav_carry import CarryStream, reference_flow  # noqa: E402
from cadence_fx.models.token2wav_stream import StockStream, random_chunks, random_prompt  # noqa: E402
from cadence_fx.report import measured_commit  # noqa: E402

REUSED = "of a model of the same structure reused"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", choices=("reduced", "full"), default="reduced")
    parser.add_argument("--lanes", type=int, default=2, help="transformed flows built one after another")
    parser.add_argument("--chunks", type=int, default=6, help="chunks of the turn streamed through the last lane")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.lanes < 1 or args.chunks < 1:
        parser.error("--lanes and --chunks must be at least 1")
    device = torch.device(args.device)
    pin_deterministic()
    print(f"building the {args.depth} Token2Wav flow on {device}...", file=sys.stderr, flush=True)
    flow, contract, prompt_tokens = reference_flow(args.depth, device=args.device)
    lanes, transformed = [], None
    with torch.no_grad():
        for lane in range(args.lanes):
            started = time.perf_counter()
            transformed, report = transform(flow, contract)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - started
            classes = sum(len(op.classes) for op in transformed.bound.operators.values())
            reused = sum(REUSED in stamp for stamp in report.stamps)
            lanes.append(
                {
                    "lane": lane,
                    "transform_s": seconds,
                    "classes": classes,
                    "exported": classes - reused,
                    "reused": reused,
                    "captures": {
                        name: op.replay.counters.captures
                        for name, op in transformed.bound.operators.items()
                        if op.replay is not None
                    },
                }
            )
            print(
                f"  lane {lane}: {seconds:.1f} s, {classes - reused} classes exported, {reused} reused",
                file=sys.stderr,
                flush=True,
            )
        prompt = random_prompt(0, n_tokens=prompt_tokens, device=device)
        stock, carried = StockStream(flow, None, prompt), CarryStream(transformed, prompt)
        equal = 0
        for stream in (stock, carried):
            stream.setup()
        for i, tokens in enumerate(random_chunks(1, args.chunks, device=device)):
            last = i == args.chunks - 1
            equal += torch.equal(stock.flow_chunk(tokens, last), carried.flow_chunk(tokens, last))
    print(f"  last lane: {equal}/{args.chunks} chunks' mel bit-identical to the stock flow", file=sys.stderr, flush=True)
    dirty = bool(subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True).stdout.strip())
    record = {
        "benchmark": "token2wav_setup",
        "commit": measured_commit(),
        "worktree_dirty": dirty,
        "command": " ".join([sys.executable, *sys.argv]) if argv is None else "bench/token2wav_setup.py " + " ".join(argv),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu"),
        "torch": torch.__version__,
        "depth": args.depth,
        "lanes": lanes,
        "last_lane_mel_equal_chunks": equal,
        "chunks": args.chunks,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
