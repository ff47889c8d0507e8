"""The window pass: per-call concat-then-slice retention rewritten into in-place carry writes.

Chunked streaming encoders retain state inside the step itself: each layer builds its operand
as ``cat([retained, new])`` and returns ``operand[..., -W:]`` as the next call's state (Freeze-Omni's
K/V window and its convolution's left context). Every call allocates a new operand and a new
retained view at new addresses. `rewrite_windows` finds these sites on an exported step graph
by pattern, from each retention output back to the concat of a region's input, checks their axis
and extents against the adapter's declaration, and rewrites them onto `WindowCarry` buffers that
keep one physical address for the life of the stream:

* **held** (the region holds the call's units, as an attention K/V cache): the concat becomes
  `window_append`, an in-place write of the new units behind the retained ones, and the carry view
  ``[retained | new]`` is the operand, with the stock concat's shape, strides and order, so every
  reduction over it sees the same operands in the same order. The slice becomes `window_evict`, an
  in-place compaction of the last W units to the front, placed after every reader of the operand;
* **not held** (a convolution's left context): the concat stays, it builds the operand; the slice
  becomes `window_keep`, a copy of the last W units into the compact carry of W units;
* a retention output with no concat behind it (the first call of a stream keeps the new units
  whole) becomes `window_adopt`, a copy into the carry.
* a not-held context taken from the new units alone (``new[..., -W:]`` where the call brings at
  least W units: the same units as the concat's tail) becomes `window_adopt` too.

The retention is either the operand's last W units (``operand[..., -W:]``: a sliding window) or
its first P units plus its last H (``cat([operand[..., :P], operand[..., -H:]])``: a prompt, or
attention sinks, plus a window of history); the kept units are compacted into the carry's
front in that order either way.

Retention writes run after the step's last reader, just before its output, so no reader ever
sees a carry the step has already advanced. Other slices and in-place writes in the step (such as
a positional table filled by ``pe[:, 0::2] = sin(...)``) are not retention and are left alone.

With an auditor attached, each op evaluates the stock retention beside its carry write (the
concat and the slice of the stock code) and compares elementwise.
"""

from __future__ import annotations

import copy
import time
import warnings
from dataclasses import dataclass

import torch
import torch.fx
from torch.utils import _pytree as pytree

from cadence_fx.audit import ShadowAuditor
from cadence_fx.passes.carry import Carry, CarryError, RetentionSite, find_retention_sites, shared_memo

__all__ = [
    "CarryCounters",
    "Window",
    "WindowCarry",
    "WindowError",
    "rewrite_windows",
    "window_adopt",
    "window_append",
    "window_evict",
    "window_keep",
]

_SLICE = torch.ops.aten.slice.Tensor
_END = 2**63 - 1  # how an exported slice spells "to the end"


class WindowError(RuntimeError):
    """A declared retention site that the step graph does not have in the declared form."""


class WindowCarry(Carry):
    """The carry of one retention site (one layer's keys, values or conv context): a view of its
    region's buffer, with the site's name and, when auditing, the auditor and the stock operand
    of the current call."""

    def __init__(self, site: str, region: str, buffer: torch.Tensor, axis: int, auditor: ShadowAuditor | None = None):
        super().__init__(region, buffer, axis)
        self.site = site
        self.auditor = auditor
        self.retentions = 0  # calls whose retention this carry took since the last reset
        self._stock_operand: torch.Tensor | None = None

    def reset(self, base: torch.Tensor | None = None) -> torch.Tensor:
        """A new stream: the base state written in place (or nothing retained)."""
        self.retentions = 0
        self._stock_operand = None
        if base is None:
            self.extent = 0
            return self.view()
        return super().reset(base)

    def _audit(self, expected: torch.Tensor | None, *, evicted: bool) -> None:
        """One retention taken; with an auditor, `expected` (the stock retention) against the carry."""
        self.retentions += 1
        self._stock_operand = None
        if self.auditor is not None:
            if expected is None:
                raise CarryError(
                    f"{self.site}: auditing, but the stock retention of call {self.retentions} was not recorded "
                    "(a retention with no `window_append` before it on a held site)"
                )
            self.auditor.check(self.site, self.retentions, expected, self.view(), evicted=evicted, address=self.address)

    def _check_retained(self, retained: torch.Tensor) -> None:
        expected = self.view()
        if (
            retained.data_ptr() != expected.data_ptr()
            or retained.shape != expected.shape
            or retained.stride() != expected.stride()
        ):
            raise CarryError(
                f"{self.site}: the retained state passed in is not this carry's view "
                f"({tuple(retained.shape)} at {retained.data_ptr():#x}, expected {tuple(expected.shape)} at "
                f"{expected.data_ptr():#x}): pass the buffers the transformed step returned"
            )


