"""The derived contracts streamed, continued: every other `transformers` model of
tests/test_byom_probe.py (the decoders that share Qwen3's layout, GPT-2, BART, T5, Moshi's temporal
transformer) transformed with no contract, streamed beside a stock copy over a short schedule of
the fuzzer (8 steps; the full-attention streams bounded at 2 tokens, so a stream past them runs
the stock code): every output and every retained tensor and host value bit-identical, and the
counters exact. The layouts are fuzzed longer in tests/test_derive_transformers_fuzz.py."""

from __future__ import annotations

import pytest
from fuzzkit import run, schedule
from test_derive_transformers_fuzz import SEED, ran, subject

STEPS = 8
FIRST = "decoder_step[n=2,L=0]"
MOVED = (
    "verification: the stock call moved host values the binding does not declare: "
    "cache.layers.0.device (None -> device(type='cpu'))"
)
TO_COPY = {FIRST: ran(1, "_to_copy.default")}
ONCE = {"not_in_catalog": 6, "verification": 1}  # the first call refused, the 6 calls past 2 tokens stock
TWICE = {"not_in_catalog": 6, "verification": 2}
# name -> (stock calls by reason, refused classes -> the start of why); every one of them has 2
# classes and ran 2 graph calls, but Moshi (a sliding window, no bound passed): 6 classes, 6 graph calls
EXPECTED = {
    **dict.fromkeys(["cohere", "gpt_neox", "llama", "olmo2", "phi3", "stablelm", "starcoder2"], (ONCE, TO_COPY)),
    "granite": (ONCE, {FIRST: ran(2, "_to_copy.default")}),
    "codegen": (ONCE, {FIRST: ran(1, "index.Tensor")}),
    "gptj": (ONCE, {FIRST: ran(1, "index.Tensor")}),
    "gpt_bigcode": (ONCE, {FIRST: ran(1, "embedding.default")}),
    "opt": (ONCE, {FIRST: ran(2, "add.Tensor")}),
    "gpt2": (ONCE, {FIRST: ran(3, "native_layer_norm.default")}),
    # the stock call's first call sets each layer's `device`, a host value the layout does not bind
    "bloom": (ONCE, {FIRST: MOVED}),
    "falcon": (ONCE, {FIRST: MOVED}),
    # mixtures of experts: aten._grouped_mm in the stock call, transformers' fallback traced
    "mixtral": (TWICE, {FIRST: ran(1, "_to_copy.default"), "decoder_step[n=2,L=2]": ran(66, "_grouped_mm.default")}),
    "qwen2_moe": (TWICE, {FIRST: ran(7, "new_ones.default"), "decoder_step[n=2,L=2]": ran(78, "_grouped_mm.default")}),
    # positions left to the model, as the probes stream these
    "bart": (TWICE, {FIRST: ran(4, "ones.default"), "decoder_step[n=2,L=2]": ran(4, "ones.default")}),
    "t5": (TWICE, {FIRST: ran(1, "pow.Tensor_Scalar"), "decoder_step[n=2,L=2]": ran(8, "pow.Tensor_Scalar")}),
    "moshi": ({"guard:cache.layers.0.cumulative_length": 2, "verification": 1}, {FIRST: ran(1, "pow.Tensor_Scalar")}),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_other_probe_transformed_from_its_config_alone_streams_bit_identically(name):
    stock_by_reason, why = EXPECTED[name]
    fuzzed = subject(name, **({} if name == "moshi" else dict(max_tokens=2)))
    steps = schedule(SEED, STEPS, odd=True, none=fuzzed.takes_none)
    outcome = run(fuzzed, steps, SEED)
    assert (outcome.wrong, outcome.first_wrong) == (0, None), outcome.as_dict()
    graphs = 6 if name == "moshi" else 2
    assert (outcome.calls, outcome.stock_by_reason, outcome.classes) == (
        sum(k != "reset" for k, _ in steps),
        stock_by_reason,
        graphs,
    )
    assert sum(op.counters.graph_calls for op in fuzzed.report.operators.values()) == graphs
    assert {cls: reason[: len(why.get(cls, ""))] for cls, reason in outcome.refused.items()} == why
