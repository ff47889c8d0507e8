"""A `transformers` Llama decoder streamed with its own `StaticCache`, whose layers write each call's
keys and values in place into preallocated tensors (`index_copy_` at `cache_position`) and move a
device-side length: contract (RingCache: the extent never changes) plus binding, nothing else.
Nothing needs rewriting; the pipeline exports the step once, verifies it against the stock call,
and replays it (on CUDA) with the cache aliased at one address per layer."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

from cadence_fx import (
    Admission,
    Binding,
    Clock,
    ClockKind,
    Contract,
    Interactivity,
    Lifetime,
    Operator,
    OperatorBinding,
    Rate,
    Region,
    RegionBinding,
    RingCache,
    transform,
)

LAYERS, KV_HEADS, HEAD_DIM, CAPACITY, STEP, TOKENS = 2, 2, 8, 16, 2, 14


def build_model(device: str):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).eval().to(device), config


CONTRACT = Contract(
    family="llama_static_cache",
    clocks=(Clock("token", ClockKind.TOKENS), Clock("call", ClockKind.CALLS)),
    rates=(Rate("token", "call", STEP, name="tokens_per_call"),),
    quantities={"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM},
    regions=(
        Region(
            "kv",
            dims=("layers", 2, 1, "kv_heads", "token", "head_dim"),
            axis=4,
            clock="token",
            stride=STEP,
            dtype="float32",
            lifetime=Lifetime.PER_STREAM,
            retention=RingCache(CAPACITY),
        ),
    ),
    operators=(Operator("decoder_step", "kv", steady=STEP),),
    admission=Admission("token", max_per_call=STEP),
    interactivity=Interactivity(stages=("decoder",)),
)
# Keys and values are the region; `is_initialized` (a host flag the first call sets) and
# `cumulative_length` (a device tensor each call advances in place) are the counters.
BINDING = Binding(
    regions=(RegionBinding("kv", at=("cache.layers.*.keys", "cache.layers.*.values")),),
    operators=(
        OperatorBinding(
            "decoder_step", units=("input_ids", 1), counters=("cache.layers.*.is_initialized", "cache.layers.*.cumulative_length")
        ),
    ),
)


def stream(model, config, tokens: torch.Tensor):
    cache = StaticCache(config=config, max_cache_len=CAPACITY)
    logits, addresses = [], set()
    with torch.no_grad():
        for t in range(0, tokens.shape[1], STEP):
            position = torch.arange(t, t + STEP, device=tokens.device)
            out = model(
                input_ids=tokens[:, t : t + STEP],
                cache=cache,
                cache_position=position,
                position_ids=position[None],
                use_cache=True,
            )
            logits.append(out.logits)
            addresses.add(tuple(t.data_ptr() for layer in cache.layers for t in (layer.keys, layer.values)))
    return logits, addresses


def run(device: str, streams: int):
    model, config = build_model(device)
    tokens = torch.randint(0, config.vocab_size, (1, TOKENS), generator=torch.Generator().manual_seed(1)).to(device)
    expected, _ = stream(model, config, tokens)
    bound, report = transform(model, CONTRACT, BINDING)
    results = [stream(bound, config, tokens) for _ in range(streams)]
    for actual, addresses in results:
        assert all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))
        assert len(addresses) == 1  # from the first call on, every layer's keys and values stay put
    return bound, report


def test_a_static_cache_decoder_streams_bit_identically_and_says_why_its_graphs_are_refused():
    bound, report = run("cpu", streams=2)
    op = report.operators["decoder_step"]
    # Each stream's first call meets a cache not allocated yet (StaticCache allocates lazily): no
    # class of the catalog, so it runs the stock code; its keys, values and lengths are then
    # adopted. The steady class is refused at its first visit: the stock call checks the cache's
    # length on the host (`eq(cumulative_length, 0)`, then reads it back) where the export,
    # traced, takes another path (`arange`); not the same program. The second stream meets the
    # same class, refused already: one class, whichever tests ran in this process before (the
    # export leaves the model's settings the very objects they were, so the guards read the same
    # paths whether this export ran or a kept one was reused).
    assert [cls.name for cls in op.classes.values()] == [f"decoder_step[n={STEP},L={CAPACITY}]"]
    assert all(
        cls.refused.startswith(
            "verification: program: the exported step is not the program the stock call "
            "runs: op 1: the stock call ran aten.eq.Scalar("
        )
        for cls in op.classes.values()
    )
    assert op.counters.as_dict() == {
        "calls": 14,
        "graph_calls": 1,
        "verified": 0,
        "stock": 14,
        "adopted": 18,
        "evicted": 6,
        "stock_by_reason": {"not_in_catalog": 2, "verification": 1, "refused": 11},
    }
    assert [(s.kind, s.rewritten) for s in report.sites] == [("ring", False)] * (2 * LAYERS)
    assert report.sites[0].reason == (
        "cache.layers.0.keys: written in place by the step (index_copy_): the carry is the ring, nothing to rewrite"
    )


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_a_static_cache_decoder_refuses_its_graphs_on_cuda_as_on_the_cpu():
    _, report = run("cuda", streams=3)
    # The stock call's host check of the cache's length is not in the export (see the CPU test):
    # every class is refused at its first visit, nothing reaches the replay engine.
    op = report.operators["decoder_step"]
    assert all(cls.refused is not None for cls in op.classes.values())
    assert op.counters.graph_calls == len(op.classes)
