"""The transformed model of a `transformers` model: a shallow copy of it whose bound methods are its
operators, so that the stock ways of calling it (`model(...)`, `model.generate(...)`, a nested
module's method) run the graphs with no glue.

`transform(model)` with no contract derives one operator per cached method (`cadence_fx.hf`) and
binds it on the input model (`BoundModel`). A `BoundModel` is reached only through itself: a method
of the model (`generate`, which calls `self(...)`) runs on the input model and calls the stock
`forward`. So the transformed model is instead an instance of a subclass of the model's own class
(`Transformed<Class>`): every `transformers` method is there and calls what the instance holds,
and the instance holds each operator in place of the method it binds. The instance is a shallow
copy of the input model: its `__dict__` and each dict in it (modules, parameters, buffers, hooks)
copied, so an attribute set on one never lands on the other, and every tensor and every submodule
shared; a submodule on the path of a bound method (`decoder.forward`) is itself copied so, so the
operator replaces the method on the copy only. The input model stays untouched: its methods are
its class's, and the operators' stock calls run on it (the weights are the same tensors).

A call whose cache is not of the class the contract was derived for (a `StaticCache` derived, and
`generate()` building a `DynamicCache`) runs the stock method, counted as `cache_class` (its
layers hold other host values: no graph of the derived contract reads them).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch

from .hf_mimi import int_paddings
from .multiplex import SessionState
from .pipeline import BoundModel, BoundOperator

__all__ = ["CACHE_CLASS", "transformed_model"]

#: The stock-call reason of a call whose cache is of another class than the derived contract's.
CACHE_CLASS = "cache_class"
#: What the transformed model adds to the model's class: the operators, the report, and the
#: stream-multiplexing calls of `cadence_fx.multiplex` (the model's own `device` stays a property).
ADDED = (
    "bound",
    "operators",
    "report",
    "explain",
    "carries",
    "calls",
    "resident",
    "set_counters",
    "reset",
    "session_state",
    "swap_in",
    "swap_out",
)
_SUBCLASSES: dict[type, type] = {}
#: What an operator's entry does to its call's arguments first, by (model_type, operator).
BEFORE: dict[tuple[str, str], Callable[[dict[str, Any]], None]] = {("mimi", "encode"): int_paddings}


def transformed_model(
    model: torch.nn.Module, bound: BoundModel, caches: dict[str, tuple[str, type]] | None = None
) -> torch.nn.Module:
    """The shallow copy of `model` whose bound methods are `bound`'s operators (`bound` built on
    `model` by `transform(model, contract, binding)`). `caches`: by operator, the argument that
    takes its cache and the cache class its contract was derived for (a call with a cache of
    another class runs the stock method); None: no such check."""
    cls = _subclass(type(model))
    twin = _shallow(model, cls)
    object.__setattr__(twin, "_cadence_bound", bound)
    copied: dict[str, torch.nn.Module] = {"": twin}  # by path: each module on a bound method's path, copied once
    for name, op in bound.operators.items():
        *path, method = op.ob.method.split(".")
        holder = twin
        for i, part in enumerate(path):
            at = ".".join(path[: i + 1])
            if at not in copied:
                child = getattr(holder, part)
                if not isinstance(child, torch.nn.Module):
                    raise TypeError(f"operator {name!r}: {at} is a {type(child).__name__}; a bound method is a module's")
                copied[at] = _shallow(child, type(child))
                setattr(holder, part, copied[at])
            holder = copied[at]
        argument, cache = (caches or {}).get(name, (None, None))
        before = BEFORE.get((getattr(getattr(model, "config", None), "model_type", ""), name))
        object.__setattr__(holder, method, _entry(op, argument, cache, before))
    return twin


def _shallow(module: torch.nn.Module, cls: type[torch.nn.Module]) -> torch.nn.Module:
    """A new `cls` instance holding what `module` holds: its `__dict__` and every dict in it copied
    (a later attribute, module, parameter, buffer or hook of one is not the other's), the values
    (tensors, submodules, the config) shared."""
    twin = cls.__new__(cls)
    twin.__dict__.update({k: copy.copy(v) if isinstance(v, dict) else v for k, v in vars(module).items()})
    return twin


def _entry(op: BoundOperator, argument: str | None, cache: type | None, before: Callable[[dict[str, Any]], None] | None):
    """The method the operator replaces, as the model's code calls it: the stock method's name,
    docstring and signature (`generate` reads which arguments `forward` takes), the call the
    operator's. A cache of another class than `cache` runs the stock method, counted. `before`
    sees the call's arguments first (`BEFORE`)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        arguments = op.signature.bind_partial(*args, **kwargs).arguments if argument or before else {}
        if before is not None:
            before(arguments)
        state = None if argument is None else arguments.get(argument)
        if cache is not None and state is not None and type(state) is not cache:
            if CACHE_CLASS not in op.counters.stock_by_reason:
                op.report.stamps.append(
                    f"{op.ob.operator}: runs the stock code ({CACHE_CLASS}): its {argument} is a "
                    f"{type(state).__name__}, its contract derived for a {cache.__name__}"
                )
            op.counters.calls += 1
            op.counters.fallback(CACHE_CLASS)
            with torch.no_grad():
                return op.method(*args, **kwargs)
        return op(*args, **kwargs)

    functools.update_wrapper(call, op.method)
    return call


def _subclass(cls: type) -> type:
    """`Transformed<Class>`, made once per model class: the class's own methods, and `ADDED`."""
    if cls not in _SUBCLASSES:
        taken = [name for name in ADDED if hasattr(cls, name)]
        if taken:
            raise TypeError(
                f"{cls.__name__} defines {taken}: names the transformed model takes for its operators and "
                "streams; transform it with an explicit contract and binding (README: Bring your own model)"
            )
        members = {name: vars(_Added)[name] for name in ADDED}
        _SUBCLASSES[cls] = type(f"Transformed{cls.__name__}", (cls,), {"__module__": __name__, **members})
    return _SUBCLASSES[cls]


class _Added:
    """The members `_subclass` adds to a model's class (`ADDED`): each one `BoundModel`'s, whose
    docstrings say what they do."""

    @property
    def bound(self) -> BoundModel:
        """The operators as `transform(model, contract, binding)` returns them."""
        return self._cadence_bound  # type: ignore[attr-defined]

    @property
    def operators(self) -> dict[str, BoundOperator]:
        return self.bound.operators

    @property
    def report(self) -> Any:
        return self.bound.report

    @property
    def carries(self) -> dict:
        return self.bound.carries

    @property
    def calls(self) -> dict[str, int]:
        return self.bound.calls

    def explain(self) -> str:
        return self.bound.explain()

    def resident(self) -> tuple[list[torch.Tensor], list[int]]:
        return self.bound.resident()

    def set_counters(self, counters: list[int]) -> None:
        self.bound.set_counters(counters)

    def reset(self) -> None:
        self.bound.reset()

    def session_state(self, seed: int) -> SessionState:
        return self.bound.session_state(seed)

    def swap_in(self, state: SessionState, *, rng: bool = True) -> None:
        self.bound.swap_in(state, rng=rng)

    def swap_out(self, state: SessionState, *, rng: bool = True) -> None:
        self.bound.swap_out(state, rng=rng)