class CarryCounters:
    """The window carries' host-side integers (retained extent, writes, retentions), as a replay
    engine's `HostCounters`: a graph replay runs no Python, so the engine moves them instead."""

    FIELDS = ("extent", "writes", "retentions")

    def __init__(self, carries: list[WindowCarry]):
        self.carries = list(carries)

    def read(self) -> list[int]:
        return [getattr(carry, name) for carry in self.carries for name in self.FIELDS]

    def write(self, values) -> None:
        values = list(values)
        if len(values) != len(self.carries) * len(self.FIELDS):
            raise ValueError(f"{len(values)} values for {len(self.carries)} carries of {len(self.FIELDS)} counters each")
        for i, carry in enumerate(self.carries):
            for j, name in enumerate(self.FIELDS):
                value = values[i * len(self.FIELDS) + j]
                if getattr(carry, name) != value:
                    # A plain int attribute: `Module.__setattr__`'s checks (parameters, buffers,
                    # submodules) cost more than the write, on every carry of every replayed call.
                    object.__setattr__(carry, name, value)


def window_append(carry: WindowCarry, retained: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``cat([retained, new])`` with `retained` already in the carry: `new` is written behind it in
    place; returns the carry view ``[retained | new]``, the operand."""
    carry._check_retained(retained)
    n = new.shape[carry.axis]
    if carry.extent + n > carry.capacity:
        raise CarryError(f"{carry.site}: {carry.extent} + {n} units exceed the carry's bound {carry.capacity}")
    if carry.auditor is not None:
        carry._stock_operand = torch.cat([retained, new], dim=carry.axis)
    carry.buffer.narrow(carry.axis, carry.extent, n).copy_(new)
    carry.extent += n
    carry.writes += 1
    return carry.view()


def _segments(keep: int, head: int) -> tuple[tuple[int, int | None], ...]:
    """The (start, stop) spans a retention of `keep` units keeps: its last `keep` units, or its
    first `head` plus its last `keep - head`."""
    return ((0, head), (head - keep, None)) if head else ((-keep, None),)


def _retention(t: torch.Tensor, axis: int, keep: int, head: int) -> torch.Tensor:
    """The stock retention of `t` along `axis` (for the auditor): the whole of `t` while it is no
    longer than `keep`."""
    n = t.shape[axis]
    if n <= keep:
        return t
    if not head:
        return t.narrow(axis, n - keep, keep)
    return torch.cat([t.narrow(axis, 0, head), t.narrow(axis, n - (keep - head), keep - head)], dim=axis)


def window_evict(carry: WindowCarry, operand: torch.Tensor, keep: int, head: int = 0) -> torch.Tensor:
    """The retention of `operand` (its last `keep` units, or its first `head` and last `keep - head`)
    as the retained state: compacted to the carry's front in place (nothing moves while the window
    is not yet full)."""
    evicted = operand.shape[carry.axis] > keep
    retained = carry.keep(operand, _segments(keep, head) if evicted else ((0, None),))
    stock = carry._stock_operand
    carry._audit(None if stock is None else _retention(stock, carry.axis, keep, head), evicted=evicted)
    return retained


def window_keep(carry: WindowCarry, retained: torch.Tensor, full: torch.Tensor, keep: int, head: int = 0) -> torch.Tensor:
    """The retention of `full` (an operand built outside the carry) copied into the carry in place."""
    carry._check_retained(retained)
    evicted = full.shape[carry.axis] > keep
    kept = carry.keep(full, _segments(keep, head) if evicted else ((0, None),))
    carry._audit(_retention(full, carry.axis, keep, head), evicted=evicted)
    return kept


def window_adopt(carry: WindowCarry, full: torch.Tensor) -> torch.Tensor:
    """`full` retained whole (nothing evicted yet): copied into the carry, or kept where it is."""
    stock = carry._stock_operand if carry._aliases(full) else full
    kept = carry.adopt(full)
    carry._audit(stock, evicted=False)
    return kept


for _op in (window_append, window_evict, window_keep, window_adopt):
    torch.fx.wrap(_op.__name__)


@dataclass(frozen=True)
class Window:
    """One retention site the adapter declares on a step graph.

    `output` is the leaf index of the retained state among the step's flattened outputs, `input`
    the placeholder that brings the retained state in (None on a call that has none yet). `axis`
    is the site's time axis, `keep` the units it retains (the region's retained bound), `live` the
    operand's extent in this class (retained + the call's units), `held` whether the region holds
    the call's units (the operand then lives in the carry), `head` the units it keeps from the
    operand's front (a prompt or attention sinks; 0 for a plain sliding window). `copy`: a state the
    step returns to its caller, who threads it back in; built where the pass does not follow it (not
    a concat of the retained state: a buffer a vendor writes and returns a view of), its kept units
    are copied into the carry, as taking it into the carry at the next call would; without `copy`
    such a site is refused.
    """

    site: str
    region: str
    output: int
    input: str | None
    axis: int
    keep: int
    live: int
    held: bool
    head: int = 0
    copy: bool = False


def _axis(node: torch.fx.Node, dim: int) -> int:
    return dim % node.meta["val"].dim()


def _extent(node: torch.fx.Node, axis: int) -> int:
    return int(node.meta["val"].shape[axis])


def _concat_pair(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, int] | None:
    """(first, second, dim) if `node` is an aten ``cat([first, second], dim)`` of two graph nodes, else None."""
    if node.op != "call_function" or node.target is not torch.ops.aten.cat.default:
        return None
    parts, dim = node.args[0], node.args[1] if len(node.args) > 1 else 0
    if not isinstance(parts, (list, tuple)) or len(parts) != 2 or not isinstance(dim, int):
        return None
    first, second = parts
    if not isinstance(first, torch.fx.Node) or not isinstance(second, torch.fx.Node):
        return None
    return first, second, dim


def _tail_slice(node: torch.fx.Node) -> tuple[torch.fx.Node, int, int] | None:
    """(source, axis, units) if `node` is ``source[..., -units:]`` along one axis, else None."""
    if node.op != "call_function" or node.target is not _SLICE:
        return None
    source, dim, start, end, step = (*node.args, *(None,) * (5 - len(node.args)))[:5]
    dim, step = dim if dim is not None else 0, step if step is not None else 1
    if not isinstance(source, torch.fx.Node) or not isinstance(dim, int):
        return None
    if not isinstance(start, int) or start >= 0 or step != 1 or end not in (None, _END):
        return None
    return source, _axis(source, dim), -start


def _head_and_tail(node: torch.fx.Node) -> tuple[torch.fx.Node, int, int, int] | None:
    """(source, axis, head, tail) if `node` is ``cat([source[..., :head], source[..., -tail:]])``."""
    pair = _concat_pair(node)
    if pair is None:
        return None
    first, second, cat_dim = pair
    if not (first.op == "call_function" and first.target is _SLICE):
        return None
    last = _tail_slice(second)
    source, dim, start, end, step = (*first.args, *(None,) * (5 - len(first.args)))[:5]
    dim = dim if dim is not None else 0
    if (
        last is None
        or last[0] is not source
        or not isinstance(source, torch.fx.Node)
        or not isinstance(dim, int)
        or start not in (None, 0)
        or step not in (None, 1)
        or not isinstance(end, int)
        or not 0 < end < _END
    ):
        return None
    axis = _axis(source, dim)
    if last[1] != axis or _axis(node, cat_dim) != axis:
        return None
    return source, axis, end, last[2]


def _retention_of(leaf: torch.fx.Node) -> tuple[torch.fx.Node, int, int, int] | None:
    """(operand, axis, head, keep) when `leaf` trims an operand (its tail, or its head and tail)."""
    tail = _tail_slice(leaf)
    if tail is not None:
        return tail[0], tail[1], 0, tail[2]
    trim = _head_and_tail(leaf)
    if trim is not None:
        source, axis, head, last = trim
        return source, axis, head, head + last
    return None


def _erase_trim(gm: torch.fx.GraphModule, leaf: torch.fx.Node) -> None:
    """Erase a retention trim nothing reads any more, and the slices only it read."""
    if leaf.users:
        return
    pair = _concat_pair(leaf)
    parts = [] if pair is None else list(pair[:2])
    gm.graph.erase_node(leaf)
    for part in parts:
        if isinstance(part, torch.fx.Node) and not part.users:
            gm.graph.erase_node(part)


def _adopt(gm: torch.fx.GraphModule, output: torch.fx.Node, carry: torch.fx.Node, leaf: torch.fx.Node) -> torch.fx.Node:
    """The step's retained `leaf` copied into the carry after its last reader: the graph returns the carry."""
    with gm.graph.inserting_before(output):
        kept = gm.graph.call_function(window_adopt, (carry, leaf))
    output.replace_input_with(leaf, kept)
    return kept


