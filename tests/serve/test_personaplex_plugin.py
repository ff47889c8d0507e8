"""``personaplex-tiny``: a session's voice and role (``configure``, from ``session.update``), its
replies bit-identical to PersonaPlex's own loop primed with that voice and role (one slot, greedy:
the masked loop at batch 1 is the vendor's), a change of persona after the conversation started
(the slot joins again with the new prompt: the conversation so far is dropped), voices by name
(the operator's, shared; a client's uploads, its own), WAV limits and refusals by name, and the
wire: ``session.update`` answered with ``session.updated`` once the persona is ready, or an
``invalid_value`` error that leaves the session as it was."""

from __future__ import annotations

import io
import wave

import numpy as np
import pytest
import sphn
import torch
from personaplex_kit import speechlike, write_checkpoint
from servekit import Server, run

from cadence_fx.models import personaplex_stream
from cadence_fx.serve.app import background_server
from cadence_fx.serve.plugins import ConfigRefused, load_plugin
from cadence_fx.serve.plugins.moshi import FRAME_SAMPLES
from cadence_fx.serve.plugins.personaplex_prompts import MAX_ROLE_TOKENS, role_tokens
from cadence_fx.serve.session import Limits

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REPLY = 3  # max_reply_frames


@pytest.fixture(scope="module")
def voices(tmp_path_factory):
    folder = tmp_path_factory.mktemp("voices")
    sphn.write_wav(str(folder / "ada.wav"), speechlike(1.0, seed=1).numpy(), 24_000)
    (folder / "notes.txt").write_text("not a voice")  # other files are left alone
    (folder / "broken.pt").write_bytes(b"not saved embeddings")
    return folder


@pytest.fixture(scope="module")
def plugin(voices):
    served = load_plugin("personaplex-tiny", slots=1, sampling=False, max_reply_frames=REPLY, voices=str(voices), record=True)
    served.reserve(1)
    yield served
    served.close()


def frames(n: int, seed: int) -> list[np.ndarray]:
    return list(speechlike(n * FRAME_SAMPLES / 24_000, seed=seed).numpy().reshape(n, FRAME_SAMPLES))


def turn(stream, fed: list[np.ndarray]) -> list[np.ndarray]:
    for frame in fed:
        stream.feed(frame)
    stream.begin_response()
    out = []
    while (chunk := stream.step()) is not None:
        out.append(chunk)
    return out


def vendor_reply(plugin, fed, *, instructions: str, voice: str | None) -> list[np.ndarray]:
    """PersonaPlex's own loop on the plugin's weights, primed with the role and voice, fed the turn
    then the reply's silence ticks: a reply opens with the output of the turn's last frame."""
    budget = min(len(fed), REPLY)
    user = torch.from_numpy(np.concatenate([*fed, np.zeros((budget - 1) * FRAME_SAMPLES, np.float32)]))[None, None]
    out = personaplex_stream.stream_reference(
        plugin.models, user, sampling=False, seed=0, text_prompt_tokens=role_tokens(instructions), voice_prompt=voice
    )
    return list(out.pcm[0, 0].numpy().reshape(-1, FRAME_SAMPLES)[-budget:])


def test_a_session_with_a_voice_and_a_role_is_personaplex_primed_with_them(plugin, voices):
    stream = plugin.open_stream()
    try:
        stream.configure("You are Ada, a bicycle mechanic.", "ada")
        fed = frames(4, seed=2)
        got = turn(stream, fed)
        want = vendor_reply(plugin, fed, instructions="You are Ada, a bicycle mechanic.", voice=str(voices / "ada.wav"))
        assert len(got) == REPLY and all(np.array_equal(g, w) for g, w in zip(got, want))
        # The persona changes after the conversation started: the slot joins again, primed with the
        # new role, and the conversation before it is gone (the reply is a fresh session's).
        rejoins = plugin.rejoins
        stream.configure("You are Bo, a librarian.", "default")
        fed = frames(2, seed=3)
        got = turn(stream, fed)
        want = vendor_reply(plugin, fed, instructions="You are Bo, a librarian.", voice=None)
        assert plugin.rejoins == rejoins + 1
        assert len(got) == 2 and all(np.array_equal(g, w) for g, w in zip(got, want))
    finally:
        stream.close()


