"""Published Moshi checkpoints, from a local directory or a Hugging Face hub repo id, loaded with
the vendor's own loaders (`moshi.models.loaders`).

The layout is the one `kyutai/moshiko-pytorch-bf16` and `kyutai/moshika-pytorch-bf16` publish and
`loaders.CheckpointInfo.from_hf_repo` reads:

==============================================  ==============================================
file                                            what it holds
==============================================  ==============================================
`model.safetensors`                             the LM (`LMModel.state_dict()`), bfloat16
`tokenizer-e351c8d8-checkpoint125.safetensors`  Mimi (`MimiModel.state_dict()`), float32
`tokenizer_spm_32k_3.model`                     the SentencePiece text tokenizer
`config.json` (optional)                        the LM's keyword arguments, plus the vendor's
                                                `moshi_name`, `mimi_name`, `tokenizer_name`,
                                                `mimi_config_name` (a JSON file of Mimi's
                                                configuration), `model_type`, `lora_name`, ...
==============================================  ==============================================

Without `config.json` the vendor builds Moshi 7B with Mimi as shipped (`loaders._lm_kwargs`,
`loaders._mimi_config`, which `moshi_stream.FULL` is); with it, the sizes it declares. The file
names inside `config.json` override the defaults above, exactly as `from_hf_repo` reads them.

A hub repo id goes through `CheckpointInfo.from_hf_repo` (it downloads into the Hugging Face cache,
or finds the files there). A local directory goes through the same parse of its `config.json` with
every file given as a local path (or, without `config.json`, the vendor's default names), so no
hub call is made. Either way the models come from `CheckpointInfo.get_mimi` / `get_moshi`
(`loaders.get_mimi` / `get_moshi_lm`: strict state-dict loading; the LM's floating tensors cast to
the requested dtype).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from moshi.models import loaders

from .moshi_stream import MoshiConfig, MoshiModels

__all__ = [
    "CONFIG_NAME",
    "CheckpointNotFound",
    "CheckpointUnsupported",
    "MoshiCheckpoint",
    "locate",
]

CONFIG_NAME = "config.json"
_PATH_FIELDS = ("moshi_weights", "mimi_weights", "tokenizer", "lora_weights")
# A hub repo id is `owner/name`; anything else that is not a directory here is a path that is missing.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class CheckpointNotFound(FileNotFoundError):
    """The checkpoint's files are neither in the directory named nor obtainable from the hub."""


class CheckpointUnsupported(ValueError):
    """The checkpoint is not a plain Moshi speech-to-speech model (LoRA, conditioned, TTS, ...)."""


@dataclass(frozen=True)
class MoshiCheckpoint:
    """Where a checkpoint's files lie on this machine (`info`, the vendor's `CheckpointInfo`) and
    what the user named (`source`: a directory or a hub repo id)."""

    source: str
    info: loaders.CheckpointInfo

    def config(self, lm_dtype: torch.dtype = torch.bfloat16) -> MoshiConfig:
        """The sizes this checkpoint builds (its `config.json`, else the vendor's 7B defaults)."""
        info = self.info  # None, as get_mimi and get_moshi_lm read it: the vendor's defaults
        return MoshiConfig(
            mimi=loaders._mimi_config if info.mimi_config is None else info.mimi_config,
            lm_kwargs=loaders._lm_kwargs if info.lm_config is None else info.lm_config,
            lm_dtype=lm_dtype,
        )

    @torch.no_grad()
    def load(self, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16) -> MoshiModels:
        """Mimi and the LM with this checkpoint's weights, by the vendor's loaders; the LM in `dtype`
        (the published LM is bfloat16, the vendor's default), Mimi as stored (float32)."""
        mimi = self.info.get_mimi(device=device)
        lm = self.info.get_moshi(device=device, dtype=dtype)
        return MoshiModels(mimi=mimi, lm=lm, config=self.config(dtype))

    def differences(self, config: MoshiConfig) -> list[str]:
        """Each setting of `config` (LM keyword arguments, Mimi configuration) that this checkpoint
        does not share, as `name: checkpoint value (expected value)`; empty when it builds the
        same model. Settings only the checkpoint declares (`conditioners: {}`, `depformer_causal`)
        are not compared: `config` sizes the contract, and the transform checks the model built
        from the checkpoint against that contract."""
        own = self.config()
        return _differences("lm", own.lm_kwargs, config.lm_kwargs) + _differences("mimi", own.mimi, config.mimi)

    def to_json(self) -> dict[str, Any]:
        """For a worker process, which loads the very files located here (no second hub lookup)."""
        info = {key: str(value) if isinstance(value, Path) else value for key, value in vars(self.info).items()}
        return {"source": self.source, "info": info}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MoshiCheckpoint:
        fields: dict[str, Any] = {
            key: Path(value) if key in _PATH_FIELDS and value is not None else value for key, value in data["info"].items()
        }
        return cls(data["source"], loaders.CheckpointInfo(**fields))


_ABSENT = "<absent>"