def rewrite_windows(gm: torch.fx.GraphModule, windows: tuple[Window, ...], carries: dict[str, WindowCarry], *, graph: str):
    """Rewrite every declared window of `gm` onto its carry (`carries` by site name).

    Returns the rewritten GraphModule (a new one; `gm` is left as it was), one `RetentionSite`
    per window saying what was found and done, and the pass's stamp. A declared window the graph
    does not have in the declared form raises `WindowError`: the carry would not hold the state.
    With no window declared (every site a ring or a counter), `gm` itself: nothing to rewrite, and
    no copy of a large graph to make (Moshi's LM step took 0.5 to 2.5 s a class).
    """
    if not windows:
        return gm, [], f"window pass on {graph}: no window site declared, the graph runs as exported"
    started = time.perf_counter()
    with warnings.catch_warnings():
        # torch.fx's Graph.__deepcopy__ copies the pytree codegen, whose LeafSpec copy warns about
        # an isinstance check inside torch itself.
        warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning)
        gm = copy.deepcopy(gm, shared_memo(gm))
    nodes = {n.name: n for n in gm.graph.nodes}
    output = next(n for n in gm.graph.nodes if n.op == "output")
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    leaves = pytree.tree_leaves(output.args)
    regions = {w.input: w.region for w in windows if w.input is not None}
    appends = {s.node for s in find_retention_sites(gm, regions, graph=graph) if s.kind == "append"}
    sites = []
    for w in windows:
        leaf = leaves[w.output]
        tail = _retention_of(leaf)
        cat = tail[0] if tail else leaf
        if tail is None and w.input is not None and leaf.op == "placeholder" and leaf.name == w.input:
            # The step reads the site and leaves it as it came (another operator retains into it).
            sites.append(
                RetentionSite(
                    graph,
                    leaf.name,
                    w.region,
                    w.axis,
                    "read",
                    False,
                    f"read ({w.site}): the step returns it as it came; the carry passes through",
                )
            )
            continue
        attr = "carry_" + "".join(c if c.isalnum() else "_" for c in w.site)
        gm.add_submodule(attr, carries[w.site])
        with gm.graph.inserting_before(first):
            carry = gm.graph.get_attr(attr)
        if cat.name in appends:
            kept, done = _rewrite_concat(gm, graph, w, carry, leaf, cat, tail, nodes.get(w.input), output)
            kind = "append"
        elif w.input is None:
            # The first call of a stream: whatever the step retains (the new units, or a trim of
            # the concat with an empty state the stock code made itself) is copied into the carry.
            expected = w.live if tail is None else min(w.live, w.keep)
            if _extent(leaf, w.axis) != expected:
                raise WindowError(
                    f"{graph}: {w.site}: {leaf.name} has extent {_extent(leaf, w.axis)}, the catalog class declares {expected}"
                )
            kept = _adopt(gm, output, carry, leaf)
            kind, done = "keep", "the new units, kept whole, copied into the carry in place"
        elif (
            not w.held and not w.head and tail is not None and tail[1:] == (w.axis, 0, w.keep) and _extent(cat, w.axis) >= w.keep
        ):
            # The last W of [retained | new] taken from the new units alone, which fill the window
            # (transformers' Mimi: `hidden_states[..., -padding:]`): the same units, copied into the
            # carry after the step's last reader of it.
            kept = _adopt(gm, output, carry, leaf)
            kind, done = "keep", f"the last {w.keep} of the new units (they fill the window) copied into the carry in place"
        elif w.copy:
            kept, done = _copy_retained(gm, graph, w, carry, leaf, tail, nodes.get(w.input), output)
            kind = "keep"
        else:
            raise WindowError(
                f"{graph}: {w.site}: retention output {leaf.name} is neither a concat of "
                f"{w.input} and new units nor new units kept whole"
            )
        sites.append(RetentionSite(graph, leaf.name, w.region, w.axis, kind, True, f"rewritten ({w.site}): {done}"))
    gm.graph.lint()
    gm.recompile()
    took = (time.perf_counter() - started) * 1e3
    stamp = f"window pass on {graph}: {len(sites)} of {len(windows)} declared sites rewritten, took {took:.1f} ms"
    return gm, sites, stamp


