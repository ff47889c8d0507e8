"""Bring your own model: a `transformers` Mistral decoder with a sliding window, streamed with
its own `DynamicCache` (whose layers concatenate then trim), transformed from a contract and a
binding written only against cadence-fx's public API. README.md shows this same code."""

from __future__ import annotations

import torch
from transformers import DynamicCache, MistralConfig, MistralForCausalLM

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
    SlidingWindow,
)

WINDOW = 5  # the model's sliding window: its cache keeps the last WINDOW - 1 tokens
TOKENS_PER_CALL = 2
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 8


def build_model(device: str = "cpu") -> tuple[MistralForCausalLM, MistralConfig]:
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        sliding_window=WINDOW,
        max_position_embeddings=512,
        attn_implementation="sdpa",
    )
    return MistralForCausalLM(config).eval().to(device), config


def contract() -> Contract:
    return Contract(
        family="mistral_sliding_window",
        clocks=(Clock("token", ClockKind.TOKENS), Clock("call", ClockKind.CALLS)),
        rates=(Rate("token", "call", TOKENS_PER_CALL, name="tokens_per_call"),),
        quantities={"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM},
        regions=(
            Region(
                "kv",
                dims=("layers", 2, 1, "kv_heads", "token", "head_dim"),
                axis=4,
                clock="token",
                stride=TOKENS_PER_CALL,
                dtype="float32",
                lifetime=Lifetime.PER_STREAM,
                retention=SlidingWindow(window=WINDOW - 1),
            ),
        ),
        operators=(Operator("decoder_step", "kv", steady=TOKENS_PER_CALL),),
        admission=Admission("token", max_per_call=TOKENS_PER_CALL),
        interactivity=Interactivity(stages=("decoder",)),
    )


def binding() -> Binding:
    return Binding(
        regions=(RegionBinding("kv", at=("cache.layers.*.keys", "cache.layers.*.values")),),
        operators=(
            OperatorBinding(
                "decoder_step",
                method="forward",
                units=("input_ids", 1),
                counters=("cache.layers.*.cumulative_length", "cache.layers.*.is_initialized"),
            ),
        ),
    )


def stream(model, config, tokens: torch.Tensor, *, positions: bool = True):
    """The stock way to stream: TOKENS_PER_CALL tokens a call into one DynamicCache."""
    cache = DynamicCache(config=config)
    logits, addresses = [], []
    with torch.no_grad():
        for t in range(0, tokens.shape[1], TOKENS_PER_CALL):
            kwargs = {"position_ids": torch.arange(t, t + TOKENS_PER_CALL, device=tokens.device)[None]} if positions else {}
            out = model(input_ids=tokens[:, t : t + TOKENS_PER_CALL], cache=cache, use_cache=True, **kwargs)
            logits.append(out.logits)
            addresses.append(tuple(t.data_ptr() for layer in cache.layers for t in (layer.keys, layer.values)))
    return logits, addresses


def diff_example(device: str = "cpu"):
    """`cadence-fx diff --binding byom_example:diff_example`: the model on `device`, its contract and
    binding, and a short stream (`chunks` calls of TOKENS_PER_CALL random tokens)."""
    model, config = build_model(device)

    def run(transformed, chunks: int) -> str:
        tokens = torch.randint(0, config.vocab_size, (1, chunks * TOKENS_PER_CALL), generator=torch.Generator().manual_seed(1))
        stream(transformed, config, tokens.to(device))
        return f"{chunks} calls of {TOKENS_PER_CALL} random tokens into one DynamicCache"

    return model, contract(), binding(), run
