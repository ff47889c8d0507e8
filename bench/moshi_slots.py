"""Moshi sessions as the slots of one batch: per batch size B, the vendor's own batched loop
(eager, and with its `CUDAGraphed` wrappers) against cadence-fx's `MoshiSlots` (every stage
replayed at batch B), in one process.

Per B, every arm runs the same schedule: B sessions join at tick 0 and every slot is live on
every tick (the capacity case), each slot its own random speech-level PCM, sampling on (one
seed for the batch, as the vendor samples all rows from one generator). One tick = Mimi encode
+ `LMGen.step` + Mimi decode for all B slots, CUDA-synchronised, from host frames to device
outputs. Per arm: tick p50/p95 over the steady ticks (from tick `STEADY_FROM`: the vendor
captures on its second call), the host's part of each (`host_ms_steady`: until the tick's call
returns, before the device is waited for; where it is near the tick, the host bounds it), peak allocated
(`torch.cuda.max_memory_allocated`, weights
included), `torch.cuda.memory_reserved` and the device footprint (`torch.cuda.mem_get_info`:
used bytes, less what was used when this process started), each at the arm's end and at its
largest over the arm's ticks (`cadence_fx.memory.DeviceMemory`); per slot, whether its tokens and PCM equal the eager arm's bit
for bit; for cadence-fx,
the replay counters (every stage replayed: captures 1, eager 0). Arms run one after another, each
freeing its batch before the next (at B = 64 one batch's rings alone are 100 GB at full size).

    python bench/moshi_slots.py --slots 1,8,16,32,64 --out bench/results/moshi_slots.json   # full size, H200
    python bench/moshi_slots.py --small --slots 1,2 --ticks 4 --out /tmp/moshi_slots.json    # CPU smoke

`--slots` is the list of batch sizes, `--arms` a subset of eager,vendor,cadence (eager first:
it is the reference of the others). The vendor's lazily compiled kernels stay off in every arm
(`no_compile`), and kernels are pinned deterministic for all (`pin_deterministic`).
"""

from __future__ import annotations

import argparse
import gc
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

from cadence_fx.catalog import derive  # noqa: E402
from cadence_fx.determinism import pin_deterministic  # noqa: E402
from cadence_fx.memory import DeviceMemory  # noqa: E402
from cadence_fx.models.moshi import contract_for  # noqa: E402
from cadence_fx.models.moshi_slots import Tick, transform_slots, vendor_ticks  # noqa: E402
from cadence_fx.models.moshi_stream import FULL, SMALL, build_models, random_pcm  # noqa: E402
from cadence_fx.report import latency_stats, measured_commit  # noqa: E402

ARMS = ("eager", "vendor", "cadence")
STEADY_FROM = 2  # the vendor's CUDAGraphed wrappers capture on their second call


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def schedule(slots: int, ticks: int, frame_size: int) -> list[Tick]:
    """Every slot joins at tick 0 and is live on every tick, each with its own PCM."""
    pcm = [random_pcm(ticks, seed=1000 + slot).reshape(ticks, frame_size) for slot in range(slots)]
    return [
        Tick({slot: pcm[slot][t] for slot in range(slots)}, joins=tuple(range(slots)) if t == 0 else ()) for t in range(ticks)
    ]


def run_arm(
    name: str, models, slots: int, ticks: list[Tick], args, device: torch.device, memory: DeviceMemory
) -> tuple[dict, list]:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    memory.reset_peak()
    setup_s, runtime, counters = 0.0, None, None
    if name == "cadence":
        started = time.perf_counter()
        runtime, report = transform_slots(
            models, contract_for(models.config, slots=slots), sampling=not args.greedy, seed=args.seed
        )
        setup_s = time.perf_counter() - started
        step = iter(runtime.tick(tick) for tick in ticks)
    else:
        step = vendor_ticks(models, slots, ticks, sampling=not args.greedy, seed=args.seed, cuda_graphs=name == "vendor")
    tick_ms, host_ms, outputs = [], [], []
    while True:
        _sync(device)
        started = time.perf_counter()
        out = next(step, None)
        returned = time.perf_counter()
        _sync(device)
        if out is None:
            break
        tick_ms.append((time.perf_counter() - started) * 1e3)
        host_ms.append((returned - started) * 1e3)
        memory.sample()
        outputs.append((out.speaking, out.tokens.cpu(), out.pcm.cpu()))
    result = {
        "tick_ms_steady": latency_stats(tick_ms[STEADY_FROM:]),
        "tick_ms_first": tick_ms[:STEADY_FROM],
        "host_ms_steady": latency_stats(host_ms[STEADY_FROM:]),
        "setup_s": setup_s,
        **memory.record(),
    }
    if runtime is not None:
        counters = runtime.counters()
        result["replay"] = counters
        result["every_stage_replayed"] = all(
            c["captures"] == 1 and c["eager"] == 0 and c["replays"] == c["calls"] for c in counters.values()
        )
        result["transform_stamps"] = report.stamps
        runtime.close()
    del step, runtime
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result, outputs


def exact_slots(outputs: list, reference: list, slots: int) -> dict:
    """Per slot, whether every tick's tokens and PCM equal the reference's bit for bit."""
    same_speaking = all(mine[0] == theirs[0] for mine, theirs in zip(outputs, reference))
    tokens = [all(torch.equal(m[1][s], r[1][s]) for m, r in zip(outputs, reference)) for s in range(slots)]
    pcm = [all(torch.equal(m[2][s], r[2][s]) for m, r in zip(outputs, reference)) for s in range(slots)]
    return {"speaking_equal": same_speaking, "tokens_equal_slots": sum(tokens), "pcm_equal_slots": sum(pcm), "of": slots}


