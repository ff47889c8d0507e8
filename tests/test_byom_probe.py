"""Bring your own model, probed as a new user: models cadence-fx has no code for, each transformed
from a contract and a binding written only against the public API (README "Bring your own model",
docs/contract.md), streamed beside the stock model and compared bit for bit.

Full attention has no retention that bounds it, and C2 asks for one: a stream that grows to N
tokens and stops is declared `SlidingWindow(window=N)`. The stock cache never trims, so every
call up to N is a class of the catalog and runs the exported step; a call past N is none and runs
the stock code.

Every test uses `Binding(verify=1)`: the first stream verifies each class (a class that moves a
host counter is verified once more, at another value of it, by the second), the later calls run
the rewritten graphs only (on CPU, eager), so a host value the graphs would not move shows there.
Most models' tests have a `cuda` twin: the same streams (three of them) on the GPU, where every
call after its class's verified ones replays a CUDA graph (transformers' Mimi and the speech LMs'
decoder steps, Kyutai's, Moshi's and CSM's, have none yet)."""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, replace
from types import SimpleNamespace

import pytest
import torch
import transformers
from torch import nn
from torch.utils import _pytree as pytree
from transformers import (
    CsmConfig,
    CsmForConditionalGeneration,
    DynamicCache,
    EncoderDecoderCache,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    KyutaiSpeechToTextConfig,
    KyutaiSpeechToTextForConditionalGeneration,
    MambaConfig,
    MambaForCausalLM,
    MimiConfig,
    MimiModel,
    MoshiConfig,
    MoshiForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    RwkvConfig,
    RwkvForCausalLM,
    WhisperConfig,
    WhisperForConditionalGeneration,
)
from transformers.modeling_outputs import BaseModelOutput
from transformers.models.mimi.modeling_mimi import MimiConv1dPaddingCache
from transformers.models.rwkv import modeling_rwkv

from cadence_fx import (
    Admission,
    Binding,
    BindingError,
    Clock,
    ClockKind,
    Contract,
    ContractError,
    InPlace,
    Interactivity,
    Lifetime,
    Operator,
    OperatorBinding,
    Rate,
    Region,
    RegionBinding,
    RingCache,
    SlidingWindow,
    transform,
)
from cadence_fx.binding import get_path, resolve, set_path

STEP = 2  # tokens (or frames) a call
CUDA_STREAMS = 3
# On the GPU the stock call of a first chunk (as many queries as keys) lets SDPA apply its own
# causal mask (`is_causal`), while transformers materialises the mask whenever torch.export traces;
# the two kernels may round differently (measured on the H200 for Mistral, tests/test_binding_cuda.py),
# and verification then refuses that class: the stream stays exact on the stock code.
FIRST = "decoder_step[n=2,L=0]"
TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=128,
    attn_implementation="sdpa",
)
KV_DIMS = ("layers", 2, 1, "kv_heads", "token", "head_dim")  # [layer, keys|values] x one layer's cache


def kv_contract(family: str, layers: int, kv_heads: int, tokens: int) -> Contract:
    """A decoder whose cache grows by STEP tokens a call, for a stream of at most `tokens` tokens."""
    return Contract(
        family=family,
        clocks=(Clock("token", ClockKind.TOKENS), Clock("call", ClockKind.CALLS)),
        rates=(Rate("token", "call", STEP, name="tokens_per_call"),),
        quantities={"layers": layers, "kv_heads": kv_heads, "head_dim": 8},
        regions=(
            Region(
                "kv",
                dims=KV_DIMS,
                axis=4,
                clock="token",
                stride=STEP,
                dtype="float32",
                lifetime=Lifetime.PER_STREAM,
                retention=SlidingWindow(window=tokens),
            ),
        ),
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


def layer_addresses(layers, prefix: str) -> dict[str, int]:
    """Where each layer's keys and values are, by their binding path."""
    return {
        f"{prefix}.{i}.{kind}": getattr(layer, kind).data_ptr() for i, layer in enumerate(layers) for kind in ("keys", "values")
    }


def stream_dynamic(model, config, tokens: torch.Tensor, sizes: list[int]) -> tuple[list[torch.Tensor], list[dict[str, int]]]:
    """The stock way to stream: calls of `sizes` tokens into one DynamicCache, positions given.
    Returns the logits, and after each call where each site of the cache is."""
    cache, logits, addresses, t = DynamicCache(config=config), [], [], 0
    with torch.no_grad():
        for n in sizes:
            out = model(
                input_ids=tokens[:, t : t + n],
                position_ids=torch.arange(t, t + n, device=tokens.device)[None],
                cache=cache,
                use_cache=True,
            )
            logits.append(out.logits)
            addresses.append(layer_addresses(cache.layers, "cache.layers"))
            t += n
    return logits, addresses


def exact(actual: list, expected: list) -> bool:
    return all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))


def streamed_returning(model, contract: Contract, binding: Binding, stream, streams: int):
    """`streamed` for a step that returns its new state (`RegionBinding.out`): the caller threads
    what the call returned back in, so its addresses are not the carries' (the pipeline takes a
    passed state into the carries before each call); only the outputs are compared. A state the
    transformed step returns may be a view of its carry, which the next call overwrites: a caller
    that keeps an earlier call's state (to roll back) must clone it, so the streams here compare
    the state as returned by the last call only."""
    expected = stream(model)
    bound, report = transform(model, contract, binding)
    with collector_paused():
        for _ in range(streams):
            assert exact(stream(bound), expected)
    return bound, report


@contextlib.contextmanager
def collector_paused():
    """The cyclic garbage collector off: a stream's cache (transformers' caches hold cycles) stays
    alive after its stream ends until the block does, so the next stream's first call finds it and
    copies its sites out of the carries (`evicted`) whatever the collector's timing would have been."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def streamed(model, contract: Contract, binding: Binding, stream, streams: int):
    """`streams` streams of the transformed model, each bit-identical to the stock model's, every
    site at its carry's address from each stream's first call to its last. `stream(m)` returns
    the outputs and, after each call, where each site is (by its binding path)."""
    expected, _ = stream(model)
    bound, report = transform(model, contract, binding)
    with collector_paused():
        for _ in range(streams):
            actual, addresses = stream(bound)
            assert exact(actual, expected)
            assert addresses == [{path: carry.address for path, carry in bound.carries.items()}] * len(expected)
    return bound, report


def assert_replay_counters(
    report,
    visits: dict[str, int],
    streams: int,
    device: str,
    may_refuse: frozenset = frozenset(),
    later: frozenset = frozenset(),
    operator: str | None = None,
    stock_by_reason: dict | None = None,
):
    """The replay engine's counters after `streams` streams that each visit the catalog classes
    `visits` (class name -> calls a stream, in the order first met). Every binding here verifies
    one visit (`Binding(verify=1)`), two for a class that moves a host counter (the pipeline
    verifies it again at another value of the counter): a class's verified calls run beside the
    stock call, outside the engine; each later call goes to the engine, which captures the class's
    graph at its first call and replays it from then on (the capturing call replays too). Without CUDA the engine runs
    each call eager (`no_cuda`). A class verification refused (only one of `may_refuse`) runs the
    stock code on every visit, never the engine. A class of `later` is one the first stream does
    not meet (its first call finds no state to count the sites by, and runs the stock code). A
    binding of several operators names the `operator` whose counters these are. `stock_by_reason`,
    where given, is the operator's exact count of stock calls by reason (a refused class met again
    as a variant, `#2`, counts a second verification, not a refusal)."""
    (op,) = [report.operators[operator]] if operator else report.operators.values()
    assert [cls.name for cls in op.classes.values()] == list(visits)
    refused = {cls.name: cls.refused for cls in op.classes.values() if cls.refused}
    assert set(refused) <= may_refuse and all(why.startswith("verification: ") for why in refused.values()), refused
    if stock_by_reason is not None:
        assert op.counters.stock_by_reason == stock_by_reason
    elif refused:
        assert op.counters.stock_by_reason == {"verification": len(refused), "refused": (streams - 1) * len(refused)}
    verified = {cls.name: cls.verified for cls in op.classes.values()}
    engine = {name: (streams - (name in later)) * n - verified[name] for name, n in visits.items() if name not in refused}
    calls = sum(engine.values())
    if device == "cuda":
        expected = {
            "calls": calls,
            "captures": sum(1 for n in engine.values() if n),
            "replays": calls,
            "eager": 0,
            "invalidations": 0,
            "fallbacks": {},
        }
    else:
        expected = {
            "calls": calls,
            "captures": 0,
            "replays": 0,
            "eager": calls,
            "invalidations": 0,
            "fallbacks": {"no_cuda": calls} if calls else {},
        }
    assert report.replays[op.ob.operator].counters.as_dict() == expected


def qwen3(device: str = "cpu") -> tuple[Qwen3ForCausalLM, Qwen3Config]:
    torch.manual_seed(0)
    config = Qwen3Config(num_hidden_layers=2, **TINY)
    return Qwen3ForCausalLM(config).eval().to(device), config


def gpt2(device: str = "cpu") -> tuple[GPT2LMHeadModel, GPT2Config]:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa"
    )
    return GPT2LMHeadModel(config).eval().to(device), config


def random_tokens(n: int, device: str = "cpu") -> torch.Tensor:
    return torch.randint(0, 64, (1, n), generator=torch.Generator().manual_seed(1)).to(device)


QWEN3_CLASSES = {f"decoder_step[n=2,L={e}]": 1 for e in (0, 2, 4, 6, 8, 10)}  # 6 calls a stream, one per class


def qwen3_streams(device: str, streams: int):
    model, config = qwen3(device)
    tokens, sizes = random_tokens(12, device), [STEP] * 6
    return streamed(
        model,
        kv_contract("qwen3_full", 2, 2, tokens=12),
        DYNAMIC_CACHE,
        lambda m: stream_dynamic(m, config, tokens, sizes),
        streams,
    )


# The first call (nothing cached) is refused: traced, transformers takes another position/mask path
# ("verification: program: ... op 1: the stock call ran aten._to_copy, the graph runs aten.arange");
# every stream's first call meets that class again and runs the stock code. Each stream's first
# (stock) call's 4 sites are adopted into the carries.
FIRSTS = frozenset({FIRST})


def test_qwen3_full_attention_refuses_its_first_call_and_streams_the_rest_on_the_exported_steps():
    _, report = qwen3_streams("cpu", streams=2)
    op = report.operators["decoder_step"]
    assert op.counters.as_dict() == {
        "calls": 12,
        "graph_calls": 11,
        "verified": 5,
        "stock": 2,
        "adopted": 8,
        "evicted": 4,
        "stock_by_reason": {"verification": 1, "refused": 1},
    }
    assert_replay_counters(report, QWEN3_CLASSES, streams=2, device="cpu", may_refuse=FIRSTS)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_qwen3_full_attention_replays_every_call_after_its_class_is_verified_on_cuda():
    # as on the CPU: the first call refused, in every stream
    _, report = qwen3_streams("cuda", CUDA_STREAMS)
    assert_replay_counters(report, QWEN3_CLASSES, CUDA_STREAMS, "cuda", may_refuse=FIRSTS)


GPT2_CLASSES = {f"decoder_step[n=2,L={e}]": 1 for e in (0, 2, 4, 6)}  # 4 calls a stream, one per class


def gpt2_streams(device: str, streams: int):
    model, config = gpt2(device)
    tokens, sizes = random_tokens(8, device), [STEP] * 4
    return streamed(
        model, kv_contract("gpt2", 2, 4, tokens=8), DYNAMIC_CACHE, lambda m: stream_dynamic(m, config, tokens, sizes), streams
    )


def test_gpt2_streams_bit_identically_through_the_same_cache_binding():
    """The first call (nothing cached) is refused: traced, transformers takes another mask path
    ("verification: program: ... op 3: the stock call ran aten.native_layer_norm, the graph runs
    aten.arange"); it runs the stock code in both streams, whose 4 sites are adopted."""
    _, report = gpt2_streams("cpu", streams=2)
    assert report.operators["decoder_step"].counters.as_dict() == {
        "calls": 8,
        "graph_calls": 7,
        "verified": 3,
        "stock": 2,
        "adopted": 8,
        "evicted": 4,
        "stock_by_reason": {"verification": 1, "refused": 1},
    }
    assert_replay_counters(report, GPT2_CLASSES, streams=2, device="cpu", may_refuse=frozenset({FIRST}))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_gpt2_replays_every_call_after_its_class_is_verified_on_cuda():
    _, report = gpt2_streams("cuda", CUDA_STREAMS)
    assert_replay_counters(report, GPT2_CLASSES, CUDA_STREAMS, "cuda", may_refuse=frozenset({FIRST}))


# More decoders from transformers, each streamed into one DynamicCache and transformed from the
# same contract and binding as Qwen3's above, with no code of their own: (config, model, the kv
# heads each layer stores, the tiny config). Bloom has no SDPA path in transformers: eager attention.
_DECODER = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, max_position_embeddings=128)
MORE_DECODERS = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        2,
        dict(_DECODER, intermediate_size=64, num_hidden_layers=2, num_key_value_heads=2, head_dim=8),
    ),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        2,
        dict(_DECODER, intermediate_size=64, num_hidden_layers=2, num_key_value_heads=2, pad_token_id=0),
    ),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", 4, dict(_DECODER, intermediate_size=64, num_hidden_layers=2)),
    "opt": ("OPTConfig", "OPTForCausalLM", 4, dict(_DECODER, ffn_dim=64, num_hidden_layers=2, word_embed_proj_dim=32)),
    "falcon": (
        "FalconConfig",
        "FalconForCausalLM",
        4,
        dict(_DECODER, num_hidden_layers=2, num_kv_heads=4, new_decoder_architecture=True),
    ),
    "olmo2": (
        "Olmo2Config",
        "Olmo2ForCausalLM",
        2,
        dict(_DECODER, intermediate_size=64, num_hidden_layers=2, num_key_value_heads=2),
    ),
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        2,
        dict(_DECODER, intermediate_size=64, num_hidden_layers=2, num_key_value_heads=2),
    ),
    "stablelm": (
        "StableLmConfig",
        "StableLmForCausalLM",
        2,
        dict(_DECODER, intermediate_size=64, num_hidden_layers=2, num_key_value_heads=2),
    ),
    "bloom": ("BloomConfig", "BloomForCausalLM", 4, dict(vocab_size=64, hidden_size=32, n_layer=2, n_head=4)),
    "gpt_bigcode": (
        "GPTBigCodeConfig",
        "GPTBigCodeForCausalLM",
        4,
        dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=128, multi_query=False),
    ),
    "gptj": (
        "GPTJConfig",
        "GPTJForCausalLM",
        4,
        dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=128, rotary_dim=4),
    ),
    "codegen": (
        "CodeGenConfig",
        "CodeGenForCausalLM",
        4,
        dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=128, rotary_dim=4),
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        2,  # mixture of experts: 2 of 4 routed a token
        dict(
            _DECODER,
            intermediate_size=64,
            num_hidden_layers=2,
            num_key_value_heads=2,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        2,
        dict(
            _DECODER,
            intermediate_size=64,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            num_hidden_layers=2,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
        ),
    ),
    "cohere": (
        "CohereConfig",
        "CohereForCausalLM",
        2,
        dict(_DECODER, intermediate_size=64, num_hidden_layers=2, num_key_value_heads=2),
    ),
    "starcoder2": (
        "Starcoder2Config",
        "Starcoder2ForCausalLM",
        2,
        dict(_DECODER, intermediate_size=64, num_hidden_layers=2, num_key_value_heads=2),
    ),
}


