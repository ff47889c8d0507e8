"""The derived contracts streamed: one `transformers` model of each cache layout `derive_transformers`
derives, transformed with no hand-written contract or binding (`transform(model, **keywords)`),
streamed beside a stock copy over the differential fuzzer's schedules (tests/fuzzkit.py): every
output, every retained tensor and every host value the cache holds bit-identical, and what the
counters say about each (which classes run their graphs, which are refused and why) exact.

The other `transformers` models of tests/test_byom_probe.py are streamed the same way over a shorter
schedule in tests/test_derive_transformers_more.py."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from derive_kit import CASES
from fuzzkit import Positioned, Subject, run, schedule
from transformers import DynamicCache, EncoderDecoderCache, StaticCache
from transformers.modeling_outputs import BaseModelOutput

from cadence_fx import transform

LIMIT = 24  # units a fuzzed stream may reach before it starts afresh: inside every tiny config's positions
STEPS, SEED = 16, 0


def subject(name: str, **derive) -> Subject:
    """The probe's model transformed from its config alone beside a stock copy of it, streamed as
    its probe streams it (positions passed where the probe passes them)."""
    case = CASES[name]
    case = dataclasses.replace(case, derive={**case.derive, **derive})
    model, _, _ = case.build()
    config = model.config
    stock = copy.deepcopy(model)
    bound, report = transform(model, **case.derive)
    step = case.derive["tokens_per_call"]

    def ids(units: int, generator: torch.Generator) -> torch.Tensor:
        return torch.randint(0, case.vocab, (1, units, *case.codebooks), generator=generator)

    if case.stream == "encoder_decoder":
        frames = case.derive.get("encoder_frames", getattr(config, "max_source_positions", None))
        encoded = BaseModelOutput(
            last_hidden_state=torch.randn(
                1, frames, config.d_model, generator=torch.Generator(device=torch.get_default_device()).manual_seed(2)
            )
        )

        def new_cache():
            return EncoderDecoderCache(DynamicCache(config=config), DynamicCache(config=config))
    elif case.stream == "static":

        def new_cache():
            return StaticCache(config=config, max_cache_len=case.derive["max_tokens"])
    else:

        def new_cache():
            return DynamicCache(config=config)

    def call(m, state, units, generator):
        at = 0 if state is None else state.seen
        positions = torch.arange(at, at + units)
        keywords = {case.positions: positions[None]} if case.positions else {}
        if case.stream == "static":
            keywords["cache_position"] = positions
        if case.stream == "encoder_decoder":
            keywords["encoder_outputs"] = encoded
        inputs = "decoder_input_ids" if case.stream == "encoder_decoder" else "input_ids"
        out = m(**{inputs: ids(units, generator)}, cache=None if state is None else state.cache, use_cache=True, **keywords)
        if state is not None:
            state.seen += units
        return out.logits

    return Subject(
        name,
        stock,
        bound,
        report,
        lambda m: Positioned(new_cache()),
        call,
        lambda s: s.cache,
        units=step,
        odd=(3, 1) if step == 2 else (2,),
        takes_none=case.stream != "static",
        limit=case.derive["max_tokens"] if case.stream == "static" else LIMIT,
    )


PROGRAM = "verification: program: the exported step is not the program the stock call runs: "


def ran(op: int, aten: str) -> str:
    """A refusal's start: the first op where the stock call's program and the exported step's differ."""
    return f"{PROGRAM}op {op}: the stock call ran aten.{aten}("


def refused(names: list[str], op: int, aten: str) -> dict[str, str]:
    return dict.fromkeys(names, ran(op, aten))


