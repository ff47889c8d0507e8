"""Can Token2Wav streams share one batched call and each stay bit for bit itself? A probe of the
flow's DiT estimator (issue 14: "batching streams of the same class into one graph only where
each stream stays bit-identical to its own single-stream eager run: prove it per class or refuse").

One stream (MiniCPM-o 4.5's flow at full depth, random weights, a random prompt) runs its first
chunks; the estimator's inputs of a steady chunk's first Euler step are kept (a CFG pair: batch 2,
its attention and convolution caches at that chunk's extent). N streams' inputs are that pair
perturbed N ways (the same shapes: one catalog class). Each stream's estimator call alone is
compared with its rows of one call on all N stacked (batch 2N), with `torch.equal` on the velocity
and both new caches, under the deterministic settings the transform pins. Also timed: the batched
call against the N single calls (CUDA events, median of repeats).

    python bench/token2wav_batch_probe.py --streams 2,4,8,16,32 --out bench/results/token2wav_batch_probe.json

Needs CUDA (the question is about the GPU's kernels); the record says which streams were equal.

``--envelope C`` asks the same question under the batch-invariant envelope at capacity C
(`models/token2wav_envelope.py`, the padded route on CUDA: every batch-sensitive op at C rows per
row of a stream, each stream's single call padded the same way), for the GPU issue to run:

    python bench/token2wav_batch_probe.py --streams 2,4,8,16,32 --envelope 32 \\
        --out bench/results/token2wav_batch_probe_envelope.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402

from cadence_fx.determinism import pin_deterministic, settings  # noqa: E402
from cadence_fx.models.token2wav_envelope import StreamRng, batch_invariant  # noqa: E402
from cadence_fx.models.token2wav_envelope import settings as envelope_settings  # noqa: E402
from cadence_fx.models.token2wav_stream import (  # noqa: E402
    FULL_DEPTH,
    N_TIMESTEPS,
    StockStream,
    build_flow,
    build_hift,
    random_chunks,
    random_prompt,
)
from cadence_fx.report import measured_commit  # noqa: E402

BATCH_AXIS = {"x": 0, "mu": 0, "t": 0, "spks": 0, "cond": 0, "cnn_cache": 1, "att_cache": 1}


def steady_inputs(device: torch.device, chunks: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The flow, and its estimator's keyword inputs at the first Euler step of the last of
    `chunks` chunks."""
    flow, hift = build_flow(FULL_DEPTH, device=device), build_hift(device=device)
    estimator = flow.decoder.estimator
    seen: list[dict[str, torch.Tensor]] = []
    original = estimator.forward_chunk

    def record(**kwargs):
        seen.append({k: None if v is None else v.detach().clone() for k, v in kwargs.items()})
        return original(**kwargs)

    estimator.forward_chunk = record
    try:
        StockStream(flow, hift, random_prompt(0, device=device)).run(random_chunks(0, chunks, device=device), last_chunk=False)
    finally:
        del estimator.forward_chunk
    return flow, seen[-N_TIMESTEPS]  # N_TIMESTEPS Euler steps a chunk: the last chunk's first step


