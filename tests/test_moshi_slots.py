"""Moshi sessions as slots of one batch (models/moshi_slots.py), TINY size on a CPU: Mimi and
`LMGen` at a batch of slots transformed from Moshi's slots bindings on the one pipeline, the
vendor's glue calling the bound LM steps. Every tick is the vendor's own batched call at the same
B, bit for bit; every ring stays where the vendor allocated it; an idle slot keeps its state; a
join resets its slot alone; at B = 1 the runtime is the vendor's batch-1 stream."""

from __future__ import annotations

import pytest
import torch
from moshi.modules.transformer import RingKVCache

from cadence_fx import derive, transform
from cadence_fx.models.moshi import contract_for
from cadence_fx.models.moshi_bound import OwnedState
from cadence_fx.models.moshi_slots import Tick, transform_slots, vendor_slots
from cadence_fx.models.moshi_stream import TINY, build_models, random_pcm, stream_reference

SLOTS, SEED = 3, 5


@pytest.fixture(scope="module")
def models():
    return build_models(TINY)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the reference and the runtime on one thread


def frames(seed: int, n: int) -> list[torch.Tensor]:
    return list(random_pcm(n, seed=seed).reshape(n, 1920))


def schedule() -> list[Tick]:
    """Sessions a, b, c join, idle, leave; slot 0 is taken over by d and slot 1 by e."""
    a, b, c, d, e = (frames(seed, 8) for seed in (60, 61, 62, 63, 64))
    return [
        Tick({0: a[0], 1: b[0]}, joins=(0, 1)),
        Tick({0: a[1]}),
        Tick({0: a[2], 1: b[1], 2: c[0]}, joins=(2,)),
        Tick({1: b[2], 2: c[1]}),
        Tick({0: a[3], 1: b[3], 2: c[2]}),
        Tick({0: d[0], 2: c[3]}, joins=(0,)),  # a left, d joins; b left
        Tick({0: d[1], 2: c[4]}),
        Tick({0: d[2], 1: e[0], 2: c[5]}, joins=(1,)),
        Tick({0: d[3], 1: e[1], 2: c[6]}),
        Tick({0: d[4], 1: e[2]}),
    ]


def run(runtime, ticks):
    return [runtime.tick(tick) for tick in ticks]


@pytest.fixture(scope="module", params=[True, False], ids=["sampling", "greedy"])
def both(request, models):
    """The runtime and the vendor's batched loop over the same schedule."""
    runtime, report = transform_slots(models, contract_for(TINY, slots=SLOTS), sampling=request.param, seed=SEED)
    addresses = runtime.addresses()
    ours = run(runtime, schedule())
    reference = vendor_slots(models, SLOTS, schedule(), sampling=request.param, seed=SEED)
    return request.param, runtime, report, addresses, ours, reference


def test_every_tick_is_the_vendors_batched_call_bit_for_bit(both):
    _, _, _, _, ours, reference = both
    assert len(ours) == len(reference) == 10
    for tick, (mine, theirs) in enumerate(zip(ours, reference)):
        assert (mine.live, mine.speaking) == (theirs.live, theirs.speaking), tick
        assert torch.equal(mine.tokens, theirs.tokens), tick
        assert torch.equal(mine.pcm, theirs.pcm), tick


def test_each_slot_speaks_after_its_own_acoustic_delay(both):
    _, _, _, _, ours, _ = both
    assert [(o.live, o.speaking) for o in ours] == [
        ((0, 1), ()),
        ((0,), (0,)),
        ((0, 1, 2), (0, 1)),
        ((1, 2), (1, 2)),
        ((0, 1, 2), (0, 1, 2)),
        ((0, 2), (2,)),  # d's first frame
        ((0, 2), (0, 2)),
        ((0, 1, 2), (0, 2)),  # e's first frame
        ((0, 1, 2), (0, 1, 2)),
        ((0, 1), (0, 1)),
    ]
    assert ours[0].slot(0) is None
    tokens, pcm = ours[1].slot(0)
    assert tokens.shape == (9,) and pcm.shape == (1920,) and bool((tokens >= 0).all())
    assert all(bool((o.tokens[list(o.speaking)] >= 0).all()) for o in ours)
    assert all(
        bool((o.tokens[[s for s in range(SLOTS) if s not in o.speaking]] == -2).all()) for o in ours
    )  # the vendor's ungenerated id


def test_sampled_and_greedy_runs_differ(both, models):
    sampling, _, _, _, ours, _ = both
    other = vendor_slots(models, SLOTS, schedule(), sampling=not sampling, seed=SEED)
    assert not torch.equal(torch.stack([o.tokens for o in ours]), torch.stack([o.tokens for o in other]))


