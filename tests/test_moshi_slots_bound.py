"""Moshi's slots runtime on the one pipeline (`transform_bound_slots`, models/moshi_slots.py):
Mimi and `LMGen` at a batch of slots transformed from their bindings as data, the vendor's glue
calling the bound LM steps. TINY size on a CPU, SMALL on a GPU: every tick is the vendor's own
batched call at the same B, bit for bit, over a schedule of joins and idle slots; every ring
stays where the vendor allocated it."""

from __future__ import annotations

import pytest
import torch

from cadence_fx.models.moshi import contract_for
from cadence_fx.models.moshi_slots import Tick, transform_bound_slots, vendor_slots
from cadence_fx.models.moshi_stream import SMALL, TINY, build_models, random_pcm

SLOTS, SEED = 3, 5


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the reference and the runtime on one thread


def schedule() -> list[Tick]:
    """Sessions join and leave, slot 1 idles for two ticks, slot 2 joins again at tick 7."""
    a, b, c = (list(random_pcm(12, seed=seed).reshape(12, 1920)) for seed in (21, 22, 23))
    ticks = [Tick({0: a[0], 1: b[0], 2: c[0]}, joins=(0, 1, 2))]
    for t in range(1, 12):
        live = {0: a[t], 2: c[t]} | ({} if t in (4, 5) else {1: b[t]})
        ticks.append(Tick(live, joins=(2,) if t == 7 else ()))
    return ticks


def run(device: str, size, sampling: bool):
    models = build_models(size, device)
    runtime, report = transform_bound_slots(models, contract_for(size, slots=SLOTS), sampling=sampling, seed=SEED)
    addresses = runtime.addresses()
    ours = [runtime.tick(tick) for tick in schedule()]
    reference = vendor_slots(models, SLOTS, schedule(), sampling=sampling, seed=SEED)
    for tick, (mine, theirs) in enumerate(zip(ours, reference, strict=True)):
        assert (mine.live, mine.speaking) == (theirs.live, theirs.speaking), tick
        assert torch.equal(mine.tokens, theirs.tokens), tick
        assert torch.equal(mine.pcm, theirs.pcm), tick
    assert runtime.addresses() == addresses
    return runtime, report


#: The depformer's modes besides the sampling switch: `LMGen`'s defaults.
SAMPLING = "self.temp=0.8, self.top_k=250, self.cfg_coef=1.0"


@pytest.mark.parametrize("sampling", [True, False], ids=["sampling", "greedy"])
def test_every_tick_is_the_vendors_batched_call_bit_for_bit_from_the_bindings(sampling):
    runtime, report = run("cpu", TINY, sampling)
    calls = 2 + 12  # two warm-up ticks at construction (the verified calls), then the schedule
    for name, op in report.operators.items():
        assert {key: op.counters.as_dict()[key] for key in ("calls", "graph_calls", "verified", "stock")} == {
            "calls": calls, "graph_calls": calls, "verified": 2, "stock": 0}, name
    classes = {name: [(cls.name, cls.refused) for cls in op.classes.values()] for name, op in report.operators.items()}
    assert classes == {
        "mimi_encode": [("mimi_encode[n=2,L=250]", None)],
        "mimi_decode": [("mimi_decode[n=2,L=250]", None)],
        "lm_step": [("lm_step[n=1,L=3000]", None)],
        "depformer_step": [(f"depformer_step[n=1,L=8]{{self.use_sampling={sampling}, {SAMPLING}}}", None)],
    }
    state = runtime.lm_gen._streaming_state
    assert (state.graphed_main, state.graphed_depth) == (report.operators["lm_step"], report.operators["depformer_step"])
    # Every ring stays where the vendor allocated it at the batch: no buffer allocated, nothing copied in.
    assert [stamp for stamp in report.stamps if stamp.startswith("state rule")] == [
        f"state rule: {region} at {shape} ({size}), kept where the model holds it (1 tensor), none allocated; written "
        "before read (the binding says so): never copied, verified through the outputs it feeds"
        for region, shape, size in (("mimi_encoder_kv", f"1x2x{SLOTS}x2x250x16", "187.50 KiB"),
                                    ("mimi_decoder_kv", f"1x2x{SLOTS}x2x250x16", "187.50 KiB"),
                                    ("lm_kv", f"1x2x{SLOTS}x4x3000x8", "2.20 MiB"))]
    assert report.stamps[-1] == (
        f"slots: batch of {SLOTS}, mimi_encode K=1, mimi_decode K=1, lm_step K=1, depformer_step K=1; the vendor's "
        "glue calls the bound lm_step and depformer_step as its graphed_main and graphed_depth")
    runtime.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("sampling", [True, False], ids=["sampling", "greedy"])
def test_every_replayed_tick_is_the_vendors_batched_eager_call_bit_for_bit_from_the_bindings(sampling):
    runtime, _ = run("cuda", SMALL, sampling)
    for name, counters in runtime.counters().items():
        # Of the three warm-up ticks (`bound_warm_up_ticks`), two were the stages' verified calls
        # and the third captured each stage; every call since replayed, none eager.
        assert runtime.warm_up_ticks == 3
        assert counters["captures"] == 1 and counters["eager"] == 0, (name, counters)
        assert counters["replays"] == counters["calls"] == 1 + 12, (name, counters)
    runtime.close()
