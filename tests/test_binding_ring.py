"""The binding pipeline on state written in place: a user's own streaming model whose cache is a
preallocated ring (RingCache in the contract), written at a device-side position that the step
itself advances. Nothing is rewritten; the ring is the carry, exported once, verified, and
(on CUDA) replayed with the ring aliased at one address."""

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
    RingCache,
    transform,
)

LAYERS, DIM, CAPACITY, STEP = 2, 8, 6, 2


class RingState:
    """The user's state object: per layer one ring of CAPACITY frames, and the next write position."""

    def __init__(self, device: str = "cpu"):
        self.rings = [torch.zeros(1, CAPACITY, DIM, device=device) for _ in range(LAYERS)]
        self.position = torch.zeros((), dtype=torch.long, device=device)


class RingMixer(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor, state: RingState) -> torch.Tensor:
        slots = (state.position + torch.arange(x.shape[1], device=x.device)) % CAPACITY
        for ring, proj in zip(state.rings, self.proj):
            ring.index_copy_(1, slots, x)
            weights = torch.softmax(x @ ring.transpose(1, 2), dim=-1)
            x = x + proj(weights @ ring)
        state.position.add_(x.shape[1]).remainder_(CAPACITY)
        return x


def contract() -> Contract:
    return Contract(
        family="ring_mixer",
        clocks=(Clock("frame", ClockKind.FRAMES), Clock("call", ClockKind.CALLS)),
        rates=(Rate("frame", "call", STEP, name="frames_per_call"),),
        quantities={"layers": LAYERS, "dim": DIM},
        regions=(
            Region(
                "rings",
                dims=("layers", 1, "frame", "dim"),
                axis=2,
                clock="frame",
                stride=STEP,
                dtype="float32",
                lifetime=Lifetime.PER_STREAM,
                retention=RingCache(CAPACITY),
            ),
        ),
        operators=(Operator("mix", "rings", steady=STEP),),
        admission=Admission("frame", max_per_call=STEP),
        interactivity=Interactivity(stages=("mixer",)),
    )


# The write position is a device-side counter the step advances in place: bound, it is state too.
BINDING = Binding(
    regions=(RegionBinding("rings", at=("state.rings.*",)),),
    operators=(OperatorBinding("mix", units=("x", 1), counters=("state.position",)),),
)


def stream(model, frames: torch.Tensor, state: RingState):
    outputs, addresses = [], set()
    with torch.no_grad():
        for t in range(0, frames.shape[1], STEP):
            outputs.append(model(frames[:, t : t + STEP], state))
            addresses.add(tuple(ring.data_ptr() for ring in state.rings))
    return outputs, addresses


# The same, saying the rings are written before they are read: verified and certified without a copy.
WRITE_BEFORE_READ = Binding(
    regions=(RegionBinding("rings", at=("state.rings.*",), write_before_read=True),), operators=BINDING.operators
)


def run(device: str, binding: Binding = BINDING):
    model = RingMixer().eval().to(device)
    frames = torch.randn(1, 9 * STEP, DIM, generator=torch.Generator().manual_seed(1)).to(device)
    expected, _ = stream(model, frames, RingState(device))
    bound, report = transform(model, contract(), binding)
    state = RingState(device)
    streams = []
    for _ in range(3):  # three streams, each from a fresh position over the same rings
        state.position.zero_()
        for ring in state.rings:
            ring.zero_()
        streams.append(stream(bound, frames, state))
    return expected, streams, report, bound, state


def test_a_ring_written_in_place_is_the_carry_and_streams_bit_identically():
    expected, streams, report, bound, state = run("cpu")
    for actual, addresses in streams:
        assert all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))
        assert addresses == {tuple(carry.address for carry in bound.carries.values())}
    op = report.operators["mix"]
    assert [cls.name for cls in op.classes.values()] == [f"mix[n={STEP},L={CAPACITY}]"]
    # The user's rings and position were adopted once (into the carries and the counter's own
    # tensor); every call ran the exported graph.
    assert op.counters.as_dict() == {
        "calls": 27,
        "graph_calls": 27,
        "verified": 2,
        "stock": 0,
        "adopted": LAYERS + 1,
        "stock_by_reason": {},
    }
    assert state.position.data_ptr() == op.held["state.position"].data_ptr()
    assert [(s.kind, s.rewritten) for s in report.sites] == [("ring", False)] * LAYERS
    assert all(s.reason.startswith(f"state.rings.{i}: written in place by the step") for i, s in enumerate(report.sites))
    assert report.carries["rings"].buffer.shape == (LAYERS, 1, CAPACITY, DIM)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("binding", [BINDING, WRITE_BEFORE_READ], ids=["copied", "write_before_read"])
