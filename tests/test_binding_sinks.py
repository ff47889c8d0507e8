"""The binding pipeline on a retention it has never been shown: a user's own streaming attention
with sinks (StreamingLLM-style), whose cache object keeps the first SINKS frames plus the newest
HISTORY by concat then head-and-tail trim. Declared as PromptPlusHistory in the contract and
bound by path, it streams bit-identically to the stock model on one carry address per site."""

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
    PromptPlusHistory,
    Rate,
    Region,
    RegionBinding,
    transform,
)

LAYERS, HEADS, HEAD_DIM, SINKS, HISTORY, STEP = 2, 2, 4, 4, 6, 2
DIM = HEADS * HEAD_DIM


class SinkCache:
    """The user's cache: per layer, keys and values (None before the first call)."""

    def __init__(self):
        self.keys: list = [None] * LAYERS
        self.values: list = [None] * LAYERS


class SinkDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.ModuleList(nn.Linear(DIM, 3 * DIM) for _ in range(LAYERS))
        self.out = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(LAYERS))

    @staticmethod
    def _retain(t: torch.Tensor) -> torch.Tensor:
        if t.shape[2] <= SINKS + HISTORY:
            return t
        return torch.cat([t[:, :, :SINKS], t[:, :, -HISTORY:]], dim=2)

    def forward(self, x: torch.Tensor, cache: SinkCache) -> torch.Tensor:
        n = x.shape[1]
        for layer, (qkv, out) in enumerate(zip(self.qkv, self.out)):
            q, k, v = (t.view(1, n, HEADS, HEAD_DIM).transpose(1, 2) for t in qkv(x).chunk(3, dim=-1))
            if cache.keys[layer] is not None:
                k = torch.cat([cache.keys[layer], k], dim=2)
                v = torch.cat([cache.values[layer], v], dim=2)
            attention = torch.softmax(q @ k.transpose(-1, -2) / HEAD_DIM**0.5, dim=-1) @ v
            x = x + out(attention.transpose(1, 2).reshape(1, n, DIM))
            cache.keys[layer], cache.values[layer] = self._retain(k), self._retain(v)
        return x


def contract() -> Contract:
    return Contract(
        family="sink_decoder",
        clocks=(Clock("frame", ClockKind.FRAMES), Clock("call", ClockKind.CALLS)),
        rates=(Rate("frame", "call", STEP, name="frames_per_call"),),
        quantities={"layers": LAYERS, "heads": HEADS, "head_dim": HEAD_DIM},
        regions=(
            Region(
                "kv",
                dims=("layers", 2, 1, "heads", "frame", "head_dim"),
                axis=4,
                clock="frame",
                stride=STEP,
                dtype="float32",
                lifetime=Lifetime.PER_STREAM,
                retention=PromptPlusHistory(prompt=SINKS, history=HISTORY),
            ),
        ),
        operators=(Operator("step", "kv", steady=STEP),),
        admission=Admission("frame", max_per_call=SINKS),
        interactivity=Interactivity(stages=("decoder",)),
    )


BINDING = Binding(
    regions=(RegionBinding("kv", at=("cache.keys.*", "cache.values.*")),), operators=(OperatorBinding("step", units=("x", 1)),)
)


def stream(model, frames: torch.Tensor):
    """The prompt's SINKS frames in one call, then STEP frames a call."""
    cache, outputs, addresses = SinkCache(), [], set()
    with torch.no_grad():
        outputs.append(model(frames[:, :SINKS], cache))
        for t in range(SINKS, frames.shape[1], STEP):
            outputs.append(model(frames[:, t : t + STEP], cache))
            addresses.add(tuple(t.data_ptr() for t in (*cache.keys, *cache.values)))
    return outputs, addresses


def test_a_sink_cache_streams_bit_identically_on_one_address_per_site():
    model = SinkDecoder().eval()
    frames = torch.randn(1, SINKS + 10 * STEP, DIM, generator=torch.Generator().manual_seed(1))
    expected, _ = stream(model, frames)
    bound, report = transform(model, contract(), BINDING)
    for _ in range(3):  # three streams over the same carries
        actual, addresses = stream(bound, frames)
        assert all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))
        assert len(addresses) == 1
    op = report.operators["step"]
    # Retained extents: the prompt's 4 frames, then 2 more a call up to 4 + 6; the prompt call
    # itself (4 frames onto nothing) is no class of the catalog and runs the stock code.
    assert [cls.name for cls in op.classes.values()] == [f"step[n=2,L={extent}]" for extent in (4, 6, 8, 10)]
    assert all(cls.refused is None for cls in op.classes.values())
    assert bound.calls == {"step[n=2,L=4]": 3, "step[n=2,L=6]": 3, "step[n=2,L=8]": 3, "step[n=2,L=10]": 3 * 7}
    assert op.counters.stock_by_reason == {"not_in_catalog": 3}
    assert report.carries["kv"].buffer.shape == (LAYERS, 2, 1, HEADS, SINKS + HISTORY + STEP, HEAD_DIM)
    steady = [s for s in report.sites if s.graph == "step[n=2,L=10]"]
    assert len(steady) == 2 * LAYERS and all("its first 4 and last 6 units compacted in place" in s.reason for s in steady)
