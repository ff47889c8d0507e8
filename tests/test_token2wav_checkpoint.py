"""The published MiniCPM-o 4.5 Token2Wav checkpoint format, written here at reduced depth with
random weights (``checkpointkit.py``): cadence-fx loads it, transforms and streams it, and every mel
frame and PCM sample equals the vendor's own ``stepaudio2.Token2wav`` loading the same files (its
``__init__`` itself, on the CPU; the stream is ``StockStream``, the vendor's ``Token2wav.stream``
line for line, since that one places its inputs on CUDA). ``test_token2wav_checkpoint_cuda.py``
does the same at full size on a GPU against the vendor's own ``Token2wav.stream``.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import huggingface_hub.constants
import numpy as np
import pytest
import torch
from checkpointkit import FLOW_YAML, vendor_token2wav, write_assets
from safetensors.torch import save_file

from cadence_fx import transform
from cadence_fx.cli import main
from cadence_fx.models import token2wav_checkpoint as checkpoint
from cadence_fx.models.token2wav_carry import CarryStream, contract_for_flow
from cadence_fx.models.token2wav_stream import (
    Prompt,
    StockStream,
    random_chunks,
    random_prompt,
)
from cadence_fx.serve.plugins.token2wav import FRAME_SAMPLES, INPUT_RATE, Token2WavPlugin, rng_seed, token_seed

pytestmark = pytest.mark.slow

SEED = 7  # draws CFM.rand_noise, which flow.pt does not hold, on both sides
PROMPT_TOKENS = 51
CHUNKS = 4  # extents P, P+50, P+100, then the flush at P+100
REPLY = random_chunks(token_seed(0, 0), CHUNKS)  # the plugin's first stream's first reply


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
    return vendor_token2wav(model_dir / "assets" / "token2wav", seed=SEED, on_cpu=True)


@pytest.fixture(scope="module")
def stock(vendor, prompt_file):
    """The vendor's stream of the first reply the plugin below speaks: its tokens, its RNG seed."""
    prompt, _ = prompt_file
    with torch.no_grad():
        return StockStream(vendor.flow, vendor.hift, prompt).run(REPLY, rng_seed=rng_seed(SEED, 0))


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
def streamed(model_dir, prompt_file):
    """The loaded checkpoint, transformed, streaming the vendor stream's tokens from its RNG seed;
    its prompt read back from the prompt file."""
    _, path = prompt_file
    found = checkpoint.locate_checkpoint(model_dir)
    flow, hift = checkpoint.load_flow(found, seed=SEED), checkpoint.load_hift(found)
    loaded = checkpoint.load_prompt(path)
    contract = contract_for_flow(flow, loaded.mels.shape[1])
    transformed, report = transform((flow, hift), contract, audit=True)
    with torch.no_grad():
        return CarryStream(transformed, loaded).run(REPLY, rng_seed=rng_seed(SEED, 0)), report


def test_transformed_checkpoint_streams_mel_and_pcm_bit_identical_to_the_vendor(stock, streamed):
    carried, _ = streamed
    assert [tuple(out.mel.shape) for out in carried] == [(1, 80, 50)] * (CHUNKS - 1) + [(1, 80, 56)]
    assert [torch.equal(a.mel, b.mel) for a, b in zip(stock, carried)] == [True] * CHUNKS
    assert [torch.equal(a.speech, b.speech) for a, b in zip(stock, carried)] == [True] * CHUNKS


def test_the_contract_follows_the_checkpoint_and_the_prompt(streamed):
    _, report = streamed
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
    with pytest.raises(
        checkpoint.CheckpointError, match=r"spk must be floating point of shape \(1, 192\), got torch.float32 \(1, 80\)"
    ):
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
    assert message.startswith(
        "could not get assets/token2wav/flow.yaml, assets/token2wav/flow.pt, "
        "assets/token2wav/hift.pt of hub repository openbmb/MiniCPM-o-4_5 (LocalEntryNotFoundError"
    )
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


def test_flow_yaml_argument_names_must_be_strings(tmp_path):
    (tmp_path / "flow.yaml").write_text(
        "flow: !new:cosyvoice2.flow.flow.CausalMaskedDiffWithXvec\n    input_size: 512\n    3: 80\n"
    )
    with pytest.raises(checkpoint.CheckpointError, match=r"CausalMaskedDiffWithXvec's argument names must be strings, got 3"):
        checkpoint.read_flow_config(tmp_path / "flow.yaml")


def test_weights_that_do_not_fit_the_config_name_both_files(model_dir, tmp_path):
    assets = tmp_path / "assets" / "token2wav"
    shutil.copytree(model_dir / "assets" / "token2wav", assets)
    (assets / "flow.yaml").write_text(FLOW_YAML.format(encoder_blocks=1, up_blocks=1, dit_blocks=3))
    with pytest.raises(
        checkpoint.CheckpointError,
        match=rf"(?s){assets}/flow.pt does not fit the CausalMaskedDiffWithXvec "
        rf"as {assets}/flow.yaml describes it: .*decoder.estimator.blocks.2",
    ):
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
    assert capsys.readouterr().err == (
        "cadence-fx serve: error: --prompt: moshi-tiny takes no speaker prompt; the models that do: token2wav, token2wav-full\n"
    )


def test_the_prompt_command_names_the_prompt_models_a_checkpoint_lacks(capsys, model_dir, tmp_path):
    assert main(["prompt", "--weights", str(model_dir), "--wav", "voice.wav", "--out", str(tmp_path / "p")]) == 2
    assert "lacks speech_tokenizer_v2_25hz.onnx, campplus.onnx" in capsys.readouterr().err


def test_a_wav_prompt_on_random_weights_is_refused():
    with pytest.raises(ValueError, match=r"--prompt voice.wav is a WAV; preparing it needs the checkpoint's speech tokenizer"):
        Token2WavPlugin("reduced", prompt="voice.wav")


def test_the_service_on_the_checkpoint_speaks_the_vendors_stream(model_dir, prompt_file, stock):
    _, path = prompt_file
    plugin = Token2WavPlugin("reduced", seed=SEED, max_reply_chunks=CHUNKS, weights=model_dir, prompt=path)
    assert plugin.describe()["weights"] == str(model_dir)
    stream = plugin.open_stream()
    for _ in range(round(CHUNKS * INPUT_RATE / FRAME_SAMPLES)):
        stream.feed(np.zeros(FRAME_SAMPLES, dtype=np.float32))
    stream.begin_response()
    heard = []
    while (chunk := stream.step()) is not None:
        heard.append(chunk)
    assert [np.array_equal(a, b.speech.reshape(-1).numpy()) for a, b in zip(heard, stock, strict=True)] == [True] * CHUNKS
