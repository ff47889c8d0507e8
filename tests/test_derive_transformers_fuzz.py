"""The derived contracts streamed: one `transformers` model of each cache layout `derive_transformers`
derives, transformed with no hand-written contract or binding (`transform(model, **keywords)`),
streamed beside a stock copy over the differential fuzzer's schedules (tests/fuzzkit.py): every
output, every retained tensor and every host value the cache holds bit-identical, and what the
counters say about each (which classes run their graphs, which are refused and why) exact. Mimi,
derived as two operators, is streamed through both the stock way (`encode` a frame of audio,
`decode` its codes).

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
    if case.stream == "mimi":
        return _mimi(name, case)
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


class _Codec:
    """A Mimi stream's state: its encoder's and decoder's caches, the padding cache `encode` returns
    (None before the first call: `encode` builds one) and the tokens seen (the positions passed)."""

    def __init__(self, config):
        self.encoder_cache, self.decoder_cache = DynamicCache(config=config), DynamicCache(config=config)
        self.padding_cache, self.seen = None, 0


def _codec_state(state: _Codec) -> dict:
    """What of a Mimi stream to compare: both caches and the padding cache, its paddings as ints.
    The transformed `encode` reads the paddings of the cache it is passed as ints, where `encode`
    stores each as its convolution's 0-d buffer (cadence_fx/hf_mimi.py: why): the same values, of
    another type; every tensor the cache retains is compared bit for bit."""
    padding = state.padding_cache
    if padding is not None:
        padding = {**vars(padding), "per_layer_padding": [int(p) for p in padding.per_layer_padding]}
    return dict(encoder_cache=state.encoder_cache, decoder_cache=state.decoder_cache, padding_cache=padding)


def _mimi(name: str, case) -> Subject:
    """Mimi transformed from its config alone beside a stock copy, streamed the stock way: `units`
    tokens of audio (whole frames) through `encode` with `use_streaming=True`, its codes through
    `decode`; the output is both. A `None` state is a call with no caches (nothing streamed)."""
    model, _, _ = case.build()
    config = model.config
    stock = copy.deepcopy(model)
    bound, report = transform(model, **case.derive)
    per_frame = round(config.encodec_frame_rate / config.frame_rate)  # tokens a frame of `frame_size` samples

    def call(m, state, units, generator):
        audio = torch.randn(1, 1, units // per_frame * config.frame_size, generator=generator)
        if state is None:
            codes = m.encode(audio, return_dict=True).audio_codes
            return codes, m.decode(codes, return_dict=True).audio_values
        at = dict(position_ids=torch.arange(state.seen, state.seen + units)[None])
        encoded = m.encode(
            audio,
            encoder_cache=state.encoder_cache,
            padding_cache=state.padding_cache,
            use_streaming=True,
            return_dict=True,
            **at,
        )
        state.padding_cache, state.seen = encoded.padding_cache, state.seen + units
        decoded = m.decode(encoded.audio_codes, decoder_cache=state.decoder_cache, return_dict=True, **at)
        return encoded.audio_codes, decoded.audio_values

    step = case.derive["tokens_per_call"]
    return Subject(
        name,
        stock,
        bound,
        report,
        lambda m: _Codec(config),
        call,
        _codec_state,
        units=step,
        odd=(2 * step,),  # two frames a call: outside the catalog (one a call)
        takes_none=True,
        limit=LIMIT,
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
    # two operators: a frame of audio through `encode`, its codes through `decode`. Each stream's
    # first `encode` has no padding cache yet (stock); the first `decode` is refused (traced, another
    # position path); the sliding window's `cumulative_length`, a guarded host counter, makes a
    # variant of the steady class at each value, 4 at most: the long stream's later calls run stock
    "mimi": (
        {},
        {
            "guard:decoder_cache.layers.0.cumulative_length": 5,
            "guard:encoder_cache.layers.0.cumulative_length": 5,
            "no_state_yet": 3,
            "refused": 2,
            "verification": 1,
        },
        11,
        15,
        refused(["decode[n=2,L=0]"], 8, "_to_copy.default"),
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


def test_mimi_streams_two_frames_a_call_and_no_cache_bit_identically():
    """Mimi over a schedule of every kind of step (seed 24): a stream opening with two frames a
    call (outside the catalog), a call with no caches, resets, two streams interleaved. Every
    output and retained tensor bit-identical. The opening two frames reach `decode` first: its class
    at L=0 is captured on them and refused (the extent is 4 tokens, the catalog's 2), and from then on
    a frame of codes differs from the inputs that class was captured on: `decode` runs the stock
    code (`units`). `encode`'s opening call has no padding cache yet (stock), so its classes are
    captured on one frame a call and run their graphs."""
    fuzzed = subject("mimi")
    steps = schedule(24, 12, odd=True, none=fuzzed.takes_none)
    assert {kind for kind, _ in steps} == {"odd", "call", "none", "reset"} and {int(s) for _, s in steps} == {0, 1}
    outcome = run(fuzzed, steps, 24)
    assert (outcome.wrong, outcome.first_wrong) == (0, None), outcome.as_dict()
    encode, decode = (fuzzed.report.operators[name].counters for name in ("encode", "decode"))
    assert (encode.calls, encode.graph_calls, encode.stock_by_reason) == (
        10,
        5,
        {"no_state_yet": 4, "guard:encoder_cache.layers.0.cumulative_length": 1},
    )
    assert (decode.calls, decode.graph_calls, decode.stock_by_reason) == (10, 0, {"refused": 1, "units": 8, "no_state_yet": 1})
    assert outcome.refused == {
        "decode[n=2,L=0]": "retention rewrite: decode[n=2,L=0]: decoder_cache.layers.0.keys: slice_8 has extent 4, "
        "the catalog class declares 2"
    }
