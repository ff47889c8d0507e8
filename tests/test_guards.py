"""Sound admission: a class replays only the program the stock call would run, or the call runs the
stock code and the counters say why. Models whose code branches on a host counter: a cache that
fills then rolls, and a buffer refreshed every k calls; each in every order of arrival."""

from __future__ import annotations

import dataclasses

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
    RingCache,
    SlidingWindow,
    transform,
)
from cadence_fx.guards import Periodic, Saturating
from cadence_fx.program import OpTrace

DIM, WINDOW, PERIOD = 4, 3, 3


class Rolling:
    """A static sliding window: `filled` frames written in place, then rolled once full (the
    branch a host counter chooses, as `transformers`' static sliding-window layers do)."""

    def __init__(self):
        self.frames = torch.zeros(1, WINDOW, DIM)
        self.seen = 0


class Roller(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, cache: Rolling) -> torch.Tensor:
        y = self.proj(x)
        if cache.seen < WINDOW:
            cache.frames[:, cache.seen] = y[:, 0]
        else:
            cache.frames.copy_(torch.cat([cache.frames[:, 1:], y], dim=1))
        cache.seen += 1
        return torch.softmax(y @ cache.frames.transpose(1, 2), dim=-1) @ cache.frames


class Refreshed(nn.Module):
    """A buffer recomputed from the input every PERIOD calls, read in between."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, cache: Rolling) -> torch.Tensor:
        if cache.seen % PERIOD == 0:
            cache.frames.copy_(self.proj(x).expand(1, WINDOW, DIM))
        cache.seen += 1
        return x + cache.frames.sum(1, keepdim=True)


def contract() -> Contract:
    return Contract(
        family="roller",
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
        interactivity=Interactivity(stages=("roller",)),
    )


def binding(*regimes) -> Binding:
    return Binding(
        regions=(RegionBinding("frames", at=("cache.frames",)),),
        operators=(OperatorBinding("step", units=("x", 1), counters=("cache.seen",), regimes=tuple(regimes)),),
    )


def stream(model, frames: torch.Tensor, cache: Rolling | None = None) -> list[torch.Tensor]:
    cache = cache or Rolling()
    with torch.no_grad():
        return [model(frames[:, t : t + 1], cache) for t in range(frames.shape[1])]


def frames(calls: int, seed: int) -> torch.Tensor:
    return torch.randn(1, calls, DIM, generator=torch.Generator().manual_seed(seed))


def exact(model, bound, lengths: list[int]) -> None:
    for seed, length in enumerate(lengths):
        x = frames(length, seed)
        assert all(torch.equal(a, e) for a, e in zip(stream(bound, x), stream(model, x), strict=True))


@pytest.mark.parametrize("order", [[8, 2, 5], [2, 2, 8], [1, 8, 3]], ids=["long-first", "short-first", "ping-first"])
def test_a_cache_that_fills_then_rolls_is_exact_in_every_order_of_arrival(order):
    """Each fill level is a class of its own (Saturating: W + 1 of them); the full one is verified
    at two counts and replays from then on."""
    model = Roller().eval()
    bound, report = transform(model, contract(), binding(Saturating("cache.seen", at=WINDOW)))
    exact(model, bound, order)
    op = report.operators["step"]
    assert sorted(min(cls.hosts["cache.seen"], WINDOW) for cls in op.classes.values()) == list(range(min(max(order), WINDOW + 1)))
    assert op.counters.stock_by_reason == {}
    assert all(cls.refused is None for cls in op.classes.values())


def test_without_a_regime_each_count_is_its_own_class_and_the_rest_runs_stock_saying_which_value():
    model = Roller().eval()
    bound, report = transform(model, contract(), binding())
    exact(model, bound, [8])
    op = report.operators["step"]
    assert [cls.hosts["cache.seen"] for cls in op.classes.values()] == [0, 1, 2, 3]
    assert op.counters.stock_by_reason == {"guard:cache.seen": 4}


def test_a_regime_that_hides_a_value_the_program_reads_is_refused_naming_the_op():
    """Declared Saturating at 1, the fill level 1 and 2 share a class whose programs differ (they
    write another row): the second visit compares the programs and refuses the class."""
    model = Roller().eval()
    bound, report = transform(model, contract(), binding(Saturating("cache.seen", at=1)))
    exact(model, bound, [6, 6])
    refused = [cls for cls in report.operators["step"].classes.values() if cls.refused]
    assert len(refused) == 1
    assert refused[0].refused.startswith("verification: program: the exported step is not the program the stock call runs: op ")
    assert "the class was captured at cache.seen=1 and this call has cache.seen=2" in refused[0].refused


def test_a_buffer_refreshed_every_k_calls_replays_by_phase():
    model = Refreshed().eval()
    bound, report = transform(model, contract(), binding(Periodic("cache.seen", period=PERIOD)))
    exact(model, bound, [10, 4, 7])
    op = report.operators["step"]
    assert sorted({cls.hosts["cache.seen"] % PERIOD for cls in op.classes.values()}) == [0, 1, 2]
    assert op.counters.stock_by_reason == {}


def test_a_none_state_after_a_stream_runs_the_stock_call():
    class Optional(nn.Module):
        def forward(self, x: torch.Tensor, cache: Rolling | None = None) -> torch.Tensor:
            return x if cache is None else Roller.forward(roller, x, cache)

    roller = Roller().eval()
    model = Optional().eval()
    model.proj = roller.proj
    bound, report = transform(model, contract(), binding(Saturating("cache.seen", at=WINDOW)))
    x = frames(4, 0)
    exact(model, bound, [4])
    with torch.no_grad():
        assert torch.equal(bound(x[:, :1], None), x[:, :1])
    assert report.operators["step"].counters.stock_by_reason == {"no_state_yet": 1}


def test_a_stock_fallback_copies_no_state():
    model = Roller().eval()
    bound, report = transform(model, contract(), binding())
    x, cache = frames(6, 0), Rolling()
    stream(bound, x[:, :4], cache)  # four counts captured: the next runs the stock code
    with OpTrace() as trace, torch.no_grad():
        bound(x[:, 4:5], cache)
    assert report.operators["step"].counters.stock_by_reason == {"guard:cache.seen": 1}
    assert [r.op for r in trace.records if r.op in ("aten.clone.default", "aten.copy_.default")] == ["aten.copy_.default"]


def test_an_int_units_is_checked_against_the_call():
    """units=1 says every call brings one frame: a two-frame call is not that class (it was
    classed as a one-frame step before), it runs the stock code and says why."""
    model = Roller().eval()
    regimes = (Saturating("cache.seen", at=WINDOW),)
    fixed = Binding(regions=binding().regions, operators=(dataclasses.replace(binding().operators[0], units=1, regimes=regimes),))
    bound, report = transform(model, contract(), fixed)
    cache, stock_cache = Rolling(), Rolling()
    x, wide = frames(4, 0), frames(2, 1)
    with torch.no_grad():
        assert torch.equal(bound(x[:, :1], cache), model(x[:, :1], stock_cache))
        assert torch.equal(bound(wide, cache), model(wide, stock_cache))
        assert torch.equal(cache.frames, stock_cache.frames) and cache.seen == stock_cache.seen == 2
    assert report.operators["step"].counters.stock_by_reason == {"units": 1}
    assert (
        "step: runs the stock code (units): step: the binding's units=1 says every call brings 1 units, but this "
        "call's inputs differ: ['x'] (1, 2, 4) (the class was captured at (1, 1, 4)); bind units as (argument, axis)"
        in report.stamps
    )


def test_a_regime_must_be_one_of_the_kinds():
    model = Roller().eval()
    with pytest.raises(BindingError, match=r"binding.operators\[0\].regimes\[0\]: needs a Saturating, Periodic or Unread"):
        transform(model, contract(), binding("cache.seen"))
    with pytest.raises(ValueError, match=r"Saturating\('cache.seen'\).at must be an int >= 0, got -1"):
        Saturating("cache.seen", at=-1)


class TwoRates(nn.Module):
    """Two windows under one call: the frames (2 a call, keeps 4) and their pooled summary (1 a
    call, keeps 3), each concatenated then trimmed."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, cache: dict) -> torch.Tensor:
        y = self.proj(x)
        frames = y if cache["frames"] is None else torch.cat([cache["frames"], y], dim=1)
        pooled = y.mean(1, keepdim=True)
        summary = pooled if cache["summary"] is None else torch.cat([cache["summary"], pooled], dim=1)
        cache["frames"], cache["summary"] = frames[:, -4:], summary[:, -3:]
        return frames.sum(1, keepdim=True) + summary.sum(1, keepdim=True)


