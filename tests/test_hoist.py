"""Host constants: detected where the stock code copies a CPU table to the device, hoisted, reported.

On the CPU the "device" is `meta`: the copies are real `.to(device)` calls, so detection, caching
and reporting run exactly as they do on CUDA (the values are checked bit for bit on the GPU).
"""

from __future__ import annotations

import math

import torch

from cadence_fx.passes.hoist import HostConstantHoist
from cadence_fx.replay import CaptureContext, ExactShapeReplay, MissReason, Signature, _HookMode

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
        ((1, 1, 9), "Vocoder.forward"), ((16,), "Vocoder.forward")]


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
    assert const.shape == (3,) and const.site.startswith("test_torch_tensor_built_on_the_host_for_the_device_is_hoisted.<locals>.f")


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
