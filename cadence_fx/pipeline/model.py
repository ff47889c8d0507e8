"""`BoundModel`: the model as its bound operators, and `transform_bound`, which builds it."""

from __future__ import annotations

from typing import Any

import torch

from ..binding import (
    Binding,
)
from ..catalog import Catalog
from ..contract import Contract
from ..multiplex import Transformed
from ..passes.window import CarryCounters, WindowCarry
from .operator import BoundOperator


class BoundModel(Transformed):
    """A model transformed from its contract and binding: call it as the stock model (its one
    bound operator), or each operator through `operators[name]`. Several streams share its graphs
    through `session_state` / `swap_in` / `swap_out` (`cadence_fx.multiplex`)."""

    def __init__(self, model: Any, operators: dict[str, BoundOperator], report):
        self.model = model
        self.operators = operators
        self.report = report
        self._methods = {op.ob.method: op for op in operators.values()}

    def __getattr__(self, name: str) -> Any:
        """A drop-in for the model: a bound method is its operator, anything else the model's own."""
        if name.startswith("_") or name in ("model", "operators", "report", "carries", "calls"):
            raise AttributeError(name)
        if name in self._methods:
            return self._methods[name]
        return getattr(self.model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(self.operators) != 1:
            raise TypeError(
                f"this model binds {len(self.operators)} operators: call operators[name], one of {sorted(self.operators)}"
            )
        return next(iter(self.operators.values()))(*args, **kwargs)

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
            raise RuntimeError(
                "the carries are allocated at each operator's first call: call the model once "
                "before taking or swapping session states"
            )
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


def transform_bound(model: Any, contract: Contract, binding: Binding, catalog: Catalog, report, *, replay: bool) -> BoundModel:
    from ..binding import check_binding

    signatures = check_binding(model, contract, binding)
    for op in catalog.operators:
        if op.name in signatures and not op.in_scope:
            raise ValueError(
                f"operator {op.name!r}: {op.verdict}; raise the budget (transform(..., budget=N), "
                f"`--budget N` on the CLI) to capture all {op.width} classes"
            )
    shared: dict[tuple[str, tuple[int, ...]], WindowCarry] = {}
    operators = {
        ob.operator: BoundOperator(
            model, contract, catalog, binding, ob, signatures[ob.operator], report, replay=replay, shared=shared
        )
        for ob in binding.operators
    }
    report.stamps.append(
        f"binding: {len(binding.regions)} region(s), {len(binding.operators)} operator(s); classes are "
        f"captured at their first visit and verified against the stock call on {binding.verify}"
    )
    report.operators = operators
    return BoundModel(model, operators, report)
