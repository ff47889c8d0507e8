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


def test_semantic_vad_is_served_by_the_server_vad_its_eagerness_setting_the_silence():
    td = {"type": "semantic_vad", "eagerness": "high", "create_response": False, "interrupt_response": True}
    config = BASE.apply({"audio": {"input": {"turn_detection": td}}})
    assert config.turn_detection == TurnDetection(silence_duration_ms=300, create_response=False)
    assert config.to_wire("sess_x", 0)["audio"]["input"]["turn_detection"] == {
        "type": "server_vad",
        "threshold": 0.5,
        "prefix_padding_ms": 300,
        "silence_duration_ms": 300,
        "idle_timeout_ms": None,
        "create_response": False,
        "interrupt_response": True,
    }
    default = BASE.apply({"audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}})
    assert default.turn_detection == TurnDetection()


# The GA fields a session.update may carry, each set to a value the service applies or echoes.
EVERY_GA_FIELD = {
    "type": "realtime",
    "model": "tone",
    "instructions": "be brief",
    "output_modalities": ["audio"],
    "tools": [{"type": "function", "name": "lookup", "description": "d", "parameters": {"type": "object"}}],
    "tool_choice": "none",
    "max_output_tokens": "inf",
    "tracing": {"workflow_name": "w", "group_id": "g", "metadata": {"k": "v"}},
    "truncation": {"type": "retention_ratio", "retention_ratio": 0.5},
    "include": ["item.input_audio_transcription.logprobs"],
    "prompt": {"id": "pmpt_1", "version": "2", "variables": {"city": "Paris"}},
    "parallel_tool_calls": False,
    "audio": {
        "input": {
            "format": {"type": "audio/pcm", "rate": 24000},
            "transcription": {"model": "gpt-4o-mini-transcribe", "language": "en"},
            "noise_reduction": {"type": "near_field"},
            "turn_detection": {"type": "server_vad", "silence_duration_ms": 600, "idle_timeout_ms": None},
        },
        "output": {"format": {"type": "audio/pcmu"}, "voice": "marin", "speed": 1.0},
    },
}


def test_every_ga_field_is_applied_or_echoed_in_the_session_object():
    wire = BASE.apply(EVERY_GA_FIELD).to_wire("sess_x", 7)
    GA_SCHEMA.validate_python({"type": "session.updated", "event_id": "e", "session": wire})
    sent, audio = dict(EVERY_GA_FIELD), EVERY_GA_FIELD["audio"]
    del sent["audio"]
    assert {k: wire[k] for k in sent} == sent
    assert wire["audio"]["input"] == {
        **audio["input"],
        "turn_detection": TurnDetection(silence_duration_ms=600).to_wire(),
    }
    assert wire["audio"]["output"] == audio["output"]


def test_nulls_of_unset_options_change_nothing_and_a_null_feature_turns_it_off():
    config = BASE.apply(EVERY_GA_FIELD)
    nulls = {
        "instructions": None,
        "tool_choice": None,
        "max_output_tokens": None,
        "model": None,
        "reasoning": None,
        "audio": {"output": {"speed": None, "voice": None}},
    }
    assert config.apply(nulls) == config
    off = config.apply({"tracing": None, "prompt": None, "audio": {"input": {"transcription": None}}})
    assert (off.tracing, off.prompt, off.transcription) == (None, None, None)


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
            {"audio": {"input": {"turn_detection": {"type": "semantic_vad", "threshold": 0.5}}}},
            "unknown_parameter",
            "session.audio.input.turn_detection.threshold",
        ),
        (
            {"audio": {"input": {"turn_detection": {"type": "semantic_vad", "eagerness": "eager"}}}},
            "invalid_value",
            "session.audio.input.turn_detection.eagerness",
        ),
        (
            {"audio": {"input": {"turn_detection": {"type": "server_vad", "idle_timeout_ms": 5000}}}},
            "invalid_value",
            "session.audio.input.turn_detection.idle_timeout_ms",
        ),
        ({"audio": {"input": {"turn_detection": {"type": "push"}}}}, "invalid_value", "session.audio.input.turn_detection.type"),
        ({"temperature": 0.8}, "unknown_parameter", "session.temperature"),
        ({"audio": {"input": {"echo": True}}}, "unknown_parameter", "session.audio.input.echo"),
        ({"model": "gpt-realtime"}, "invalid_value", "session.model"),
        ({"audio": {"output": {"speed": 1.25}}}, "invalid_value", "session.audio.output.speed"),
        ({"max_output_tokens": 4096}, "invalid_value", "session.max_output_tokens"),
        ({"tool_choice": "required"}, "invalid_value", "session.tool_choice"),
        ({"tools": [{"type": "mcp", "server_label": "x"}]}, "invalid_value", "session.tools[0].type"),
        ({"tools": [{"type": "function"}]}, "invalid_value", "session.tools[0].name"),
        ({"tracing": {"workflow": "x"}}, "unknown_parameter", "session.tracing.workflow"),
        (
            {"truncation": {"type": "retention_ratio", "retention_ratio": 2}},
            "invalid_value",
            "session.truncation.retention_ratio",
        ),
        ({"include": ["item.audio"]}, "invalid_value", "session.include[0]"),
        ({"prompt": {"version": "1"}}, "invalid_value", "session.prompt.id"),
        ({"reasoning": {"effort": "low"}}, "invalid_value", "session.reasoning"),
        ({"audio": {"input": {"transcription": {"model": 1}}}}, "invalid_value", "session.audio.input.transcription.model"),
        (
            {"audio": {"input": {"noise_reduction": {"type": "loud"}}}},
            "invalid_value",
            "session.audio.input.noise_reduction.type",
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
