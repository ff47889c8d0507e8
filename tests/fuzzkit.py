"""The differential fuzzer: random schedules of calls over bound models, each call's output, every
retained tensor and every host counter compared with the stock model's, run side by side.

A `Subject` is one bound model, a stock copy of it, and how to stream both: a fresh state, one
call of n units, and what of the state to compare (`snapshot`: every tensor and host value the
state reaches). A schedule (`schedule(seed, ...)`) mixes, at fixed seeds:

- calls of the catalog's units and of units outside it (an odd-length prefill),
- resets (a fresh state object in mid-process), a `None` state where the model takes one,
- two streams interleaved on the one bound model (one, where the state lives in the model's
  modules: `Subject.streams`),
- every order of arrival: short streams and single pings first, or long (primed) streams first,
  and streams that start with the window already full (a prefill outside the catalog first).

`run(subject, steps)` returns what happened: calls, classes, stock calls by reason, and wrong
outputs (which must be 0). The subjects: the counter-branching models below, the probes and
examples (`fuzz_probes.py`), the families (`fuzz_families.py`), all named in `fuzz_subjects.py`;
`bench/fuzz.py` runs longer schedules and records them.
"""

from __future__ import annotations

import contextlib
import enum
import random
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from cadence_fx import (
    Admission,
    Binding,
    Clock,
    ClockKind,
    Contract,
    Interactivity,
    Lifetime,
    Operator,
    OperatorBinding,
    Rate,
    Region,
    RegionBinding,
    RingCache,
    transform,
)
from cadence_fx.guards import Periodic, Saturating

DIM, WINDOW, SINKS, PERIOD = 4, 4, 2, 3


@dataclass
class Subject:
    """One bound model and a stock copy, and how to stream them alike. `model` and `bound` are
    whatever `call` takes (a model, or a namespace of a family's operators)."""

    name: str
    model: Any  # the stock copy
    bound: Any
    report: Any
    new_state: Callable[[Any], Any]  # (model) -> a fresh stream's state on it
    call: Callable[[Any, Any, int, torch.Generator], Any]  # (model, state, units, generator) -> output
    state_of: Callable[[Any], Any]  # what of a state to compare: its tensors and host values
    units: int  # the catalog's steady units
    odd: tuple[int, ...] = ()  # units outside the catalog that the model takes
    takes_none: bool = False
    streams: int = 2  # streams held at once: 1 where the state lives in the model's own modules
    limit: int | None = None  # units a stream may reach (the model's positions): a fresh stream past it
    around: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext  # the calls' context
    # A state the step returns may be a view of its carry, which the next call overwrites: a caller
    # keeping it while another stream's call runs clones it first (docs/contract.md, Paths): how.
    keep: Callable[[Any], Any] | None = None


@dataclass
class Outcome:
    calls: int = 0
    wrong: int = 0
    first_wrong: str | None = None
    stock_by_reason: dict[str, int] = field(default_factory=dict)
    classes: int = 0
    refused: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "wrong": self.wrong,
            "first_wrong": self.first_wrong,
            "classes": self.classes,
            "stock_by_reason": dict(sorted(self.stock_by_reason.items())),
            "refused": self.refused,
        }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if hasattr(a, "__dataclass_fields__") and type(a) is type(b):
        return _same(vars(a), vars(b))
    return type(a) is type(b) and a == b


def _differs(actual: dict[str, Any], expected: dict[str, Any]) -> str | None:
    """The first path of a snapshot where the two differ."""
    for path in sorted(actual.keys() | expected.keys()):
        if path not in actual or path not in expected or not _same(actual[path], expected[path]):
            return path
    return None


_HOST = (bool, int, float, str, torch.dtype, torch.device, enum.Enum)
_SKIPPED = (nn.Module, type, types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.ModuleType)


def snapshot(value: Any, path: str = "state") -> dict[str, Any]:
    """Every tensor and host value `value` reaches, by path: through lists, tuples, dicts and the
    attributes of plain objects and dataclasses; modules, types and functions are not state."""
    out: dict[str, Any] = {}
    _walk(value, path, out, set())
    return out


