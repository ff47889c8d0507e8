"""PersonaPlex's released checkpoint layout (`models/personaplex_checkpoint.py`), tested with
checkpoints written here in that layout from the tiny random-weight build: the LM in bfloat16 in
`model.safetensors` (as released), Mimi in `tokenizer-e351c8d8-checkpoint125.safetensors`, a
SentencePiece model in `tokenizer_spm_32k_3.model`, and `voices.tgz` holding `voices/ADA.pt`, the
embeddings the vendor saves from a WAV. The reference is the vendor's own loaders on the same files
(`get_mimi`, `get_moshi_lm`, with the loaders' sizes set to the tiny ones) and its own session with
the voice's embeddings (`load_voice_prompt_embeddings`)."""

from __future__ import annotations

import pytest
import torch
from personaplex_kit import ROLE, speechlike, write_checkpoint

from cadence_fx.models import personaplex, personaplex_stream
from cadence_fx.models.personaplex_checkpoint import PersonaPlexCheckpoint, _sizes

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("personaplex-7b-v1")
    write_checkpoint(folder, personaplex_stream.build_models(personaplex_stream.TINY))
    return folder


def test_the_released_layout_loads_as_the_vendor_loads_it(checkpoint):
    found = PersonaPlexCheckpoint.locate(checkpoint)
    assert found.voices == checkpoint / "voices" and sorted(p.name for p in found.voices.iterdir()) == ["ADA.pt"]
    loaded = found.load(personaplex_stream.TINY)
    with _sizes(personaplex_stream.TINY) as loaders:
        mimi = loaders.get_mimi(checkpoint / "tokenizer-e351c8d8-checkpoint125.safetensors", "cpu")
        lm = loaders.get_moshi_lm(str(checkpoint / "model.safetensors"), device="cpu", dtype=torch.float32)
    for ours, theirs in ((loaded.mimi, mimi), (loaded.lm, lm)):
        ours, theirs = ours.state_dict(), theirs.state_dict()
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    # The loaders' own sizes are back: the full model's.
    assert personaplex._vendor("models.loaders")._lm_kwargs["dim"] == 4096
    # The role through the checkpoint's tokenizer, a voice from the checkpoint's voices: a session of
    # the loaded models is the vendor's own on the models it loads.
    tokens = found.tokenize(ROLE)
    assert tokens and max(tokens) < 120
    user = speechlike(4 * 1920 / 24_000, seed=2)[None]
    kwargs = dict(seed=0, text_prompt_tokens=tokens)
    voice = str(found.voices / "ADA.pt")
    gen = personaplex_stream.lm_gen(loaded.lm, sampling=True)
    with personaplex._vendor("utils.compile").no_compile(), loaded.mimi.streaming(1), gen.streaming(1):
        ours = personaplex_stream.vendor_loop(loaded.mimi, gen, user, voice_prompt_embeddings=voice, **kwargs)
    reference = personaplex_stream.PersonaPlexModels(mimi=mimi, lm=lm, config=personaplex_stream.TINY)
    gen = personaplex_stream.lm_gen(lm, sampling=True)
    with personaplex._vendor("utils.compile").no_compile(), mimi.streaming(1), gen.streaming(1):
        theirs = personaplex_stream.vendor_loop(reference.mimi, gen, user, voice_prompt_embeddings=voice, **kwargs)
    assert torch.equal(ours.tokens, theirs.tokens) and torch.equal(ours.pcm, theirs.pcm)


def test_a_checkpoint_that_does_not_fit_is_refused_by_name(checkpoint, tmp_path):
    with pytest.raises(
        ValueError,
        match=r"PersonaPlex checkpoint '.*' has no tokenizer_spm_32k_3.model \(the layout "
        r"of nvidia/personaplex-7b-v1: model.safetensors, "
        r"tokenizer-e351c8d8-checkpoint125.safetensors, tokenizer_spm_32k_3.model, "
        r"voices.tgz\)",
    ):
        for name in ("model.safetensors", "tokenizer-e351c8d8-checkpoint125.safetensors"):
            (tmp_path / name).write_bytes((checkpoint / name).read_bytes())
        PersonaPlexCheckpoint.locate(tmp_path)
    tiny = personaplex_stream.TINY
    wider = dict(tiny.lm_kwargs, dim=64)
    config = personaplex_stream.PersonaPlexConfig(tiny.seanet, tiny.quantizer, tiny.transformer, wider, torch.float32)
    with pytest.raises(ValueError, match=r"is not at this configuration's sizes: size mismatch for "):
        PersonaPlexCheckpoint.locate(checkpoint).load(config)