def test_the_state_keeps_every_address_through_ticks_and_joins(both):
    _, runtime, _, addresses, _, _ = both
    assert runtime.addresses() == addresses


def test_counters_show_every_stage_call_of_warm_up_and_ticks(both):
    sampling, runtime, report, _, _, _ = both
    assert runtime.warm_up_ticks == 2  # on a CPU: the verified visits, nothing to capture
    ticks = 10
    for name, op in report.operators.items():
        assert {key: op.counters.as_dict()[key] for key in ("calls", "graph_calls", "verified", "stock")} == {
            "calls": 2 + ticks,
            "graph_calls": 2 + ticks,
            "verified": 2,
            "stock": 0,
        }, name

    def eager(reason):
        return {"calls": ticks, "captures": 0, "replays": 0, "eager": ticks, "invalidations": 0, "fallbacks": {reason: ticks}}

    # Once verified, every call goes through the stage's replay engine: without CUDA it runs the
    # rewritten graph eagerly (no_cuda); the sampling depformer reads the CPU generator, a host
    # RNG, so its class is refused for good.
    assert runtime.counters() == {
        "mimi_encode": eager("no_cuda"),
        "mimi_decode": eager("no_cuda"),
        "lm_step": eager("no_cuda"),
        "depformer_step": eager("host_rng" if sampling else "no_cuda"),
    }


#: The depformer's modes besides the sampling switch: `LMGen`'s defaults.
SAMPLING = "self.temp=0.8, self.top_k=250, self.cfg_coef=1.0"


def test_each_stage_has_one_class_at_the_batch_bound_from_the_bindings(both):
    sampling, runtime, report, *_ = both
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
        for region, shape, size in (
            ("mimi_encoder_kv", f"1x2x{SLOTS}x2x250x16", "187.50 KiB"),
            ("mimi_decoder_kv", f"1x2x{SLOTS}x2x250x16", "187.50 KiB"),
            ("lm_kv", f"1x2x{SLOTS}x4x3000x8", "2.20 MiB"),
        )
    ]
    assert report.stamps[-1] == (
        f"slots: batch of {SLOTS}, mimi_encode K=1, mimi_decode K=1, lm_step K=1, depformer_step K=1; the vendor's "
        "glue calls the bound lm_step and depformer_step as its graphed_main and graphed_depth"
    )


def test_the_catalog_declares_every_ring_at_the_batch():
    catalog = derive(contract_for(TINY, slots=SLOTS))
    assert catalog.region("lm_kv").shape == (1, 2, SLOTS, 4, 3000, 8)
    assert catalog.region("mimi_encoder_kv").shape == (1, 2, SLOTS, 2, 250, 16)
    assert {op.name: op.width for op in catalog.operators} == {
        "mimi_encode": 1,
        "lm_step": 1,
        "depformer_step": 1,
        "mimi_decode": 1,
    }


def _held(runtime) -> list:
    """Every tensor of the batch's streaming state, with the vendor object that holds it."""
    return OwnedState.of(
        {
            "mimi": runtime.models.mimi.get_streaming_state(),
            "lm": runtime.models.lm.get_streaming_state(),
            "lm_gen": runtime.lm_gen.get_streaming_state(),
        }
    ).tensors


def _rows(runtime, slot: int) -> list[tuple[str, torch.Tensor]]:
    """Every state tensor's row of `slot` (the batch axis is 1 in a ring body, else 0), with the
    tensors that hold no batch axis (LMGen's initial tokens) whole; exec masks left out."""
    rows = []
    for held in _held(runtime):
        name = f"{type(held.owner).__name__}.{held.attr}"
        if held.attr == "exec_mask":
            continue
        if isinstance(held.owner, RingKVCache) and held.attr == "cache":
            rows.append((name, held.tensor[:, slot].clone()))
        elif held.tensor.dim() and held.tensor.shape[0] == runtime.slots:
            rows.append((name, held.tensor[slot].clone()))
        else:
            rows.append((name, held.tensor.clone()))
    return rows


def _rings(runtime) -> list[RingKVCache]:
    return [held.owner for held in _held(runtime) if isinstance(held.owner, RingKVCache) and held.attr == "cache"]


