"""FX capture front end: a `torch.fx.GraphModule` per hot operator, shapes in clock symbols.

`torch.fx.symbolic_trace` fails on the real targets (einops, shape unpacking, Python control
flow); `torch.export(strict=False)` succeeds. Cache axes are exported as dynamic dimensions named
after the contract's clocks, so every node's shape metadata reads in clock terms (for example
``mel_frame + 50``). When the model's own guards refuse a dynamic axis, the operator is captured
at the catalog class it was given, and the capture says so.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.fx

__all__ = ["Captured", "capture", "node_shape", "without_stack_traces"]


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


@dataclass(frozen=True)
class Captured:
    name: str
    graph_module: torch.fx.GraphModule
    symbolic: bool  # True when the clock axes are symbolic dims
    stamp: str


def node_shape(node: torch.fx.Node) -> str | None:
    """A node's shape as text, symbolic dims by their expression; None for non-tensors."""
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        return "(" + ", ".join(str(d) for d in value.shape) + ")"
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return "[" + ", ".join("(" + ", ".join(str(d) for d in v.shape) + ")" for v in value) + "]"
    return None


def capture(
    name: str,
    module: torch.nn.Module,
    args: tuple,
    *,
    clocks: dict[str, dict[int, str]] | None = None,
    max_extent: int = 4096,
) -> Captured:
    """Export `module(*args)`; `clocks` maps an argument name to {axis: clock name}."""
    started = time.perf_counter()
    clocks = clocks or {}
    parameters = list(inspect.signature(module.forward).parameters)
    unknown = set(clocks) - set(parameters)
    if unknown:
        raise ValueError(f"{name}: clock axes given for unknown arguments {sorted(unknown)}; arguments: {parameters}")
    dims = {clock: torch.export.Dim(clock, min=2, max=max_extent) for axes in clocks.values() for clock in axes.values()}
    dynamic = tuple({axis: dims[clock] for axis, clock in clocks[p].items()} if p in clocks else None for p in parameters)
    symbolic = bool(clocks)
    reason = ""
    with torch.no_grad(), without_stack_traces():
        try:
            program = torch.export.export(module, args, dynamic_shapes=dynamic if symbolic else None, strict=False)
        except Exception as error:  # the model's guards specialise the axis: capture the class as given
            if not symbolic:
                raise
            symbolic = False
            reason = f" (dynamic {sorted(dims)} refused: {type(error).__name__}; captured at the given class)"
            program = torch.export.export(module, args, strict=False)
    gm = program.module()  # keeps each node's "val" (its shape metadata)
    took = (time.perf_counter() - started) * 1e3
    kind = "symbolic in " + ", ".join(sorted(dims)) if symbolic else "static"
    stamp = f"capture of {name}: torch.export(strict=False), {len(gm.graph.nodes)} nodes, {kind}, took {took:.0f} ms{reason}"
    return Captured(name, gm, symbolic, stamp)
