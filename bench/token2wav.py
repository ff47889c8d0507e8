"""Token2Wav end to end: the ablation (eager, S, R, Rc, SRc) on the real vendor flow and HiFT.

One process, one device. Every arm streams the same token chunks, turn by turn, through the
vendor's streaming loop (flow `setup_cache` + `inference_chunk`, the caller's trim, HiFT with its
stream cache and cross-fade), from the same RNG state per turn, and is compared bit for bit with
the eager arm (mel and float32 PCM). Per chunk: wall latency (CUDA-synchronised), the CFM loop's
own latency (CUDA events around `decoder.forward_chunk`); per arm: peak allocated memory, replay
counters, kernel time and launches of one steady chunk (torch.profiler). The torch.compile arm
runs in its own process under a time limit, and its outcome is recorded, whatever it is.

    python bench/token2wav.py --out bench/results/token2wav.json            # full size, GPU
    python bench/token2wav.py --depth reduced --blocks 1 --chunks 3 --out /tmp/smoke.json  # CPU smoke

Arms: eager (stock); S (state rule and carry, hot operators eager); R (replay of the stock flow,
the stock cache passed by address: its trim allocates a new cache each chunk, so the address
drifts); Rc (replay of the stock flow with its cache copied into static buffers per class); SRc
(state rule, carry and replay: the carry passed by address); V (the vendor's own CUDA-graph
branch of the DiT, re-bucketed to the live chunk sizes: `rebucket_vendor_graphs`); eager16 and
SRc16 (the vendor's fp16 autocast, `Token2wav(float16=True)`; SRc16 is compared with eager16).

Memory: each arm's peak is recorded over the whole run, over the first turn (where captures
happen) and over the later turns (steady state), next to the memory model's prediction of its
peak delta against eager, derived from the contract alone (`predicted_delta_bytes`).

Capacity (`--capacity 1,2,4,8,16,32`, its own process): N token streams time-multiplexed over
one set of SRc graph bindings. Each stream owns its carries' contents, its cache dict, its HiFT
cache and its CUDA RNG state; before a stream's chunk its state is copied into the carries (the
addresses the graphs read), after it copied back out. Recorded per N: the round time (one chunk
of every stream: the period at which each stream gets its next 1-second chunk) p50/p95, and
whether every stream keeps up with real time; streams 0 and N-1 are checked bit for bit against
the same token streams run alone.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from cadence_fx import transform
from cadence_fx.catalog import derive
from cadence_fx.determinism import check_repeatable, pin_deterministic
from cadence_fx.models.token2wav_carry import ENVELOPES, CarryStream, reference_flow
from cadence_fx.models.token2wav_stream import (
    StockStream,
    build_hift,
    random_chunks,
    random_prompt,
    rebucket_vendor_graphs,
)
from cadence_fx.passes.hoist import HostConstantHoist
from cadence_fx.passes.piecewise import Piecewise
from cadence_fx.replay import ExactShapeReplay, TensorSpec
from cadence_fx.report import format_bytes, latency_stats, measured_commit

ARMS = ("eager", "S", "SRc", "Rc", "R", "V", "eager16", "SRc16")
CHUNK_PERIOD_MS = 1000.0  # one chunk = 50 mel frames = 1 s of speech
TENSOR = TensorSpec((1,)).key()[0]  # how a signature marks a tensor leaf


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Timed:
    """Times every call of a callable (CUDA events on a GPU, wall clock on a CPU)."""

    def __init__(self, fn, device: torch.device):
        self.fn, self.device, self.ms = fn, device, []

    def __call__(self, *args, **kwargs):
        _sync(self.device)
        start = time.perf_counter()
        out = self.fn(*args, **kwargs)
        _sync(self.device)
        self.ms.append((time.perf_counter() - start) * 1e3)
        return out


def _stock_replay(flow, hift, *, aliased: bool):
    """R / Rc: the stock flow and HiFT under ExactShapeReplay, catalog = the stock call shapes."""
    flow, hift = copy.deepcopy(flow), copy.deepcopy(hift)

    def cfm_class(signature):
        names = signature.names()
        att = signature.leaves[names.index("att_cache")] if "att_cache" in names else None
        return None if att is None or att[0] != TENSOR else f"L={att[1][4]} stride={att[2][0]}"

    engine = ExactShapeReplay(
        flow.decoder.forward_chunk,
        cfm_class,
        name="cfm_loop",
        aliased=["cnn_cache", "att_cache"] if aliased else (),
        hooks=[HostConstantHoist()],
    )
    flow.decoder.forward_chunk = engine
    vocoder = ExactShapeReplay(hift, lambda s: True, name="hift", hooks=[Piecewise(), HostConstantHoist()])
    return flow, vocoder, {"cfm_loop": engine, "hift": vocoder}


def _base_arm(arm: str) -> tuple[str, bool]:
    """(arm without its precision, fp16 autocast)."""
    return (arm[:-2], True) if arm.endswith("16") else (arm, False)


def build_arm(arm: str, flow, hift, contract):
    """(flow, vocoder, transformed flow or None, replay engines) of one arm."""
    arm, _ = _base_arm(arm)
    if arm == "eager":
        return flow, hift, None, {}
    if arm in ("S", "SRc"):
        transformed, report = transform((flow, hift), contract, capture=False, replay=arm == "SRc")
        return transformed.flow, transformed.hift, transformed, report.replays
    if arm == "V":
        vendor = copy.deepcopy(flow)
        classes = derive(contract).operator("cfm_loop").classes
        largest = max(c.extent for c in classes)
        rebucket_vendor_graphs(vendor.decoder.estimator, {c.call: largest for c in classes})
        return vendor, hift, None, {}
    stock_flow, vocoder, engines = _stock_replay(flow, hift, aliased=arm == "R")
    return stock_flow, vocoder, None, engines


def predicted_delta_bytes(arm: str, contract) -> int | None:
    """The memory model of DESIGN.md section 2, from the declaration alone: an arm's peak minus
    eager's = its staging (copied inputs, one set per catalog class) plus its envelopes at
    A-dagger minus the stock envelopes. The state rule sets A-dagger = A (the derived demand) for
    every region it resizes; aliasing stages nothing; Rc stages the stock cache once per class.
    R (its addresses drift) and V (the vendor's own buffers) are not modelled: None."""
    arm, _ = _base_arm(arm)
    catalog = derive(contract)
    if arm == "eager":
        return 0
    if arm in ("S", "SRc"):
        return sum(catalog.region(e.region).bytes - catalog.region(e.region).stock_bytes for e in ENVELOPES)
    if arm == "Rc":
        cfm = catalog.operator("cfm_loop")
        att, cnn = catalog.region(cfm.region), catalog.region("estimator_cnn_cache")
        per_frame = att.stock_bytes // att.stock_shape[contract.region(cfm.region).axis]
        return sum(per_frame * c.extent + cnn.stock_bytes for c in cfm.classes)
    return None


def _bytes(*modules) -> int:
    tensors = {id(t): t for m in modules for t in (*m.parameters(), *m.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _peak(device: torch.device, base: int, owned: int) -> int | None:
    return (torch.cuda.max_memory_allocated(device) - base + owned) if device.type == "cuda" else None


def open_stream(arm: str, flow, hift, contract, prompt):
    """One arm's stream: (stream, replay engines)."""
    arm_flow, arm_hift, transformed, engines = build_arm(arm, flow, hift, contract)
    float16 = _base_arm(arm)[1]
    if transformed:
        return CarryStream(transformed, prompt, float16=float16), engines
    return StockStream(arm_flow, arm_hift, prompt, float16=float16), engines


def run_arm(arm, flow, hift, contract, prompt, turns, device, seed):
    """Stream every turn through one arm. Peak memory counts the arm's own model (weights,
    buffers, carries), graph pools and transients: the eager arms own the stock flow and HiFT,
    the other arms own the copies their build made. The first turn's peak includes every
    capture; the later turns' peak is the steady state."""
    owned = _bytes(flow, hift) if _base_arm(arm)[0] == "eager" else 0
    _sync(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    stream, engines = open_stream(arm, flow, hift, contract, prompt)
    timed_cfm = _Timed(stream.flow.decoder.forward_chunk, device)
    stream.flow.decoder.forward_chunk = timed_cfm
    timed_flow = stream.flow_chunk = _Timed(stream.flow_chunk, device)
    chunk_ms, mels, pcm = [], [], []
    first_turn = None
    for turn, chunks in enumerate(turns):
        if turn == 1:
            first_turn = _peak(device, base, owned)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
        torch.manual_seed(seed + turn)
        if device.type == "cuda":
            torch.cuda.manual_seed(seed + turn)
        stream.setup() if turn == 0 else stream.reset_turn()
        timed_cfm.ms.clear()  # setup's CFM call is not a chunk
        for i, tokens in enumerate(chunks):
            _sync(device)
            start = time.perf_counter()
            out = stream.step(tokens, last_chunk=i == len(chunks) - 1)
            _sync(device)
            chunk_ms.append((time.perf_counter() - start) * 1e3)
            mels.append(out.mel.cpu())
            pcm.append(out.speech.float().cpu())
        timed_cfm.ms = timed_cfm.ms[: len(chunks)]
        cfm_ms, flow_ms = list(timed_cfm.ms), list(timed_flow.ms)
        timed_flow.ms.clear()
    end = _peak(device, base, owned)
    first_turn, later_turns = (first_turn, end) if len(turns) > 1 else (end, None)
    overall = None if first_turn is None else max(first_turn, later_turns or 0)
    result = {
        "chunk_ms": chunk_ms,
        "cfm_loop_ms_last_turn": cfm_ms,
        "flow_chunk_ms_last_turn": flow_ms,
        "peak_allocated_bytes": overall,
        "peak_allocated_bytes_first_turn": first_turn,
        "peak_allocated_bytes_later_turns": later_turns,
        "reserved_bytes_end": torch.cuda.memory_reserved(device) if device.type == "cuda" else None,
        "replay": {name: e.counters.as_dict() for name, e in engines.items()},
    }
    return result, mels, pcm, stream


def capacity(flow, hift, contract, prompt, device, sessions: list[int], chunks: int, seed: int) -> dict:
    """N token streams over one set of SRc bindings, round robin (`TransformedFlow.swap_in` /
    `swap_out` around each stream's chunk; see the module docstring)."""
    transformed, report = transform((flow, hift), contract, capture=False, replay=True)

    def run_alone(tokens: list[torch.Tensor], rng_seed: int) -> list[torch.Tensor]:
        stream = CarryStream(transformed, prompt)
        stream.setup()
        transformed.swap_in(transformed.session_state(rng_seed))
        return [stream.step(t, last_chunk=False).speech.float().cpu() for t in tokens]

    run_alone(random_chunks(7, 4, device=device), seed)  # every class captured before the rounds
    records, state_bytes = [], 0
    for n in sessions:
        token_streams = [random_chunks(5000 + i, chunks, device=device) for i in range(n)]
        streams, states, outputs = [], [], [[] for _ in range(n)]
        for i in range(n):
            stream = CarryStream(transformed, prompt)
            if i == 0:
                stream.setup()
            else:
                stream.reset_turn()  # the prompt state the first setup kept, written in place
            streams.append(stream)
            states.append(transformed.session_state(seed + i))
        state_bytes = states[0].nbytes
        round_ms, chunk_ms = [], []
        for c in range(chunks):
            _sync(device)
            round_start = time.perf_counter()
            for i, stream in enumerate(streams):
                start = time.perf_counter()
                transformed.swap_in(states[i])
                outputs[i].append(stream.step(token_streams[i][c], last_chunk=False).speech)
                transformed.swap_out(states[i])
                _sync(device)
                chunk_ms.append((time.perf_counter() - start) * 1e3)
            round_ms.append((time.perf_counter() - round_start) * 1e3)
        exact = {i: all(torch.equal(a.float().cpu(), b) for a, b in zip(outputs[i], run_alone(token_streams[i], seed + i)))
                 for i in sorted({0, n - 1})}
        steady = round_ms[3:]  # the first three chunks cross the classes
        stats = latency_stats(steady)
        record = {
            "sessions": n,
            "round_ms": latency_stats(round_ms),
            "round_ms_steady": stats,
            "chunk_ms_with_swap": latency_stats(chunk_ms),
            "keeps_real_time": stats["p95"] <= CHUNK_PERIOD_MS,
            "streams_checked_exact": {str(i): e for i, e in exact.items()},
            "session_state_bytes": state_bytes * n,
        }
        records.append(record)
        print(f"  capacity N={n}: round p50 {stats['p50']:.1f} ms p95 {stats['p95']:.1f} ms, real time "
              f"{record['keeps_real_time']}, exact {record['streams_checked_exact']}", flush=True)
    keeping = [r["sessions"] for r in records if r["keeps_real_time"] and all(r["streams_checked_exact"].values())]
    return {
        "chunks_per_stream": chunks,
        "chunk_period_ms": CHUNK_PERIOD_MS,
        "carry_bytes_swapped_per_chunk": 2 * state_bytes,
        "replay": {name: e.counters.as_dict() for name, e in report.replays.items()},
        "rounds": records,
        "largest_real_time_N": max(keeping) if keeping else 0,
    }


def _profile_steady_chunk(stream, tokens, device):
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        stream.flow_chunk(tokens)
        torch.cuda.synchronize(device)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return {"launches": len(events), "kernel_ms": sum(e.device_time for e in events) / 1e3}


def _compile_arm(args, limit_s: int) -> dict:
    """torch.compile(mode="reduce-overhead") of the CFM loop, in its own process, time-limited."""
    code = (
        "import torch,time,json,sys;"
        "from cadence_fx.models.token2wav_carry import reference_flow;"
        "from cadence_fx.models.token2wav_stream import StockStream,random_chunks,random_prompt;"
        f"flow,contract,n=reference_flow({args.depth!r});flow=flow.to('cuda');"
        "p=random_prompt(0,n_tokens=n,device='cuda');s=StockStream(flow,None,p);s.setup();"
        "flow.decoder.forward_chunk=torch.compile(flow.decoder.forward_chunk,mode='reduce-overhead');"
        "t=time.perf_counter();[s.flow_chunk(c) for c in random_chunks(1,4,device='cuda')];torch.cuda.synchronize();"
        "print(json.dumps({'first_4_chunks_s':time.perf_counter()-t}))"
    )
    started = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=limit_s)
    except subprocess.TimeoutExpired:
        return {"outcome": f"still compiling after {limit_s} s: killed", "seconds": limit_s}
    took = time.perf_counter() - started
    if done.returncode != 0:
        return {"outcome": "aborted", "seconds": took, "error_tail": done.stderr[-1500:]}
    return {"outcome": "ran", "seconds": took, "result": done.stdout.strip().splitlines()[-1]}


def _one_arm(args, device) -> dict:
    """Child mode: build the models, stream one arm, profile a steady chunk, save everything."""
    settings = pin_deterministic()
    flow, contract, prompt_tokens = reference_flow(args.depth)
    flow, hift = flow.to(device), build_hift(device=device)
    prompt = random_prompt(0, n_tokens=prompt_tokens, device=device)
    turns = [random_chunks(1000 + b, args.chunks, device=device) for b in range(args.blocks)]
    saved = {"settings": settings}
    torch.set_grad_enabled(args.grad)
    if args.only == "capacity":
        saved["capacity"] = capacity(flow, hift, contract, prompt, device, _session_counts(args.capacity),
                                     args.capacity_chunks, args.seed)
        return saved
    saved["predicted_delta_bytes"] = predicted_delta_bytes(args.only, contract)
    if args.only == "eager":
        torch.manual_seed(1)
        probe = (torch.randn(1, 80, 58, device=device), torch.zeros(1, 1, 3840, device=device))
        saved["eager_hift_repeats_itself"] = check_repeatable(hift, *probe).equal
    result, mels, pcm, stream = run_arm(args.only, flow, hift, contract, prompt, turns, device, args.seed)
    result["kernels_one_steady_chunk"] = _profile_steady_chunk(stream, turns[0][1], device)
    saved.update(result=result, mels=mels, pcm=pcm)
    return saved


def _session_counts(text: str) -> list[int]:
    """`--capacity`'s session counts; [] when `text` is not positive integers separated by commas."""
    try:
        counts = [int(n) for n in text.split(",")]
    except ValueError:
        return []
    return counts if min(counts) >= 1 else []


def _signed(n: int | None) -> str:
    if n is None:
        return "not modelled"
    return ("-" if n < 0 else "+") + format_bytes(abs(n))


def _spawn_arm(arm: str, argv: list[str], limit_s: int, scratch: Path) -> dict:
    """Each arm runs in a fresh process: no arm's CUDA or RNG state can reach another's."""
    path = scratch / f"{arm}.pt"
    command = [sys.executable, __file__, *argv, "--only", arm, "--only-out", str(path)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=limit_s)
    except subprocess.TimeoutExpired:
        return {"outcome": f"killed after {limit_s} s"}
    if done.returncode != 0:
        return {"outcome": "failed", "error_tail": (done.stderr or done.stdout)[-4000:]}
    return torch.load(path, weights_only=False)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depth", choices=("reduced", "full"), default="full")
    parser.add_argument("--blocks", type=int, default=8, help="turns, with a reset to the prompt state between them")
    parser.add_argument("--chunks", type=int, default=10, help="chunks per turn (the last one flushes)")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--arm-limit", type=int, default=240, help="seconds one arm may take")
    parser.add_argument("--compile-limit", type=int, default=0, help="seconds for the torch.compile arm (0: skip)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--grad", action="store_true", help="stream with autograd on (the default is no_grad)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--capacity", default="", help="session counts for the multi-session run, e.g. 1,2,4,8,16,32")
    parser.add_argument("--capacity-chunks", type=int, default=8, help="chunks per stream in the multi-session run")
    parser.add_argument("--capacity-limit", type=int, default=300, help="seconds the multi-session run may take")
    parser.add_argument("--only", choices=(*ARMS, "capacity"), help=argparse.SUPPRESS)
    parser.add_argument("--only-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    arms = args.arms.split(",") if args.arms else []
    unknown = set(arms) - set(ARMS)
    if not arms and not args.capacity:
        parser.error("nothing to run: give --arms, --capacity or both")
    if unknown or (arms and arms[0] not in ("eager", "eager16")):
        parser.error(f"--arms must start with eager (or eager16) and name only {ARMS}, got {arms}")
    if any(not _base_arm(a)[1] for a in arms) and "eager" not in arms:
        parser.error("--arms: fp32 arms are compared with eager, which must run first")
    if args.blocks < 1 or args.chunks < 3:
        parser.error("need at least 1 block of at least 3 chunks (steady classes, then a flush)")
    for arm in arms:
        base, fp16 = _base_arm(arm)
        if fp16 and arm != "eager16" and ("eager16" not in arms or arms.index("eager16") > arms.index(arm)):
            parser.error(f"--arms: {arm} is compared with eager16, which must run before it")
    if args.capacity:
        if not _session_counts(args.capacity):
            parser.error(f"--capacity must be positive session counts separated by commas, got {args.capacity!r}")
        if args.capacity_chunks < 4:
            parser.error("--capacity-chunks must be at least 4 (3 chunks cross the classes, then steady rounds)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.only:
        torch.save(_one_arm(args, device), args.only_out)
        return 0

    import tempfile

    results, references, extra = {}, {}, {}
    with tempfile.TemporaryDirectory() as scratch:
        for arm in arms:
            print(f"arm {arm}...", flush=True)
            saved = _spawn_arm(arm, argv, args.arm_limit, Path(scratch))
            if "result" not in saved:
                results[arm] = saved
                print(f"  {arm}: {saved['outcome']} {saved.get('error_tail', '')[-600:]}", flush=True)
                continue
            extra.setdefault("determinism", saved["settings"])
            if "eager_hift_repeats_itself" in saved:
                extra["eager_hift_repeats_itself"] = saved["eager_hift_repeats_itself"]
            result, mels, pcm = saved["result"], saved["mels"], saved["pcm"]
            fp16 = _base_arm(arm)[1]
            reference = references.setdefault(fp16, (mels, pcm))
            result["outcome"] = "ran"
            result["compared_with"] = "eager16" if fp16 else "eager"
            result["predicted_delta_bytes"] = saved["predicted_delta_bytes"]
            result["mel_equal_chunks"] = sum(torch.equal(a, b) for a, b in zip(mels, reference[0]))
            result["pcm_equal_chunks"] = sum(torch.equal(a, b) for a, b in zip(pcm, reference[1]))
            result["chunks"] = len(mels)
            result["chunk_stats_ms"] = latency_stats(result["chunk_ms"][1:])
            result["cfm_loop_stats_ms"] = latency_stats(result["cfm_loop_ms_last_turn"][2:-1])
            result["flow_chunk_stats_ms"] = latency_stats(result["flow_chunk_ms_last_turn"][2:-1])
            results[arm] = result
            print(
                f"  {arm}: chunk p50 {result['chunk_stats_ms']['p50']:.1f} ms, CFM loop p50 "
                f"{(result['cfm_loop_stats_ms'] or {}).get('p50', float('nan')):.1f} ms, exact mel "
                f"{result['mel_equal_chunks']}/{len(mels)} pcm {result['pcm_equal_chunks']}/{len(mels)}, peak "
                f"{format_bytes(result['peak_allocated_bytes'])}, kernels {result['kernels_one_steady_chunk']}, "
                f"replay {result['replay']}",
                flush=True,
            )
        for arm, result in results.items():
            eager = results.get("eager16" if _base_arm(arm)[1] else "eager", {})
            if result.get("peak_allocated_bytes") is not None and eager.get("peak_allocated_bytes") is not None:
                result["measured_delta_bytes"] = result["peak_allocated_bytes"] - eager["peak_allocated_bytes"]
                result["measured_delta_bytes_later_turns"] = (
                    result["peak_allocated_bytes_later_turns"] - eager["peak_allocated_bytes_later_turns"]
                    if result["peak_allocated_bytes_later_turns"] is not None else None)
                print(f"  memory model, {arm}: predicted delta {_signed(result['predicted_delta_bytes'])}, measured "
                      f"{_signed(result['measured_delta_bytes'])} (later turns "
                      f"{_signed(result['measured_delta_bytes_later_turns'])})", flush=True)
        sessions = None
        if args.capacity:
            print("capacity...", flush=True)
            saved = _spawn_arm("capacity", argv, args.capacity_limit, Path(scratch))
            sessions = saved.get("capacity", saved)
    compiled = _compile_arm(args, args.compile_limit) if args.compile_limit and device.type == "cuda" else None
    commit = measured_commit()
    record = {
        "benchmark": "token2wav",
        "commit": commit,
        "command": " ".join([sys.executable, __file__, *argv]),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "depth": args.depth,
        "blocks": args.blocks,
        "chunks_per_block": args.chunks,
        **extra,
        "arms": results,
        "torch_compile_reduce_overhead": compiled,
        "capacity": sessions,
        "not_run": [name for name in (*ARMS, "capacity", "torch.compile")
                    if name not in results and not (name == "capacity" and sessions)
                    and not (name == "torch.compile" and compiled)],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1, default=str))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
