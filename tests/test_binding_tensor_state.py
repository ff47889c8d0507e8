"""The plainest streaming step: `forward(x, state=None) -> (y, new_state)`, its state one tensor
argument (None on the first call) that it concatenates then trims and returns. The binding names
the argument itself (`at=("state",)`, `out=("return.1",)`); extra keywords go through `**kwargs`."""

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

CHANNELS, CONTEXT, HOP, CALLS = 3, 6, 2, 8


class CausalConv(nn.Module):
    """A causal convolution streamed with its left context as state."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv1d(CHANNELS, CHANNELS, kernel_size=CONTEXT + 1)

    def forward(self, x: torch.Tensor, state: torch.Tensor | None = None, **options):
        if state is None:
            state = x.new_zeros(x.shape[0], CHANNELS, CONTEXT)
        full = torch.cat([state, x], dim=2)
        y = self.conv(full) * options.get("gain", 1.0)
        return y, full[:, :, -CONTEXT:]


def contract() -> Contract:
    return Contract(
        family="causal_conv",
        clocks=(Clock("sample", ClockKind.SAMPLES), Clock("call", ClockKind.CALLS)),
        rates=(Rate("sample", "call", HOP, name="hop"),),
        quantities={"channels": CHANNELS},
        regions=(
            Region(
                "context",
                dims=(1, "channels", "sample"),
                axis=2,
                clock="sample",
                stride=HOP,
                dtype="float32",
                lifetime=Lifetime.PER_STREAM,
                retention=SlidingWindow(window=CONTEXT, initial=CONTEXT),
                holds_call=False,
            ),
        ),
        operators=(Operator("conv", "context", steady=HOP),),
        admission=Admission("sample", max_per_call=HOP),
        interactivity=Interactivity(stages=("conv",)),
    )


BINDING = Binding(
    regions=(RegionBinding("context", at=("state",), out=("return.1",)),), operators=(OperatorBinding("conv", units=("x", 2)),)
)


def stream(model, signal):
    state, outputs = None, []
    with torch.no_grad():
        for t in range(0, signal.shape[2], HOP):
            y, state = model(signal[:, :, t : t + HOP], state, gain=0.5)
            outputs.append(y)
    return outputs, state


def test_a_tensor_state_argument_streams_bit_identically_through_its_carry():
    model = CausalConv().eval()
    signal = torch.randn(1, CHANNELS, CALLS * HOP, generator=torch.Generator().manual_seed(1))
    expected, expected_state = stream(model, signal)
    bound, report = transform(model, contract(), BINDING)
    for _ in range(2):
        actual, state = stream(bound, signal)
        assert all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))
        assert torch.equal(state, expected_state)
        assert state.data_ptr() == report.carries["context"].buffer.data_ptr()
    op = report.operators["conv"]
    # The first call of each stream (state None: the step makes its own zeros) is no class of the
    # catalog (which starts from the CONTEXT samples retained); it runs the stock code.
    assert [cls.name for cls in op.classes.values()] == [f"conv[n={HOP},L={CONTEXT}]"]
    assert op.counters.stock_by_reason == {"not_in_catalog": 2}
    assert [(s.kind, s.rewritten) for s in report.sites] == [("append", True)]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_a_tensor_state_argument_replays_on_cuda():
    model = CausalConv().eval().cuda()
    signal = torch.randn(1, CHANNELS, CALLS * HOP, generator=torch.Generator().manual_seed(1)).cuda()
    expected, _ = stream(model, signal)
    bound, report = transform(model, contract(), BINDING)
    for _ in range(2):
        actual, _ = stream(bound, signal)
        assert all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))
    # 7 steady calls a stream: the first two ever are verified, the 12 others replay.
    assert report.replays["conv"].counters.as_dict() == {
        "calls": 12,
        "captures": 1,
        "replays": 12,
        "eager": 0,
        "invalidations": 0,
        "fallbacks": {},
    }
    print("adopted", report.operators["conv"].counters.adopted)
