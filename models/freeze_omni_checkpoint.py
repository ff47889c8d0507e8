"""A released Freeze-Omni speech encoder, loaded from its checkpoint files.

The release is the Hugging Face repository `VITA-MLLM/Freeze-Omni`; its folder `checkpoints/` is
what the vendor's scripts take as `--model_path`, and the audio LLM's files lie in `audiollm/`:

- `train.yaml`: the training configuration. Its `encoder_conf` (`overview_conf` and the
  `para_conf` of the `subsampling` and `transformer` components) defines the encoder; keys it
  leaves out take the defaults of the vendor's argument parsers, as in `speechEncoder`.
- `global_cmvn`: JSON fbank statistics (`mean_stat`, `var_stat`, `frame_num`), which the vendor's
  `inferencePipeline` always turns into the encoder's `GlobalCMVN` (float64 arithmetic, then
  float32).
- `final.pt`: a torch state dict of the whole audio LLM except the frozen LLM: the encoder under
  `encoder.`, the adapter under `adpter.`, the prompt and task embeddings and the state head. The
  published file is 752,396,798 bytes (its LFS pointer in a public mirror); those modules hold
  375,961,764 values at the released size, 751,923,528 bytes at 2 bytes each, the rest being the
  archive's per-entry records: the weights are stored in 16 bits (`train.yaml`: `ds_dtype: bf16`).

The vendor loads `final.pt` with `load_state_dict(strict=False)` after building the CMVN from
`global_cmvn`, so the checkpoint's CMVN entries, when present, win, and a missing or misnamed
weight passes unnoticed. `load_encoder` does the same loading but strictly: every `encoder.` entry
must be a parameter or buffer of the encoder the configuration builds, and every one of those
must be in the file (the CMVN statistics may come from `global_cmvn` instead). Weights are copied
into a float32 encoder, as the vendor's are.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path

import torch
import yaml

from .freeze_omni_encoder import FreezeOmniEncoder, FreezeOmniEncoderConfig

__all__ = ["RELEASE_REPO", "CheckpointError", "encoder_config", "load_encoder", "read_cmvn"]

#: The Hugging Face repository of the release, and its folder that holds `audiollm/`.
RELEASE_REPO = "VITA-MLLM/Freeze-Omni"
RELEASE_FOLDER = "checkpoints"

PREFIX = "encoder."  # the encoder's entries in final.pt
CMVN_KEYS = ("global_cmvn.mean", "global_cmvn.istd")

# Defaults of the vendor's parsers (`add_encoder_args`, `Transformer.add_arguments`,
# `Subsampling.add_arguments`) for the entries read here: a key missing from train.yaml gets these.
_OVERVIEW_DEFAULTS = {"encoder-layer-config": "tdnn-dtc", "encoder-input-dim": 256, "encoder-output-dim": 256}
_SUBSAMPLING_DEFAULTS = {"subsampling-rate": 4, "subsampling-input-dim": 256, "subsampling-output-dim": 256}
_TRANSFORMER_DEFAULTS = {
    "transformer-input-dim": 256,
    "transformer-output-dim": 4,
    "transformer-attention-dim": 256,
    "transformer-attention-heads": 4,
    "transformer-linear-units": 1024,
    "transformer-num-blocks": 6,
    "transformer-input-layer": "linear",
    "transformer-pos-enc-class": "abs-enc",
    "transformer-normalize-before": True,
    "transformer-concat-after": False,
    "transformer-positionwise-layer-type": "linear",
    "transformer-positionwise-conv-kernel_size": 1,
    "transformer-chunk_size": -1,
    "transformer-left_chunks": -1,
}
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class CheckpointError(ValueError):
    """A checkpoint that cannot be found or does not fit the encoder; the message names the file."""


def encoder_config(train: Mapping, source: str = "train.yaml") -> FreezeOmniEncoderConfig:
    """The encoder configuration a parsed `train.yaml` describes (`source` names it in errors)."""
    try:
        conf = train["encoder_conf"]
        overview = {**_OVERVIEW_DEFAULTS, **(conf.get("overview_conf") or {})}
        para = conf.get("para_conf") or {}
        sub = {**_SUBSAMPLING_DEFAULTS, **(para.get("subsampling") or {})}
        tr = {**_TRANSFORMER_DEFAULTS, **(para.get("transformer") or {})}
        input_dim = train["input_dim"]
    except (KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(
            f"{source}: no encoder configuration (expected input_dim and encoder_conf with overview_conf and para_conf): {exc!r}"
        ) from exc

    def require(entry: str, actual, expected, why: str) -> None:
        if actual != expected:
            raise CheckpointError(f"{source}: {entry} is {actual!r}, expected {expected!r} ({why})")

    d = tr["transformer-attention-dim"]
    require(
        "encoder-layer-config",
        overview["encoder-layer-config"],
        "subsampling-transformer",
        "the streaming encoder is 4x subsampling then a chunk transformer",
    )
    require("subsampling-rate", sub["subsampling-rate"], 4, "the only subsampling the vendor builds")
    require("subsampling-input-dim", sub["subsampling-input-dim"], input_dim, "the fbank bins, input_dim")
    require("encoder-input-dim", overview["encoder-input-dim"], input_dim, "the fbank bins, input_dim")
    require("subsampling-output-dim", sub["subsampling-output-dim"], d, "the transformer's attention-dim")
    require("transformer-input-dim", tr["transformer-input-dim"], d, "the transformer's attention-dim")
    require("transformer-input-layer", tr["transformer-input-layer"], "linear", "the embedding this encoder builds")
    for entry in ("transformer-normalize-before", "transformer-concat-after"):
        if not isinstance(tr[entry], bool):
            raise CheckpointError(f"{source}: {entry} is {tr[entry]!r}, expected true or false")
    feed_forward = tr["transformer-positionwise-layer-type"]
    try:
        config = FreezeOmniEncoderConfig(
            input_dim=input_dim,
            attention_dim=d,
            attention_heads=tr["transformer-attention-heads"],
            linear_units=tr["transformer-linear-units"],
            num_blocks=tr["transformer-num-blocks"],
            feed_forward=feed_forward,
            left_chunks=tr["transformer-left_chunks"],
            normalize_before=tr["transformer-normalize-before"],
            concat_after=tr["transformer-concat-after"],
            pos_enc=tr["transformer-pos-enc-class"],
            **({"conv_kernel_size": tr["transformer-positionwise-conv-kernel_size"]} if feed_forward == "conv1d-linear" else {}),
        )
    except ValueError as exc:
        raise CheckpointError(f"{source}: {exc}") from exc
    require(
        "transformer-chunk_size",
        tr["transformer-chunk_size"],
        config.chunk_size,
        f"the encoder frames that {config.chunk_frames} + {config.chunk_overlap} fbank frames a call give",
    )
    return config


def read_cmvn(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, istd) from a JSON `global_cmvn`, computed as the vendor does: per bin, in float64,
    mean = sum / n and istd = 1 / sqrt(max(sum_sq / n - mean^2, 1e-20)), then cast to float32."""
    try:
        stats = json.loads(path.read_text())
        count = stats["frame_num"]
        means = [m / count for m in stats["mean_stat"]]
        istd = [1.0 / math.sqrt(max(v / count - m * m, 1.0e-20)) for v, m in zip(stats["var_stat"], means, strict=True)]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: not a JSON CMVN file with mean_stat, var_stat and frame_num: {exc!r}") from exc
    return (torch.tensor(means, dtype=torch.float64).float(), torch.tensor(istd, dtype=torch.float64).float())


