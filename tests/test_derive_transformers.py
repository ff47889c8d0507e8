"""`derive_transformers` (cadence_fx/hf.py): a `transformers` model's contract and binding derived
from its config and the cache it builds, checked against the ones a person wrote by hand for the
same model (tests/test_byom_probe.py, tests/test_binding_static_cache.py, the README's example),
and its refusals, each by name. The streams of the derived models are fuzzed in
tests/test_derive_transformers_fuzz.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import test_byom_probe as probe
import torch
from derive_kit import CASES, _expand, comparable, differences
from torch import nn

from cadence_fx import DeriveError, derive, derive_transformers, transform
from cadence_fx.guards import ModuleSettings

VERIFY = "verify: 1 -> 2"  # the probes verify each class once; the derived binding keeps the default, two visits
MAMBA_FLAGS = ("conv_kernel_size", "has_previous_state", "is_conv_states_initialized", "is_recurrent_states_initialized")
SCAN = "cache.layers.0.recurrent_states.0"
# Where a derived pair differs from the hand-written one. Only declaring more is allowed: verifying
# more visits, binding more counters. One case is listed apart: Jamba's scan state, hand-written
# before `InPlace` existed, is a RingCache along a clock made up for it (stride 1); derived, it is
# an `InPlace` region, as Mamba's hand-written scan state already is. Its shape and bound are the same.
ALLOWED = {
    "mistral": [],  # the README's binding keeps the default verification
    "llama_static": [],
    "mamba": [f"counter only derived: cache.layers.{i}.{flag}" for i in (0, 1) for flag in MAMBA_FLAGS] + [VERIFY],
    "jamba": [
        f"{SCAN}.retention: RingCache(capacity=4) -> InPlace()",
        f"{SCAN}.stride: 1 -> 0",
        f"{SCAN}.axis: 3 -> None",
        f"{SCAN}.clock_kind: <ClockKind.TOKENS: 'tokens'> -> None",
        VERIFY,
    ],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_derived_contract_and_binding_equal_the_hand_written_ones(name):
    case = CASES[name]
    model, contract, binding = case.build()
    derived = derive_transformers(model, **case.derive)
    assert differences(comparable(model, contract, binding), comparable(model, *derived)) == ALLOWED.get(name, [VERIFY])


def test_the_derivation_leaves_the_model_as_it_was():
    """The shapes come from one call of a twin on the meta device: the model's settings (a table
    transformers sets at the first call, `_pp_plan`) and weights are untouched."""
    model, _, _ = CASES["qwen3"].build()
    settings = ModuleSettings(model)
    before, weights = settings.read(), {k: v.clone() for k, v in model.state_dict().items()}
    paths = settings.paths
    derive_transformers(model, tokens_per_call=2, max_tokens=12)
    assert settings.read() == before and settings.paths == paths
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def test_a_full_attention_layer_without_the_longest_stream_is_refused_by_name():
    model, _, _ = CASES["qwen3"].build()
    with pytest.raises(DeriveError) as error:
        derive_transformers(model, tokens_per_call=2)
    assert str(error.value) == (
        "Qwen3ForCausalLM: cache.layers.0 is a full-attention layer (DynamicLayer): its cache "
        "grows with the stream and no config field bounds it; pass max_tokens, the longest stream"
    )


def test_a_sliding_window_static_cache_is_refused_by_name():
    """transformers' StaticSlidingWindowLayer branches on a host length of its own: not derived."""
    model, _, _ = CASES["mistral"].build()
    with pytest.raises(DeriveError) as error:
        derive_transformers(model, tokens_per_call=2, max_tokens=16, cache="static")
    assert str(error.value) == (
        "MistralForCausalLM: cache.layers.0 is a transformers.cache_utils.StaticSlidingWindowLayer; "
        "derived are DynamicLayer, DynamicSlidingWindowLayer, StaticLayer, LinearAttentionLayer "
        "from transformers.cache_utils; bind it by hand"
    )


def test_a_model_whose_forward_takes_no_cache_is_refused_by_name():
    """transformers' RWKV keeps a `state` list: no cache transformers builds for the config."""
    from transformers import RwkvConfig, RwkvForCausalLM

    model = RwkvForCausalLM(
        RwkvConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64, context_length=64
        )
    )
    with pytest.raises(DeriveError) as error:
        transform(model, tokens_per_call=2)
    assert str(error.value) == (
        "RwkvForCausalLM.forward takes no cache argument (cache or past_key_values): its state is "
        "no cache transformers builds; bind it by hand (README: Bring your own model)"
    )


def _declared(contract, binding) -> dict:
    """What a contract and binding of several operators declare, names left out (labels a person
    picks): each region by its concrete paths, with its derived shape, bound, retention, stride,
    axis, dtype and clock kind; each operator's method, units, counters and catalog classes; the
    rates by value (their clocks' kinds)."""
    catalog = derive(contract)
    counts = {"encoder_cache.layers": 2, "decoder_cache.layers": 2, "padding_cache.padding_cache": 9}
    kinds = {c.name: c.kind for c in contract.clocks}
    regions = {}
    for rb in binding.regions:
        region, derived = contract.region(rb.region), catalog.region(rb.region)
        paths = frozenset().union(*(_expand(p, counts) for p in rb.at))
        regions[paths] = (
            derived.shape,
            derived.bound,
            region.retention,
            region.stride,
            region.axis,
            region.dtype,
            region.holds_call,
            kinds.get(region.clock),
        )
    operators = {
        ob.operator: (
            ob.method,
            ob.units,
            ob.counters,
            frozenset().union(*(_expand(p, counts) for p in binding.region(op.region).at)),
            tuple((c.call, c.extent) for c in catalog.operator(op.name).classes),
        )
        for ob, op in zip(binding.operators, contract.operators, strict=True)
    }
    rates = sorted(((kinds[r.clock], kinds[r.per], r.value) for r in contract.rates), key=repr)
    return dict(regions=regions, operators=operators, rates=rates, admission=contract.admission.max_per_call)


