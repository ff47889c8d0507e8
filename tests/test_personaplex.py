"""PersonaPlex (NVIDIA's fine-tune of Moshi) bound as data on the one pipeline (`models/personaplex.py`,
`personaplex_stream.py`, `personaplex_bound.py`).

Its package (Kyutai's `moshi` forked from an older release) is installed as `personaplex_moshi`
beside Kyutai's `moshi` 0.2.13 (`.ci/install`). A tiny random-weight build (`TINY`) streams four
sessions, one after the other, on one transformed model, each compared with `torch.equal` to the
vendor's own loop on the stock models (`stream_reference`): every token of the user phase (text and
the 16 depformer codebooks) and the agent's PCM. Each session steps the vendor's prompt phase as
`offline.py` does (`step_system_prompts`): an optional voice prompt from audio
(`load_voice_prompt`: a wav file read, loudness-normalized, Mimi-encoded and stepped frame by
frame), half a second of silence, the text role prompt `<system> ... <system>` token by token, half
a second of silence; then the user's frames.

The role prompt and the audio come from `personaplex_kit.py`.
"""

from __future__ import annotations

import pytest
import torch
from personaplex_kit import ROLE, SILENCE_FRAMES, VOICE_FRAMES, VOICE_SECONDS, role_prompt_tokens, speechlike

from cadence_fx.models import personaplex, personaplex_bound, personaplex_stream
from cadence_fx.models.personaplex import FRAME_SIZE, SAMPLE_RATE

pytestmark = pytest.mark.usefixtures("one_torch_thread")

USER_FRAMES = 6
#: (sampling, voice prompt): a sampled session, a greedy one (the depformer's other mode), one with a
#: voice prompt, and a sampled one again (the graphs serving a session like the first).
SESSIONS = ((True, False), (False, False), (True, True), (True, False))
DEPFORMER = "depformer_step[n=1,L=16]{{self.use_sampling={}, self.temp=0.8, self.top_k=250}}"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The four sessions on one transformed model, each beside the vendor's loop on the stock models."""
    import sphn

    voice = str(tmp_path_factory.mktemp("personaplex") / "voice.wav")
    sphn.write_wav(voice, speechlike(VOICE_SECONDS, seed=1).numpy(), SAMPLE_RATE)
    user = speechlike(USER_FRAMES * FRAME_SIZE / SAMPLE_RATE, seed=2)[None]
    tokens, text = role_prompt_tokens()
    models = personaplex_stream.build_models(personaplex_stream.TINY)
    transformed = personaplex_bound.transform_personaplex(models, personaplex.contract_for(personaplex_stream.TINY))
    outputs = []
    try:
        for seed, (sampling, voiced) in enumerate(SESSIONS):
            kwargs = dict(sampling=sampling, seed=seed, text_prompt_tokens=tokens, voice_prompt=voice if voiced else None)
            expected = personaplex_stream.stream_reference(models, user, **kwargs)
            outputs.append((transformed.stream(user, **kwargs), expected))
        yield transformed.report, outputs, tokens, text
    finally:
        transformed.close()


def test_kyutai_moshi_and_personaplex_import_side_by_side():
    import importlib.metadata

    import moshi
    import moshi.models.lm
    import personaplex_moshi
    import personaplex_moshi.models.lm

    assert importlib.metadata.version("moshi") == "0.2.13"
    assert moshi.__file__ != personaplex_moshi.__file__ and personaplex_moshi.__version__ == "0.1.0"
    # The fork predates Kyutai's slots: no exec mask, and a host-int offset in `LMGen`'s state.
    assert hasattr(moshi.models.lm.LMGen, "set_exec_mask")
    assert not hasattr(personaplex_moshi.models.lm.LMGen, "set_exec_mask")
    # Its modules import each other relatively: nothing of it reaches Kyutai's package.
    assert personaplex_moshi.models.lm.StreamingTransformer.__module__ == "personaplex_moshi.modules.transformer"


def test_every_session_is_bit_identical_to_the_vendor_loop(run):
    _, outputs, _, _ = run
    for (sampling, voiced), (actual, expected) in zip(SESSIONS, outputs, strict=True):
        assert expected.tokens.shape == (1, 17, USER_FRAMES) and expected.pcm.shape == (1, 1, USER_FRAMES * FRAME_SIZE)
        assert torch.equal(actual.tokens, expected.tokens), (sampling, voiced)
        assert torch.equal(actual.pcm, expected.pcm), (sampling, voiced)
    # The sessions differ from each other (sampling, mode and voice prompt reach the outputs).
    assert len({tuple(expected.tokens.flatten().tolist()) for _, expected in outputs}) == len(SESSIONS)


