"""Session configuration: the ``session`` object of session.created/updated and the patch of
session.update (GA layout; the beta top-level spellings are accepted on input).

Every GA field of a patch is applied, echoed or refused; none is dropped, and a field GA does not
define is refused with ``unknown_parameter``:

- applied: ``instructions`` (stored), ``output_modalities``, the audio formats, ``voice``,
  ``turn_detection`` (``server_vad``; ``semantic_vad`` is served by the server VAD, and the
  session object reports the ``server_vad`` settings that serve it), ``tool_choice`` ``auto`` and
  ``none`` (these models never call a tool), ``speed`` 1.0, ``max_output_tokens`` ``inf``, ``model``
  naming the served model;
- echoed (stored and reported, no effect on the audio): ``tools`` (function tools, never called),
  ``tracing``, ``truncation``, ``include``, ``prompt``, ``parallel_tool_calls``,
  ``audio.input.transcription`` (no transcript is produced), ``audio.input.noise_reduction`` (the
  model hears the audio as sent);
- refused: any other value of the applied fields, ``reasoning``, ``mcp`` tools, and a
  ``turn_detection.idle_timeout_ms``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .audio import PCM24K, AudioFormat, parse_format
from .errors import ProtocolError, quoted

# semantic_vad's eagerness, served as the server VAD's silence before a turn ends.
EAGERNESS_SILENCE_MS = {"low": 800, "medium": 500, "auto": 500, "high": 300}

_SESSION_FIELDS = frozenset(
    {
        "type",
        "model",
        "instructions",
        "output_modalities",
        "audio",
        "tools",
        "tool_choice",
        "max_output_tokens",
        "tracing",
        "truncation",
        "include",
        "prompt",
        "parallel_tool_calls",
        "reasoning",
        # beta spellings, accepted on input
        "modalities",
        "voice",
        "input_audio_format",
        "output_audio_format",
        "turn_detection",
    }
)
_AUDIO_INPUT_FIELDS = frozenset({"format", "transcription", "noise_reduction", "turn_detection"})
_AUDIO_OUTPUT_FIELDS = frozenset({"format", "voice", "speed"})
_SERVER_VAD_FIELDS = frozenset(
    {"type", "threshold", "prefix_padding_ms", "silence_duration_ms", "idle_timeout_ms", "create_response", "interrupt_response"}
)
_SEMANTIC_VAD_FIELDS = frozenset({"type", "eagerness", "create_response", "interrupt_response"})
# A null where null means nothing is "not given" (clients send their unset options as null);
# these fields' null is a value: it turns the feature off.
_NULLABLE = frozenset({"turn_detection", "tracing", "prompt", "include", "transcription", "noise_reduction"})
_RESPONSE_FIELDS = frozenset(
    {
        "audio",
        "conversation",
        "input",
        "instructions",
        "max_output_tokens",
        "metadata",
        "output_modalities",
        "prompt",
        "tool_choice",
        "tools",
        "parallel_tool_calls",
        "reasoning",
    }
)


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
    tool_choice: str = "auto"
    # Echoed: stored as sent (already checked) and reported; nothing in the service reads them.
    tools: tuple = ()
    tracing: Any = None
    truncation: Any = "auto"
    include: tuple | None = None
    prompt: Any = None
    parallel_tool_calls: bool | None = None
    transcription: Any = None
    noise_reduction: Any = None

    def to_wire(self, session_id: str, expires_at: int) -> dict[str, Any]:
        wire = {
            "type": "realtime",
            "object": "realtime.session",
            "id": session_id,
            "model": self.model,
            "output_modalities": ["audio"],
            "instructions": self.instructions,
            "tools": list(self.tools),
            "tool_choice": self.tool_choice,
            "max_output_tokens": "inf",
            "tracing": self.tracing,
            "truncation": self.truncation,
            "prompt": self.prompt,
            "expires_at": expires_at,
            "include": None if self.include is None else list(self.include),
            "audio": {
                "input": {
                    "format": self.input_format.to_wire(),
                    "transcription": self.transcription,
                    "noise_reduction": self.noise_reduction,
                    "turn_detection": None if self.turn_detection is None else self.turn_detection.to_wire(),
                },
                "output": {"format": self.output_format.to_wire(), "voice": self.voice, "speed": 1.0},
            },
        }
        if self.parallel_tool_calls is not None:
            wire["parallel_tool_calls"] = self.parallel_tool_calls
        return wire

    def apply(self, patch: dict[str, Any], duplex: bool = False) -> SessionConfig:
        """This config with a session.update ``session`` object applied; raises ProtocolError.
        ``duplex``: formats as a duplex connection takes them (``audio.parse_format``); its other
        extension fields are ``duplex.apply_duplex``'s, which calls this without them."""
        known(patch, _SESSION_FIELDS, "session")
        patch = given(patch)
        changes: dict[str, Any] = {}
        kind = patch.get("type", "realtime")
        if kind != "realtime":
            raise ProtocolError("invalid_value", f"session.type must be 'realtime', got {quoted(kind)}", "session.type")
        if "model" in patch and patch["model"] != self.model:
            raise ProtocolError(
                "invalid_value",
                f"model {quoted(patch['model'])} is not served here; this server serves {self.model!r} (GET /v1/models)",
                "session.model",
            )
        if "instructions" in patch:
            changes["instructions"] = typed(patch["instructions"], str, "session.instructions")
        if "output_modalities" in patch:
            output_modalities(patch["output_modalities"], "session.output_modalities")
        elif "modalities" in patch:
            output_modalities(patch["modalities"], "session.modalities")
        if "max_output_tokens" in patch:
            max_output_tokens(patch["max_output_tokens"], "session.max_output_tokens")
        if "tools" in patch:
            changes["tools"] = tools(patch["tools"], "session.tools")
        if "tool_choice" in patch:
            changes["tool_choice"] = tool_choice(patch["tool_choice"], "session.tool_choice")
        if "tracing" in patch:
            changes["tracing"] = _tracing(patch["tracing"])
        if "truncation" in patch:
            changes["truncation"] = _truncation(patch["truncation"])
        if "include" in patch:
            changes["include"] = _include(patch["include"])
        if "prompt" in patch:
            changes["prompt"] = prompt(patch["prompt"], "session.prompt")
        if "parallel_tool_calls" in patch:
            changes["parallel_tool_calls"] = typed(patch["parallel_tool_calls"], bool, "session.parallel_tool_calls")
        if patch.get("reasoning") is not None:
            raise ProtocolError(
                "invalid_value", "reasoning is not served: the model speaks, it does not reason in text", "session.reasoning"
            )
        audio = typed(patch.get("audio", {}), dict, "session.audio")
        known(audio, {"input", "output"}, "session.audio")
        audio_in = given(typed(audio.get("input", {}), dict, "session.audio.input"))
        audio_out = given(typed(audio.get("output", {}), dict, "session.audio.output"))
        known(audio_in, _AUDIO_INPUT_FIELDS, "session.audio.input")
        known(audio_out, _AUDIO_OUTPUT_FIELDS, "session.audio.output")
        if "format" in audio_in:
            changes["input_format"] = parse_format(audio_in["format"], "session.audio.input.format", duplex)
        elif "input_audio_format" in patch:
            changes["input_format"] = parse_format(patch["input_audio_format"], "session.input_audio_format", duplex)
        if "format" in audio_out:
            changes["output_format"] = parse_format(audio_out["format"], "session.audio.output.format", duplex)
        elif "output_audio_format" in patch:
            changes["output_format"] = parse_format(patch["output_audio_format"], "session.output_audio_format", duplex)
        if "voice" in audio_out or "voice" in patch:
            voice = audio_out.get("voice", patch.get("voice"))
            changes["voice"] = typed(voice, str, "session.audio.output.voice")
        if "speed" in audio_out:
            speed(audio_out["speed"], "session.audio.output.speed")
        if "transcription" in audio_in:
            changes["transcription"] = _transcription(audio_in["transcription"])
        if "noise_reduction" in audio_in:
            changes["noise_reduction"] = _noise_reduction(audio_in["noise_reduction"])
        if "turn_detection" in audio_in:
            changes["turn_detection"] = _turn_detection(audio_in["turn_detection"], "session.audio.input.turn_detection")
        elif "turn_detection" in patch:
            changes["turn_detection"] = _turn_detection(patch["turn_detection"], "session.turn_detection")
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ResponseParams:
    """The ``response`` object of response.create, checked against what the service can honour."""

    output_format: AudioFormat
    voice: str
    in_conversation: bool = True  # conversation "none": the reply item stays out of the history
    instructions: str | None = None
    metadata: dict | None = None

    @classmethod
    def parse(cls, value: dict[str, Any] | None, session: SessionConfig, duplex: bool = False) -> ResponseParams:
        base = cls(output_format=session.output_format, voice=session.voice)
        if value is None:
            return base
        known(value, _RESPONSE_FIELDS, "response")
        value = given(value)
        changes: dict[str, Any] = {}
        audio = typed(value.get("audio", {}), dict, "response.audio")
        known(audio, {"output"}, "response.audio")
        audio_out = given(typed(audio.get("output", {}), dict, "response.audio.output"))
        known(audio_out, {"format", "voice"}, "response.audio.output")
        if "format" in audio_out:
            changes["output_format"] = parse_format(audio_out["format"], "response.audio.output.format", duplex)
        if "voice" in audio_out:
            changes["voice"] = typed(audio_out["voice"], str, "response.audio.output.voice")
        conversation = value.get("conversation", "auto")
        if conversation not in ("auto", "none"):
            raise ProtocolError(
                "invalid_value", f"conversation must be 'auto' or 'none', got {conversation!r}", "response.conversation"
            )
        changes["in_conversation"] = conversation == "auto"
        if "input" in value:
            raise ProtocolError(
                "invalid_value",
                "response.input is not served: the model answers from the audio it has heard",
                "response.input",
            )
        if "instructions" in value:
            changes["instructions"] = typed(value["instructions"], str, "response.instructions")
        if "metadata" in value:
            changes["metadata"] = _metadata(value["metadata"])
        if "output_modalities" in value:
            output_modalities(value["output_modalities"], "response.output_modalities")
        if "max_output_tokens" in value:
            max_output_tokens(value["max_output_tokens"], "response.max_output_tokens")
        if "tools" in value:
            tools(value["tools"], "response.tools")
        if "tool_choice" in value:
            tool_choice(value["tool_choice"], "response.tool_choice")
        if "parallel_tool_calls" in value:
            typed(value["parallel_tool_calls"], bool, "response.parallel_tool_calls")
        if value.get("prompt") is not None:
            raise ProtocolError("invalid_value", "prompt templates are not served", "response.prompt")
        if value.get("reasoning") is not None:
            raise ProtocolError("invalid_value", "reasoning is not served", "response.reasoning")
        return dataclasses.replace(base, **changes)


