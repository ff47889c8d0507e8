"""Host constants: detected where the stock code copies a CPU table to the device, hoisted, reported.

On the CPU the "device" is `meta`: the copies are real `.to(device)` calls, so detection, caching
and reporting run exactly as they do on CUDA (the values are checked bit for bit on the GPU).
"""

from __future__ import annotations

import math

import pytest
import torch

from cadence_fx.passes.hoist import HostConstantHoist
from cadence_fx.replay import CaptureContext, ExactShapeReplay, MissReason, Signature
from cadence_fx.replay.capture import _HookMode

META = torch.device("meta")


class TimestepEmbedder(torch.nn.Module):
    """The DiT's pattern: a CPU frequency table moved with `.to(t)` on every call."""

    @staticmethod
    def timestep_embedding(t: torch.Tensor, dim: int, max_period: int = 10000) -> torch.Tensor:
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(start=0, end=half) / half).to(t)
        args = t[:, None] * freqs[None]
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.timestep_embedding(t * 1000, 256)


class Vocoder(torch.nn.Module):
    """HiFT's patterns: a plain CPU window attribute and SineGen's harmonic table."""

    def __init__(self, harmonic_num: int = 8) -> None:
        super().__init__()
        self.harmonic_num = harmonic_num
        self.stft_window = torch.hann_window(16)

    def forward(self, f0: torch.Tensor) -> torch.Tensor:
        fn = torch.multiply(f0, torch.FloatTensor([[range(1, self.harmonic_num + 2)]]).to(f0.device))
        return fn.sum(-1, keepdim=True) * self.stft_window.to(f0.device)


def _certify(module, *args, hooks=None):
    engine = ExactShapeReplay(module, [Signature.of(*args)], hooks=hooks if hooks is not None else [HostConstantHoist()])
    with torch.no_grad():
        engine(*args)
    return engine, engine.certificates["class0"]


def test_timestep_frequency_table_is_detected_and_reported_with_its_site():
    _, cert = _certify(TimestepEmbedder(), torch.rand(2, device=META))
    (const,) = cert.host_constants
    assert const.site.startswith("TimestepEmbedder.timestep_embedding (test_hoist.py:")
    assert (const.shape, const.dtype, const.device, const.nbytes, const.shared) == ((128,), torch.float32, "meta", 512, True)


def test_window_attribute_and_harmonic_table_are_both_hoisted():
    _, cert = _certify(Vocoder(), torch.rand(1, 100, 1, device=META))
    assert [(c.shape, c.site.split(" ")[0]) for c in cert.host_constants] == [
        ((1, 1, 9), "Vocoder.forward"),
        ((16,), "Vocoder.forward"),
    ]


def test_a_constant_is_computed_once_and_shared_by_every_class():
    hoist = HostConstantHoist()
    engine = ExactShapeReplay(TimestepEmbedder(), lambda sig: True, hooks=[hoist])
    with torch.no_grad():
        engine(torch.rand(2, device=META))
        engine(torch.rand(3, device=META))
    assert len(engine.certificates) == 2
    assert len(hoist.constants) == 1


def test_a_constant_the_callable_writes_is_handed_out_as_a_fresh_copy():
    class Writes(torch.nn.Module):
        def forward(self, x):
            table = torch.arange(4.0).to(x.device)
            table.mul_(2)
            return x + table

    hoist = HostConstantHoist()
    ctx = CaptureContext("probe", META)
    with _HookMode(ctx, [hoist]):
        Writes()(torch.rand(4, device=META))
    hoist.before_capture()
    (const,) = hoist.constants
    assert not const.shared


def test_torch_tensor_built_on_the_host_for_the_device_is_hoisted():
    def f(x):
        return x * torch.tensor([1.0, 2.0, 3.0], device=x.device)

    _, cert = _certify(f, torch.rand(3, device=META))
    (const,) = cert.host_constants
    assert const.shape == (3,) and const.site.startswith(
        "test_torch_tensor_built_on_the_host_for_the_device_is_hoisted.<locals>.f"
    )


