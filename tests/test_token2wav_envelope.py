"""The batch-invariant envelope op by op (CPU), the per-stream RNG, and the float16 declaration."""

import pytest
import torch
import torch.nn.functional as F

from cadence_fx.models.token2wav_batch import BatchedStreams
from cadence_fx.models.token2wav_envelope import (
    OP_CLASSES,
    ROUTES,
    BatchInvariant,
    StreamRng,
    batch_invariant,
    envelope,
    in_force,
    route_for,
    settings,
)
from cadence_fx.models.token2wav_precision import FLOAT16, FLOAT32, build_models, precision, stock_stream
from cadence_fx.models.token2wav_stream import TINY_DEPTH, build_flow, random_prompt

CAPACITY = 4


def _ops():
    """One op of each padded class, at the shapes the flow and HiFT call it with, batch first."""
    g = torch.Generator().manual_seed(0)
    w1, b1, w2, b2 = (
        torch.randn(512, 256, generator=g),
        torch.randn(512, generator=g),
        torch.randn(512, 512, generator=g),
        torch.randn(512, generator=g),
    )
    down, up, window = torch.randn(32, 18, 10, generator=g), torch.randn(64, 32, 16, generator=g), torch.hann_window(16)
    return {
        "linear (vectors)": (lambda x: F.linear(x, w1, b1), (256,)),
        "linear (sequences)": (lambda x: F.linear(x, w2, b2), (50, 512)),
        "matmul": (lambda x: torch.matmul(x[:, :, :, :64], x[:, :, :, 64:].transpose(-2, -1)), (8, 50, 128)),
        "attention": (
            lambda x: F.scaled_dot_product_attention(x[:, :, :50, :64], x[:, :, :, :64], x[:, :, :, 64:]),
            (8, 120, 128),
        ),
        "conv1d (strided)": (lambda x: F.conv1d(x, down, stride=5, padding=2), (18, 2321)),
        "conv_transpose1d": (lambda x: F.conv_transpose1d(x, up, stride=8, padding=4), (64, 58)),
        "layer_norm": (lambda x: F.layer_norm(x, (512,)), (50, 512)),
        "istft": (lambda x: torch.istft(torch.complex(x[:, :9], x[:, 9:]), 16, 4, 16, window=window), (18, 1000)),
    }


@pytest.mark.parametrize("name", list(_ops()))
def test_a_row_of_a_batched_call_is_the_row_alone(name):
    op, shape = _ops()[name]
    rows = torch.randn(3, *shape, generator=torch.Generator().manual_seed(1))
    rngs = [StreamRng(s) for s in range(3)]
    with batch_invariant(CAPACITY, rngs) as mode:
        together = op(rows)
    assert mode.per_row_calls >= 1 and mode.padded_calls == 0  # the CPU's route
    for i in range(3):
        with batch_invariant(CAPACITY, [rngs[i]]):
            alone = op(rows[i : i + 1])
        assert torch.equal(together[i : i + 1], alone), f"{name}: row {i}"


def test_each_stream_draws_from_its_own_counter():
    rngs = [StreamRng(7), StreamRng(8), StreamRng(9)]
    with batch_invariant(CAPACITY, rngs):
        together = [torch.rand(3, 9), torch.randn_like(torch.empty(3, 100, 1))]
    assert [r.state() for r in rngs] == [(7, 2), (8, 2), (9, 2)]
    for i, seed in enumerate((7, 8, 9)):
        own = StreamRng(seed)
        with batch_invariant(CAPACITY, [own]):
            alone = [torch.rand(1, 9), torch.randn_like(torch.empty(1, 100, 1))]
        assert all(torch.equal(t[i : i + 1], a) for t, a in zip(together, alone))
    # Draw k is a function of (seed, k) alone: a restored state draws it again.
    resumed = StreamRng(8, offset=1)
    with batch_invariant(CAPACITY, [resumed]):
        again = torch.randn(1, 100, 1)
    assert torch.equal(again, together[1][1:2])
    assert not torch.equal(together[0][0], together[0][1])
    # The process generator is neither read nor advanced.
    before = torch.get_rng_state()
    with batch_invariant(CAPACITY, [StreamRng(0)]):
        torch.rand(1, 3)
    assert torch.equal(torch.get_rng_state(), before)


