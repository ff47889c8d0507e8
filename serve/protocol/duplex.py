"""vLLM-Omni's duplex extension of the session object, on duplex connections only.

vLLM-Omni's ``DuplexClient`` (0.30.0) and its presets send, beside the GA fields, the top-level
``sample_rate_hz`` (the input rate), ``audio.input.sample_rate_hz``, ``audio.output.sample_rate_hz``,
``extra_body``, and, as set, ``ref_audio``, ``overlap_policy``, ``playback_commit_policy``,
``temperature`` and ``idle_timeout_s``; the formats as beta strings (``pcm16``, ``pcm_f32le``).
``apply_duplex`` takes them out of the patch, applies or refuses each by name, and hands the rest
to ``SessionConfig.apply``. A plain Realtime connection never gets here: there a field GA does not
define stays ``unknown_parameter``.

The session object a duplex connection is sent reports them back (``duplex_session_fields``),
with ``capabilities``: what this server does for the client (``chunk_period_ms``, the model's
native frame, is what vLLM-Omni's client paces its input units by).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any

from . import client_commands
from .audio import BETA_NAME, AudioFormat, duplex_format
from .codec import command_from_object
from .config import SessionConfig, typed
from .errors import ProtocolError, quoted

OVERLAP_POLICIES = ("barge_in_on_speech", "listen_only")
PLAYBACK_COMMIT_POLICIES = ("commit_all_on_done", "ack_only")
_TOP_LEVEL = (
    "sample_rate_hz",
    "extra_body",
    "ref_audio",
    "overlap_policy",
    "playback_commit_policy",
    "temperature",
    "idle_timeout_s",
)
_EXTRA_BODY = frozenset({"auto_response", "force_listen_count"})
# What a turn.signal may name: the commands it is an envelope for (vLLM-Omni's list, less its text input).
SIGNALLED = (
    client_commands.BargeInCommand,
    client_commands.InputCancel,
    client_commands.ResponseCancel,
    client_commands.SessionUpdate,
    client_commands.ConversationItemCreate,
    client_commands.ConversationItemDelete,
    client_commands.ConversationItemTruncate,
    client_commands.ConversationItemRetrieve,
)


@dataclass(frozen=True)
class DuplexSettings:
    """What the duplex fields set beyond the GA config.

    ``auto_response``: a final commit without ``response_create`` asks for a response (vLLM-Omni's
    default flow: append, commit, read the response). ``overlap_policy``: ``listen_only`` keeps a
    reply playing when the server VAD hears speech over it (no barge-in);
    ``barge_in_on_speech`` lets the VAD's ``interrupt_response`` cut it. ``playback_commit_policy``
    is echoed: the models keep what they said in their own state, so what the history holds of a
    reply changes nothing they hear."""

    auto_response: bool = False
    overlap_policy: str = "barge_in_on_speech"
    playback_commit_policy: str = "commit_all_on_done"
    force_listen_count: int | None = None
    # A client's voice WAV from ``ref_audio`` and the voice name it goes under, until the session
    # has handed it to its stream (``upload_voice``).
    ref_audio: tuple[str, bytes] | None = dataclasses.field(default=None, repr=False)

    def handed_over(self) -> DuplexSettings:
        """These settings once the session has handed ``ref_audio``'s WAV to its stream."""
        return dataclasses.replace(self, ref_audio=None)


