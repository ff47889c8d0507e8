"""Moshi sessions as the slots of one batch: one Mimi and one `LMGen` at batch B, every session
ticking in one batched call per 80 ms frame, each stage an `ExactShapeReplay` binding at batch B.

B is the contract quantity `slots` (`contract_for(config, slots=B)`): every ring region is
declared at batch B, so each operator's catalog is one class (K = 1) at that batch, and a
runtime holds exactly B slots. What the vendor gives and this runtime uses, as Kyutai's batched
servers do (moshi 0.2.13, `modules/streaming.py`, `models/lm.py`):

* **idle slots are masked.** `set_exec_mask(mask)` writes a (B,) boolean into every streaming
  module's state; each module then advances only the rows that execute: ring offsets, conv
  `previous`/`partial` buffers, the replicate-pad `first` flags, the transformers' positions and
  `LMGen`'s offsets and delayed-token cache are written through `torch.where(exec_mask, new,
  old)`. A masked row is still computed (the batch always runs at B) and its result is thrown
  away. One thing a masked call does write: `RingKVCache.complete` scatters every row's new keys
  and values at that row's `end_offset` before it attends, masked or not, and leaves the offset
  where it was; those positions are the ones the row's next executed call writes before it reads
  them, so nothing a slot will ever read changes while it is masked (`tests/test_moshi_slots.py`
  checks both: every other state byte equal, ring bytes only at those positions).
* **a joining session resets only its slot.** `reset_streaming(reset_mask)` rewrites the masked
  rows' offsets, conv buffers and flags to a fresh entry's values and leaves the other rows
  alone. It does not clear ring bodies: a reset slot's positions count as empty again (the
  attention bias masks every position at or past its `end_offset`), and `LMGen` reads its
  delayed-token cache only where the slot has written since its reset. It also zeroes the
  host-side `offset_cpu` counters of the whole batch; with `support_out_of_sync=True` (what the
  vendor asks for batched, out-of-step slots) nothing reads them but weights chosen per step,
  which only the depformer has, and its state is fresh on every frame.
* **each slot speaks after its own acoustic delay.** With `support_out_of_sync=True`, `LMGen.step`
  returns every row on every call and writes the vendor's ungenerated id (-2) into the rows of
  masked slots and of slots whose offset has not passed the delay yet. Mimi decode cannot take
  -2, so the decode stage decodes code 0 there under a false exec mask (the slot's decoder state
  stays as it was, its row of PCM is not handed out): a slot's decoder starts at its first real
  frame, as the vendor's batch-1 loop, which decodes nothing until `step` returns tokens.

Where the vendor does not keep slots apart: **sampling**. `LMGen` samples every row of the batch
from one generator in one call (`utils/sampling.py::multinomial` draws
`torch.empty_like(probs).exponential_(1)` of shape (B, k): the text token, then each of the
depformer's codebooks), with one temperature, top-k and sampling switch for the batch. So a
slot's draws depend on the batch size, its row, and every tick the runtime ran before (joins and
idle ticks included), not on a seed of its own; this runtime seeds the batch's generator once
(`seed`; the device's default generator, the one the vendor draws from) and swaps it in for its
ticks, so nothing else in the process draws from it or is disturbed by it. Greedy decoding (`sampling=False`) draws nothing, and
a slot's tokens then
depend only on its own inputs. What is bit-identical, then: every slot's tokens and PCM against
the vendor's own batched loop at the same B, with the same ticks, joins and seed
(`vendor_ticks`, the reference here). Against the vendor's batch-1 loop a slot's results are not
guaranteed: batched kernels may round differently (measured on a CPU at the TINY size, greedy:
tokens equal, PCM within 2.6e-8, not equal; `tests/test_moshi_slots.py` records it).

The transform (`transform_slots`) builds the runtime on the one pipeline of every model: Mimi
and `LMGen` at batch B transformed from Moshi's slots bindings as data (`models/moshi.py`), four
bound operators: Mimi encode, the LM's main step (`forward_text`, inside `LMGen.step`), the
depformer step (all codebooks and their sampling) and Mimi decode. The tick writes the exec masks,
calls encode, lets the vendor's own glue (`LMGen.step`: the delayed-token cache, the text
sampling) call the bound LM steps as its `graphed_main` and `graphed_depth`, then writes the
speaking mask and calls decode; a join's `reset_streaming` runs eagerly, as the vendor runs its
glue between its graphs. Every ring stays where the vendor allocated it. The service runs it
(`serve/plugins/moshi.py`): at B = 64, full size, on the H200 it answered every turn of the load
with first audio p95 209 ms and a server start-up of 28.7 s
(`bench/results/serve_load_moshi_full_64.json`); its tick took 53.3 ms at B = 64
(`bench/results/moshi_slots_64.json`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cadence_fx.contract import Contract
from cadence_fx.multiplex import rng_get, rng_seeded, rng_set
from cadence_fx.pipeline import BoundModel
from cadence_fx.transform import TransformReport

from .moshi import MIMI_SLOTS_BINDING, MOSHI_LM_SLOTS_BINDING
from .moshi_bound import bind, replays
from .moshi_stream import MoshiModels, streaming_copy

__all__ = ["MoshiSlots", "Tick", "TickOutput", "transform_slots", "vendor_slots", "vendor_ticks", "warm_up_ticks"]


def warm_up_ticks(device: torch.device) -> int:
    """`MoshiSlots`' warm-up: its bindings' verified visits of each stage's one class, and on a GPU
    one tick more, whose call captures each stage. Without it the first tick under load captured
    the four stages (at B = 64, full size, the replies that began then found 16 frames queued:
    `bench/results/history/serve_load_moshi_full_64_pipeline_016184d.json`)."""
    return max(MIMI_SLOTS_BINDING.verify, MOSHI_LM_SLOTS_BINDING.verify) + (device.type == "cuda")


@dataclass(frozen=True)
class Tick:
    """One batched call. `frames` maps each live slot to its input frame (float32, shape
    `(frame_size,)`); the other slots are masked. `joins` are the slots whose sessions begin
    here: they are reset before the tick runs."""

    frames: Mapping[int, torch.Tensor]
    joins: tuple[int, ...] = ()


@dataclass(frozen=True)
class TickOutput:
    """What one tick gave. `tokens` `(B, 1 + dep_q)` (text first) and `pcm` `(B, frame_size)` hold
    a row per slot; only the rows of `speaking` slots (live and past the acoustic delay) are
    outputs: the others are the vendor's ungenerated id and the PCM of a masked decode."""

    live: tuple[int, ...]
    speaking: tuple[int, ...]
    tokens: torch.Tensor
    pcm: torch.Tensor

    def slot(self, index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`(tokens, pcm)` of one slot, None when it did not speak at this tick."""
        return (self.tokens[index], self.pcm[index]) if index in self.speaking else None


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``. To a GPU from pinned memory without waiting: a pageable copy
    synchronizes the stream, so the host would wait for the device's queued work at every input
    (and, in a busy server, queue again for the GIL afterwards)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _mask(slots: int, rows: Sequence[int], device: torch.device) -> torch.Tensor:
    mask = torch.zeros(slots, dtype=torch.bool)
    mask[list(rows)] = True
    return _to_device(mask, device)


def _frames(slots: int, frame_size: int, frames: Mapping[int, torch.Tensor], device: torch.device) -> torch.Tensor:
    """`(B, 1, frame_size)`: each live slot's frame in its row, zeros in the masked rows (one
    copy for all rows, not one per slot)."""
    batch = torch.zeros(slots, 1, frame_size)
    rows = list(frames)
    batch[rows, 0] = torch.stack([frames[slot] for slot in rows])
    return _to_device(batch, device)


def _check_tick(tick: Tick, slots: int, frame_size: int) -> None:
    if not tick.frames:
        raise ValueError("a tick runs at least one slot: its frames are empty")
    for name, indices in (("frames", list(tick.frames)), ("joins", list(tick.joins))):
        outside = [i for i in indices if not (isinstance(i, int) and 0 <= i < slots)]
        if outside:
            raise ValueError(f"{name}: slot {outside[0]!r} is outside 0..{slots - 1} (the batch holds {slots} slots)")
    if len(set(tick.joins)) != len(tick.joins):
        raise ValueError(f"joins: a slot joins twice in one tick: {sorted(tick.joins)}")
    for slot, frame in tick.frames.items():
        if not isinstance(frame, torch.Tensor) or frame.shape != (frame_size,) or frame.dtype != torch.float32:
            got = f"{frame.dtype} {tuple(frame.shape)}" if isinstance(frame, torch.Tensor) else type(frame).__name__
            raise ValueError(f"frames[{slot}]: a frame is {frame_size} float32 samples, shape ({frame_size},); got {got}")


def vendor_ticks(
    models: MoshiModels, slots: int, ticks: Sequence[Tick], *, sampling: bool, seed: int, cuda_graphs: bool = False
) -> Iterator[TickOutput]:
    """The vendor's own batched loop, the reference of `MoshiSlots`: `mimi.streaming(B)` and
    `LMGen(support_out_of_sync=True).streaming(B)` entered afresh, the default generators seeded
    with `seed`, then per tick: `reset_streaming(joins)`, `set_exec_mask(live)` on Mimi and the
    LM, `mimi.encode`, `LMGen.step`, `mimi.set_exec_mask(speaking)` (the rows `step` returned
    real tokens for) and `mimi.decode` of the audio codebooks, the ungenerated id (-2) written as code 0.

    `cuda_graphs=True` keeps the vendor's `CUDAGraphed` wrappers on (on a GPU), False runs them
    eagerly (`no_cuda_graph`). Yields each tick's output as the tick ends; the models stream for
    as long as the iteration runs."""
    from moshi.models import LMGen
    from moshi.utils.compile import no_compile, no_cuda_graph

    mimi, lm = models.mimi, models.lm
    device = next(lm.parameters()).device
    lm_gen = LMGen(lm, use_sampling=sampling, support_out_of_sync=True)
    torch.manual_seed(seed)
    graphs = contextlib.nullcontext() if cuda_graphs else no_cuda_graph()
    with graphs, no_compile(), torch.no_grad(), mimi.streaming(slots), lm_gen.streaming(slots):
        for tick in ticks:
            _check_tick(tick, slots, mimi.frame_size)
            if tick.joins:
                joins = _mask(slots, tick.joins, device)
                mimi.reset_streaming(joins)
                lm_gen.reset_streaming(joins)
            live = _mask(slots, sorted(tick.frames), device)
            mimi.set_exec_mask(live)
            lm_gen.set_exec_mask(live)
            codes = mimi.encode(_frames(slots, mimi.frame_size, tick.frames, device))
            tokens = lm_gen.step(codes)
            assert tokens is not None  # support_out_of_sync: LMGen.step returns a frame on every call
            speaking = (tokens[:, :, 0] >= 0).all(dim=1)
            mimi.set_exec_mask(speaking)
            pcm = mimi.decode(tokens[:, 1:].clamp(min=0))
            yield TickOutput(tuple(sorted(tick.frames)), tuple(speaking.nonzero().flatten().tolist()), tokens[:, :, 0], pcm[:, 0])


def vendor_slots(
    models: MoshiModels, slots: int, ticks: Sequence[Tick], *, sampling: bool, seed: int, cuda_graphs: bool = False
) -> list[TickOutput]:
    """Every output of `vendor_ticks`."""
    return list(vendor_ticks(models, slots, ticks, sampling=sampling, seed=seed, cuda_graphs=cuda_graphs))


@dataclass
class MoshiSlots:
    """B slots of one batched Mimi + `LMGen`, their four stages bound operators of
    `cadence_fx.transform` from Moshi's slots bindings; see the module docstring.

    `tick(Tick(frames={slot: frame}, joins=(...)))` runs one batched call for every live slot and
    returns its `TickOutput`. Which slot a session owns, and when it joins, is the caller's
    schedule: the runtime keeps no sessions, only each slot's frames since its last join."""

    models: MoshiModels
    lm_gen: Any  # moshi.models.LMGen at batch `slots`
    slots: int
    bound: dict[str, BoundModel]  # "mimi" and "lm": each stage is one of their operators
    reports: dict[str, TransformReport]  # their transforms' reports (`report` merges them)
    streaming: contextlib.ExitStack  # the modules' streaming entries, closed by `close`
    rng: torch.Tensor | None = None  # the batch's generator state between ticks (the device's)
    ran: list[int] = field(default_factory=list)  # per slot: the frames it ran since it joined
    ticks: int = 0
    closed: bool = False
    warm_up_ticks: int = 0  # the ticks of its construction, before any slot's (`warm_up_ticks(device)`)

    @property
    def device(self) -> torch.device:
        return next(self.models.lm.parameters()).device

    @property
    def frame_size(self) -> int:
        return self.models.mimi.frame_size

    @property
    def report(self) -> TransformReport:
        """The two transforms' reports as one, as they stand now, and what the runtime is."""
        report = TransformReport.merged(list(self.reports.values()))
        stages = ", ".join(f"{name} K={len(op.classes)}" for name, op in report.operators.items())
        report.stamps.append(
            f"slots: batch of {self.slots}, {stages}; the vendor's glue calls the bound lm_step "
            "and depformer_step as its graphed_main and graphed_depth"
        )
        return report

    @contextlib.contextmanager
    def _generators(self) -> Iterator[None]:
        """The batch's generator state swapped in for a tick; the caller's put back after it."""
        if self.rng is None:
            raise RuntimeError("these slots have no generator state: build them with transform_slots, which seeds it")
        caller = rng_get(self.device)
        rng_set(self.device, self.rng)
        try:
            yield
        finally:
            self.rng = rng_get(self.device)
            rng_set(self.device, caller)

    def tick(self, tick: Tick) -> TickOutput:
        from moshi.utils.compile import no_compile

        if self.closed:
            raise RuntimeError(f"this {type(self).__name__} is closed")
        _check_tick(tick, self.slots, self.frame_size)
        device, mimi, lm_gen = self.device, self.models.mimi, self.lm_gen
        stages = self.bound["mimi"].operators
        live = tuple(sorted(tick.frames))
        ran = [0 if slot in tick.joins else count for slot, count in enumerate(self.ran)]
        # LMGen's offsets reach max_delay + 1 at a slot's (max_delay + 1)-th frame: its first real tokens.
        speaking = tuple(slot for slot in live if ran[slot] + 1 > lm_gen.max_delay)
        # The vendor's own `CUDAGraphed` wrappers stay on: those of its exec masks and resets run
        # as in its own loop; the ones of the stages are never reached while the bound operators
        # replay (only a stock fallback calls them).
        with self._generators(), no_compile(), torch.inference_mode():
            # Every input goes to the device before the first stage runs (the speaking mask too:
            # it is known on the host), so no copy waits for a stage in flight.
            live_mask, speaking_mask = _mask(self.slots, live, device), _mask(self.slots, speaking, device)
            frames = _frames(self.slots, self.frame_size, tick.frames, device)
            if tick.joins:
                joins = _mask(self.slots, tick.joins, device)
                mimi.reset_streaming(joins)
                lm_gen.reset_streaming(joins)
            mimi.set_exec_mask(live_mask)
            lm_gen.set_exec_mask(live_mask)
            codes = stages["mimi_encode"](frames)
            tokens = lm_gen.step(codes)  # its glue calls the bound lm_step and depformer_step
            mimi.set_exec_mask(speaking_mask)
            pcm = stages["mimi_decode"](tokens[:, 1:].clamp(min=0))
        self.ran = [count + (slot in live) for slot, count in enumerate(ran)]
        self.ticks += 1
        return TickOutput(live, speaking, tokens[:, :, 0], pcm[:, 0])

    def counters(self) -> dict[str, dict]:
        """Per stage: its replay engine's counters (on a GPU), else its bound operator's (calls,
        graph calls, verified, stock)."""
        engines = replays(self.bound)
        return {
            name: (engines[name] if name in engines else op).counters.as_dict()
            for model in self.bound.values()
            for name, op in model.operators.items()
        }

    def addresses(self) -> list[int]:
        """Where every tensor the stages' graphs read as state lives (regions and device-side
        counters): the same for the runtime's life."""
        return [t.data_ptr() for model in self.bound.values() for t in model.resident()[0]]

    def close(self) -> None:
        """Leave streaming and drop every graph: the batch's state and graph pools can be freed."""
        if not self.closed:
            self.closed = True
            for engine in replays(self.bound).values():
                engine.reset()
            self.streaming.close()


