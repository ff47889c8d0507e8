"""A MiniCPM-o 4.5 Token2Wav checkpoint written in the model repository's format, and the vendor's
own ``stepaudio2.Token2wav`` loading it (tests only)."""

from __future__ import annotations

import importlib
import types
from pathlib import Path

import pytest
import torch

from cadence_fx.models.token2wav_stream import REDUCED_DEPTH, FlowDepth, build_flow, build_hift
from cadence_fx.models.vendor import token2wav_vendor

# flow.yaml as the model repository ships it (hyperpyyaml tags, the vendor's keyword arguments),
# with the depths left open: the file must describe the weights it comes with.
FLOW_YAML = """\
flow: !new:cosyvoice2.flow.flow.CausalMaskedDiffWithXvec
    input_size: 512
    output_size: 80
    spk_embed_dim: 192
    output_type: 'mel'
    vocab_size: 6561
    encoder: !new:cosyvoice2.transformer.upsample_encoder_v2.UpsampleConformerEncoderV2
        input_size: 512
        output_size: 512
        input_layer: 'linear'
        pre_lookahead_len: 3
        num_blocks: {encoder_blocks}
        num_up_blocks: {up_blocks}
        up_stride: 2
        up_scale_factor: 2
        attention_heads: 8
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        key_bias: true
        linear_units: 2048
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.1
        normalize_before: true
    decoder: !new:cosyvoice2.flow.flow_matching.CausalConditionalCFM
        inference_cfg_rate: 0.7
        estimator: !new:cosyvoice2.flow.decoder_dit.DiT
            in_channels: 320
            out_channels: 80
            mlp_ratio: 4.0
            depth: {dit_blocks}
            num_heads: 8
            head_dim: 64
            hidden_size: 512
"""


def write_assets(assets: Path, depth: FlowDepth = REDUCED_DEPTH) -> None:
    """flow.yaml, flow.pt and hift.pt (float32 state dicts of the vendor modules, random weights)
    as in the model repository's assets/token2wav."""
    assets.mkdir(parents=True)
    (assets / "flow.yaml").write_text(FLOW_YAML.format(**vars(depth)))
    torch.save(build_flow(depth, seed=11).state_dict(), assets / "flow.pt")
    torch.save(build_hift(seed=12).state_dict(), assets / "hift.pt")


def vendor_token2wav(assets: Path, *, seed: int, on_cpu: bool):
    """``stepaudio2.Token2wav(assets)``, its flow's ``CFM.rand_noise`` drawn under ``seed``. Its two
    prompt models (speech tokenizer, speaker model: ONNX files streaming does not use) are stubbed;
    ``on_cpu`` makes its ``.cuda()`` moves no-ops."""
    token2wav_vendor()  # registers the placeholders stepaudio2.token2wav needs where packages are missing
    module = importlib.import_module("stepaudio2.token2wav")
    patch = pytest.MonkeyPatch()
    patch.setattr(module, "s3tokenizer", types.SimpleNamespace(load_model=lambda path: torch.nn.Identity()))
    patch.setattr(
        module,
        "onnxruntime",
        types.SimpleNamespace(
            SessionOptions=types.SimpleNamespace,
            GraphOptimizationLevel=types.SimpleNamespace(ORT_ENABLE_ALL=None),
            InferenceSession=lambda *args, **kwargs: None,
        ),
    )
    if on_cpu:
        patch.setattr(torch.nn.Module, "cuda", lambda self, device=None: self)
        patch.setattr(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return module.Token2wav(str(assets))
    finally:
        patch.undo()