def _download(repo: str, cache_dir: str | Path | None, local_files_only: bool) -> Path:
    from huggingface_hub import snapshot_download

    pattern = f"{RELEASE_FOLDER}/audiollm/*"
    try:
        snapshot = snapshot_download(repo, allow_patterns=[pattern], cache_dir=cache_dir, local_files_only=local_files_only)
    except Exception as exc:  # offline, no access, no such repo: the hub client's errors have no common base
        raise CheckpointError(
            f"could not fetch {pattern} (train.yaml, global_cmvn, final.pt: about 750 MB) from the Hugging Face "
            f"hub repository {repo!r}, and no such local directory exists: {type(exc).__name__}: {exc}. "
            f"Offline, pass the directory that holds audiollm/final.pt instead"
        ) from exc
    return Path(snapshot) / RELEASE_FOLDER


def _audiollm(root: Path) -> Path:
    """The `audiollm` folder under `root`: the vendor's `--model_path`, or a clone of the hub repo."""
    candidates = (root / "audiollm", root / RELEASE_FOLDER / "audiollm")
    for folder in candidates:
        if (folder / "final.pt").is_file():
            return folder
    looked = ", ".join(str(folder / "final.pt") for folder in candidates)
    raise CheckpointError(f"no Freeze-Omni audio LLM checkpoint under {root}: looked for {looked}")


