"""The binding pipeline on state a model keeps in its own buffers: a hand-written streaming
attention stack whose layers reassign their K/V buffers by concat then trim (`self.*` paths)."""

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

WIDTH, HEADS, WINDOW, STEP, LAYERS = 16, 2, 6, 2, 3


class StreamingAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("keys", torch.zeros(1, HEADS, 0, WIDTH // HEADS))
        self.register_buffer("values", torch.zeros(1, HEADS, 0, WIDTH // HEADS))

    def forward(self, x):
        q, k, v = (t.view(1, -1, HEADS, WIDTH // HEADS).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        keys, values = torch.cat([self.keys, k], dim=2), torch.cat([self.values, v], dim=2)
        self.keys, self.values = keys[:, :, -WINDOW:], values[:, :, -WINDOW:]
        y = nn.functional.scaled_dot_product_attention(q, keys, values)
        return x + self.out(y.transpose(1, 2).reshape(1, -1, WIDTH))


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(StreamingAttention() for _ in range(LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


CONTRACT = Contract(
    family="toy_stack",
    clocks=(Clock("frame", ClockKind.FRAMES), Clock("call", ClockKind.CALLS)),
    rates=(Rate("frame", "call", STEP, name="frames_per_call"),),
    quantities={"layers": LAYERS, "heads": HEADS, "head_dim": WIDTH // HEADS},
    regions=(
        Region(
            "kv",
            dims=("layers", 2, 1, "heads", "frame", "head_dim"),
            axis=4,
            clock="frame",
            stride=STEP,
            dtype="float32",
            lifetime=Lifetime.PER_STREAM,
            retention=SlidingWindow(window=WINDOW),
        ),
    ),
    operators=(Operator("stack_step", "kv", steady=STEP),),
    admission=Admission("frame", max_per_call=STEP),
    interactivity=Interactivity(stages=("stack",)),
)
BINDING = Binding(
    regions=(RegionBinding("kv", at=("self.layers.*.keys", "self.layers.*.values")),),
    operators=(OperatorBinding("stack_step", units=("x", 1)),),
)


def test_state_in_module_buffers_streams_bit_for_bit_on_carries():
    torch.manual_seed(0)
    model = Stack().eval()
    frames = torch.randn(1, 10 * STEP, WIDTH, generator=torch.Generator().manual_seed(1))
    fresh = {name: buffer.clone() for name, buffer in model.named_buffers()}
    with torch.no_grad():
        expected = [model(frames[:, t : t + STEP]) for t in range(0, frames.shape[1], STEP)]
    for name, buffer in fresh.items():  # a new stream: the stock model's empty state back
        model.get_submodule(name.rsplit(".", 1)[0]).register_buffer(name.rsplit(".", 1)[1], buffer)
    bound, report = transform(model, CONTRACT, BINDING)
    with torch.no_grad():
        actual = [bound(frames[:, t : t + STEP]) for t in range(0, frames.shape[1], STEP)]
    assert all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))
    op = report.operators["stack_step"]
    assert [cls.name for cls in op.classes.values()] == [f"stack_step[n=2,L={e}]" for e in (0, 2, 4, 6)]
    assert (op.counters.stock, op.counters.graph_calls) == (0, 10)
    # the model's buffers are the carries' views now, one address each for the whole stream
    assert {layer.keys.data_ptr() for layer in model.layers} == {c.address for n, c in op.carries.items() if n.endswith("keys")}
    weights = {p.data_ptr() for p in model.parameters()}
    assert all({p.data_ptr() for p in after.parameters()} == weights for _, after in report.graphs.values())
