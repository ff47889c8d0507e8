"""PersonaPlex sessions as batch slots (`models/personaplex_slots.py`), on CPU at the tiny size.

At batch 1 the reference is PersonaPlex's own loop (`stream_reference`: the vendor's `LMGen` and
Mimi, its prompt phase stepped as `offline.py` steps it), sampled and greedy: tokens and PCM
`torch.equal`. At B = 2 to 4 the reference is the same masked batched loop, eagerly, with the
slot's session alone in its row: with sessions joining at their own ticks, priming while others
talk, leaving, and new sessions joining the freed slots, every slot's tokens and PCM are
`torch.equal` to it (greedy: sampled slots at B > 1 draw from the batch's generator, see the module
docstring). Against the vendor's batch-1 loop a slot at B > 1 is not bit-exact by construction: the
batched kernels may round a row otherwise (measured here: the KV ring of a slot primed at B = 3
differed from batch 1's by up to 2.4e-7, and at B = 2 it differed too).
"""

from __future__ import annotations

import pytest
import sphn
import torch
from personaplex_kit import role_prompt_tokens, speechlike

from cadence_fx.models import personaplex, personaplex_stream
from cadence_fx.models.personaplex import FRAME_SIZE, SAMPLE_RATE
from cadence_fx.models.personaplex_prompt import capture, prime
from cadence_fx.models.personaplex_slots import PersonaPlexSlots, prompt_steps, voice_codes

pytestmark = pytest.mark.usefixtures("one_torch_thread")

USER_FRAMES = 4


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    wav = str(tmp_path_factory.mktemp("personaplex_slots") / "voice.wav")
    sphn.write_wav(wav, speechlike(1.0, seed=1).numpy(), SAMPLE_RATE)
    models = personaplex_stream.build_models(personaplex_stream.TINY)
    roles = {"ada": role_prompt_tokens("You are Ada. Be kind.")[0], "bo": role_prompt_tokens("You are Bo, a librarian.")[0]}
    return models, wav, voice_codes(models, wav), roles


def audio(seed: int) -> torch.Tensor:
    return speechlike(USER_FRAMES * FRAME_SIZE / SAMPLE_RATE, seed=seed)[None]


def stitched(outputs):
    """A slot's answers as `stream_reference` returns them: tokens `(1, 17, frames)`, PCM `(1, 1, samples)`."""
    return torch.stack([o.tokens for o in outputs], dim=-1)[None], torch.cat([o.pcm for o in outputs])[None, None]


def run_schedule(runtime, sessions, joins):
    """Every session of `sessions` (`(slot, steps or prompt state, user audio)`) joins its slot at
    `joins[i]` (a tick), or, with None, at the tick after the slot's last session leaves; each
    primes, then sends one user frame a tick until its audio ends, then leaves."""
    answers = {i: [] for i in range(len(sessions))}
    waiting, active, sent, tick = dict(enumerate(joins)), {}, {}, 0
    while waiting or active:
        for i, at in sorted(waiting.items()):
            slot, prompt, _ = sessions[i]
            if slot not in active and (at is None or tick >= at):
                runtime.join(slot, **prompt)
                active[slot], sent[i] = i, 0
                del waiting[i]
        frames = {
            slot: sessions[i][2][0, 0, sent[i] * FRAME_SIZE : (sent[i] + 1) * FRAME_SIZE]
            for slot, i in active.items()
            if not runtime.priming(slot)
        }
        for slot, answer in runtime.tick(frames).items() if active else ():
            i = active[slot]
            answers[i].append(answer)
            sent[i] += 1
            if sent[i] == USER_FRAMES:
                runtime.leave(slot)
                del active[slot]
        tick += 1
    return answers


