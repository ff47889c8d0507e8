"""The published MiniCPM-o 4.5 Token2Wav checkpoint format, written here at reduced depth with
random weights: cadence-fx loads it, transforms and streams it, and every mel frame and PCM sample
equals the vendor's own ``stepaudio2.Token2wav`` loading the same files.

The vendor's ``Token2wav.__init__`` runs itself, on the CPU: its ``.cuda()`` moves are made
no-ops and its two prompt models (the speech tokenizer and the speaker model, which streaming does
not use) are stubbed, since their ONNX files cannot be written here.
"""

from __future__ import annotations

import importlib
import shutil
import sys
import types
from pathlib import Path

import huggingface_hub.constants
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from cadence_fx import transform
from cadence_fx.cli import main
from cadence_fx.models import token2wav_checkpoint as checkpoint
from cadence_fx.models.token2wav_carry import CarryStream, contract_for_flow
from cadence_fx.models.token2wav_stream import (
    REDUCED_DEPTH,
    Prompt,
    StockStream,
    build_flow,
    build_hift,
    random_chunks,
    random_prompt,
)
from cadence_fx.models.vendor import token2wav_vendor
from cadence_fx.serve.plugins.token2wav import FRAME_SAMPLES, INPUT_RATE, Token2WavPlugin, rng_seed, token_seed

pytestmark = pytest.mark.slow

SEED = 7  # draws CFM.rand_noise, which flow.pt does not hold, on both sides
PROMPT_TOKENS = 51
CHUNKS = 4  # extents P, P+50, P+100, then the flush at P+100

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


