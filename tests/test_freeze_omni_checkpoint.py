"""Loading a released Freeze-Omni encoder checkpoint (CPU, reduced size).

Each test writes the release's files itself, in its format: `audiollm/train.yaml` (the published
one with the sizes reduced), `audiollm/global_cmvn` (JSON statistics) and `audiollm/final.pt` (a
bf16 state dict of the audio LLM: the encoder under `encoder.` beside adapter and embedding
entries), with random weights drawn by the vendor-side port. The loaded encoder, and its
transform, must stream bit for bit what the port of the vendor's own code streams from the same
files.
"""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
import yaml
from freeze_omni_vendor_port import AudioLLM, GlobalCMVN, SpeechEncoder, load_vendor_encoder, stream

from cadence_fx import transform
from cadence_fx.models.freeze_omni import encoder_contract
from cadence_fx.models.freeze_omni_checkpoint import RELEASE_REPO, CheckpointError, encoder_config, load_encoder
from cadence_fx.models.freeze_omni_encoder import FreezeOmniEncoder, FreezeOmniEncoderConfig, stream_utterance

# The encoder part of the published audiollm/train.yaml, as a public mirror of the release holds it.
RELEASED_TRAIN_YAML = """\
cmvn_file:
input_dim: 80
is_json_cmvn: true
encoder_conf:
  overview_conf:
    encoder-input-dim: 80
    encoder-layer-config: subsampling-transformer
    encoder-output-dim: 1024
  para_conf:
    subsampling:
      subsampling-dropout-rate: 0.1
      subsampling-input-dim: 80
      subsampling-output-dim: 1024
      subsampling-rate: 4
    transformer:
      transformer-attention-dim: 1024
      transformer-attention-dropout-rate: 0.0
      transformer-attention-heads: 16
      transformer-chunk_size: 4
      transformer-concat-after: false
      transformer-dropout-rate: 0.1
      transformer-dynamic-chunks: false
      transformer-input-dim: 1024
      transformer-input-layer: linear
      transformer-left_chunks: 16
      transformer-linear-units: 4096
      transformer-normalize-before: true
      transformer-num-blocks: 24
      transformer-output-dim: 1024
      transformer-pos-enc-class: rel-enc
      transformer-positional-dropout-rate: 0.1
      transformer-positionwise-layer-type: linear
"""
CHUNKS = 7  # with 3 left chunks: classes L = 0, 4, 8, then 12 for the last four calls


def class_name(extent: int, chunk: int = 4) -> str:
    return f"encoder_chunk[n={chunk},L={extent}]"


def train_yaml(left_chunks: int = 3, transformer: dict | None = None) -> dict:
    """The published train.yaml at 2 blocks of width 64 (4 heads, 128 units), `left_chunks` left
    chunks and the `transformer` entries given (the vendor's names)."""
    train = yaml.safe_load(RELEASED_TRAIN_YAML)
    conf = train["encoder_conf"]
    conf["overview_conf"]["encoder-output-dim"] = 64
    conf["para_conf"]["subsampling"]["subsampling-output-dim"] = 64
    conf["para_conf"]["transformer"].update(
        {
            "transformer-attention-dim": 64,
            "transformer-input-dim": 64,
            "transformer-output-dim": 64,
            "transformer-attention-heads": 4,
            "transformer-linear-units": 128,
            "transformer-num-blocks": 2,
            "transformer-left_chunks": left_chunks,
            **(transformer or {}),
        }
    )
    return train


