"""The carry pass: concat-based retention rewritten into in-place writes to a fixed-address carry.

Stock streaming code retains a cache by concatenating and slicing, which allocates a new tensor
at a new address every call. A `Carry` is one buffer allocated once at the region's declared
bound; every retention writes the kept units into it in place, in the stock code's physical order
(reductions over the cache then see the same operands in the same order, so no bit changes).

`find_retention_sites` finds two kinds of site on an FX graph, which the window pass
(`passes/window.py`) rewrites onto the carries:

* a **trim** (``cat([c[..., :head], c[..., -tail:]])``, the prompt-head plus recent-tail trim);
* an **operand concat** (``cat([new, cache])`` prepending, or ``cat([cache, new])`` appending,
  inside an attention), reported with its ordering.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx

__all__ = [
    "Carry",
    "CarryError",
    "RetentionSite",
    "find_retention_sites",
    "stock_trim",
]


class CarryError(RuntimeError):
    """A write the carry cannot take without changing results (overflow, foreign aliasing)."""


class Carry(torch.nn.Module):
    """One region's state at one physical address for the life of a stream.

    `extent` is the number of units currently retained along `axis`; `view()` is the retained
    state, a view of the buffer starting at offset 0. A module, so graphs can own it.
    """

    buffer: torch.Tensor  # registered as a (non-persistent) buffer in `__init__`

    def __init__(self, region: str, buffer: torch.Tensor, axis: int):
        super().__init__()
        self.region = region
        self.register_buffer("buffer", buffer, persistent=False)
        self.axis = axis
        self.extent = 0
        self.writes = 0

    @property
    def capacity(self) -> int:
        return self.buffer.shape[self.axis]

    @property
    def address(self) -> int:
        return self.buffer.data_ptr()

    def view(self, extent: int | None = None) -> torch.Tensor:
        return self.buffer.narrow(self.axis, 0, self.extent if extent is None else extent)

    def holds(self, t: torch.Tensor) -> bool:
        """`t` is the retained state as `view()` gives it: at the buffer's address, with its dtype
        and strides, `extent` units along the axis and the buffer's size on every other dim."""
        buffer = self._buffers["buffer"]  # straight from the table: `Module.__getattr__` is Python, every call
        if buffer is None:
            raise CarryError(f"{self.region}: the carry's buffer was set to None; a carry always holds its buffer")
        held = self.__dict__.get("_held")
        if (
            held is not None
            and held[0] is t
            and held[1] == self.extent
            and held[2] is buffer
            and held[3] == (t.data_ptr(), t.shape, t.stride(), t.dtype, buffer.data_ptr(), buffer.shape, buffer.stride())
        ):
            return True  # the very tensor last found to be the view, it and the buffer unchanged, at the same extent
        if t.data_ptr() != buffer.data_ptr() or t.dtype != buffer.dtype or t.stride() != buffer.stride():
            return False
        shape, axis = t.shape, self.axis
        if shape[axis] == self.extent and shape[:axis] == buffer.shape[:axis] and shape[axis + 1 :] == buffer.shape[axis + 1 :]:
            key = (t.data_ptr(), shape, t.stride(), t.dtype, buffer.data_ptr(), buffer.shape, buffer.stride())
            object.__setattr__(self, "_held", (t, self.extent, buffer, key))
            return True
        return False

    def _aliases(self, full: torch.Tensor) -> bool:
        return full.data_ptr() == self.buffer.data_ptr() and full.stride() == self.buffer.stride()

    def adopt(self, full: torch.Tensor) -> torch.Tensor:
        """Take `full` as the retained state: a view of the carry is adopted as is, anything else
        is copied in. Used when the stock code keeps the whole tensor."""
        return self.keep(full, ((0, full.shape[self.axis]),))

    def keep(self, full: torch.Tensor, segments: tuple[tuple[int, int | None], ...]) -> torch.Tensor:
        """Write the `segments` (start, stop) of `full` along the axis, in order, to the carry's
        front, in place; return the retained view. A stop of None is the axis's end, as in a slice.

        `full` is either a view of the carry at offset 0 (the stock code wrote into the carry
        itself: the kept units are compacted leftwards, piece by piece so no copy overlaps) or a
        tensor outside the carry (copied in).
        """
        n = full.shape[self.axis]
        spans = [slice(start, stop).indices(n)[:2] for start, stop in segments]
        total = sum(stop - start for start, stop in spans)
        if total > self.capacity:
            raise CarryError(f"{self.region}: {total} units exceed the carry's bound {self.capacity}")
        aliased = self._aliases(full)
        storage = self.buffer.untyped_storage().data_ptr()
        if not aliased and full.untyped_storage().data_ptr() == storage:
            raise CarryError(f"{self.region}: the input aliases the carry at another offset or stride")
        dst = 0
        previous_stop = 0
        for start, stop in spans:
            if start < previous_stop or stop < start:
                raise CarryError(f"{self.region}: segments {spans} are not ordered and disjoint")
            length = stop - start
            if aliased:
                self._move_left(start, dst, length)
            else:
                self.buffer.narrow(self.axis, dst, length).copy_(full.narrow(self.axis, start, length))
            dst += length
            previous_stop = stop
        self.extent = dst
        self.writes += 1
        return self.view()

    def _move_left(self, src: int, dst: int, length: int) -> None:
        if src == dst or length == 0:
            return
        step = src - dst  # pieces no longer than the shift never overlap their destination
        for offset in range(0, length, step):
            piece = min(step, length - offset)
            self.buffer.narrow(self.axis, dst + offset, piece).copy_(self.buffer.narrow(self.axis, src + offset, piece))

    def reset(self, base: torch.Tensor) -> torch.Tensor:
        """Turn reset: write the base state into the carry in place."""
        return self.adopt(base)


