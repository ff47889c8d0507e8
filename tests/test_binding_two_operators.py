"""Two hot operators on one bound model, each with its own state argument, and one region both
use: `encode(x, memory)` retains a window of encoder frames, `decode(y, history, memory)` retains
its own window and attends over the encoder's. Each operator binds the regions its arguments
reach; the region they share keeps one buffer and one carry per site, so `decode` reads exactly
what `encode` retained."""

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

DIM, ENC_WINDOW, ENC_STEP, DEC_WINDOW, CALLS = 4, 4, 2, 3, 7


class Window:
    def __init__(self):
        self.kept = None


def retain(window: Window, new: torch.Tensor, keep: int) -> torch.Tensor:
    full = new if window.kept is None else torch.cat([window.kept, new], dim=1)
    window.kept = full[:, -keep:]
    return full


class EncoderDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.enc, self.dec = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def encode(self, x: torch.Tensor, memory: Window) -> torch.Tensor:
        full = retain(memory, self.enc(x), ENC_WINDOW)
        return full.cumsum(1)[:, -x.shape[1] :]

    def decode(self, y: torch.Tensor, history: Window, memory: Window) -> torch.Tensor:
        full = retain(history, self.dec(y), DEC_WINDOW)
        scores = torch.softmax(full @ memory.kept.transpose(1, 2), dim=-1)
        return (scores @ memory.kept)[:, -y.shape[1] :]


def contract() -> Contract:
    return Contract(
        family="encoder_decoder",
        clocks=(Clock("frame", ClockKind.FRAMES), Clock("token", ClockKind.TOKENS), Clock("call", ClockKind.CALLS)),
        rates=(Rate("frame", "call", ENC_STEP, name="frames_per_call"), Rate("token", "call", 1)),
        quantities={"dim": DIM},
        regions=(
            Region(
                "memory",
                dims=(1, "frame", "dim"),
                axis=1,
                clock="frame",
                stride=ENC_STEP,
                dtype="float32",
                lifetime=Lifetime.PER_STREAM,
                retention=SlidingWindow(window=ENC_WINDOW),
            ),
            Region(
                "history",
                dims=(1, "token", "dim"),
                axis=1,
                clock="token",
                stride=1,
                dtype="float32",
                lifetime=Lifetime.PER_STREAM,
                retention=SlidingWindow(window=DEC_WINDOW),
            ),
        ),
        operators=(Operator("encode", "memory", steady=ENC_STEP), Operator("decode", "history", steady=1)),
        admission=Admission("frame", max_per_call=ENC_STEP),
        interactivity=Interactivity(stages=("encoder", "decoder")),
    )


BINDING = Binding(
    regions=(RegionBinding("memory", at=("memory.kept",)), RegionBinding("history", at=("history.kept",))),
    operators=(
        OperatorBinding("encode", method="encode", units=("x", 1)),
        OperatorBinding("decode", method="decode", units=("y", 1)),
    ),
)


def stream(model, frames, tokens):
    memory, history, outputs = Window(), Window(), []
    with torch.no_grad():
        for call in range(CALLS):
            outputs.append(model.encode(frames[:, call * ENC_STEP : (call + 1) * ENC_STEP], memory))
            outputs.append(model.decode(tokens[:, call : call + 1], history, memory))
    return outputs, memory, history


def test_two_operators_share_the_region_both_bind_and_stream_bit_identically():
    model = EncoderDecoder().eval()
    frames = torch.randn(1, CALLS * ENC_STEP, DIM, generator=torch.Generator().manual_seed(1))
    tokens = torch.randn(1, CALLS, DIM, generator=torch.Generator().manual_seed(2))
    expected, _, _ = stream(model, frames, tokens)
    bound, report = transform(model, contract(), BINDING)
    for _ in range(2):
        actual, memory, history = stream(bound, frames, tokens)
        assert all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))
    encode, decode = report.operators["encode"], report.operators["decode"]
    assert [rb.region for rb in encode.regions] == ["memory"]
    assert [rb.region for rb in decode.regions] == ["memory", "history"]
    # one carry for the shared site, whichever operator's path reaches it
    assert encode.carries["memory.kept"] is decode.carries["memory.kept"]
    assert memory.kept.data_ptr() == report.carries["memory"].buffer.data_ptr()
    assert history.kept.data_ptr() == report.carries["history"].buffer.data_ptr()
    for op in (encode, decode):
        assert op.counters.stock == 0 and all(cls.refused is None for cls in op.classes.values())
    # decode reads the memory as encode left it: its sites there are reads, not retentions
    reads = [s for s in report.sites if s.kind == "read"]
    assert reads and all(s.region == "memory" and s.graph.startswith("decode[") for s in reads)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_two_operators_replay_on_cuda_with_the_shared_region_aliased():
    model = EncoderDecoder().eval().cuda()
    frames = torch.randn(1, CALLS * ENC_STEP, DIM, generator=torch.Generator().manual_seed(1)).cuda()
    tokens = torch.randn(1, CALLS, DIM, generator=torch.Generator().manual_seed(2)).cuda()
    expected, _, _ = stream(model, frames, tokens)
    bound, report = transform(model, contract(), BINDING)
    for _ in range(2):
        actual, _, _ = stream(bound, frames, tokens)
        assert all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))
    # encode: its steady class (4 frames retained) is met 5 times a stream: 2 verified, 8 replayed.
    # decode: its steady class (3 tokens retained, over 4 frames of memory) 4 times a stream: 6 replayed.
    assert report.replays["encode"].counters.as_dict() == {
        "calls": 8,
        "captures": 1,
        "replays": 8,
        "eager": 0,
        "invalidations": 0,
        "fallbacks": {},
    }
    assert report.replays["decode"].counters.as_dict() == {
        "calls": 6,
        "captures": 1,
        "replays": 6,
        "eager": 0,
        "invalidations": 0,
        "fallbacks": {},
    }


def test_a_region_no_operator_reaches_is_refused_naming_the_arguments():
    from cadence_fx import BindingError

    stray = Binding(
        regions=(RegionBinding("memory", at=("memory.kept",)), RegionBinding("history", at=("past.kept",))),
        operators=(OperatorBinding("encode", method="encode", units=("x", 1)),),
    )
    with pytest.raises(BindingError) as error:
        transform(EncoderDecoder(), contract(), stray)
    assert str(error.value) == (
        "binding.regions[1].at: ('past.kept',): no operator's method takes the arguments these paths start at, so no "
        "operator would keep this region; the methods' arguments: {'encode': ['memory', 'x']}"
    )
