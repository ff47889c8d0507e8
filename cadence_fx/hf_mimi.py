"""The contract and binding of `transformers`' Mimi codec, derived from its config and modules: two
operators, `encode` and `decode`, a frame of audio (or of codes) a call.

Mimi streams through two methods, each with caches of its own: `encode(input_values,
encoder_cache=, padding_cache=, use_streaming=True)` keeps its transformer's keys and values (a
`DynamicCache`) and each causal convolution's left context (a `MimiConv1dPaddingCache`: the last
`padding_total` inputs of the convolution, at the rate the convolution runs at), and
`decode(audio_codes, decoder_cache=)` its transformer's keys and values. Every bound is a field of
the config or of a module: the sliding window (`sliding_window - 1` tokens), each convolution's
`padding_total`, and the strides that give each convolution its rate (samples a token: the
product of the strides before it). A convolution of no left context (a 1x1) keeps nothing: not
bound.

The padding cache `encode` builds keeps each padding as the convolution's 0-d `padding_total`
buffer, and `MimiConv1dPaddingCache.update` branches on `padding > 0`: no export traces that
branch on a tensor. So the transformed model's `encode` reads the paddings of the padding cache it
is passed as ints (`int_paddings`: the same values, the same slices; the cache object the caller
holds then keeps ints).
"""

from __future__ import annotations

import math
from typing import Any

from .binding import Binding, OperatorBinding, RegionBinding
from .contract import Admission, Clock, ClockKind, Contract, Interactivity, Lifetime, Operator, Rate, Region
from .passes.retention import SlidingWindow

__all__ = ["derive_mimi", "int_paddings", "mimi_caches"]

PADDINGS = "padding_cache.padding_cache"


def derive_mimi(model: Any, *, tokens_per_call: int, verify: int = 2) -> tuple[Contract, Binding]:
    """Mimi's contract and binding, `tokens_per_call` transformer tokens a call (a whole number of
    frames: `encodec_frame_rate / frame_rate` tokens a frame)."""
    from .hf import DeriveError, _selection

    config = model.config
    name = type(model).__name__
    per_frame = round(config.encodec_frame_rate / config.frame_rate)
    if tokens_per_call % per_frame:
        raise DeriveError(f"{name}: a call brings whole frames of {per_frame} tokens; tokens_per_call is {tokens_per_call}")
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or window < 2:
        raise DeriveError(f"{name}: its transformers keep no sliding window (sliding_window {window!r}); bind it by hand")
    encoder = model.encoder
    convs = [encoder.encoder_seanet.get_submodule(n) for n in encoder.encoder_seanet._conv1d_layer_names] + [encoder.downsample]
    hop = math.prod(int(c.conv.stride[0]) for c in convs[:-1])  # samples a token
    clocks: dict[int, str] = {1: "token", hop: "sample"}  # samples a unit of the clock -> its name
    groups: dict[tuple[int, int, int], list[int]] = {}  # (padding, channels, samples a unit) -> layers
    divisor = 1
    for i, conv in enumerate(convs):
        padding = int(conv.padding_total)
        if padding:
            groups.setdefault((padding, conv.in_channels, hop // divisor), []).append(i)
        divisor *= int(conv.conv.stride[0])
    regions, bindings = [], []
    for (padding, channels, units), layers in groups.items():
        clock = clocks.setdefault(units, f"sample_{hop // units}")
        at = str(layers[0]) if len(layers) == 1 else _selection(layers, len(convs), f"{name}: {PADDINGS}")
        lead = () if len(layers) == 1 else (len(layers),)
        region = f"conv_{channels}_{clock}"
        regions.append(
            Region(
                region,
                dims=(*lead, 1, channels, clock),
                axis=len(lead) + 2,
                clock=clock,
                stride=units * tokens_per_call,
                dtype=_dtype(model),
                lifetime=Lifetime.PER_STREAM,
                retention=SlidingWindow(window=padding, initial=padding),
                holds_call=False,
            )
        )
        bindings.append(RegionBinding(region, at=(f"{PADDINGS}.{at}",)))

    def kv(region: str) -> Region:  # a transformer's layers: (layer, keys|values, batch, heads, tokens, head_dim)
        return Region(
            region,
            dims=(config.num_hidden_layers, 2, 1, config.num_key_value_heads, "token", config.head_dim),
            axis=4,
            clock="token",
            stride=tokens_per_call,
            dtype=_dtype(model),
            lifetime=Lifetime.PER_STREAM,
            retention=SlidingWindow(window=window - 1),
        )

    contract = Contract(
        family=config.model_type,
        clocks=(
            *(Clock(c, ClockKind.FRAMES if c == "token" else ClockKind.SAMPLES) for c in clocks.values()),
            Clock("call", ClockKind.CALLS),
        ),
        rates=(
            Rate("token", "call", tokens_per_call, name="tokens_per_call"),
            *(Rate(c, "token", units) for units, c in clocks.items() if units != 1),
        ),
        regions=(kv("encoder_kv"), kv("decoder_kv"), *regions),
        operators=(
            Operator("encode", "encoder_kv", steady=tokens_per_call),
            Operator("decode", "decoder_kv", steady=tokens_per_call),
        ),
        admission=Admission("token", max_per_call=tokens_per_call),
        interactivity=Interactivity(stages=("encoder", "decoder")),
    )

    def kv_binding(cache: str) -> RegionBinding:
        return RegionBinding(f"{cache}_kv", at=(f"{cache}_cache.layers.*.keys", f"{cache}_cache.layers.*.values"))

    def counters(cache: str) -> tuple[str, ...]:
        return f"{cache}_cache.layers.*.is_initialized", f"{cache}_cache.layers.*.cumulative_length"

    binding = Binding(
        regions=(kv_binding("encoder"), kv_binding("decoder"), *bindings),
        operators=(
            OperatorBinding("encode", method="encode", units=tokens_per_call, counters=counters("encoder")),
            OperatorBinding("decode", method="decode", units=tokens_per_call, counters=counters("decoder")),
        ),
        verify=verify,
    )
    return contract, binding


def _dtype(model: Any) -> str:
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def mimi_caches() -> dict[str, tuple[str, type]]:
    """By operator, the argument its transformer's cache is passed by, and that cache's class."""
    from transformers import DynamicCache

    return {"encode": ("encoder_cache", DynamicCache), "decode": ("decoder_cache", DynamicCache)}


def int_paddings(arguments: dict[str, Any]) -> None:
    """The paddings of the padding cache in `arguments` read as ints (module docstring: why)."""
    cache = arguments.get("padding_cache")
    if cache is not None:
        cache.per_layer_padding = [int(p) for p in cache.per_layer_padding]