# What the pipeline does with each, the stream bit-identical in every case. The first call (nothing
# cached) is refused for all: traced, transformers takes another position/mask path (verification:
# program), or (Falcon, Bloom) the stock call sets each layer's `device`, a host value the binding
# does not declare. The mixtures of experts' steady classes are refused too: the stock call runs
# `aten._grouped_mm`, the traced one transformers' `grouped_mm_fallback`; every call runs the stock code.
_REFUSED_ONCE = (
    {
        "calls": 12,
        "graph_calls": 11,
        "verified": 5,
        "stock": 2,
        "adopted": 8,
        "evicted": 4,
        "stock_by_reason": {"verification": 1, "refused": 1},
    },
    QWEN3_CLASSES,
)
_ALL_REFUSED = (
    {
        "calls": 12,
        "graph_calls": 6,
        "verified": 0,
        "stock": 12,
        "adopted": 48,
        "evicted": 4,
        "stock_by_reason": {"verification": 6, "refused": 6},
    },
    QWEN3_CLASSES,
)
MORE_DECODERS_RESULTS = {
    **{family: _REFUSED_ONCE for family in MORE_DECODERS},
    **dict.fromkeys(("mixtral", "qwen2_moe"), _ALL_REFUSED),
}


@pytest.mark.parametrize("family", sorted(MORE_DECODERS))
def test_more_transformers_decoders_stream_bit_identically_from_the_same_binding(family):
    config_class, model_class, kv_heads, kwargs = MORE_DECODERS[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**kwargs, attn_implementation="eager" if family == "bloom" else "sdpa")
    model = getattr(transformers, model_class)(config).eval()
    tokens, sizes = random_tokens(12), [STEP] * 6
    _, report = streamed(
        model,
        kv_contract(family, 2, kv_heads, tokens=12),
        DYNAMIC_CACHE,
        lambda m: stream_dynamic(m, config, tokens, sizes),
        streams=2,
    )
    counters, visits = MORE_DECODERS_RESULTS[family]
    assert report.operators["decoder_step"].counters.as_dict() == counters
    assert_replay_counters(
        report,
        visits,
        streams=2,
        device="cpu",
        may_refuse=frozenset(visits) if family in ("mixtral", "qwen2_moe") else FIRSTS,
        stock_by_reason=counters["stock_by_reason"],
    )


CHANNELS, KERNEL, CONV_LAYERS = 8, 3, 3