def _walk(value: Any, path: str, out: dict[str, Any], seen: set[int]) -> None:
    if value is None or isinstance(value, (torch.Tensor, *_HOST)):
        out[path] = value
        return
    if isinstance(value, _SKIPPED) or id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, (list, tuple)):
        items = enumerate(value)
    elif isinstance(value, dict):
        items = value.items()
    elif hasattr(value, "__dict__"):
        items = ((k, v) for k, v in vars(value).items() if not k.startswith("__"))
    else:
        out[path] = f"<{type(value).__name__}>"
        return
    for key, item in items:
        _walk(item, f"{path}.{key}", out, seen)


def schedule(seed: int, length: int, *, odd: bool, none: bool) -> list[tuple[str, int]]:
    """A random schedule of `length` steps: ("call", stream), ("odd", stream), ("reset", stream),
    ("none", stream), the stream 0 or 1; it opens, by the seed, with pings and short streams
    first, or with a long stream first, or with a stream whose window a prefill has filled."""
    rng = random.Random(seed)
    steps: list[tuple[str, int]] = []
    opening = rng.choice(["pings", "long", "primed"])
    if opening == "pings":
        steps += [("call", 0), ("reset", 0), ("call", 0), ("call", 0), ("reset", 0)]
    elif opening == "long":
        steps += [("call", 0)] * (2 * WINDOW + 3) + [("reset", 0)]
    elif odd:
        steps += [("odd", 0), ("call", 0), ("call", 0)]
    while len(steps) < length:
        stream = rng.random() < 0.3
        roll = rng.random()
        if roll < 0.08:
            steps.append(("reset", stream))
        elif roll < 0.14 and odd:
            steps.append(("odd", stream))
        elif roll < 0.17 and none:
            steps.append(("none", stream))
        else:
            steps.append(("call", stream))
    return steps[:length]


def run(subject: Subject, steps: list[tuple[str, int]], seed: int = 0) -> Outcome:
    """Stream the schedule through the stock model and the bound one side by side. A stream that
    would pass the subject's `limit` starts afresh first; after a wrong call both start afresh,
    so one difference is counted once."""
    outcome = Outcome()
    states: dict[int, tuple[Any, Any]] = {}
    seen: dict[int, int] = {}

    def fresh(stream: int) -> None:
        states[stream] = (subject.new_state(subject.model), subject.new_state(subject.bound))
        seen[stream] = 0

    # on the default device, where the subject was built and draws its inputs (bench/fuzz.py --device)
    generator = torch.Generator(device=torch.get_default_device()).manual_seed(seed)
    last = 0
    with torch.no_grad(), subject.around():
        for stream in range(subject.streams):
            fresh(stream)
        for i, (kind, stream) in enumerate(steps):
            stream = int(stream) % subject.streams
            if kind == "reset":
                fresh(stream)
                continue
            if subject.keep is not None and stream != last:
                states[last] = tuple(subject.keep(state) for state in states[last])
            last = stream
            units = subject.units if kind in ("call", "none") else subject.odd[i % len(subject.odd)]
            if kind != "none" and subject.limit is not None and seen[stream] + units > subject.limit:
                fresh(stream)
            stock_state, bound_state = (None, None) if kind == "none" else states[stream]
            rng = generator.get_state()
            expected = subject.call(subject.model, stock_state, units, generator)
            generator.set_state(rng)
            actual = subject.call(subject.bound, bound_state, units, generator)
            outcome.calls += 1
            seen[stream] += units if kind != "none" else 0
            wrong = None if _same(actual, expected) else "output"
            if wrong is None and kind != "none":
                wrong = _differs(snapshot(subject.state_of(states[stream][1])), snapshot(subject.state_of(states[stream][0])))
            if wrong is not None:
                outcome.wrong += 1
                outcome.first_wrong = outcome.first_wrong or f"step {i}: {kind} of {units} on stream {stream}: {wrong} differs"
                fresh(stream)
    for op in subject.report.operators.values():
        for reason, n in op.counters.stock_by_reason.items():
            outcome.stock_by_reason[reason] = outcome.stock_by_reason.get(reason, 0) + n
        outcome.classes += len(op.classes)
        outcome.refused.update({cls.name: cls.refused for cls in op.classes.values() if cls.refused})
    return outcome


class Held:
    """A state a functional step returns: the caller threads it back in (`value`, None at first or
    the fresh state the stream starts from)."""

    def __init__(self, value: Any = None):
        self.value = value

    def kept(self) -> Held:
        """A copy of the state to keep while another stream's call runs (`Subject.keep`)."""
        return Held(_cloned(self.value))