def capacity(points: list[tuple[int, int]], total: int | None) -> dict | None:
    """Peak allocated as a line in B (least squares over the measured batches), and the largest B
    that line keeps within the device's memory."""
    if total is None or len(points) < 2:
        return None
    n = len(points)
    mean_b = sum(b for b, _ in points) / n
    mean_p = sum(p for _, p in points) / n
    slope = sum((b - mean_b) * (p - mean_p) for b, p in points) / sum((b - mean_b) ** 2 for b, _ in points)
    intercept = mean_p - slope * mean_b
    return {
        "bytes_per_slot": slope,
        "bytes_at_zero_slots": intercept,
        "device_total_bytes": total,
        "largest_slots_predicted": int((total - intercept) // slope) if slope > 0 else None,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", default="1,8,16,32,64", help="batch sizes, comma-separated")
    parser.add_argument("--ticks", type=int, default=12, help="ticks per arm and batch (80 ms of audio each)")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--small", action="store_true", help="the reduced configuration (moshi_stream.SMALL)")
    parser.add_argument("--greedy", action="store_true", help="decode greedily (default: sampling, as served)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        batches = [int(b) for b in args.slots.split(",")]
    except ValueError:
        parser.error(f"--slots takes batch sizes separated by commas, e.g. 1,8,16, got {args.slots!r}")
    if any(b < 1 for b in batches):
        parser.error(f"--slots: every batch size must be at least 1, got {batches}")
    arms = args.arms.split(",")
    if set(arms) - set(ARMS) or arms[0] != "eager":
        parser.error(f"--arms must start with eager and name only {ARMS}, got {arms}")
    if args.ticks <= STEADY_FROM:
        parser.error(f"--ticks must be more than {STEADY_FROM} (the first {STEADY_FROM} are not steady)")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    memory = DeviceMemory(device)  # this process's CUDA context and whatever else held the device: the baseline
    settings = pin_deterministic()
    config = SMALL if args.small else FULL
    started = time.perf_counter()
    models = build_models(config, device=device)
    build_s = time.perf_counter() - started
    weights = sum(t.numel() * t.element_size() for m in (models.mimi, models.lm) for t in (*m.parameters(), *m.buffers()))
    print(f"device {device}; built in {build_s:.1f} s; weights {weights / 2**30:.2f} GiB", flush=True)
    # Exactness is defined against a deterministic eager baseline: eager first against itself.
    check = schedule(batches[0], STEADY_FROM + 2, models.mimi.frame_size)
    runs = [run_arm("eager", models, batches[0], check, args, device, memory)[1] for _ in range(2)]
    repeats = exact_slots(runs[0], runs[1], batches[0])
    print(f"eager repeats itself at B={batches[0]}: {repeats}", flush=True)

    def write() -> None:
        """The record of the batch sizes done so far: a run cut short by its time limit keeps them."""
        total = torch.cuda.mem_get_info(device)[1] if device.type == "cuda" else None
        fits = {
            arm: capacity([(int(b), r["arms"][arm]["peak_allocated_bytes"]) for b, r in results.items()], total)
            for arm in arms
            if device.type == "cuda"
        }
        try:
            dirty = bool(subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True).stdout.strip())
        except FileNotFoundError:  # a copy of the tree without git (the GPU machine's): CADENCE_COMMIT names it
            dirty = None
        record = {
            "benchmark": "moshi_slots",
            "commit": measured_commit(),
            "worktree_dirty": dirty,
            "command": " ".join(["python", "bench/moshi_slots.py", *(sys.argv[1:] if argv is None else argv)]),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__,
            "python": platform.python_version(),
            "config": "small" if args.small else "full",
            "sampling": not args.greedy,
            "ticks_per_arm": args.ticks,
            "steady_ticks_from": STEADY_FROM,
            "build_s": build_s,
            "weights_bytes": weights,
            "device_used_at_start_bytes": memory.used_at_start,
            "determinism": settings,
            "eager_repeats_itself": repeats,
            "torch_compile": "off in every arm (moshi.utils.compile.no_compile)",
            "slots": results,
            "capacity_fit_of_peak_allocated": fits,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1, default=str))

    results = {}
    for slots in batches:
        ticks = schedule(slots, args.ticks, models.mimi.frame_size)
        catalog = derive(contract_for(config, slots=slots))
        per_b = {"catalog_ring_bytes": sum(region.bytes for region in catalog.regions), "arms": {}}
        reference = None
        for name in arms:
            print(f"B={slots} arm {name}...", flush=True)
            result, outputs = run_arm(name, models, slots, ticks, args, device, memory)
            if reference is None:
                reference = outputs
            result["slots_equal_to_eager"] = exact_slots(outputs, reference, slots)
            per_b["arms"][name] = result
            s = result["tick_ms_steady"]
            print(
                f"  p50 {s['p50']:.2f} ms p95 {s['p95']:.2f} ms; peak {result['peak_allocated_bytes']}; "
                f"equal {result['slots_equal_to_eager']}",
                flush=True,
            )
        if "vendor" in per_b["arms"] and "cadence" in per_b["arms"]:
            vendor, cadence = per_b["arms"]["vendor"], per_b["arms"]["cadence"]
            exact = cadence["slots_equal_to_eager"]
            per_b["summary"] = {
                "cadence_over_vendor_p50": cadence["tick_ms_steady"]["p50"] / vendor["tick_ms_steady"]["p50"],
                "cadence_real_time_p95": cadence["tick_ms_steady"]["p95"] < 80.0,
                "cadence_bit_exact_every_slot": exact["tokens_equal_slots"] == exact["pcm_equal_slots"] == slots
                and exact["speaking_equal"],
                "cadence_every_stage_replayed": cadence["every_stage_replayed"],
            }
        results[str(slots)] = per_b
        write()

    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