class CausalConvStack(nn.Module):
    """A vocoder-like stack of causal convolutions; each layer's left context (its last KERNEL - 1
    frames) is kept in a plain list attribute, concatenated before the call and trimmed after."""

    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv1d(CHANNELS, CHANNELS, KERNEL) for _ in range(CONV_LAYERS))
        self.start()

    def start(self) -> None:
        device = self.convs[0].weight.device
        self.contexts = [torch.zeros(1, CHANNELS, KERNEL - 1, device=device) for _ in range(CONV_LAYERS)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, conv in enumerate(self.convs):
            full = torch.cat([self.contexts[i], x], dim=-1)
            self.contexts[i] = full[..., -(KERNEL - 1) :]
            x = torch.tanh(conv(full))
        return x


CONV_CLASSES = {"vocoder_step[n=2,L=2]": 6}  # 6 calls a stream, all of one class


def conv_stack_streams(device: str, streams: int):
    torch.manual_seed(0)
    model = CausalConvStack().eval().to(device)
    frames = torch.randn(1, CHANNELS, 6 * STEP, generator=torch.Generator().manual_seed(1)).to(device)

    def stream(m):
        model.start()
        outputs, addresses = [], []
        with torch.no_grad():
            for t in range(0, frames.shape[-1], STEP):
                outputs.append(m(frames[..., t : t + STEP]))
                addresses.append({f"self.contexts.{i}": c.data_ptr() for i, c in enumerate(model.contexts)})
        return outputs, addresses

    contract = Contract(
        family="conv_stack",
        clocks=(Clock("frame", ClockKind.FRAMES), Clock("call", ClockKind.CALLS)),
        rates=(Rate("frame", "call", STEP, name="frames_per_call"),),
        quantities={"layers": CONV_LAYERS, "channels": CHANNELS},
        regions=(
            Region(
                "conv_context",
                dims=("layers", 1, "channels", "frame"),
                axis=3,
                clock="frame",
                stride=STEP,
                dtype="float32",
                lifetime=Lifetime.PER_STREAM,
                retention=SlidingWindow(window=KERNEL - 1, initial=KERNEL - 1),
                holds_call=False,
            ),
        ),
        operators=(Operator("vocoder_step", "conv_context", steady=STEP),),
        admission=Admission("frame", max_per_call=STEP),
        interactivity=Interactivity(stages=("vocoder",)),
    )
    binding = Binding(
        regions=(RegionBinding("conv_context", at=("self.contexts.*",)),),
        operators=(OperatorBinding("vocoder_step", units=("x", 2)),),
        verify=1,
    )
    return streamed(model, contract, binding, stream, streams)


def test_a_causal_conv_stack_with_its_contexts_in_a_list_attribute_streams_on_carries():
    _, report = conv_stack_streams("cpu", streams=2)
    op = report.operators["vocoder_step"]
    # each stream's fresh zero contexts are copied into the carries: 3 a stream; the list holds
    # the carries' views from then on, one address each (`streamed`)
    assert op.counters.as_dict() == {
        "calls": 12,
        "graph_calls": 12,
        "verified": 1,
        "stock": 0,
        "adopted": 6,
        "stock_by_reason": {},
    }
    assert [(s.kind, s.rewritten) for s in report.sites] == [("append", True)] * CONV_LAYERS
    assert_replay_counters(report, CONV_CLASSES, streams=2, device="cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_a_causal_conv_stack_replays_every_call_after_the_first_on_cuda():
    _, report = conv_stack_streams("cuda", CUDA_STREAMS)
    assert_replay_counters(report, CONV_CLASSES, CUDA_STREAMS, "cuda")


ENCODER_FRAMES, WHISPER_TOKENS = 6, 8


WHISPER_CLASSES = {f"decoder_step[n=2,L={e}]": 1 for e in (0, 2, 4, 6)}  # 4 calls a stream, one per class


def encoder_decoder(family: str) -> tuple[Contract, Binding]:
    """The contract and binding of a 2-layer decoder with an `EncoderDecoderCache`, 4 heads of 8:
    self-attention grows (SlidingWindow to the stream's length), cross-attention is the encoder's
    keys and values, computed at the first call and read after (a RingCache of the encoder's extent)."""
    contract = Contract(
        family=family,
        clocks=(Clock("token", ClockKind.TOKENS), Clock("frame", ClockKind.FRAMES), Clock("call", ClockKind.CALLS)),
        rates=(Rate("token", "call", STEP, name="tokens_per_call"),),
        quantities={"layers": 2, "heads": 4, "head_dim": 8},
        regions=(
            Region(
                "self_kv",
                dims=("layers", 2, 1, "heads", "token", "head_dim"),
                axis=4,
                clock="token",
                stride=STEP,
                dtype="float32",
                lifetime=Lifetime.PER_STREAM,
                retention=SlidingWindow(window=WHISPER_TOKENS),
            ),
            # constant for the stream; `stride` must be positive though no call appends to it
            Region(
                "cross_kv",
                dims=("layers", 2, 1, "heads", "frame", "head_dim"),
                axis=4,
                clock="frame",
                stride=1,
                dtype="float32",
                lifetime=Lifetime.PER_STREAM,
                retention=RingCache(ENCODER_FRAMES),
            ),
        ),
        operators=(Operator("decoder_step", "self_kv", steady=STEP),),
        admission=Admission("token", max_per_call=STEP),
        interactivity=Interactivity(stages=("decoder",)),
    )
    layers = "cache.{}_attention_cache.layers.*.{}"
    binding = Binding(
        regions=(
            RegionBinding("self_kv", at=(layers.format("self", "keys"), layers.format("self", "values"))),
            RegionBinding("cross_kv", at=(layers.format("cross", "keys"), layers.format("cross", "values"))),
        ),
        operators=(
            OperatorBinding(
                "decoder_step",
                units=("decoder_input_ids", 1),
                # `is_updated` is a dict keyed by layer index (ints)
                counters=(
                    layers.format("self", "is_initialized"),
                    layers.format("cross", "is_initialized"),
                    "cache.is_updated.0",
                    "cache.is_updated.1",
                ),
            ),
        ),
        verify=1,
    )
    return contract, binding


def encoder_decoder_stream(config, device: str, **call):
    """The stock stream of an encoder-decoder model over a fixed encoding: WHISPER_TOKENS decoder
    tokens, STEP a call, into one `EncoderDecoderCache`; `call` adds keywords (positions)."""
    encoded = BaseModelOutput(
        last_hidden_state=torch.randn(1, ENCODER_FRAMES, 32, generator=torch.Generator().manual_seed(2)).to(device)
    )
    tokens = random_tokens(WHISPER_TOKENS, device)

    def stream(m):
        cache, logits, addresses = EncoderDecoderCache(DynamicCache(config=config), DynamicCache(config=config)), [], []
        with torch.no_grad():
            for t in range(0, WHISPER_TOKENS, STEP):
                extra = {name: value(t) for name, value in call.items()}
                logits.append(
                    m(
                        encoder_outputs=encoded, decoder_input_ids=tokens[:, t : t + STEP], use_cache=True, cache=cache, **extra
                    ).logits
                )
                addresses.append(
                    layer_addresses(cache.self_attention_cache.layers, "cache.self_attention_cache.layers")
                    | layer_addresses(cache.cross_attention_cache.layers, "cache.cross_attention_cache.layers")
                )
        return logits, addresses

    return stream


def whisper_streams(device: str, streams: int):
    torch.manual_seed(0)
    config = WhisperConfig(
        vocab_size=64,
        d_model=32,
        encoder_layers=1,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_mel_bins=8,
        max_source_positions=ENCODER_FRAMES,
        max_target_positions=32,
        attn_implementation="sdpa",
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    model = WhisperForConditionalGeneration(config).eval().to(device)
    stream = encoder_decoder_stream(config, device, decoder_position_ids=lambda t: torch.arange(t, t + STEP, device=device)[None])
    return streamed(model, *encoder_decoder("whisper_decoder"), stream, streams)


def test_a_whisper_decoder_streams_with_an_encoder_decoder_cache():
    _, report = whisper_streams("cpu", streams=2)
    op = report.operators["decoder_step"]
    # the first call (nothing cached) is refused: traced, transformers takes another mask path
    # (verification: program, op 3: aten.native_layer_norm against aten.arange); it runs the stock
    # code in both streams, whose retained state (self- and cross-attention, 10 sites) is adopted
    assert op.counters.as_dict() == {
        "calls": 8,
        "graph_calls": 7,
        "verified": 3,
        "stock": 2,
        "adopted": 20,
        "evicted": 8,
        "stock_by_reason": {"verification": 1, "refused": 1},
    }
    assert_replay_counters(report, WHISPER_CLASSES, streams=2, device="cpu", may_refuse=frozenset({FIRST}))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_a_whisper_decoder_replays_every_call_after_its_class_is_verified_on_cuda():
    _, report = whisper_streams("cuda", CUDA_STREAMS)
    assert_replay_counters(report, WHISPER_CLASSES, CUDA_STREAMS, "cuda", may_refuse=frozenset({FIRST}))


SEQ2SEQ = {  # 2 decoder layers (and 2 encoder layers: `DynamicCache(config=)` counts T5's from `num_layers`), 4 heads of 8
    "bart": lambda: transformers.BartForConditionalGeneration(
        transformers.BartConfig(
            vocab_size=64,
            d_model=32,
            encoder_layers=1,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=64,
            attn_implementation="sdpa",
        )
    ),
    # relative position buckets, from the cache's length: each class (one length) exports its own
    "t5": lambda: transformers.T5ForConditionalGeneration(
        transformers.T5Config(
            vocab_size=64,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            decoder_start_token_id=0,
            pad_token_id=0,
        )
    ),
}


@pytest.mark.parametrize("family", sorted(SEQ2SEQ))
def test_bart_and_t5_decoders_bind_as_whisper_does(family):
    torch.manual_seed(0)
    model = SEQ2SEQ[family]().eval()
    _, report = streamed(model, *encoder_decoder(family), encoder_decoder_stream(model.config, "cpu"), streams=2)
    # Without positions passed, every class is refused: traced, BART's positions (aten.arange against
    # the stock call's aten.ones) and T5's (aten.arange where the stock call runs aten.pow) take
    # another code path (verification: program); every call runs the stock code, exact.
    assert report.operators["decoder_step"].counters.as_dict() == {
        "calls": 8,
        "graph_calls": 4,
        "verified": 0,
        "stock": 8,
        "adopted": 56,
        "evicted": 8,
        "stock_by_reason": {"verification": 4, "refused": 4},
    }
    assert_replay_counters(report, WHISPER_CLASSES, streams=2, device="cpu", may_refuse=frozenset(WHISPER_CLASSES))


def test_a_digit_segment_names_a_mapping_s_int_key_when_it_has_no_such_string_key():
    """Bug (fixed in binding.py `_key`): Whisper's `EncoderDecoderCache.is_updated` is keyed by layer
    index, and `cache.is_updated.0` looked up the string "0": KeyError."""
    flags = {0: False, 1: True}
    roots = {"cache": SimpleNamespace(is_updated=flags, named={"0": "the string key", 0: "the int key"})}
    assert list(resolve(roots["cache"], "cache.is_updated.1")) == [((), "cache.is_updated.1", True)]
    assert get_path(roots, "cache.named.0") == "the string key"  # a string key the mapping has comes first
    set_path(roots, "cache.is_updated.0", True)
    assert flags == {0: True, 1: True}


def test_a_stream_past_the_bound_runs_the_stock_code_instead_of_overflowing_the_carry():
    """Bug (fixed in pipeline/state.py `carry_view`): a call outside the catalog runs the stock code, whose
    retained state is then taken into the carries; when the stock code retained more than the
    carry's bound (full attention past N, or a prompt longer than the window) the adoption raised
    `CarryError: kv: 12 units exceed the carry's bound 10` and the stream died."""
    model, config = qwen3()
    tokens, sizes = random_tokens(12), [STEP] * 6
    expected, _ = stream_dynamic(model, config, tokens, sizes)
    bound, report = transform(model, kv_contract("qwen3_full", 2, 2, tokens=8), DYNAMIC_CACHE)
    assert exact(stream_dynamic(bound, config, tokens, sizes)[0], expected)
    assert exact(stream_dynamic(bound, config, tokens, sizes)[0], expected)
    op = report.operators["decoder_step"]
    assert [cls.name for cls in op.classes.values()] == [f"decoder_step[n=2,L={e}]" for e in (0, 2, 4, 6, 8)]
    # the call at L=10 of each stream is no class (the window keeps at most 8 + 2): stock; the first
    # call is refused (verification: program, transformers' traced position path) in each stream
    assert op.counters.as_dict() == {
        "calls": 12,
        "graph_calls": 9,
        "verified": 4,
        "stock": 4,
        "adopted": 8,
        "stock_by_reason": {"verification": 1, "refused": 1, "not_in_catalog": 2},
    }


GEMMA_WINDOW = 5  # a sliding layer's cache keeps its last GEMMA_WINDOW - 1 tokens
GEMMA_CLASSES = {f"decoder_step[n=2,L={e}]": 1 for e in (0, 2, 4, 6, 8, 10)}  # 6 calls a stream, one per class


def gemma3_streams(device: str, streams: int):
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        num_hidden_layers=4, sliding_window=GEMMA_WINDOW, layer_types=["sliding_attention", "full_attention"] * 2, **TINY
    )
    model = Gemma3ForCausalLM(config).eval().to(device)
    tokens, sizes = random_tokens(12, device), [STEP] * 6
    contract = Contract(
        family="gemma3_hybrid",
        clocks=(Clock("token", ClockKind.TOKENS), Clock("call", ClockKind.CALLS)),
        rates=(Rate("token", "call", STEP, name="tokens_per_call"),),
        quantities={"layers": 2, "kv_heads": 2, "head_dim": 8},  # of each kind
        regions=(
            Region(
                "kv_full",
                dims=KV_DIMS,
                axis=4,
                clock="token",
                stride=STEP,
                dtype="float32",
                lifetime=Lifetime.PER_STREAM,
                retention=SlidingWindow(window=12),
            ),
            Region(
                "kv_sliding",
                dims=KV_DIMS,
                axis=4,
                clock="token",
                stride=STEP,
                dtype="float32",
                lifetime=Lifetime.PER_STREAM,
                retention=SlidingWindow(window=GEMMA_WINDOW - 1),
            ),
        ),
        operators=(Operator("decoder_step", "kv_full", steady=STEP),),
        admission=Admission("token", max_per_call=STEP),
        interactivity=Interactivity(stages=("decoder",)),
    )
    binding = Binding(
        regions=(
            RegionBinding("kv_full", at=("cache.layers.[1::2].keys", "cache.layers.[1::2].values")),
            RegionBinding("kv_sliding", at=("cache.layers.[0::2].keys", "cache.layers.[0::2].values")),
        ),
        operators=(
            OperatorBinding(
                "decoder_step",
                units=("input_ids", 1),
                counters=("cache.layers.*.is_initialized", "cache.layers.[0::2].cumulative_length"),
            ),
        ),
        verify=1,
    )
    return streamed(model, contract, binding, lambda m: stream_dynamic(m, config, tokens, sizes), streams)


def test_gemma3_hybrid_layers_stream_on_the_exported_steps_while_the_sliding_layers_fill():
    """Bug (fixed in pipeline/export.py `capture_class`): sliding and full layers are two regions; the operator's
    region (the full layers') decides the class, and the pipeline declared every other region at its
    whole window, so while the sliding layers were still filling (L=0, L=2) the window pass refused
    the class (`cache.layers.0.keys: slice_5 has extent 2, the catalog class declares 4`) and those
    calls ran the stock code. The other region's extent is the one the call brings. L=2 (the
    sliding layers still filling) runs its exported step; L=0 is refused for another reason (below)."""
    _, report = gemma3_streams("cpu", streams=2)
    op = report.operators["decoder_step"]
    # The first call (nothing cached) is refused: traced, transformers takes another position path
    # (verification: program, op 2), in each stream. The other classes are verified once each.
    assert {cls.name: cls.refused is None for cls in op.classes.values()} == {name: name != FIRST for name in GEMMA_CLASSES}
    assert op.counters.as_dict() == {
        "calls": 12,
        "graph_calls": 11,
        "verified": 5,
        "stock": 2,
        "adopted": 16,
        "evicted": 8,
        "stock_by_reason": {"verification": 1, "refused": 1},
    }
    assert_replay_counters(report, GEMMA_CLASSES, streams=2, device="cpu", may_refuse=FIRSTS)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_gemma3_hybrid_layers_replay_every_call_after_its_class_is_verified_on_cuda():
    # as on the CPU: the first call refused, in every stream
    _, report = gemma3_streams("cuda", CUDA_STREAMS)
    assert_replay_counters(report, GEMMA_CLASSES, CUDA_STREAMS, "cuda", may_refuse=FIRSTS)


def test_a_host_flag_the_binding_leaves_out_is_guarded_and_the_stream_stays_exact():
    """Bug (fixed in pipeline/verify.py `verify_class`): a binding without `cache.layers.*.is_initialized`
    verified every class, since the verified stock calls set the flag on the caller's cache. A
    later stream then ran its first call through the graph, which sets no flag; its next stock call
    (a 1-token call, no class) found the flag False, re-initialised the layer and dropped the
    retained tokens: wrong logits, silently. A host value the stock call moves and the binding
    leaves out now refuses the class, saying which."""
    model, config = gpt2()
    tokens, sizes = random_tokens(7), [STEP, STEP, STEP, 1]
    expected, _ = stream_dynamic(model, config, tokens, sizes)
    binding = Binding(
        regions=DYNAMIC_CACHE.regions, operators=(OperatorBinding("decoder_step", units=("input_ids", 1)),), verify=1
    )
    bound, report = transform(model, kv_contract("gpt2", 2, 4, tokens=8), binding)
    assert exact(stream_dynamic(bound, config, tokens, sizes)[0], expected)
    assert exact(stream_dynamic(bound, config, tokens, sizes)[0], expected)
    op = report.operators["decoder_step"]
    # The first class is refused; its program differs before the flag is compared: traced,
    # transformers takes another mask path (op 3: the stock call ran aten.native_layer_norm, the
    # graph runs aten.arange). The flag it moves is now guarded (docs/contract.md, "The guarantee").
    refused = {cls.name: cls.refused for cls in op.classes.values()}
    assert list(refused) == ["decoder_step[n=2,L=0]", "decoder_step[n=2,L=2]", "decoder_step[n=2,L=4]"]
    assert refused["decoder_step[n=2,L=0]"].startswith(
        "verification: program: the exported step is not the program the stock call runs: op 3: the stock call ran "
        "aten.native_layer_norm.default("
    )
    assert refused["decoder_step[n=2,L=2]"] is None and refused["decoder_step[n=2,L=4]"] is None
    # the refused first call ran its graph beside the stock call once; every stock call's retained
    # state (4 sites) is then taken into the carries
    assert op.counters.as_dict() == {
        "calls": 8,
        "graph_calls": 5,
        "verified": 2,
        "stock": 4,
        "adopted": 16,
        "evicted": 4,
        "stock_by_reason": {"verification": 1, "refused": 1, "not_in_catalog": 2},
    }


def test_a_contract_shape_the_first_call_contradicts_is_an_error_naming_the_site():
    """Bug (fixed in pipeline/export.py `capture_class`): with no state yet the first call's shapes went
    unchecked, and a contract declaring 2 heads where GPT-2 keeps 4 failed inside the graph with
    `RuntimeError: The size of tensor a (2) must match the size of tensor b (4) at non-singleton
    dimension 1` (from passes/carry.py). It now fails as a later call's state would: naming the
    site, what it holds and what the contract declares."""
    model, config = gpt2()
    bound, _ = transform(model, kv_contract("gpt2", 2, 2, tokens=8), DYNAMIC_CACHE)
    with pytest.raises(ValueError) as error:
        stream_dynamic(bound, config, random_tokens(2), [STEP])
    assert str(error.value) == (
        "decoder_step: after the call cache.layers.0.keys holds torch.float32 (1, 4, 2, 8), "
        "the contract declares torch.float32 (1, 2) x extent x (8,)"
    )


def test_a_counter_path_the_state_does_not_have_is_a_binding_error_naming_the_counter():
    """Error quality (fixed in pipeline/state.py `counter_paths`): the byom example's Mistral counters on
    a full-attention cache, whose `DynamicLayer` has no `cumulative_length`, failed at the first
    call with a bare `AttributeError: 'DynamicLayer' object has no attribute 'cumulative_length'`
    from deep in binding.resolve; it now names the binding field and the path."""
    model, config = qwen3()
    binding = Binding(
        regions=DYNAMIC_CACHE.regions,
        operators=(
            OperatorBinding(
                "decoder_step",
                units=("input_ids", 1),
                counters=("cache.layers.*.cumulative_length", "cache.layers.*.is_initialized"),
            ),
        ),
    )
    bound, _ = transform(model, kv_contract("qwen3_full", 2, 2, tokens=8), binding)
    with pytest.raises(BindingError) as error:
        stream_dynamic(bound, config, random_tokens(2), [STEP])
    assert str(error.value) == (
        "binding.operators[0].counters[0]: 'cache.layers.*.cumulative_length' does not resolve "
        "on this call's arguments: 'DynamicLayer' object has no attribute 'cumulative_length'"
    )


MAMBA_KERNEL, MAMBA_STATE, MAMBA_INNER = 4, 8, 64
# Each stream's first call meets a cache not allocated yet (no class: stock), then 5 of one class.
MAMBA_CLASSES = {f"decoder_step[n=2,L={MAMBA_KERNEL}]": 5}


def mamba_streams(device: str, streams: int):
    """A recurrent model: each layer keeps a causal convolution's last MAMBA_KERNEL inputs and a
    selective-scan state of fixed size, both allocated at the first call and written in place
    (`copy_`) by every later one (transformers' `LinearAttentionLayer`, keyed by state index 0).
    The convolution's window is a RingCache along the tokens; the scan state has no time axis, so
    it is an InPlace region (one fixed shape, no clock). Neither shape ever changes: the carry is
    the state itself."""
    torch.manual_seed(0)
    config = MambaConfig(
        vocab_size=64, hidden_size=32, state_size=MAMBA_STATE, num_hidden_layers=2, expand=2, conv_kernel=MAMBA_KERNEL
    )
    model = MambaForCausalLM(config).eval().to(device)
    tokens = random_tokens(12, device)

    def stream(m):
        cache, logits, addresses = DynamicCache(config=config), [], []
        with torch.no_grad():
            for t in range(0, tokens.shape[1], STEP):
                logits.append(m(input_ids=tokens[:, t : t + STEP], cache=cache, use_cache=True).logits)
                addresses.append(
                    {
                        f"cache.layers.{i}.{kind}.0": getattr(layer, kind)[0].data_ptr()
                        for i, layer in enumerate(cache.layers)
                        for kind in ("conv_states", "recurrent_states")
                    }
                )
        return logits, addresses

    contract = Contract(
        family="mamba",
        clocks=(Clock("token", ClockKind.TOKENS), Clock("call", ClockKind.CALLS)),
        rates=(Rate("token", "call", STEP, name="tokens_per_call"),),
        quantities={"layers": 2, "inner": MAMBA_INNER, "state": MAMBA_STATE},
        regions=(
            Region(
                "conv",
                dims=("layers", 1, "inner", "token"),
                axis=3,
                clock="token",
                stride=STEP,
                dtype="float32",
                lifetime=Lifetime.PER_STREAM,
                retention=RingCache(MAMBA_KERNEL),
            ),
            Region(
                "scan", dims=("layers", 1, "inner", "state"), dtype="float32", lifetime=Lifetime.PER_STREAM, retention=InPlace()
            ),
        ),
        operators=(Operator("decoder_step", "conv", steady=STEP),),
        admission=Admission("token", max_per_call=STEP),
        interactivity=Interactivity(stages=("decoder",)),
    )
    binding = Binding(
        regions=(
            RegionBinding("conv", at=("cache.layers.*.conv_states.0",)),
            RegionBinding("scan", at=("cache.layers.*.recurrent_states.0",)),
        ),
        operators=(OperatorBinding("decoder_step", units=("input_ids", 1)),),
        verify=1,
    )
    return streamed(model, contract, binding, stream, streams)


def test_a_mamba_decoder_streams_its_fixed_size_states_in_place():
    _, report = mamba_streams("cpu", streams=2)
    op = report.operators["decoder_step"]
    # the first call of each stream runs stock and allocates the states; its 4 tensors are adopted
    # (the first stream's states are copied out when the second stream's first call makes its own: 4)
    assert op.counters.as_dict() == {
        "calls": 12,
        "graph_calls": 10,
        "verified": 1,
        "stock": 2,
        "adopted": 8,
        "evicted": 4,
        "stock_by_reason": {"not_in_catalog": 2},
    }
    assert [(s.kind, s.rewritten) for s in report.sites] == [("ring", False)] * 4
    assert_replay_counters(report, MAMBA_CLASSES, streams=2, device="cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_a_mamba_decoder_replays_every_steady_call_after_the_first_on_cuda():
    _, report = mamba_streams("cuda", CUDA_STREAMS)
    assert_replay_counters(report, MAMBA_CLASSES, CUDA_STREAMS, "cuda")


def deepseek_v3():
    """DeepSeek-V3 (tiny), its contract and binding: (model, config, contract, binding)."""
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=4,
        qk_nope_head_dim=8,
        v_head_dim=8,
        max_position_embeddings=128,
        attn_implementation="sdpa",
    )
    model = transformers.DeepseekV3ForCausalLM(config).eval()

    def region(name: str, width: str) -> Region:
        return Region(
            name,
            dims=("layers", 1, 1, "token", width),
            axis=3,
            clock="token",
            stride=STEP,
            dtype="float32",
            lifetime=Lifetime.PER_STREAM,
            retention=SlidingWindow(window=12),
        )

    contract = Contract(
        family="deepseek_v3",
        clocks=(Clock("token", ClockKind.TOKENS), Clock("call", ClockKind.CALLS)),
        rates=(Rate("token", "call", STEP, name="tokens_per_call"),),
        quantities={"layers": 2, "latent": 16, "rope": 4},
        regions=(region("latent", "latent"), region("rope_keys", "rope")),
        operators=(Operator("decoder_step", "latent", steady=STEP),),
        admission=Admission("token", max_per_call=STEP),
        interactivity=Interactivity(stages=("decoder",)),
    )
    binding = Binding(
        regions=(RegionBinding("latent", at=("cache.layers.*.keys",)), RegionBinding("rope_keys", at=("cache.layers.*.values",))),
        operators=(OperatorBinding("decoder_step", units=("input_ids", 1), counters=("cache.layers.*.is_initialized",)),),
        verify=1,
    )
    return model, config, contract, binding


def test_deepseek_v3_latent_attention_binds_its_two_cache_widths_as_two_regions():
    """DeepSeek-V3's multi-head latent attention caches one compressed latent (its `keys`, 16 wide)
    and one rotary key (its `values`, 4 wide) per layer: two regions of their own widths, one
    operator, the stream bit-identical (a mixture of experts after the first layer, too)."""
    model, config, contract, binding = deepseek_v3()
    tokens, sizes = random_tokens(12), [STEP] * 6
    _, report = streamed(model, contract, binding, lambda m: stream_dynamic(m, config, tokens, sizes), streams=2)
    # Every class is refused (verification: program): the first, traced, takes another position path;
    # the others' mixture of experts runs `aten._grouped_mm` in the stock call, transformers'
    # `grouped_mm_fallback` traced. Every call runs the stock code, exact.
    assert report.operators["decoder_step"].counters.as_dict() == {
        "calls": 12,
        "graph_calls": 6,
        "verified": 0,
        "stock": 12,
        "adopted": 48,
        "evicted": 4,
        "stock_by_reason": {"verification": 6, "refused": 6},
    }
    assert sorted(report.carries) == ["latent", "rope_keys"]
    # each at its own width, 12 retained tokens plus the call's 2 (the region holds the call's units)
    assert report.carries["latent"].buffer.shape == (2, 1, 1, 14, 16)
    assert report.carries["rope_keys"].buffer.shape == (2, 1, 1, 14, 4)


JAMBA_COUNTERS = (
    "cache.layers.[1::2].is_initialized",
    "cache.layers.[0::2].is_conv_states_initialized",
    "cache.layers.[0::2].is_recurrent_states_initialized",
    "cache.layers.[0::2].has_previous_state",
    "cache.layers.[0::2].conv_kernel_size",
)


def jamba_streams(counters: tuple[str, ...] = JAMBA_COUNTERS, streams: int = 2):
    """A hybrid decoder: transformers' Jamba, Mamba layers (even) and attention layers (odd) in one
    `DynamicCache`. Three regions in one binding: the attention layers' keys and values a growing
    `SlidingWindow(window=N)` (Qwen3's), the Mamba layers' convolution and scan states `RingCache`s
    (Mamba's), each reached by a slice of `cache.layers`; the host values their first call sets
    bound as counters."""
    torch.manual_seed(0)
    config = transformers.JambaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=100,
        expert_layer_offset=99,
        num_experts=1,
        mamba_d_state=4,
        mamba_d_conv=4,
        mamba_expand=2,
        max_position_embeddings=128,
        attn_implementation="sdpa",
    )
    model = transformers.JambaForCausalLM(config).eval()
    tokens = random_tokens(12)

    def stream(m):
        cache, logits, addresses = DynamicCache(config=config), [], []
        with torch.no_grad():
            for t in range(0, tokens.shape[1], STEP):
                logits.append(m(input_ids=tokens[:, t : t + STEP], cache=cache, use_cache=True).logits)
                where = {}
                for i, layer in enumerate(cache.layers):
                    if i % 2:
                        where |= {f"cache.layers.{i}.{kind}": getattr(layer, kind).data_ptr() for kind in ("keys", "values")}
                    else:
                        where |= {
                            f"cache.layers.{i}.{kind}.0": getattr(layer, kind)[0].data_ptr()
                            for kind in ("conv_states", "recurrent_states")
                        }
                addresses.append(where)
        return logits, addresses

    contract = Contract(
        family="jamba",
        clocks=(Clock("token", ClockKind.TOKENS), Clock("state", ClockKind.TOKENS), Clock("call", ClockKind.CALLS)),
        rates=(Rate("token", "call", STEP, name="tokens_per_call"),),
        quantities={"attention_layers": 2, "mamba_layers": 2, "kv_heads": 2, "head_dim": 8, "inner": 64},
        regions=(
            Region(
                "kv",
                dims=("attention_layers", 2, 1, "kv_heads", "token", "head_dim"),
                axis=4,
                clock="token",
                stride=STEP,
                dtype="float32",
                lifetime=Lifetime.PER_STREAM,
                retention=SlidingWindow(window=12),
            ),
            Region(
                "conv",
                dims=("mamba_layers", 1, "inner", "token"),
                axis=3,
                clock="token",
                stride=STEP,
                dtype="float32",
                lifetime=Lifetime.PER_STREAM,
                retention=RingCache(4),
            ),
            Region(
                "scan",
                dims=("mamba_layers", 1, "inner", "state"),
                axis=3,
                clock="state",
                stride=1,
                dtype="float32",
                lifetime=Lifetime.PER_STREAM,
                retention=RingCache(4),
            ),
        ),
        operators=(Operator("decoder_step", "kv", steady=STEP),),
        admission=Admission("token", max_per_call=STEP),
        interactivity=Interactivity(stages=("decoder",)),
    )
    binding = Binding(
        regions=(
            RegionBinding("kv", at=("cache.layers.[1::2].keys", "cache.layers.[1::2].values")),
            RegionBinding("conv", at=("cache.layers.[0::2].conv_states.0",)),
            RegionBinding("scan", at=("cache.layers.[0::2].recurrent_states.0",)),
        ),
        operators=(OperatorBinding("decoder_step", units=("input_ids", 1), counters=counters),),
        verify=1,
    )
    return streamed(model, contract, binding, stream, streams=streams)


JAMBA_COUNTS = {
    "calls": 12,
    "graph_calls": 11,
    "verified": 5,
    "stock": 2,
    "adopted": 20,
    "evicted": 8,
    "stock_by_reason": {"verification": 1, "refused": 1},
}
JAMBA_REFUSAL = (
    "decoder_step[n=2,L=0]: refused, verification: program: the exported step is not the program the stock "
    "call runs: op 3: the stock call ran aten.pow.Tensor_Scalar("
)


def test_a_hybrid_attention_and_mamba_decoder_refuses_its_first_call_and_streams_three_regions_on_the_exported_steps():
    """The first call (nothing cached) is refused: traced, transformers takes another code path
    ("verification: program: ... op 3: the stock call ran aten.pow, the graph runs aten.arange");
    it runs the stock code in both streams, and its sites (the Mamba layers' states it allocates
    too) are adopted into the carries. Every other class streams its three regions on its exported
    step, verified once."""
    _, report = jamba_streams()
    assert report.operators["decoder_step"].counters.as_dict() == JAMBA_COUNTS
    (refusal,) = [stamp for stamp in report.stamps if "refused" in stamp]
    assert refusal.startswith(JAMBA_REFUSAL)
    assert_replay_counters(report, QWEN3_CLASSES, streams=2, device="cpu", may_refuse=frozenset({FIRST}))


def test_a_host_value_the_first_call_sets_and_the_binding_leaves_out_is_guarded_and_streams_as_when_declared():
    """Without `conv_kernel_size` in the binding (the first call sets it, None -> 4), the value is
    guarded like every host value the state reaches: each class is captured at the value it meets
    (None at the first call, 4 after), so no variant is made and the counters are those of the
    binding that declares it. The only refusal is the first call's, whose export takes another
    code path (verification: program, op 3), not the host value."""
    _, report = jamba_streams(JAMBA_COUNTERS[:-1])  # without `conv_kernel_size`, which the first call sets
    assert report.operators["decoder_step"].counters.as_dict() == JAMBA_COUNTS
    (refusal,) = [stamp for stamp in report.stamps if "refused" in stamp]
    assert refusal.startswith(JAMBA_REFUSAL)
    assert_replay_counters(report, QWEN3_CLASSES, streams=2, device="cpu", may_refuse=frozenset({FIRST}))


CONF_DIM, CONF_HEADS, CONF_HEAD_DIM, CONF_KERNEL, CONF_WINDOW = 16, 2, 8, 3, 4


class ConformerBlock(nn.Module):
    """A streaming conformer block with a functional step: the depthwise convolution's last
    CONF_KERNEL - 1 frames and the attention's keys and values (stacked, concatenated then trimmed
    to CONF_WINDOW frames) come in as arguments and go back out as results."""

    def __init__(self):
        super().__init__()
        self.ff, self.qkv, self.out = (
            nn.Linear(CONF_DIM, CONF_DIM),
            nn.Linear(CONF_DIM, 3 * CONF_DIM),
            nn.Linear(CONF_DIM, CONF_DIM),
        )
        self.depthwise = nn.Conv1d(CONF_DIM, CONF_DIM, CONF_KERNEL, groups=CONF_DIM)
        self.pointwise, self.norm = nn.Linear(CONF_DIM, CONF_DIM), nn.LayerNorm(CONF_DIM)

    def forward(self, x, conv_cache, kv_cache=None):
        x = x + 0.5 * torch.tanh(self.ff(x))
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, CONF_HEADS, CONF_HEAD_DIM).permute(2, 0, 3, 1, 4)
        kv = torch.stack([k, v])
        if kv_cache is not None:
            kv = torch.cat([kv_cache, kv], dim=3)
        past = kv.shape[3] - t
        mask = torch.arange(kv.shape[3], device=x.device)[None, :] <= (past + torch.arange(t, device=x.device))[:, None]
        attended = torch.nn.functional.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask)
        x = x + self.out(attended.transpose(1, 2).reshape(b, t, CONF_DIM))
        full = torch.cat([conv_cache, x.transpose(1, 2)], dim=2)
        x = x + self.pointwise(self.depthwise(full).transpose(1, 2))
        return self.norm(x), full[:, :, -(CONF_KERNEL - 1) :], kv[:, :, :, -CONF_WINDOW:]


