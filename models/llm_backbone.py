"""The out-of-scope example: a unit-stride LLM backbone over a 2,000-token sliding window.

Every decode step attends over one more key until the window fills, so the derived catalog has
W / s + 1 = 2,001 classes: far past any capture budget, and reported as outside lossless scope.
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
)
from cadence_fx.passes.retention import SlidingWindow

__all__ = ["llm_backbone_contract"]


def llm_backbone_contract(*, window: int = 2000, layers: int = 32, heads: int = 32, head_dim: int = 128) -> Contract:
    return Contract(
        family="llm_backbone",
        clocks=(Clock("token", ClockKind.TOKENS), Clock("step", ClockKind.CALLS)),
        rates=(Rate("token", "step", 1),),
        quantities={"layers": layers, "heads": heads, "head_dim": head_dim},
        regions=(
            Region(
                "kv",
                dims=("layers", 2, 1, "heads", "token", "head_dim"),
                axis=4,
                clock="token",
                stride=1,
                dtype="bfloat16",
                lifetime=Lifetime.PER_STREAM,
                retention=SlidingWindow(window=window),
            ),
        ),
        operators=(Operator("decode_step", "kv", steady=1),),
        admission=Admission("token", max_per_call=1),
        interactivity=Interactivity(stages=("decode",)),
    )
