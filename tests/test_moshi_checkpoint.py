"""Published Moshi checkpoints: a directory in the vendor's layout, written here from random TINY
weights (LM in bfloat16 as published), loads through cadence-fx's loader and, transformed, streams
the tokens and PCM of the vendor's own loaders and loop on the same files, bit for bit; what is
missing, offline or unsupported is refused, naming the directory or repo and every file looked for."""

import json

import pytest
import torch
from huggingface_hub import constants
from moshi.models import loaders
from moshi.utils.compile import no_cuda_graph
from moshi_checkpoint_kit import stored, vendor_models, write_checkpoint

from cadence_fx import transform
from cadence_fx.models.moshi import contract_for
from cadence_fx.models.moshi_checkpoint import CheckpointNotFound, CheckpointUnsupported, locate
from cadence_fx.models.moshi_stream import FULL, TINY, MoshiConfig, build_models, random_pcm, stream_reference

FRAMES = 10
PUBLISHED = [loaders.MOSHI_NAME, loaders.MIMI_NAME, loaders.TEXT_TOKENIZER_NAME]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the reference and the runtime on one thread


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("moshi") / "tiny", build_models(TINY))


@pytest.fixture(scope="module")
def checkpoint(directory):
    return locate(str(directory))


@pytest.fixture(scope="module")
def bf16() -> MoshiConfig:
    return MoshiConfig(mimi=TINY.mimi, lm_kwargs=TINY.lm_kwargs, lm_dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def transformed(checkpoint, bf16):
    models = checkpoint.load("cpu", torch.bfloat16)
    assert models.config == bf16
    return transform(models, contract_for(models.config))[0]


def test_the_directory_holds_the_vendors_files_keys_and_dtypes(directory):
    lm, mimi = stored(directory)
    vendor_lm = loaders.get_moshi_lm(None, lm_kwargs=TINY.lm_kwargs, device="meta")
    vendor_mimi = loaders.get_mimi(None, TINY.mimi, device="meta")
    assert sorted(p.name for p in directory.iterdir()) == sorted(["config.json", "mimi_config.json", *PUBLISHED])
    assert lm.keys() == vendor_lm.state_dict().keys() and {v.dtype for v in lm.values()} == {torch.bfloat16}
    assert mimi.keys() == vendor_mimi.state_dict().keys() and {v.dtype for v in mimi.values()} == {torch.float32}


def test_the_loader_holds_exactly_the_stored_weights_and_tokenizer(checkpoint, directory, bf16):
    models = checkpoint.load("cpu", torch.bfloat16)
    for tensors, module in zip(stored(directory), (models.lm, models.mimi)):
        state = module.state_dict()
        assert state.keys() == tensors.keys()
        for key, value in tensors.items():
            assert state[key].dtype == value.dtype and torch.equal(state[key], value), key
    assert (checkpoint.source, checkpoint.config(torch.bfloat16), checkpoint.differences(TINY)) == (str(directory), bf16, [])
    tokenizer = checkpoint.info.get_text_tokenizer()
    assert tokenizer.serialized_model_proto() == (directory / loaders.TEXT_TOKENIZER_NAME).read_bytes()


@pytest.mark.parametrize(("sampling", "seed"), [(True, 7), (False, 0)])
def test_the_transformed_checkpoint_streams_the_vendors_tokens_and_pcm_bit_for_bit(transformed, directory, bf16, sampling, seed):
    pcm = random_pcm(FRAMES, seed=seed + 100)
    want = stream_reference(vendor_models(directory, bf16), pcm, sampling=sampling, seed=seed)
    got = transformed.stream(pcm, sampling=sampling, seed=seed)
    assert got.tokens.shape == (1, 9, FRAMES - 1)
    assert torch.equal(got.tokens, want.tokens)
    assert torch.equal(got.pcm, want.pcm)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@torch.no_grad()
def test_on_cuda_the_replayed_checkpoint_streams_the_vendors_eager_tokens_and_pcm(directory, bf16):
    models = locate(directory).load("cuda", torch.bfloat16)
    transformed, _ = transform(models, contract_for(models.config))
    vendor = vendor_models(directory, bf16, device="cuda")  # run after the transform: under its pinned kernels
    for sampling, seed in [(True, 7), (False, 0)]:
        pcm = random_pcm(FRAMES, seed=seed + 100, device="cuda")
        got = transformed.stream(pcm, sampling=sampling, seed=seed)
        with no_cuda_graph():
            want = stream_reference(vendor, pcm, sampling=sampling, seed=seed)
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.pcm, want.pcm), (sampling, seed)
    counters = transformed.counters()
    for name, classes in (("mimi_encode", 1), ("lm_step", 1), ("mimi_decode", 1), ("depformer_step", 2)):
        bound, replay = counters[name], counters[name]["replay"]
        assert bound["stock"] == 0 and bound["graph_calls"] == bound["calls"], (name, bound)
        assert replay["captures"] == classes and replay["eager"] == 0, (name, replay)
        assert replay["replays"] == replay["calls"] == bound["calls"] - 2 * classes, (name, replay)


