"""A host flag the model reads to choose what it computes (a decoding switch) is a binding `mode`:
each value its own class, captured and verified apart, so a stream that flips it between calls
stays exactly the stock stream; undeclared, a graph would keep the value it was captured with."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cadence_fx import (
    Admission,
    Binding,
    BindingError,
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
    SlidingWindow,
    transform,
)

DIM, WINDOW, STEP, CALLS = 4, 4, 2, 9


class Cache:
    def __init__(self):
        self.kept = None


def contract() -> Contract:
    return Contract(
        family="switched",
        clocks=(Clock("frame", ClockKind.FRAMES), Clock("call", ClockKind.CALLS)),
        rates=(Rate("frame", "call", STEP, name="frames_per_call"),),
        quantities={"dim": DIM},
        regions=(
            Region(
                "window",
                dims=(1, "frame", "dim"),
                axis=1,
                clock="frame",
                stride=STEP,
                dtype="float32",
                lifetime=Lifetime.PER_STREAM,
                retention=SlidingWindow(window=WINDOW),
            ),
        ),
        operators=(Operator("smooth", "window", steady=STEP),),
        admission=Admission("frame", max_per_call=STEP),
        interactivity=Interactivity(stages=("switched",)),
    )


class Switched(nn.Module):
    """A concat-then-trim window whose output is a running sum or a running max, as `self.summing` says."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(DIM, DIM)
        self.summing = True

    def forward(self, x: torch.Tensor, cache: Cache):
        x = self.proj(x)
        full = x if cache.kept is None else torch.cat([cache.kept, x], dim=1)
        cache.kept = full[:, -WINDOW:]
        out = full.cumsum(1) if self.summing else full.cummax(1).values
        return out[:, -x.shape[1] :]


def binding(modes: tuple[str, ...]) -> Binding:
    return Binding(
        regions=(RegionBinding("window", at=("cache.kept",)),),
        operators=(OperatorBinding("smooth", units=("x", 1), modes=modes),),
    )


SWITCHES = [True, False, False, True, True, False, True, False, True]


def stream(model, switch, frames, switches=SWITCHES):
    cache, outputs = Cache(), []
    with torch.no_grad():
        for call, summing in enumerate(switches):
            switch.summing = summing
            outputs.append(model(frames[:, call * STEP : (call + 1) * STEP], cache))
    return outputs


def test_a_stream_that_flips_its_mode_is_the_stock_stream_bit_for_bit():
    stock, model = Switched(), Switched()
    frames = torch.randn(1, CALLS * STEP, DIM, generator=torch.Generator().manual_seed(1))
    expected = stream(stock, stock, frames)
    bound, report = transform(model, contract(), binding(("self.summing",)))
    actual = stream(bound, model, frames)
    assert all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))
    assert sorted(bound.calls) == [
        "smooth[n=2,L=0]{self.summing=True}",
        "smooth[n=2,L=2]{self.summing=False}",
        "smooth[n=2,L=4]{self.summing=False}",
        "smooth[n=2,L=4]{self.summing=True}",
    ]
    counters = report.operators["smooth"].counters
    assert (counters.calls, counters.graph_calls, counters.stock) == (CALLS, CALLS, 0)


def test_undeclared_the_flag_is_still_guarded_each_value_its_own_program():
    """A flag the binding does not declare as a mode is a module setting, guarded like every host
    value (it was frozen at its captured value before): each value is a variant of the class,
    captured and verified apart, and the stream stays exact."""
    switches = [True] * 6 + [False] * 3
    stock, model = Switched(), Switched()
    frames = torch.randn(1, CALLS * STEP, DIM, generator=torch.Generator().manual_seed(1))
    expected = stream(stock, stock, frames, switches)
    bound, report = transform(model, contract(), binding(()))
    actual = stream(bound, model, frames, switches)
    assert all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))
    steady = [cls for cls in report.operators["smooth"].classes.values() if cls.call.extent == WINDOW]
    assert [(cls.name, cls.hosts["self.summing"]) for cls in steady] == [("smooth[n=2,L=4]", True), ("smooth[n=2,L=4]#2", False)]
    assert report.operators["smooth"].counters.stock == 0


def test_a_mode_path_must_start_at_an_argument_or_the_model():
    with pytest.raises(BindingError, match=r"binding.operators\[0\].modes\[0\]: 'switch.summing' starts at 'switch'"):
        transform(Switched(), contract(), binding(("switch.summing",)))


def test_a_mode_must_be_a_host_value():
    model = Switched()
    bound, _ = transform(model, contract(), binding(("self.proj",)))
    with pytest.raises(TypeError, match="mode 'self.proj' is Linear; a mode is a host value"):
        bound(torch.zeros(1, STEP, DIM), Cache())


class Reciprocal(nn.Module):
    """A window whose output is divided by `self.scale`: 0.0 and -0.0 give +inf and -inf."""

    def __init__(self):
        super().__init__()
        self.scale = 0.0

    def forward(self, x: torch.Tensor, cache: Cache):
        full = x if cache.kept is None else torch.cat([cache.kept, x], dim=1)
        cache.kept = full[:, -WINDOW:]
        return full[:, -x.shape[1] :] / torch.full_like(x, self.scale)


def test_modes_equal_to_python_but_not_the_same_program_are_classes_apart():
    """0.0 == -0.0 in Python, yet dividing by one or the other gives infinities of opposite signs:
    a mode is told apart by its type and repr, and the replay engine admits each call to its own."""
    scales = [0.0, 0.0, 0.0, 0.0, -0.0, -0.0, 0.0, -0.0, 0.0]
    frames = torch.rand(1, CALLS * STEP, DIM, generator=torch.Generator().manual_seed(2)) + 1.0
    stock, model = Reciprocal(), Reciprocal()
    bound, report = transform(model, contract(), binding(("self.scale",)))
    cache, stock_cache, outputs, expected = Cache(), Cache(), [], []
    with torch.no_grad():
        for call, scale in enumerate(scales):
            model.scale = stock.scale = scale
            chunk = frames[:, call * STEP : (call + 1) * STEP]
            outputs.append(bound(chunk, cache))
            expected.append(stock(chunk, stock_cache))
    assert all(torch.equal(a, e) for a, e in zip(outputs, expected, strict=True))
    assert sorted(bound.calls) == [
        "smooth[n=2,L=0]{self.scale=0.0}",
        "smooth[n=2,L=2]{self.scale=0.0}",
        "smooth[n=2,L=4]{self.scale=-0.0}",
        "smooth[n=2,L=4]{self.scale=0.0}",
    ]
    # Past the first visits of each class (verified: one each at L=0 and L=2, two at each mode of
    # L=4), every call went through the replay engine (eager without CUDA),
    # never missing it: the engine keys each call with its modes as the pipeline named it.
    counters = report.operators["smooth"].counters
    assert (counters.calls, counters.graph_calls, counters.verified, counters.stock) == (CALLS, CALLS, 6, 0)
    assert dict(report.replays["smooth"].counters.fallbacks) == {"no_cuda": CALLS - 6}


def test_a_misspelt_mode_on_the_model_is_refused_when_the_transform_starts():
    with pytest.raises(BindingError, match=r"binding.operators\[0\].modes\[0\]: 'self.sumING' does not resolve on the model"):
        transform(Switched(), contract(), binding(("self.sumING",)))
