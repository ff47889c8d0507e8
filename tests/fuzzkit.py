"""The differential fuzzer: random schedules of calls over bound models, each call's output, every
retained tensor and every host counter compared with the stock model's, run side by side.

A `Subject` is one bound model and how to stream it: a fresh state, one call of n units, and what
of the state to compare. A schedule (`schedule(seed, ...)`) mixes, at fixed seeds:

- calls of the catalog's units and of units outside it (an odd-length prefill),
- resets (a fresh state object in mid-process), a `None` state where the model takes one,
- two streams interleaved on the one bound model,
- every order of arrival: short streams and single pings first, or long (primed) streams first,
  and streams that start with the window already full (a prefill outside the catalog first).

`run(subject, steps)` returns what happened: calls, classes, stock calls by reason, and wrong
outputs (which must be 0). `bench/fuzz.py` runs longer schedules and records them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable

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
    """One bound model and how to stream it, stock and transformed alike."""

    name: str
    model: Any
    bound: Any
    report: Any
    new_state: Callable[[], Any]
    call: Callable[[Any, Any, int, torch.Generator], Any]  # (model, state, units, generator) -> output
    state_of: Callable[[Any], list]  # what of a state to compare: tensors and host values
    units: int  # the catalog's steady units
    odd: tuple[int, ...] = ()  # units outside the catalog that the model takes
    takes_none: bool = False


@dataclass
class Outcome:
    calls: int = 0
    wrong: int = 0
    first_wrong: str | None = None
    stock_by_reason: dict[str, int] = field(default_factory=dict)
    classes: int = 0
    refused: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "wrong": self.wrong, "first_wrong": self.first_wrong, "classes": self.classes,
                "stock_by_reason": dict(sorted(self.stock_by_reason.items())), "refused": self.refused}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


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
    """Stream the schedule through the stock model and the bound one side by side."""
    outcome = Outcome()
    stock_states = {0: subject.new_state(), 1: subject.new_state()}
    bound_states = {0: subject.new_state(), 1: subject.new_state()}
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for i, (kind, stream) in enumerate(steps):
            stream = int(stream)
            if kind == "reset":
                stock_states[stream], bound_states[stream] = subject.new_state(), subject.new_state()
                continue
            units = subject.units if kind in ("call", "none") else subject.odd[i % len(subject.odd)]
            stock_state = None if kind == "none" else stock_states[stream]
            bound_state = None if kind == "none" else bound_states[stream]
            state = generator.get_state()
            expected = subject.call(subject.model, stock_state, units, generator)
            generator.set_state(state)
            actual = subject.call(subject.bound, bound_state, units, generator)
            outcome.calls += 1
            same = _same(actual, expected) and (kind == "none" or _same(subject.state_of(bound_states[stream]),
                                                                        subject.state_of(stock_states[stream])))
            if not same:
                outcome.wrong += 1
                outcome.first_wrong = outcome.first_wrong or f"step {i}: {kind} on stream {stream}"
                # the streams go on from the stock state, so one difference is counted once
                bound_states[stream] = stock_states[stream] if kind != "none" else bound_states[stream]
                stock_states[stream] = _copied(stock_states[stream])
    for op in subject.report.operators.values():
        for reason, n in op.counters.stock_by_reason.items():
            outcome.stock_by_reason[reason] = outcome.stock_by_reason.get(reason, 0) + n
        outcome.classes += len(op.classes)
        outcome.refused.update({cls.name: cls.refused for cls in op.classes.values() if cls.refused})
    return outcome


def _copied(state: Any) -> Any:
    import copy

    return copy.deepcopy(state)


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
                cache.frames.copy_(torch.cat([cache.frames[:, 1:], y[:, t:t + 1]], dim=1))
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
                history = torch.cat([cache.frames[:, SINKS + 1:], y[:, t:t + 1]], dim=1)
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
        regions=(Region("frames", dims=(1, "frame", "dim"), axis=1, clock="frame", stride=1, dtype="float32",
                        lifetime=Lifetime.PER_STREAM, retention=RingCache(WINDOW)),),
        operators=(Operator("step", "frames", steady=1),),
        admission=Admission("frame", max_per_call=1),
        interactivity=Interactivity(stages=(family,)),
    )


def _buffer_subject(name: str, model: nn.Module, regime) -> Subject:
    binding = Binding(regions=(RegionBinding("frames", at=("cache.frames",)),),
                      operators=(OperatorBinding("step", units=("x", 1), counters=("cache.seen",), regimes=(regime,)),))
    bound, report = transform(model, _buffer_contract(name), binding)

    def call(m, state, units, generator):
        return m(torch.randn(1, units, DIM, generator=generator), state)

    return Subject(name, model, bound, report, Buffer, call, lambda s: [s.frames, s.seen], units=1, odd=(2, 3),
                   takes_none=True)


def rolling() -> Subject:
    return _buffer_subject("rolling", Rolling().eval(), Saturating("cache.seen", at=WINDOW))


def sinks() -> Subject:
    return _buffer_subject("sinks", Sinks().eval(), Saturating("cache.seen", at=WINDOW))


def refreshed() -> Subject:
    return _buffer_subject("refreshed", Refreshed().eval(), Periodic("cache.seen", period=PERIOD))


def mistral() -> Subject:
    """The README's example: a `transformers` Mistral decoder with its sliding-window DynamicCache."""
    from byom_example import TOKENS_PER_CALL, binding, build_model, contract
    from transformers import DynamicCache

    model, config = build_model()
    bound, report = transform(model, contract(), binding())

    def call(m, cache, units, generator):
        tokens = torch.randint(0, config.vocab_size, (1, units), generator=generator)
        return m(input_ids=tokens, cache=cache, use_cache=True).logits

    def state_of(cache):
        return [[layer.keys, layer.values, layer.cumulative_length] for layer in cache.layers
                if getattr(layer, "is_initialized", False)]

    return Subject("mistral", model, bound, report, lambda: DynamicCache(config=config), call, state_of,
                   units=TOKENS_PER_CALL, odd=(3, 1))


SUBJECTS: dict[str, Callable[[], Subject]] = {"rolling": rolling, "sinks": sinks, "refreshed": refreshed, "mistral": mistral}