def test_an_idle_slot_keeps_its_state_but_the_ring_positions_its_next_call_writes_first(models):
    runtime, _ = transform_slots(models, contract_for(TINY, slots=SLOTS), sampling=True, seed=SEED)
    a, b, c = frames(70, 4), frames(71, 4), frames(72, 4)
    run(runtime, [Tick({0: a[0], 1: b[0], 2: c[0]}, joins=(0, 1, 2)), Tick({0: a[1], 1: b[1], 2: c[1]})])
    before = _rows(runtime, 2)
    ends = [ring.end_offset[2].item() for ring in _rings(runtime)]
    run(runtime, [Tick({0: a[2], 1: b[2]}), Tick({0: a[3]})])  # slot 2 idle for two ticks
    after = _rows(runtime, 2)

    assert [name for name, _ in before] == [name for name, _ in after]
    rings = iter(zip(_rings(runtime), ends))
    touched = 0
    for (name, old), (_, new) in zip(before, after):
        if name != "RingKVCache.cache":
            assert torch.equal(old, new), name
            continue
        ring, end = next(rings)
        assert ring.end_offset[2].item() == end
        changed = (old != new).any(dim=0).any(dim=0).any(dim=-1).nonzero().flatten().tolist()  # positions
        assert set(changed) <= {(end + t) % ring.capacity for t in range(2)}, changed
        touched += bool(changed)
    assert touched  # masked rows are computed and scattered: what the assertion above bounds
    assert runtime.ran == [4, 3, 2]


@pytest.fixture(scope="module")
def greedy(models):
    """One greedy runtime for the tests whose schedules begin with their slots' joins: a join
    resets its slot (`test_a_joining_session_hears_nothing_of_the_slots_last_session`), so what
    an earlier test ran on it does not reach them."""
    runtime, _ = transform_slots(models, contract_for(TINY, slots=SLOTS), sampling=False, seed=SEED)
    return runtime


def test_an_idle_slot_resumes_as_if_it_had_never_waited(greedy):
    """Greedy, so nothing couples the slots: in one batch, slot 1 with three idle ticks in the
    middle gives what slot 0 gives on the same frames with none."""
    mine = frames(73, 6)
    outs = run(
        greedy,
        [
            Tick({0: mine[0], 1: mine[0]}, joins=(0, 1)),
            Tick({0: mine[1], 1: mine[1]}),
            Tick({0: mine[2], 1: mine[2]}),
            Tick({0: mine[3]}),
            Tick({0: mine[4]}),
            Tick({0: mine[5]}),
            Tick({1: mine[3]}),
            Tick({1: mine[4]}),
            Tick({1: mine[5]}),
        ],
    )
    straight = [o.slot(0) for o in outs if 0 in o.live]
    paused = [o.slot(1) for o in outs if 1 in o.live]
    assert len(straight) == len(paused) == 6 and straight[0] is paused[0] is None
    for (tokens, pcm), (want_tokens, want_pcm) in zip(paused[1:], straight[1:]):
        assert torch.equal(tokens, want_tokens) and torch.equal(pcm, want_pcm)


def test_a_join_resets_its_slot_alone(models):
    """Two runtimes, one schedule, but slot 1 rejoins at tick 2 in one of them: every other
    slot's state bytes and outputs stay the same in both (the batch's draws too: a join draws
    nothing), and slot 1 restarts (its first frame after the join says nothing)."""
    contract = contract_for(TINY, slots=SLOTS)
    a, b, c = frames(75, 5), frames(76, 5), frames(77, 5)
    ticks = [Tick({0: a[i], 1: b[i], 2: c[i]}, joins=(0, 1, 2) if i == 0 else ()) for i in range(5)]
    rejoined = [*ticks[:2], Tick(ticks[2].frames, joins=(1,)), *ticks[3:]]
    kept, _ = transform_slots(models, contract, sampling=True, seed=SEED)
    reset, _ = transform_slots(models, contract, sampling=True, seed=SEED)
    for tick_kept, tick_reset in zip(ticks, rejoined):
        out_kept, out_reset = kept.tick(tick_kept), reset.tick(tick_reset)
        for slot in (0, 2):
            assert all(torch.equal(x, y) for (_, x), (_, y) in zip(_rows(kept, slot), _rows(reset, slot)))
            assert torch.equal(out_kept.tokens[slot], out_reset.tokens[slot])
            assert torch.equal(out_kept.pcm[slot], out_reset.pcm[slot])
    assert (kept.ran, reset.ran) == ([5, 5, 5], [5, 3, 5])
    assert out_reset.speaking == (0, 1, 2)
    assert [o.speaking for o in vendor_slots(models, SLOTS, rejoined, sampling=True, seed=SEED)][2] == (0, 2)