def test_cpu_argument_copied_to_the_device_is_a_cut_not_a_constant():
    def f(x, lengths):
        return x * lengths.to(x.device)

    _, cert = _certify(f, torch.rand(3, device=META), torch.arange(3.0))
    assert cert.host_constants == ()
    assert [c.name.split(" ")[0:2] for c in cert.cuts] == [["host", "copy"]]


def test_value_computed_from_a_cpu_argument_refuses_the_class():
    def f(x, lengths):
        return x * (lengths * 2).to(x.device)

    engine, cert = _certify(f, torch.rand(3, device=META), torch.arange(3.0))
    assert not cert.admitted
    assert engine.counters.fallbacks == {MissReason.HOST_DATA.value: 1}


def test_without_the_hook_nothing_is_hoisted():
    _, cert = _certify(TimestepEmbedder(), torch.rand(2, device=META), hooks=[])
    assert cert.host_constants == ()


def test_cpu_only_calls_have_no_host_constants():
    _, cert = _certify(TimestepEmbedder(), torch.rand(2))
    assert cert.host_constants == ()


def _exported(module, *args, decompose=False):
    program = torch.export.export(module, args, strict=False)
    return (program.run_decompositions() if decompose else program).module()


@pytest.mark.parametrize("decompose", [False, True], ids=["aten.to", "aten._to_copy"])
def test_an_exported_graphs_host_to_device_copies_are_hoisted(decompose):
    t = torch.rand(2, device=META)
    graph = _exported(TimestepEmbedder(), t, decompose=decompose)
    op = torch.ops.aten._to_copy.default if decompose else torch.ops.aten.to.device
    assert op in [n.target for n in graph.graph.nodes]
    _, cert = _certify(graph, t)
    (const,) = cert.host_constants
    assert (const.shape, const.dtype, const.device, const.nbytes, const.shared) == ((128,), torch.float32, "meta", 512, True)


@pytest.mark.parametrize("decompose", [False, True], ids=["aten.to", "aten._to_copy"])
def test_an_exported_vocoders_window_and_harmonic_table_are_both_hoisted(decompose):
    f0 = torch.rand(1, 100, 1, device=META)
    _, cert = _certify(_exported(Vocoder(), f0, decompose=decompose), f0)
    assert sorted(c.shape for c in cert.host_constants) == [(1, 1, 9), (16,)]


@pytest.mark.parametrize(
    "copy",
    [
        lambda table, x: torch.ops.aten.to.device(table, x.device, table.dtype),
        lambda table, x: torch.ops.aten.to.dtype_layout(table, dtype=torch.float64, layout=torch.strided, device=x.device),
        lambda table, x: torch.ops.aten.to.other(table, x),
        lambda table, x: torch.ops.aten._to_copy.default(table, device=x.device),
        lambda table, x: torch.ops.aten.copy_.default(torch.empty(4, device=x.device), table),
    ],
    ids=["to.device", "to.dtype_layout", "to.other", "_to_copy", "copy_"],
)
def test_every_aten_copy_of_a_host_table_to_the_device_is_a_constant(copy):
    def f(x):
        return x * copy(torch.arange(4.0), x)

    _, cert = _certify(f, torch.rand(4, device=META))
    (const,) = cert.host_constants
    assert const.shape == (4,) and const.device == "meta"


def test_an_aten_copy_within_the_host_leaves_nothing_to_hoist():
    def f(x):
        return x * torch.ops.aten._to_copy.default(torch.arange(4.0), dtype=torch.float64)

    _, cert = _certify(f, torch.rand(4, dtype=torch.float64))
    assert cert.host_constants == ()


def test_an_exported_graphs_copy_of_a_cpu_argument_is_a_cut_and_of_a_value_computed_from_one_a_refusal():
    class Lengths(torch.nn.Module):
        def forward(self, x, lengths):
            return x * lengths.to(x.device), x * (lengths * 2).to(x.device)

    x, lengths = torch.rand(3, device=META), torch.arange(3.0)
    graph = _exported(Lengths(), x, lengths)
    engine, cert = _certify(graph, x, lengths)
    assert cert.host_constants == () and not cert.admitted
    assert engine.counters.fallbacks == {MissReason.HOST_DATA.value: 1}