def test_a_ring_written_in_place_replays_on_one_address(binding):
    expected, streams, report, bound, _ = run("cuda", binding)
    for actual, addresses in streams:
        assert all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))
        assert len(addresses) == 1
    engine = report.replays["mix"]
    # Two verified calls, then every call replays (the first one captures).
    assert engine.counters.as_dict() == {
        "calls": 25,
        "captures": 1,
        "replays": 25,
        "eager": 0,
        "invalidations": 0,
        "fallbacks": {},
    }


def test_state_the_binding_does_not_declare_is_refused_by_name_and_the_stream_stays_exact():
    model = RingMixer().eval()
    frames = torch.randn(1, 9 * STEP, DIM, generator=torch.Generator().manual_seed(1))
    expected, _ = stream(model, frames, RingState())
    undeclared = Binding(
        regions=(RegionBinding("rings", at=("state.rings.*",)),), operators=(OperatorBinding("mix", units=("x", 1)),)
    )
    bound, report = transform(model, contract(), undeclared)
    actual, _ = stream(bound, frames, RingState())
    assert all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))
    (cls,) = report.operators["mix"].classes.values()
    assert cls.refused == (
        "the step reads state.position: state the binding does not declare, which a graph would "
        "freeze as a constant; bind it (a region's `at`, or the operator's `counters` for a position "
        "or length the step moves)"
    )
    assert report.operators["mix"].counters.stock_by_reason == {"refused": 9}


def _ring_copies(monkeypatch) -> list[str]:
    """Every copy of a ring-sized real tensor made from here on (a clone or a deep copy), by kind."""
    copies: list[str] = []
    clone, deepcopy = torch.Tensor.clone, torch.Tensor.__deepcopy__

    def counted(kind, method):
        def wrapper(self, *args, **kwargs):
            if type(self) is torch.Tensor and tuple(self.shape[-2:]) == (CAPACITY, DIM):
                copies.append(kind)
            return method(self, *args, **kwargs)

        return wrapper

    monkeypatch.setattr(torch.Tensor, "clone", counted("clone", clone))
    monkeypatch.setattr(torch.Tensor, "__deepcopy__", counted("deepcopy", deepcopy))
    return copies


@pytest.mark.parametrize("write_before_read", [False, True])
def test_a_ring_written_before_read_is_verified_without_a_copy(monkeypatch, write_before_read):
    model = RingMixer().eval()
    frames = torch.randn(1, 9 * STEP, DIM, generator=torch.Generator().manual_seed(1))
    expected, _ = stream(model, frames, RingState())
    binding = WRITE_BEFORE_READ if write_before_read else BINDING
    copies = _ring_copies(monkeypatch)
    bound, report = transform(model, contract(), binding)
    state = RingState()
    addresses = [ring.data_ptr() for ring in state.rings]
    actual, seen = stream(bound, frames, state)
    assert all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))
    # Declared, the rings stay the model's own tensors (no buffer allocated, nothing copied in);
    # not declared, they move into the region's buffer at the first call.
    assert ("rings" in report.carries) != write_before_read
    assert (seen == {tuple(addresses)}) == write_before_read
    assert seen == {tuple(carry.address for carry in bound.carries.values())}
    op = report.operators["mix"]
    assert op.counters.as_dict() == {
        "calls": 9,
        "graph_calls": 9,
        "verified": 2,
        "stock": 0,
        "adopted": LAYERS + 1,
        "stock_by_reason": {},
    }
    # Without the declaration each of the 2 verified calls runs the exported step and the stock
    # code traced (their programs compared), then the stock code untraced, each on a copy of every
    # ring, and the replay engine's certification probe snapshots every ring twice (as the state
    # argument and as the carry module's buffer).
    assert copies == ([] if write_before_read else ["clone"] * (2 * 3 * LAYERS + 2 * LAYERS))
    stamp = next(s for s in report.stamps if s.startswith("state rule: rings"))
    assert stamp.endswith("never copied, verified through the outputs it feeds") == write_before_read
    assert ("kept where the model holds it (2 tensors), none allocated" in stamp) == write_before_read


def test_write_before_read_is_refused_where_the_region_is_not_a_ring_written_in_place():
    from cadence_fx import BindingError

    returned = Binding(
        regions=(RegionBinding("rings", at=("state",), out=("return.1",), write_before_read=True),), operators=BINDING.operators
    )
    with pytest.raises(BindingError) as refused:
        transform(RingMixer().eval(), contract(), returned)
    assert str(refused.value) == (
        "binding.regions[0].write_before_read: region 'rings': only a region written in place at a "
        "fixed extent (retained by InPlace or RingCache, no `out`) is written before it is read; it retains by "
        "RingCache and is returned (('return.1',))"
    )
