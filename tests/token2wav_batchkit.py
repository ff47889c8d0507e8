"""Random compositions of Token2Wav streams for the batched-rows tests (CPU and cuda).

A schedule is rounds of chunk steps. Each stream joins at a round of its own, streams one or two
turns of 2 or 3 chunks (the last of each flushing, a turn reset between them), sometimes pauses a
round, and leaves when its turns are done, so a round mixes streams at every class of the catalog.
Each stream's reference is the vendor's stream (`StockStream`) run alone under the same envelope.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from cadence_fx.models.token2wav_batch import BatchedStreams
from cadence_fx.models.token2wav_envelope import StreamRng, batch_invariant
from cadence_fx.models.token2wav_stream import StockStream, random_chunks, random_prompt


@dataclass
class Plan:
    seed: int
    join: int  # round it joins
    turns: list[list[torch.Tensor]]
    pauses: set[int]  # rounds (after joining) it sits out


def plans(seed: int, streams: int, *, prompt_tokens: int, device: str = "cpu") -> list[Plan]:
    rand = random.Random(seed)
    out = []
    for s in range(streams):
        stream_seed = 1000 * seed + s
        lengths = [rand.choice((2, 3)) for _ in range(rand.choice((1, 2)))]
        chunks = random_chunks(stream_seed, sum(lengths), device=device)
        turns, at = [], 0
        for n in lengths:
            turns.append(chunks[at : at + n])
            at += n
        out.append(Plan(stream_seed, rand.randrange(3), turns, {r for r in range(8) if rand.random() < 0.2}))
    return out


def expected_class(index: int, length: int) -> tuple[int, bool]:
    """A chunk's class from the schedule alone: its place in the turn (the cache extent stops
    growing at the third chunk) and whether it flushes."""
    return min(index, 2), index == length - 1


def run_batched(batched: BatchedStreams, schedule: list[Plan], *, prompt_tokens: int, device: str = "cpu"):
    """Every stream of `schedule` through `batched`; returns each stream's chunks (mel, PCM) and,
    per call, the schedule's classes of the rows it held."""
    outs = {s: [] for s in range(len(schedule))}
    where = {s: (0, 0) for s in range(len(schedule))}  # (turn, chunk)
    call_classes = []
    round_ = 0
    while any(where[s][0] < len(p.turns) for s, p in enumerate(schedule)):
        chunks, last, classes = {}, set(), {}
        for s, plan in enumerate(schedule):
            turn, index = where[s]
            if round_ < plan.join or turn >= len(plan.turns):
                continue
            if round_ == plan.join:
                batched.join(s, random_prompt(plan.seed, n_tokens=prompt_tokens, device=device), plan.seed)
            if round_ in plan.pauses and round_ != plan.join:
                continue
            if index == 0 and turn > 0:
                batched.reset_turn(s)
            length = len(plan.turns[turn])
            chunks[s] = plan.turns[turn][index]
            classes[s] = expected_class(index, length)
            if index == length - 1:
                last.add(s)
                where[s] = (turn + 1, 0)
            else:
                where[s] = (turn, index + 1)
        before = len(batched.calls)
        for s, out in batched.step(chunks, last).items():
            outs[s].append(out)
        call_classes += [[classes[k] for k in keys] for _, keys in batched.calls[before:]]
        for s, plan in enumerate(schedule):
            if s in batched.rows and where[s][0] >= len(plan.turns):
                batched.leave(s)
        round_ += 1
    return outs, call_classes


def run_alone(
    flow, hift, plan: Plan, *, capacity: int, prompt_tokens: int, n_timesteps: int, device: str = "cpu", float16: bool = False
):
    """The vendor's stream of `plan`, alone under the batch-invariant envelope at `capacity`."""
    stream = StockStream(
        flow, hift, random_prompt(plan.seed, n_tokens=prompt_tokens, device=device), n_timesteps=n_timesteps, float16=float16
    )
    rng = StreamRng(plan.seed)
    outs = []
    with torch.inference_mode():
        for t, turn in enumerate(plan.turns):
            with batch_invariant(capacity, [rng], device):
                stream.setup() if t == 0 else stream.reset_turn()
            for i, tokens in enumerate(turn):
                with batch_invariant(capacity, [rng], device):
                    outs.append(stream.step(tokens, last_chunk=i == len(turn) - 1))
    return outs
