"""What tracing leaves on a graph: no Python stack trace per node where torch can leave it out
(`without_stack_traces`, around every export), and a node's shape as text (`node_shape`, for the
graph-diff report), symbolic dims by their expression."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.fx

__all__ = ["node_shape", "without_stack_traces"]


@contextlib.contextmanager
def without_stack_traces() -> Iterator[None]:
    """Tracing that records no Python stack trace per node (`torch.fx.config.do_not_emit_stack_traces`,
    where this torch has it): nothing here reads a node's `stack_trace`, and extracting one per node
    was a fifth of a Token2Wav CFM loop's export (10.0 s -> 6.5 to 8.8 s a class, reduced depth,
    2 CPU cores)."""
    config = torch.fx.config
    if not hasattr(config, "do_not_emit_stack_traces"):
        yield
        return
    before = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = before


def node_shape(node: torch.fx.Node) -> str | None:
    """A node's shape as text, symbolic dims by their expression; None for non-tensors."""
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        return "(" + ", ".join(str(d) for d in value.shape) + ")"
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return "[" + ", ".join("(" + ", ".join(str(d) for d in v.shape) + ")" for v in value) + "]"
    return None
