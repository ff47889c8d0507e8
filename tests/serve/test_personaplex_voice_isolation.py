"""A voice one client uploads over the wire (``ref_audio``) is that client's alone: over the wire a
client is one session, and its resumes. Another session naming it, whether it guesses the name or
not, is refused by name with why, and keeps its voice; the operator's named voices are every
session's; a session that uploads the same WAV gets the same name as its own (its prompt state
found in the cache, not primed again); a resumed session still names its upload, and a new
session does not. Exact event sequences for each step."""

from __future__ import annotations

import hashlib

import pytest
import sphn
import vllm_omni_shim as vo
from personaplex_kit import speechlike
from servekit import Server, run
from test_personaplex_plugin import wav_bytes

from cadence_fx.serve.app import background_server
from cadence_fx.serve.plugins import load_plugin
from cadence_fx.serve.session import Limits

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOICE = wav_bytes(1.0)
NAME = "ref_audio-" + hashlib.sha256(VOICE).hexdigest()[:16]
REFUSAL = (
    f"voice '{NAME}' is not a voice this client may use: the server's voices are default, ada; an uploaded "
    "voice (ref_audio) is usable by name only by the client that uploaded it (a session and its resumes)"
)


@pytest.fixture
def plugin(tmp_path):
    """One per test (the server closes its plugin when it stops), with the operator's voice ``ada``."""
    sphn.write_wav(str(tmp_path / "ada.wav"), speechlike(1.0, seed=1).numpy(), 24_000)
    served = load_plugin("personaplex-tiny", slots=3, sampling=False, max_reply_frames=3, voices=str(tmp_path))
    served.reserve(3)
    yield served
    served.close()


def answer(events: list[dict]) -> tuple:
    """An update's answer as the test compares it: each event's type, and the voice or the error."""
    return tuple(
        (e["type"], e["session"]["audio"]["output"]["voice"])
        if e["type"] == "session.updated"
        else (e["type"], e["error"]["code"], e["error"]["param"], e["error"]["message"])
        for e in events
    )


def test_a_sessions_uploaded_voice_is_its_own_and_the_operators_voices_are_shared(plugin):
    async def scenario(server: Server):
        steps: dict[str, tuple] = {}

        async def say(sock, key: str, session: dict) -> None:
            await sock.send({"type": "session.update", "session": {"type": "realtime", **session}})
            first = await sock.recv(timeout=60)  # the answer, once the voice is primed (or refused)
            steps[key] = answer([first, *await sock.recv_all(quiet_s=0.5)])  # and nothing after it

        a = await server.connect("/v1/duplex")
        b = await server.connect("/v1/duplex")
        await say(a, "a uploads", {"ref_audio": vo.duplex.audio_data_url(VOICE)})
        await say(b, "b names a's upload", {"audio": {"output": {"voice": NAME}}})
        await say(b, "b is as it was", {"tracing": None})
        await say(b, "b names the operator's", {"audio": {"output": {"voice": "ada"}}})
        await say(a, "a names the operator's", {"audio": {"output": {"voice": "ada"}}})
        await say(a, "a names its upload again", {"audio": {"output": {"voice": NAME}}})
        before = plugin.describe()["prompt_states"]
        await say(b, "b uploads the same wav", {"ref_audio": vo.duplex.audio_data_url(VOICE)})
        steps["b's prompt state"] = tuple(plugin.describe()["prompt_states"][k] - before[k] for k in ("primed", "reused"))
        await say(b, "b leaves its upload", {"audio": {"output": {"voice": "default"}}})
        await say(a, "a leaves its upload", {"audio": {"output": {"voice": "default"}}})
        # a's session resumed on a new connection (the old one is replaced) still names its upload.
        resumed = await server.connect(f"/v1/duplex?session_id={a.session_id}", created=False)
        seen = a.received[-1]["server_event_seq"]
        await resumed.send(
            {"type": "session.resume", "session_id": a.session_id, "resume_token": a.resume_token, "last_server_event_seq": seen}
        )
        steps["resume"] = ((await resumed.recv())["type"], (await a.recv())["type"])
        await say(resumed, "a resumed names its upload", {"audio": {"output": {"voice": NAME}}})
        await resumed.send({"type": "session.close"})
        steps["a closes"] = tuple(e["type"] for e in await resumed.recv_until("session.closed"))
        # A new session (from the same address, as every client here is) does not name it.
        c = await server.connect("/v1/duplex")
        await say(c, "a new session names a's upload", {"audio": {"output": {"voice": NAME}}})
        for sock in (b, c):
            await sock.close()
        return steps

    with background_server(lambda: plugin, Limits(max_sessions=3, max_sessions_per_client=3), settle_heap=False) as handle:
        steps = run(scenario(Server(handle)))
    refused = (("error", "invalid_value", "session.audio.output.voice", REFUSAL),)
    assert steps == {
        "a uploads": (("session.updated", NAME),),
        "b names a's upload": refused,
        "b is as it was": (("session.updated", "default"),),
        "b names the operator's": (("session.updated", "ada"),),
        "a names the operator's": (("session.updated", "ada"),),
        "a names its upload again": (("session.updated", NAME),),
        "b uploads the same wav": (("session.updated", NAME),),
        # b's upload is its own name for the same content: its prompt state found, not primed again.
        "b's prompt state": (0, 1),
        "b leaves its upload": (("session.updated", "default"),),
        "a leaves its upload": (("session.updated", "default"),),
        "resume": ("session.resumed", "session.replaced"),
        "a resumed names its upload": (("session.updated", NAME),),
        "a closes": ("session.closed",),
        "a new session names a's upload": refused,
    }
