"""Freeze-Omni: the contract of its chunk-wise streaming speech encoder.

Each attention layer keeps the K/V of `left_chunks` previous chunks (concat-then-trim); with the
conv feed-forward, each layer also keeps a conv left context of `lorder` frames (the linear
feed-forward of the released encoder keeps none). The attended extent grows by one chunk a call
from one chunk to `left_chunks + 1`: K = left_chunks + 1 classes, derived (K = 2 with one left
chunk, 17 for the released encoder's 16). `encoder_contract` reads all of it off an encoder's
configuration.

Where the regions live (`freeze_omni_binding`, data): `infer(chunk, buffer, pe_index)` returns
``(ys, buffer, pe_index)``, its new buffer list, a flat list `[kv_0, cnn_0, kv_1, cnn_1, ...]` with the
conv feed-forward (`[kv_0, kv_1, ...]` with the linear one). Layer l's attention keeps
``kv_l = [keys, values]`` (None before the first chunk), each ``cat([kept, new], dim=2)[:, :, -W:]``;
the conv feed-forward keeps ``cat([cnn_l, x], dim=2)[:, :, -lorder:]``. `transform(encoder,
contract)` runs the one binding pipeline on it (`cadence_fx.pipeline`): no code of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cadence_fx.binding import Binding, OperatorBinding, RegionBinding
from cadence_fx.catalog import derive
from cadence_fx.contract import (
    Admission,
    Clock,
    ClockKind,
    Contract,
    Interactivity,
    Lifetime,
    Operator,
    Rate,
    Region,
)
from cadence_fx.passes.retention import SlidingWindow

if TYPE_CHECKING:
    from .freeze_omni_encoder import FreezeOmniEncoder, FreezeOmniEncoderConfig

__all__ = ["encoder_contract", "freeze_omni_binding", "freeze_omni_contract", "reference_stream"]

OPERATOR = "encoder_chunk"
KV, CONV = "attention_kv", "conv_left_context"


def freeze_omni_contract(
    *,
    chunk_frames: int = 4,
    left_chunks: int = 1,
    subsampling: int = 4,
    blocks: int = 24,
    d_model: int = 1024,
    heads: int = 16,
    lorder: int | None = 2,
) -> Contract:
    """`chunk_frames` is the chunk in encoder frames (16 fbank frames through 4x subsampling);
    `lorder` the conv feed-forward's left context, None for the linear feed-forward (no region)."""
    regions: tuple[Region, ...] = (
        Region(
            "attention_kv",
            dims=("blocks", 2, 1, "heads", "encoder_frame", "head_dim"),
            axis=4,
            clock="encoder_frame",
            stride=chunk_frames,
            dtype="float32",
            lifetime=Lifetime.PER_STREAM,
            retention=SlidingWindow(window=chunk_frames * left_chunks),
        ),
    )
    if lorder is not None:
        regions += (
            Region(
                "conv_left_context",
                dims=("blocks", 1, "d_model", "encoder_frame"),
                axis=3,
                clock="encoder_frame",
                stride=chunk_frames,
                dtype="float32",
                lifetime=Lifetime.PER_STREAM,
                retention=SlidingWindow(window=lorder, initial=lorder),
                holds_call=False,
            ),
        )
    return Contract(
        family="freeze_omni",
        clocks=(
            Clock("fbank_frame", ClockKind.FRAMES),
            Clock("encoder_frame", ClockKind.FRAMES),
            Clock("chunk", ClockKind.CALLS),
        ),
        rates=(
            Rate("fbank_frame", "encoder_frame", subsampling, name="subsampling"),
            Rate("encoder_frame", "chunk", chunk_frames, name="chunk_frames"),
        ),
        quantities={"blocks": blocks, "heads": heads, "head_dim": d_model // heads, "d_model": d_model},
        regions=regions,
        operators=(Operator("encoder_chunk", "attention_kv", steady=chunk_frames),),
        admission=Admission("encoder_frame", max_per_call=chunk_frames),
        interactivity=Interactivity(stages=("fbank", "encoder")),
    )


def encoder_contract(config: FreezeOmniEncoderConfig) -> Contract:
    """The contract of an encoder built from `config`: its size, chunk, left chunks and whether its
    feed-forward keeps a conv left context."""
    return freeze_omni_contract(
        chunk_frames=config.chunk_size,
        left_chunks=config.left_chunks,
        blocks=config.num_blocks,
        d_model=config.attention_dim,
        heads=config.attention_heads,
        lorder=config.lorder if config.conv_feed_forward else None,
    )


def freeze_omni_binding(encoder: FreezeOmniEncoder, contract: Contract) -> Binding:
    """Where `encoder` keeps each region of `contract`, after checking that the contract describes
    this encoder (its size, chunk, left chunks and feed-forward)."""
    c = encoder.config
    symbols = contract.symbols()
    found = {
        "blocks": c.num_blocks,
        "heads": c.attention_heads,
        "d_model": c.attention_dim,
        "head_dim": c.attention_dim // c.attention_heads,
        "chunk_frames": c.chunk_size,
    }
    for name, actual in found.items():
        if symbols[name] != actual:
            raise ValueError(f"contract quantity {name}={symbols[name]} but the encoder has {actual}: declare {name}={actual}")
    names = tuple(region.name for region in contract.regions)
    retained = {KV: c.kv_frames, CONV: c.lorder} if c.conv_feed_forward else {KV: c.kv_frames}
    if names != tuple(retained):
        raise ValueError(
            f"the contract declares regions {names} but the encoder ({c.feed_forward} feed-forward) "
            f"keeps {tuple(retained)}: derive the contract with encoder_contract(encoder.config)"
        )
    catalog = derive(contract)
    for region, actual in retained.items():
        declared = catalog.region(region).kept()  # the units it retains between calls in steady state
        if declared != actual:
            raise ValueError(f"region {region!r} retains {declared} frames but the encoder keeps {actual}")
    kv, cnn = ("[0::2]", "[1::2]") if c.conv_feed_forward else ("*", None)
    bindings: tuple[RegionBinding, ...] = (
        RegionBinding(KV, at=(f"buffer.{kv}.0", f"buffer.{kv}.1"), out=(f"return.1.{kv}.0", f"return.1.{kv}.1")),
    )
    if cnn is not None:
        bindings += (RegionBinding(CONV, at=(f"buffer.{cnn}",), out=(f"return.1.{cnn}",)),)
    return Binding(regions=bindings, operators=(OperatorBinding(OPERATOR, method="infer", units=c.chunk_size),))


def reference_encoder(depth: str = "reduced", device: str = "cpu"):
    """The in-repo encoder with random weights, on `device`, and its contract, for the CLI: `depth`
    is "reduced" (2 blocks, 64 wide) or "full" (24 blocks, 1024 wide)."""
    from .freeze_omni_encoder import FreezeOmniEncoderConfig, build_encoder

    if depth not in ("reduced", "full"):
        raise ValueError(f"depth must be 'reduced' or 'full', got {depth!r}")
    config = FreezeOmniEncoderConfig.small() if depth == "reduced" else FreezeOmniEncoderConfig()
    return build_encoder(config).to(device), encoder_contract(config)


def reference_stream(depth: str, device: str = "cpu"):
    """The reference encoder on `device`, its contract, and a short stream through its transformed
    encoder, for the CLI's diff: `stream(transformed, chunks)` runs `chunks` chunks and says what it ran."""
    from .freeze_omni_encoder import stream_utterance

    encoder, contract = reference_encoder(depth, device)

    def stream(transformed, chunks: int) -> str:
        # Three utterances: each class's first two visits are verified against the stock call,
        # the third utterance's reach the replay engine, so every class has its certificate.
        c = encoder.config
        generator = torch.Generator().manual_seed(0)
        for _ in range(3):
            feats = torch.randn(1, chunks * c.chunk_frames, c.input_dim, generator=generator)
            stream_utterance(transformed, feats.to(device))
        return f"3 utterances of {chunks} chunks of random fbank features"

    return encoder, contract, stream
