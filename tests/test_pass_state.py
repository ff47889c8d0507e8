"""The state rule on a hand-made module: a stock envelope buffer is replaced in place by one of the
demand shape the catalog derives, and nothing else changes."""

from __future__ import annotations

import copy

import pytest
import torch

from cadence_fx import (
    Admission,
    Clock,
    ClockKind,
    Contract,
    Interactivity,
    Lifetime,
    Operator,
    Rate,
    Region,
    SlidingWindow,
    derive,
)
from cadence_fx.passes.state import Envelope, Resize, apply_state_rule, shed_envelopes

ENVELOPE = Envelope("attention.cache", "kv")


def toy_catalog(window: int = 6):
    """A K/V region of 2 heads x frames x 4 features, 2 frames a call, a window of `window`
    frames: demand (2, window + 2, 4) against a stock (2, 100, 4)."""
    contract = Contract(
        family="toy",
        clocks=(Clock("frame", ClockKind.FRAMES), Clock("call", ClockKind.CALLS)),
        rates=(Rate("frame", "call", 2),),
        quantities={"heads": 2, "width": 4},
        regions=(
            Region(
                "kv",
                dims=("heads", "frame", "width"),
                axis=1,
                clock="frame",
                stride=2,
                dtype="float32",
                lifetime=Lifetime.PER_STREAM,
                retention=SlidingWindow(window=window),
                stock_dims=(2, 100, 4),
            ),
        ),
        operators=(Operator("step", "kv", steady=2),),
        admission=Admission("frame", max_per_call=2),
        interactivity=Interactivity(stages=("step",)),
    )
    return derive(contract)


class Attention(torch.nn.Module):
    """Stock code that provisions a 100-frame envelope and indexes its first `n` frames."""

    def __init__(self, frames: int = 100, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("cache", torch.randn(2, frames, 4).to(dtype))
        self.register_buffer("scale", torch.full((4,), 0.5))

    def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
        self.cache[:, n - x.shape[1] : n].copy_(x)
        return self.proj(self.cache[:, :n] * self.scale).sum(1)


class Model(torch.nn.Module):
    def __init__(self, **kwargs) -> None:
        super().__init__()
        self.attention = Attention(**kwargs)


def test_the_envelope_is_replaced_on_the_module_by_a_zeroed_buffer_of_the_demand_shape():
    model = Model()
    resizes, stamp = apply_state_rule(model, (ENVELOPE,), toy_catalog(), device=torch.device("cpu"))
    assert resizes == [Resize("attention.cache", "kv", (2, 100, 4), 3200, (2, 8, 4), 256)]
    assert torch.equal(model.attention.cache, torch.zeros(2, 8, 4))
    assert "cache" in model.attention._buffers
    assert stamp.startswith("state rule: 1 envelopes resized to demand, took ")


def test_the_stock_code_runs_unchanged_on_the_resized_buffer_with_the_same_outputs():
    torch.manual_seed(0)
    stock = Model()
    resized = copy.deepcopy(stock)
    apply_state_rule(resized, (ENVELOPE,), toy_catalog(), device=torch.device("cpu"))
    stock.attention.cache.zero_()
    xs = torch.randn(4, 2, 2, 4)
    for call, x in enumerate(xs, start=1):
        assert torch.equal(resized.attention(x, 2 * call), stock.attention(x, 2 * call))


def test_every_other_parameter_and_buffer_is_left_as_it_was():
    model = Model()
    before = {name: t for name, t in (*model.named_parameters(), *model.named_buffers()) if name != "attention.cache"}
    apply_state_rule(model, (ENVELOPE,), toy_catalog(), device=torch.device("cpu"))
    after = {name: t for name, t in (*model.named_parameters(), *model.named_buffers()) if name != "attention.cache"}
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)


@pytest.mark.parametrize(
    ("model", "envelope", "message"),
    [
        (Model(), Envelope("attention.proj.weight", "kv"), "'attention.proj.weight' is not a buffer of Linear; buffers: []"),
        (
            Model(frames=4),
            ENVELOPE,
            "'attention.cache': demand (2, 8, 4) exceeds the stock envelope (2, 4, 4); the contract and the model disagree",
        ),
        (Model(dtype=torch.float16), ENVELOPE, "'attention.cache' is torch.float16, region 'kv' declares float32"),
    ],
    ids=["not_a_buffer", "demand_exceeds_stock", "dtype"],
)
def test_an_envelope_the_model_does_not_have_as_declared_is_refused(model, envelope, message):
    with pytest.raises(ValueError) as error:
        apply_state_rule(model, (envelope,), toy_catalog(), device=torch.device("cpu"))
    assert str(error.value) == message


def test_an_envelope_of_another_rank_is_refused():
    model = Model()
    model.attention.cache = torch.zeros(2, 100)
    with pytest.raises(ValueError) as error:
        apply_state_rule(model, (ENVELOPE,), toy_catalog(), device=torch.device("cpu"))
    assert str(error.value) == "'attention.cache' has shape (2, 100), region 'kv' has rank 3"


def test_copying_a_model_with_shed_envelopes_never_copies_the_envelope():
    model = Model()
    twin = copy.deepcopy(model, shed_envelopes(model, (ENVELOPE,)))
    assert (twin.attention.cache.device.type, tuple(twin.attention.cache.shape)) == ("meta", (2, 100, 4))
    assert torch.equal(twin.attention.proj.weight, model.attention.proj.weight)
    assert twin.attention.proj.weight is not model.attention.proj.weight
    assert model.attention.cache.device.type == "cpu"
    apply_state_rule(twin, (ENVELOPE,), toy_catalog(), device=torch.device("cpu"))
    assert torch.equal(twin.attention.cache, torch.zeros(2, 8, 4))