def carry_node_strides(gm: torch.fx.GraphModule, carry: torch.fx.Node, extent: int) -> tuple[int, ...]:
    """Strides of the carry view of `extent` units that a `get_attr` carry node stands for."""
    module = gm.get_submodule(carry.target) if isinstance(carry.target, str) else None
    if not isinstance(module, Carry):
        raise WindowError(f"{carry.name} is not a get_attr of a carry (target {carry.target!r}, found {type(module).__name__})")
    return tuple(module.view(extent).stride())


def _rewrite_concat(gm, graph, w: Window, carry, leaf, cat, tail, retained_input, output):
    """One ``[retained | new]`` concat and its optional tail slice (`leaf` is the retention output,
    the slice or the concat itself). Returns (kept node, what was done)."""
    (retained, new), dim = cat.args[0], cat.args[1] if len(cat.args) > 1 else 0
    if retained is not retained_input or _axis(cat, dim) != w.axis:
        raise WindowError(
            f"{graph}: {w.site}: {cat.name} concatenates {retained} along axis {_axis(cat, dim)}, "
            f"declared {w.input} along axis {w.axis}"
        )
    if _extent(cat, w.axis) != w.live:
        raise WindowError(
            f"{graph}: {w.site}: operand {cat.name} has extent {_extent(cat, w.axis)} along "
            f"axis {w.axis}, the catalog class declares {w.live}"
        )
    _check_retention(graph, w, tail)
    if w.held:
        cat_strides = tuple(cat.meta["val"].stride())
        with gm.graph.inserting_before(cat):
            operand = gm.graph.call_function(window_append, (carry, retained, new))
        cat.replace_all_uses_with(operand)
        gm.graph.erase_node(cat)
        if leaf is cat:
            leaf = operand
        with gm.graph.inserting_before(output):
            kept = gm.graph.call_function(
                window_evict if tail else window_adopt, (carry, operand, w.keep, w.head) if tail else (carry, operand)
            )
        layout = (
            "its strides are the stock concat's"
            if carry_node_strides(gm, carry, w.live) == cat_strides
            else f"a strided view of the {w.live}-unit prefix (the stock concat is contiguous)"
        )
        done = (
            f"[retained | new] written in place at offset {w.live - _extent(new, w.axis)} of the carry is the "
            f"operand, {layout}; "
            + (f"{_kept(w.keep, w.head)} compacted in place after the last reader" if tail else "kept whole")
        )
    else:
        with gm.graph.inserting_before(output):
            kept = gm.graph.call_function(window_keep, (carry, retained, cat, w.keep if tail else w.live, w.head if tail else 0))
        copied = _kept(w.keep if tail else w.live, w.head if tail else 0)
        done = f"operand concat kept; {copied} copied into the compact carry in place"
    output.replace_input_with(leaf, kept)
    if tail is not None:
        _erase_trim(gm, leaf)
    return kept, done