def test_a_joining_session_hears_nothing_of_the_slots_last_session(greedy):
    """Greedy: after a join, slot 2 gives what slot 0, joining afresh at the same tick, gives on
    the same frames, although slot 2's rings still hold the previous session's keys (a reset only
    empties them)."""
    old, new = frames(78, 4), frames(79, 4)
    runtime = greedy
    run(runtime, [Tick({2: f}, joins=(2,) if i == 0 else ()) for i, f in enumerate(old)])
    after = run(runtime, [Tick({0: f, 2: f}, joins=(0, 2) if i == 0 else ()) for i, f in enumerate(new)])
    assert [o.speaking for o in after] == [(), (0, 2), (0, 2), (0, 2)]
    for out in after[1:]:
        assert torch.equal(out.tokens[2], out.tokens[0]) and torch.equal(out.pcm[2], out.pcm[0])


@pytest.fixture(scope="module")
def one_slot(models):
    """A runtime of one slot; `test_a_closed_runtime_refuses_to_tick`, the last to use it, closes it."""
    runtime, _ = transform_slots(models, contract_for(TINY, slots=1), sampling=True, seed=SEED)
    return runtime


def test_at_one_slot_the_runtime_is_the_vendors_batch_1_stream(models, one_slot):
    pcm = random_pcm(8, seed=80)
    runtime = one_slot
    outs = run(runtime, [Tick({0: f}, joins=(0,) if i == 0 else ()) for i, f in enumerate(pcm.reshape(8, 1920))])
    reference = stream_reference(models, pcm, sampling=True, seed=SEED)
    assert torch.equal(torch.stack([o.tokens[0] for o in outs[1:]], dim=-1)[None], reference.tokens)
    assert torch.equal(torch.cat([o.pcm[0] for o in outs[1:]])[None, None], reference.pcm)


def test_a_closed_runtime_refuses_to_tick(one_slot):
    runtime = one_slot
    runtime.close()
    with pytest.raises(RuntimeError, match="this MoshiSlots is closed"):
        runtime.tick(Tick({0: torch.zeros(1920)}))


def test_against_batch_1_greedy_tokens_agree_and_pcm_is_close_but_not_promised_equal(models, greedy):
    """What a slot at B = 3 gives against the vendor's batch-1 stream of the same frames, greedy.
    Not a guarantee (batched kernels may round differently): measured here, tokens equal and PCM
    within 2.6e-8 of batch 1, not equal."""
    streams = [random_pcm(10, seed=81 + slot) for slot in range(SLOTS)]
    outs = run(
        greedy,
        [
            Tick({slot: s.reshape(10, 1920)[i] for slot, s in enumerate(streams)}, joins=tuple(range(SLOTS)) if i == 0 else ())
            for i in range(10)
        ],
    )
    for slot, pcm in enumerate(streams):
        reference = stream_reference(models, pcm, sampling=False, seed=SEED)
        assert torch.equal(torch.stack([o.tokens[slot] for o in outs[1:]], dim=-1)[None], reference.tokens)
        torch.testing.assert_close(torch.cat([o.pcm[slot] for o in outs[1:]])[None, None], reference.pcm, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("tick", "error"),
    [
        (Tick({}), "a tick runs at least one slot: its frames are empty"),
        (Tick({3: torch.zeros(1920)}), "frames: slot 3 is outside 0..2 (the batch holds 3 slots)"),
        (Tick({0: torch.zeros(1920)}, joins=(-1,)), "joins: slot -1 is outside 0..2 (the batch holds 3 slots)"),
        (Tick({0: torch.zeros(1920)}, joins=(0, 0)), "joins: a slot joins twice in one tick: [0, 0]"),
        (
            Tick({1: torch.zeros(1, 1920)}),
            "frames[1]: a frame is 1920 float32 samples, shape (1920,); got torch.float32 (1, 1920)",
        ),
        (
            Tick({1: torch.zeros(1920, dtype=torch.float64)}),
            "frames[1]: a frame is 1920 float32 samples, shape (1920,); got torch.float64 (1920,)",
        ),
    ],
)
def test_a_bad_tick_is_refused_by_name_before_anything_runs(both, tick, error):
    _, runtime, *_ = both
    ran, ticks = list(runtime.ran), runtime.ticks
    with pytest.raises(ValueError) as refused:
        runtime.tick(tick)
    assert str(refused.value) == error
    assert (runtime.ran, runtime.ticks) == (ran, ticks)


def test_the_one_session_transform_refuses_a_batch_of_slots(models):
    with pytest.raises(ValueError) as refused:
        transform(models, contract_for(TINY, slots=2))
    assert str(refused.value) == (
        "contract quantity slots=2: transform() streams one session at batch 1; sessions as "
        "slots of one batch: models/moshi_slots.py transform_slots"
    )
