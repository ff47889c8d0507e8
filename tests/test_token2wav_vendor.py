"""MiniCPM-o 4.5 Token2Wav from minicpmo-utils 1.0.6 on the CPU, at reduced depth.

Needs the vendor package; without it the tests fail with VendorMissing, which names the package,
the version and the install command (CI installs it).
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field

import pytest
import torch

from cadence_fx.models.token2wav_stream import (
    REDUCED_DEPTH,
    ChunkOut,
    StockStream,
    build_flow,
    build_hift,
    random_chunks,
    random_prompt,
)
from cadence_fx.models.vendor import (
    PROMPT_ONLY_IMPORTS,
    PlaceholderUsed,
    PromptOnlyImport,
    VendorMissing,
    VendorPackage,
    placeholders,
    register_placeholder,
    require,
    token2wav_vendor,
)

pytestmark = pytest.mark.slow

P = 302
N_BLOCKS = REDUCED_DEPTH.encoder_blocks + REDUCED_DEPTH.up_blocks


@dataclass
class Snapshot:
    shapes: dict[str, tuple[int, ...]]
    estimator: torch.Tensor  # estimator_att_cache[0, 0]: Euler step 0, DiT block 0
    conformer: torch.Tensor  # conformer_att_cache, all blocks


def _snapshot(cache: dict[str, torch.Tensor]) -> Snapshot:
    return Snapshot(
        shapes={key: tuple(value.shape) for key, value in cache.items()},
        estimator=cache["estimator_att_cache"][0, 0].clone(),
        conformer=cache["conformer_att_cache"].clone(),
    )


class RecordingStream(StockStream):
    """StockStream that snapshots the flow cache after setup and around every retain()."""

    def setup(self) -> None:
        super().setup()
        self.after_setup = _snapshot(self.stream_cache)
        self.around_retain: list[tuple[Snapshot, Snapshot]] = []
        self.hift_shapes: list[dict[str, tuple[int, ...]]] = []

    def retain(self, cache: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        before = _snapshot(cache)
        cache = super().retain(cache)
        self.around_retain.append((before, _snapshot(cache)))
        return cache

    def step(self, tokens: torch.Tensor, last_chunk: bool = False) -> ChunkOut:
        out = super().step(tokens, last_chunk)
        self.hift_shapes.append({key: tuple(value.shape) for key, value in self.hift_cache_dict.items()})
        return out


@dataclass
class Run:
    flow: torch.nn.Module
    hift: torch.nn.Module
    stream: RecordingStream
    outs: list[ChunkOut] = field(default_factory=list)


def _run(seed: int) -> Run:
    flow = build_flow(REDUCED_DEPTH, seed=seed)
    hift = build_hift(seed=seed)
    stream = RecordingStream(flow, hift, random_prompt(seed))
    outs = stream.run(random_chunks(seed, 3), rng_seed=seed, last_chunk=False)
    return Run(flow, hift, stream, outs)


@pytest.fixture(scope="module")
def reduced() -> Run:
    return _run(seed=0)


def _flow_shapes(length: int) -> dict[str, tuple[int, ...]]:
    return {
        "conformer_cnn_cache": (1, 512, 6),
        "conformer_att_cache": (N_BLOCKS, 1, 8, length, 128),
        "estimator_cnn_cache": (16, 16, 2, 1024, 2),
        "estimator_att_cache": (16, 16, 2, 8, length, 128),
    }


def test_vendor_is_minicpmo_utils_1_0_6_streaming_cosyvoice2() -> None:
    vendor = token2wav_vendor()
    assert vendor.version == "1.0.6"
    assert vendor.flow.__module__ == "stepaudio2.cosyvoice2.flow.flow"
    assert vendor.cfm.__module__ == "stepaudio2.cosyvoice2.flow.flow_matching"
    assert vendor.estimator.__module__ == "stepaudio2.cosyvoice2.flow.decoder_dit"
    assert vendor.encoder.__module__ == "stepaudio2.cosyvoice2.transformer.upsample_encoder_v2"
    assert vendor.hift.__module__ == "stepaudio2.flashcosyvoice.modules.hifigan"


def test_missing_vendor_names_package_version_and_install_command() -> None:
    package = VendorPackage("cadence-fx-absent", "9.9.9", "absent_vendor", (), "pip install absent==9.9.9")
    with pytest.raises(VendorMissing, match=r"cadence-fx-absent==9\.9\.9 .* pip install absent==9\.9\.9"):
        require(package)


def test_wrong_vendor_version_is_refused() -> None:
    package = VendorPackage("torch", "0.0.1", "torch", (), "pip install torch==0.0.1", "a test pin")
    refusal = r"torch \S+ is installed but cadence-fx needs exactly 0\.0\.1 \(a test pin\); install it with"
    with pytest.raises(VendorMissing, match=refusal):
        require(package)


def test_placeholder_raises_naming_module_and_vendor_use() -> None:
    spec = PromptOnlyImport("cadence_fx_absent_audio.io", ("load",), "prompt_fn in a test")
    try:
        assert register_placeholder(spec)
        module = importlib.import_module("cadence_fx_absent_audio.io")
        from cadence_fx_absent_audio.io import load

        refusal = r"cadence_fx_absent_audio\.io\.load\(\) is unavailable: .*prompt_fn in a test"
        with pytest.raises(PlaceholderUsed, match=refusal):
            load("x.wav")
        with pytest.raises(PlaceholderUsed, match=r"cadence_fx_absent_audio\.io\.resample is unavailable"):
            module.resample
        assert not hasattr(module, "resample")
    finally:
        for name in ("cadence_fx_absent_audio.io", "cadence_fx_absent_audio"):
            sys.modules.pop(name, None)


@pytest.mark.parametrize("spec", PROMPT_ONLY_IMPORTS, ids=lambda spec: spec.module)
def test_prompt_only_import_is_real_or_a_placeholder_that_raises(spec: PromptOnlyImport) -> None:
    token2wav_vendor()
    module = importlib.import_module(spec.module)
    if spec.module not in placeholders():
        assert not hasattr(module, "__cadence_placeholder__")
        return
    with pytest.raises(PlaceholderUsed, match=rf"{spec.module}\.anything is unavailable: .*prompt"):
        module.anything
    for name in spec.names:
        with pytest.raises(PlaceholderUsed, match=rf"{spec.module}\.{name}\(\)"):
            getattr(module, name)()


def test_flow_builds_reduced_with_vendor_classes_in_eval_mode(reduced: Run) -> None:
    vendor = token2wav_vendor()
    flow = reduced.flow
    assert type(flow) is vendor.flow and type(flow.encoder) is vendor.encoder
    assert type(flow.decoder) is vendor.cfm and type(flow.decoder.estimator) is vendor.estimator
    assert type(reduced.hift) is vendor.hift
    blocks = (len(flow.encoder.encoders), len(flow.encoder.up_encoders), len(flow.decoder.estimator.blocks))
    assert blocks == (1, 1, 2)
    assert (flow.pre_lookahead_len, flow.up_rate, flow.decoder.inference_cfg_rate) == (3, 2, 0.7)
    assert not flow.training and not reduced.hift.training


def test_no_parameter_is_all_zero(reduced: Run) -> None:
    for module in (reduced.flow, reduced.hift):
        assert [name for name, p in module.named_parameters() if p.count_nonzero() == 0] == []


def test_cache_shapes_per_chunk(reduced: Run) -> None:
    stream = reduced.stream
    assert stream.after_setup.shapes == _flow_shapes(302)
    assert [(before.shapes, after.shapes) for before, after in stream.around_retain] == [
        (_flow_shapes(352), _flow_shapes(352)),
        (_flow_shapes(402), _flow_shapes(402)),
        (_flow_shapes(452), _flow_shapes(402)),
    ]
    assert [tuple(out.mel.shape) for out in reduced.outs] == [(1, 80, 50)] * 3
    assert [tuple(out.speech.shape) for out in reduced.outs] == [(1, 24000)] * 3
    assert stream.hift_shapes == [{"mel": (1, 80, 8), "source": (1, 1, 3840), "speech": (1, 3840)}] * 3


def test_estimator_trim_keeps_newest_frames_then_prompt_tail(reduced: Run) -> None:
    setup = reduced.stream.after_setup.estimator
    before, after = reduced.stream.around_retain[2]
    g3_g2_g1 = before.estimator[:, :, :150]
    assert torch.equal(after.estimator[:, :, :150], g3_g2_g1)
    assert torch.equal(after.estimator[:, :, 150:302], setup[:, :, :152])
    assert torch.equal(after.estimator[:, :, 302:], setup[:, :, 202:302])


def test_conformer_trim_keeps_prompt_then_newest_frames(reduced: Run) -> None:
    setup = reduced.stream.after_setup.conformer
    before, after = reduced.stream.around_retain[2]
    token_rate = slice(0, REDUCED_DEPTH.encoder_blocks)
    mel_rate = slice(REDUCED_DEPTH.encoder_blocks, N_BLOCKS)
    assert torch.equal(after.conformer[mel_rate, :, :, :302], setup[mel_rate])
    assert torch.equal(after.conformer[mel_rate, :, :, 302:], before.conformer[mel_rate, :, :, 352:])
    # Token-rate blocks read back the first half (201): prompt 151 + chunks 1 and 2, not chunk 3.
    assert torch.equal(after.conformer[token_rate, :, :, :201], before.conformer[token_rate, :, :, :201])
    assert torch.equal(after.conformer[token_rate, :, :, :151], setup[token_rate, :, :, :151])


def test_two_runs_from_one_seed_are_bit_identical(reduced: Run) -> None:
    again = _run(seed=0)
    for name, value in reduced.flow.state_dict().items():
        assert torch.equal(value, again.flow.state_dict()[name]), name
    assert torch.equal(reduced.flow.decoder.rand_noise, again.flow.decoder.rand_noise)
    for first, second in zip(reduced.outs, again.outs, strict=True):
        assert torch.equal(first.mel, second.mel)
        assert torch.equal(first.speech, second.speech)
    pairs = zip(reduced.stream.around_retain, again.stream.around_retain, strict=True)
    for (_, first), (_, second) in pairs:
        assert torch.equal(first.estimator, second.estimator)
        assert torch.equal(first.conformer, second.conformer)


def test_a_stream_without_a_vocoder_streams_the_flow_and_refuses_a_waveform_step(reduced: Run) -> None:
    stream = StockStream(build_flow(REDUCED_DEPTH, seed=0), None, random_prompt(0))
    chunk = random_chunks(0, 3)[0]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # as `run(rng_seed=0)` seeds the fixture's stream
        stream.setup()
        with pytest.raises(ValueError, match=r"this stream has no vocoder \(hift=None\): flow_chunk\(\) streams the flow alone"):
            stream.step(chunk)
        mel = stream.flow_chunk(chunk)
    assert torch.equal(mel, reduced.outs[0].mel)
