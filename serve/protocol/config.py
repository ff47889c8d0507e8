"""Session configuration: the ``session`` object of session.created/updated and the patch of
session.update (GA layout; the beta top-level spellings are accepted on input)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .audio import PCM24K, AudioFormat, parse_format
from .errors import ProtocolError, quoted


@dataclass(frozen=True)
class TurnDetection:
    """Server VAD settings (GA ``server_vad``); ``threshold`` in [0, 1] maps to an energy gate."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": "server_vad",
            "threshold": self.threshold,
            "prefix_padding_ms": self.prefix_padding_ms,
            "silence_duration_ms": self.silence_duration_ms,
            "idle_timeout_ms": None,
            "create_response": self.create_response,
            "interrupt_response": self.interrupt_response,
        }


@dataclass(frozen=True)
class SessionConfig:
    model: str
    instructions: str = ""
    voice: str = "default"
    input_format: AudioFormat = PCM24K
    output_format: AudioFormat = PCM24K
    turn_detection: TurnDetection | None = field(default_factory=TurnDetection)

    def to_wire(self, session_id: str, expires_at: int) -> dict[str, Any]:
        return {
            "type": "realtime",
            "object": "realtime.session",
            "id": session_id,
            "model": self.model,
            "output_modalities": ["audio"],
            "instructions": self.instructions,
            "tools": [],
            "tool_choice": "auto",
            "max_output_tokens": "inf",
            "tracing": None,
            "prompt": None,
            "expires_at": expires_at,
            "include": None,
            "audio": {
                "input": {
                    "format": self.input_format.to_wire(),
                    "transcription": None,
                    "noise_reduction": None,
                    "turn_detection": None if self.turn_detection is None else self.turn_detection.to_wire(),
                },
                "output": {"format": self.output_format.to_wire(), "voice": self.voice, "speed": 1.0},
            },
        }

    def apply(self, patch: dict[str, Any]) -> SessionConfig:
        """This config with a session.update ``session`` object applied; raises ProtocolError."""
        changes: dict[str, Any] = {}
        kind = patch.get("type", "realtime")
        if kind != "realtime":
            raise ProtocolError("invalid_value", f"session.type must be 'realtime', got {quoted(kind)}", "session.type")
        if "instructions" in patch:
            changes["instructions"] = _typed(patch["instructions"], str, "session.instructions")
        modalities = patch.get("output_modalities", patch.get("modalities"))
        if modalities is not None:
            _typed(modalities, list, "session.output_modalities")
            if "audio" not in modalities or not all(m in ("audio", "text") for m in modalities):
                raise ProtocolError("invalid_value", "only audio output is served", "session.output_modalities")
        audio = _typed(patch.get("audio", {}), dict, "session.audio")
        audio_in = _typed(audio.get("input", {}), dict, "session.audio.input")
        audio_out = _typed(audio.get("output", {}), dict, "session.audio.output")
        if "format" in audio_in:
            changes["input_format"] = parse_format(audio_in["format"], "session.audio.input.format")
        elif "input_audio_format" in patch:
            changes["input_format"] = parse_format(patch["input_audio_format"], "session.input_audio_format")
        if "format" in audio_out:
            changes["output_format"] = parse_format(audio_out["format"], "session.audio.output.format")
        elif "output_audio_format" in patch:
            changes["output_format"] = parse_format(patch["output_audio_format"], "session.output_audio_format")
        if "voice" in audio_out or "voice" in patch:
            voice = audio_out.get("voice", patch.get("voice"))
            changes["voice"] = _typed(voice, str, "session.audio.output.voice")
        if "turn_detection" in audio_in:
            changes["turn_detection"] = _turn_detection(
                audio_in["turn_detection"], "session.audio.input.turn_detection"
            )
        elif "turn_detection" in patch:
            changes["turn_detection"] = _turn_detection(patch["turn_detection"], "session.turn_detection")
        return dataclasses.replace(self, **changes)


def _typed(value: Any, kind: type, param: str) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ProtocolError("invalid_value", f"{param} must be of type {kind.__name__}", param)
    return value


def _turn_detection(value: Any, param: str) -> TurnDetection | None:
    if value is None:
        return None
    _typed(value, dict, param)
    if value.get("type", "server_vad") != "server_vad":
        raise ProtocolError("invalid_value", "only turn_detection.type 'server_vad' is served", f"{param}.type")
    base = TurnDetection()
    threshold = value.get("threshold", base.threshold)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
        raise ProtocolError("invalid_value", "threshold must be a number in [0, 1]", f"{param}.threshold")
    ints = {}
    for name in ("prefix_padding_ms", "silence_duration_ms"):
        v = value.get(name, getattr(base, name))
        if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v > 10_000:
            raise ProtocolError("invalid_value", f"{name} must be an integer in [0, 10000]", f"{param}.{name}")
        ints[name] = v
    flags = {}
    for name in ("create_response", "interrupt_response"):
        flags[name] = _typed(value.get(name, getattr(base, name)), bool, f"{param}.{name}")
    return TurnDetection(threshold=float(threshold), **ints, **flags)