@pytest.mark.parametrize("sampling", [False, True])
def test_one_slot_is_personaplex_own_loop(kit, sampling):
    models, wav, voice, roles = kit
    runtime = PersonaPlexSlots(models, 1, sampling=sampling, seed=7)
    steps = prompt_steps(runtime.gen, voice=voice, role=roles["ada"])
    assert len(steps) == voice.shape[1] + 12 + len(roles["ada"]) == 13 + 12 + len(roles["ada"])
    answers = run_schedule(runtime, [(0, {"steps": steps}, audio(2))], [0])[0]
    expected = personaplex_stream.stream_reference(
        models, audio(2), sampling=sampling, seed=7, text_prompt_tokens=roles["ada"], voice_prompt=wav
    )
    tokens, pcm = stitched(answers)
    assert torch.equal(tokens, expected.tokens) and torch.equal(pcm, expected.pcm)
    # The prompt stepped at prompt_rate (4) steps a tick: ceil(steps / 4) ticks, then one tick a user frame.
    assert runtime.ticks == -(-len(steps) // 4) + USER_FRAMES


@pytest.mark.parametrize("slots", [2, 3, 4])
def test_slots_with_joins_leaves_and_rejoins_are_each_the_masked_loop_alone(kit, slots):
    models, wav, voice, roles = kit
    # slots + 1 sessions: the first of each slot joins at its own tick (priming while the earlier
    # ones talk), the last as a slot frees up (a leave, then a join that resets the slot's rows).
    kinds = [("ada", None), ("bo", wav), ("bo", None), ("ada", wav), ("bo", wav)][: slots + 1]
    sessions = [
        (i % slots, {"steps": prompt_steps(models_gen(models), voice=voice if voiced else None, role=roles[role])}, audio(10 + i))
        for i, (role, voiced) in enumerate(kinds)
    ]
    joins = [3 * i if i < slots else None for i in range(len(kinds))]
    busy = run_schedule(PersonaPlexSlots(models, slots, sampling=False, seed=0), sessions, joins)
    for i, session in enumerate(sessions):
        # The same session, in the same row of the same batch, with every other row empty.
        alone = run_schedule(PersonaPlexSlots(models, slots, sampling=False, seed=0), [session], [0])[0]
        assert len(busy[i]) == len(alone) == USER_FRAMES
        for got, expected in zip(busy[i], alone):
            assert torch.equal(got.tokens, expected.tokens) and torch.equal(got.pcm, expected.pcm), (slots, i)


def models_gen(models):
    return personaplex_stream.lm_gen(models.lm, sampling=False)


def test_a_slot_joins_from_a_prompt_state_in_place_of_the_vendor_priming(kit):
    models, wav, voice, roles = kit
    no_compile = personaplex._vendor("utils.compile").no_compile
    gen = personaplex_stream.lm_gen(models.lm, sampling=False)
    with no_compile(), models.mimi.streaming(1), gen.streaming(1):
        prime(models.mimi, gen, text_prompt_tokens=roles["bo"], voice_prompt=wav)
        vendor = capture(gen, voice="wav", role=roles["bo"])
    steps = prompt_steps(gen, voice=voice, role=roles["bo"])
    # At batch 1, the prompt stepped in the slot leaves the vendor's state, byte for byte.
    one = PersonaPlexSlots(models, 1, sampling=False, seed=0)
    one.join(0, steps=steps)
    while one.priming(0):
        one.tick({})
    assert one.capture(0, voice="wav", role=roles["bo"]).digest == vendor.digest
    # At batch 3, a slot restored from it holds it, and talks as the vendor's primed loop does.
    runtime = PersonaPlexSlots(models, 3, sampling=False, seed=0)
    runtime.join(2, prompt=vendor)
    assert runtime.priming(2) == 0 and runtime.capture(2, voice="wav", role=roles["bo"]).digest == vendor.digest
    runtime.leave(2)
    sessions = [(0, {"prompt": vendor}, audio(20)), (1, {"steps": steps}, audio(21)), (2, {"prompt": vendor}, audio(22))]
    busy = run_schedule(runtime, sessions, [0, 0, 2])
    for i, session in enumerate(sessions):
        alone = run_schedule(PersonaPlexSlots(models, 3, sampling=False, seed=0), [session], [0])[0]
        for got, expected in zip(busy[i], alone, strict=True):
            assert torch.equal(got.tokens, expected.tokens) and torch.equal(got.pcm, expected.pcm), i
    # Restored at batch 1, the vendor's primed stream itself.
    restored = run_schedule(PersonaPlexSlots(models, 1, sampling=False, seed=0), [(0, {"prompt": vendor}, audio(20))], [0])
    expected = personaplex_stream.stream_reference(
        models, audio(20), sampling=False, seed=0, text_prompt_tokens=roles["bo"], voice_prompt=wav
    )
    tokens, pcm = stitched(restored[0])
    assert torch.equal(tokens, expected.tokens) and torch.equal(pcm, expected.pcm)


def test_a_masked_slot_keeps_its_state(kit):
    models, wav, voice, roles = kit
    runtime = PersonaPlexSlots(models, 2, sampling=False, seed=0)
    runtime.join(0, steps=prompt_steps(runtime.gen, voice=None, role=roles["ada"]))
    runtime.join(1, steps=prompt_steps(runtime.gen, voice=None, role=roles["bo"]))
    while runtime.priming(0) or runtime.priming(1):
        runtime.tick({})
    before = {"cache": runtime.cache[1].clone(), "provided": runtime.provided[1].clone(), "offset": int(runtime.offsets[1])}
    rows = {
        name: (
            state.offset[1].clone(),
            None if state.end is None else state.end[1].clone(),
            None if state.cache is None else state.cache[:, 1, :, : int(state.end[1])].clone(),
        )
        for name, state in runtime.rows.items()
    }
    user = audio(3)
    for frame in user[0, 0].split(FRAME_SIZE):
        runtime.tick({0: frame})  # slot 1 holds a session and sends nothing: masked
    assert torch.equal(runtime.cache[1], before["cache"]) and torch.equal(runtime.provided[1], before["provided"])
    assert int(runtime.offsets[1]) == before["offset"]
    for name, state in runtime.rows.items():
        offset, end, ring = rows[name]
        assert torch.equal(state.offset[1], offset), name
        if end is not None:
            assert torch.equal(state.end[1], end) and torch.equal(state.cache[:, 1, :, : int(end)], ring), name


def test_bad_calls_are_refused_by_name(kit):
    models, _, _, roles = kit
    runtime = PersonaPlexSlots(models, 2, sampling=False, seed=0)
    frame = torch.zeros(FRAME_SIZE)
    with pytest.raises(ValueError, match=r"slots must be a positive batch size, got 0"):
        PersonaPlexSlots(models, 0, sampling=False, seed=0)
    with pytest.raises(ValueError, match=r"prompt_rate must be a positive number of prompt steps per tick, got 0"):
        PersonaPlexSlots(models, 1, sampling=False, seed=0, prompt_rate=0)
    with pytest.raises(ValueError, match=r"a tick runs at least one slot: no frames, and no slot is priming"):
        runtime.tick({})
    with pytest.raises(ValueError, match=r"frames\[0\]: slot 0 holds no session \(join it first\)"):
        runtime.tick({0: frame})
    runtime.join(0, steps=prompt_steps(runtime.gen, voice=None, role=roles["ada"]))
    steps = runtime.priming(0)
    with pytest.raises(
        ValueError,
        match=rf"frames\[0\]: slot 0 is priming \({steps} prompt steps left\); it takes "
        r"user frames once primed",
    ):
        runtime.tick({0: frame})
    with pytest.raises(ValueError, match=r"slot 0 holds a session: it leaves before another joins"):
        runtime.join(0)
    with pytest.raises(ValueError, match=r"slot 2 is outside 0..1 \(the batch holds 2 slots\)"):
        runtime.join(2)
    with pytest.raises(ValueError, match=r"slot 1 is not primed \(a prompt state is taken once every prompt step ran\)"):
        runtime.capture(1, voice="v", role=())
    while runtime.priming(0):
        runtime.tick({})
    with pytest.raises(
        ValueError,
        match=r"frames\[0\]: a frame is 1920 float32 samples, shape \(1920,\); got "
        r"torch.float64 \(1920,\)",
    ):
        runtime.tick({0: frame.double()})
    runtime.leave(0)
    with pytest.raises(ValueError, match=r"slot 0 holds no session"):
        runtime.leave(0)