def write_release(root, train: dict, *, cmvn_in_checkpoint: bool = True, seed: int = 0):
    """root/audiollm/{train.yaml, global_cmvn, final.pt}, random weights, bf16 as training saved them."""
    folder = root / "audiollm"
    folder.mkdir(parents=True)
    (folder / "train.yaml").write_text(yaml.safe_dump(train))
    generator = torch.Generator().manual_seed(seed)
    frames = torch.randn(500, 80, generator=generator, dtype=torch.float64) * 3 + 8
    (folder / "global_cmvn").write_text(
        json.dumps(
            {
                "mean_stat": frames.sum(0).tolist(),
                "var_stat": (frames**2).sum(0).tolist(),
                "frame_num": 500,
            }
        )
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AudioLLM(SpeechEncoder(GlobalCMVN(torch.randn(80), torch.rand(80) + 0.5), **train["encoder_conf"]))
        with torch.no_grad():
            for name, tensor in model.state_dict().items():
                if not torch.any(tensor) or torch.all(tensor == 1):  # LayerNorms start at 0 and 1
                    tensor.add_(torch.randn(tensor.shape) * 0.02)
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items() if cmvn_in_checkpoint or "global_cmvn" not in k}
    state |= {  # the rest of the audio LLM, which the encoder must leave alone
        "adpter.conv1d2.weight": torch.randn(128, 64, 5, dtype=torch.bfloat16),
        "adpter.project.weight": torch.randn(96, 128, dtype=torch.bfloat16),
        "task_embeddings.weight": torch.randn(20, 96, dtype=torch.bfloat16),
        "prompt_embeddings.weight": torch.randn(25, 96, dtype=torch.bfloat16),
        "predictor_head.weight": torch.randn(4, 96, dtype=torch.bfloat16),
    }
    torch.save(state, folder / "final.pt")
    return folder


def feats(chunks: int = CHUNKS, seed: int = 1) -> torch.Tensor:
    return torch.randn(1, chunks * 16, 80, generator=torch.Generator().manual_seed(seed)) * 4 + 8


@torch.no_grad()
def stock_calls(encoder, x: torch.Tensor):
    """Per call of `encoder.infer`: output, buffer list, next pe_index (the vendor port's driver's input)."""
    c = encoder.config
    window = x.new_zeros(1, c.chunk_frames + c.chunk_overlap, x.size(2))
    buffer, pe_index, calls = encoder.init_buffers(), encoder.init_pe_index(), []
    for new_frames in x.split(c.chunk_frames, dim=1):
        window = torch.cat([window[:, -c.chunk_overlap :], new_frames], dim=1)
        out, buffer, pe_index = encoder.infer(window, buffer, pe_index)
        calls.append((out, buffer, int(pe_index)))
    return calls


def assert_same_stream(ours, vendor) -> None:
    assert len(ours) == len(vendor)
    for (out, buffer, pe_index), (v_out, v_buffer, v_pe_index) in zip(ours, vendor, strict=True):
        assert torch.equal(out, v_out)
        assert pe_index == v_pe_index
        assert all(torch.equal(a, b) for kv, v_kv in zip(buffer, v_buffer, strict=True) for a, b in zip(kv, v_kv, strict=True))


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    root = tmp_path_factory.mktemp("freeze_omni")
    write_release(root, train_yaml())
    return root


def test_the_published_train_yaml_configures_the_released_encoder():
    config = encoder_config(yaml.safe_load(RELEASED_TRAIN_YAML))
    assert config == FreezeOmniEncoderConfig.released()
    assert (config.feed_forward, config.left_chunks, config.normalize_before, config.concat_after, config.pos_enc) == (
        "linear",
        16,
        True,
        False,
        "rel-enc",
    )


def test_at_full_size_the_encoder_has_the_vendors_470_keys():
    train = yaml.safe_load(RELEASED_TRAIN_YAML)
    with torch.device("meta"):
        ours = FreezeOmniEncoder(encoder_config(train)).state_dict()
        vendor = AudioLLM(SpeechEncoder(GlobalCMVN(torch.zeros(80), torch.ones(80)), **train["encoder_conf"])).state_dict()
    assert {"encoder." + k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in vendor.items()}
    assert len(ours) == 470
    assert sorted(k for k in ours if ".feed_forward.w_1." in k) == sorted(
        f"enc.1.encoders.{i}.feed_forward.w_1.{p}" for i in range(24) for p in ("weight", "bias")
    )


def test_loaded_weights_stream_bit_identically_to_the_vendor_code(release):
    encoder = load_encoder(release)
    vendor = load_vendor_encoder(release)
    x = feats()
    assert_same_stream(stock_calls(encoder, x), stream(vendor, x))
    assert all(p.dtype == torch.float32 for p in encoder.state_dict().values())