def transform_slots(
    models: MoshiModels, contract: Contract, *, sampling: bool, seed: int, replay: bool = True
) -> tuple[MoshiSlots, TransformReport]:
    """A `MoshiSlots` at the contract's batch (quantity `slots`) on `models`' weights (shared, not
    copied; the lazily derived codebook caches the calls read are filled in `models` first, as the
    vendor's first call would), on the one pipeline of every model: Mimi and `LMGen` transformed
    from `MIMI_SLOTS_BINDING` and `MOSHI_LM_SLOTS_BINDING` (Moshi's bindings with the exec masks of
    the modules each operator runs, which `set_exec_mask` writes in place between the calls);
    Mimi's encode and decode called by the runtime, the LM's main step and depformer step called
    by the vendor's own glue (`LMGen.step`) as its `graphed_main` and `graphed_depth`. Every ring
    is a region written before it is read: it stays where the vendor allocated it (no buffer, no
    copy). `sampling` and `seed` are the batch's (module docstring).

    The runtime ticks at construction until every stage is verified and, on a GPU, captured
    (`warm_up_ticks`), then resets every slot in place (`reset_streaming` of all rows) and seeds
    its generator, so its first tick starts where the vendor's `streaming(B)` entry does. Like
    every transform it pins no kernel switch: on a GPU the caller pins deterministic kernels first
    (`cadence_fx.determinism.pin_deterministic`), and the report says what it found."""
    slots = contract.symbols().get("slots")
    if not isinstance(slots, int) or slots < 1:
        raise ValueError(f"contract quantity slots must be a positive batch size, got {slots!r}")
    models, lm_gen, streaming = streaming_copy(models, contract, slots, use_sampling=sampling, support_out_of_sync=True)
    try:
        bound, reports = bind(models, lm_gen, contract, MIMI_SLOTS_BINDING, MOSHI_LM_SLOTS_BINDING, replay=replay)
        runtime = MoshiSlots(models, lm_gen, slots, bound, reports, streaming, ran=[0] * slots)
        _warm_up(runtime)
    except BaseException:
        streaming.close()
        raise
    runtime.rng = rng_seeded(runtime.device, seed)
    runtime.ran, runtime.ticks = [0] * slots, 0
    return runtime, runtime.report


def _warm_up(runtime: MoshiSlots) -> None:
    """`warm_up_ticks` of silence in every slot, then every slot reset in place (`reset_streaming`
    of all rows, the fresh streaming entry's values): every stage verified (on a GPU captured),
    every address kept."""
    from moshi.utils.compile import no_compile, no_cuda_graph

    device, slots, mimi, lm_gen = runtime.device, runtime.slots, runtime.models.mimi, runtime.lm_gen
    everyone = tuple(range(slots))
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []), no_compile(), no_cuda_graph():
        runtime.rng = rng_get(device)
        silence = torch.zeros(mimi.frame_size)
        runtime.warm_up_ticks = warm_up_ticks(device)
        for index in range(runtime.warm_up_ticks):
            runtime.tick(Tick({slot: silence for slot in everyone}, joins=everyone if index == 0 else ()))
        with torch.inference_mode():
            mimi.reset_streaming(_mask(slots, everyone, device))
            lm_gen.reset_streaming(_mask(slots, everyone, device))