def test_the_lm_steps_run_their_graphs_on_every_step_of_every_phase(run):
    report, _, tokens, text = run
    # The role prompt, stepped token by token.
    assert text == f"<system> {ROLE} <system>" and len(tokens) > 30
    # Per session, every step of `LMGen.step` but its first (offset 0 only fills the delayed-token
    # cache) calls both steps: the voice prompt's frames, the silences, the role prompt, the user's frames.
    steps = sum((VOICE_FRAMES if voiced else 0) + 2 * SILENCE_FRAMES + len(tokens) + USER_FRAMES - 1 for _, voiced in SESSIONS)
    lm, depformer = report.operators["lm_step"], report.operators["depformer_step"]
    # One class for the main step (it reads nothing a session moves: `LM_BINDING`'s Unread paths);
    # the depformer's sampling switch is its mode, each value its own class.
    assert [cls.name for cls in lm.classes.values()] == ["lm_step[n=1,L=3000]"]
    assert [cls.name for cls in depformer.classes.values()] == [DEPFORMER.format(True), DEPFORMER.format(False)]
    # The first call adopts each layer's ring and its two device-side offsets and the transformer's.
    assert lm.counters.as_dict() == {
        "calls": steps,
        "graph_calls": steps,
        "verified": 2,
        "stock": 0,
        "adopted": 4,
        "stock_by_reason": {},
    }
    assert depformer.counters.as_dict() == {
        "calls": steps,
        "graph_calls": steps,
        "verified": 4,
        "stock": 0,
        "adopted": 0,
        "stock_by_reason": {},
    }


def test_mimi_encode_and_decode_run_their_graphs_on_every_frame(run):
    report, _, _, _ = run
    # One priming frame (`transform_personaplex`: its streaming convolutions make their state at
    # their first call), then per session the user's frames, and the voice prompt's frames encoded.
    encodes = 1 + USER_FRAMES * len(SESSIONS) + VOICE_FRAMES
    decodes = 1 + USER_FRAMES * len(SESSIONS)
    encode, decode = report.operators["mimi_encode"], report.operators["mimi_decode"]
    # Two programs per stage: the steady frame (the priming frame's program too) and the first
    # frame after a reset (every kept tensor None, each `padding_to_add` at its start). A reset's
    # Nones and the next call's tensors change the module settings' paths back and forth; each set
    # of paths keeps its version, so the same programs are met again, never new variants.
    assert [cls.name for cls in encode.classes.values()] == ["mimi_encode[n=2,L=250]", "mimi_encode[n=2,L=250]#2"]
    assert [cls.name for cls in decode.classes.values()] == ["mimi_decode[n=2,L=250]", "mimi_decode[n=2,L=250]#2"]
    assert encode.counters.as_dict() == {
        "calls": encodes,
        "graph_calls": encodes,
        "verified": 5,
        "stock": 0,
        "adopted": 28,
        "stock_by_reason": {},
    }
    assert decode.counters.as_dict() == {
        "calls": decodes,
        "graph_calls": decodes,
        "verified": 5,
        "stock": 0,
        "adopted": 26,
        "stock_by_reason": {},
    }


def test_the_contract_is_checked_against_the_models():
    from cadence_fx.models.personaplex import check_models, contract_for, personaplex_contract
    from cadence_fx.models.personaplex_stream import FULL, TINY

    assert contract_for(FULL) == personaplex_contract()  # the loaders' sizes are the contract's defaults
    models = personaplex_stream.build_models(TINY)
    check_models(models, contract_for(TINY))
    # Kyutai's 8 depformer codebooks are not PersonaPlex's 16 (`get_moshi_lm` sets dep_q = 16).
    with pytest.raises(ValueError, match=r"contract quantity codebooks=8 but the model has 16: declare codebooks=16"):
        check_models(
            models,
            personaplex_contract(
                codebooks=8,
                mimi_layers=1,
                mimi_heads=2,
                mimi_dim=32,
                lm_layers=1,
                lm_heads=4,
                lm_dim=32,
                depformer_layers=1,
                depformer_heads=4,
                depformer_dim=32,
                lm_dtype="float32",
            ),
        )
    with pytest.raises(ValueError, match=r"region 'lm_kv' declares bfloat16, the LM runs in torch.float32"):
        check_models(
            models,
            personaplex_contract(
                mimi_layers=1,
                mimi_heads=2,
                mimi_dim=32,
                lm_layers=1,
                lm_heads=4,
                lm_dim=32,
                depformer_layers=1,
                depformer_heads=4,
                depformer_dim=32,
            ),
        )