def apply_duplex(
    patch: dict[str, Any], config: SessionConfig, settings: DuplexSettings, model_name: str, takes_voice: bool = False
) -> tuple[SessionConfig, DuplexSettings]:
    """``patch`` (a duplex connection's ``session.update`` ``session``) applied to both; raises
    ProtocolError naming the field. ``takes_voice``: the model takes a client's voice WAV, so a
    ``ref_audio`` becomes the session's voice, named by its content hash (``ref_audio-`` and the
    SHA-256's first 16 hex digits),
    with the WAV in ``settings.ref_audio`` for the session to hand to its stream; otherwise it is
    refused by name."""
    patch = dict(patch)
    own = {key: patch.pop(key) for key in _TOP_LEVEL if key in patch}
    audio = patch.get("audio")
    rates: dict[str, Any] = {}
    if isinstance(audio, dict):
        audio = dict(audio)
        for side in ("input", "output"):
            block = audio.get(side)
            if isinstance(block, dict) and "sample_rate_hz" in block:
                block = dict(block)
                rates[side] = block.pop("sample_rate_hz")
                audio[side] = block
        patch["audio"] = audio
    input_rate = _agreed(own.get("sample_rate_hz"), rates.get("input"))
    _format_with_rate(patch, "input", input_rate, config.input_format)
    _format_with_rate(patch, "output", rates.get("output"), config.output_format)
    config = config.apply(patch, duplex=True)
    changes: dict[str, Any] = {}
    for name, allowed in (("overlap_policy", OVERLAP_POLICIES), ("playback_commit_policy", PLAYBACK_COMMIT_POLICIES)):
        value = own.get(name)
        if value is not None:
            if value not in allowed:
                raise ProtocolError(
                    "invalid_value", f"{name} must be one of {list(allowed)}, got {quoted(value)}", f"session.{name}"
                )
            changes[name] = value
    if own.get("ref_audio") is not None:
        if not takes_voice:
            raise ProtocolError(
                "unsupported_feature",
                f"ref_audio is not served: {model_name} has no voice cloning (session.audio.output.voice names a voice)",
                "session.ref_audio",
            )
        wav = ref_audio_wav(own["ref_audio"])
        name = "ref_audio-" + hashlib.sha256(wav).hexdigest()[:16]  # the model keys its cache by the whole hash
        config = dataclasses.replace(config, voice=name)
        changes["ref_audio"] = (name, wav)
    if own.get("temperature") is not None:
        raise ProtocolError(
            "unsupported_feature",
            f"temperature is not served: {model_name} samples with the settings it was started with",
            "session.temperature",
        )
    if own.get("idle_timeout_s") is not None:
        raise ProtocolError(
            "unsupported_feature",
            "idle_timeout_s is not served: a session's idle limit is the server's (Limits.idle_ttl_s)",
            "session.idle_timeout_s",
        )
    extra = own.get("extra_body")
    if extra is not None:
        changes.update(_extra_body(typed(extra, dict, "session.extra_body")))
    return config, dataclasses.replace(settings, **changes)


REF_AUDIO_TYPES = ("audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave")


