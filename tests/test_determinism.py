"""The determinism envelope is the caller's explicit step: a transform sets no kernel switch, and
its report says which ones it found in force."""

from __future__ import annotations

import pytest
import torch

from cadence_fx import determinism, transform
from cadence_fx.models.freeze_omni import freeze_omni_contract
from cadence_fx.models.freeze_omni_encoder import FreezeOmniEncoderConfig, build_encoder

SMALL = FreezeOmniEncoderConfig.small()
NOT_PINNED = (
    "determinism envelope: NOT pinned (cudnn.deterministic=False, cudnn.benchmark=True): eager may not "
    "repeat itself on a GPU, so neither can the transformed model; call "
    "cadence_fx.determinism.pin_deterministic() before running any stream"
)
PINNED = "determinism envelope: pinned (cudnn.deterministic=True, cudnn.benchmark=False)"


@pytest.fixture
def autotuned():
    """cuDNN as a user may have left it (autotuning on), restored afterwards."""
    before = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = False, True
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before


def _transform():
    contract = freeze_omni_contract(blocks=SMALL.num_blocks, d_model=SMALL.attention_dim, heads=SMALL.attention_heads)
    return transform(build_encoder(SMALL), contract, replay=False)


def test_a_transform_flips_no_kernel_switch_and_reports_the_ones_it_found(autotuned):
    _, report = _transform()
    assert (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark) == (False, True)
    assert (report.determinism["cudnn.deterministic"], report.determinism["cudnn.benchmark"]) == (False, True)
    assert report.stamps[0] == NOT_PINNED


def test_switches_the_caller_pinned_are_reported_as_pinned(autotuned):
    with determinism.deterministic():
        _, report = _transform()
    assert report.stamps[0] == PINNED
    assert (report.determinism["cudnn.deterministic"], report.determinism["cudnn.benchmark"]) == (True, False)


def test_the_envelope_line_follows_the_switches(autotuned):
    assert not determinism.pinned() and determinism.envelope() == NOT_PINNED
    with determinism.deterministic():
        assert determinism.pinned() and determinism.envelope() == PINNED


def test_a_saved_rng_state_restores_under_another_default_device():
    """A generator state is a CPU byte tensor whatever the default device: restoring one under
    `torch.set_default_device` (here the meta device, as cuda would be) used to build it on that
    device and fail ("RNG state must be a torch.ByteTensor")."""
    saved = determinism.RngState.capture()
    first = torch.rand(4)
    with torch.device("meta"):
        saved.restore()
    assert torch.equal(torch.rand(4), first)
