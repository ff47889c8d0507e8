"""Guards: every value a captured program depends on beyond its tensors' data, read on every call.

A graph runs no Python: whatever host value the export read (a cache's length, a first-call flag,
a module's setting) is frozen into it. So each class of a bound operator is keyed by all of them,
and a call whose values differ from every captured class is another class (captured and verified
apart) or, past the operator's budget of variants, runs the stock code, counted by the path that
differed. What is guarded:

- every host scalar (bool, int, float, str, None, enum, dtype, device) reachable from the call's
  state arguments (`host_values`),
- every such scalar reachable from the model's modules' attributes, nested state objects
  (a streaming state dataclass) included (`ModuleSettings`),
- the binding's modes, and every non-tensor input (in the call's `Signature`), and the tensors'
  shapes, strides, dtypes, devices and layouts (the `Signature` and the state's shapes).

The guard is equality, unless the binding declares a `Regime` for a counter: how its value maps to
the component of the class key (`Saturating`: min(n, at), for a cache that fills then rolls;
`Periodic`: n mod period, for a buffer refreshed every k calls; `Unread`: the computation never
reads it or anything under its path, the call only moves it). A declared regime is a premise: verification visits each
class at two values of such a counter where the class spans more than one, and compares the
programs the stock code runs at both (`cadence_fx.program`).
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["HOST_SCALARS", "ModuleSettings", "Periodic", "Regime", "Saturating", "Unread", "guard_key", "host_values"]

HOST_SCALARS = (bool, int, float, str, type(None), enum.Enum, torch.dtype, torch.device)
_DEPTH = 8


@dataclass(frozen=True)
class Regime:
    """How a counter's value `path` (a binding path: `*`, `**` and slices allowed) keys a class."""

    path: str

    def component(self, value: Any) -> Hashable:
        raise NotImplementedError

    def spans(self, component: Hashable) -> bool:
        """Whether more than one value of the counter maps to `component`."""
        raise NotImplementedError

    def values(self) -> int | None:
        """How many components the regime has (None: unbounded)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Saturating(Regime):
    """The computation reads the counter only as min(n, at): a cache that fills, then rolls."""

    at: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.at, int) or isinstance(self.at, bool) or self.at < 0:
            raise ValueError(f"Saturating({self.path!r}).at must be an int >= 0, got {self.at!r}")

    def component(self, value: Any) -> Hashable:
        return min(value, self.at) if _integral(value) else ("value", value)

    def spans(self, component: Hashable) -> bool:
        return component == self.at

    def values(self) -> int | None:
        return self.at + 1


@dataclass(frozen=True)
class Periodic(Regime):
    """The computation reads the counter only as n mod `period`: a buffer refreshed every k calls."""

    period: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.period, int) or isinstance(self.period, bool) or self.period < 1:
            raise ValueError(f"Periodic({self.path!r}).period must be an int >= 1, got {self.period!r}")

    def component(self, value: Any) -> Hashable:
        return value % self.period if _integral(value) else ("value", value)

    def spans(self, component: Hashable) -> bool:
        return True

    def values(self) -> int | None:
        return self.period


@dataclass(frozen=True)
class Unread(Regime):
    """The computation never reads the value, nor anything under it (a host mirror of a
    device-side offset that a layer keeps for another use, a vendor's table of module names): it
    keys no class."""

    def component(self, value: Any) -> Hashable:
        return "unread"

    def spans(self, component: Hashable) -> bool:
        return True

    def values(self) -> int | None:
        return 1


def _integral(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _children(value: Any) -> Any:
    """The live container of `value`'s children (a dict, a list or tuple, an object's `__dict__`),
    or None for what holds no state."""
    if isinstance(value, (dict, list, tuple)):
        return value
    if getattr(value, "_guard_opaque", False) or isinstance(value, type) or callable(value):
        return None  # a bound operator (a handle on graphs), a class, a function: not state
    if hasattr(value, "__dict__"):
        return vars(value)
    return None


def _seen(value: Any, seen: set[int]) -> bool:
    """Whether the walk met this object already (a cycle, a state object two paths share); a
    tuple is walked wherever it is met: constant tuples are shared by unrelated paths, and a
    tuple alone makes no cycle."""
    if isinstance(value, tuple):
        return False
    if id(value) in seen:
        return True
    seen.add(id(value))
    return False


def _items(children: Any):
    return children.items() if isinstance(children, dict) else enumerate(children)


def _walk(value: Any, path: str, depth: int, found: dict[str, Any], seen: set[int], skip: frozenset[str]) -> None:
    if path in skip:
        return
    if isinstance(value, HOST_SCALARS):
        found[path] = value
        return
    if depth > _DEPTH or isinstance(value, (torch.Tensor, torch.nn.Module)) or _seen(value, seen):
        return
    children = _children(value)
    if children:
        for key, child in list(_items(children)):
            _walk(child, f"{path}.{key}", depth + 1, found, seen, skip)


def host_values(roots: dict[str, Any], skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Every host scalar in the state objects `roots` (not a model: its modules are
    `ModuleSettings`'), by path; nothing at or under a path in `skip`."""
    found: dict[str, Any] = {}
    seen: set[int] = set()
    for name, root in roots.items():
        _walk(root, name, 0, found, seen, skip)
    return found


