"""Bring your own model, probed as a new user: models cadence-fx has no code for, each transformed
from a contract and a binding written only against the public API (README "Bring your own model",
docs/contract.md), streamed beside the stock model and compared bit for bit.

Full attention has no retention that bounds it, and C2 asks for one: a stream that grows to N
tokens and stops is declared `SlidingWindow(window=N)`. The stock cache never trims, so every
call up to N is a class of the catalog and runs the exported step; a call past N is none and runs
the stock code.

Every test uses `Binding(verify=1)`: the first stream verifies each class, the second runs the
rewritten graphs only (on CPU, eager), so a host value the graphs would not move shows there."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import (DynamicCache, EncoderDecoderCache, Gemma3ForCausalLM, Gemma3TextConfig, GPT2Config,
                          GPT2LMHeadModel, Qwen3Config, Qwen3ForCausalLM, WhisperConfig, WhisperForConditionalGeneration)
from transformers.modeling_outputs import BaseModelOutput

from cadence_fx import (Admission, Binding, BindingError, Clock, ClockKind, Contract, Interactivity, Lifetime, Operator,
                        OperatorBinding, Rate, Region, RegionBinding, RingCache, SlidingWindow, transform)

STEP = 2  # tokens (or frames) a call
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, max_position_embeddings=128, attn_implementation="sdpa")
KV_DIMS = ("layers", 2, 1, "kv_heads", "token", "head_dim")  # [layer, keys|values] x one layer's cache


def kv_contract(family: str, layers: int, kv_heads: int, tokens: int) -> Contract:
    """A decoder whose cache grows by STEP tokens a call, for a stream of at most `tokens` tokens."""
    return Contract(
        family=family,
        clocks=(Clock("token", ClockKind.TOKENS), Clock("call", ClockKind.CALLS)),
        rates=(Rate("token", "call", STEP, name="tokens_per_call"),),
        quantities={"layers": layers, "kv_heads": kv_heads, "head_dim": 8},
        regions=(Region("kv", dims=KV_DIMS, axis=4, clock="token", stride=STEP, dtype="float32",
                        lifetime=Lifetime.PER_STREAM, retention=SlidingWindow(window=tokens)),),
        operators=(Operator("decoder_step", "kv", steady=STEP),),
        admission=Admission("token", max_per_call=STEP),
        interactivity=Interactivity(stages=("decoder",)),
    )


# A full-attention `DynamicLayer` has no `cumulative_length` (only a sliding one has): its one host
# value is the flag its first call sets.
DYNAMIC_CACHE = Binding(
    regions=(RegionBinding("kv", at=("cache.layers.*.keys", "cache.layers.*.values")),),
    operators=(OperatorBinding("decoder_step", units=("input_ids", 1), counters=("cache.layers.*.is_initialized",)),),
    verify=1,
)


def stream_dynamic(model, config, tokens: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """The stock way to stream: calls of `sizes` tokens into one DynamicCache, positions given."""
    cache, logits, t = DynamicCache(config=config), [], 0
    with torch.no_grad():
        for n in sizes:
            out = model(input_ids=tokens[:, t:t + n], position_ids=torch.arange(t, t + n)[None], cache=cache, use_cache=True)
            logits.append(out.logits)
            t += n
    return logits


def exact(actual: list, expected: list) -> bool:
    return all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))


def qwen3() -> tuple[Qwen3ForCausalLM, Qwen3Config]:
    torch.manual_seed(0)
    config = Qwen3Config(num_hidden_layers=2, **TINY)
    return Qwen3ForCausalLM(config).eval(), config


def gpt2() -> tuple[GPT2LMHeadModel, GPT2Config]:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2,
                        attn_implementation="sdpa")
    return GPT2LMHeadModel(config).eval(), config


def random_tokens(n: int) -> torch.Tensor:
    return torch.randint(0, 64, (1, n), generator=torch.Generator().manual_seed(1))


def test_qwen3_full_attention_streams_to_its_bound_on_the_exported_steps():
    model, config = qwen3()
    tokens, sizes = random_tokens(12), [STEP] * 6
    expected = stream_dynamic(model, config, tokens, sizes)
    bound, report = transform(model, kv_contract("qwen3_full", 2, 2, tokens=12), DYNAMIC_CACHE)
    assert exact(stream_dynamic(bound, config, tokens, sizes), expected)
    assert exact(stream_dynamic(bound, config, tokens, sizes), expected)
    op = report.operators["decoder_step"]
    assert [cls.name for cls in op.classes.values()] == [f"decoder_step[n=2,L={e}]" for e in (0, 2, 4, 6, 8, 10)]
    assert op.counters.as_dict() == {"calls": 12, "graph_calls": 12, "verified": 6, "stock": 0, "adopted": 0,
                                     "stock_by_reason": {}}


def test_gpt2_streams_bit_identically_through_the_same_cache_binding():
    model, config = gpt2()
    tokens, sizes = random_tokens(8), [STEP] * 4
    expected = stream_dynamic(model, config, tokens, sizes)
    bound, report = transform(model, kv_contract("gpt2", 2, 4, tokens=8), DYNAMIC_CACHE)
    assert exact(stream_dynamic(bound, config, tokens, sizes), expected)
    assert exact(stream_dynamic(bound, config, tokens, sizes), expected)
    assert report.operators["decoder_step"].counters.as_dict() == {
        "calls": 8, "graph_calls": 8, "verified": 4, "stock": 0, "adopted": 0, "stock_by_reason": {}}


CHANNELS, KERNEL, CONV_LAYERS = 8, 3, 3


class CausalConvStack(nn.Module):
    """A vocoder-like stack of causal convolutions; each layer's left context (its last KERNEL - 1
    frames) is kept in a plain list attribute, concatenated before the call and trimmed after."""

    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv1d(CHANNELS, CHANNELS, KERNEL) for _ in range(CONV_LAYERS))
        self.start()

    def start(self) -> None:
        self.contexts = [torch.zeros(1, CHANNELS, KERNEL - 1) for _ in range(CONV_LAYERS)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, conv in enumerate(self.convs):
            full = torch.cat([self.contexts[i], x], dim=-1)
            self.contexts[i] = full[..., -(KERNEL - 1):]
            x = torch.tanh(conv(full))
        return x


def test_a_causal_conv_stack_with_its_contexts_in_a_list_attribute_streams_on_carries():
    torch.manual_seed(0)
    model = CausalConvStack().eval()
    frames = torch.randn(1, CHANNELS, 6 * STEP, generator=torch.Generator().manual_seed(1))

    def stream(m):
        model.start()
        with torch.no_grad():
            return [m(frames[..., t:t + STEP]) for t in range(0, frames.shape[-1], STEP)]

    expected = stream(model)
    contract = Contract(
        family="conv_stack",
        clocks=(Clock("frame", ClockKind.FRAMES), Clock("call", ClockKind.CALLS)),
        rates=(Rate("frame", "call", STEP, name="frames_per_call"),),
        quantities={"layers": CONV_LAYERS, "channels": CHANNELS},
        regions=(Region("conv_context", dims=("layers", 1, "channels", "frame"), axis=3, clock="frame", stride=STEP,
                        dtype="float32", lifetime=Lifetime.PER_STREAM,
                        retention=SlidingWindow(window=KERNEL - 1, initial=KERNEL - 1), holds_call=False),),
        operators=(Operator("vocoder_step", "conv_context", steady=STEP),),
        admission=Admission("frame", max_per_call=STEP),
        interactivity=Interactivity(stages=("vocoder",)),
    )
    binding = Binding(regions=(RegionBinding("conv_context", at=("self.contexts.*",)),),
                      operators=(OperatorBinding("vocoder_step", units=("x", 2)),), verify=1)
    bound, report = transform(model, contract, binding)
    assert exact(stream(bound), expected)
    assert exact(stream(bound), expected)
    op = report.operators["vocoder_step"]
    assert [cls.name for cls in op.classes.values()] == ["vocoder_step[n=2,L=2]"]
    # each stream's fresh zero contexts are copied into the carries: 3 a stream
    assert op.counters.as_dict() == {"calls": 12, "graph_calls": 12, "verified": 1, "stock": 0, "adopted": 6,
                                     "stock_by_reason": {}}
    assert [(s.kind, s.rewritten) for s in report.sites] == [("append", True)] * CONV_LAYERS
    # the list holds the carries' views now, one address each
    assert [c.data_ptr() for c in model.contexts] == [op.carries[f"self.contexts.{i}"].address for i in range(CONV_LAYERS)]


ENCODER_FRAMES, WHISPER_TOKENS = 6, 8


def test_a_whisper_decoder_streams_with_an_encoder_decoder_cache():
    """Self-attention grows (SlidingWindow to the stream's length), cross-attention is the encoder's
    keys and values, computed at the first call and read after (a RingCache of the encoder's extent)."""
    torch.manual_seed(0)
    config = WhisperConfig(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=2, encoder_attention_heads=4,
                           decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
                           max_source_positions=ENCODER_FRAMES, max_target_positions=32, attn_implementation="sdpa",
                           pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    model = WhisperForConditionalGeneration(config).eval()
    encoded = BaseModelOutput(last_hidden_state=torch.randn(1, ENCODER_FRAMES, 32, generator=torch.Generator().manual_seed(2)))
    tokens = random_tokens(WHISPER_TOKENS)

    def stream(m):
        cache, logits = EncoderDecoderCache(DynamicCache(config=config), DynamicCache(config=config)), []
        with torch.no_grad():
            for t in range(0, WHISPER_TOKENS, STEP):
                logits.append(m(encoder_outputs=encoded, decoder_input_ids=tokens[:, t:t + STEP], use_cache=True,
                                decoder_position_ids=torch.arange(t, t + STEP)[None], cache=cache).logits)
        return logits

    expected = stream(model)
    contract = Contract(
        family="whisper_decoder",
        clocks=(Clock("token", ClockKind.TOKENS), Clock("frame", ClockKind.FRAMES), Clock("call", ClockKind.CALLS)),
        rates=(Rate("token", "call", STEP, name="tokens_per_call"),),
        quantities={"layers": 2, "heads": 4, "head_dim": 8},
        regions=(
            Region("self_kv", dims=("layers", 2, 1, "heads", "token", "head_dim"), axis=4, clock="token", stride=STEP,
                   dtype="float32", lifetime=Lifetime.PER_STREAM, retention=SlidingWindow(window=WHISPER_TOKENS)),
            # constant for the stream; `stride` must be positive though no call appends to it
            Region("cross_kv", dims=("layers", 2, 1, "heads", "frame", "head_dim"), axis=4, clock="frame", stride=1,
                   dtype="float32", lifetime=Lifetime.PER_STREAM, retention=RingCache(ENCODER_FRAMES)),
        ),
        operators=(Operator("decoder_step", "self_kv", steady=STEP),),
        admission=Admission("token", max_per_call=STEP),
        interactivity=Interactivity(stages=("decoder",)),
    )
    layers = "cache.{}_attention_cache.layers.*.{}"
    binding = Binding(
        regions=(RegionBinding("self_kv", at=(layers.format("self", "keys"), layers.format("self", "values"))),
                 RegionBinding("cross_kv", at=(layers.format("cross", "keys"), layers.format("cross", "values")))),
        operators=(OperatorBinding("decoder_step", units=("decoder_input_ids", 1),
                                   counters=(layers.format("self", "is_initialized"), layers.format("cross", "is_initialized"),
                                             "cache.is_updated")),),
        verify=1,
    )
    bound, report = transform(model, contract, binding)
    assert exact(stream(bound), expected)
    assert exact(stream(bound), expected)
    op = report.operators["decoder_step"]
    assert [cls.name for cls in op.classes.values()] == [f"decoder_step[n=2,L={e}]" for e in (0, 2, 4, 6)]
    # each stream's cross-attention keys and values (4 sites), computed by its first call, are
    # taken into their carries once
    assert op.counters.as_dict() == {"calls": 8, "graph_calls": 8, "verified": 4, "stock": 0, "adopted": 8,
                                     "stock_by_reason": {}}


def test_a_stream_past_the_bound_runs_the_stock_code_instead_of_overflowing_the_carry():
    """Bug (fixed in pipeline.py `_carry_view`): a call outside the catalog runs the stock code, whose
    retained state is then taken into the carries; when the stock code retained more than the
    carry's bound (full attention past N, or a prompt longer than the window) the adoption raised
    `CarryError: kv: 12 units exceed the carry's bound 10` and the stream died."""
    model, config = qwen3()
    tokens, sizes = random_tokens(12), [STEP] * 6
    expected = stream_dynamic(model, config, tokens, sizes)
    bound, report = transform(model, kv_contract("qwen3_full", 2, 2, tokens=8), DYNAMIC_CACHE)
    assert exact(stream_dynamic(bound, config, tokens, sizes), expected)
    assert exact(stream_dynamic(bound, config, tokens, sizes), expected)
    op = report.operators["decoder_step"]
    assert [cls.name for cls in op.classes.values()] == [f"decoder_step[n=2,L={e}]" for e in (0, 2, 4, 6, 8)]
    # the call at L=10 of each stream is no class (the window keeps at most 8 + 2): stock
    assert op.counters.as_dict() == {"calls": 12, "graph_calls": 10, "verified": 5, "stock": 2, "adopted": 0,
                                     "stock_by_reason": {"not_in_catalog": 2}}


GEMMA_WINDOW = 5  # a sliding layer's cache keeps its last GEMMA_WINDOW - 1 tokens


def test_gemma3_hybrid_layers_stream_from_their_first_call_on_the_exported_steps():
    """Bug (fixed in pipeline.py `_capture`): sliding and full layers are two regions; the operator's
    region (the full layers') decides the class, and the pipeline declared every other region at its
    whole window, so while the sliding layers were still filling (L=0, L=2) the window pass refused
    the class (`cache.layers.0.keys: slice_5 has extent 2, the catalog class declares 4`) and those
    calls ran the stock code. The other region's extent is the one the call brings."""
    torch.manual_seed(0)
    config = Gemma3TextConfig(num_hidden_layers=4, sliding_window=GEMMA_WINDOW,
                              layer_types=["sliding_attention", "full_attention"] * 2, **TINY)
    model = Gemma3ForCausalLM(config).eval()
    tokens, sizes = random_tokens(12), [STEP] * 6
    expected = stream_dynamic(model, config, tokens, sizes)
    contract = Contract(
        family="gemma3_hybrid",
        clocks=(Clock("token", ClockKind.TOKENS), Clock("call", ClockKind.CALLS)),
        rates=(Rate("token", "call", STEP, name="tokens_per_call"),),
        quantities={"layers": 2, "kv_heads": 2, "head_dim": 8},  # of each kind
        regions=(Region("kv_full", dims=KV_DIMS, axis=4, clock="token", stride=STEP, dtype="float32",
                        lifetime=Lifetime.PER_STREAM, retention=SlidingWindow(window=12)),
                 Region("kv_sliding", dims=KV_DIMS, axis=4, clock="token", stride=STEP, dtype="float32",
                        lifetime=Lifetime.PER_STREAM, retention=SlidingWindow(window=GEMMA_WINDOW - 1))),
        operators=(Operator("decoder_step", "kv_full", steady=STEP),),
        admission=Admission("token", max_per_call=STEP),
        interactivity=Interactivity(stages=("decoder",)),
    )
    binding = Binding(
        regions=(RegionBinding("kv_full", at=("cache.layers.[1::2].keys", "cache.layers.[1::2].values")),
                 RegionBinding("kv_sliding", at=("cache.layers.[0::2].keys", "cache.layers.[0::2].values"))),
        operators=(OperatorBinding("decoder_step", units=("input_ids", 1),
                                   counters=("cache.layers.*.is_initialized", "cache.layers.[0::2].cumulative_length")),),
        verify=1,
    )
    bound, report = transform(model, contract, binding)
    assert exact(stream_dynamic(bound, config, tokens, sizes), expected)
    assert exact(stream_dynamic(bound, config, tokens, sizes), expected)
    op = report.operators["decoder_step"]
    assert {cls.name: cls.refused for cls in op.classes.values()} == {
        f"decoder_step[n=2,L={e}]": None for e in (0, 2, 4, 6, 8, 10)}
    assert op.counters.as_dict() == {"calls": 12, "graph_calls": 12, "verified": 6, "stock": 0, "adopted": 0,
                                     "stock_by_reason": {}}


def test_a_host_flag_the_binding_leaves_out_refuses_the_class_that_moves_it():
    """Bug (fixed in pipeline.py `_verify`): a binding without `cache.layers.*.is_initialized`
    verified every class, since the verified stock calls set the flag on the caller's cache. A
    later stream then ran its first call through the graph, which sets no flag; its next stock call
    (a 1-token call, no class) found the flag False, re-initialised the layer and dropped the
    retained tokens: wrong logits, silently. A host value the stock call moves and the binding
    leaves out now refuses the class, saying which."""
    model, config = gpt2()
    tokens, sizes = random_tokens(7), [STEP, STEP, STEP, 1]
    expected = stream_dynamic(model, config, tokens, sizes)
    binding = Binding(regions=DYNAMIC_CACHE.regions,
                      operators=(OperatorBinding("decoder_step", units=("input_ids", 1)),), verify=1)
    bound, report = transform(model, kv_contract("gpt2", 2, 4, tokens=8), binding)
    assert exact(stream_dynamic(bound, config, tokens, sizes), expected)
    assert exact(stream_dynamic(bound, config, tokens, sizes), expected)
    op = report.operators["decoder_step"]
    assert {cls.name: cls.refused for cls in op.classes.values()} == {
        "decoder_step[n=2,L=0]": "verification: the stock call moved host values the binding does not declare: "
                                 "cache.layers.0.is_initialized (False -> True), cache.layers.1.is_initialized "
                                 "(False -> True); a graph would not move them: bind them as the operator's counters",
        "decoder_step[n=2,L=2]": None, "decoder_step[n=2,L=4]": None}
    # the refused first call ran its graph beside the stock call once; every stock call's retained
    # state (4 sites) is then taken into the carries
    assert op.counters.as_dict() == {"calls": 8, "graph_calls": 5, "verified": 2, "stock": 4, "adopted": 16,
                                     "stock_by_reason": {"verification": 1, "refused": 1, "not_in_catalog": 2}}


def test_a_contract_shape_the_first_call_contradicts_is_an_error_naming_the_site():
    """Bug (fixed in pipeline.py `_capture`): with no state yet the first call's shapes went
    unchecked, and a contract declaring 2 heads where GPT-2 keeps 4 failed inside the graph with
    `RuntimeError: The size of tensor a (2) must match the size of tensor b (4) at non-singleton
    dimension 1` (from passes/carry.py). It now fails as a later call's state would: naming the
    site, what it holds and what the contract declares."""
    model, config = gpt2()
    bound, _ = transform(model, kv_contract("gpt2", 2, 2, tokens=8), DYNAMIC_CACHE)
    with pytest.raises(ValueError) as error:
        stream_dynamic(bound, config, random_tokens(2), [STEP])
    assert str(error.value) == ("decoder_step: after the call cache.layers.0.keys holds torch.float32 (1, 4, 2, 8), "
                                "the contract declares torch.float32 (1, 2) x extent x (8,)")


def test_a_counter_path_the_state_does_not_have_is_a_binding_error_naming_the_counter():
    """Error quality (fixed in pipeline.py `_counter_paths`): the byom example's Mistral counters on
    a full-attention cache, whose `DynamicLayer` has no `cumulative_length`, failed at the first
    call with a bare `AttributeError: 'DynamicLayer' object has no attribute 'cumulative_length'`
    from deep in binding.resolve; it now names the binding field and the path."""
    model, config = qwen3()
    binding = Binding(regions=DYNAMIC_CACHE.regions, operators=(
        OperatorBinding("decoder_step", units=("input_ids", 1),
                        counters=("cache.layers.*.cumulative_length", "cache.layers.*.is_initialized")),))
    bound, _ = transform(model, kv_contract("qwen3_full", 2, 2, tokens=8), binding)
    with pytest.raises(BindingError) as error:
        stream_dynamic(bound, config, random_tokens(2), [STEP])
    assert str(error.value) == ("binding.operators[0].counters[0]: 'cache.layers.*.cumulative_length' does not resolve "
                                "on this call's arguments: 'DynamicLayer' object has no attribute 'cumulative_length'")