def test_mimi_derives_the_hand_written_contract_and_binding_of_its_two_operators():
    """transformers' Mimi, derived (cadence_fx/hf_mimi.py): `encode` and `decode`, the two sliding
    windows of its transformers and each convolution's left context (its `padding_total`, at the
    rate the convolution runs at), equal to the pair written by hand in tests/test_byom_probe.py
    but in the names (regions', clocks') and the verification depth (the default two visits)."""
    model, config = probe.mimi()
    hand = (probe.mimi_contract(config), probe.mimi_binding(verify=2))
    contract, binding = derive_transformers(model, tokens_per_call=2)
    assert binding.verify == 2 and _declared(*hand) == _declared(contract, binding)
    assert [r.name for r in contract.regions] == [
        "encoder_kv",
        "decoder_kv",
        "conv_1_sample",
        "conv_4_sample",
        "conv_8_sample_2",
        "conv_16_token",
    ]


@pytest.mark.parametrize(
    "keywords, message",
    [
        (dict(tokens_per_call=3), "MimiModel: a call brings whole frames of 2 tokens; tokens_per_call is 3"),
        (
            dict(tokens_per_call=2, max_tokens=8),
            "MimiModel: Mimi's bounds are its config's; pass tokens_per_call (and verify) only",
        ),
    ],
)
def test_mimi_refuses_what_it_cannot_take_by_name(keywords, message):
    model, _ = probe.mimi()
    with pytest.raises(DeriveError) as error:
        derive_transformers(model, **keywords)
    assert str(error.value) == message


def test_an_encoder_decoder_model_without_its_encoder_length_is_refused_by_name():
    model, _, _ = CASES["t5"].build()
    with pytest.raises(DeriveError) as error:
        derive_transformers(model, tokens_per_call=2, max_tokens=8)
    assert str(error.value) == (
        "T5ForConditionalGeneration is an encoder-decoder model whose config gives no encoder length "
        "(max_source_positions): pass encoder_frames, the frames of the encoder output it decodes "
        "against"
    )


@pytest.mark.parametrize(
    "keywords, message",
    [
        (dict(tokens_per_call=0), "tokens_per_call must be an int >= 1, got 0"),
        (dict(tokens_per_call=2, max_tokens=1), "max_tokens must be an int >= tokens_per_call (2), got 1"),
        (dict(tokens_per_call=2, cache="paged"), "cache must be 'dynamic' or 'static', got 'paged'"),
        (
            dict(tokens_per_call=2, cache="static"),
            "MistralForCausalLM: a static cache holds max_cache_len tokens; pass max_tokens, its capacity",
        ),
    ],
)
def test_bad_arguments_are_refused_saying_what_was_expected(keywords, message):
    model, _, _ = CASES["mistral"].build()
    with pytest.raises(DeriveError) as error:
        derive_transformers(model, **keywords)
    assert str(error.value) == message


def test_transform_without_a_contract_needs_a_transformers_model_and_takes_keywords_only_without_one():
    with pytest.raises(TypeError) as error:
        transform(nn.Linear(2, 2))
    assert str(error.value) == (
        "no contract given, and Linear is no transformers model whose contract cadence-fx derives: "
        "pass transform(model, contract, binding) (README: Bring your own model)"
    )
    with pytest.raises(DeriveError) as error:
        derive_transformers(nn.Linear(2, 2))
    assert str(error.value) == "derive_transformers needs a transformers.PreTrainedModel, got Linear"
    model, contract, binding = CASES["mistral"].build()
    with pytest.raises(TypeError) as error:
        transform(model, contract, binding, tokens_per_call=2)
    assert str(error.value) == ("transform() got ['tokens_per_call']: keywords of a derived contract, but a contract was given")
    with pytest.raises(TypeError) as error:
        transform(model, None, binding)
    assert str(error.value) == "a binding was given without its contract: pass transform(model, contract, binding)"


def test_the_core_imports_transformers_only_when_a_model_is_derived():
    code = "import sys, cadence_fx; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_layers_of_one_kind_no_slice_selects_are_refused_by_name():
    """Gemma3 with sliding layers 0, 1 and 3 around a full layer: one region would need a path
    no slice spells (`[0:2]` and `3`); bound by hand, they are two regions."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        num_hidden_layers=4,
        sliding_window=5,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    )
    with pytest.raises(DeriveError) as error:
        derive_transformers(Gemma3ForCausalLM(config), tokens_per_call=2, max_tokens=12)
    assert str(error.value) == (
        "Gemma3ForCausalLM: cache.layers: layers [0, 1, 3] are of one kind but no slice selects them; bind them by hand"
    )
