"""A client's own voice WAV over the duplex route: vLLM-Omni's ``ref_audio`` (a ``data:audio/wav``
URL, as its client's ``audio_data_url`` makes it) becomes a PersonaPlex session's voice, named by
its content hash (16 hex digits of its SHA-256), and the reply is PersonaPlex's own loop primed with that WAV, bit for bit; a path
or URL, a payload that is not base64 and a WAV outside the limits are refused by name, and leave the
session's voice as it was; the reply's transcript is the text of PersonaPlex's own tokens. A model that takes no voice keeps
refusing ``ref_audio``
(``test_duplex_fields.py``)."""

from __future__ import annotations

import asyncio
import hashlib

import numpy as np
import pytest
import torch
import vllm_omni_shim as vo
from personaplex_kit import speechlike
from servekit import Server, run
from test_moshi_plugin_text import spoken
from test_personaplex_plugin import wav_bytes
from test_vllm_omni_interop import next_response, play

from cadence_fx.models import personaplex_stream
from cadence_fx.serve.app import background_server
from cadence_fx.serve.plugins import load_plugin
from cadence_fx.serve.plugins.moshi import FRAME_SAMPLES
from cadence_fx.serve.plugins.personaplex_prompts import role_tokens
from cadence_fx.serve.protocol import ProtocolError
from cadence_fx.serve.protocol import audio as wire_audio
from cadence_fx.serve.protocol.duplex import ref_audio_wav
from cadence_fx.serve.session import Limits

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REPLY = 3  # max_reply_frames
ROLE = "You are Cy, a lighthouse keeper."


@pytest.fixture
def plugin():
    """One per test: the server closes its plugin when it stops."""
    served = load_plugin("personaplex-tiny", slots=1, sampling=False, max_reply_frames=REPLY)
    served.reserve(1)
    yield served
    served.close()


def test_the_personaplex_preset_with_ref_audio_is_personaplex_primed_with_that_wav(plugin, tmp_path):
    voice = wav_bytes(1.0)
    config = vo.personaplex.create_duplex_session_config(persona=ROLE, ref_audio=vo.duplex.audio_data_url(voice))
    turn = speechlike(4 * FRAME_SAMPLES / 24_000, seed=2).numpy().reshape(-1)

    async def scenario(server: Server):
        collector = vo.duplex.EventCollector()
        async with vo.duplex.DuplexClient(server.handle.ws_url, model="personaplex-tiny", config=config) as client:
            consumer = asyncio.create_task(collector.consume(client))
            await client.stream_pcm(turn.astype("<f4").tobytes(), realtime=False)
            await client.commit()
            handle = await next_response(client)
            audio = await play(client, handle)
            info = client.session_info
            await client.close()
        await consumer
        return audio, handle.transcript, info, collector.events

    with background_server(lambda: plugin, Limits(max_sessions=1), settle_heap=False) as handle:
        audio, transcript, info, events = asyncio.run(asyncio.wait_for(scenario(Server(handle)), 120))
    assert [e for e in events if e["type"] == "error"] == []
    assert (info["audio"]["output"]["voice"], info["instructions"]) == (
        "ref_audio-" + hashlib.sha256(voice).hexdigest()[:16],
        ROLE,
    )
    (tmp_path / "voice.wav").write_bytes(voice)
    user = torch.from_numpy(np.concatenate([turn, np.zeros((REPLY - 1) * FRAME_SAMPLES, np.float32)]))[None, None]
    want = personaplex_stream.stream_reference(
        plugin.models,
        user,
        sampling=False,
        seed=0,
        text_prompt_tokens=role_tokens(ROLE),
        voice_prompt=str(tmp_path / "voice.wav"),
    )
    reply = want.pcm[0, 0].numpy()[-REPLY * FRAME_SAMPLES :]  # the reply opens with the turn's last frame
    assert audio == wire_audio.encode_samples(reply, wire_audio.PCM24K)
    # Its text tokens are the transcript, as Moshi's are (the stand-in tokenizer of random weights).
    assert transcript == "".join(spoken(want.tokens[0, 0, -REPLY:].tolist()))


def test_a_ref_audio_that_is_no_wav_data_url_is_refused_by_name_and_changes_nothing(plugin):
    async def scenario(server: Server):
        sock = await server.connect("/v1/duplex")
        before = await sock.update({"audio": {"output": {"voice": "default"}}})
        answers = []
        for value in (
            "file:///etc/passwd",
            "data:audio/mpeg;base64,AAAA",
            "data:audio/wav;base64,not base64!",
            vo.duplex.audio_data_url(b"ID3 not a wav at all"),
            vo.duplex.audio_data_url(wav_bytes(0.2)),
        ):
            await sock.send({"type": "session.update", "session": {"ref_audio": value}})
            answers.append(await sock.recv(timeout=30))
        after = await sock.update({"tracing": None})
        await sock.close()
        return before["session"], answers, after["session"]

    with background_server(lambda: plugin, Limits(max_sessions=1), settle_heap=False) as handle:
        before, answers, after = run(scenario(Server(handle)))
    name = "ref_audio-" + hashlib.sha256(b"ID3 not a wav at all").hexdigest()[:16]
    short = "ref_audio-" + hashlib.sha256(wav_bytes(0.2)).hexdigest()[:16]
    assert [(a["type"], a["error"]["code"], a["error"]["param"], a["error"]["message"]) for a in answers] == [
        (
            "error",
            "invalid_value",
            "session.ref_audio",
            "ref_audio must be a data URL (data:audio/wav;base64,<WAV "
            "bytes>), got 'file:///etc/passwd': this server reads no path or URL",
        ),
        (
            "error",
            "invalid_value",
            "session.ref_audio",
            "ref_audio is 'data:audio/mpeg;base64'; expected a base64 data "
            "URL of a WAV file (audio/wav or audio/x-wav or audio/wave or audio/vnd.wave, then ;base64)",
        ),
        ("error", "invalid_value", "session.ref_audio", "ref_audio's payload is not valid base64"),
        ("error", "invalid_value", "session.ref_audio", f"voice '{name}' is not a WAV file (RIFF/WAVE header expected)"),
        ("error", "invalid_value", "session.ref_audio", f"voice '{short}' lasts 0.20 s; a voice WAV lasts 0.5 to 30 s"),
    ]
    assert before["audio"]["output"]["voice"] == after["audio"]["output"]["voice"] == "default"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (7, "session.ref_audio"),
        ("data:audio/wav,UklGRg==", r"ref_audio is 'data:audio/wav'; expected a base64 data URL of a WAV file"),
        ("UklGRg==", r"ref_audio must be a data URL \(data:audio/wav;base64,<WAV bytes>\), got 'UklGRg=='"),
    ],
)
def test_ref_audio_values_that_are_not_a_wav_data_url_are_refused_by_name(value, message):
    with pytest.raises(ProtocolError, match=message) as refused:
        ref_audio_wav(value)
    assert refused.value.param == "session.ref_audio"
    assert ref_audio_wav(vo.duplex.audio_data_url(b"RIFF....WAVE")) == b"RIFF....WAVE"
