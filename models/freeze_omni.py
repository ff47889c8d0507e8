"""Freeze-Omni: the contract of its chunk-wise streaming speech encoder.

Each attention layer keeps the K/V of `left_chunks` previous chunks (concat-then-trim); with the
conv feed-forward, each layer also keeps a conv left context of `lorder` frames (the linear
feed-forward of the released encoder keeps none). The attended extent grows by one chunk a call
from one chunk to `left_chunks + 1`: K = left_chunks + 1 classes, derived (K = 2 with one left
chunk, 17 for the released encoder's 16). `encoder_contract` reads all of it off an encoder's
configuration.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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
    SlidingWindow,
)

if TYPE_CHECKING:
    from .freeze_omni_encoder import FreezeOmniEncoderConfig

__all__ = ["encoder_contract", "freeze_omni_contract"]


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
    regions = (Region(
        "attention_kv",
        dims=("blocks", 2, 1, "heads", "encoder_frame", "head_dim"),
        axis=4,
        clock="encoder_frame",
        stride=chunk_frames,
        dtype="float32",
        lifetime=Lifetime.PER_STREAM,
        retention=SlidingWindow(window=chunk_frames * left_chunks),
    ),)
    if lorder is not None:
        regions += (Region(
            "conv_left_context",
            dims=("blocks", 1, "d_model", "encoder_frame"),
            axis=3,
            clock="encoder_frame",
            stride=chunk_frames,
            dtype="float32",
            lifetime=Lifetime.PER_STREAM,
            retention=SlidingWindow(window=lorder, initial=lorder),
            holds_call=False,
        ),)
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