def test_the_transformed_loaded_encoder_streams_bit_identically_to_the_vendor_code(release):
    encoder = load_encoder(release)
    transformed, report = transform(encoder, encoder_contract(encoder.config))
    x = feats(seed=2)
    vendor = [out for out, _, _ in stream(load_vendor_encoder(release), x)]
    for _ in range(2):  # two utterances: the second starts from the carries' reset
        got = stream_utterance(transformed, x)
        assert all(torch.equal(a, b) for a, b in zip(got, vendor, strict=True))
    assert transformed.calls == {class_name(0): 2, class_name(4): 2, class_name(8): 2, class_name(12): 2 * (CHUNKS - 3)}
    assert {name: tuple(carry.buffer.shape) for name, carry in report.carries.items()} == {
        "attention_kv": (2, 2, 1, 4, 16, 16)
    }  # 2 blocks, keys and values, 4 heads, 4 x (3 + 1) frames, d_k 16
    # The linear feed-forward's buffer list is [kv_0, kv_1]: layer l's keys and values at buffer.l.0 and buffer.l.1.
    assert sorted(transformed.carries) == [f"buffer.{layer}.{part}" for layer in (0, 1) for part in (0, 1)]
    assert report.operators["encoder_chunk"].counters.as_dict() == {
        "calls": 2 * CHUNKS,
        "graph_calls": 2 * CHUNKS,
        "verified": 2 * 4,
        "stock": 0,
        "adopted": 0,
        "stock_by_reason": {},
    }


def test_post_norm_and_concat_after_stream_bit_identically_to_the_vendor_code(tmp_path):
    write_release(tmp_path, train_yaml(2, {"transformer-normalize-before": False, "transformer-concat-after": True}), seed=3)
    encoder = load_encoder(tmp_path)
    assert (encoder.config.normalize_before, encoder.config.concat_after) == (False, True)
    assert_same_stream(stock_calls(encoder, feats(5)), stream(load_vendor_encoder(tmp_path), feats(5)))


def test_cmvn_comes_from_global_cmvn_when_the_checkpoint_has_none(tmp_path):
    write_release(tmp_path, train_yaml(), cmvn_in_checkpoint=False)
    encoder, vendor = load_encoder(tmp_path), load_vendor_encoder(tmp_path)
    assert torch.equal(encoder.global_cmvn.mean, vendor.global_cmvn.mean)
    assert torch.equal(encoder.global_cmvn.istd, vendor.global_cmvn.istd)
    assert_same_stream(stock_calls(encoder, feats(2)), stream(vendor, feats(2)))


