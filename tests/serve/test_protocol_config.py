"""session.update patches: GA layout, beta spellings, and typed refusals."""

from __future__ import annotations

import pytest
from servekit import GA_SCHEMA

from cadence_fx.serve.protocol import PCM24K, PCMA, PCMU, ProtocolError, SessionConfig, TurnDetection

BASE = SessionConfig(model="tone")


def test_ga_formats_and_turn_detection_apply():
    patch = {
        "type": "realtime",
        "instructions": "be brief",
        "audio": {
            "input": {
                "format": {"type": "audio/pcmu"},
                "turn_detection": {"type": "server_vad", "silence_duration_ms": 700},
            },
            "output": {"format": {"type": "audio/pcma"}, "voice": "marin"},
        },
    }
    assert BASE.apply(patch) == SessionConfig(
        model="tone",
        instructions="be brief",
        voice="marin",
        input_format=PCMU,
        output_format=PCMA,
        turn_detection=TurnDetection(silence_duration_ms=700),
    )


def test_beta_spellings_are_accepted_on_input():
    patch = {"input_audio_format": "g711_alaw", "output_audio_format": "pcm16", "turn_detection": None}
    config = BASE.apply(patch)
    assert (config.input_format, config.output_format, config.turn_detection) == (PCMA, PCM24K, None)


def test_session_object_is_ga():
    wire = {
        "type": "session.updated",
        "event_id": "e",
        "session": BASE.apply({"turn_detection": None}).to_wire("sess_x", 0),
    }
    GA_SCHEMA.validate_python(wire)
    assert wire["session"]["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 24000}


@pytest.mark.parametrize(
    ("patch", "code", "param"),
    [
        (
            {"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}},
            "unsupported_audio_format",
            "session.audio.input.format.rate",
        ),
        (
            {"audio": {"output": {"format": {"type": "audio/opus"}}}},
            "unsupported_audio_format",
            "session.audio.output.format.type",
        ),
        ({"input_audio_format": "mp3"}, "unsupported_audio_format", "session.input_audio_format"),
        ({"type": "transcription"}, "invalid_value", "session.type"),
        ({"output_modalities": ["text"]}, "invalid_value", "session.output_modalities"),
        ({"output_modalities": 3}, "invalid_value", "session.output_modalities"),
        (
            {"audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}},
            "invalid_value",
            "session.audio.input.turn_detection.type",
        ),
        (
            {"audio": {"input": {"turn_detection": {"threshold": 2}}}},
            "invalid_value",
            "session.audio.input.turn_detection.threshold",
        ),
        ({"audio": []}, "invalid_value", "session.audio"),
        ({"instructions": 5}, "invalid_value", "session.instructions"),
    ],
)
def test_bad_patch_is_refused_with_the_field_named(patch, code, param):
    with pytest.raises(ProtocolError) as info:
        BASE.apply(patch)
    assert (info.value.code, info.value.param) == (code, param)