def ref_audio_wav(value: Any) -> bytes:
    """The WAV bytes of a ``ref_audio`` as vLLM-Omni's client sends it (``audio_data_url``:
    ``data:audio/wav;base64,<the file>``). A path or URL (``file://``, ``http://``) is refused: the
    server reads no file the client names. What the WAV itself may be is the model's to check."""
    where = "session.ref_audio"
    value = typed(value, str, where)
    head, comma, payload = value.partition(",")
    if not head.startswith("data:") or not comma:
        raise ProtocolError(
            "invalid_value",
            f"ref_audio must be a data URL (data:audio/wav;base64,<WAV bytes>), got "
            f"{quoted(value[:40])}{'...' if len(value) > 40 else ''}: this server reads no path or URL",
            where,
        )
    mime, *params = head.removeprefix("data:").split(";")
    if mime not in REF_AUDIO_TYPES or params != ["base64"]:
        raise ProtocolError(
            "invalid_value",
            f"ref_audio is {quoted(head[:60])}; expected a base64 data URL of a WAV "
            f"file ({' or '.join(REF_AUDIO_TYPES)}, then ;base64)",
            where,
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError("invalid_value", "ref_audio's payload is not valid base64", where) from None


def _agreed(top: Any, nested: Any) -> Any:
    if top is not None and nested is not None and top != nested:
        raise ProtocolError(
            "invalid_value",
            f"sample_rate_hz {quoted(top)} and audio.input.sample_rate_hz {quoted(nested)} disagree",
            "session.audio.input.sample_rate_hz",
        )
    return nested if nested is not None else top


def _format_with_rate(patch: dict[str, Any], side: str, rate: Any, current: AudioFormat) -> None:
    """Fold a declared rate and a beta format name into the GA format object ``SessionConfig.apply``
    reads (``audio.input.format``: ``{"type": "audio/pcm", "rate": 16000}``). A name without a rate
    keeps the current rate if it names the current encoding, else takes the name's default."""
    audio = patch.get("audio", {})
    block = audio.get(side, {}) if isinstance(audio, dict) else None
    if not isinstance(block, dict):
        return  # not an object: SessionConfig.apply names it
    beta = f"{side}_audio_format"
    fmt = block.get("format")
    if fmt is None and rate is None and not isinstance(patch.get(beta), str):
        return  # nothing of the extension's: GA's own reading
    if fmt is None:
        fmt = patch.pop(beta, None) or BETA_NAME[current.encoding]
        if rate is None and fmt == BETA_NAME[current.encoding]:
            rate = current.rate
    param = f"session.audio.{side}.format"
    if isinstance(fmt, dict):
        if rate is not None and fmt.get("rate", rate) != rate:
            raise ProtocolError(
                "invalid_value",
                f"audio.{side}.format.rate {quoted(fmt.get('rate'))} and sample_rate_hz {quoted(rate)} disagree",
                f"session.audio.{side}.sample_rate_hz",
            )
        wire = fmt if rate is None else {**fmt, "rate": rate}
    else:
        wire = duplex_format(fmt, rate, param).to_wire()
    patch["audio"] = {**audio, side: {**block, "format": wire}}


def _extra_body(extra: dict[str, Any]) -> dict[str, Any]:
    changes: dict[str, Any] = {}
    for key, value in extra.items():
        if key not in _EXTRA_BODY:
            raise ProtocolError(
                "unknown_parameter",
                f"Unknown parameter: 'session.extra_body.{key}'. Served: {sorted(_EXTRA_BODY)}.",
                f"session.extra_body.{key}",
            )
    if "auto_response" in extra:
        changes["auto_response"] = typed(extra["auto_response"], bool, "session.extra_body.auto_response")
    if "force_listen_count" in extra:
        count = extra["force_listen_count"]
        if count != 0 or isinstance(count, bool):
            raise ProtocolError(
                "unsupported_feature",
                f"force_listen_count {quoted(count)} is not served: the models here take no forced listen "
                "units (0, the MiniCPM-o preset's, is accepted)",
                "session.extra_body.force_listen_count",
            )
        changes["force_listen_count"] = 0
    return changes


def duplex_session_fields(config: SessionConfig, settings: DuplexSettings, capabilities: dict[str, Any]) -> dict[str, Any]:
    """The extension fields of a duplex connection's session object (beside the GA ones)."""
    extra: dict[str, Any] = {"auto_response": settings.auto_response}
    if settings.force_listen_count is not None:
        extra["force_listen_count"] = settings.force_listen_count
    return {
        "input_audio_format": BETA_NAME[config.input_format.encoding],
        "output_audio_format": BETA_NAME[config.output_format.encoding],
        "sample_rate_hz": config.input_format.rate,
        "overlap_policy": settings.overlap_policy,
        "playback_commit_policy": settings.playback_commit_policy,
        "extra_body": extra,
        "capabilities": capabilities,
    }


def capabilities(frame_samples: int, input_rate: int, output_rate: int) -> dict[str, Any]:
    """What the server does for a duplex client, in vLLM-Omni's names; each one true here."""
    return {
        "chunk_period_ms": frame_samples * 1000 // input_rate,
        "model_input_sample_rate_hz": input_rate,
        "model_output_sample_rate_hz": output_rate,
        "supports_client_commit": True,
        "supports_barge_in": True,
        "supports_playback_ack": True,
        "supports_session_resume": True,
        "supports_external_turn_signal": True,
        "supports_text_only_turn": False,
        "supports_image_input": False,
        "required_input_modalities": ["audio"],
        "optional_input_modalities": [],
    }


def signalled_command(cmd: client_commands.TurnSignal) -> client_commands.ClientCommand:
    """The command a ``turn.signal`` carries: ``event`` with ``payload``'s fields, decoded as a frame
    of its own would be (errors name ``payload.<field>``); one it may not carry is refused by name."""
    inner = command_from_object({**(cmd.payload or {}), "type": cmd.event}, at="payload.")
    if not isinstance(inner, SIGNALLED):
        raise ProtocolError(
            "unsupported_feature",
            f"turn.signal does not carry {quoted(cmd.event)}; it carries {', '.join(c.TYPE for c in SIGNALLED)}",
            "event",
        )
    return inner