def stock_trim(cache: torch.Tensor, axis: int, head: int, tail: int) -> torch.Tensor:
    """The stock prompt-head plus recent-tail trim: the first `head` and last `tail` units."""
    prefix = (slice(None),) * axis
    return torch.cat([cache[prefix + (slice(None, head),)], cache[prefix + (slice(-tail, None),)]], dim=axis)


@dataclass(frozen=True)
class RetentionSite:
    graph: str
    node: str
    region: str
    axis: int
    kind: str  # "trim", "prepend" or "append"
    rewritten: bool
    reason: str


_CATS = {torch.cat, torch.ops.aten.cat.default, torch.concat}
_VIEWS = {
    operator.getitem,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.select.int,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.split_with_sizes.default,
    torch.ops.aten.chunk.default,
    torch.ops.aten.view.default,
    torch.ops.aten.unsqueeze.default,
    torch.ops.aten.squeeze.dim,
    torch.ops.aten.alias.default,
    torch.ops.aten.narrow.default,
    torch.narrow,
}


def _cat_parts(node: torch.fx.Node) -> tuple[list[torch.fx.Node], int] | None:
    """The concatenated nodes and the dim of a concat node; None for any other node, or a concat
    whose operands are not all graph nodes or whose dim is not a plain int (not a site the pass
    can reason about)."""
    if node.op != "call_function" or node.target not in _CATS:
        return None
    tensors = node.args[0] if node.args else node.kwargs["tensors"]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not isinstance(tensors, (list, tuple)) or not isinstance(dim, int):
        return None
    parts = [t for t in tensors if isinstance(t, torch.fx.Node)]
    return (parts, dim) if len(parts) == len(tensors) else None


def _source(node, inputs: dict[str, str]) -> str | None:
    """The region whose input `node` is a view of, following view-like ops back to a placeholder."""
    while isinstance(node, torch.fx.Node):
        if node.op == "placeholder":
            return inputs.get(node.name)
        if node.op == "call_function" and node.target in _VIEWS:
            node = node.args[0]
            continue
        if node.op == "call_method" and node.target in {"chunk", "split", "narrow", "view", "__getitem__"}:
            node = node.args[0]
            continue
        return None
    return None


def _rank(node: torch.fx.Node) -> int | None:
    value = node.meta.get("val", node.meta.get("example_value"))
    return value.dim() if isinstance(value, torch.Tensor) else None


def find_retention_sites(gm: torch.fx.GraphModule, inputs: dict[str, str], *, graph: str) -> list[RetentionSite]:
    """Every concat along a cache axis in `gm`. `inputs` maps placeholder names to regions."""
    sites = []
    for node in gm.graph.nodes:
        parts = _cat_parts(node)
        if parts is None:
            continue
        tensors, dim = parts
        sources = [_source(t, inputs) for t in tensors]
        regions = {s for s in sources if s}
        if not regions:
            continue
        if len(regions) > 1:
            sites.append(
                RetentionSite(
                    graph, node.name, ",".join(sorted(regions)), dim, "mixed", False, "left in place: concatenates two regions"
                )
            )
            continue
        (region,) = regions
        rank = _rank(tensors[0])
        axis = dim % rank if rank else dim
        if all(sources):
            kind, reason = "trim", "trim of one region"
        elif sources[-1] and not sources[0]:
            kind = "prepend"
            reason = "left in place: builds the attention operand [new | cache]; the stock buffer write carries it"
        elif sources[0] and not sources[-1]:
            kind = "append"
            reason = "left in place: builds the attention operand [cache | new]; the stock buffer write carries it"
        else:
            kind, reason = "mixed", "left in place: the cache sits between new units"
        sites.append(RetentionSite(graph, node.name, region, axis, kind, False, reason))
    return sites


def shared_memo(gm: torch.fx.GraphModule) -> dict[int, object]:
    """A `copy.deepcopy` memo under which the copy shares every tensor `gm`'s modules hold (the
    weights and buffers, and the constants `torch.export` lifted: `lifted_tensor_*`, views of the
    model's own weights that a graph only reads) and its (immutable) pytree specs: a rewritten
    graph costs its nodes, not a second copy of the model."""
    shared: list[object] = [*gm.parameters(), *gm.buffers()]
    shared += [value for module in gm.modules() for value in vars(module).values() if isinstance(value, torch.Tensor)]
    shared += [getattr(gm, name) for name in ("_in_spec", "_out_spec") if hasattr(gm, name)]
    return {id(x): x for x in shared}
