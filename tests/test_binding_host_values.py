"""Host values the binding pipeline cannot put in a graph fail closed, and say so: a position passed
as a Python int (every call a new signature), and a step count returned as a Python int (a graph
would return the first one every call). Either way the stream stays exactly the stock stream."""

from __future__ import annotations

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
    SlidingWindow,
    transform,
)
from cadence_fx.pipeline import VARIANTS

DIM, WINDOW, STEP, CALLS = 4, 4, 2, 9


class Cache:
    def __init__(self):
        self.kept = None
        self.calls = 0


class Smoother(nn.Module):
    """A concat-then-trim window; `position` offsets the input (a host int), and the call returns
    how many calls the cache has seen (a host int) beside its output."""

    def __init__(self, returns_count: bool):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(DIM, DIM)
        self.returns_count = returns_count

    def forward(self, x: torch.Tensor, cache: Cache, position: int = 0):
        x = self.proj(x) + position
        full = x if cache.kept is None else torch.cat([cache.kept, x], dim=1)
        cache.kept = full[:, -WINDOW:]
        cache.calls += 1
        out = full.cumsum(1)[:, -x.shape[1] :]
        return (out, cache.calls) if self.returns_count else out


def contract() -> Contract:
    return Contract(
        family="smoother",
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
        interactivity=Interactivity(stages=("smoother",)),
    )


BINDING = Binding(
    regions=(RegionBinding("window", at=("cache.kept",)),),
    operators=(OperatorBinding("smooth", units=("x", 1), counters=("cache.calls",)),),
)


def stream(model, frames, *, positions: bool):
    cache, outputs = Cache(), []
    with torch.no_grad():
        for call in range(CALLS):
            kwargs = {"position": call} if positions else {}
            outputs.append(model(frames[:, call * STEP : (call + 1) * STEP], cache, **kwargs))
    return outputs


def same(a, b) -> bool:
    if isinstance(a, tuple):
        return a[1] == b[1] and torch.equal(a[0], b[0])
    return torch.equal(a, b)


def test_a_position_passed_as_an_int_stops_capturing_after_a_few_variants_and_says_why():
    frames = torch.randn(1, CALLS * STEP, DIM, generator=torch.Generator().manual_seed(1))
    model = Smoother(returns_count=False).eval()
    bound, report = transform(model, contract(), BINDING)
    actual, expected = stream(bound, frames, positions=True), stream(model, frames, positions=True)
    assert all(same(a, e) for a, e in zip(actual, expected, strict=True))
    op = report.operators["smooth"]
    # Calls 0 and 1 fill the window (classes L=0 and L=2, one signature each); from call 2 on
    # every call is the steady class with a new position (and a new count of calls, a counter
    # guarded by its value): VARIANTS of them are captured, the rest run the stock code, counted
    # by the value that differs.
    assert len(op.classes) == 2 + VARIANTS
    assert op.counters.stock_by_reason == {"guard:cache.calls": CALLS - 2 - VARIANTS}
    (stamp,) = [s for s in report.stamps if "variants captured" in s]
    assert stamp.startswith(
        f"smooth[n={STEP},L={WINDOW}]: {VARIANTS} variants captured and this call differs from each "
        f"(cache.calls is 6, smooth[n={STEP},L={WINDOW}] was captured at 2"
    )
    assert stamp.endswith(
        "pass a value that changes every call as a tensor, or declare the counter's regime in the "
        "binding (`OperatorBinding.regimes`)"
    )


def test_a_host_value_the_call_returns_is_right_in_every_class():
    """The call returns its count of calls, a host value a graph returns as it was captured: the
    count is a guarded counter, so each value is a class of its own whose graph returns it (it was
    refused at the steady class's second visit before, or worse, returned stale past it)."""
    frames = torch.randn(1, CALLS * STEP, DIM, generator=torch.Generator().manual_seed(2))
    model = Smoother(returns_count=True).eval()
    bound, report = transform(model, contract(), BINDING)
    actual, expected = stream(bound, frames, positions=False), stream(model, frames, positions=False)
    assert all(same(a, e) for a, e in zip(actual, expected, strict=True))
    op = report.operators["smooth"]
    assert all(cls.refused is None for cls in op.classes.values())
    assert op.counters.stock_by_reason == {"guard:cache.calls": CALLS - 2 - VARIANTS}


class FlaggedCache:
    """A window whose host flags live in a dict the call updates in place (as Whisper's
    `EncoderDecoderCache.is_updated`)."""

    def __init__(self):
        self.kept = None
        self.flags = {"started": False}


class Starter(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, cache: FlaggedCache):
        x = self.proj(x)
        full = x if cache.kept is None else torch.cat([cache.kept, x], dim=1)
        cache.kept = full[:, -WINDOW:]
        cache.flags["started"] = True
        return full.cumsum(1)[:, -x.shape[1] :]


def test_a_counter_the_call_sets_is_each_stream_s_own_value_not_the_verified_call_s_object():
    """Bug (fixed in pipeline/verify.py and pipeline/operator.py): a counter that is no int (a dict of flags)
    was moved by handing every graph call the very object the verified stock call left, so every
    later stream's cache shared the first stream's dict: resetting one stream's flags reset all."""
    frames = torch.randn(1, CALLS * STEP, DIM, generator=torch.Generator().manual_seed(3))
    model = Starter().eval()
    binding = Binding(
        regions=BINDING.regions, operators=(OperatorBinding("smooth", units=("x", 1), counters=("cache.flags",)),), verify=1
    )
    bound, report = transform(model, contract(), binding)

    def stream(m, cache):
        with torch.no_grad():
            return [m(frames[:, call * STEP : (call + 1) * STEP], cache) for call in range(CALLS)]

    expected = stream(model, FlaggedCache())
    first, second = FlaggedCache(), FlaggedCache()
    for cache in (first, second):
        assert all(torch.equal(a, e) for a, e in zip(stream(bound, cache), expected, strict=True))
    assert report.operators["smooth"].counters.verified == 3  # the first stream's classes; the second runs graphs only
    assert second.flags == {"started": True} and second.flags is not first.flags
    first.flags["started"] = False  # the first stream starts over
    assert second.flags == {"started": True}
