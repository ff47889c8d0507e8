"""Moshi end to end: eager, the vendor's CUDAGraphed wrappers, and cadence-fx, in one process.

Every arm streams the same PCM through the vendor's frame loop (`mimi.encode` -> `LMGen.step` ->
`mimi.decode`, batch 1, as `moshi/server.py` does), greedy and sampling, each stream from the same
seed, and is compared bit for bit with the eager arm (tokens and float32 PCM). Per frame: wall
latency (CUDA-synchronised); per arm: peak allocated memory above the weights, kernel time and
launches per frame over steady frames (torch.profiler), replay counters.

    python bench/moshi.py --out bench/results/moshi.json                      # full size, GPU
    python bench/moshi.py --small --frames 10 --streams 1 --out /tmp/moshi.json  # CPU smoke

Arms: eager (vendor graphs off: `moshi.utils.compile.no_cuda_graph()`); vendor (its `CUDAGraphed`
wrappers, which capture on the second call of every session, so each stream's first two frames
are left out of the steady statistics of every arm); cadence (`transform(models, contract)`: Mimi
and the LM transformed from their bindings on the one pipeline, `models/moshi_bound.py`; its
set-up streams a few frames of silence per decoding mode, counted in `replay`). The vendor's lazily
`torch.compile`d kernels stay off in every arm (`no_compile()`), so all arms run the same kernels.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

# Run as a script, this file's folder is sys.path[0], where `import moshi` would find this file.
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != Path(__file__).resolve().parent]

from moshi.models import LMGen  # noqa: E402
from moshi.utils.compile import no_compile, no_cuda_graph  # noqa: E402

from cadence_fx import transform  # noqa: E402
from cadence_fx.determinism import pin_deterministic  # noqa: E402
from cadence_fx.memory import DeviceMemory  # noqa: E402
from cadence_fx.models.moshi import contract_for  # noqa: E402
from cadence_fx.models.moshi_stream import FULL, SMALL, build_models, random_pcm  # noqa: E402
from cadence_fx.report import format_bytes, latency_stats, measured_commit  # noqa: E402

ARMS = ("eager", "vendor", "cadence")
STEADY_FROM = 2  # the vendor captures on a session's second frame


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def vendor_session(models, *, sampling: bool, seed: int, graphs: bool):
    """The vendor loop, one frame per `step`, with or without its CUDA graphs."""
    lm_gen = LMGen(models.lm, use_sampling=sampling)
    torch.manual_seed(seed)
    with contextlib.ExitStack() as stack:
        stack.enter_context(no_compile())
        if not graphs:
            stack.enter_context(no_cuda_graph())
        stack.enter_context(torch.no_grad())
        stack.enter_context(models.mimi.streaming(1))
        stack.enter_context(lm_gen.streaming(1))

        def step(frame):
            tokens = lm_gen.step(models.mimi.encode(frame))
            return (None, None) if tokens is None else (tokens, models.mimi.decode(tokens[:, 1:]))

        yield step


class Arm:
    """One arm: how it opens a session, and what it holds."""

    def __init__(self, name: str, models, contract):
        self.name, self.models, self.transformed, self.report = name, models, None, None
        if name == "cadence":
            self.transformed, self.report = transform(models, contract)

    def session(self, *, sampling: bool, seed: int):
        if self.transformed is not None:
            return self.transformed.session(sampling=sampling, seed=seed)
        return vendor_session(self.models, sampling=sampling, seed=seed, graphs=self.name == "vendor")


def run_stream(arm: Arm, pcm: torch.Tensor, *, sampling: bool, seed: int, device: torch.device):
    frame_ms, tokens, audio = [], [], []
    with arm.session(sampling=sampling, seed=seed) as step:
        for frame in pcm.split(arm.models.mimi.frame_size, dim=-1):
            _sync(device)
            start = time.perf_counter()
            codes, out = step(frame)
            _sync(device)
            frame_ms.append((time.perf_counter() - start) * 1e3)
            if codes is not None:
                tokens.append(codes.cpu())
                audio.append(out.float().cpu())
    return frame_ms, torch.cat(tokens, dim=-1), torch.cat(audio, dim=-1)


def profile_frames(arm: Arm, pcm: torch.Tensor, frames: int, device: torch.device) -> dict | None:
    """Kernel time and launches per steady frame (CUDA only)."""
    if device.type != "cuda" or frames <= 0:
        return None
    from torch.profiler import ProfilerActivity, profile

    chunks = list(pcm.split(arm.models.mimi.frame_size, dim=-1))
    with arm.session(sampling=True, seed=0) as step:
        for frame in chunks[: STEADY_FROM + 1]:
            step(frame)
        _sync(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for frame in chunks[STEADY_FROM + 1 : STEADY_FROM + 1 + frames]:
                step(frame)
            _sync(device)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return {
        "frames": frames,
        "launches_per_frame": len(events) / frames,
        "kernel_ms_per_frame": sum(e.device_time for e in events) / 1e3 / frames,
    }


def run_arm(name: str, models, contract, streams: dict, args, device: torch.device, memory: DeviceMemory) -> tuple[dict, dict]:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    memory.reset_peak()
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    started = time.perf_counter()
    arm = Arm(name, models, contract)
    setup_s = time.perf_counter() - started
    warmup = random_pcm(args.warmup_frames, seed=99, device=device)
    for sampling in (True, False):
        run_stream(arm, warmup, sampling=sampling, seed=99, device=device)
    setup_peak = (torch.cuda.max_memory_allocated(device) - base) if device.type == "cuda" else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    steady, first_frames, outputs = [], [], {}
    for mode, sampling in (("sampling", True), ("greedy", False)):
        for i, pcm in enumerate(streams[mode]):
            ms, tokens, audio = run_stream(arm, pcm, sampling=sampling, seed=args.seed + i, device=device)
            steady += ms[STEADY_FROM:]
            first_frames.append(ms[:STEADY_FROM])
            outputs[mode, i] = (tokens, audio)
            memory.sample()
    device_memory = memory.record()
    held = (torch.cuda.memory_allocated(device) - base) if device.type == "cuda" else None
    streams_peak = (torch.cuda.max_memory_allocated(device) - base) if device.type == "cuda" else None
    kernels = profile_frames(arm, streams["sampling"][0], args.profile_frames, device)
    result = {
        "setup_s": setup_s,
        "frame_ms_steady": latency_stats(steady),
        "frame_ms_first_two_per_stream": first_frames,
        # Above the shared weights: while the arm is set up and warmed up (captures, certification
        # probes), then over the measured streams; held: what the arm keeps between sessions.
        "peak_allocated_bytes_above_weights": None if setup_peak is None else max(setup_peak, streams_peak),
        "peak_allocated_bytes_above_weights_setup": setup_peak,
        "peak_allocated_bytes_above_weights_streams": streams_peak,
        "held_after_streams_bytes_above_weights": held,
        # What the device sees (cadence_fx.memory), for the process since its start: the shared
        # weights included; peak allocated over the measured streams, reserved and footprint.
        "memory": device_memory,
        "kernels": kernels,
    }
    if arm.transformed is not None:
        result["replay"] = arm.transformed.counters()
        result["certificates"] = {
            name: [c.explain() for c in e.certificates.values()] for name, e in arm.transformed.replays.items()
        }
        result["transform_stamps"] = arm.report.stamps
    del arm
    gc.collect()
    return result, outputs


def _eager_repeats(models, pcm: torch.Tensor, device: torch.device, seed: int) -> bool:
    arm = Arm("eager", models, None)
    _, tokens_a, audio_a = run_stream(arm, pcm, sampling=True, seed=seed, device=device)
    _, tokens_b, audio_b = run_stream(arm, pcm, sampling=True, seed=seed, device=device)
    return torch.equal(tokens_a, tokens_b) and torch.equal(audio_a, audio_b)


def _plot(record: dict, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "skipped: matplotlib is not installed"
    arms = list(record["arms"])
    fig, (lat, mem) = plt.subplots(1, 2, figsize=(10, 4))
    for i, key in enumerate(("p50", "p95")):
        values = [record["arms"][a]["frame_ms_steady"][key] for a in arms]
        lat.bar([x + 0.4 * i for x in range(len(arms))], values, width=0.4, label=key)
    lat.set_xticks([x + 0.2 for x in range(len(arms))], arms)
    lat.set_ylabel("ms per 80 ms frame")
    lat.legend()
    peaks = [record["arms"][a]["peak_allocated_bytes_above_weights"] for a in arms]
    mem.bar(arms, [(p or 0) / 2**30 for p in peaks])
    mem.set_ylabel("peak GiB above weights")
    if all(p is None for p in peaks):
        mem.set_title("not measured without CUDA")
    fig.suptitle(f"Moshi {record['config']} on {record['device']}")
    fig.tight_layout()
    fig.savefig(path)
    return str(path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="the reduced CPU configuration (moshi_stream.SMALL)")
    parser.add_argument("--frames", type=int, default=50, help="frames per stream (80 ms each)")
    parser.add_argument("--streams", type=int, default=3, help="streams per decoding mode")
    parser.add_argument("--warmup-frames", type=int, default=5, help="one unmeasured stream per mode and arm")
    parser.add_argument("--profile-frames", type=int, default=10, help="steady frames under torch.profiler (CUDA)")
    parser.add_argument("--repeat-frames", type=int, default=10, help="frames of the eager-against-itself check")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    arms = args.arms.split(",")
    if set(arms) - set(ARMS) or arms[0] != "eager":
        parser.error(f"--arms must start with eager and name only {ARMS}, got {arms}")
    if args.frames <= STEADY_FROM or args.warmup_frames <= STEADY_FROM or args.streams < 1:
        parser.error(f"need at least 1 stream, and streams and warm-ups of more than {STEADY_FROM} frames")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    memory = DeviceMemory(device)  # first: the device footprint counts from here
    settings = pin_deterministic()
    config = SMALL if args.small else FULL
    started = time.perf_counter()
    models = build_models(config, device=device)
    build_s = time.perf_counter() - started
    contract = contract_for(config)
    streams = {
        mode: [random_pcm(args.frames, seed=1000 * m + i, device=device) for i in range(args.streams)]
        for m, mode in enumerate(("sampling", "greedy"))
    }
    repeat_pcm = streams["sampling"][0][..., : models.mimi.frame_size * min(args.frames, args.repeat_frames)]
    repeats = _eager_repeats(models, repeat_pcm, device, args.seed)
    print(f"device {device}; built in {build_s:.1f} s; eager repeats itself: {repeats}", flush=True)

    results, reference = {}, None
    for name in arms:
        print(f"arm {name}...", flush=True)
        result, outputs = run_arm(name, models, contract, streams, args, device, memory)
        if reference is None:
            reference = outputs
        result["streams_equal_to_eager"] = {
            mode: {
                "tokens": sum(torch.equal(outputs[mode, i][0], reference[mode, i][0]) for i in range(args.streams)),
                "pcm": sum(torch.equal(outputs[mode, i][1], reference[mode, i][1]) for i in range(args.streams)),
                "of": args.streams,
            }
            for mode in ("sampling", "greedy")
        }
        results[name] = result
        s = result["frame_ms_steady"]
        print(
            f"  {name}: steady frame p50 {s['p50']:.2f} ms p95 {s['p95']:.2f} ms, peak "
            f"{format_bytes(result['peak_allocated_bytes_above_weights'])}, equal {result['streams_equal_to_eager']}",
            flush=True,
        )

    summary = {}
    if "vendor" in results and "cadence" in results:
        vendor, cadence = results["vendor"], results["cadence"]
        exact = all(v["tokens"] == v["pcm"] == v["of"] for v in cadence["streams_equal_to_eager"].values())
        ratio = cadence["frame_ms_steady"]["p50"] / vendor["frame_ms_steady"]["p50"]
        peaks = (cadence["peak_allocated_bytes_above_weights"], vendor["peak_allocated_bytes_above_weights"])
        steady_peaks = (
            cadence["peak_allocated_bytes_above_weights_streams"],
            vendor["peak_allocated_bytes_above_weights_streams"],
        )
        summary = {
            "cadence_over_vendor_p50": ratio,
            "target_time_at_most_vendor": ratio <= 1.0,
            "target_bit_exact_all_streams": exact,
            "target_peak_memory_at_most_vendor": None if None in peaks else peaks[0] <= peaks[1],
            "streams_peak_memory_at_most_vendor": None if None in steady_peaks else steady_peaks[0] <= steady_peaks[1],
        }
    commit = measured_commit()
    dirty = bool(subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True).stdout.strip())
    record = {
        "benchmark": "moshi",
        "commit": commit,
        "worktree_dirty": dirty,
        "command": " ".join([sys.executable, *sys.argv]) if argv is None else "bench/moshi.py " + " ".join(argv),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "config": "small" if args.small else "full",
        "frames_per_stream": args.frames,
        "streams_per_mode": args.streams,
        "steady_frames_from": STEADY_FROM,
        "build_s": build_s,
        "determinism": settings,
        "env_NO_CUDA_GRAPH": os.environ.get("NO_CUDA_GRAPH"),
        "vendor_graphs_active": device.type == "cuda" and not os.environ.get("NO_CUDA_GRAPH"),
        "torch_compile": "off in every arm (moshi.utils.compile.no_compile)",
        "eager_repeats_itself": repeats,
        "arms": results,
        "summary": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record["png"] = _plot(record, args.out.with_suffix(".png"))
    args.out.write_text(json.dumps(record, indent=1, default=str))
    print(f"wrote {args.out} (png: {record['png']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