# 6 calls a stream: the window fills in two calls, then 4 of the steady class
CONFORMER_CLASSES = {"block_step[n=2,L=0]": 1, "block_step[n=2,L=2]": 1, "block_step[n=2,L=4]": 4}


def conformer_streams(device: str, streams: int):
    torch.manual_seed(0)
    model = ConformerBlock().eval().to(device)
    frames = torch.randn(1, 6 * STEP, CONF_DIM, generator=torch.Generator().manual_seed(1)).to(device)

    def stream(m):
        conv, kv, outputs = torch.zeros(1, CONF_DIM, CONF_KERNEL - 1, device=device), None, []
        with torch.no_grad():
            for t in range(0, frames.shape[1], STEP):
                y, conv, kv = m(frames[:, t : t + STEP], conv, kv)
                outputs.append(y)
        return outputs + [conv, kv]  # the state as returned last (see `streamed_returning`)

    contract = Contract(
        family="conformer_block",
        clocks=(Clock("frame", ClockKind.FRAMES), Clock("call", ClockKind.CALLS)),
        rates=(Rate("frame", "call", STEP, name="frames_per_call"),),
        quantities={"channels": CONF_DIM, "heads": CONF_HEADS, "head_dim": CONF_HEAD_DIM},
        regions=(
            Region(
                "kv",
                dims=(2, 1, "heads", "frame", "head_dim"),
                axis=3,
                clock="frame",
                stride=STEP,
                dtype="float32",
                lifetime=Lifetime.PER_STREAM,
                retention=SlidingWindow(window=CONF_WINDOW),
            ),
            Region(
                "conv",
                dims=(1, "channels", "frame"),
                axis=2,
                clock="frame",
                stride=STEP,
                dtype="float32",
                lifetime=Lifetime.PER_STREAM,
                retention=SlidingWindow(window=CONF_KERNEL - 1, initial=CONF_KERNEL - 1),
                holds_call=False,
            ),
        ),
        operators=(Operator("block_step", "kv", steady=STEP),),
        admission=Admission("frame", max_per_call=STEP),
        interactivity=Interactivity(stages=("encoder",)),
    )
    binding = Binding(
        regions=(
            RegionBinding("kv", at=("kv_cache",), out=("return.2",)),
            RegionBinding("conv", at=("conv_cache",), out=("return.1",)),
        ),
        operators=(OperatorBinding("block_step", units=("x", 1)),),
        verify=1,
    )
    return streamed_returning(model, contract, binding, stream, streams)


