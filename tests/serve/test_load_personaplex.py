"""The load generator against ``personaplex-tiny``: each session's persona (role) is set once, with
its first ``session.update``, and primed once; the generator's synchronisation updates change
nothing, so no session's persona is primed again and no slot joins again (``rejoins``). A persona
the server refuses fails the session, saying what the server said. The per-session start timings
(``start_to_created_s``, ``start_to_ready_s``, ``start_to_first_audio_s``) are in order."""

from __future__ import annotations

import pytest
from loadgen import run_load, speech_pattern
from servekit import run

from cadence_fx.serve.app import background_server
from cadence_fx.serve.plugins import load_plugin
from cadence_fx.serve.session import Limits

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LIMITS = Limits(max_sessions=2, max_sessions_per_client=2)


@pytest.fixture
def plugin():
    """One per test: the server closes its plugin when it stops."""
    served = load_plugin("personaplex-tiny", slots=2, sampling=False, max_reply_frames=3)
    served.reserve(2)  # primes the default prompt state (no voice, no role)
    yield served
    served.close()


def test_each_persona_is_primed_once_and_the_barrier_primes_nothing_again(plugin):
    pcm = speech_pattern(2.0)  # a burst at 0-0.8 s (the VAD ends it at 1.3 s), then 1.5-2.0 s, committed at the end
    personas = [{"instructions": f"You are agent {i}.", "voice": "default"} for i in range(2)]
    with background_server(lambda: plugin, LIMITS, settle_heap=False) as handle:
        results = run(run_load(handle.ws_url + "/v1/duplex", pcm, sessions=2, personas=personas, patience_s=50))
        described = plugin.describe()
    for result in results:
        assert result.errors == [] and result.accounted
        assert (result.turns, len(result.replies)) == (1, 1)
        assert 0 < result.start_to_created_s <= result.start_to_ready_s < result.start_to_first_audio_s
        # It streamed once ready, in real time: the append that ends its first turn (1.2-1.4 s of
        # audio, the VAD ends the turn at 1.3 s) went 1.2 s after it was ready.
        assert result.start_to_first_audio_s - result.start_to_ready_s > 1.2
    # The default state at reserve, then each session's role once; nothing found made, no rejoin.
    assert described["prompt_states"] == {"primed": 3, "reused": 0}
    assert described["rejoins"] == 0


def test_a_persona_the_server_refuses_fails_the_session_saying_what_the_server_said(plugin):
    with background_server(lambda: plugin, LIMITS, settle_heap=False) as handle:
        with pytest.raises(RuntimeError) as refused:
            run(run_load(handle.ws_url + "/v1/duplex", speech_pattern(1.0), sessions=1, personas=[{"voice": "nobody"}]))
    assert str(refused.value) == (
        "the server refused the session's first session.update: [{'type': 'invalid_request_error', "
        "'code': 'invalid_value', 'message': \"voice 'nobody' is not a voice this client may use: the server's voices are "
        "default; an uploaded voice (ref_audio) is usable by name only by the client that uploaded it (a session and "
        "its resumes)\", 'param': 'session.audio.output.voice', 'event_id': 'loadgen_update_1'}]"
    )
    assert plugin.describe()["prompt_states"] == {"primed": 1, "reused": 0}


def test_personas_are_one_per_session():
    with pytest.raises(ValueError, match=r"^personas: one per session expected, 2 sessions, got 1$"):
        run(run_load("ws://127.0.0.1:9/v1/duplex", b"", sessions=2, personas=[{}]))
