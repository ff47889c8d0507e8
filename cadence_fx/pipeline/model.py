"""`BoundModel`: the model as its bound operators, and `transform_bound`, which builds it."""

from __future__ import annotations

import copy
from typing import Any

import torch

from ..binding import (
    Binding,
)
from ..catalog import Catalog
from ..contract import Contract
from ..passes.window import CarryCounters, WindowCarry
from ..transformed import Transformed
from .operator import BoundOperator


class BoundModel(Transformed):
    """A model transformed from its contract and binding: a drop-in for it. Several streams share
    its graphs through `session_state` / `swap_in` / `swap_out` (`cadence_fx.transformed`).

    Its attributes are those of `module`, a shallow copy of the model in which each bound method
    is its operator (`with_operators`): calling the transformed model the stock way, or any of its
    own methods that call a bound method (`generate()` calling `forward`, a parent's `forward`
    calling a bound submodule), goes through the operators. With one operator, calling it calls
    that operator; with several, the copy's own call (its stock code, reaching each operator where
    the stock code calls the bound method)."""

    def __init__(self, model: Any, operators: dict[str, BoundOperator], report):
        self.model = model
        self.operators = operators
        self.report = report
        self.module = with_operators(model, operators)

    def __getattr__(self, name: str) -> Any:
        """A drop-in for the model: its copy's attribute, where a bound method is its operator."""
        if name.startswith("_") or name in ("model", "module", "operators", "report", "carries", "calls"):
            raise AttributeError(name)
        return getattr(self.module, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(self.operators) == 1:
            return next(iter(self.operators.values()))(*args, **kwargs)
        if not callable(self.module):
            raise TypeError(f"this model binds {len(self.operators)} operators and is not callable: call "
                            f"operators[name], one of {sorted(self.operators)}")
        return self.module(*args, **kwargs)

    def explain(self) -> str:
        return "\n".join(op.explain() for op in self.operators.values())

    @property
    def carries(self) -> dict[str, WindowCarry]:
        """Every site's carry, by its name: the site's concrete path (with its region where the binding
        names the region's operators: two methods' `att_cache`); empty before the first call."""
        return {carry.site: carry for op in self.operators.values() for carry in op.carries.values()}

    @property
    def calls(self) -> dict[str, int]:
        """Calls per catalog class met so far, by class name, that ran the rewritten graph."""
        return {cls.name: cls.calls for op in self.operators.values() for cls in op.classes.values()}

    def device(self) -> torch.device:
        return next(iter(self.operators.values()))._device()

    def _carries(self) -> list[WindowCarry]:
        if not all(op.carries for op in self.operators.values()):
            raise RuntimeError("the carries are allocated at each operator's first call: call the model once "
                               "before taking or swapping session states")
        carries = [carry for op in self.operators.values() for carry in op.carries.values()]
        return list({id(c): c for c in carries}.values())  # operators binding one region share its carries

    def resident(self) -> tuple[list[torch.Tensor], list[int]]:
        """The carries and held counters (read by `session_state`, `swap_in` and `swap_out`): the
        caller swapping streams' states decides what the carries hold from here, so no operator
        copies a stream's state out of them on its own when the next call's objects differ."""
        for op in self.operators.values():
            op._owner = None
        carries = self._carries()
        buffers = [t for op in self.operators.values() for rb in op.regions for t in op.region_tensors[rb.region]]
        buffers += [t for op in self.operators.values() for t in op.held.values()]
        return list({id(b): b for b in buffers}.values()), CarryCounters(carries).read()

    def set_counters(self, counters: list[int]) -> None:
        CarryCounters(self._carries()).write(counters)

    def reset(self) -> None:
        """A fresh stream: every carry empty (before the first call they are not even allocated)."""
        if not all(op.carries for op in self.operators.values()):
            return
        for carry in self._carries():
            carry.reset()
        for buffer in self.resident()[0]:
            buffer.zero_()


def with_operators(model: Any, operators: dict[str, BoundOperator]) -> Any:
    """A shallow copy of `model` whose bound methods are their operators: the model object and each
    object on the way to a bound method's owner are copied (their attribute dicts, and a module's
    table of submodules), every other attribute, parameter, buffer and submodule is the model's own,
    and the input model is left as it was."""
    top = copy.copy(model)
    originals = {id(top): model}  # each copy's original
    copies = {id(model): top}  # each original's copy, made once (two operators under one submodule share it)
    for op in operators.values():
        *owners, method = op.ob.method.split(".")
        holder = top
        for name in owners:
            original = getattr(originals[id(holder)], name)
            child = copies.get(id(original))
            if child is None:
                child = copies[id(original)] = copy.copy(original)
                originals[id(child)] = original
                if isinstance(holder, torch.nn.Module) and name in holder._modules:
                    if holder._modules is originals[id(holder)]._modules:  # still the model's own table
                        holder.__dict__["_modules"] = dict(holder._modules)
                    holder._modules[name] = child
                else:
                    holder.__dict__[name] = child
            holder = child
        holder.__dict__[method] = op
    return top


def transform_bound(model: Any, contract: Contract, binding: Binding, catalog: Catalog, report, *, replay: bool) -> BoundModel:
    from ..binding import check_binding

    signatures = check_binding(model, contract, binding)
    for op in catalog.operators:
        if op.name in signatures and not op.in_scope:
            raise ValueError(f"operator {op.name!r}: {op.verdict}; raise the budget (transform(..., budget=N), "
                             f"`--budget N` on the CLI) to capture all {op.width} classes")
    shared: dict[tuple[str, tuple[int, ...]], WindowCarry] = {}
    operators = {ob.operator: BoundOperator(model, contract, catalog, binding, ob, signatures[ob.operator], report,
                                            replay=replay, shared=shared)
                 for ob in binding.operators}
    report.stamps.append(f"binding: {len(binding.regions)} region(s), {len(binding.operators)} operator(s); classes are "
                         f"captured at their first visit and verified against the stock call on {binding.verify}")
    report.operators = operators
    return BoundModel(model, operators, report)
