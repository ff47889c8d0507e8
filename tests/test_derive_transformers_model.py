"""The transformed model of a `transformers` model (cadence_fx/hf_model.py): a shallow copy of the
input model whose bound methods are its operators, so `generate()` (which calls `self(...)`), a
model of several operators (Mimi's `encode` and `decode`) and an operator on a nested module, each
called the stock way, go through the pipeline, and the input model stays as it was.

What each layout's `generate()` does, counted exactly: Mamba's decoding steps run their graphs;
an attention model's decoding steps reach the operator and are refused at verification
(transformers derives the positions from the cache another way when exported; the stock result is
kept); a cache of another class than the derived one runs the stock code, counted as `cache_class`."""

from __future__ import annotations

import copy
import dataclasses

import byom_example
import test_byom_probe as probe
import torch
from derive_kit import CASES
from test_derive_transformers_fuzz import ran
from transformers import DynamicCache

from cadence_fx import transform
from cadence_fx.hf_model import CACHE_CLASS, transformed_model

NEW = 8  # new tokens a generate() call makes: its prefill, then NEW - 1 decoding steps of one token
PROMPT = 5


def generated(model, seed: int):
    """Greedy decoding of NEW tokens after a random prompt: the tokens and every step's logits."""
    prompt = torch.randint(0, 64, (1, PROMPT), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences, out.logits


def same(a, b) -> bool:
    (tokens_a, logits_a), (tokens_b, logits_b) = a, b
    return torch.equal(tokens_a, tokens_b) and len(logits_a) == len(logits_b) == NEW and all(map(torch.equal, logits_a, logits_b))


def transformed(name: str, **keywords):
    """(input model, a stock copy of it, the transformed model, its report, the input model's modules)."""
    model, _, _ = CASES[name].build()
    stock = copy.deepcopy(model)
    modules = list(model.modules())
    fast, report = transform(model, **keywords)
    return model, stock, fast, report, modules


def assert_untouched(model, stock, fast, modules, seed: int) -> None:
    """The input model's methods are its class's, its modules the very objects they were; the
    transformed model shares its weights and submodules but not its attributes; a stock run of the
    input model gives the stock copy's bits, and reaches no operator."""
    assert "forward" not in vars(model) and model.forward.__func__ is type(model).forward
    assert list(model.modules()) == modules and all(a is b for a, b in zip(model.modules(), modules))
    assert type(fast).__name__ == f"Transformed{type(model).__name__}" and type(fast).__mro__[1] is type(model)
    assert all(a is b for a, b in zip(fast.parameters(), model.parameters(), strict=True))
    assert [m for _, m in fast.named_children()] == [m for _, m in model.named_children()]
    fast.added_here = 1
    fast.lm_head = torch.nn.Identity()
    assert not hasattr(model, "added_here") and isinstance(model.lm_head, torch.nn.Linear)
    calls = {name: op.counters.calls for name, op in fast.operators.items()}
    assert same(generated(model, seed), generated(stock, seed))
    assert {name: op.counters.calls for name, op in fast.operators.items()} == calls


def test_generate_on_a_transformed_mamba_runs_its_decoding_steps_on_the_graphs():
    """The prompt (5 tokens, no class of one token a call) runs the stock code; each of the 7
    decoding steps is the one class n=1 at the convolution's window: captured at the first,
    verified at the first two, then replayed. Tokens and logits bit-identical to stock."""
    model, stock, fast, report, modules = transformed("mamba", tokens_per_call=1)
    assert same(generated(fast, 3), generated(stock, 3))
    assert report.operators["decoder_step"].counters.as_dict() == {
        "calls": NEW,
        "graph_calls": NEW - 1,
        "verified": 2,
        "stock": 1,
        "adopted": 4,  # the prompt's states (2 layers x conv and scan), taken into the carries
        "stock_by_reason": {"not_in_catalog": 1},
    }
    assert fast.calls == {"decoder_step[n=1,L=4]": NEW - 1}
    assert_untouched(model, stock, fast, modules, 3)


def test_generate_on_a_transformed_attention_model_reaches_the_operator_and_keeps_the_stock_result():
    """Qwen3, full attention, `max_tokens` covering the prompt and the new tokens: generate() passes
    no positions, so the model derives them from the cache, and exported it takes another path
    (arange where the stock call converts its positions): each decoding step is a class of its own
    extent, refused at its verification (the graph ran beside the stock call, whose result is kept)."""
    model, stock, fast, report, modules = transformed("qwen3", tokens_per_call=1, max_tokens=PROMPT + NEW)
    assert same(generated(fast, 3), generated(stock, 3))
    op = report.operators["decoder_step"]
    assert op.counters.as_dict() == {
        "calls": NEW,
        "graph_calls": NEW - 1,
        "verified": 0,
        "stock": NEW,
        "adopted": 32,  # 4 sites (2 layers x keys, values) taken into the carries at each of 8 calls
        "stock_by_reason": {"not_in_catalog": 1, "verification": NEW - 1},
    }
    why = ran(1, "_to_copy.default")
    assert {cls.name: cls.refused[: len(why)] for cls in op.classes.values()} == {
        f"decoder_step[n=1,L={extent}]": why for extent in range(PROMPT, PROMPT + NEW - 1)
    }
    assert_untouched(model, stock, fast, modules, 3)


def test_a_cache_of_another_class_than_the_derived_one_runs_the_stock_code_counted():
    """Derived for a StaticCache, called by generate() with the DynamicCache it builds: every call
    runs the stock code, counted as `cache_class`, said once in the report."""
    model, stock, fast, report, modules = transformed("llama_static", tokens_per_call=1, max_tokens=PROMPT + NEW, cache="static")
    assert same(generated(fast, 3), generated(stock, 3))
    assert report.operators["decoder_step"].counters.as_dict() == {
        "calls": NEW,
        "graph_calls": 0,
        "verified": 0,
        "stock": NEW,
        "adopted": 0,
        "stock_by_reason": {CACHE_CLASS: NEW},
    }
    assert [s for s in report.stamps if CACHE_CLASS in s] == [
        "decoder_step: runs the stock code (cache_class): its cache is a DynamicCache, its contract derived for a StaticCache"
    ]
    assert_untouched(model, stock, fast, modules, 3)


def test_a_model_of_two_operators_runs_both_when_called_the_stock_way():
    """transformers' Mimi bound by hand as two operators, `encode` and `decode` (its contract and
    binding from tests/test_byom_probe.py), made a transformed model: its `encode` and `decode` are
    the operators, so the stock stream (encode a frame, decode its codes) runs both through the
    pipeline with no glue, bit-identical to the stock model; so does its `forward`, which calls
    both (it passes no padding cache: `encode` has no state to bind, and runs the stock code)."""
    model, config = probe.mimi()
    stream = probe.mimi_stream(config, probe.mimi_audio(config), lambda: probe.mimi_padding_cache(model), positions=True)
    expected, _ = stream(model)
    bound, report = transform(model, probe.mimi_contract(config), probe.mimi_binding(verify=1))
    fast = transformed_model(model, bound)
    actual, _ = stream(fast)
    assert probe.exact(actual, expected)
    assert type(fast).__name__ == "TransformedMimiModel" and not {"encode", "decode"} & set(vars(model))
    steady = {"calls": 6, "graph_calls": 6, "verified": 5, "stock": 1}  # the first call refused at verification
    assert report.operators["encode"].counters.as_dict() == {**steady, "adopted": 11, "stock_by_reason": {"verification": 1}}
    assert report.operators["decode"].counters.as_dict() == {**steady, "adopted": 4, "stock_by_reason": {"verification": 1}}
    _forward_equal(fast, model, config)
    assert report.operators["encode"].counters.stock_by_reason == {"verification": 1, "no_state_yet": 6}
    assert report.operators["decode"].counters.stock_by_reason == {"verification": 1, "units": 6}


def test_mimi_transformed_from_its_config_alone_streams_both_operators_the_stock_way():
    """Mimi with no contract (cadence_fx/hf_mimi.py): two operators, `encode` and `decode`, on the
    transformed model's own methods. Streamed the stock way, two streams of 6 frames: `encode`
    with `use_streaming=True` and no padding cache at its first call (it builds one, whose paddings
    are 0-d tensors: read as ints by the transformed `encode`), its codes through `decode`.
    Codes, audio and every retained tensor bit-identical to the stock model; the sites at one
    address from each stream's second call on. Each stream's first `encode` runs the stock code (no
    padding cache yet); the first `decode` is refused at verification (its export takes another
    position path); every other class runs its graph, verified at its two visits (one a stream);
    the steady class is a variant at each `cumulative_length` (L=4, #2 to #4)."""
    model, config = probe.mimi()
    stream = probe.mimi_stream(config, probe.mimi_audio(config), lambda: None, positions=True)
    expected, _ = stream(model)
    fast, report = transform(model, tokens_per_call=2)
    assert type(fast).__name__ == "TransformedMimiModel" and not {"encode", "decode"} & set(vars(model))
    for _ in range(2):
        actual, addresses = stream(fast)
        assert probe.exact(actual, expected)
        assert addresses[1:] == [{path: carry.address for path, carry in fast.carries.items()}] * (probe.MIMI_CALLS - 1)
    assert report.operators["encode"].counters.as_dict() == {
        "calls": 12,
        "graph_calls": 10,
        "verified": 10,
        "stock": 2,
        "adopted": 22,  # each stream's first (stock) call's 11 sites: 4 keys and values, 7 left contexts
        "stock_by_reason": {"no_state_yet": 2},
    }
    assert report.operators["decode"].counters.as_dict() == {
        "calls": 12,
        "graph_calls": 11,
        "verified": 10,
        "stock": 2,
        "adopted": 8,
        "evicted": 4,
        "stock_by_reason": {"verification": 1, "refused": 1},
    }
    steady = [f"[n=2,L=4]{variant}" for variant in ("", "#2", "#3", "#4")]
    assert fast.calls == {
        **{f"encode{c}": 2 for c in ["[n=2,L=2]", *steady]},
        "decode[n=2,L=0]": 1,
        **{f"decode{c}": 2 for c in ["[n=2,L=2]", *steady]},
    }
    why = ran(8, "_to_copy.default")
    assert {c.name: c.refused[: len(why)] for op in report.operators.values() for c in op.classes.values() if c.refused} == {
        "decode[n=2,L=0]": why
    }
    # its forward calls both operators; it passes no padding cache, so `encode` has no state to bind
    _forward_equal(fast, model, config)
    assert report.operators["encode"].counters.stock_by_reason == {"no_state_yet": 8}
    assert report.operators["decode"].counters.stock_by_reason == {"verification": 1, "refused": 1, "units": 6}


def test_an_operator_bound_on_a_nested_module_runs_when_the_model_is_called_the_stock_way():
    """The README's Mistral bound at its inner `model.forward` (the decoder without its head): the
    transformed model's `model` is a shallow copy of the input's whose `forward` is the operator,
    so calling the transformed model the stock way (its own `forward`, then its head) reaches it.
    The input model's inner module is untouched; the head and the weights are shared."""
    model, config = byom_example.build_model()
    stock = copy.deepcopy(model)
    binding = byom_example.binding()
    binding = dataclasses.replace(binding, operators=(dataclasses.replace(binding.operators[0], method="model.forward"),))
    bound, report = transform(model, byom_example.contract(), binding)
    fast = transformed_model(model, bound)
    assert fast.model is not model.model and "forward" in vars(fast.model) and "forward" not in vars(model.model)
    assert fast.lm_head is model.lm_head and all(a is b for a, b in zip(fast.parameters(), model.parameters(), strict=True))
    tokens = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    ours, theirs = DynamicCache(config=config), DynamicCache(config=config)
    with torch.no_grad():
        for t in range(0, 12, 2):
            chunk = tokens[:, t : t + 2]
            assert torch.equal(
                fast(input_ids=chunk, cache=ours, use_cache=True).logits,
                stock(input_ids=chunk, cache=theirs, use_cache=True).logits,
            )
    assert report.operators[binding.operators[0].operator].counters.as_dict() == {
        "calls": 6,
        "graph_calls": 6,
        "verified": 5,
        "stock": 1,
        "adopted": 4,
        "stock_by_reason": {"verification": 1},  # the first call, refused at verification
    }


def _forward_equal(fast, model, config) -> None:
    """Mimi's stock call (`forward`: both operators), frame by frame with its caches, on the transformed
    model and the stock one: equal codes and audio at every frame."""
    audio = probe.mimi_audio(config)
    caches = [(DynamicCache(config=config), DynamicCache(config=config)) for _ in range(2)]
    with torch.no_grad():
        for i in range(probe.MIMI_CALLS):
            frame = audio[..., i * config.frame_size : (i + 1) * config.frame_size]
            ours, theirs = (m(frame, encoder_cache=e, decoder_cache=d) for m, (e, d) in zip((fast, model), caches))
            assert torch.equal(ours.audio_codes, theirs.audio_codes) and torch.equal(ours.audio_values, theirs.audio_values)
