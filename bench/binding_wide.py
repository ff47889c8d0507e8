"""What a wide catalog costs the binding pipeline: a real sliding window of 250 tokens at 2 tokens a
call gives K = 126 classes, each exported and rewritten at its first visit.

The model is tests/byom_example.py's `transformers` Mistral decoder (random weights, reduced size)
with its window widened to 250 retained tokens, bound by the same contract and binding; three
streams of 130 calls, each against the stock stream bit for bit. Written as JSON with the commit,
command and device:

    python bench/binding_wide.py --out bench/results/binding_wide_cpu.json [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from transformers import MistralConfig, MistralForCausalLM

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import byom_example  # noqa: E402

from cadence_fx import SlidingWindow, transform  # noqa: E402
from cadence_fx.report import latency_stats, measured_commit  # noqa: E402

RETAINED = 250  # tokens the window keeps (Mistral's sliding_window counts the current token too)
CALLS = 130  # enough to reach the steady class (125 calls fill the window) and stay in it


def build(device: str):
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=byom_example.LAYERS,
        num_attention_heads=4,
        num_key_value_heads=byom_example.KV_HEADS,
        head_dim=byom_example.HEAD_DIM,
        sliding_window=RETAINED + 1,
        max_position_embeddings=2 * CALLS * byom_example.TOKENS_PER_CALL,
        attn_implementation="sdpa",
    )
    contract = byom_example.contract()
    contract = replace(contract, regions=(replace(contract.regions[0], retention=SlidingWindow(window=RETAINED)),))
    return MistralForCausalLM(config).eval().to(device), config, contract


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    model, config, contract = build(args.device)
    tokens = torch.randint(
        0, config.vocab_size, (1, CALLS * byom_example.TOKENS_PER_CALL), generator=torch.Generator().manual_seed(1)
    ).to(args.device)

    def timed(m):
        started = time.perf_counter()
        logits, _ = byom_example.stream(m, config, tokens)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return logits, time.perf_counter() - started

    expected, stock_s = timed(model)
    bound, report = transform(model, contract, byom_example.binding(), budget=200)
    streams = []
    for i in range(3):
        actual, seconds = timed(bound)
        equal = all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))
        streams.append({"stream": i, "seconds": round(seconds, 3), "bit_identical": equal})
        print(f"stream {i}: {seconds:.2f} s, bit-identical {equal}", file=sys.stderr)
    op = report.operators["decoder_step"]
    capture_ms = [cls.capture_ms for cls in op.classes.values()]
    record = {
        "benchmark": "binding_wide",
        "commit": measured_commit(),
        "command": " ".join([sys.executable, *sys.argv]),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu",
        "cpu_count": os.cpu_count(),
        "load_average_1min_after": os.getloadavg()[0],
        "torch": torch.__version__,
        "catalog_width": report.catalog.operator("decoder_step").width,
        "classes_met": len(op.classes),
        "calls_per_stream": CALLS,
        "stock_stream_seconds": round(stock_s, 3),
        "streams": streams,
        "capture_and_rewrite_ms_per_class": latency_stats(capture_ms),
        "capture_and_rewrite_seconds_total": round(sum(capture_ms) / 1e3, 2),
        "operator": op.counters.as_dict(),
        "replay": None if op.replay is None else op.replay.counters.as_dict(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