FIRST = "decoder_step[n=2,L=0]"
GUARD = "guard:cache.layers.0.cumulative_length"
# What the counters say, the schedule's 15 calls bit-identical in every case: (derive keywords beyond
# the probe's, stock calls by reason, classes, graph calls (a refused class's verified visit ran its
# graph beside the stock call too), refused classes -> the start of why).
# Every first call (nothing cached) is refused: traced, transformers takes another position or
# mask path; every later stream's first call meets that class refused. The full-attention streams
# are bounded at 4 tokens here (`max_tokens=4`): a stream past them runs the stock code (`not_in_catalog`).
EXPECTED = {
    # the README's example, positions left to the cache: the steady class at each cumulative_length
    "mistral": ({}, {GUARD: 5, "refused": 2, "verification": 1}, 6, 8, refused([FIRST], 3, "_to_copy.default")),
    "qwen3": (
        dict(max_tokens=4),
        {"not_in_catalog": 8, "refused": 2, "verification": 1},
        3,
        5,
        refused([FIRST], 1, "_to_copy.default"),
    ),
    "gemma3": (
        dict(max_tokens=4),
        {"not_in_catalog": 8, "refused": 2, "verification": 1},
        3,
        5,
        refused([FIRST], 2, "_to_copy.default"),
    ),
    # the mixture of experts: aten._grouped_mm in the stock call, transformers' fallback traced
    "deepseek_v3": (
        dict(max_tokens=4),
        {"not_in_catalog": 8, "refused": 4, "verification": 3},
        3,
        3,
        refused([FIRST], 1, "_to_copy.default")
        | refused(["decoder_step[n=2,L=2]", "decoder_step[n=2,L=4]"], 164, "_grouped_mm.default"),
    ),
    "whisper": (
        dict(max_tokens=4),
        {"not_in_catalog": 8, "refused": 2, "verification": 1},
        3,
        5,
        refused([FIRST], 3, "native_layer_norm.default"),
    ),
    # each stream's first call allocates the states (no class): stock; then one class, on its graph
    "mamba": ({}, {"not_in_catalog": 3}, 1, 12, {}),
    "jamba": (
        dict(max_tokens=4),
        {"not_in_catalog": 8, "refused": 2, "verification": 1},
        3,
        5,
        refused([FIRST], 3, "pow.Tensor_Scalar"),
    ),
    # the stock call reads the length back on the host (aten.eq, then item); the export does not
    "llama_static": (
        {},
        {"not_in_catalog": 4, "refused": 10, "verification": 1},
        1,
        1,
        refused(["decoder_step[n=2,L=16]"], 1, "eq.Scalar"),
    ),
    # frames of codes: every class refused (traced, the model takes another code path)
    "kyutai_stt": (
        {},
        {GUARD: 2, "refused": 4, "verification": 9},
        9,
        9,
        refused(
            [f"decoder_step[n=1,L={e}]" for e in range(6)] + [f"decoder_step[n=1,L=5]#{v}" for v in (2, 3, 4)],
            5,
            "pow.Tensor_Scalar",
        ),
    ),
    "csm": (
        dict(max_tokens=4),
        {"not_in_catalog": 6, "refused": 4, "verification": 5},
        5,
        5,
        refused([f"decoder_step[n=1,L={e}]" for e in range(5)], 3, "_to_copy.default"),
    ),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_model_transformed_from_its_config_alone_streams_bit_identically(name):
    keywords, stock_by_reason, classes, graph_calls, why = EXPECTED[name]
    fuzzed = subject(name, **keywords)
    steps = schedule(SEED, STEPS, odd=True, none=fuzzed.takes_none)
    outcome = run(fuzzed, steps, SEED)
    assert (outcome.wrong, outcome.first_wrong) == (0, None), outcome.as_dict()
    calls = sum(kind != "reset" for kind, _ in steps)
    assert (outcome.calls, outcome.stock_by_reason, outcome.classes) == (calls, stock_by_reason, classes)
    assert {cls: reason[: len(why.get(cls, ""))] for cls, reason in outcome.refused.items()} == why
    assert sum(op.counters.graph_calls for op in fuzzed.report.operators.values()) == graph_calls