# ---------------------------------------------------------------- field checks (shared with response.create)


def given(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` without the nulls that mean "not given"."""
    return {k: v for k, v in obj.items() if v is not None or k in _NULLABLE}


def _metadata(value: Any) -> dict:
    """GA metadata: at most 16 string pairs, keys up to 64 characters, values up to 512."""
    param = "response.metadata"
    typed(value, dict, param)
    if len(value) > 16:
        raise ProtocolError("invalid_value", "metadata holds at most 16 pairs", param)
    for key, item in value.items():
        if len(key) > 64 or not isinstance(item, str) or len(item) > 512:
            raise ProtocolError(
                "invalid_value", "metadata maps keys of up to 64 characters to strings of up to 512", f"{param}.{key}"
            )
    return dict(value)


def typed(value: Any, kind: type, param: str) -> Any:
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ProtocolError("invalid_value", f"{param} must be of type {kind.__name__}", param)
    return value


def known(obj: dict[str, Any], names: frozenset[str] | set[str], param: str) -> None:
    """Refuses the first key of ``obj`` outside ``names``, in OpenAI's wording."""
    for key in obj:
        if key not in names:
            raise ProtocolError("unknown_parameter", f"Unknown parameter: '{param}.{key}'.", f"{param}.{key}")


def output_modalities(value: Any, param: str) -> None:
    typed(value, list, param)
    if "audio" not in value or not all(m in ("audio", "text") for m in value):
        raise ProtocolError("invalid_value", "only audio output is served", param)


def max_output_tokens(value: Any, param: str) -> None:
    if value != "inf":
        raise ProtocolError(
            "invalid_value",
            f"only max_output_tokens 'inf' is served (replies are audio, not counted in tokens), got {value!r}",
            param,
        )


def speed(value: Any, param: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != 1.0:
        raise ProtocolError("invalid_value", f"only speed 1.0 is served, got {value!r}", param)


def tools(value: Any, param: str) -> tuple:
    """Function tools, echoed: these models never call one. MCP tools are refused."""
    typed(value, list, param)
    for i, tool in enumerate(value):
        at = f"{param}[{i}]"
        typed(tool, dict, at)
        if tool.get("type") != "function":
            raise ProtocolError("invalid_value", f"only function tools are accepted, got type {tool.get('type')!r}", f"{at}.type")
        known(tool, {"type", "name", "description", "parameters"}, at)
        typed(tool.get("name"), str, f"{at}.name")
        if "description" in tool:
            typed(tool["description"], str, f"{at}.description")
        if "parameters" in tool:
            typed(tool["parameters"], dict, f"{at}.parameters")
    return tuple(value)


def tool_choice(value: Any, param: str) -> str:
    if value not in ("auto", "none"):
        raise ProtocolError(
            "invalid_value",
            f"tool_choice must be 'auto' or 'none' (these models never call a tool), got {value!r}",
            param,
        )
    return value


def prompt(value: Any, param: str) -> Any:
    if value is None:
        return None
    typed(value, dict, param)
    known(value, {"id", "version", "variables"}, param)
    typed(value.get("id"), str, f"{param}.id")
    if value.get("version") is not None:
        typed(value["version"], str, f"{param}.version")
    if value.get("variables") is not None:
        typed(value["variables"], dict, f"{param}.variables")
    return value


def _tracing(value: Any) -> Any:
    param = "session.tracing"
    if value is None or value == "auto":
        return value
    typed(value, dict, param)
    known(value, {"workflow_name", "group_id", "metadata"}, param)
    for name in ("workflow_name", "group_id"):
        if value.get(name) is not None:
            typed(value[name], str, f"{param}.{name}")
    return value


def _truncation(value: Any) -> Any:
    param = "session.truncation"
    if value in ("auto", "disabled"):
        return value
    typed(value, dict, param)
    known(value, {"type", "retention_ratio", "token_limits"}, param)
    if value.get("type") != "retention_ratio":
        raise ProtocolError("invalid_value", "truncation must be 'auto', 'disabled' or a retention_ratio object", f"{param}.type")
    ratio = value.get("retention_ratio")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
        raise ProtocolError("invalid_value", "retention_ratio must be a number in [0, 1]", f"{param}.retention_ratio")
    return value


def _include(value: Any) -> tuple | None:
    param = "session.include"
    if value is None:
        return None
    typed(value, list, param)
    for i, entry in enumerate(value):
        if entry != "item.input_audio_transcription.logprobs":
            raise ProtocolError("invalid_value", f"unknown include entry {entry!r}", f"{param}[{i}]")
    return tuple(value)


def _transcription(value: Any) -> Any:
    param = "session.audio.input.transcription"
    if value is None:
        return None
    typed(value, dict, param)
    known(value, {"model", "language", "prompt"}, param)
    for name in ("model", "language", "prompt"):
        if name in value:
            typed(value[name], str, f"{param}.{name}")
    return value


def _noise_reduction(value: Any) -> Any:
    param = "session.audio.input.noise_reduction"
    if value is None:
        return None
    typed(value, dict, param)
    known(value, {"type"}, param)
    if value.get("type") not in ("near_field", "far_field"):
        raise ProtocolError("invalid_value", "noise_reduction.type must be 'near_field' or 'far_field'", f"{param}.type")
    return value


def _turn_detection(value: Any, param: str) -> TurnDetection | None:
    if value is None:
        return None
    typed(value, dict, param)
    kind = value.get("type", "server_vad")
    base = TurnDetection()
    flags = {}
    for name in ("create_response", "interrupt_response"):
        flags[name] = typed(value.get(name, getattr(base, name)), bool, f"{param}.{name}")
    if kind == "semantic_vad":
        known(value, _SEMANTIC_VAD_FIELDS, param)
        eagerness = value.get("eagerness", "auto")
        if eagerness not in EAGERNESS_SILENCE_MS:
            raise ProtocolError("invalid_value", f"eagerness must be one of {sorted(EAGERNESS_SILENCE_MS)}", f"{param}.eagerness")
        return TurnDetection(silence_duration_ms=EAGERNESS_SILENCE_MS[eagerness], **flags)
    if kind != "server_vad":
        raise ProtocolError("invalid_value", "turn_detection.type must be 'server_vad' or 'semantic_vad'", f"{param}.type")
    known(value, _SERVER_VAD_FIELDS, param)
    if value.get("idle_timeout_ms") is not None:
        raise ProtocolError("invalid_value", "idle_timeout_ms is not served (no idle timeout events)", f"{param}.idle_timeout_ms")
    threshold = value.get("threshold", base.threshold)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
        raise ProtocolError("invalid_value", "threshold must be a number in [0, 1]", f"{param}.threshold")
    ints = {}
    for name in ("prefix_padding_ms", "silence_duration_ms"):
        v = value.get(name, getattr(base, name))
        if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v > 10_000:
            raise ProtocolError("invalid_value", f"{name} must be an integer in [0, 10000]", f"{param}.{name}")
        ints[name] = v
    return TurnDetection(threshold=float(threshold), **ints, **flags)
