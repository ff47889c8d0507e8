"""ExactShapeReplay admission on the CPU: every refused call runs eager, is counted and explained.

CPU tensors are never captured: an admitted call is certified, then runs eagerly as `no_cuda`.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch

from cadence_fx import determinism
from cadence_fx.replay import (
    ExactShapeReplay,
    MissReason,
    Phase,
    ShapeClass,
    Signature,
    TensorSpec,
)


class Affine(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.lin(x) * scale


def _engine(**kwargs) -> tuple[ExactShapeReplay, Affine, torch.Tensor]:
    torch.manual_seed(0)
    m = Affine().eval()
    x = torch.randn(4, 8)
    with torch.no_grad():
        engine = ExactShapeReplay(m, [ShapeClass("B=4", Signature.of(x, 2.0))], **kwargs)
    return engine, m, x


@torch.no_grad()
def test_admitted_call_without_cuda_runs_eager_certified_and_counted_no_cuda():
    engine, m, x = _engine()
    out = engine(x, 2.0)
    assert torch.equal(out, m(x, 2.0))
    assert engine.counters.as_dict() == {
        "calls": 1,
        "captures": 0,
        "replays": 0,
        "eager": 1,
        "invalidations": 0,
        "fallbacks": {"no_cuda": 1},
    }
    cert = engine.certificates["B=4"]
    assert cert.admitted and not cert.captured
    assert cert.copied == ("args[0]",)
    assert engine.phase("B=4") is Phase.EAGER


def test_tensor_spec_keys_like_the_tensor_it_describes():
    x = torch.randn(2, 80, 50)
    assert Signature.of(TensorSpec((2, 80, 50)), 3) == Signature.of(x, 3)
    assert Signature.of(TensorSpec((2, 80, 50), torch.float16), 3) != Signature.of(x, 3)


def test_a_spec_on_the_current_cuda_device_keys_like_one_that_names_its_index():
    # A tensor on the current CUDA device always reports its index (cuda:0), never bare "cuda".
    index = torch.cuda.current_device() if torch.cuda.is_available() else 0
    assert Signature.of(TensorSpec((2, 3), device="cuda")) == Signature.of(TensorSpec((2, 3), device=f"cuda:{index}"))
    assert Signature.of(TensorSpec((2, 3), device="cuda")).leaves[0][4] == torch.device("cuda", index)


def test_a_spec_of_a_zero_size_view_keys_like_the_view_so_a_streams_first_call_is_admitted():
    carry = torch.zeros(1, 2, 8, 3)
    empty = carry.narrow(2, 0, 0)  # nothing retained yet: a view of the carry's first 0 units
    spec = TensorSpec(tuple(empty.shape), stride=tuple(empty.stride()))
    assert Signature.of(spec) == Signature.of(empty)
    engine = ExactShapeReplay(lambda kept: kept.sum(2), [Signature.of(spec)])
    engine(empty)
    assert engine.counters.fallbacks == {"no_cuda": 1}


def scaled(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    return x * scale + 1


@pytest.mark.parametrize(
    ("make_args", "reason", "detail"),
    [
        (lambda x: (torch.randn(5, 8), 2.0), MissReason.SHAPE, "args[0].shape: expected (4, 8), got (5, 8)"),
        (
            lambda x: (torch.randn(8, 4).t(), 2.0),
            MissReason.MEMORY_FORMAT,
            "args[0].memory_format: expected contiguous, got strided",
        ),
        (lambda x: (x.double(), 2.0), MissReason.DTYPE, "args[0].dtype: expected torch.float32, got torch.float64"),
        (lambda x: (torch.randn(4, 8, device="meta"), 2.0), MissReason.DEVICE, "args[0].device: expected cpu, got meta"),
        (lambda x: (x, 3.0), MissReason.SCALAR, "args[1]: expected 2.0, got 3.0"),
        (lambda x: (x, 2), MissReason.SCALAR, "args[1]: expected 2.0, got 2"),
        (
            lambda x: (x.clone().requires_grad_(), 2.0),
            MissReason.REQUIRES_GRAD,
            "args[0].requires_grad: expected False, got True",
        ),
        (lambda x: (x,), MissReason.STRUCTURE, "structure: expected (0, 1), got (0)"),
    ],
    ids=["shape", "memory_format", "dtype", "device", "scalar", "scalar_type", "requires_grad", "structure"],
)
@torch.no_grad()
def test_signature_miss_runs_eager_and_is_counted_with_expected_against_actual(make_args, reason, detail):
    x = torch.randn(4, 8)
    engine = ExactShapeReplay(scaled, [Signature.of(x, 2.0)])
    args = make_args(x)
    out = engine(*args)
    if args[0].device.type != "meta":
        assert torch.equal(out, scaled(*args))
    assert engine.counters.fallbacks == {reason.value: 1}
    assert engine.last_miss.reason is reason
    assert detail in engine.last_miss.detail
    assert engine.certificates == {}


@torch.no_grad()
def test_stride_miss_is_named_when_layout_differs_but_format_does_not():
    m = Affine()
    base = torch.randn(4, 16)
    engine = ExactShapeReplay(m, [Signature.of(torch.randn(4, 8), 1.0)])
    strided = base[:, ::2]
    engine(strided, 1.0)
    assert engine.counters.fallbacks == {"memory_format": 1}
    engine2 = ExactShapeReplay(m, [Signature.of(TensorSpec((4, 8), stride=(16, 2)), 1.0)])
    engine2(torch.randn(4, 32)[:, ::4], 1.0)
    assert engine2.counters.fallbacks == {"stride": 1}
    assert "args[0].stride: expected (16, 2), got (32, 4)" in engine2.last_miss.detail


@torch.no_grad()
def test_unkeyable_argument_runs_eager():
    engine, m, x = _engine()

    class Opaque:
        def __rmul__(self, other):
            return other * 2.0

    out = engine(x, Opaque())
    assert torch.equal(out, m(x, 2.0))
    assert engine.counters.fallbacks == {"unkeyable": 1}
    assert engine.last_miss.detail == ("cannot key on Opaque",)


@torch.no_grad()
def test_predicate_catalog_refusal_is_not_in_catalog():
    m = Affine()
    engine = ExactShapeReplay(m, lambda sig: "B=4" if sig.leaves[0][1] == (4, 8) else None)
    engine(torch.randn(4, 8))
    engine(torch.randn(3, 8))
    assert engine.counters.fallbacks == {"no_cuda": 1, "not_in_catalog": 1}
    assert list(engine.certificates) == ["B=4"]


def carry_step(x: torch.Tensor, carry: torch.Tensor) -> torch.Tensor:
    carry.add_(x)
    return carry.sum(0)


def test_pointer_drift_on_aliased_region_invalidates_runs_eager_and_recovers():
    carry, x = torch.zeros(4, 8), torch.ones(4, 8)
    engine = ExactShapeReplay(carry_step, [Signature.of(x, carry)], aliased=[1])
    engine(x, carry)
    engine(x, carry)
    moved = carry.clone()
    out = engine(x, moved)
    assert torch.equal(out, torch.full((8,), 12.0))
    assert engine.counters.invalidations == 1
    assert engine.counters.fallbacks == {"no_cuda": 2, "pointer_drift": 1}
    assert "args[1]: data_ptr expected" in engine.last_miss.detail[0]
    engine(x, moved)
    assert engine.counters.fallbacks == {"no_cuda": 3, "pointer_drift": 1}
    assert engine.certificates["class0"].aliased == ("args[1]",)


def test_probe_is_invisible_writes_happen_once_and_are_certified():
    carry, x = torch.zeros(4, 8), torch.ones(4, 8)
    engine = ExactShapeReplay(carry_step, [Signature.of(x, carry=carry)], aliased=["carry"])
    engine(x, carry=carry)
    assert torch.equal(carry, torch.ones(4, 8))
    assert engine.certificates["class0"].writes == ("carry",)


class Position:
    """A stream position kept on the host, advanced by every call (`HostCounters`)."""

    def __init__(self) -> None:
        self.frames = 0

    def read(self) -> list[int]:
        return [self.frames]

    def write(self, values) -> None:
        (self.frames,) = values

    def step(self, x: torch.Tensor) -> torch.Tensor:
        self.frames += 1
        return x * 2


@pytest.mark.parametrize("declared", [True, False], ids=["declared", "undeclared"])
def test_the_probe_rewinds_declared_host_counters(declared):
    position, x = Position(), torch.ones(4)
    engine = ExactShapeReplay(position.step, [Signature.of(x)], host_counters=position if declared else None)
    for _ in range(3):
        engine(x)
    # Undeclared, the probe's Python ran once more than the stream's calls.
    assert position.frames == (3 if declared else 4)
    assert engine.host_counters is (position if declared else None)


class NoisyHost(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.rand(x.shape)


class PythonRandom(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * random.random()


@pytest.mark.parametrize(("module", "reader"), [(NoisyHost(), "torch.get_rng_state"), (PythonRandom(), "random")])
def test_host_rng_reader_is_rejected_for_good_and_the_probe_leaves_no_trace(module, reader):
    x = torch.randn(4, 8)
    engine = ExactShapeReplay(module, [Signature.of(x)])
    torch.manual_seed(7)
    random.seed(7)
    first = engine(x)
    torch.manual_seed(7)
    random.seed(7)
    assert torch.equal(first, module(x))
    engine(x)
    cert = engine.certificates["class0"]
    assert not cert.admitted and cert.host_rng == (reader,)
    assert engine.counters.fallbacks == {"host_rng": 2}


class Rebinds(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("state", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.state = self.state + x.sum(0)
        return self.state


class WritesOwnCache(torch.nn.Module):
    """Reads its cache argument, then writes the new cache into its own buffer (the CFM's way)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(4, 8))

    def forward(self, cache: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        out = cache.sum(0) + x
        self.cache[1:].copy_(cache + 1)
        return out


@torch.no_grad()
def test_a_copied_argument_that_views_module_state_is_refused():
    m = WritesOwnCache()
    x = torch.ones(8)
    view = m.cache[:3]
    engine = ExactShapeReplay(m, [Signature.of(view, x)])
    engine(view, x)
    assert engine.counters.fallbacks == {"layout": 1}
    assert "args[0] ~ buffer cache" in engine.certificates["class0"].reason
    assert torch.equal(m.cache, torch.tensor([[0.0] * 8, [1.0] * 8, [1.0] * 8, [1.0] * 8]))


@pytest.mark.parametrize(
    ("make", "described"),
    [
        (lambda: torch.randn(4, 16)[:, ::2], "args[0] (4, 8) strides (16, 2)"),
        (lambda: torch.randn(4, 1).expand(4, 8), "args[0] (4, 8) strides (1, 0)"),
    ],
    ids=["gaps", "repeated"],
)
@torch.no_grad()
def test_a_copied_argument_that_is_not_dense_is_refused_as_not_dense(make, described):
    x = make()
    engine = ExactShapeReplay(scaled, [Signature.of(x, 2.0)])
    assert torch.equal(engine(x, 2.0), scaled(x, 2.0))
    assert engine.counters.fallbacks == {"layout": 1}
    assert engine.certificates["class0"].reason == (
        f"layout: {described} is not dense (its strides leave gaps or repeat elements): the engine stages "
        "only dense tensors; declare it aliased or pass a dense tensor"
    )


@torch.no_grad()
def test_an_aliased_argument_need_not_be_dense():
    carry = torch.zeros(4, 16)
    engine = ExactShapeReplay(carry_step, [Signature.of(torch.ones(4, 8), carry[:, :8])], aliased=[1])
    engine(torch.ones(4, 8), carry[:, :8])
    assert engine.counters.fallbacks == {"no_cuda": 1}
    assert engine.certificates["class0"].admitted


def test_module_state_holds_each_tensor_once_however_many_class_graphs_share_it():
    m = Affine()
    graphs = [torch.export.export(m, (torch.randn(n, 8),), strict=False).module() for n in (2, 3, 4)]
    engine = ExactShapeReplay(graphs[0], lambda sig: True, modules=graphs)
    assert [id(t) for t in engine.module_state] == [id(p) for p in m.parameters()]


def test_rebinding_a_buffer_is_refused():
    x = torch.ones(4, 8)
    m = Rebinds()
    engine = ExactShapeReplay(m, [Signature.of(x)])
    assert torch.equal(engine(x), torch.full((8,), 4.0))
    assert engine.counters.fallbacks == {"state_rebind": 1}


def test_grad_mode_with_trainable_parameters_is_refused():
    engine, m, x = _engine()
    with torch.enable_grad():
        sig_x = x
        engine2 = ExactShapeReplay(m, [Signature.of(sig_x, 2.0)])
        engine2(x, 2.0)
    assert engine2.counters.fallbacks == {"autograd": 1}


def test_nested_engine_runs_plainly_inside_another_engines_probe():
    inner_fn = Affine()
    x = torch.randn(4, 8)
    with torch.no_grad():
        inner = ExactShapeReplay(inner_fn, [Signature.of(x)])
        outer = ExactShapeReplay(lambda v: inner(v) + 1, [Signature.of(x)])
        outer(x)
    assert inner.counters.fallbacks == {"nested": 1, "no_cuda": 1}


def test_debug_logs_every_refused_call_with_expected_against_actual(caplog):
    engine, m, x = _engine(debug=True)
    with caplog.at_level(logging.WARNING, logger="cadence_fx.replay"), torch.no_grad():
        engine(torch.randn(5, 8), 2.0)
    assert "args[0].shape: expected (4, 8), got (5, 8)" in caplog.text


@torch.no_grad()
def test_explain_prints_phases_counters_and_certificates():
    engine, m, x = _engine()
    engine(x, 2.0)
    engine(torch.randn(5, 8), 2.0)
    text = engine.explain()
    assert "[eager] B=4" in text
    assert "eager by reason: no_cuda=1, shape=1" in text
    assert "class B=4: admitted" in text
    assert "last miss: shape" in text


def test_output_rule_is_validated():
    with pytest.raises(ValueError, match="output_rule"):
        ExactShapeReplay(Affine(), [], output_rule="borrowed")


def test_check_repeatable_accepts_deterministic_and_flags_drifting_calls():
    m = NoisyHost()
    x = torch.randn(4, 8)
    assert determinism.check_repeatable(m, x).equal
    calls = []

    def drifting(v):
        calls.append(1)
        return v + len(calls)

    result = determinism.check_repeatable(drifting, x)
    assert not result.equal
    assert result.mismatches == ("run 1 output 0: 32 of 32 elements differ, max |diff| 1",)


def test_deterministic_scope_pins_cudnn_reports_and_restores():
    before = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    torch.backends.cudnn.benchmark = True
    with determinism.deterministic() as report:
        assert report["cudnn.deterministic"] is True and report["cudnn.benchmark"] is False
        assert torch.backends.cudnn.deterministic
    assert torch.backends.cudnn.benchmark is True
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before


def test_the_module_state_a_replay_checks_is_each_parameter_and_buffer_place_once():
    """Where the modules hold their tensors, read again at every replay (a rebound buffer is
    drift): each place once, a module reachable twice included, a buffer set to None left out."""
    shared = torch.nn.Linear(2, 2)
    root = torch.nn.Module()
    root.a, root.b = shared, shared
    root.register_buffer("scale", torch.ones(2))
    root.register_buffer("absent", None)
    engine = ExactShapeReplay(lambda x: root.a(x) * root.scale, [Signature.of(torch.zeros(2))], modules=[root])
    places = engine.state_check.find()
    assert [qualified for _, _, qualified in places] == ["scale", "a.weight", "a.bias"]
    assert [table[name] is tensor for (table, name, _), tensor in zip(places, (root.scale, shared.weight, shared.bias))] == [
        True
    ] * 3


def test_the_module_state_check_passes_the_same_tensors_and_decides_a_rebound_one_by_its_address():
    """The check every replay runs over the module state: the tensors seen last time at their
    addresses; a tensor rebound at a place is decided by its address (as the check always was),
    then remembered; a tensor at another address, or a place emptied, is drift."""
    layer = torch.nn.Linear(2, 2)
    layer.register_buffer("scale", torch.ones(2))
    engine = ExactShapeReplay(lambda x: layer(x) * layer.scale, [Signature.of(torch.zeros(2))], modules=[layer])
    engine.state_check.remember()
    assert engine.state_check.unmoved()
    weight = layer.weight
    layer.weight = torch.nn.Parameter(weight.data)  # another object over the same storage
    assert engine.state_check.unmoved()
    assert any(t is layer.weight for t in engine.state_check.tensors) and not any(t is weight for t in engine.state_check.tensors)
    layer.weight = torch.nn.Parameter(weight.data.clone())  # another address
    assert not engine.state_check.unmoved()
    layer.weight = torch.nn.Parameter(weight.data)
    assert engine.state_check.unmoved()
    layer.scale = None
    assert not engine.state_check.unmoved()