def test_a_clone_of_the_hub_repository_loads_from_its_root(tmp_path, release):
    clone = tmp_path / "Freeze-Omni"
    (clone / "checkpoints").mkdir(parents=True)
    (clone / "checkpoints" / "audiollm").symlink_to(release / "audiollm")
    pairs = zip(load_encoder(clone).state_dict().values(), load_encoder(release).state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def test_loading_leaves_the_global_rng_alone(release):
    state = torch.get_rng_state()
    load_encoder(release)
    assert torch.equal(torch.get_rng_state(), state)


def test_a_conv_feed_forward_config_against_linear_weights_names_every_key(tmp_path):
    folder = write_release(tmp_path, train_yaml())
    wrong = train_yaml(
        3, {"transformer-positionwise-layer-type": "conv1d-linear", "transformer-positionwise-conv-kernel_size": 3}
    )
    (folder / "train.yaml").write_text(yaml.safe_dump(wrong))
    layers = (0, 1)
    missing = [f"encoder.enc.1.encoders.{i}.feed_forward.w_1.{j}.{p}" for i in layers for j in (0, 1) for p in ("bias", "weight")]
    unexpected = [f"encoder.enc.1.encoders.{i}.feed_forward.w_1.{p}" for i in layers for p in ("bias", "weight")]
    message = (
        f"{folder / 'final.pt'}: its encoder.* entries do not match the encoder that train.yaml configures "
        f"(2 blocks, conv1d-linear feed-forward): missing {missing}, unexpected {unexpected}"
    )
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_encoder(tmp_path)


def test_a_checkpoint_without_cmvn_and_without_global_cmvn_is_refused(tmp_path):
    folder = write_release(tmp_path, train_yaml(), cmvn_in_checkpoint=False)
    (folder / "global_cmvn").unlink()
    with pytest.raises(
        CheckpointError,
        match=re.escape(f"{folder / 'final.pt'} has no encoder.global_cmvn.* entries and {folder / 'global_cmvn'} is missing"),
    ):
        load_encoder(tmp_path)


def test_a_weight_of_another_shape_is_refused_naming_the_file(tmp_path):
    folder = write_release(tmp_path, train_yaml())
    state = torch.load(folder / "final.pt")
    state["encoder.enc.1.after_norm.weight"] = torch.ones(32, dtype=torch.bfloat16)
    torch.save(state, folder / "final.pt")
    with pytest.raises(
        CheckpointError,
        match=re.escape(
            f"{folder / 'final.pt'}: Error(s) in loading state_dict for FreezeOmniEncoder:\n\tsize mismatch for "
            "enc.1.after_norm.weight: copying a param with shape torch.Size([32]) from checkpoint, the shape in current "
            "model is torch.Size([64])."
        ),
    ):
        load_encoder(tmp_path)


def test_an_empty_directory_names_the_files_looked_for(tmp_path):
    looked = f"{tmp_path / 'audiollm' / 'final.pt'}, {tmp_path / 'checkpoints' / 'audiollm' / 'final.pt'}"
    with pytest.raises(
        CheckpointError, match=re.escape(f"no Freeze-Omni audio LLM checkpoint under {tmp_path}: looked for {looked}")
    ):
        load_encoder(tmp_path)


def test_a_missing_train_yaml_is_named(tmp_path):
    folder = write_release(tmp_path, train_yaml())
    (folder / "train.yaml").unlink()
    with pytest.raises(CheckpointError, match=re.escape(f"{folder / 'train.yaml'}: missing")):
        load_encoder(tmp_path)


def test_the_hub_release_offline_without_a_cached_copy_says_what_it_looked_for(tmp_path):
    with pytest.raises(CheckpointError) as caught:
        load_encoder(RELEASE_REPO, cache_dir=tmp_path, local_files_only=True)
    assert str(caught.value).startswith(
        "could not fetch checkpoints/audiollm/* (train.yaml, global_cmvn, final.pt: about 750 MB) from the Hugging Face "
        "hub repository 'VITA-MLLM/Freeze-Omni', and no such local directory exists: LocalEntryNotFoundError: "
    )
    assert str(caught.value).endswith("Offline, pass the directory that holds audiollm/final.pt instead")


def test_a_source_that_is_neither_a_directory_nor_a_hub_id_is_refused(tmp_path):
    with pytest.raises(
        CheckpointError,
        match=re.escape(f"{str(tmp_path / 'nowhere')!r} is neither a local directory nor a hub repository id (owner/name)"),
    ):
        load_encoder(str(tmp_path / "nowhere"))


@pytest.mark.parametrize(
    ("entry", "value", "message"),
    [
        ("transformer-pos-enc-class", "abs-enc", "pos_enc 'abs-enc': only 'rel-enc' streams"),
        ("transformer-positionwise-layer-type", "conv1d", "feed_forward 'conv1d': expected one of ('linear', 'conv1d-linear')"),
        ("transformer-left_chunks", -1, "left_chunks -1: a streaming encoder attends to at least one left chunk"),
        ("transformer-chunk_size", 8, "transformer-chunk_size is 8, expected 4"),
    ],
)
def test_an_option_the_streaming_path_cannot_run_is_refused(entry, value, message):
    train = copy.deepcopy(yaml.safe_load(RELEASED_TRAIN_YAML))
    train["encoder_conf"]["para_conf"]["transformer"][entry] = value
    with pytest.raises(CheckpointError, match=re.escape(f"audiollm/train.yaml: {message}")):
        encoder_config(train, "audiollm/train.yaml")


def test_an_entry_train_yaml_leaves_out_takes_the_vendors_default():
    train = yaml.safe_load(RELEASED_TRAIN_YAML)
    del train["encoder_conf"]["para_conf"]["transformer"]["transformer-pos-enc-class"]  # the vendor's default: abs-enc
    with pytest.raises(CheckpointError, match=re.escape("pos_enc 'abs-enc': only 'rel-enc' streams")):
        encoder_config(train)


def test_a_yes_no_option_that_is_not_a_boolean_is_refused():
    train = yaml.safe_load(RELEASED_TRAIN_YAML)
    train["encoder_conf"]["para_conf"]["transformer"]["transformer-normalize-before"] = "yes please"
    with pytest.raises(
        CheckpointError, match=re.escape("train.yaml: transformer-normalize-before is 'yes please', expected true or false")
    ):
        encoder_config(train)