#: Module attributes that are not settings: the tables torch keeps (weights, buffers, submodules
#: by name, hooks), read through their own guards (the tensors' shapes and dtypes) or not at all.
_MODULE_TABLES = frozenset(
    {
        "_parameters",
        "_buffers",
        "_modules",
        "_non_persistent_buffers_set",
        "_forward_hooks",
        "_forward_pre_hooks",
        "_backward_hooks",
        "_backward_pre_hooks",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_hooks_always_called",
        "_forward_pre_hooks_with_kwargs",
        "_is_full_backward_hook",
    }
)


class ModuleSettings:
    """The host scalars of a model's modules (their attributes, and the state objects they hold),
    by path from `self`, read on every call.

    A model has thousands of them (a 7B LM: about 2,800), so the walk is planned once: every
    container it passed through (a module's `__dict__`, a state object's, a list), each one's
    length, and each leaf's (container, key). A call reads the leaves through that plan in C
    (`map(getitem)`), after checking, also in C, that every container is still the one the plan
    walked and has the same length; anything else (a state object replaced, an attribute added,
    an empty buffer filled) walks again. `version` names the set of paths.
    """

    def __init__(self, model: torch.nn.Module, unread: Callable[[], frozenset[str]] = frozenset, root: str = "self") -> None:
        self.modules = [
            (f"{root}.{name}" if name else root, module) for name, module in model.named_modules(remove_duplicate=True)
        ]
        self._unread = unread  # the paths (and all under them) an Unread regime covers, found afresh at each walk
        self.paths: tuple[str, ...] = ()
        self.version = 0
        self._versions: dict[tuple[str, ...], int] = {}
        self._edges: tuple[list, list, list] = ([], [], [])  # (parent containers, keys, children) walked into
        self._sized: tuple[list, list] = ([], [])  # (containers, lengths)
        self._leaves: tuple[list, list] = ([], [])  # (containers, keys)
        self._types: list[type] = []  # each leaf's type when planned: a leaf that became an object is walked

    def read(self) -> list:
        """The leaves' values, aligned with `paths` (walked again first when the plan is stale)."""
        parents, keys, children = self._edges
        if (
            not self._sized[0]
            or not all(map(operator.is_, map(operator.getitem, parents, keys), children))
            or list(map(len, self._sized[0])) != self._sized[1]
        ):
            self._plan()
        values = list(map(operator.getitem, *self._leaves))
        if list(map(type, values)) != self._types:
            self._plan()
            values = list(map(operator.getitem, *self._leaves))
        return values

    def _plan(self) -> None:
        skip = self._unread()
        edges: tuple[list, list, list] = ([], [], [])
        sized: tuple[list, list] = ([], [])
        leaves: tuple[list, list] = ([], [])
        paths: list[str] = []
        seen: set[int] = set()

        def walk(container: Any, key: Any, value: Any, path: str, depth: int) -> None:
            if path in skip:
                return
            if isinstance(value, HOST_SCALARS):
                leaves[0].append(container)
                leaves[1].append(key)
                paths.append(path)
                return
            if depth > _DEPTH or isinstance(value, (torch.Tensor, torch.nn.Module)) or _seen(value, seen):
                return
            inner = _children(value)
            if inner is None:
                return
            edges[0].append(container)
            edges[1].append(key)
            edges[2].append(value)
            sized[0].append(inner)
            sized[1].append(len(inner))
            for k, child in list(_items(inner)):
                walk(inner, k, child, f"{path}.{k}", depth + 1)

        under = tuple(f"{p}." for p in skip)
        for prefix, module in self.modules:
            if prefix in skip or prefix.startswith(under):
                continue
            # A buffer registered empty and filled lazily (a codebook's cached table): its filling
            # changes the program (the cache read instead of computed), so it is a guarded None.
            buffers = module._buffers
            sized[0].append(buffers)
            sized[1].append(len(buffers))
            for key, value in buffers.items():
                if value is None and f"{prefix}.{key}" not in skip:
                    leaves[0].append(buffers)
                    leaves[1].append(key)
                    paths.append(f"{prefix}.{key}")
            table = module.__dict__
            sized[0].append(table)
            sized[1].append(len(table))
            for key, value in list(table.items()):
                if key not in _MODULE_TABLES and not isinstance(value, (torch.Tensor, torch.nn.Module)):
                    walk(table, key, value, f"{prefix}.{key}", 1)
        self._edges, self._sized, self._leaves = edges, sized, leaves
        self._types = [type(v) for v in map(operator.getitem, *leaves)]
        if tuple(paths) != self.paths:
            # One version per distinct set of paths, the same again when a set comes back (a
            # stream's reset making a state None, its first call filling it).
            self.paths = tuple(paths)
            self.version = self._versions.setdefault(self.paths, len(self._versions) + 1)


def guard_key(values: dict[str, Any], regimes: dict[str, Regime]) -> tuple:
    """The class key's guard part: each value by its path, its type and its regime's component
    (its value itself where none is declared: a bool and an int, 0.0 and -0.0 told apart)."""
    key = []
    for path, value in values.items():
        regime = regimes.get(path)
        if isinstance(regime, Unread):
            continue
        if regime is not None:
            key.append((path, type(value).__name__, regime.component(value)))
        elif isinstance(value, float):
            key.append((path, "float", value.hex()))
        else:
            key.append((path, type(value).__name__, value))
    return tuple(key)
