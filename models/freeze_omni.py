"""Freeze-Omni: the contract of its chunk-wise streaming speech encoder.

Two retentions: each attention layer keeps the K/V of `left_chunks` previous chunks
(concat-then-trim), and each convolution module keeps a left context of `lorder` frames. With one
left chunk the attended extent is one chunk on the first call and two afterwards: K = 2, derived.
"""

from __future__ import annotations

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

__all__ = ["freeze_omni_contract"]


def freeze_omni_contract(
    *,
    chunk_frames: int = 4,
    left_chunks: int = 1,
    subsampling: int = 4,
    blocks: int = 24,
    d_model: int = 1024,
    heads: int = 16,
    lorder: int = 2,
) -> Contract:
    """`chunk_frames` is the chunk in encoder frames (16 fbank frames through 4x subsampling)."""
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
        regions=(
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
        ),
        operators=(Operator("encoder_chunk", "attention_kv", steady=chunk_frames),),
        admission=Admission("encoder_frame", max_per_call=chunk_frames),
        interactivity=Interactivity(stages=("fbank", "encoder")),
    )
