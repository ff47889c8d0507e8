"""Program equivalence: the ATen program a call runs, recorded under a dispatch mode, and the first
place two such programs differ.

A sampled comparison of values cannot tell "the same program" from "another program that agreed
on these inputs" (a mask materialised where the stock call lets SDPA apply `is_causal`; a position
frozen at capture that the stock code derives from a host counter). So at capture the exported
step and the stock call each run under `OpTrace`, fed the very same tensors, and their traces must
name the same ops with the same shapes, strides, dtypes, devices and non-tensor arguments. View
ops are left out of both (they move no data and export spells them differently); the ops that
compute or write are compared one for one, in order.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpRecord", "OpTrace", "first_difference"]


@dataclass(frozen=True)
class OpRecord:
    """One op a program ran: its ATen name and each argument as it saw it (a tensor by its
    shape, stride, dtype and device; anything else by value)."""

    op: str
    args: tuple

    def describe(self) -> str:
        return f"{self.op}({', '.join(_describe(a) for a in self.args)})"


def _describe(arg: Any) -> str:
    if isinstance(arg, tuple) and arg and arg[0] == "tensor":
        _, shape, stride, dtype, device, offset, *values = arg
        at = f" offset {offset}" if offset else ""
        held = f" holding {list(values[0])}" if values else ""
        return f"tensor{list(shape)} {str(dtype).removeprefix('torch.')} stride {list(stride)}{at} {device}{held}"
    if isinstance(arg, tuple) and len(arg) == 2 and isinstance(arg[0], str) and not arg[0].startswith("tensor"):
        return f"{arg[0]}={_describe(arg[1])}"
    return repr(arg)


#: A CPU tensor this small is described by its values too: a host value the code turned into a
#: tensor (`torch.tensor(n)`), which export freezes as a constant, shows in no op's arguments.
_SMALL = 8


def _leaf(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        described: tuple[Any, ...] = ("tensor", tuple(x.shape), tuple(x.stride()), x.dtype, str(x.device), x.storage_offset())
        if x.device.type == "cpu" and x.numel() <= _SMALL and x.layout == torch.strided:
            described += (tuple(x.reshape(-1).tolist()),)
        return described
    if isinstance(x, enum.Enum):
        return repr(x)
    if isinstance(x, float):
        return ("float", x.hex())  # -0.0 and 0.0, nan payloads: told apart
    return x


#: Copies that move bits unchanged: export spells a mutated input's or an output's copy where the
#: stock code has none. What is computed from the copy still shows its layout.
_COPIES = frozenset({"aten.clone.default", "aten.lift_fresh_copy.default"})
#: Checks export adds that compute nothing (a tensor's metadata asserted, a symbolic range).
_CHECKS = ("aten._assert", "aten.sym_constrain_range", "aten._functional_assert")


def _ignored(func: torch._ops.OpOverload) -> bool:
    schema = func._schema
    name = str(func)
    if name in _COPIES or name.startswith(_CHECKS):
        return True
    return not schema.is_mutable and bool(schema.returns) and all(r.alias_info is not None for r in schema.returns)


class OpTrace(TorchDispatchMode):
    """Records every non-view ATen op run under it (`records`), in order."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[OpRecord] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _ignored(func):
            self.records.append(OpRecord(str(func), _freeze(tuple(pytree.tree_map(_leaf, _normalised(func, args, kwargs))))))
        return func(*args, **kwargs)


#: Arguments an op's kernels never read, which export sets otherwise than a stock call: the
#: functional `layer_norm` and `group_norm` pass `torch.backends.cudnn.enabled`, export passes
#: False, and both ops run their native kernel whatever it says.
_UNREAD_ARGUMENTS = {"aten.layer_norm.default": "cudnn_enable", "aten.group_norm.default": "cudnn_enabled"}


def _normalised(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list:
    """Every argument of the op's schema, positional or keyword, a default left out filled in:
    export spells out what the stock call leaves at its default (`layer_norm`'s `eps`)."""
    values = []
    unread = _UNREAD_ARGUMENTS.get(str(func))
    for i, argument in enumerate(func._schema.arguments):
        if argument.name == unread:
            continue
        if i < len(args):
            values.append(args[i])
        elif argument.name in kwargs:
            values.append(kwargs[argument.name])
        elif argument.has_default_value():
            values.append(argument.default_value)
        else:
            values.append(None)
    return values


def _freeze(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, tuple):
        return tuple(_freeze(v) for v in value)
    return value


def first_difference(stock: list[OpRecord], graph: list[OpRecord]) -> str | None:
    """None when the two programs are the same op for op; else the first op where they differ,
    stock against graph, with its index."""
    for i, (s, g) in enumerate(zip(stock, graph)):
        if s != g:
            return f"op {i}: the stock call ran {s.describe()}, the graph runs {g.describe()}"
    if len(stock) != len(graph):
        longer, which = (stock, "stock call") if len(stock) > len(graph) else (graph, "graph")
        return (
            f"the stock call ran {len(stock)} ops, the graph runs {len(graph)}; the {which} goes on with "
            f"{longer[min(len(stock), len(graph))].describe()}"
        )
    return None