def test_the_envelope_refuses_by_name():
    with pytest.raises(RuntimeError, match="randint would draw from the process generator"):
        with batch_invariant(CAPACITY, [StreamRng(0)]):
            torch.randint(0, 5, (1, 3))
    with pytest.raises(RuntimeError, match=r"a draw of shape \(3, 9\) under 2 stream\(s\)"):
        with batch_invariant(CAPACITY, [StreamRng(0), StreamRng(1)]):
            torch.rand(3, 9)
    with pytest.raises(RuntimeError, match="linear got 3 rows for 2 streams"):
        with batch_invariant(CAPACITY, [StreamRng(0), StreamRng(1)]):
            F.linear(torch.ones(3, 4), torch.ones(2, 4))
    with pytest.raises(ValueError, match="a call holds 1 to capacity=1 streams, got 2"):
        BatchInvariant(1, [StreamRng(0), StreamRng(1)], "per_row")
    with pytest.raises(ValueError, match="route must be 'per_row' or 'padded', got 'tiles'"):
        BatchInvariant(2, [StreamRng(0)], "tiles")
    with pytest.raises(ValueError, match=r"StreamRng.seed must be a non-negative int, got -1"):
        StreamRng(-1)
    with pytest.raises(ValueError, match=r"declared for \['cpu', 'cuda'\], not 'meta'"):
        route_for("meta")
    # A draw from a generator of its own passes through.
    with batch_invariant(CAPACITY, [StreamRng(0)]):
        torch.randint(0, 5, (1, 3), generator=torch.Generator().manual_seed(0))


def test_the_declaration():
    assert [c.name for c in OP_CLASSES] == [
        "linear",
        "matmul",
        "attention",
        "conv1d",
        "conv_transpose1d",
        "norms",
        "spectral",
        "scan and resample",
        "elementwise",
        "random draws",
    ]
    assert ROUTES == {"cpu": "per_row", "cuda": "padded"}
    record = settings(8)
    assert record["capacity"] == 8 and set(record["op_classes"]) == {c.name for c in OP_CLASSES}
    assert envelope(None).startswith("batch-invariant envelope: off")
    assert envelope(8).startswith("batch-invariant envelope: capacity 8")
    assert in_force() is None
    with batch_invariant(2, [StreamRng(0)]) as mode:
        assert in_force() is mode
    assert in_force() is None


def test_float16_is_declared_and_refused_on_the_cpu_by_name():
    assert precision("float16") is FLOAT16 and precision("float32") is FLOAT32
    assert FLOAT16.float16 and FLOAT16.devices == ("cuda",) and FLOAT16.flow_dtype == torch.float16
    with pytest.raises(ValueError, match="token2wav precision must be one of"):
        precision("bfloat16")
    refusal = r"token2wav precision 'float16' is the vendor's cuda configuration .*flow.half\(\).*not exist on 'cpu'"
    with pytest.raises(ValueError, match=refusal):
        build_models(FLOAT16, TINY_DEPTH, device="cpu")
    flow = build_flow(TINY_DEPTH)
    with pytest.raises(ValueError, match=refusal):
        stock_stream(FLOAT16, flow, None, random_prompt(0, n_tokens=10))
    with pytest.raises(ValueError, match=refusal):
        BatchedStreams(flow, None, capacity=2, precision=FLOAT16)
    half = build_flow(TINY_DEPTH, dtype=torch.float16)
    with pytest.raises(ValueError, match="precision 'float32' runs the flow in torch.float32, the flow given is torch.float16"):
        BatchedStreams(half, None, capacity=2)


def test_the_padded_route_tiles_every_batch_operand_to_the_capacity():
    """The CUDA route's mechanics, on the CPU: operands tiled cyclically to capacity x rows a
    stream (a shared one-row operand too), the call made at that shape, the live rows returned."""
    g = torch.Generator().manual_seed(3)
    x, weight = torch.randn(2, 50, 64, generator=g), torch.randn(32, 64, generator=g)
    q, shared = torch.randn(2, 4, 10, 8, generator=g), torch.randn(1, 4, 8, 12, generator=g)
    mode = BatchInvariant(3, [StreamRng(0), StreamRng(1)], "padded")
    with mode:
        out = F.linear(x, weight)
        scores = torch.matmul(q, shared)
    assert mode.padded_calls == 2 and mode.per_row_calls == 0
    assert torch.equal(out, F.linear(torch.cat([x, x])[:3].contiguous(), weight)[:2])
    assert torch.equal(scores, torch.matmul(torch.cat([q, q])[:3].contiguous(), torch.cat([shared] * 3))[:2])
    with BatchInvariant(3, [StreamRng(0)], "padded") as alone:  # one stream: its row tiled 3 times
        one = F.linear(x[1:2], weight)
    assert alone.padded_calls == 1 and torch.equal(one, F.linear(torch.cat([x[1:2]] * 3), weight)[:1])
    with BatchInvariant(3, [StreamRng(0)], "padded") as vectors:  # a vector a row: per row on every route
        F.linear(torch.ones(2, 64), weight)
    assert vectors.per_row_calls == 1 and vectors.padded_calls == 0