def test_a_barge_in_drops_the_rest_of_the_reply_and_the_clock_goes_on(plugin):
    start = len(plugin.history())
    stream = plugin.open_stream()
    stream.configure("You are Ada.", "default")
    first_turn, second_turn = frames(4, seed=6), frames(2, seed=7)
    for frame in first_turn:
        stream.feed(frame)
    stream.begin_response()
    opening = stream.step()
    stream.cancel()  # the user talks over the reply: the rest of it is dropped
    assert stream.step() is None
    second = turn(stream, second_turn)
    stream.close()
    # The slot's every tick since the session joined it, and PersonaPlex's own loop over them.
    ticked = [record.frames[0] for record in plugin.history()[start:]]
    assert 0 in plugin.history()[start].joins
    user = torch.from_numpy(np.concatenate(ticked))[None, None]
    out = personaplex_stream.stream_reference(
        plugin.models, user, sampling=False, seed=0, text_prompt_tokens=role_tokens("You are Ada.")
    )
    reference = list(out.pcm[0, 0].numpy().reshape(-1, FRAME_SAMPLES))
    opened = next(i for i, frame in enumerate(ticked) if frame is first_turn[-1])
    assert np.array_equal(opening, reference[opened])
    # The second reply opens where the second turn ends, on the same clock (nothing was rewound).
    resumed = next(i for i, frame in enumerate(ticked) if frame is second_turn[-1])
    assert resumed > opened + 1 and len(second) == 2
    assert all(np.array_equal(g, w) for g, w in zip(second, reference[resumed : resumed + 2]))


def test_prompt_states_are_primed_once_per_voice_and_role(plugin):
    before = plugin.describe()["prompt_states"]
    for _ in range(2):
        stream = plugin.open_stream()
        stream.configure("You are Cy.", "ada")
        stream.close()
    after = plugin.describe()["prompt_states"]
    assert (after["primed"] - before["primed"], after["reused"] - before["reused"]) == (1, 1)
    assert plugin.describe()["voices"] == ["default", "ada", "broken"]


def wav_bytes(seconds: float, *, width: int = 2, channels: int = 1, rate: int = 24_000) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as wav:
        wav.setnchannels(channels)
        wav.setsampwidth(width)
        wav.setframerate(rate)
        samples = (0.1 * speechlike(seconds, seed=5).numpy()[0] * 32767).astype("<i2")
        wav.writeframes(np.repeat(samples, channels).tobytes() if width == 2 else bytes(int(seconds * rate) * channels))
    return buffer.getvalue()


def test_a_clients_uploaded_voice_is_its_own(plugin):
    mine = plugin.open_stream(client="10.0.0.1")
    mine.upload_voice("mine", wav_bytes(1.0))
    mine.configure("", "mine")
    mine.close()
    theirs = plugin.open_stream(client="10.0.0.2")
    try:
        with pytest.raises(
            ConfigRefused,
            match=r"^voice 'mine' is not a voice this client may use: the server's voices are default, ada, broken; an "
            r"uploaded voice \(ref_audio\) is usable by name only by the client that uploaded it \(a session and its resumes\)$",
        ) as refused:
            theirs.configure("", "mine")
        assert refused.value.param == "session.audio.output.voice"
    finally:
        theirs.close()
    again = plugin.open_stream(client="10.0.0.1")
    again.configure("", "mine")  # the same client names it again
    again.close()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"ID3 not a wav at all", r"voice 'v' is not a WAV file \(RIFF/WAVE header expected\)"),
        (wav_bytes(1.0, width=1), r"voice 'v' is 8-bit with 1 channels; a voice WAV is 16-bit PCM, mono or stereo"),
        (wav_bytes(0.2), r"voice 'v' lasts 0.20 s; a voice WAV lasts 0.5 to 30 s"),
        (wav_bytes(31.0), r"voice 'v' lasts 31.00 s; a voice WAV lasts 0.5 to 30 s"),
        (b"RIFF" + bytes(5 * 1024 * 1024), r"voice 'v' is 5242884 bytes; a voice WAV is at most 4194304"),
    ],
)
def test_voice_wavs_are_refused_by_name(plugin, data, message):
    stream = plugin.open_stream(client="c")
    try:
        with pytest.raises(ConfigRefused, match=f"^{message}$"):
            stream.upload_voice("v", data)
        with pytest.raises(
            ConfigRefused,
            match=r"^voice 'ada' is taken \(the operator's voices and 'default'\); "
            r"name an uploaded voice otherwise$",
        ):
            stream.upload_voice("ada", wav_bytes(1.0))
    finally:
        stream.close()