def perturbed(base: dict[str, torch.Tensor], index: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator(device=base["x"].device).manual_seed(1000 + index)
    out = {}
    for name, value in base.items():
        if value.is_floating_point() and name != "t":
            noise = torch.randn(value.shape, generator=generator, device=value.device, dtype=value.dtype)
            out[name] = value + 0.05 * noise * value.abs().mean()
        else:
            out[name] = value.clone()
    return out


def _scope(capacity: int | None, streams: int):
    """The batch-invariant envelope for a call of `streams` streams, or nothing (the stock kernels)."""
    if capacity is None:
        return contextlib.nullcontext()
    return batch_invariant(capacity, [StreamRng(i) for i in range(streams)], "cuda")


def alone(estimator, inputs: dict[str, torch.Tensor], capacity: int | None = None) -> tuple[torch.Tensor, ...]:
    """One stream's call, its outputs copied out of the estimator's own buffers (its new caches are
    views of them, which the next call overwrites)."""
    with _scope(capacity, 1):
        return tuple(out.clone() for out in estimator.forward_chunk(**inputs))


def together(estimator, streams: list[dict[str, torch.Tensor]], capacity: int | None = None) -> tuple[torch.Tensor, ...]:
    """One call on every stream's inputs stacked on the batch axis. The vendor writes a call's new
    caches into buffers of batch 2 (one CFG pair): for the call they are buffers of batch 2N, the
    same in every other dimension, zeroed as the vendor's are."""
    stacked = {k: torch.cat([s[k] for s in streams], dim=BATCH_AXIS[k]) for k in streams[0]}
    own = estimator.cnn_cache_buffer, estimator.att_cache_buffer
    pairs = len(streams)
    estimator.cnn_cache_buffer = own[0].new_zeros((own[0].shape[0], 2 * pairs, *own[0].shape[2:]))
    estimator.att_cache_buffer = own[1].new_zeros((own[1].shape[0], 2 * pairs, *own[1].shape[2:]))
    try:
        with _scope(capacity, pairs):
            return tuple(out.clone() for out in estimator.forward_chunk(**stacked))
    finally:
        estimator.cnn_cache_buffer, estimator.att_cache_buffer = own


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="2,4,8,16,32", help="stream counts, comma-separated")
    parser.add_argument("--chunks", type=int, default=4, help="chunks the source stream runs (the last is the steady one)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--envelope",
        type=int,
        metavar="C",
        help="under the batch-invariant envelope at capacity C (at least the largest --streams)",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs CUDA: the question is whether the GPU's kernels give each stream's rows the same bits")
    counts = [int(n) for n in args.streams.split(",")]
    if any(n < 1 for n in counts):
        parser.error(f"--streams takes positive counts, got {args.streams}")
    if args.envelope is not None and args.envelope < max(counts):
        parser.error(f"--envelope {args.envelope}: the capacity must hold the largest --streams ({max(counts)})")
    device = torch.device("cuda")
    pin_deterministic()
    # As Token2wav.stream runs the flow: under autocast at float32 (which leaves its kernels as they are).
    with torch.inference_mode(), torch.amp.autocast("cuda", dtype=torch.float32):
        flow, base = steady_inputs(device, args.chunks)
        estimator = flow.decoder.estimator
        shapes = {k: list(v.shape) for k, v in base.items()}
        print(f"steady estimator inputs: {shapes}", file=sys.stderr)
        results = {}
        for n in counts:
            streams = [perturbed(base, i) for i in range(n)]
            singles = [alone(estimator, stream, args.envelope) for stream in streams]
            batched = together(estimator, streams, args.envelope)
            equal, worst = [], 0.0
            for i, outs in enumerate(singles):
                rows = (batched[0][2 * i : 2 * i + 2], batched[1][:, 2 * i : 2 * i + 2], batched[2][:, 2 * i : 2 * i + 2])
                equal.append([torch.equal(a, b) for a, b in zip(outs, rows, strict=True)])
                worst = max([worst, *(float((a - b).abs().max()) for a, b in zip(outs, rows))])
            single_ms = timed(lambda: [alone(estimator, stream, args.envelope) for stream in streams], args.repeats)
            batched_ms = timed(lambda: together(estimator, streams, args.envelope), args.repeats)
            results[str(n)] = {
                "streams_bit_identical": sum(all(e) for e in equal),
                "of": n,
                "outputs_equal_per_stream": [dict(zip(("velocity", "cnn_cache", "att_cache"), e)) for e in equal],
                "max_abs_difference": worst,
                "n_single_calls_ms": round(single_ms, 3),
                "one_batched_call_ms": round(batched_ms, 3),
            }
            print(
                f"N={n}: {sum(all(e) for e in equal)} of {n} streams bit-identical (max |diff| {worst:.3g}); "
                f"{n} single calls {single_ms:.2f} ms, one batched call {batched_ms:.2f} ms",
                file=sys.stderr,
            )
    record = {
        "benchmark": "token2wav_batch_probe",
        "commit": measured_commit(),
        "command": "python " + " ".join([f"bench/{Path(__file__).name}", *(argv if argv is not None else sys.argv[1:])]),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "determinism": settings(),
        "batch_invariant_envelope": None if args.envelope is None else envelope_settings(args.envelope),
        "estimator_inputs": shapes,
        "streams": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
