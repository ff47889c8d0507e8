"""Piecewise capture: operators that cannot be captured become cuts between graph segments.

Some operators cannot live inside a CUDA graph: `torch.istft` synchronises with the host to check
its window envelope, `.item()` reads a device value on the host. Rather than refusing the whole
class, `Piecewise` (a `CaptureHook`) cuts the callable at each such call while the engine
captures: the graph segment so far is closed and replayed, the operator runs eagerly, its tensor
results are staged in static buffers, and the next segment is captured reading them. At replay
the segments are replayed in order with the operator re-run eagerly between them on the same
(refreshed) buffers. The class certificate lists every cut, how often it ran per call, and why.

A cut whose result is a Python value (`.item()`) was baked into the following segment, so each
replay re-checks it (a guard): if the value changed, a call without in-place effects is rewound
(device RNG) and run eagerly (`cut_guard`); otherwise the engine raises `ReplayError`.

Cut points are torch functions matched by identity (`CutPoint(torch.istft, ...)`), together with
the aten operator an exported graph calls in their place (`aten.istft`), or a Python method an
adapter names with `cut_method(owner, "attr", reason)`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cadence_fx.replay import NOT_HANDLED, CaptureContext, current_capture

__all__ = ["CutPoint", "ISTFT", "ITEM", "DEFAULT_CUTS", "Piecewise", "cut_method"]


@dataclass(frozen=True)
class CutPoint:
    """A torch function (matched by identity) that is run eagerly between graph segments; `aten`
    is the operator (every overload of it) that an exported graph calls instead."""

    target: Callable[..., Any]
    reason: str
    name: str = ""
    aten: torch._ops.OpOverloadPacket | None = None

    @property
    def label(self) -> str:
        return self.name or getattr(self.target, "__qualname__", repr(self.target))


ISTFT = CutPoint(torch.istft, "host sync: istft checks its window envelope on the host", "torch.istft", torch.ops.aten.istft)
ITEM = CutPoint(
    torch.Tensor.item,
    "host sync: .item() reads a device value on the host (baked into the next segment and guarded on every replay)",
    "Tensor.item",
    torch.ops.aten.item,
)
DEFAULT_CUTS: tuple[CutPoint, ...] = (ISTFT,)


class Piecewise:
    """CaptureHook that turns each declared cut point into a cut."""

    def __init__(self, cuts: Sequence[CutPoint] = DEFAULT_CUTS):
        self.cuts = tuple(cuts)
        # keyed by torch functions and by aten operator packets alike
        self._by_target: dict[object, CutPoint] = {c.target: c for c in self.cuts}
        self._by_target.update({c.aten: c for c in self.cuts if c.aten is not None})

    def intercept(self, ctx: CaptureContext, func: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        cut = self._by_target.get(func) or self._by_target.get(getattr(func, "overloadpacket", None))
        if cut is None:
            return NOT_HANDLED
        return ctx.cut(cut.label, cut.reason, func, args, kwargs)


def cut_method(owner: Any, attr: str, reason: str, name: str | None = None) -> Callable[[], None]:
    """Make `owner.attr` (a Python callable, e.g. a vendor module's method) a cut point.

    Outside an engine's probe or capture the original runs untouched. Returns a function that
    undoes the patch.
    """
    had_own = attr in vars(owner)
    original = getattr(owner, attr)
    label = name or f"{type(owner).__name__}.{attr}"

    @functools.wraps(original)
    def cut(*args: Any, **kwargs: Any) -> Any:
        ctx = current_capture()
        if ctx is None:
            return original(*args, **kwargs)
        return ctx.cut(label, reason, original, args, kwargs)

    setattr(owner, attr, cut)

    def undo() -> None:
        if had_own:
            setattr(owner, attr, original)
        else:
            delattr(owner, attr)

    return undo
