"""A Moshi checkpoint directory in the published layout (`kyutai/moshiko-pytorch-bf16`), written
from random-weight models of any size, and the vendor's own loading of such a directory: what the
checkpoint tests compare cadence-fx against."""

from __future__ import annotations

import io
import json
from pathlib import Path

import sentencepiece
import torch
from moshi.models import loaders
from safetensors.torch import load_file, save_file

from cadence_fx.models.moshi_stream import MoshiConfig, MoshiModels
from cadence_fx.models.moshi_tokenizer import padded_tokenizer

MIMI_CONFIG_NAME = "mimi_config.json"  # named by config.json's mimi_config_name, as the vendor reads it


def _text_tokenizer(card: int) -> bytes:
    """A SentencePiece model trained on a few lines, padded to a piece per id of the LM's text
    vocabulary (`card`), as the published `tokenizer_spm_32k_3.model` has one."""
    lines = ["moshi listens and speaks at once", "a duplex model keeps its clock", "eighty milliseconds a frame"] * 8
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        vocab_size=40,
        hard_vocab_limit=False,
        minloglevel=2,
        num_threads=1,
    )
    return padded_tokenizer(model.getvalue(), card)


def write_checkpoint(directory: Path, models: MoshiModels) -> Path:
    """The LM's state dict in bfloat16 (as published) in `model.safetensors`, Mimi's in float32 in
    `tokenizer-e351c8d8-checkpoint125.safetensors`, a text tokenizer in `tokenizer_spm_32k_3.model`,
    and, for a size other than the vendor's default, `config.json` (the LM's keyword arguments and
    `mimi_config_name`) with Mimi's configuration beside it."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in models.lm.state_dict().items()}, directory / loaders.MOSHI_NAME)
    save_file({k: v.contiguous() for k, v in models.mimi.state_dict().items()}, directory / loaders.MIMI_NAME)
    (directory / loaders.TEXT_TOKENIZER_NAME).write_bytes(_text_tokenizer(models.lm.text_card))
    config = models.config
    if config.lm_kwargs is not loaders._lm_kwargs or config.mimi is not loaders._mimi_config:
        (directory / "config.json").write_text(json.dumps(config.lm_kwargs | {"mimi_config_name": MIMI_CONFIG_NAME}))
        (directory / MIMI_CONFIG_NAME).write_text(json.dumps(config.mimi))
    return directory


def vendor_models(directory: Path, config: MoshiConfig, device: str = "cpu") -> MoshiModels:
    """The directory loaded by the vendor's functions themselves, called as `CheckpointInfo` calls
    them (`get_mimi` with the LM's codebook count, `get_moshi_lm` in `config.lm_dtype`)."""
    raw = json.loads((directory / "config.json").read_text())
    lm_kwargs = {k: v for k, v in raw.items() if k != "mimi_config_name"}
    mimi_config = json.loads((directory / raw["mimi_config_name"]).read_text())
    codebooks = max(lm_kwargs["dep_q"], lm_kwargs["n_q"] - lm_kwargs["dep_q"])
    mimi = loaders.get_mimi(directory / loaders.MIMI_NAME, mimi_config, device=device, num_codebooks=codebooks)
    lm = loaders.get_moshi_lm(directory / loaders.MOSHI_NAME, lm_kwargs=lm_kwargs, device=device, dtype=config.lm_dtype)
    return MoshiModels(mimi=mimi, lm=lm, config=config)


def stored(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(LM tensors, Mimi tensors) as the files hold them."""
    return load_file(directory / loaders.MOSHI_NAME), load_file(directory / loaders.MIMI_NAME)
