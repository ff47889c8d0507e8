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
(state rule, carry and replay: the carry passed by address).
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
from cadence_fx.determinism import check_repeatable, pin_deterministic
from cadence_fx.models.token2wav_carry import CarryStream, reference_flow
from cadence_fx.models.token2wav_stream import StockStream, build_hift, random_chunks, random_prompt
from cadence_fx.passes.hoist import HostConstantHoist
from cadence_fx.passes.piecewise import Piecewise
from cadence_fx.replay import ExactShapeReplay, TensorSpec
from cadence_fx.report import format_bytes, latency_stats, measured_commit

ARMS = ("eager", "S", "SRc", "Rc", "R")
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


def build_arm(arm: str, flow, hift, contract):
    """(stream factory inputs, replay engines) of one arm."""
    if arm == "eager":
        return flow, hift, None, {}
    if arm in ("S", "SRc"):
        transformed, report = transform((flow, hift), contract, capture=False, replay=arm == "SRc")
        return transformed.flow, transformed.hift, transformed, report.replays
    stock_flow, vocoder, engines = _stock_replay(flow, hift, aliased=arm == "R")
    return stock_flow, vocoder, None, engines


def _bytes(*modules) -> int:
    tensors = {id(t): t for m in modules for t in (*m.parameters(), *m.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def run_arm(arm, flow, hift, contract, prompt, turns, device, seed):
    """Stream every turn through one arm. Peak memory counts the arm's own model (weights,
    buffers, carries), graph pools and transients: the eager arm owns the stock flow and HiFT,
    the other arms own the copies their build made."""
    owned = _bytes(flow, hift) if arm == "eager" else 0
    _sync(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    arm_flow, arm_hift, transformed, engines = build_arm(arm, flow, hift, contract)
    stream = CarryStream(transformed, prompt) if transformed else StockStream(arm_flow, arm_hift, prompt)
    timed_cfm = _Timed(stream.flow.decoder.forward_chunk, device)
    stream.flow.decoder.forward_chunk = timed_cfm
    chunk_ms, mels, pcm = [], [], []
    for turn, chunks in enumerate(turns):
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
        cfm_ms = list(timed_cfm.ms)
    peak = (torch.cuda.max_memory_allocated(device) - base + owned) if device.type == "cuda" else None
    result = {
        "chunk_ms": chunk_ms,
        "cfm_loop_ms_last_turn": cfm_ms,
        "peak_allocated_bytes": peak,
        "replay": {name: e.counters.as_dict() for name, e in engines.items()},
    }
    return result, mels, pcm, stream


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
    if args.only == "eager":
        torch.manual_seed(1)
        probe = (torch.randn(1, 80, 58, device=device), torch.zeros(1, 1, 3840, device=device))
        saved["eager_hift_repeats_itself"] = check_repeatable(hift, *probe).equal
    torch.set_grad_enabled(args.grad)
    result, mels, pcm, stream = run_arm(args.only, flow, hift, contract, prompt, turns, device, args.seed)
    result["kernels_one_steady_chunk"] = _profile_steady_chunk(stream, turns[0][1], device)
    saved.update(result=result, mels=mels, pcm=pcm)
    return saved


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
    parser.add_argument("--only", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--only-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    arms = args.arms.split(",")
    unknown = set(arms) - set(ARMS)
    if unknown or arms[0] != "eager":
        parser.error(f"--arms must start with eager and name only {ARMS}, got {arms}")
    if args.blocks < 1 or args.chunks < 3:
        parser.error("need at least 1 block of at least 3 chunks (steady classes, then a flush)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.only:
        torch.save(_one_arm(args, device), args.only_out)
        return 0

    import tempfile

    results, reference, extra = {}, None, {}
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
            if reference is None:
                reference = (mels, pcm)
            result["outcome"] = "ran"
            result["mel_equal_chunks"] = sum(torch.equal(a, b) for a, b in zip(mels, reference[0]))
            result["pcm_equal_chunks"] = sum(torch.equal(a, b) for a, b in zip(pcm, reference[1]))
            result["chunks"] = len(mels)
            result["chunk_stats_ms"] = latency_stats(result["chunk_ms"][1:])
            result["cfm_loop_stats_ms"] = latency_stats(result["cfm_loop_ms_last_turn"][2:-1])
            results[arm] = result
            print(
                f"  {arm}: chunk p50 {result['chunk_stats_ms']['p50']:.1f} ms, CFM loop p50 "
                f"{(result['cfm_loop_stats_ms'] or {}).get('p50', float('nan')):.1f} ms, exact mel "
                f"{result['mel_equal_chunks']}/{len(mels)} pcm {result['pcm_equal_chunks']}/{len(mels)}, peak "
                f"{format_bytes(result['peak_allocated_bytes'])}, kernels {result['kernels_one_steady_chunk']}, "
                f"replay {result['replay']}",
                flush=True,
            )
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
        "not_run": ["vendor CUDA-graph branch re-bucketed", "fp16 autocast", "multi-session capacity"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1, default=str))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