def test_two_regions_advancing_at_their_own_strides_under_one_operator_are_rewritten():
    """The second region's live extent is its own stride past what it retains (it was the
    operator's units, and every class was refused: "operand cat_1 has extent 2 ... declares 1")."""
    contract = Contract(
        family="two_rates",
        clocks=(Clock("frame", ClockKind.FRAMES), Clock("pool", ClockKind.FRAMES), Clock("call", ClockKind.CALLS)),
        rates=(Rate("frame", "call", 2, name="frames_per_call"), Rate("pool", "call", 1, name="pools_per_call")),
        quantities={"dim": DIM},
        regions=(
            Region(
                "frames",
                dims=(1, "frame", "dim"),
                axis=1,
                clock="frame",
                stride=2,
                dtype="float32",
                lifetime=Lifetime.PER_STREAM,
                retention=SlidingWindow(window=4),
            ),
            Region(
                "summary",
                dims=(1, "pool", "dim"),
                axis=1,
                clock="pool",
                stride=1,
                dtype="float32",
                lifetime=Lifetime.PER_STREAM,
                retention=SlidingWindow(window=3),
            ),
        ),
        operators=(Operator("step", "frames", steady=2),),
        admission=Admission("frame", max_per_call=2),
        interactivity=Interactivity(stages=("two_rates",)),
    )
    binding = Binding(
        regions=(RegionBinding("frames", at=("cache.frames",)), RegionBinding("summary", at=("cache.summary",))),
        operators=(OperatorBinding("step", units=("x", 1)),),
    )
    model = TwoRates().eval()
    bound, report = transform(model, contract, binding)
    x = frames(16, 4)
    with torch.no_grad():
        for _ in range(2):
            cache, stock_cache = {"frames": None, "summary": None}, {"frames": None, "summary": None}
            for t in range(0, 16, 2):
                assert torch.equal(bound(x[:, t : t + 2], cache), model(x[:, t : t + 2], stock_cache))
    op = report.operators["step"]
    # The frames' extents 0, 2, 4; at 4 the summary holds 2 pooled frames on the third call and 3
    # from the fourth on: two programs of that class, each verified.
    assert [(cls.name, cls.refused) for cls in op.classes.values()] == [
        ("step[n=2,L=0]", None),
        ("step[n=2,L=2]", None),
        ("step[n=2,L=4]", None),
        ("step[n=2,L=4]#2", None),
    ]
    assert op.counters.as_dict() == {
        "calls": 16,
        "graph_calls": 16,
        "verified": 8,
        "stock": 0,
        "adopted": 0,
        "evicted": 2,
        "stock_by_reason": {},
    }
