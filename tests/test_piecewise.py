"""Piecewise capture: operators that cannot be captured become named cuts in the certificate."""

from __future__ import annotations

import torch

from cadence_fx.passes.hoist import HostConstantHoist
from cadence_fx.passes.piecewise import ISTFT, ITEM, CutPoint, Piecewise, cut_method
from cadence_fx.replay import CutRecord, ExactShapeReplay, Signature


class ISTFTHead(torch.nn.Module):
    """HiFT's tail: magnitude/phase -> istft (a host sync) -> clamp."""

    def __init__(self) -> None:
        super().__init__()
        self.window = torch.hann_window(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        magnitude, phase = torch.exp(x[:, :9]), torch.sin(x[:, 9:])
        spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        y = torch.istft(spec, 16, 4, 16, window=self.window.to(x.device))
        return torch.clamp(y, -0.99, 0.99)


def _certificate(module, *args, hooks):
    engine = ExactShapeReplay(module, [Signature.of(*args)], hooks=hooks)
    with torch.no_grad():
        out = engine(*args)
    return engine, engine.certificates["class0"], out


def test_istft_becomes_a_named_cut_and_the_output_is_eager():
    x = torch.randn(1, 18, 20)
    _, cert, out = _certificate(ISTFTHead(), x, hooks=[Piecewise(), HostConstantHoist()])
    assert cert.cuts == (CutRecord("torch.istft", ISTFT.reason, 1),)
    assert torch.equal(out, ISTFTHead()(x))


def test_item_is_a_cut_when_declared():
    def normalise(x):
        return x / x.abs().max().item()

    _, cert, _ = _certificate(normalise, torch.randn(8), hooks=[Piecewise([ITEM])])
    assert cert.cuts == (CutRecord("Tensor.item", ITEM.reason, 1),)


def test_every_call_of_a_cut_point_is_counted():
    def twice(x):
        return torch.istft(x, 16, 4, 16, window=torch.ones(16)) + torch.istft(x, 16, 4, 16, window=torch.ones(16))

    spec = torch.randn(1, 9, 20, dtype=torch.complex64)
    _, cert, _ = _certificate(twice, spec, hooks=[Piecewise()])
    assert cert.cuts == (CutRecord("torch.istft", ISTFT.reason, 2),)


def test_a_python_method_can_be_declared_a_cut_and_the_patch_undone():
    class Vocoder(torch.nn.Module):
        def _istft(self, x):
            return x * 2

        def forward(self, x):
            return self._istft(x) + 1

    v = Vocoder()
    undo = cut_method(v, "_istft", "host sync inside the vendor's _istft")
    _, cert, out = _certificate(v, torch.ones(3), hooks=[])
    assert cert.cuts == (CutRecord("Vocoder._istft", "host sync inside the vendor's _istft", 1),)
    assert torch.equal(out, torch.full((3,), 3.0))
    undo()
    assert "_istft" not in vars(v)


def test_custom_cut_point_by_identity():
    cut = CutPoint(torch.nonzero, "data-dependent output shape", "torch.nonzero")
    _, cert, _ = _certificate(lambda x: torch.nonzero(x > 0).float().sum(), torch.randn(8), hooks=[Piecewise([cut])])
    assert cert.cuts == (CutRecord("torch.nonzero", "data-dependent output shape", 1),)


def test_no_cut_without_the_hook():
    _, cert, _ = _certificate(ISTFTHead(), torch.randn(1, 18, 20), hooks=[])
    assert cert.cuts == ()


def _exported(module, *args):
    return torch.export.export(module, args, strict=False).module()


def test_an_exported_graphs_istft_is_the_same_named_cut():
    x = torch.randn(1, 18, 20)
    graph = _exported(ISTFTHead(), x)
    assert torch.ops.aten.istft.default in [n.target for n in graph.graph.nodes]
    _, cert, out = _certificate(graph, x, hooks=[Piecewise(), HostConstantHoist()])
    assert cert.cuts == (CutRecord("torch.istft", ISTFT.reason, 1),)
    assert torch.equal(out, ISTFTHead()(x))


def test_an_exported_graphs_item_is_the_same_named_cut_when_declared():
    class Normalise(torch.nn.Module):
        def forward(self, x):
            return x / x.abs().max().item()

    x = torch.randn(8)
    _, cert, out = _certificate(_exported(Normalise(), x), x, hooks=[Piecewise([ITEM])])
    assert cert.cuts == (CutRecord("Tensor.item", ITEM.reason, 1),)
    assert torch.equal(out, Normalise()(x))