def _check_retention(graph: str, w: Window, tail) -> None:
    """A trim the step makes (`tail`: `_retention_of` its output, None for none) must keep what the
    region retains, along its axis."""
    if tail and (tail[1] != w.axis or tail[3] != w.keep or tail[2] != w.head):
        kept = f"the first {tail[2]} and last {tail[3] - tail[2]}" if tail[2] else f"the last {tail[3]}"
        declared = f"the first {w.head} and last {w.keep - w.head}" if w.head else f"the last {w.keep}"
        raise WindowError(
            f"{graph}: {w.site}: the retention keeps {kept} units along axis {tail[1]}, "
            f"the region retains {declared} along axis {w.axis}"
        )


def _copy_retained(gm, graph, w: Window, carry, leaf, tail, retained_input, output):
    """A retained state the step builds itself (`leaf`: its retention, or the state whole while it
    fits): the kept units copied into the carry after the step's last reader. Returns (kept node,
    what was done)."""
    _check_retention(graph, w, tail)
    operand = leaf if tail is None else tail[0]
    with gm.graph.inserting_before(output):
        kept = gm.graph.call_function(window_keep, (carry, retained_input, operand, w.keep, w.head))
    output.replace_input_with(leaf, kept)
    if tail is not None:
        _erase_trim(gm, leaf)
    return (
        kept,
        f"built by the step ({operand.name}); {_kept(w.keep, w.head)} copied into the carry in place after the last reader",
    )


def _kept(keep: int, head: int) -> str:
    return f"its first {head} and last {keep - head} units" if head else f"its last {keep} units"
