"""The operator's call as an explicit-state step, ``step(inputs, sites) -> (outputs, sites)``: what the
capture stage exports and the verify stage runs beside the stock call, and the helpers both use to
read a call's output and state."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..binding import (
    RETURN,
    SELF,
    Site,
    get_path,
    set_path,
)
from ..replay.signature import is_dense


class Step(torch.nn.Module):
    """The operator's call with its state made explicit: the sites come in as arguments and go
    out as results, on `roots`, a private copy of the state objects. The output's tensors are
    returned flat; `output_structure` of a stock output rebuilds it."""

    def __init__(self, model: Any, method, roots: dict[str, Any], sites: list[Site], trims: dict[int, tuple[int, int, int]]):
        super().__init__()
        if isinstance(model, torch.nn.Module):
            # Registered, so the export lifts the model's weights as parameters the graphs share
            # with it; unregistered, every class's graph would hold a copy of them as constants.
            self.model = model
        self.method, self.roots, self.sites, self.trims = method, roots, sites, trims

    def forward(self, inputs: dict[str, Any], state: list):
        for site, value in zip(self.sites, state):
            set_path(self.roots, site.path, value)
        out = caller_trimmed(self.method(**inputs, **root_arguments(self.roots)), self.sites, self.trims)
        leaves, _ = output_structure(out, self.roots)
        return [x for x in leaves if isinstance(x, torch.Tensor)], state_after(self.sites, self.roots, out)


def caller_trim(value: torch.Tensor, axis: int, keep: int, head: int) -> torch.Tensor:
    """A region's retention of a returned state, as its caller cuts it: the whole state while it is
    no longer than `keep`, else its last `keep` units, or its first `head` and last `keep - head`
    (negative slices, the form the window pass reads)."""
    if value.shape[axis] <= keep:
        return value
    index = (slice(None),) * axis
    tail = value[index + (slice(head - keep, None),)]
    return torch.cat([value[index + (slice(None, head),)], tail], dim=axis) if head else tail


def caller_trimmed(out: Any, sites: list[Site], trims: dict[int, tuple[int, int, int]]) -> Any:
    """The call's output with each state its caller trims (`trims`: (axis, keep, head) by site
    index, the binding's `caller_trims` regions) cut to the region's retention."""
    if not trims:
        return out
    holder = {RETURN: out}
    for i, (axis, keep, head) in trims.items():
        out = sites[i].out
        assert out is not None  # the binding refuses `caller_trims` on a region that is not returned (`out`)
        set_path(holder, out, caller_trim(get_path(holder, out), axis, keep, head))
    return holder[RETURN]


def root_arguments(roots: dict[str, Any]) -> dict[str, Any]:
    """The state roots that are the method's arguments (not the model itself)."""
    return {name: value for name, value in roots.items() if name != SELF}


def private_roots(roots: dict[str, Any], shared: list[torch.Tensor]) -> dict[str, Any]:
    """A copy of the state roots for a trace: state objects copied whole, the model's modules copied
    around the very same weight and buffer tensors (a traced write lands on the copy's attribute).
    `shared` (the sites' tensors) are not copied either: the step puts its traced inputs in their
    place before the method runs, and a copy of a cache would cost its size (a batch's rings: GBs)."""
    memo: dict[int, Any] = {id(t): t for t in shared}
    model = roots.get(SELF)
    if isinstance(model, torch.nn.Module):
        memo.update({id(t): t for t in (*model.parameters(), *model.buffers())})
    return copy.deepcopy(roots, memo)


def state_after(sites: list[Site], roots: dict[str, Any], out: Any) -> list:
    """Each site's state after a call: in the state object it mutated, or in what it returned."""
    return [get_path({RETURN: out}, s.out) if s.out else get_path(roots, s.path) for s in sites]


class OpaqueOutput(TypeError):
    """The method returns an object holding tensors that torch's pytree cannot flatten."""


def holds_tensors(value: Any) -> bool:
    if isinstance(value, type):
        return False
    names = (
        [f.name for f in dataclasses.fields(value)] if dataclasses.is_dataclass(value) else list(getattr(value, "__dict__", ()))
    )
    return any(isinstance(getattr(value, name, None), torch.Tensor) for name in names)


def output_structure(out: Any, roots: dict[str, Any]) -> tuple[list, tuple]:
    """The output's leaves (the state objects kept whole) and (treespec, its non-tensor leaves by
    position, a state object by its argument name)."""
    leaves, spec = pytree.tree_flatten(out, is_leaf=lambda x: any(x is r for r in roots.values()))
    others = {}
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            root = next((name for name, r in roots.items() if r is leaf), None)
            if root is None and holds_tensors(leaf):
                # Kept whole, it would be the first call's object, its tensors returned by every later call.
                kind = type(leaf)
                raise OpaqueOutput(
                    f"the call returns an object of type {kind.__name__} holding tensors, which torch's pytree does not "
                    f"flatten; register it (torch.utils._pytree.register_dataclass({kind.__name__}) for a "
                    "dataclass) or return a tuple, list or dict"
                )
            others[i] = ("root", root) if root is not None else ("value", leaf)
    return leaves, (spec, others)


def input_shapes(inputs: dict[str, Any]) -> tuple:
    """The input tensors' shapes, by path."""
    return tuple(
        (pytree.keystr(path), tuple(leaf.shape))
        for path, leaf in pytree.tree_flatten_with_path(inputs)[0]
        if isinstance(leaf, torch.Tensor)
    )


def staged_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    """The copied inputs as the graphs take them: a view that is not dense (a slice of a longer
    signal) copied to a contiguous tensor, values unchanged, so a replay can stage it; the stock
    call keeps the caller's own, and verification compares the two."""
    return {
        name: value.contiguous() if isinstance(value, torch.Tensor) and not is_dense(value) else value
        for name, value in inputs.items()
    }


def writes_in_place(node: torch.fx.Node) -> bool:
    """Whether `node` calls an in-place (mutable-schema) op, which writes its first argument."""
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and schema.is_mutable and bool(node.args)
