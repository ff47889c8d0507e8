"""The `InPlace` retention kind: a buffer of one fixed shape that every call overwrites with
`copy_` (a causal convolution's padding cache), declared with no clock, axis or stride.

Before this kind existed such a buffer could only be declared as a `RingCache` along a clock made
up for it (stride 1, since a ring must hold a whole call), which the contract then checked
against nothing real. Here the operator whose region it is counts its units in the admission's
clock, the catalog has one class, and the stream runs on the graphs bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cadence_fx import (
    Admission,
    Binding,
    Clock,
    ClockKind,
    Contract,
    ContractError,
    InPlace,
    Interactivity,
    Lifetime,
    Operator,
    OperatorBinding,
    Rate,
    Region,
    RegionBinding,
    RingCache,
    derive,
    transform,
)

LAYERS, CHANNELS, KERNEL, STEP = 2, 6, 3, 4


class PaddedConvStack(nn.Module):
    """Causal convolutions, each keeping its last KERNEL - 1 input frames in a registered buffer it
    overwrites with `copy_` after every call (the shape never changes)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.convs = nn.ModuleList(nn.Conv1d(CHANNELS, CHANNELS, KERNEL) for _ in range(LAYERS))
        self.register_buffer("pads", torch.zeros(LAYERS, 1, CHANNELS, KERNEL - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, conv in enumerate(self.convs):
            full = torch.cat([self.pads[i], x], dim=-1)
            self.pads[i].copy_(full[..., -(KERNEL - 1) :])
            x = torch.tanh(conv(full))
        return x


def contract(**region) -> Contract:
    fields = dict(dims=("layers", 1, "channels", KERNEL - 1), dtype="float32", lifetime=Lifetime.PER_STREAM, retention=InPlace())
    fields.update(region)
    return Contract(
        family="padded_conv",
        clocks=(Clock("frame", ClockKind.FRAMES), Clock("call", ClockKind.CALLS)),
        rates=(Rate("frame", "call", STEP, name="frames_per_call"),),
        quantities={"layers": LAYERS, "channels": CHANNELS},
        regions=(Region("pads", **fields),),
        operators=(Operator("conv_step", "pads", steady=STEP),),
        admission=Admission("frame", max_per_call=STEP),
        interactivity=Interactivity(stages=("vocoder",)),
    )


BINDING = Binding(
    regions=(RegionBinding("pads", at=("self.pads",)),), operators=(OperatorBinding("conv_step", units=("x", 2)),), verify=2
)


def test_an_in_place_region_derives_one_class_at_its_fixed_shape():
    catalog = derive(contract())
    region = catalog.region("pads")
    assert (region.lower, region.bound, region.window) == (KERNEL - 1, KERNEL - 1, 0)
    assert region.shape == (LAYERS, 1, CHANNELS, KERNEL - 1)
    assert region.bytes == 4 * LAYERS * CHANNELS * (KERNEL - 1)
    op = catalog.operator("conv_step")
    assert (op.width, op.grid, [(c.call, c.extent, c.flush) for c in op.classes]) == (
        1,
        (KERNEL - 1,),
        [(STEP, KERNEL - 1, False)],
    )


@pytest.mark.parametrize(
    "field, value, message",
    [
        (
            "clock",
            "frame",
            "regions[0].clock: an InPlace region has one fixed shape and advances along no "
            "clock: leave `clock` unset, got 'frame'",
        ),
        (
            "axis",
            3,
            "regions[0].axis: an InPlace region has one fixed shape and advances along no clock: leave `axis` unset, got 3",
        ),
        (
            "stride",
            1,
            "regions[0].stride: an InPlace region has one fixed shape and advances along no clock: leave `stride` unset, got 1",
        ),
        (
            "dims",
            ("layers", 1, "channels", "frame"),
            "regions[0].dims[3]: an InPlace region's dims are fixed: ['frame'] is not a quantity or named rate of the contract",
        ),
    ],
)
def test_an_in_place_region_that_names_a_clock_is_refused_by_field(field, value, message):
    with pytest.raises(ContractError) as refused:
        contract(**{field: value})
    assert str(refused.value).startswith(message)


def test_an_operator_on_an_in_place_region_counts_its_units_in_the_admission_clock():
    with pytest.raises(ContractError) as refused:
        Contract(**{**contract().__dict__, "operators": (Operator("conv_step", "pads", steady=STEP + 1),)})
    assert str(refused.value).startswith(
        f"operators[0].steady: {STEP + 1} frame per call is {STEP + 1} frame, outside the admission predicate 0 < n <= {STEP}"
    )


def stream(model: nn.Module, frames: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    outputs, pads = [], []
    with torch.no_grad():
        for t in range(0, frames.shape[-1], STEP):
            outputs.append(model(frames[..., t : t + STEP]))
            pads.append(model.pads.clone())
    return outputs, pads


def test_a_padding_cache_written_with_copy_streams_on_its_carry_bit_identically():
    frames = torch.randn(1, CHANNELS, 7 * STEP, generator=torch.Generator().manual_seed(1))
    stock = PaddedConvStack().eval()
    expected, expected_pads = stream(stock, frames)
    model = PaddedConvStack().eval()
    bound, report = transform(model, contract(), BINDING)
    for _ in range(2):  # two streams, the buffer zeroed in place between them
        model.pads.zero_()
        actual, pads = stream(bound, frames)
        assert all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))
        assert all(torch.equal(a, e) for a, e in zip(pads, expected_pads, strict=True))
    op = report.operators["conv_step"]
    assert [cls.name for cls in op.classes.values()] == [f"conv_step[n={STEP},L={KERNEL - 1}]"]
    # The model's buffer is adopted into the carry once; from then on it is the carry's view.
    assert op.counters.as_dict() == {
        "calls": 14,
        "graph_calls": 14,
        "verified": 2,
        "stock": 0,
        "adopted": 1,
        "stock_by_reason": {},
    }
    assert model.pads.data_ptr() == report.carries["pads"].buffer.data_ptr()
    assert [(s.kind, s.rewritten) for s in report.sites] == [("ring", False)]
    assert report.sites[0].reason.startswith("self.pads: written in place by the step")


def test_the_same_buffer_as_a_ring_needs_a_clock_the_model_does_not_have():
    """What the kind replaces: as a RingCache along the frames it really advances by, the padding
    cache (KERNEL - 1 frames) is refused, since a ring must hold a whole call (STEP frames)."""
    with pytest.raises(ContractError) as refused:
        contract(dims=("layers", 1, "channels", "frame"), axis=3, clock="frame", stride=STEP, retention=RingCache(KERNEL - 1))
    assert str(refused.value) == (
        f"regions[0].retention.capacity: retention bound {KERNEL - 1} is below the chunk (stride {STEP}) (rule C2)"
    )