def write_assets(assets: Path, depth=REDUCED_DEPTH) -> None:
    """flow.yaml, flow.pt and hift.pt as in the model repository's assets/token2wav."""
    assets.mkdir(parents=True)
    (assets / "flow.yaml").write_text(FLOW_YAML.format(**vars(depth)))
    torch.save(build_flow(depth, seed=11).state_dict(), assets / "flow.pt")
    torch.save(build_hift(seed=12).state_dict(), assets / "hift.pt")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A MiniCPM-o model folder holding only the streaming part of assets/token2wav."""
    root = tmp_path_factory.mktemp("MiniCPM-o-4_5")
    write_assets(root / "assets" / "token2wav")
    return root


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> tuple[Prompt, Path]:
    prompt = random_prompt(3, n_tokens=PROMPT_TOKENS)
    path = tmp_path_factory.mktemp("prompt") / "voice.safetensors"
    checkpoint.save_prompt(prompt, path, source="random")
    return prompt, path


@pytest.fixture(scope="module")
def vendor(model_dir):
    """``stepaudio2.Token2wav(model_dir/assets/token2wav)``, its flow's noise drawn under SEED."""
    token2wav_vendor()  # registers the placeholders stepaudio2.token2wav needs to import here
    module = importlib.import_module("stepaudio2.token2wav")
    patch = pytest.MonkeyPatch()
    patch.setattr(module, "s3tokenizer", types.SimpleNamespace(load_model=lambda path: torch.nn.Identity()))
    patch.setattr(module, "onnxruntime", types.SimpleNamespace(
        SessionOptions=types.SimpleNamespace,
        GraphOptimizationLevel=types.SimpleNamespace(ORT_ENABLE_ALL=None),
        InferenceSession=lambda *args, **kwargs: None,
    ))
    patch.setattr(torch.nn.Module, "cuda", lambda self, device=None: self)
    patch.setattr(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            return module.Token2wav(str(model_dir / "assets" / "token2wav"))
    finally:
        patch.undo()


def stock_run(vendor, prompt: Prompt, chunks, rng: int):
    with torch.no_grad():
        return StockStream(vendor.flow, vendor.hift, prompt).run(chunks, rng_seed=rng)


# -- loading ---------------------------------------------------------------------------------------


def test_the_loaded_flow_and_hift_hold_the_files_weights(model_dir):
    found = checkpoint.locate_checkpoint(model_dir)
    assert found.assets == model_dir / "assets" / "token2wav" and found.root == model_dir
    for module, name in ((checkpoint.load_flow(found), "flow.pt"), (checkpoint.load_hift(found), "hift.pt")):
        saved = torch.load(found.assets / name, weights_only=True)
        state = module.state_dict()
        assert state.keys() == saved.keys()
        assert all(torch.equal(state[key], saved[key]) for key in saved)
        assert not module.training


def test_the_flow_is_the_vendors_token2wav_flow_loading_the_same_files(model_dir, vendor):
    flow = checkpoint.load_flow(checkpoint.locate_checkpoint(model_dir), seed=SEED)
    ours, theirs = flow.state_dict(), vendor.flow.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert torch.equal(flow.decoder.rand_noise, vendor.flow.decoder.rand_noise)
    assert (len(flow.decoder.estimator.blocks), len(flow.encoder.encoders), len(flow.encoder.up_encoders)) == (2, 1, 1)


def test_the_asset_folder_itself_is_a_checkpoint_too(model_dir):
    found = checkpoint.locate_checkpoint(model_dir / "assets" / "token2wav")
    assert (found.assets, found.root) == (model_dir / "assets" / "token2wav", model_dir)


def test_a_generator_prefixed_hift_file_loads_as_the_vendor_strips_it(model_dir, tmp_path):
    assets = tmp_path / "assets" / "token2wav"
    shutil.copytree(model_dir / "assets" / "token2wav", assets)
    saved = torch.load(assets / "hift.pt", weights_only=True)
    torch.save({f"generator.{k}": v for k, v in saved.items()}, assets / "hift.pt")
    state = checkpoint.load_hift(checkpoint.locate_checkpoint(tmp_path)).state_dict()
    assert all(torch.equal(state[k], saved[k]) for k in saved)


# -- streaming -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def streamed(model_dir, vendor, prompt_file):
    """The vendor's stream and the transformed stream of the loaded checkpoint, same tokens and RNG."""
    prompt, path = prompt_file
    found = checkpoint.locate_checkpoint(model_dir)
    flow, hift = checkpoint.load_flow(found, seed=SEED), checkpoint.load_hift(found)
    loaded = checkpoint.load_prompt(path)
    transformed, report = transform((flow, hift), contract_for_flow(flow, loaded.mels.shape[1]), audit=True, capture=False)
    chunks = random_chunks(21, CHUNKS)
    with torch.no_grad():
        carried = CarryStream(transformed, loaded).run(chunks, rng_seed=5)
    return stock_run(vendor, prompt, chunks, 5), carried, report


def test_transformed_checkpoint_streams_mel_and_pcm_bit_identical_to_the_vendor(streamed):
    stock, carried, _ = streamed
    assert [tuple(out.mel.shape) for out in carried] == [(1, 80, 50)] * (CHUNKS - 1) + [(1, 80, 56)]
    assert [torch.equal(a.mel, b.mel) for a, b in zip(stock, carried)] == [True] * CHUNKS
    assert [torch.equal(a.speech, b.speech) for a, b in zip(stock, carried)] == [True] * CHUNKS


def test_the_contract_follows_the_checkpoint_and_the_prompt(streamed):
    _, _, report = streamed
    assert report.auditor.mismatches == 0
    assert report.catalog.operator("cfm_loop").grid == (102, 152, 202)
    assert report.catalog.region("estimator_att_cache").shape == (10, 2, 2, 8, 258, 128)


# -- the prompt file -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_a_prompt_file_reads_back_exactly(tmp_path, dtype):
    prompt = random_prompt(4, n_tokens=9)
    prompt = Prompt(prompt.tokens.to(dtype), prompt.mels, prompt.spk)
    checkpoint.save_prompt(prompt, tmp_path / "p.safetensors", source="x.wav")
    loaded = checkpoint.load_prompt(tmp_path / "p.safetensors")
    for name in ("tokens", "mels", "spk"):
        a, b = getattr(prompt, name), getattr(loaded, name)
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_a_safetensors_file_of_something_else_is_not_a_prompt(tmp_path):
    save_file({"tokens": torch.zeros(1, 3, dtype=torch.int32)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(checkpoint.CheckpointError, match=r"format=None version=None, expected 'cadence-fx/token2wav-prompt'"):
        checkpoint.load_prompt(tmp_path / "other.safetensors")
    (tmp_path / "voice.txt").write_text("hello")
    with pytest.raises(checkpoint.CheckpointError, match=r"voice.txt is not a Token2Wav prompt file"):
        checkpoint.load_prompt(tmp_path / "voice.txt")


def test_a_prompt_of_the_wrong_shape_is_refused_naming_the_tensor(tmp_path):
    prompt = random_prompt(4, n_tokens=9)
    with pytest.raises(checkpoint.CheckpointError, match=r"spk must be floating point of shape \(1, 192\), got torch.float32 \(1, 80\)"):
        checkpoint.save_prompt(Prompt(prompt.tokens, prompt.mels, prompt.mels[:, 0]), tmp_path / "p.safetensors")
    uneven = Prompt(prompt.tokens, prompt.mels[:, :17], prompt.spk)
    with pytest.raises(checkpoint.CheckpointError, match=r"9 speech tokens and 17 mel frames; this flow needs 18"):
        checkpoint.prompt_frames_fit(uneven, 2, "p.safetensors")


# -- what is missing, said ---------------------------------------------------------------------------


def test_a_missing_file_is_named_with_the_folder_that_lacks_it(model_dir, tmp_path):
    assets = tmp_path / "assets" / "token2wav"
    shutil.copytree(model_dir / "assets" / "token2wav", assets)
    (assets / "hift.pt").unlink()
    with pytest.raises(checkpoint.CheckpointError, match=rf"{assets} lacks hift.pt of the MiniCPM-o 4.5 Token2Wav checkpoint"):
        checkpoint.locate_checkpoint(tmp_path)
    with pytest.raises(checkpoint.CheckpointError, match=r"lacks speech_tokenizer_v2_25hz.onnx, campplus.onnx"):
        checkpoint.locate_checkpoint(model_dir, checkpoint.PREPARE_FILES)
    with pytest.raises(checkpoint.CheckpointError, match=rf"{tmp_path / 'assets'} holds no MiniCPM-o 4.5 Token2Wav checkpoint"):
        checkpoint.locate_checkpoint(tmp_path / "assets")


def test_an_unreachable_hub_id_names_the_repository_and_the_files(monkeypatch, tmp_path):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(checkpoint.CheckpointError) as caught:
        checkpoint.locate_checkpoint("openbmb/MiniCPM-o-4_5", cache_dir=tmp_path)
    message = str(caught.value)
    assert message.startswith("could not get assets/token2wav/flow.yaml, assets/token2wav/flow.pt, "
                              "assets/token2wav/hift.pt of hub repository openbmb/MiniCPM-o-4_5 (LocalEntryNotFoundError")
    assert "hf download openbmb/MiniCPM-o-4_5 --include 'assets/token2wav/*' --local-dir DIR" in message


def test_weights_that_are_neither_a_folder_nor_a_hub_id_are_refused(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match=r"neither an existing folder nor a hub id \(OWNER/NAME"):
        checkpoint.locate_checkpoint(tmp_path / "nowhere")
    (tmp_path / "flow.pt").write_bytes(b"")
    with pytest.raises(checkpoint.CheckpointError, match=r"flow.pt is a file; expected a checkpoint folder or a hub id"):
        checkpoint.locate_checkpoint(tmp_path / "flow.pt")


def test_flow_yaml_may_name_the_four_vendor_classes_only(tmp_path):
    (tmp_path / "flow.yaml").write_text("flow: !new:os.system\n    command: 'echo hi'\n")
    with pytest.raises(checkpoint.CheckpointError, match=r"could not determine a constructor for the tag '!new:os.system'"):
        checkpoint.read_flow_config(tmp_path / "flow.yaml")


def test_weights_that_do_not_fit_the_config_name_both_files(model_dir, tmp_path):
    assets = tmp_path / "assets" / "token2wav"
    shutil.copytree(model_dir / "assets" / "token2wav", assets)
    (assets / "flow.yaml").write_text(FLOW_YAML.format(encoder_blocks=1, up_blocks=1, dit_blocks=3))
    with pytest.raises(checkpoint.CheckpointError, match=rf"{assets}/flow.pt does not fit the CausalMaskedDiffWithXvec "
                                                          rf"as {assets}/flow.yaml describes it: .*decoder.estimator.blocks.2"):
        checkpoint.load_flow(checkpoint.locate_checkpoint(tmp_path))


def test_preparing_a_prompt_without_its_packages_names_each_with_its_install(monkeypatch, model_dir):
    for name in checkpoint.PROMPT_PACKAGES:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(checkpoint.PromptUnavailable) as caught:
        checkpoint.prepare_prompt(checkpoint.locate_checkpoint(model_dir), model_dir / "voice.wav")
    message = str(caught.value)
    assert "needs torchaudio, s3tokenizer, onnx, onnxruntime, soundfile, librosa (not installed or not loadable here)" in message
    assert "pip install --no-deps s3tokenizer==0.3.0" in message and "`cadence-fx prompt`" in message


# -- the command line and the service --------------------------------------------------------------


def test_serve_refuses_a_prompt_for_a_model_that_takes_none(capsys):
    assert main(["serve", "--model", "moshi-tiny", "--prompt", "voice.safetensors"]) == 2
    assert capsys.readouterr().err.endswith(
        "cadence-fx serve: error: --prompt is not an option of --model moshi-tiny; "
        "the models that take it: token2wav, token2wav-full\n")


def test_the_prompt_command_names_the_prompt_models_a_checkpoint_lacks(capsys, model_dir, tmp_path):
    assert main(["prompt", "--weights", str(model_dir), "--wav", "voice.wav", "--out", str(tmp_path / "p")]) == 2
    assert "lacks speech_tokenizer_v2_25hz.onnx, campplus.onnx" in capsys.readouterr().err


def test_a_wav_prompt_on_random_weights_is_refused():
    with pytest.raises(ValueError, match=r"--prompt voice.wav is a WAV; preparing it needs the checkpoint's speech tokenizer"):
        Token2WavPlugin("reduced", prompt="voice.wav")


def test_the_service_on_the_checkpoint_speaks_the_vendors_stream(model_dir, vendor, prompt_file):
    prompt, path = prompt_file
    plugin = Token2WavPlugin("reduced", seed=SEED, max_reply_chunks=3, weights=model_dir, prompt=path)
    assert plugin.describe()["weights"] == str(model_dir)
    stream = plugin.open_stream()
    for _ in range(round(3 * INPUT_RATE / FRAME_SAMPLES)):
        stream.feed(np.zeros(FRAME_SAMPLES, dtype=np.float32))
    stream.begin_response()
    heard = []
    while (chunk := stream.step()) is not None:
        heard.append(chunk)
    stock = stock_run(vendor, prompt, random_chunks(token_seed(0, 0), 3), rng_seed(SEED, 0))
    assert len(heard) == 3
    assert all(np.array_equal(a, b.speech.reshape(-1).numpy()) for a, b in zip(heard, stock))