def _cloned(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_cloned(v) for v in value)
    return value


class Positioned:
    """A cache object and the units its stream has seen (the positions the caller passes)."""

    def __init__(self, cache: Any):
        self.cache, self.seen = cache, 0


# -- models whose code branches on a host counter ------------------------------------------------


class Buffer:
    """A fixed buffer of WINDOW frames and the count of frames seen: a host counter."""

    def __init__(self):
        self.frames = torch.zeros(1, WINDOW, DIM)
        self.seen = 0


class Rolling(nn.Module):
    """A static sliding window: written in place while it fills, rolled once full."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, cache: Buffer | None = None) -> torch.Tensor:
        y = self.proj(x)
        if cache is None:
            return y
        for t in range(y.shape[1]):
            if cache.seen < WINDOW:
                cache.frames[:, cache.seen] = y[:, t]
            else:
                cache.frames.copy_(torch.cat([cache.frames[:, 1:], y[:, t : t + 1]], dim=1))
            cache.seen += 1
        return torch.softmax(y @ cache.frames.transpose(1, 2), dim=-1) @ cache.frames


class Sinks(nn.Module):
    """Attention sinks: the first SINKS frames kept for good, the rest a rolling history."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, cache: Buffer | None = None) -> torch.Tensor:
        y = self.proj(x)
        if cache is None:
            return y
        for t in range(y.shape[1]):
            if cache.seen < WINDOW:
                cache.frames[:, cache.seen] = y[:, t]
            else:
                history = torch.cat([cache.frames[:, SINKS + 1 :], y[:, t : t + 1]], dim=1)
                cache.frames[:, SINKS:] = history
            cache.seen += 1
        scale = 1.0 / (1 + min(cache.seen, WINDOW))
        return (y @ cache.frames.transpose(1, 2) * scale) @ cache.frames


class Refreshed(nn.Module):
    """A buffer recomputed from the input every PERIOD calls, read in between."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, cache: Buffer | None = None) -> torch.Tensor:
        if cache is None:
            return x
        if cache.seen % PERIOD == 0:
            cache.frames.copy_(self.proj(x[:, -1:]).expand(1, WINDOW, DIM))
        cache.seen += 1
        return x + cache.frames.sum(1, keepdim=True)


def _buffer_contract(family: str) -> Contract:
    return Contract(
        family=family,
        clocks=(Clock("frame", ClockKind.FRAMES), Clock("call", ClockKind.CALLS)),
        rates=(Rate("frame", "call", 1, name="frames_per_call"),),
        quantities={"dim": DIM},
        regions=(
            Region(
                "frames",
                dims=(1, "frame", "dim"),
                axis=1,
                clock="frame",
                stride=1,
                dtype="float32",
                lifetime=Lifetime.PER_STREAM,
                retention=RingCache(WINDOW),
            ),
        ),
        operators=(Operator("step", "frames", steady=1),),
        admission=Admission("frame", max_per_call=1),
        interactivity=Interactivity(stages=(family,)),
    )


def _buffer_subject(name: str, model: nn.Module, regime) -> Subject:
    binding = Binding(
        regions=(RegionBinding("frames", at=("cache.frames",)),),
        operators=(OperatorBinding("step", units=("x", 1), counters=("cache.seen",), regimes=(regime,)),),
    )
    bound, report = transform(model, _buffer_contract(name), binding)

    def call(m, state, units, generator):
        return m(torch.randn(1, units, DIM, generator=generator), state)

    # the model keeps no state of its own: the one module serves as the stock copy
    return Subject(name, model, bound, report, lambda m: Buffer(), call, lambda s: s, units=1, odd=(2, 3), takes_none=True)


def rolling() -> Subject:
    return _buffer_subject("rolling", Rolling().eval(), Saturating("cache.seen", at=WINDOW))


def sinks() -> Subject:
    return _buffer_subject("sinks", Sinks().eval(), Saturating("cache.seen", at=WINDOW))


def refreshed() -> Subject:
    return _buffer_subject("refreshed", Refreshed().eval(), Periodic("cache.seen", period=PERIOD))


TOYS: dict[str, Callable[[], Subject]] = {"rolling": rolling, "sinks": sinks, "refreshed": refreshed}
