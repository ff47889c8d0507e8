"""The one pipeline's own host time per frame, outside the graphs, on the CPU.

Moshi at its real depths (the LM's 32 layers, the depformer's 6, Mimi's 8-layer transformers: every
site a bound operator walks, reads and commits each call) and the tiny widths of
`moshi_stream.TINY` (little arithmetic), transformed by `transform(models, contract)` and streamed
greedily, one session. On a CPU the replay engine runs each class's rewritten graph eagerly; the
time inside those graphs is measured around them and taken out of each frame's time, which leaves
what the bound operators and the engine spend in Python: the part of a frame a GPU waits for at
batch 1 (`bench/moshi.py` measures the frame itself on the H200).

    python bench/pipeline_host.py --out bench/results/pipeline_host.json
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

# Run as a script, this file's folder is sys.path[0], where `import moshi` would find bench/moshi.py.
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != Path(__file__).resolve().parent]

from cadence_fx import transform  # noqa: E402
from cadence_fx.models.moshi import contract_for  # noqa: E402
from cadence_fx.models.moshi_stream import TINY, MoshiConfig, build_models, random_pcm  # noqa: E402
from cadence_fx.report import latency_stats, measured_commit  # noqa: E402

WARM_UP = 10  # frames before the measured ones: every class verified, the state settled


def deep_tiny() -> MoshiConfig:
    """TINY's widths at the real depths."""
    mimi = {key: dict(value) if isinstance(value, dict) else value for key, value in TINY.mimi.items()}
    mimi["transformer"] = dict(mimi["transformer"], num_layers=8)
    return MoshiConfig(mimi=mimi, lm_kwargs=TINY.lm_kwargs | dict(num_layers=32, depformer_num_layers=6), lm_dtype=torch.float32)


def measure(transformed, frames: list[torch.Tensor]) -> dict:
    """Per measured frame: its time, the time inside the graphs, and the rest (the host's)."""
    inside = [0.0]
    engines = [op.replay for model in transformed.bound.values() for op in model.operators.values() if op.replay is not None]
    graphs = [engine.fn for engine in engines]
    for engine, graph in zip(engines, graphs):

        def timed(*args, _graph=graph, **kwargs):
            started = time.perf_counter()
            try:
                return _graph(*args, **kwargs)
            finally:
                inside[0] += time.perf_counter() - started

        engine.fn = timed
    frame_ms, graph_ms = [], []
    try:
        with transformed.session(sampling=False, seed=1) as step:
            for i, frame in enumerate(frames):
                inside[0] = 0.0
                started = time.perf_counter()
                step(frame)
                if i >= WARM_UP:
                    frame_ms.append((time.perf_counter() - started) * 1e3)
                    graph_ms.append(inside[0] * 1e3)
    finally:  # the next run times the graphs themselves, not this run's wrappers around them
        for engine, graph in zip(engines, graphs):
            engine.fn = graph
    host_ms = [f - g for f, g in zip(frame_ms, graph_ms)]
    return {"frame_ms": latency_stats(frame_ms), "graph_ms": latency_stats(graph_ms), "host_ms": latency_stats(host_ms)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=50, help="measured frames a run (80 ms each), after the warm-up")
    parser.add_argument("--runs", type=int, default=2, help="sessions measured, one after another")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.frames < 1 or args.runs < 1 or args.threads < 1:
        parser.error("--frames, --runs and --threads must be at least 1")
    torch.set_num_threads(args.threads)
    config = deep_tiny()
    print("building Moshi at its real depths, tiny widths (CPU, random weights)...", file=sys.stderr, flush=True)
    models = build_models(config)
    started = time.perf_counter()
    transformed, report = transform(models, contract_for(config))
    setup_s = time.perf_counter() - started
    print(f"transformed in {setup_s:.1f} s; {args.runs} run(s) of {args.frames} frames...", file=sys.stderr, flush=True)
    frames = list(random_pcm(WARM_UP + args.frames, seed=1).split(models.mimi.frame_size, dim=-1))
    runs = []
    for run in range(args.runs):
        runs.append(measure(transformed, frames))
        print(
            f"  run {run}: host {runs[-1]['host_ms']['p50']:.2f} ms a frame (p50), graphs {runs[-1]['graph_ms']['p50']:.2f} ms",
            file=sys.stderr,
            flush=True,
        )
    counters = transformed.counters()
    transformed.close()
    dirty = bool(subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True).stdout.strip())
    record = {
        "benchmark": "pipeline_host",
        "commit": measured_commit(),
        "worktree_dirty": dirty,
        "command": " ".join([sys.executable, *sys.argv]) if argv is None else "bench/pipeline_host.py " + " ".join(argv),
        "device": platform.processor() or "cpu",
        "cpu_count": os.cpu_count(),
        "torch_threads": args.threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "config": "Moshi: LM 32 layers, depformer 6, Mimi transformers 8; TINY widths; greedy, one session",
        "warm_up_frames": WARM_UP,
        "setup_s": setup_s,
        "runs": runs,
        "operators": counters,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