def _differences(prefix: str, own: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    out = []
    for key, want in expected.items():
        got = own.get(key, _ABSENT)
        if isinstance(want, dict) and isinstance(got, dict):
            out += _differences(f"{prefix}.{key}", got, want)
        elif got != want:
            out.append(f"{prefix}.{key}: {got!r} ({want!r})")
    return out


def locate(source: str | Path) -> MoshiCheckpoint:
    """The checkpoint at `source`: an existing local directory, else a hub repo id (`owner/name`),
    downloaded into the Hugging Face cache unless already there. Raises `CheckpointNotFound`
    naming the directory or repo and every file looked for, and `CheckpointUnsupported` for a
    checkpoint that is not a plain Moshi model."""
    text = str(source)
    path = Path(text).expanduser()
    if path.is_dir():
        return _from_directory(text, path)
    if path.exists():
        raise CheckpointNotFound(
            f"Moshi checkpoint {text!r} is a file; expected a directory holding {_listing()} "
            "or a Hugging Face hub repo id such as kyutai/moshiko-pytorch-bf16"
        )
    if not _REPO_ID.fullmatch(text):
        raise CheckpointNotFound(
            f"Moshi checkpoint {text!r}: no such directory, and not a hub repo id (owner/name); "
            f"expected a directory holding {_listing()} or a repo id such as "
            "kyutai/moshiko-pytorch-bf16"
        )
    return _from_hub(text)


def _listing(names: dict[str, str] | None = None) -> str:
    names = names or _names({})
    return f"{CONFIG_NAME} (optional), " + ", ".join(names.values())


def _names(raw: dict[str, Any]) -> dict[str, str]:
    """The files a checkpoint with this `config.json` content consists of, as `from_hf_repo` names
    them (the keys are `from_hf_repo`'s arguments)."""
    names = {
        "moshi_weights": raw.get("moshi_name", loaders.MOSHI_NAME),
        "mimi_weights": raw.get("mimi_name", loaders.MIMI_NAME),
        "tokenizer": raw.get("tokenizer_name", loaders.TEXT_TOKENIZER_NAME),
    }
    if "mimi_config_name" in raw:
        names["mimi_config_path"] = raw["mimi_config_name"]
    return names


def _read_config(path: Path, where: str) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointUnsupported(f"{where}: {CONFIG_NAME} is not JSON ({error})") from None
    if not isinstance(raw, dict):
        raise CheckpointUnsupported(
            f"{where}: {CONFIG_NAME} holds a {type(raw).__name__}; expected an object of the LM's keyword arguments"
        )
    return raw


def _check_supported(raw: dict[str, Any], where: str) -> None:
    """Fail closed on what the Moshi adapter does not drive: another program than Moshi's
    (`model_type` hibiki, stt, tts...), LoRA adapters (the vendor leaves them unfused), a condition
    fuser (`LMGen` then needs condition tensors on every step)."""
    problems = []
    if raw.get("model_type", "moshi") != "moshi":
        problems.append(f"model_type is {raw['model_type']!r}, not 'moshi'")
    if raw.get("lora") or raw.get("lora_name"):
        problems.append("it carries LoRA weights (lora / lora_name)")
    if raw.get("fuser") is not None:
        problems.append("it is conditioned (fuser), so every step needs condition tensors")
    if problems:
        raise CheckpointUnsupported(f"{where}: not a plain Moshi checkpoint: {'; '.join(problems)}")


def _from_directory(source: str, directory: Path) -> MoshiCheckpoint:
    config_path = directory / CONFIG_NAME
    where = f"Moshi checkpoint directory {str(directory)!r}"
    raw = _read_config(config_path, where) if config_path.is_file() else {}
    _check_supported(raw, where)
    names = _names(raw)
    missing = [name for name in names.values() if not (directory / name).is_file()]
    if missing:
        looked = ", ".join(f"{name} ({'missing' if name in missing else 'found'})" for name in names.values())
        config = f"{CONFIG_NAME} ({'found' if config_path.is_file() else 'absent: the 7B defaults'})"
        raise CheckpointNotFound(f"{where} lacks {', '.join(missing)}; looked for {config}, {looked}")
    paths = {key: directory / name for key, name in names.items()}
    if not config_path.is_file():
        # What from_hf_repo builds for a repository without config.json (it would ask the hub for one).
        return MoshiCheckpoint(source, loaders.CheckpointInfo(paths["moshi_weights"], paths["mimi_weights"], paths["tokenizer"]))
    # Every file is given as a local path, so from_hf_repo never uses the repo argument.
    info = loaders.CheckpointInfo.from_hf_repo(
        str(directory),
        moshi_weights=paths["moshi_weights"],
        mimi_weights=paths["mimi_weights"],
        tokenizer=paths["tokenizer"],
        config_path=config_path,
        mimi_config_path=paths.get("mimi_config_path"),
    )
    return MoshiCheckpoint(source, info)


def _from_hub(repo: str) -> MoshiCheckpoint:
    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError

    where = f"Moshi checkpoint {repo!r}"
    try:
        config_path: str | None
        try:
            config_path = hf_hub_download(repo, CONFIG_NAME)
        except EntryNotFoundError:  # none (or, offline, none cached): from_hf_repo then assumes the 7B layout
            config_path = None
        if config_path is not None:  # checked before the weights are downloaded
            _check_supported(_read_config(Path(config_path), where), where)
        info = loaders.CheckpointInfo.from_hf_repo(repo, config_path=config_path)
    except LocalEntryNotFoundError as error:
        cached = try_to_load_from_cache(repo, CONFIG_NAME)
        names = _names(json.loads(Path(cached).read_text())) if isinstance(cached, str) else _names({})
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub could not be reached"
        raise CheckpointNotFound(
            f"{where} is not a directory here, and as a Hugging Face hub repo it has no complete local copy in "
            f"{constants.HF_HUB_CACHE} and {why}; looked for {_listing(names)}. Download it where the hub is "
            f"reachable (hf download {repo}) or pass a directory holding those files"
        ) from error
    except (RepositoryNotFoundError, EntryNotFoundError) as error:
        raise CheckpointNotFound(
            f"{where}: the hub refused it ({type(error).__name__}: {error}); expected a repo holding {_listing()}"
        ) from error
    return MoshiCheckpoint(repo, info)