def _locate(source: str | Path, cache_dir: str | Path | None, local_files_only: bool) -> Path:
    path = Path(source).expanduser()
    if path.is_dir():
        return _audiollm(path)
    if path.exists():
        raise CheckpointError(f"{path} is a file: pass the directory that holds audiollm/final.pt (the vendor's --model_path)")
    if _HUB_ID.fullmatch(str(source)):
        return _audiollm(_download(str(source), cache_dir, local_files_only))
    raise CheckpointError(f"{source!r} is neither a local directory nor a hub repository id (owner/name)")


def _encoder_state(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch.load raises what the unpickler or the archive reader raise
        raise CheckpointError(f"{path}: not a torch checkpoint: {type(exc).__name__}: {exc}") from exc
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: expected a state dict of tensors (the vendor's final.pt), got {type(state).__name__}")
    return {key[len(PREFIX) :]: value for key, value in state.items() if key.startswith(PREFIX)}


@torch.no_grad()
def load_encoder(source: str | Path, *, cache_dir: str | Path | None = None, local_files_only: bool = False) -> FreezeOmniEncoder:
    """The released encoder in eval mode, from `source`: a local directory (the vendor's
    `--model_path`, holding `audiollm/`, or a clone of the hub repository) or a hub repository id
    such as `RELEASE_REPO`, whose `checkpoints/audiollm/` is fetched into the hub cache
    (`cache_dir`; `local_files_only` uses the cache alone). The global RNG is left as it was."""
    folder = _locate(source, cache_dir, local_files_only)
    train_yaml, cmvn_file, weights = folder / "train.yaml", folder / "global_cmvn", folder / "final.pt"
    if not train_yaml.is_file():
        raise CheckpointError(f"{train_yaml}: missing (the encoder's configuration, beside {weights.name})")
    try:
        train = yaml.safe_load(train_yaml.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise CheckpointError(f"{train_yaml}: unreadable: {exc}") from exc
    config = encoder_config(train, str(train_yaml))
    with torch.random.fork_rng(devices=[]):
        encoder = FreezeOmniEncoder(config)
    state = _encoder_state(weights)
    expected = set(encoder.state_dict())
    present_cmvn = [key for key in CMVN_KEYS if key in state]
    if not present_cmvn:
        if not cmvn_file.is_file():
            raise CheckpointError(
                f"{weights} has no {PREFIX}global_cmvn.* entries and {cmvn_file} is missing: "
                "the encoder's CMVN statistics come from one or the other"
            )
        state.update(zip(CMVN_KEYS, read_cmvn(cmvn_file)))
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{weights}: its {PREFIX}* entries do not match the encoder that {train_yaml.name} configures "
            f"({config.num_blocks} blocks, {config.feed_forward} feed-forward): "
            f"missing {[PREFIX + k for k in missing]}, unexpected {[PREFIX + k for k in unexpected]}"
        )
    try:
        encoder.load_state_dict(state, strict=True)
    except RuntimeError as exc:  # the keys match, so a shape does not
        raise CheckpointError(f"{weights}: {exc}") from exc
    return encoder.eval()
