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

Memory as the device sees it (`cadence_fx.memory.DeviceMemory`, started first thing in each
arm's process): besides the peaks above, each arm records the process's peak allocated bytes,
reserved bytes at the end and the device footprint (`torch.cuda.mem_get_info`, less what was in use
at the process's start), at the end of the run and again after `torch.cuda.empty_cache()`; every
arm but eager hands the stock models back to the host once its own copies are built, so the
footprint is what a deployment of that arm holds. Per replayed class, the graph pool's measured
growth at its capture stands beside the staging the memory model charges (`graph_pool`).

Capacity (`--capacity 8,16,24,32 --lanes 4`, its own process): N token streams over L replay
lanes (`cadence_fx.lanes`): each lane its own set of SRc graph bindings, graph pool, host thread
and CUDA stream; stream i runs on lane i mod L, the streams of one lane taking turns over its
bindings. Each stream owns its carries' contents, its cache dict, its HiFT cache and its CUDA
RNG state; before a stream's chunk its state is copied into its lane's carries (the addresses the
graphs read), after it copied back out; HiFT's RNG draws go through one `RngSection`, from the
stream's own generator state. Every class of every lane is captured before the rounds (the time
it took is recorded). Recorded per N: the round time (one chunk of every stream: the period at
which each stream gets its next 1-second chunk) p50/p95, whether every stream keeps up with real
time, the device footprint, and every stream checked bit for bit against the same token stream
run alone (one thread, lane 0's bindings, nothing between its chunks). The record is saved after
each N, so a run cut short by `--capacity-limit` keeps the counts it finished.
"""

from __future__ import annotations

import argparse
import copy
import functools
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
from cadence_fx.lanes import Lane, RngSection
from cadence_fx.memory import DeviceMemory
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
        transformed, report = transform((flow, hift), contract, replay=arm == "SRc")
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
    """The memory model, from the declaration alone: an arm's peak minus
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


def _shed_stock(arm: str, flow, hift, device: torch.device) -> None:
    """Every arm but eager runs on copies its build made: the stock flow and HiFT leave the
    device, so the process holds what a deployment of this arm would hold and no more. A
    transformed flow (S, SRc) shares the stock flow's weights: only the stock envelopes it sized
    to demand leave."""
    base = _base_arm(arm)[0]
    if base != "eager" and device.type == "cuda":
        if base in ("S", "SRc"):
            for envelope in ENVELOPES:
                owner, _, name = envelope.path.rpartition(".")
                module = flow.get_submodule(owner)
                module._buffers[name] = module._buffers[name].to("cpu")
        else:
            flow.to("cpu")
        hift.to("cpu")
        _sync(device)
        torch.cuda.empty_cache()


def run_arm(arm, flow, hift, contract, prompt, turns, device, seed, memory: DeviceMemory):
    """Stream every turn through one arm. Peak memory counts the arm's own model (weights,
    buffers, carries), graph pools and transients: the eager arms own the stock flow and HiFT,
    the other arms own the copies their build made. The first turn's peak includes every
    capture; the later turns' peak is the steady state. `memory` (started with the process)
    records what the device sees: reserved bytes and the device footprint, once at the end of
    the run and once more after `torch.cuda.empty_cache()` hands back the allocator's free blocks."""
    owned = _bytes(flow, hift) if _base_arm(arm)[0] == "eager" else 0
    _sync(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    memory.reset_peak()
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    stream, engines = open_stream(arm, flow, hift, contract, prompt)
    _shed_stock(arm, flow, hift, device)
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
            memory.sample()
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
        "memory": memory.record(),
        "replay": {name: e.counters.as_dict() for name, e in engines.items()},
        "graph_pool": {name: e.memory for name, e in engines.items()},
    }
    if device.type == "cuda":
        torch.cuda.empty_cache()
        result["memory"]["device_footprint_bytes_after_empty_cache"] = memory.footprint()
        result["memory"]["reserved_bytes_after_empty_cache"] = torch.cuda.memory_reserved(device)
    return result, mels, pcm, stream


def capacity(
    flow,
    hift,
    contract,
    prompt,
    device,
    sessions: list[int],
    chunks: int,
    seed: int,
    lanes: int,
    memory: DeviceMemory,
    checkpoint=lambda record: None,
) -> dict:
    """N token streams over L replay lanes, each lane its own set of SRc bindings on its own
    thread and CUDA stream, the streams of a lane round robin over its bindings
    (`TransformedFlow.swap_in` / `swap_out`), HiFT's device-RNG draws through one `RngSection`;
    every stream checked bit for bit against the same stream run alone (module docstring)."""
    started = time.perf_counter()
    models = [transform((flow, hift), contract, replay=True) for _ in range(lanes)]
    _shed_stock("SRc", flow, hift, device)
    section = RngSection(device)
    lane_set = [Lane(f"lane{k}", device) for k in range(lanes)]

    def open_session(transformed, index: int):
        stream = CarryStream(transformed, prompt)
        if transformed.base is None:
            stream.setup()
        else:
            stream.reset_turn()  # the prompt state the first setup kept, written in place
        state = transformed.session_state(seed + index)
        stream.hift = functools.partial(section.call, state, transformed.hift)
        return stream, state

    def step(transformed, stream, state, tokens):
        transformed.swap_in(state, rng=False)
        out = stream.step(tokens, last_chunk=False)
        transformed.swap_out(state, rng=False)
        return out.speech

    def warm_up(transformed) -> None:
        stream, state = open_session(transformed, -1)
        for tokens in random_chunks(7, 4, device=device):
            step(transformed, stream, state, tokens)

    # Every class of every lane captured before the rounds (the lanes' captures take turns).
    for future in [lane.submit(warm_up, models[k][0]) for k, lane in enumerate(lane_set)]:
        future.result()
    warm_up_s = time.perf_counter() - started
    print(f"  {lanes} lane(s) built and captured in {warm_up_s:.1f} s", flush=True)
    token_streams: dict[int, list[torch.Tensor]] = {}
    alone: dict[int, list[torch.Tensor]] = {}

    def tokens_of(i: int) -> list[torch.Tensor]:
        return token_streams.setdefault(i, random_chunks(5000 + i, chunks, device=device))

    def run_alone(i: int) -> list[torch.Tensor]:
        """Stream i by itself: this thread, lane 0's bindings, nothing between its chunks."""
        if i not in alone:
            transformed = models[0][0]
            stream = CarryStream(transformed, prompt)
            stream.reset_turn()
            transformed.swap_in(transformed.session_state(seed + i))
            alone[i] = [stream.step(t, last_chunk=False).speech.float().cpu() for t in tokens_of(i)]
        return alone[i]

    records: list[dict] = []

    def summary() -> dict:
        refused = [
            {"lane": k, "engine": name, "class": c.shape_class, "thread": c.thread, "reason": c.reason}
            for k, (_, report) in enumerate(models)
            for name, e in report.replays.items()
            for c in e.certificates.values()
            if not c.admitted
        ]
        keeping = [r for r in records if r["keeps_real_time"] and r["streams_exact"] == r["streams_checked"]]
        best = max(keeping, key=lambda r: r["sessions"]) if keeping else None
        return {
            "lanes": lanes,
            "chunks_per_stream": chunks,
            "chunk_period_ms": CHUNK_PERIOD_MS,
            "build_and_capture_s": warm_up_s,
            "rng_section_calls": section.calls,
            "replay": {
                f"lane{k}": {name: e.counters.as_dict() for name, e in report.replays.items()}
                for k, (_, report) in enumerate(models)
            },
            "graph_pool_lane0": {name: e.memory for name, e in models[0][1].replays.items()},
            "refused_classes": refused,
            "rounds": list(records),
            "largest_real_time_N": best["sessions"] if best else 0,
            "largest_real_time_N_device_footprint_bytes": best["device_footprint_bytes"] if best else None,
            "memory": memory.record(),
        }

    for n in sessions:
        assigned = [[i for i in range(n) if i % lanes == k] for k in range(lanes)]
        opened: dict[int, tuple] = {}
        for k, lane in enumerate(lane_set):
            opened.update(lane.submit(lambda k=k: {i: open_session(models[k][0], i) for i in assigned[k]}).result())
        outputs: list[list[torch.Tensor]] = [[] for _ in range(n)]

        def lane_round(k: int, c: int, assigned=assigned, opened=opened, outputs=outputs) -> None:
            for i in assigned[k]:
                stream, state = opened[i]
                outputs[i].append(step(models[k][0], stream, state, tokens_of(i)[c]))

        round_ms = []
        for c in range(chunks):
            round_start = time.perf_counter()
            for future in [lane.submit(lane_round, k, c) for k, lane in enumerate(lane_set)]:
                future.result()
            round_ms.append((time.perf_counter() - round_start) * 1e3)
            memory.sample()
        footprint, reserved = memory.footprint(), (torch.cuda.memory_reserved(device) if device.type == "cuda" else None)
        exact = [all(torch.equal(a.float().cpu(), b) for a, b in zip(outputs[i], run_alone(i), strict=True)) for i in range(n)]
        stats = latency_stats(round_ms[3:])  # the first three chunks cross the classes
        record = {
            "sessions": n,
            "lanes": lanes,
            "round_ms": latency_stats(round_ms),
            "round_ms_steady": stats,
            "keeps_real_time": stats["p95"] <= CHUNK_PERIOD_MS,
            "streams_exact": sum(exact),
            "streams_checked": n,
            "streams_not_exact": [i for i, e in enumerate(exact) if not e],
            "session_state_bytes": sum(state.nbytes for _, state in opened.values()),
            "device_footprint_bytes": footprint,
            "reserved_bytes": reserved,
        }
        records.append(record)
        print(
            f"  capacity N={n} on {lanes} lane(s): round p50 {stats['p50']:.1f} ms p95 {stats['p95']:.1f} ms, real "
            f"time {record['keeps_real_time']}, exact {sum(exact)}/{n}, footprint {format_bytes(footprint)}",
            flush=True,
        )
        del opened, outputs
        checkpoint(summary())
    for lane in lane_set:
        lane.close()
    return summary()


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
    memory = DeviceMemory(device)  # first: the device footprint counts from here
    settings = pin_deterministic()
    flow, contract, prompt_tokens = reference_flow(args.depth)
    flow, hift = flow.to(device), build_hift(device=device)
    prompt = random_prompt(0, n_tokens=prompt_tokens, device=device)
    turns = [random_chunks(1000 + b, args.chunks, device=device) for b in range(args.blocks)]
    saved = {"settings": settings}
    torch.set_grad_enabled(args.grad)
    if args.only == "capacity":

        def checkpoint(partial: dict) -> None:
            torch.save({**saved, "capacity": partial}, args.only_out)

        saved["capacity"] = capacity(
            flow,
            hift,
            contract,
            prompt,
            device,
            _session_counts(args.capacity),
            args.capacity_chunks,
            args.seed,
            args.lanes,
            memory,
            checkpoint,
        )
        return saved
    saved["predicted_delta_bytes"] = predicted_delta_bytes(args.only, contract)
    if args.only == "eager":
        torch.manual_seed(1)
        probe = (torch.randn(1, 80, 58, device=device), torch.zeros(1, 1, 3840, device=device))
        saved["eager_hift_repeats_itself"] = check_repeatable(hift, *probe).equal
    result, mels, pcm, stream = run_arm(args.only, flow, hift, contract, prompt, turns, device, args.seed, memory)
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
    try:  # the child's progress goes straight to this process's stdout
        done = subprocess.run(command, stdout=None, stderr=subprocess.PIPE, text=True, timeout=limit_s)
    except subprocess.TimeoutExpired:
        if path.exists():  # what the child saved before it was cut short
            return {**torch.load(path, weights_only=False), "outcome": f"killed after {limit_s} s (partial)"}
        return {"outcome": f"killed after {limit_s} s"}
    if done.returncode != 0:
        return {"outcome": "failed", "error_tail": (done.stderr or "")[-4000:]}
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
    parser.add_argument(
        "--lanes",
        type=int,
        default=1,
        help="replay lanes in the multi-session run: each its own bindings, thread and CUDA stream",
    )
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
        if args.lanes < 1:
            parser.error(f"--lanes must be at least 1, got {args.lanes}")
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
                    if result["peak_allocated_bytes_later_turns"] is not None
                    else None
                )
                print(
                    f"  memory model, {arm}: predicted delta {_signed(result['predicted_delta_bytes'])}, measured "
                    f"{_signed(result['measured_delta_bytes'])} (later turns "
                    f"{_signed(result['measured_delta_bytes_later_turns'])})",
                    flush=True,
                )
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
        "not_run": [
            name
            for name in (*ARMS, "capacity", "torch.compile")
            if name not in results and not (name == "capacity" and sessions) and not (name == "torch.compile" and compiled)
        ],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1, default=str))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
