"""PersonaPlex's prompt phase as a snapshot (`models/personaplex_prompt.py`), at the tiny size.

The reference is the vendor's own session (`vendor_loop` = `prime` then `user_phase`) on the stock
models: its state right after priming and its generator there, then its user phase. A prompt
state is captured once per (voice, role), from that priming and from priming stepped on the bound
operators, and restored into a stock `LMGen` (its state compared, every tensor, with `torch.equal`)
and into the bound model, sessions after sessions (every token and PCM sample compared). Voices:
none, a WAV (`load_voice_prompt`), and the embeddings the vendor saves from that WAV
(`load_voice_prompt_embeddings`).
"""

from __future__ import annotations

import pytest
import sphn
import torch
from personaplex_kit import role_prompt_tokens, speechlike

from cadence_fx.models import personaplex, personaplex_bound, personaplex_stream
from cadence_fx.models.personaplex import FRAME_SIZE, SAMPLE_RATE
from cadence_fx.models.personaplex_prompt import capture, prime, restore, state_of
from cadence_fx.models.personaplex_stream import lm_gen, user_phase

pytestmark = pytest.mark.usefixtures("one_torch_thread")

USER_FRAMES = 5
VOICES = ("none", "wav", "embeddings")


def _clone(values: dict) -> dict:
    return {path: v.clone() if isinstance(v, torch.Tensor) else v for path, v in values.items()}