def test_a_role_too_long_is_refused_by_name():
    # Wrapped in '<system> ' and ' <system>' (18 bytes), one token a byte.
    assert len(role_tokens("x" * (MAX_ROLE_TOKENS - 18))) == MAX_ROLE_TOKENS
    with pytest.raises(
        ConfigRefused,
        match=rf"^session.instructions is {MAX_ROLE_TOKENS + 1} tokens as a role "
        rf"prompt; PersonaPlex takes at most {MAX_ROLE_TOKENS}$",
    ):
        role_tokens("x" * (MAX_ROLE_TOKENS - 17))


def test_a_checkpoint_in_the_released_layout_serves_its_voices_and_tokenizer(tmp_path):
    write_checkpoint(tmp_path, personaplex_stream.build_models(personaplex_stream.TINY))
    served = load_plugin("personaplex-tiny", slots=1, sampling=False, max_reply_frames=REPLY, weights=str(tmp_path))
    try:
        assert served.describe()["voices"] == ["default", "ADA"]  # the checkpoint's voices/, extracted from voices.tgz
        stream = served.open_stream()
        stream.configure("You are Ada, a bicycle mechanic.", "ADA")
        fed = frames(3, seed=4)
        got = turn(stream, fed)
        stream.close()
        tokens = served.checkpoint.tokenize("You are Ada, a bicycle mechanic.")
        user = torch.from_numpy(np.concatenate([*fed, np.zeros((REPLY - 1) * FRAME_SAMPLES, np.float32)]))[None, None]
        gen = personaplex_stream.lm_gen(served.models.lm, sampling=False)
        with served.models.mimi.streaming(1), gen.streaming(1):
            out = personaplex_stream.vendor_loop(
                served.models.mimi,
                gen,
                user,
                seed=0,
                text_prompt_tokens=tokens,
                voice_prompt_embeddings=str(tmp_path / "voices" / "ADA.pt"),
            )
        want = list(out.pcm[0, 0].numpy().reshape(-1, FRAME_SAMPLES)[-REPLY:])
        assert len(got) == REPLY and all(np.array_equal(g, w) for g, w in zip(got, want))
    finally:
        served.close()


def test_a_voice_file_the_vendor_cannot_read_is_refused_by_name(plugin):
    stream = plugin.open_stream()
    try:
        with pytest.raises(ConfigRefused, match=r"^voice 'broken' could not be primed: UnpicklingError: ") as refused:
            stream.configure("", "broken")
        assert refused.value.param == "session.audio.output.voice"
    finally:
        stream.close()


def test_bad_options_are_refused_by_name(plugin):
    with pytest.raises(ValueError, match=r"^slots must be a batch of 1 to 64 sessions, got 0$"):
        load_plugin("personaplex-tiny", slots=0)
    with pytest.raises(
        ValueError,
        match=r"^PersonaPlexPlugin takes no option 'size'; its options: seed, sampling, slots, "
        r"max_reply_frames, voices, weights, prompt_rate, record$",
    ):
        load_plugin("personaplex-tiny", size="full")
    with pytest.raises(
        ValueError,
        match=r"^personaplex-tiny holds 1 slots, not 2 sessions at once: admit at most 1 "
        r"\(a batch holds 1 to 64\)$",
    ):
        plugin.reserve(2)
    with pytest.raises(
        ValueError,
        match=r"^voices: '/nowhere' is not a folder \(expected a folder of <name>.wav or "
        r"<name>.pt voice prompt files\)$",
    ):
        load_plugin("personaplex-tiny", voices="/nowhere")


def test_session_update_sets_the_persona_over_the_wire(plugin):
    """Last: the server closes the plugin when it stops."""

    async def scenario(server: Server):
        sock = await server.connect("/v1/realtime")
        await sock.send(
            {"type": "session.update", "session": {"instructions": "You are Di.", "audio": {"output": {"voice": "ada"}}}}
        )
        updated = await sock.recv(timeout=30)
        await sock.send({"type": "session.update", "session": {"audio": {"output": {"voice": "nobody"}}}})
        error = await sock.recv(timeout=30)
        await sock.send({"type": "session.update", "session": {"tracing": None}})
        after = await sock.recv(timeout=30)
        await sock.close()
        return updated, error, after

    with background_server(lambda: plugin, Limits(max_sessions=1), settle_heap=False) as handle:
        updated, error, after = run(scenario(Server(handle)))
    assert updated["type"] == "session.updated"
    assert (updated["session"]["instructions"], updated["session"]["audio"]["output"]["voice"]) == ("You are Di.", "ada")
    assert error["type"] == "error"
    assert (error["error"]["code"], error["error"]["param"]) == ("invalid_value", "session.audio.output.voice")
    # The refused update changed nothing: the voice is still the one set before it.
    assert after["type"] == "session.updated" and after["session"]["audio"]["output"]["voice"] == "ada"