def test_a_functional_conformer_block_streams_both_caches_through_its_returned_state():
    _, report = conformer_streams("cpu", streams=2)
    op = report.operators["block_step"]
    # each stream's fresh zero convolution context is taken into its carry once
    assert op.counters.as_dict() == {
        "calls": 12,
        "graph_calls": 12,
        "verified": 3,
        "stock": 0,
        "adopted": 2,
        "stock_by_reason": {},
    }
    assert_replay_counters(report, CONFORMER_CLASSES, streams=2, device="cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_a_functional_conformer_block_replays_every_call_after_its_class_is_verified_on_cuda():
    _, report = conformer_streams("cuda", CUDA_STREAMS)
    assert_replay_counters(report, CONFORMER_CLASSES, CUDA_STREAMS, "cuda")


LSTM_INPUT, LSTM_HIDDEN, LSTM_LAYERS = 8, 16, 2


class LstmStep(nn.Module):
    """A streaming step on an `nn.LSTM`: its hidden state `(h, c)` is passed in (None at first) and returned."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(LSTM_INPUT, LSTM_HIDDEN, LSTM_LAYERS, batch_first=True)
        self.head = nn.Linear(LSTM_HIDDEN, LSTM_INPUT)

    def forward(self, x, state=None):
        y, (h, c) = self.lstm(x, state)
        return self.head(y), (h, c)


# Each stream's first call (no state yet: extent 0) is no class: stock; then 5 of one class.
LSTM_CLASSES = {f"lstm_step[n=2,L={LSTM_HIDDEN}]": 5}


def lstm_streams(device: str, streams: int):
    """The hidden state has no time axis. As Mamba's scan state, its contract names a clock of its
    own for the hidden dimension (`state`), a fixed-size RingCache region; this region is also the
    operator's (there is no other), whose steady call is counted in the admission's clock, so the
    contract needs a rate from `state` to `frame` as well (1: any rate converts)."""
    torch.manual_seed(0)
    model = LstmStep().eval().to(device)
    frames = torch.randn(1, 6 * STEP, LSTM_INPUT, generator=torch.Generator().manual_seed(1)).to(device)

    def stream(m):
        state, outputs = None, []
        with torch.no_grad():
            for t in range(0, frames.shape[1], STEP):
                y, state = m(frames[:, t : t + STEP], state)
                outputs.append(y)
        return outputs + list(state)

    contract = Contract(
        family="lstm",
        clocks=(Clock("frame", ClockKind.FRAMES), Clock("state", ClockKind.FRAMES), Clock("call", ClockKind.CALLS)),
        rates=(Rate("frame", "call", STEP, name="frames_per_call"), Rate("state", "frame", 1)),
        quantities={"layers": LSTM_LAYERS},
        regions=(
            Region(
                "hidden",
                dims=(2, "layers", 1, "state"),
                axis=3,
                clock="state",
                stride=STEP,
                dtype="float32",
                lifetime=Lifetime.PER_STREAM,
                retention=RingCache(LSTM_HIDDEN),
            ),
        ),
        operators=(Operator("lstm_step", "hidden", steady=STEP),),
        admission=Admission("frame", max_per_call=STEP),
        interactivity=Interactivity(stages=("encoder",)),
    )
    binding = Binding(
        regions=(RegionBinding("hidden", at=("state.0", "state.1"), out=("return.1.0", "return.1.1")),),
        operators=(OperatorBinding("lstm_step", units=("x", 1)),),
        verify=1,
    )
    return streamed_returning(model, contract, binding, stream, streams)


def test_an_lstm_step_streams_its_hidden_state_tuple_as_a_ring():
    """Bug (fixed in binding.py `set_path`): a site inside a tuple (`state.0`, the LSTM's `h`) could
    not be written (`AttributeError: 'tuple' object has no attribute '0'`): the export refused the
    class, and the stock fallback, which puts clones of the state in place, crashed the stream. A
    tuple is now rebuilt with the element replaced, in its parent's place."""
    _, report = lstm_streams("cpu", streams=2)
    op = report.operators["lstm_step"]
    # the step returns new tensors: each call's returned (h, c) is copied into the carries at the next
    # call; each stream's first call passes state=None: no sites to count, stock (`no_state_yet`)
    assert op.counters.as_dict() == {
        "calls": 12,
        "graph_calls": 10,
        "verified": 1,
        "stock": 2,
        "adopted": 20,
        "stock_by_reason": {"no_state_yet": 2},
    }
    assert [(s.kind, s.rewritten) for s in report.sites] == [("ring", False)] * 2
    assert_replay_counters(report, LSTM_CLASSES, streams=2, device="cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_an_lstm_step_replays_every_steady_call_after_the_first_on_cuda():
    _, report = lstm_streams("cuda", CUDA_STREAMS)
    assert_replay_counters(report, LSTM_CLASSES, CUDA_STREAMS, "cuda")


LEGACY_DIM, LEGACY_WINDOW = 16, 4


class LegacyAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(LEGACY_DIM, 3 * LEGACY_DIM), nn.Linear(LEGACY_DIM, LEGACY_DIM)

    def forward(self, x, past):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        mask = torch.arange(k.shape[2], device=x.device)[None, :] <= (k.shape[2] - t + torch.arange(t, device=x.device))[:, None]
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + self.out(attended.transpose(1, 2).reshape(b, t, LEGACY_DIM)), (
            k[:, :, -LEGACY_WINDOW:],
            v[:, :, -LEGACY_WINDOW:],
        )


class LegacyDecoder(nn.Module):
    """A decoder with the legacy cache: `past_key_values` a tuple of `(keys, values)` per layer, None
    at first, returned (each layer concatenated, then trimmed to its last LEGACY_WINDOW tokens)."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(64, LEGACY_DIM), nn.Linear(LEGACY_DIM, 64)
        self.layers = nn.ModuleList(LegacyAttention() for _ in range(2))

    def forward(self, input_ids, past_key_values=None):
        x, cache = self.embed(input_ids), []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, None if past_key_values is None else past_key_values[i])
            cache.append(kv)
        return self.head(x), tuple(cache)


# Every stream's first call finds past_key_values None: no sites to count, stock (`no_state_yet`);
# then one call at L=2 and four at L=4.
LEGACY_CLASSES = {"decoder_step[n=2,L=2]": 1, "decoder_step[n=2,L=4]": 4}


def legacy_streams(device: str, streams: int):
    torch.manual_seed(0)
    model = LegacyDecoder().eval().to(device)
    tokens = random_tokens(6 * STEP, device)

    def stream(m):
        past, outputs = None, []
        with torch.no_grad():
            for t in range(0, tokens.shape[1], STEP):
                logits, past = m(tokens[:, t : t + STEP], past_key_values=past)
                outputs.append(logits)
        return outputs + [x for kv in past for x in kv]

    contract = kv_contract("legacy_past_key_values", 2, 2, tokens=LEGACY_WINDOW)
    binding = Binding(
        regions=(RegionBinding("kv", at=("past_key_values.*.0", "past_key_values.*.1"), out=("return.1.*.0", "return.1.*.1")),),
        operators=(OperatorBinding("decoder_step", units=("input_ids", 1)),),
        verify=1,
    )
    return streamed_returning(model, contract, binding, stream, streams)


def test_a_legacy_tuple_of_tuples_past_key_values_streams_from_none():
    """Bug (fixed in binding.py `resolve` and pipeline/operator.py `_call`): the first call of a stream passes
    `past_key_values=None`, and the region's paths (`past_key_values.*.0`) could not count their
    sites there: `TypeError: '*' after 'past_key_values' needs a sequence, found NoneType`, the
    stream dead at its first call. A wildcard over None is state not retained yet: until the sites
    can be counted, calls run the stock code (`no_state_yet`)."""
    _, report = legacy_streams("cpu", streams=2)
    op = report.operators["decoder_step"]
    # each stream's first stock call's returned state (4 sites) is taken into the carries at its next call
    assert op.counters.as_dict() == {
        "calls": 12,
        "graph_calls": 10,
        "verified": 2,
        "stock": 2,
        "adopted": 8,
        "stock_by_reason": {"no_state_yet": 2},
    }
    assert_replay_counters(report, LEGACY_CLASSES, streams=2, device="cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_a_legacy_past_key_values_replays_every_call_after_its_class_is_verified_on_cuda():
    _, report = legacy_streams("cuda", CUDA_STREAMS)
    assert_replay_counters(report, LEGACY_CLASSES, CUDA_STREAMS, "cuda")


RWKV_HIDDEN = 32
# Stream 1's first call: no state (None), stock; every stream's first call then finds it None
# (extent 0: no class), stock; 5 calls a stream of the one class.
RWKV_CLASSES = {f"decoder_step[n=2,L={RWKV_HIDDEN}]": 5}


def rwkv_streams(device: str, streams: int):
    """`transformers` RWKV: its `state` is a list of 5 tensors (batch, hidden, layers), None at first,
    made by the first call, written in place by every call and returned as `out.state`. No time
    axis: as Mamba's scan state, a `state` clock of its own (and, the operator's region being this
    one, a rate to the token clock), a RingCache of the hidden size."""
    torch.manual_seed(0)
    config = RwkvConfig(
        vocab_size=64,
        hidden_size=RWKV_HIDDEN,
        num_hidden_layers=2,
        attention_hidden_size=RWKV_HIDDEN,
        intermediate_size=64,
        context_length=64,
    )
    model = RwkvForCausalLM(config).eval().to(device)
    tokens = random_tokens(6 * STEP, device)

    def stream(m):
        state, outputs = None, []
        with torch.no_grad():
            for t in range(0, tokens.shape[1], STEP):
                out = m(input_ids=tokens[:, t : t + STEP], state=state, use_cache=True)
                state = out.state
                outputs.append(out.logits)
        return outputs + list(state)

    contract = Contract(
        family="rwkv",
        clocks=(Clock("token", ClockKind.TOKENS), Clock("state", ClockKind.TOKENS), Clock("call", ClockKind.CALLS)),
        rates=(Rate("token", "call", STEP, name="tokens_per_call"), Rate("state", "token", 1)),
        quantities={"layers": 2},
        regions=(
            Region(
                "state",
                dims=(5, 1, "state", "layers"),
                axis=2,
                clock="state",
                stride=STEP,
                dtype="float32",
                lifetime=Lifetime.PER_STREAM,
                retention=RingCache(RWKV_HIDDEN),
            ),
        ),
        operators=(Operator("decoder_step", "state", steady=STEP),),
        admission=Admission("token", max_per_call=STEP),
        interactivity=Interactivity(stages=("decoder",)),
    )
    binding = Binding(
        regions=(RegionBinding("state", at=("state.*",)),),
        operators=(OperatorBinding("decoder_step", units=("input_ids", 1)),),
        verify=1,
    )
    return streamed_returning(model, contract, binding, stream, streams)


def test_rwkv_streams_its_state_list_in_place_from_none():
    _, report = rwkv_streams("cpu", streams=2)
    op = report.operators["decoder_step"]
    # each stream's state, made by its first (stock) call, is taken into the carries once (5 sites)
    # every stream's first call passes state=None (`no_state_yet`); the first stream's state is copied
    # out (5 sites) when the second stream's is taken in
    assert op.counters.as_dict() == {
        "calls": 12,
        "graph_calls": 10,
        "verified": 1,
        "stock": 2,
        "adopted": 10,
        "evicted": 5,
        "stock_by_reason": {"no_state_yet": 2},
    }
    assert [(s.kind, s.rewritten) for s in report.sites] == [("ring", False)] * 5
    assert_replay_counters(report, RWKV_CLASSES, streams=2, device="cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_rwkv_replays_every_steady_call_after_the_first_on_cuda(monkeypatch):
    # With ninja, transformers builds its own WKV kernel (a C++ extension torch.export cannot trace)
    # when the model is made; without it, the model runs its torch implementation, which exports.
    monkeypatch.setattr(modeling_rwkv, "is_ninja_available", lambda: False)
    monkeypatch.setattr(modeling_rwkv, "rwkv_cuda_kernel", None)
    _, report = rwkv_streams("cuda", CUDA_STREAMS)
    assert_replay_counters(report, RWKV_CLASSES, CUDA_STREAMS, "cuda")


CODEC_CHANNELS = 8


@dataclass
class DecodeOutput:
    audio: torch.Tensor
    context: torch.Tensor


pytree.register_dataclass(DecodeOutput)  # what the refusal below asks for


@dataclass
class OpaqueDecodeOutput:  # the same, not registered with torch's pytree
    audio: torch.Tensor
    context: torch.Tensor


class CodecDecoder(nn.Module):
    """A codec's decoder whose hot operator is `decode_step`, not `forward`, taking keyword-only
    arguments and returning a dataclass that holds the new state (a causal conv's left context)."""

    def __init__(self, output: type = DecodeOutput):
        super().__init__()
        self.conv = nn.Conv1d(CODEC_CHANNELS, CODEC_CHANNELS, KERNEL)
        self.output = output

    def forward(self, frames: torch.Tensor) -> torch.Tensor:  # the offline path, never streamed
        return torch.tanh(self.conv(frames))

    def decode_step(self, *, frames: torch.Tensor, context: torch.Tensor, gain: float = 1.0):
        full = torch.cat([context, frames], dim=-1)
        return self.output(audio=torch.tanh(self.conv(full)) * gain, context=full[..., -(KERNEL - 1) :])


CODEC_CLASSES = {"decode_step[n=2,L=2]": 6}  # 6 calls a stream, all of one class


def codec_streams(device: str, streams: int, output: type = DecodeOutput):
    torch.manual_seed(0)
    model = CodecDecoder(output).eval().to(device)
    frames = torch.randn(1, CODEC_CHANNELS, 6 * STEP, generator=torch.Generator().manual_seed(1)).to(device)

    def stream(m):
        context, outputs = torch.zeros(1, CODEC_CHANNELS, KERNEL - 1, device=device), []
        with torch.no_grad():
            for t in range(0, frames.shape[-1], STEP):
                out = m.decode_step(frames=frames[..., t : t + STEP], context=context, gain=0.5)
                assert isinstance(out, output)
                context = out.context
                outputs.append(out.audio)
        return outputs + [context]

    contract = Contract(
        family="codec_decoder",
        clocks=(Clock("frame", ClockKind.FRAMES), Clock("call", ClockKind.CALLS)),
        rates=(Rate("frame", "call", STEP, name="frames_per_call"),),
        quantities={"channels": CODEC_CHANNELS},
        regions=(
            Region(
                "context",
                dims=(1, "channels", "frame"),
                axis=2,
                clock="frame",
                stride=STEP,
                dtype="float32",
                lifetime=Lifetime.PER_STREAM,
                retention=SlidingWindow(window=KERNEL - 1, initial=KERNEL - 1),
                holds_call=False,
            ),
        ),
        operators=(Operator("decode_step", "context", steady=STEP),),
        admission=Admission("frame", max_per_call=STEP),
        interactivity=Interactivity(stages=("decoder",)),
    )
    binding = Binding(
        regions=(RegionBinding("context", at=("context",), out=("return.context",)),),
        operators=(OperatorBinding("decode_step", method="decode_step", units=("frames", 2)),),
        verify=1,
    )
    return streamed_returning(model, contract, binding, stream, streams)


def test_a_keyword_only_method_returning_a_registered_dataclass_streams_on_its_graph():
    _, report = codec_streams("cpu", streams=2)
    op = report.operators["decode_step"]
    # each stream's fresh zero context is taken into the carry once
    assert op.counters.as_dict() == {
        "calls": 12,
        "graph_calls": 12,
        "verified": 1,
        "stock": 0,
        "adopted": 2,
        "stock_by_reason": {},
    }
    assert_replay_counters(report, CODEC_CLASSES, streams=2, device="cpu")


def test_a_returned_object_pytree_cannot_flatten_refuses_its_class_saying_how_to_register_it():
    """Bug (fixed in pipeline/step.py `output_structure`): an unregistered dataclass is one pytree leaf, kept
    whole as a host value of the output; every graph call returned the verified call's object,
    its audio and context those of that first call: wrong outputs from the second call on, silently
    (verification saw no tensor to compare). The class is now refused, saying what to do."""
    _, report = codec_streams("cpu", streams=2, output=OpaqueDecodeOutput)
    op = report.operators["decode_step"]
    assert {cls.name: cls.refused for cls in op.classes.values()} == {
        "decode_step[n=2,L=2]": "the call returns an object of type OpaqueDecodeOutput holding tensors, "
        "which torch's pytree does not "
        "flatten; register it (torch.utils._pytree.register_dataclass(OpaqueDecodeOutput) for a "
        "dataclass) or return a tuple, list or dict"
    }
    assert op.counters.stock_by_reason == {"refused": 12}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_a_keyword_only_method_returning_a_dataclass_replays_every_call_after_the_first_on_cuda():
    _, report = codec_streams("cuda", CUDA_STREAMS)
    assert_replay_counters(report, CODEC_CLASSES, CUDA_STREAMS, "cuda")


def test_a_state_clock_no_rate_links_to_the_admission_clock_is_an_error_saying_to_declare_one():
    """Error quality (fixed in contract.py `_check_operators`): an LSTM's hidden state declared as
    Mamba's scan state (a clock of its own) but, having no other region, as the operator's region,
    without a rate to the admission's clock, was refused with `no declared rate converts 'state'
    into 'frame'`, which says neither why the two must convert nor what to declare."""
    with pytest.raises(ContractError) as error:
        Contract(
            family="lstm",
            clocks=(Clock("frame", ClockKind.FRAMES), Clock("state", ClockKind.FRAMES), Clock("call", ClockKind.CALLS)),
            rates=(Rate("frame", "call", STEP, name="frames_per_call"),),
            quantities={"layers": LSTM_LAYERS},
            regions=(
                Region(
                    "hidden",
                    dims=(2, "layers", 1, "state"),
                    axis=3,
                    clock="state",
                    stride=STEP,
                    dtype="float32",
                    lifetime=Lifetime.PER_STREAM,
                    retention=RingCache(LSTM_HIDDEN),
                ),
            ),
            operators=(Operator("lstm_step", "hidden", steady=STEP),),
            admission=Admission("frame", max_per_call=STEP),
            interactivity=Interactivity(stages=("encoder",)),
        )
    assert str(error.value) == (
        "operators[0].steady: no declared rate converts 'state' into 'frame': the call is counted "
        "in the clock of the operator's region 'hidden', the admission in 'frame'; declare a Rate "
        "that links them (rule C1)"
    )


MIMI_CALLS, MIMI_WINDOW = 6, 5  # a sliding layer's cache keeps its last MIMI_WINDOW - 1 tokens
# The encoder's padded convolutions with a left context (padding 2), grouped by channels and rate;
# its two 1x1 convolutions (layers 2 and 5) keep an empty one, left unbound.
# name: (the layers' path, their leading dims, channels, clock)
MIMI_CONVS = {
    "conv_in": ("0", (), 1, "sample"),
    "conv_4": ("[1:4:2]", (2,), 4, "sample"),
    "conv_8": ("[4:7:2]", (2,), 8, "half"),
    "conv_16": ("[7:9]", (2,), 16, "token"),
}
# 6 calls a stream: L=0, L=2, then the steady class L=4 at cumulative_length 4, 6, 8 and 10, a host
# counter guarded by its value (no regime declared): a variant at each (`#2`..`#4`, the most a class has)
MIMI_CLASSES = {
    f"{op}[n=2,L={e}]{variant}": 1
    for op in ("encode", "decode")
    for e, variant in ((0, ""), (2, ""), (4, ""), (4, "#2"), (4, "#3"), (4, "#4"))
}


def mimi() -> tuple[MimiModel, MimiConfig]:
    """transformers' Mimi codec: 8 samples a frame, 2 encoder (and decoder) transformer tokens a frame."""
    torch.manual_seed(0)
    config = MimiConfig(
        hidden_size=16,
        num_filters=4,
        num_residual_layers=1,
        upsampling_ratios=[2, 2],
        kernel_size=3,
        last_kernel_size=3,
        residual_kernel_size=3,
        codebook_size=16,
        codebook_dim=16,
        num_quantizers=2,
        vector_quantization_hidden_dimension=16,
        upsample_groups=16,
        num_hidden_layers=2,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=MIMI_WINDOW,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    return MimiModel(config).eval(), config


def mimi_padding_cache(model: MimiModel) -> MimiConv1dPaddingCache:
    """The padding cache as `MimiEncoderModel.forward` makes it, but with each layer's padding an int:
    the model's own holds its 0-d buffers, and `update` branches on `padding > 0`."""
    encoder = model.encoder
    convs = [encoder.encoder_seanet.get_submodule(name) for name in encoder.encoder_seanet._conv1d_layer_names]
    convs.append(encoder.downsample)
    return MimiConv1dPaddingCache(
        len(convs), [int(c.padding_total) for c in convs], [c.pad_mode for c in convs], [c.in_channels for c in convs]
    )


def mimi_contract(config: MimiConfig) -> Contract:
    kv = dict(
        dims=KV_DIMS,
        axis=4,
        clock="token",
        stride=STEP,
        dtype="float32",
        lifetime=Lifetime.PER_STREAM,
        retention=SlidingWindow(window=config.sliding_window - 1),
    )
    strides = {"sample": 4 * STEP, "half": 2 * STEP, "token": STEP}  # units of each clock a frame brings
    convs = tuple(
        Region(
            name,
            dims=(*lead, 1, channels, clock),
            axis=len(lead) + 2,
            clock=clock,
            stride=strides[clock],
            dtype="float32",
            lifetime=Lifetime.PER_STREAM,
            retention=SlidingWindow(window=2, initial=2),
            holds_call=False,
        )
        for name, (_, lead, channels, clock) in MIMI_CONVS.items()
    )
    return Contract(
        family="mimi",
        clocks=(
            Clock("sample", ClockKind.SAMPLES),
            Clock("half", ClockKind.SAMPLES),
            Clock("token", ClockKind.FRAMES),
            Clock("call", ClockKind.CALLS),
        ),
        rates=(Rate("token", "call", STEP, name="tokens_per_call"), Rate("sample", "token", 4), Rate("half", "token", 2)),
        quantities={"layers": 2, "kv_heads": 2, "head_dim": 8},
        regions=(Region("encoder_kv", **kv), Region("decoder_kv", **kv), *convs),
        operators=(Operator("encode", "encoder_kv", steady=STEP), Operator("decode", "decoder_kv", steady=STEP)),
        admission=Admission("token", max_per_call=STEP),
        interactivity=Interactivity(stages=("encoder", "decoder")),
    )


def mimi_binding(verify: int) -> Binding:
    def kv(cache: str) -> RegionBinding:
        return RegionBinding(f"{cache}_kv", at=(f"{cache}_cache.layers.*.keys", f"{cache}_cache.layers.*.values"))

    def counters(cache: str) -> tuple[str, ...]:
        return f"{cache}_cache.layers.*.is_initialized", f"{cache}_cache.layers.*.cumulative_length"

    return Binding(
        regions=(
            kv("encoder"),
            kv("decoder"),
            *(RegionBinding(name, at=(f"padding_cache.padding_cache.{at}",)) for name, (at, *_) in MIMI_CONVS.items()),
        ),
        operators=(
            OperatorBinding("encode", method="encode", units=STEP, counters=counters("encoder")),
            OperatorBinding("decode", method="decode", units=STEP, counters=counters("decoder")),
        ),
        verify=verify,
    )


def mimi_stream(config: MimiConfig, audio: torch.Tensor, padding_cache, positions: bool):
    """The stock way to stream Mimi: one frame a call through `encode` (its caches passed back in),
    its codes through `decode`. Returns the codes, the audio and every retained tensor after each
    call (the encoder's state compared too: its codes alone could hide a difference), and where
    each bound site is."""

    def stream(m):
        encoder_cache, decoder_cache, padding = DynamicCache(config=config), DynamicCache(config=config), padding_cache()
        outputs, addresses = [], []
        with torch.no_grad():
            for i in range(MIMI_CALLS):
                at = dict(position_ids=torch.arange(i * STEP, (i + 1) * STEP)[None]) if positions else {}
                encoded = m.encode(
                    audio[..., i * config.frame_size : (i + 1) * config.frame_size],
                    encoder_cache=encoder_cache,
                    padding_cache=padding,
                    use_streaming=True,
                    return_dict=True,
                    **at,
                )
                padding = encoded.padding_cache
                decoded = m.decode(encoded.audio_codes, decoder_cache=decoder_cache, return_dict=True, **at)
                kept = [padding.padding_cache[i] for i in (0, 1, 3, 4, 6, 7, 8)]
                kept += [
                    getattr(layer, kind)
                    for cache in (encoder_cache, decoder_cache)
                    for layer in cache.layers
                    for kind in ("keys", "values")
                ]
                # cloned now: the transformed model's retained tensors are its carries, which the next call overwrites
                outputs += [x.clone() for x in (encoded.audio_codes, decoded.audio_values, *kept)]
                addresses.append(
                    layer_addresses(encoder_cache.layers, "encoder_cache.layers")
                    | layer_addresses(decoder_cache.layers, "decoder_cache.layers")
                    | {f"padding_cache.padding_cache.{i}": padding.padding_cache[i].data_ptr() for i in (0, 1, 3, 4, 6, 7, 8)}
                )
        return outputs, addresses

    return stream


def mimi_audio(config: MimiConfig) -> torch.Tensor:
    return torch.randn(1, 1, MIMI_CALLS * config.frame_size, generator=torch.Generator().manual_seed(1))


def test_mimi_refuses_its_first_encode_and_decode_and_streams_the_rest_frame_by_frame_on_the_exported_steps():
    """transformers' Mimi, `encode` and `decode` bound as two operators: the encoder keeps its
    convolutions' left contexts (a padding cache, fixed windows) and its transformer's sliding
    window, the decoder its transformer's. The positions are passed (`position_ids`): without them
    the transformer derives them from `cumulative_length`, a host counter the graph reads (see the
    next test). Each operator's first call (nothing cached) is refused: traced, transformers takes
    another position path ("verification: program: ... the stock call ran aten._to_copy, the graph
    runs aten.arange"); it runs the stock code in both streams. The steady class is captured at each
    value of `cumulative_length` it meets (a guarded host counter), each variant verified once."""
    model, config = mimi()
    stream = mimi_stream(config, mimi_audio(config), lambda: mimi_padding_cache(model), positions=True)
    expected, _ = stream(model)
    bound, report = transform(model, mimi_contract(config), mimi_binding(verify=1))
    for _ in range(2):
        actual, addresses = stream(bound)
        assert exact(actual, expected)
        assert addresses == [{path: carry.address for path, carry in bound.carries.items()}] * MIMI_CALLS
    # each stream's first (stock) call's sites are adopted: the encoder's 11 (4 key and value, 7 left
    # contexts), the decoder's 4
    assert report.operators["encode"].counters.as_dict() == {
        "calls": 12,
        "graph_calls": 11,
        "verified": 5,
        "stock": 2,
        "adopted": 22,
        "stock_by_reason": {"verification": 1, "refused": 1},
    }
    assert report.operators["decode"].counters.as_dict() == {
        "calls": 12,
        "graph_calls": 11,
        "verified": 5,
        "stock": 2,
        "adopted": 8,
        "evicted": 4,
        "stock_by_reason": {"verification": 1, "refused": 1},
    }
    for name in ("encode", "decode"):
        assert_replay_counters(
            report,
            {k: v for k, v in MIMI_CLASSES.items() if k.startswith(name)},
            streams=2,
            device="cpu",
            operator=name,
            may_refuse=frozenset({f"{name}[n=2,L=0]"}),
        )
    # at the steady class: the encoder's 4 key and value sites appended then evicted in place, its 7
    # left contexts (each the last 2 units of its convolution's new input) copied into their carries
    assert [(s.kind, s.region) for s in report.sites if s.graph == "encode[n=2,L=4]"] == (
        [("append", "encoder_kv")] * 4
        + [("keep", "conv_in")]
        + [("keep", "conv_4")] * 2
        + [("keep", "conv_8")] * 2
        + [("keep", "conv_16")] * 2
    )


@pytest.mark.parametrize("verify", [2, 1])
def test_mimi_positions_left_to_the_cache_make_a_variant_of_the_steady_class_at_each_position(verify):
    """Without `position_ids` the transformers derive the positions from the caches'
    `cumulative_length`, a host int the graph freezes at capture: one graph of the steady class
    (L=4, met at positions 4, 6, 8, 10) would key every call at the position it was captured at (its
    codes may still match: the retained keys do not). The counter, bound without a regime, is
    guarded by its value: the class is captured once at each position (L=4, `#2`, `#3`, `#4`), each
    verified `verify` times at its own position, and both streams stay exact. (Bug, fixed in
    pipeline/verify.py `verify_class`: one class verified once at position 4 had its retained keys go wrong
    from the fourth call on, silently.) Each operator's first call is refused, its export taking
    another position path (verification: program), as when the positions are passed."""
    model, config = mimi()
    audio = mimi_audio(config)
    bound, report = transform(model, mimi_contract(config), mimi_binding(verify=verify))
    stream = mimi_stream(config, audio, lambda: mimi_padding_cache(model), positions=False)
    expected, _ = stream(model)
    for _ in range(2):
        assert exact(stream(bound)[0], expected)
    for name, op_at, adopted in (("encode", 125, {"adopted": 22}), ("decode", 10, {"adopted": 8, "evicted": 4})):
        op = report.operators[name]
        refused = {cls.name: cls.refused for cls in op.classes.values() if cls.refused}
        assert list(refused) == [f"{name}[n=2,L=0]"]
        assert refused[f"{name}[n=2,L=0]"].startswith(
            f"verification: program: the exported step is not the program the stock call runs: op {op_at}: the stock call "
            "ran aten._to_copy.default("
        )
        assert op.counters.as_dict() == {
            "calls": 12,
            "graph_calls": 11,
            "verified": 5 * verify,
            "stock": 2,
            **adopted,
            "stock_by_reason": {"verification": 1, "refused": 1},
        }
        assert_replay_counters(
            report,
            {k: v for k, v in MIMI_CLASSES.items() if k.startswith(name)},
            streams=2,
            device="cpu",
            operator=name,
            may_refuse=frozenset({f"{name}[n=2,L=0]"}),
        )


def test_mimi_with_the_padding_cache_the_model_makes_runs_the_stock_code_saying_why():
    """The padding cache `encode` makes itself (padding_cache=None at the first call) holds each
    layer's padding as a 0-d buffer, and `update` branches on `padding > 0`: torch.export cannot
    trace a branch on a tensor's value, so every encode class is refused and runs the stock code."""
    model, config = mimi()
    audio = mimi_audio(config)
    bound, report = transform(model, mimi_contract(config), mimi_binding(verify=1))
    stream = mimi_stream(config, audio, lambda: None, positions=True)
    expected, _ = stream(model)
    for _ in range(2):
        assert exact(stream(bound)[0], expected)
    op = report.operators["encode"]
    # the steady class at each value of `cumulative_length` (a guarded host counter), each refused alike
    assert [cls.name for cls in op.classes.values()] == [
        "encode[n=2,L=2]",
        "encode[n=2,L=4]",
        "encode[n=2,L=4]#2",
        "encode[n=2,L=4]#3",
        "encode[n=2,L=4]#4",
    ]
    assert all(
        cls.refused.startswith("torch.export failed: GuardOnDataDependentSymNode: Could not guard on data-dependent expression")
        for cls in op.classes.values()
    )
    # each stream's first call: no padding cache to count the sites in yet (the call makes it); every
    # later call's state (11 sites) is taken into the carries after its stock call, and once more at
    # the call that allocates them
    assert op.counters.as_dict() == {
        "calls": 12,
        "graph_calls": 0,
        "verified": 0,
        "stock": 12,
        "adopted": 132,
        "stock_by_reason": {"no_state_yet": 2, "refused": 10},
    }
    # the decoder's first call is refused (its export takes another position path), its other classes stream
    assert report.operators["decode"].counters.stock_by_reason == {"verification": 1, "refused": 1}


# The audio codec a speech LM builds beside its transformer (a Mimi), unused by the decoder steps here.
TINY_CODEC = dict(
    model_type="mimi",
    hidden_size=16,
    num_filters=4,
    num_residual_layers=1,
    upsampling_ratios=[2, 2],
    kernel_size=3,
    last_kernel_size=3,
    residual_kernel_size=3,
    codebook_size=16,
    codebook_dim=16,
    num_quantizers=2,
    vector_quantization_hidden_dimension=16,
    upsample_groups=16,
    num_hidden_layers=1,
    intermediate_size=32,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=8,
)
KYUTAI_CALLS, KYUTAI_WINDOW = 8, 6  # a sliding layer's cache keeps its last KYUTAI_WINDOW - 1 frames
# the steady class L=5 at cumulative_length 5, 6 and 7 (a host counter guarded by its value): three variants
KYUTAI_CLASSES = {f"decoder_step[n=1,L={e}]": 1 for e in range(6)} | {f"decoder_step[n=1,L=5]#{v}": 1 for v in (2, 3)}


def kyutai_refusal(op_at: int) -> str:
    return (
        f"verification: program: the exported step is not the program the stock call runs: op {op_at}: the stock call "
        "ran aten.pow.Tensor_Scalar("
    )


def kyutai() -> tuple[KyutaiSpeechToTextForConditionalGeneration, KyutaiSpeechToTextConfig]:
    """transformers' Kyutai speech-to-text: each frame is one text token and 2 codebooks' codes,
    summed into one embedding; its audio codec (a Mimi) is not run here, the codes are fed directly."""
    torch.manual_seed(0)
    config = KyutaiSpeechToTextConfig(
        codebook_vocab_size=17,
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        sliding_window=KYUTAI_WINDOW,
        ffn_dim=64,
        num_codebooks=2,
        audio_bos_token_id=16,
        audio_pad_token_id=64 + 2 * 17,
        pad_token_id=3,
        bos_token_id=1,
        codec_config=TINY_CODEC,
        attn_implementation="sdpa",
    )
    return KyutaiSpeechToTextForConditionalGeneration(config).eval(), config


def kyutai_stream(config: KyutaiSpeechToTextConfig, positions: bool):
    """The stock way to stream the ASR decoder: one frame (text token + codes) a call into one
    DynamicCache (sliding layers). Returns the logits and every retained tensor after each call,
    and where each site is."""
    generator = torch.Generator().manual_seed(1)
    frames = torch.cat(
        [
            torch.randint(0, 64, (1, KYUTAI_CALLS, 1), generator=generator),
            torch.randint(0, 16, (1, KYUTAI_CALLS, 2), generator=generator),
        ],
        dim=-1,
    )

    def stream(m):
        cache, outputs, addresses = DynamicCache(config=config), [], []
        with torch.no_grad():
            for t in range(KYUTAI_CALLS):
                at = dict(position_ids=torch.tensor([[t]])) if positions else {}
                outputs.append(m(input_ids=frames[:, t : t + 1], cache=cache, use_cache=True, **at).logits)
                # cloned now: the transformed model's retained tensors are its carries, which the next call overwrites
                outputs += [getattr(layer, kind).clone() for layer in cache.layers for kind in ("keys", "values")]
                addresses.append(layer_addresses(cache.layers, "cache.layers"))
        return outputs, addresses

    return stream


def kyutai_contract(config: KyutaiSpeechToTextConfig) -> Contract:
    return Contract(
        family="kyutai_stt",
        clocks=(Clock("frame", ClockKind.FRAMES), Clock("call", ClockKind.CALLS)),
        rates=(Rate("frame", "call", 1, name="frames_per_call"),),
        quantities={"layers": 2, "kv_heads": 2, "head_dim": 8},
        regions=(
            Region(
                "kv",
                dims=("layers", 2, 1, "kv_heads", "frame", "head_dim"),
                axis=4,
                clock="frame",
                stride=1,
                dtype="float32",
                lifetime=Lifetime.PER_STREAM,
                retention=SlidingWindow(window=config.sliding_window - 1),
            ),
        ),
        operators=(Operator("decoder_step", "kv", steady=1),),
        admission=Admission("frame", max_per_call=1),
        interactivity=Interactivity(stages=("decoder",)),
    )


KYUTAI_BINDING = Binding(
    regions=(RegionBinding("kv", at=("cache.layers.*.keys", "cache.layers.*.values")),),
    operators=(
        OperatorBinding(
            "decoder_step", units=("input_ids", 1), counters=("cache.layers.*.is_initialized", "cache.layers.*.cumulative_length")
        ),
    ),
    verify=1,
)


def test_kyutai_speech_to_text_refuses_every_class_and_decodes_frame_by_frame_exact_on_the_stock_code():
    """One frame of codes a call, positions passed: every class of the sliding cache (L = 0..5, the
    steady one from the sixth call on, a variant at each value of the guarded `cumulative_length`)
    is refused: the stock call's program differs from the exported step's ("verification: program:
    ... op 5: the stock call ran aten.pow, the graph runs aten.arange": traced, the model takes
    another code path). Every call runs the stock code, bit-identical, its sites adopted into the
    carries after each call."""
    model, config = kyutai()
    stream = kyutai_stream(config, positions=True)
    expected, _ = stream(model)
    bound, report = transform(model, kyutai_contract(config), KYUTAI_BINDING)
    for _ in range(2):
        actual, addresses = stream(bound)
        assert exact(actual, expected)
        assert addresses == [{path: carry.address for path, carry in bound.carries.items()}] * KYUTAI_CALLS
    op = report.operators["decoder_step"]
    assert all(cls.refused.startswith(kyutai_refusal(5)) for cls in op.classes.values())
    assert op.counters.as_dict() == {
        "calls": 16,
        "graph_calls": 8,
        "verified": 0,
        "stock": 16,
        "adopted": 64,
        "evicted": 4,
        "stock_by_reason": {"verification": 8, "refused": 8},
    }
    assert_replay_counters(report, KYUTAI_CLASSES, streams=2, device="cpu", may_refuse=frozenset(KYUTAI_CLASSES))
    assert [(s.kind, s.region) for s in report.sites if s.graph == "decoder_step[n=1,L=5]"] == [("append", "kv")] * 4


def test_kyutai_positions_left_to_the_cache_refuse_every_class_as_with_positions_passed():
    """Without `position_ids` the model derives them from the cache's seen length, a host counter
    the graph would freeze: guarded by its value, the steady class (L=5, met at frames 5, 6, 7) is
    captured at each (`#2`, `#3`). Every class is refused as when the positions are passed (the
    stock call's program differs: op 7, aten.pow against aten.arange); the stream stays exact on
    the stock code."""
    model, config = kyutai()
    stream = kyutai_stream(config, positions=False)
    expected, _ = stream(model)
    bound, report = transform(model, kyutai_contract(config), KYUTAI_BINDING)
    for _ in range(2):
        assert exact(stream(bound)[0], expected)
    op = report.operators["decoder_step"]
    assert [cls.name for cls in op.classes.values()] == list(KYUTAI_CLASSES)
    assert all(cls.refused.startswith(kyutai_refusal(7)) for cls in op.classes.values())
    assert op.counters.as_dict() == {
        "calls": 16,
        "graph_calls": 8,
        "verified": 0,
        "stock": 16,
        "adopted": 64,
        "evicted": 4,
        "stock_by_reason": {"verification": 8, "refused": 8},
    }


MOSHI_WINDOW = 5  # a sliding layer's cache keeps its last MOSHI_WINDOW - 1 tokens
# the steady class L=4 at cumulative_length 4, 6, 8 and 10 (a host counter guarded by its value): four variants
MOSHI_CLASSES = {
    "decoder_step[n=2,L=0]": 1,
    "decoder_step[n=2,L=2]": 1,
    "decoder_step[n=2,L=4]": 1,
    **{f"decoder_step[n=2,L=4]#{v}": 1 for v in (2, 3, 4)},
}


def moshi_text():
    """transformers' MoshiForCausalLM (tiny), its contract and binding: (model, config, contract, binding)."""
    torch.manual_seed(0)
    config = MoshiConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        ffn_dim=64,
        sliding_window=MOSHI_WINDOW,
        max_position_embeddings=64,
        audio_vocab_size=16,
        num_codebooks=2,
        audio_encoder_config=TINY_CODEC,
        attn_implementation="sdpa",
    )
    model = MoshiForCausalLM(config).eval()
    contract = kv_contract("moshi_text", 2, 2, tokens=12)
    contract = replace(contract, regions=(replace(contract.regions[0], retention=SlidingWindow(window=MOSHI_WINDOW - 1)),))
    binding = Binding(
        regions=DYNAMIC_CACHE.regions,
        operators=(
            OperatorBinding(
                "decoder_step",
                units=("input_ids", 1),
                counters=("cache.layers.*.is_initialized", "cache.layers.*.cumulative_length"),
            ),
        ),
        verify=1,
    )
    return model, config, contract, binding


def test_moshi_text_transformer_refuses_its_first_call_and_streams_its_sliding_cache_on_the_exported_steps():
    """transformers' MoshiForCausalLM (Moshi's temporal transformer with its text head), STEP tokens a
    call into a DynamicCache of sliding layers, positions passed; the retained keys and values are
    compared too, the logits alone could hide an eviction gone wrong. The first call (nothing
    cached) is refused: traced, transformers takes another code path ("verification: program: ...
    op 1: the stock call ran aten.pow, the graph runs aten.arange"); it runs the stock code in both
    streams, its 4 sites adopted. The other classes (the steady one a variant at each value of the
    guarded `cumulative_length`) run their exported steps, each verified once."""
    model, config, contract, binding = moshi_text()
    tokens = random_tokens(12)

    def stream(m):
        cache, outputs, addresses = DynamicCache(config=config), [], []
        with torch.no_grad():
            for t in range(0, 12, STEP):
                outputs.append(
                    m(
                        input_ids=tokens[:, t : t + STEP],
                        position_ids=torch.arange(t, t + STEP)[None],
                        cache=cache,
                        use_cache=True,
                    ).logits
                )
                outputs += [getattr(layer, kind).clone() for layer in cache.layers for kind in ("keys", "values")]
                addresses.append(layer_addresses(cache.layers, "cache.layers"))
        return outputs, addresses

    expected, _ = stream(model)
    bound, report = transform(model, contract, binding)
    for _ in range(2):
        actual, addresses = stream(bound)
        assert exact(actual, expected)
        assert addresses == [{path: carry.address for path, carry in bound.carries.items()}] * 6
    assert report.operators["decoder_step"].counters.as_dict() == {
        "calls": 12,
        "graph_calls": 11,
        "verified": 5,
        "stock": 2,
        "adopted": 8,
        "evicted": 4,
        "stock_by_reason": {"verification": 1, "refused": 1},
    }
    assert_replay_counters(report, MOSHI_CLASSES, streams=2, device="cpu", may_refuse=frozenset({FIRST}))


CSM_CALLS = 6
CSM_CLASSES = {f"decoder_step[n=1,L={e}]": 1 for e in range(CSM_CALLS)}


def csm():
    """transformers' CSM (tiny) and its backbone's contract: (model, config, contract)."""
    torch.manual_seed(0)
    depth = dict(
        num_codebooks=2,
        backbone_hidden_size=32,
        vocab_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=3,
    )
    config = CsmConfig(
        num_codebooks=2,
        vocab_size=16,
        text_vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        pad_token_id=28,
        codebook_pad_token_id=15,
        codebook_eos_token_id=0,
        bos_token_id=1,
        audio_token_id=29,
        audio_eos_token_id=30,
        depth_decoder_config=depth,
        codec_config=TINY_CODEC,
        attn_implementation="sdpa",
    )
    model = CsmForConditionalGeneration(config).eval()
    contract = Contract(
        family="csm_backbone",
        clocks=(Clock("frame", ClockKind.FRAMES), Clock("call", ClockKind.CALLS)),
        rates=(Rate("frame", "call", 1, name="frames_per_call"),),
        quantities={"layers": 2, "kv_heads": 2, "head_dim": 8},
        regions=(
            Region(
                "kv",
                dims=("layers", 2, 1, "kv_heads", "frame", "head_dim"),
                axis=4,
                clock="frame",
                stride=1,
                dtype="float32",
                lifetime=Lifetime.PER_STREAM,
                retention=SlidingWindow(window=CSM_CALLS),
            ),
        ),
        operators=(Operator("decoder_step", "kv", steady=1),),
        admission=Admission("frame", max_per_call=1),
        interactivity=Interactivity(stages=("backbone",)),
    )
    return model, config, contract


def test_csm_backbone_refuses_every_class_and_streams_one_frame_of_codes_a_call_exact_on_the_stock_code():
    """transformers' CsmForConditionalGeneration, its backbone's generation step: one frame of codes
    a call (input_ids of shape (1, 1, codebooks), as `generate` feeds it; the text and the codec are
    not run) into a DynamicCache of full attention, positions passed. Full attention: the stream's
    CSM_CALLS frames are its window. Every class is refused: the stock call's program differs from
    the exported step's ("verification: program: ... op 3: the stock call ran aten._to_copy, the
    graph runs aten.arange": traced, the model takes another code path). Every call runs the stock
    code, bit-identical, its sites adopted into the carries after each call."""
    model, config, contract = csm()
    codes = torch.randint(0, 16, (1, CSM_CALLS, 2), generator=torch.Generator().manual_seed(1))

    def stream(m):
        cache, outputs, addresses = DynamicCache(config=config), [], []
        with torch.no_grad():
            for t in range(CSM_CALLS):
                outputs.append(
                    m(input_ids=codes[:, t : t + 1], position_ids=torch.tensor([[t]]), cache=cache, use_cache=True).logits
                )
                outputs += [getattr(layer, kind).clone() for layer in cache.layers for kind in ("keys", "values")]
                addresses.append(layer_addresses(cache.layers, "cache.layers"))
        return outputs, addresses

    expected, _ = stream(model)
    bound, report = transform(model, contract, DYNAMIC_CACHE)
    for _ in range(2):
        actual, addresses = stream(bound)
        assert exact(actual, expected)
        assert addresses == [{path: carry.address for path, carry in bound.carries.items()}] * CSM_CALLS
    op = report.operators["decoder_step"]
    assert all(
        cls.refused.startswith(
            "verification: program: the exported step is not the program the stock call runs: "
            "op 3: the stock call ran aten._to_copy.default("
        )
        for cls in op.classes.values()
    )
    assert op.counters.as_dict() == {
        "calls": 12,
        "graph_calls": 6,
        "verified": 0,
        "stock": 12,
        "adopted": 48,
        "evicted": 4,
        "stock_by_reason": {"verification": 6, "refused": 6},
    }
    assert_replay_counters(report, CSM_CLASSES, streams=2, device="cpu", may_refuse=frozenset(CSM_CLASSES))