def _assert_same_state(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for path, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(actual[path], value), path
        else:
            assert actual[path] == value, path


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    folder = tmp_path_factory.mktemp("personaplex_prompt")
    wav = str(folder / "voice.wav")
    sphn.write_wav(wav, speechlike(1.0, seed=1).numpy(), SAMPLE_RATE)
    models = personaplex_stream.build_models(personaplex_stream.TINY)
    no_compile = personaplex._vendor("utils.compile").no_compile
    # The vendor saves a WAV's embeddings and its delayed-token cache next to it while it primes.
    saver = lm_gen(models.lm, sampling=True)
    saver.save_voice_prompt_embeddings = True
    with no_compile(), models.mimi.streaming(1), saver.streaming(1):
        prime(models.mimi, saver, text_prompt_tokens=[], voice_prompt=wav)
    voices = {"none": {}, "wav": {"voice_prompt": wav}, "embeddings": {"voice_prompt_embeddings": str(folder / "voice.pt")}}
    tokens, _ = role_prompt_tokens()
    user = speechlike(USER_FRAMES * FRAME_SIZE / SAMPLE_RATE, seed=2)[None]
    return models, voices, tokens, user


def primed_vendor(models, voice: dict, tokens, user, *, sampling: bool, seed: int):
    """The vendor's session on a fresh `LMGen`: its state and generator right after priming, its outputs."""
    no_compile = personaplex._vendor("utils.compile").no_compile
    gen = lm_gen(models.lm, sampling=sampling)
    with no_compile(), models.mimi.streaming(1), gen.streaming(1):
        torch.manual_seed(seed)
        prime(models.mimi, gen, text_prompt_tokens=tokens, **voice)
        state, generator = _clone(state_of(gen)), torch.get_rng_state()
        snapshot = capture(gen, voice="v", role=tokens)
        return state, generator, snapshot, user_phase(models.mimi, gen, user)


def test_priming_leaves_the_same_state_whatever_the_generator(kit):
    models, voices, tokens, user = kit
    first = primed_vendor(models, voices["wav"], tokens, user, sampling=True, seed=0)
    second = primed_vendor(models, voices["wav"], tokens, user, sampling=True, seed=1)
    _assert_same_state(second[0], first[0])
    assert second[2].digest == first[2].digest
    assert not torch.equal(second[1], first[1])  # the generators differ, and so do the sessions' outputs
    assert not torch.equal(second[3].tokens, first[3].tokens)


@pytest.mark.parametrize("voice", VOICES)
def test_priming_paused_at_each_step_leaves_the_vendor_s_state(kit, voice):
    """`prime` with a `checkpoint` drives the vendor's step generators itself, called before each
    step (and once more after a WAV's frames, where the vendor's generator yields again): the same
    state, every tensor, and the generator where the vendor's priming leaves it."""
    models, voices, tokens, user = kit
    expected, generator, _, _ = primed_vendor(models, voices[voice], tokens, user, sampling=True, seed=4)
    calls = []
    no_compile = personaplex._vendor("utils.compile").no_compile
    gen = lm_gen(models.lm, sampling=True)
    with no_compile(), models.mimi.streaming(1), gen.streaming(1):
        torch.manual_seed(4)
        prime(models.mimi, gen, text_prompt_tokens=tokens, checkpoint=lambda: calls.append(1), **voices[voice])
        _assert_same_state(state_of(gen), expected)
        assert torch.equal(torch.get_rng_state(), generator)
        # One a saved embedding replayed; one a WAV's frame (13), and one after them.
        voiced = len(gen.voice_prompt_embeddings) if voice == "embeddings" else {"none": 0, "wav": 13 + 1}[voice]
    assert voiced > 0 or voice == "none"
    assert len(calls) == 12 + len(tokens) + voiced


@pytest.mark.parametrize("voice", VOICES)
def test_a_restored_prompt_state_is_the_primed_vendor_state(kit, voice):
    models, voices, tokens, user = kit
    expected, generator, snapshot, reference = primed_vendor(models, voices[voice], tokens, user, sampling=True, seed=3)
    # The state the vendor's priming left: 12 silence steps, one a role token, one a voice frame (13 of them).
    assert snapshot.steps == 12 + len(tokens) + (13 if voice != "none" else 0)
    no_compile = personaplex._vendor("utils.compile").no_compile
    gen = lm_gen(models.lm, sampling=True)
    with no_compile(), models.mimi.streaming(1), gen.streaming(1):
        restore(gen, snapshot)
        # A fresh LMGen restored: every tensor of its state, every byte, and every host value.
        _assert_same_state(state_of(gen), expected)
        torch.set_rng_state(generator)
        models.mimi.reset_streaming()
        actual = user_phase(models.mimi, gen, user)
    assert torch.equal(actual.tokens, reference.tokens) and torch.equal(actual.pcm, reference.pcm)


def test_sessions_from_prompt_states_on_the_bound_model_equal_the_primed_vendor_streams(kit):
    models, voices, tokens, user = kit
    transformed = personaplex_bound.transform_personaplex(models, personaplex.contract_for(personaplex_stream.TINY))
    try:
        # The WAV turned into a prompt state once, stepped on the bound operators: the vendor's state.
        stepped = transformed.prompt_state(voice="wav", text_prompt_tokens=tokens, **voices["wav"])
        states = {}
        for seed, (voice, sampling) in enumerate(
            (("wav", True), ("none", False), ("embeddings", True), ("wav", False), ("none", True))
        ):
            _, generator, snapshot, reference = primed_vendor(models, voices[voice], tokens, user, sampling=sampling, seed=seed)
            state = states.setdefault(voice, snapshot)
            if voice == "wav":
                assert stepped.digest == snapshot.digest
            # Sessions one after another on one bound model, each restored in place over the last.
            actual = transformed.stream_primed(state, user, sampling=sampling, generator=generator)
            assert torch.equal(actual.tokens, reference.tokens), (voice, sampling)
            assert torch.equal(actual.pcm, reference.pcm), (voice, sampling)
        # Nothing wrote into a prompt state: the bytes it was taken with.
        for state in states.values():
            assert capture_digest(state) == state.digest
        # The saved embeddings (and the cache the vendor saves with them) prime the state the WAV primes.
        assert states["embeddings"].digest == states["wav"].digest != states["none"].digest
        # The LM's main step replayed its graph on every user step of the five sessions, and no prompt step ran.
        lm = transformed.report.operators["lm_step"].counters.as_dict()
        prompt_steps = stepped.steps - 1
        assert lm["calls"] == lm["graph_calls"] == prompt_steps + 5 * USER_FRAMES
    finally:
        transformed.close()


def capture_digest(state) -> str:
    from cadence_fx.models.personaplex_prompt import _digest

    return _digest(state.tensors, state.host)


def test_a_prompt_state_is_refused_where_it_does_not_fit(kit):
    models, voices, tokens, user = kit
    _, _, snapshot, _ = primed_vendor(models, voices["none"], tokens, user, sampling=False, seed=0)
    gen = lm_gen(models.lm, sampling=False)
    with gen.streaming(2):
        with pytest.raises(
            ValueError,
            match=r"LMGen state ':cache' is torch.int64 \(2, 17, 4\); the prompt state "
            r"holds torch.int64 \(1, 17, 4\) \(another model size or batch\)",
        ):
            restore(gen, snapshot)
        with pytest.raises(
            ValueError,
            match=r"a prompt state is taken at batch 1 \(one session's priming\), the "
            r"LMGen streams at batch 2",
        ):
            capture(gen, voice="v", role=tokens)
    with pytest.raises(
        ValueError,
        match=r"LMGen module '' is not streaming: a prompt state is taken and restored "
        r"while streaming",
    ):
        restore(gen, snapshot)
