"""PersonaPlex's released checkpoint layout (`nvidia/personaplex-7b-v1`), loaded as the vendor
loads it.

The layout, as the vendor's `server.py` reads it from the hub repository (`loaders.py` names the
files): the LM in `model.safetensors`, Mimi in `tokenizer-e351c8d8-checkpoint125.safetensors`, the
text tokenizer (SentencePiece) in `tokenizer_spm_32k_3.model`, and the voice prompts in
`voices.tgz`, an archive of a `voices/` folder of `<name>.pt` files (saved embeddings, as
`load_voice_prompt_embeddings` reads them), extracted once beside it as the vendor extracts it.

`PersonaPlexCheckpoint.locate(directory)` finds the files (a missing one is refused by name);
`load(config, device)` builds the models with the vendor's own `loaders.get_mimi` and
`loaders.get_moshi_lm` (its depformer expansion and weight copies included), at `config`'s sizes:
those functions read their sizes from the loaders' module-level keyword dictionaries, which
`load` sets to `config`'s for the call and puts back after (`FULL` is what they hold already).
A checkpoint of another size fails in the vendor's `load_state_dict` with the shapes that differ,
and is refused naming the first of them.
"""

from __future__ import annotations

import contextlib
import tarfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .personaplex import _vendor
from .personaplex_stream import PersonaPlexConfig, PersonaPlexModels, role_prompt

__all__ = ["PersonaPlexCheckpoint"]

LM_NAME = "model.safetensors"
MIMI_NAME = "tokenizer-e351c8d8-checkpoint125.safetensors"
TOKENIZER_NAME = "tokenizer_spm_32k_3.model"
VOICES_ARCHIVE = "voices.tgz"

_SIZES = threading.Lock()  # the loaders' module-level sizes are set for one load at a time


@contextlib.contextmanager
def _sizes(config: PersonaPlexConfig) -> Iterator[Any]:
    """The vendor's loaders with `config`'s sizes in their module-level dictionaries, for one call."""
    loaders = _vendor("models.loaders")
    names = {
        "_seanet_kwargs": config.seanet,
        "_quantizer_kwargs": config.quantizer,
        "_transformer_kwargs": config.transformer,
        "_lm_kwargs": config.lm_kwargs,
    }
    with _SIZES:
        saved = {name: getattr(loaders, name) for name in names}
        try:
            for name, value in names.items():
                setattr(loaders, name, dict(value))
            yield loaders
        finally:
            for name, value in saved.items():
                setattr(loaders, name, value)


@dataclass(frozen=True)
class PersonaPlexCheckpoint:
    """A checkpoint directory in the released layout (module docstring)."""

    directory: Path
    lm: Path
    mimi: Path
    tokenizer: Path
    voices: Path | None  # the extracted `voices/` folder, None when the directory has no voices

    @classmethod
    def locate(cls, directory: str | Path) -> PersonaPlexCheckpoint:
        folder = Path(directory)
        if not folder.is_dir():
            raise ValueError(
                f"PersonaPlex checkpoint {str(directory)!r} is not a folder (expected the layout of "
                f"nvidia/personaplex-7b-v1: {LM_NAME}, {MIMI_NAME}, {TOKENIZER_NAME}, {VOICES_ARCHIVE})"
            )
        missing = [name for name in (LM_NAME, MIMI_NAME, TOKENIZER_NAME) if not (folder / name).is_file()]
        if missing:
            raise ValueError(
                f"PersonaPlex checkpoint {str(folder)!r} has no {', '.join(missing)} (the layout of "
                f"nvidia/personaplex-7b-v1: {LM_NAME}, {MIMI_NAME}, {TOKENIZER_NAME}, {VOICES_ARCHIVE})"
            )
        return cls(folder, folder / LM_NAME, folder / MIMI_NAME, folder / TOKENIZER_NAME, _voices(folder))

    def load(self, config: PersonaPlexConfig, device: str | torch.device = "cpu") -> PersonaPlexModels:
        """Mimi and the LM as the vendor's loaders load them, at `config`'s sizes, in `config.lm_dtype`."""
        device = torch.device(device)
        with _sizes(config) as loaders:
            try:
                mimi = loaders.get_mimi(self.mimi, device)
                lm = loaders.get_moshi_lm(str(self.lm), device=device, dtype=config.lm_dtype)
            except RuntimeError as error:
                first = next((line.strip() for line in str(error).splitlines() if "size mismatch" in line), str(error))
                raise ValueError(
                    f"PersonaPlex checkpoint {str(self.directory)!r} is not at this configuration's sizes: {first}"
                ) from None
        unloaded = [name for name, tensor in lm.state_dict().items() if tensor.is_meta]
        if unloaded:  # `get_moshi_lm` loads with strict=False: a key the file lacks stays unallocated
            raise ValueError(
                f"PersonaPlex checkpoint {str(self.lm)!r} lacks {len(unloaded)} of the LM's weights, {unloaded[0]} first"
            )
        return PersonaPlexModels(mimi=mimi, lm=lm, config=config)

    def tokenize(self, text: str) -> list[int]:
        """A role prompt's tokens, as the vendor's server makes them: wrapped in `<system>` tags,
        then encoded with the checkpoint's SentencePiece model."""
        import sentencepiece

        return sentencepiece.SentencePieceProcessor(model_file=str(self.tokenizer)).encode(role_prompt(text))


def _voices(folder: Path) -> Path | None:
    """`voices/`, extracted from `voices.tgz` once (the vendor's `_get_voice_prompt_dir`), or as found."""
    voices = folder / "voices"
    archive = folder / VOICES_ARCHIVE
    if not voices.is_dir() and archive.is_file():
        with tarfile.open(archive, "r:gz") as tar:
            members = [m for m in tar.getmembers() if m.isfile() and m.name.startswith("voices/") and ".." not in m.name]
            tar.extractall(folder, members=members, filter="data")
        if not voices.is_dir():
            raise ValueError(f"PersonaPlex checkpoint {str(folder)!r}: {VOICES_ARCHIVE} holds no voices/ folder")
    return voices if voices.is_dir() else None