def test_a_checkpoint_moves_to_a_worker_as_json_and_back_unchanged(checkpoint):
    again = type(checkpoint).from_json(json.loads(json.dumps(checkpoint.to_json())))
    assert again == checkpoint


def test_a_directory_without_config_json_is_moshi_7b_as_shipped(tmp_path):
    for name in PUBLISHED:
        (tmp_path / name).write_bytes(b"")  # located, not read
    checkpoint = locate(tmp_path)
    assert (checkpoint.info.lm_config, checkpoint.info.mimi_config) == (None, None)
    assert checkpoint.config() == FULL and checkpoint.differences(FULL) == []


def test_a_missing_file_is_named_with_every_file_looked_for(directory, tmp_path):
    for name in ("config.json", "mimi_config.json", loaders.TEXT_TOKENIZER_NAME):
        (tmp_path / name).write_bytes((directory / name).read_bytes())
    with pytest.raises(CheckpointNotFound) as missing:
        locate(tmp_path)
    assert str(missing.value) == (
        f"Moshi checkpoint directory '{tmp_path}' lacks model.safetensors, "
        "tokenizer-e351c8d8-checkpoint125.safetensors; looked for config.json (found), model.safetensors (missing), "
        "tokenizer-e351c8d8-checkpoint125.safetensors (missing), tokenizer_spm_32k_3.model (found), "
        "mimi_config.json (found)"
    )


def test_a_path_that_is_neither_a_directory_nor_a_repo_id_is_refused(tmp_path):
    with pytest.raises(CheckpointNotFound) as missing:
        locate(tmp_path / "absent")
    assert str(missing.value) == (
        f"Moshi checkpoint '{tmp_path / 'absent'}': no such directory, and not a hub repo id (owner/name); expected a "
        "directory holding config.json (optional), model.safetensors, tokenizer-e351c8d8-checkpoint125.safetensors, "
        "tokenizer_spm_32k_3.model or a repo id such as kyutai/moshiko-pytorch-bf16"
    )


def test_offline_without_a_local_copy_names_the_repo_and_every_file(monkeypatch, tmp_path):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(CheckpointNotFound) as offline:
        locate("kyutai/moshika-pytorch-bf16")
    assert str(offline.value) == (
        "Moshi checkpoint 'kyutai/moshika-pytorch-bf16' is not a directory here, and as a Hugging Face hub repo it has "
        f"no complete local copy in {tmp_path} and HF_HUB_OFFLINE is set; looked for config.json (optional), "
        "model.safetensors, tokenizer-e351c8d8-checkpoint125.safetensors, tokenizer_spm_32k_3.model. Download it "
        "where the hub is reachable (hf download kyutai/moshika-pytorch-bf16) or pass a directory holding those files"
    )


@pytest.mark.parametrize(
    ("config", "problem"),
    [
        ({"model_type": "hibiki"}, "not a plain Moshi checkpoint: model_type is 'hibiki', not 'moshi'"),
        (
            {"lora": True, "lora_name": "lora.safetensors"},
            "not a plain Moshi checkpoint: it carries LoRA weights (lora / lora_name)",
        ),
        (
            {"fuser": {"sum": ["control"]}},
            "not a plain Moshi checkpoint: it is conditioned (fuser), so every step needs condition tensors",
        ),
        (["dim", 4096], "config.json holds a list; expected an object of the LM's keyword arguments"),
    ],
)
def test_a_checkpoint_moshi_does_not_drive_is_refused_before_its_files_are_read(tmp_path, config, problem):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointUnsupported) as refused:
        locate(tmp_path)
    assert str(refused.value) == f"Moshi checkpoint directory '{tmp_path}': {problem}"
