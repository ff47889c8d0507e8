"""Moshi sessions as slots (SMALL size) on CUDA, from Moshi's slots bindings on the one pipeline:
every stage replayed at batch B, every tick's
tokens and PCM bit-exact against the vendor's own batched eager loop over the same schedule
(joins, idle slots, a slot taken over), sampling and greedy.

The full-size comparison with the vendor's own CUDA graphs, B up to 64, is `bench/moshi_slots.py`.
"""

from __future__ import annotations

import pytest
import torch

from cadence_fx.models.moshi import contract_for
from cadence_fx.models.moshi_slots import Tick, transform_slots, vendor_slots
from cadence_fx.models.moshi_stream import SMALL, build_models, random_pcm

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

SLOTS, SEED = 4, 5


def schedule() -> list[Tick]:
    """Four sessions join over the first ticks, two idle a while, slot 1 is taken over."""
    pcm = [random_pcm(12, seed=90 + i).reshape(12, 1920) for i in range(5)]
    ticks = []
    for t in range(12):
        frames = {
            slot: pcm[4 if slot == 1 and t >= 8 else slot][t]
            for slot in range(SLOTS)
            if t >= slot and not (slot == 2 and 4 <= t < 7)
        }
        joins = tuple(slot for slot in range(SLOTS) if t == slot) + ((1,) if t == 8 else ())
        ticks.append(Tick(frames, joins))
    return ticks


@pytest.fixture(scope="module")
def models():
    return build_models(SMALL, device="cuda")


@pytest.mark.parametrize("sampling", [True, False], ids=["sampling", "greedy"])
def test_every_replayed_tick_is_the_vendors_batched_eager_call_bit_for_bit(models, sampling):
    runtime, _ = transform_slots(models, contract_for(SMALL, slots=SLOTS), sampling=sampling, seed=SEED)
    addresses = runtime.addresses()
    ours = [runtime.tick(tick) for tick in schedule()]
    reference = vendor_slots(models, SLOTS, schedule(), sampling=sampling, seed=SEED)
    for tick, (mine, theirs) in enumerate(zip(ours, reference, strict=True)):
        assert (mine.live, mine.speaking) == (theirs.live, theirs.speaking), tick
        assert torch.equal(mine.tokens, theirs.tokens), tick
        assert torch.equal(mine.pcm, theirs.pcm), tick
    assert runtime.addresses() == addresses
    # Of the three warm-up ticks (`warm_up_ticks`), two were the stages' verified calls and the
    # third captured each stage; every call since replayed, none eager.
    assert runtime.warm_up_ticks == 3
    for name, counters in runtime.counters().items():
        assert counters["captures"] == 1 and counters["eager"] == 0, (name, counters)
        assert counters["replays"] == counters["calls"] == 1 + 12, (name, counters)
    runtime.close()
