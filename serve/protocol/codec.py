"""The one codec between typed commands/events and Realtime JSON.

``decode_command`` is total: any text either becomes a well-typed ``ClientCommand`` or raises a
``ProtocolError`` naming the code and the offending field, never anything else.

A command with a lone UTF-16 surrogate in any string (a ``\\udXXX`` escape without its pair, or
one encoded in a binary frame's UTF-8) is refused (``invalid_value``, naming the field): the
string is valid JSON but not valid Unicode, and kept, it would be echoed back (an item, the
instructions) as an escape that strict JSON parsers refuse. Refused at the door, no event the
server sends can carry one.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import types
import typing
from typing import Any

from .client_commands import COMMANDS, ClientCommand
from .config import known
from .errors import ProtocolError, quoted
from .events import EVENTS, ServerEvent
from .tiers import is_tier2

# Ids a client names: longer ones are refused, so no id a session keeps or echoes is unbounded.
MAX_ID_CHARS = 256
_ID_FIELDS = {"event_id", "session_id", "item_id", "previous_item_id", "response_id", "resume_token"}
# A surrogate code point in a Python string decoded from JSON: a pair of escapes decodes to the one
# character it encodes, so any left is a lone one.
_SURROGATE = re.compile("[\ud800-\udfff]")


@functools.cache
def _field_specs(cls: type) -> tuple[tuple[str, tuple[type, ...], bool, bool], ...]:
    """(name, accepted python types, optional, required) for every dataclass field of ``cls``."""
    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        optional = type(None) in args
        kinds = tuple(a for a in args if a is not type(None))
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        specs.append((f.name, kinds, optional, required))
    return tuple(specs)


def _check(value: Any, kinds: tuple[type, ...], optional: bool, param: str) -> None:
    if value is None:
        if not optional:
            raise ProtocolError("invalid_value", f"{param} must not be null", param)
        return
    if isinstance(value, bool) and bool not in kinds:
        raise ProtocolError("invalid_value", f"{param} must be of type {kinds[0].__name__}", param)
    if not isinstance(value, kinds):
        raise ProtocolError("invalid_value", f"{param} must be of type {kinds[0].__name__}", param)
    if isinstance(value, int) and not isinstance(value, bool) and value < 0:
        raise ProtocolError("invalid_value", f"{param} must not be negative", param)
    if param.rsplit(".", 1)[-1] in _ID_FIELDS:
        assert isinstance(value, str), f"{param}: every id field of a command is typed str"
        _check_id(value, param)


def _check_id(value: str, param: str) -> None:
    if len(value) > MAX_ID_CHARS:
        raise ProtocolError(
            "invalid_value", f"{param} is {len(value)} characters long, at most {MAX_ID_CHARS} are accepted", param
        )


def _parse_object(text: str | bytes) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError("invalid_json", f"frame is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("invalid_json", "frame must be a JSON object")
    return obj


def _surrogate_in(text: str) -> re.Match | None:
    # An ASCII string (base64 audio, ids) holds none, and Python knows it is ASCII without a scan.
    return None if text.isascii() else _SURROGATE.search(text)


def _may_hold_surrogate(text: str | bytes, obj: dict[str, Any]) -> bool:
    """False when ``obj`` (decoded from ``text``) surely holds no lone surrogate, cheaply: only an
    escape (a backslash) or a character beyond ASCII can bring one, and most frames (audio
    appends, in base64) have neither; of those that do, only one that UTF-8 cannot encode back
    holds one (a check at C speed, where the walk that names the string costs a microsecond for
    each object and list in the frame)."""
    escaped = "\\" in text if isinstance(text, str) else b"\\" in text
    if not escaped and text.isascii():
        return False
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _lone_surrogate(obj: dict[str, Any]) -> ProtocolError | None:
    """The error naming a string of ``obj`` (a key or a value) that holds a lone surrogate, or
    None; an object's or list's own strings are looked at before those nested deeper. Iterative,
    as a frame may nest as deep as ``json`` allows; a place is kept as (its parent's place, its
    key or index), spelled out only for the error."""
    pending: list[tuple[dict | list, tuple | None]] = [(obj, None)]
    while pending:
        value, at = pending.pop()
        if isinstance(value, dict):
            found = next((f for f in map(_surrogate_in, value) if f is not None), None)
            if found is not None:
                return _surrogate_error(found, at, key=True)
            entries: Any = value.items()
        else:
            entries = enumerate(value)
        nested = []
        for step, item in entries:
            if isinstance(item, str):
                found = _surrogate_in(item)
                if found is not None:
                    return _surrogate_error(found, (at, step))
            elif isinstance(item, (dict, list)):
                nested.append((item, (at, step)))
        pending += reversed(nested)
    return None


def _surrogate_error(found: re.Match, at: tuple | None, key: bool = False) -> ProtocolError:
    path = _spelled(at)
    where = f"a key of {path or 'the frame'}" if key else path
    return ProtocolError(
        "invalid_value",
        f"{where} holds a lone UTF-16 surrogate (U+{ord(found.group()):04X} at character {found.start()}): "
        "strings must be valid Unicode, since strict JSON parsers refuse an unpaired surrogate "
        "(RFC 8259, section 8.2); send the text as UTF-8, or pair the surrogates",
        path or None,
    )


def _spelled(at: tuple | None) -> str:
    """A place of ``_lone_surrogate`` as a dotted path: ``item.content[1].text``."""
    parts: list[str] = []
    while at is not None:
        at, step = at
        parts.append(f"[{step}]" if isinstance(step, int) else f".{step}")
    return "".join(reversed(parts)).removeprefix(".")


def decode_command(text: str | bytes) -> ClientCommand:
    obj = _parse_object(text)
    event_id = obj.get("event_id")
    # Errors echo the client's event_id, unless it is the very thing that is wrong with the frame.
    client_event_id = (
        event_id if isinstance(event_id, str) and len(event_id) <= MAX_ID_CHARS and not _surrogate_in(event_id) else None
    )
    try:
        if _may_hold_surrogate(text, obj):
            lone = _lone_surrogate(obj)
            if lone is not None:
                raise lone
        return command_from_object(obj)
    except ProtocolError as err:
        err.event_id = client_event_id
        raise


def command_from_object(obj: dict[str, Any], at: str = "") -> ClientCommand:
    """A decoded JSON object as a typed command (its strings already checked); ``at``: where the
    object sits in its frame (``payload.`` for a ``turn.signal``'s), for the errors' ``param``."""
    kind = obj.get("type")
    if kind is None:
        raise ProtocolError("missing_field", "missing required field 'type'", f"{at}type")
    if not isinstance(kind, str):
        raise ProtocolError("invalid_value", "type must be a string", f"{at}type")
    cls = COMMANDS.get(kind)
    if cls is None:
        raise ProtocolError("unknown_event_type", f"unknown event type {quoted(kind)}", f"{at}type")
    values = {}
    # A class object is hashable; mypy checks the frozen dataclass's instance __hash__ instead.
    for name, kinds, optional, required in _field_specs(cls):  # type: ignore[arg-type]
        if name not in obj:
            if required:
                raise ProtocolError("missing_field", f"{kind} requires field {name!r}", f"{at}{name}")
            continue
        _check(obj[name], kinds, optional, f"{at}{name}")
        values[name] = obj[name]
    if cls.TYPE == "conversation.item.create":
        _check_item(values["item"])
    for first, second in _ONE_OF.get(cls.TYPE, ()):
        _one_of(kind, values, first, second, at)
    return cls(**values)


# Commands that take a number under either of two names (ours, vLLM-Omni's): one is required, and
# both must agree.
_ONE_OF = {
    "session.resume": (("last_server_event_seq", "last_received_server_event_seq"),),
    "playback.ack": (("audio_end_ms", "played_ms"),),
}


def _one_of(kind: str, values: dict[str, Any], first: str, second: str, at: str) -> None:
    a, b = values.get(first), values.get(second)
    if a is None and b is None:
        raise ProtocolError("missing_field", f"{kind} requires field {first!r} (or {second!r})", f"{at}{first}")
    if a is not None and b is not None and a != b:
        raise ProtocolError("invalid_value", f"{first} {a!r} and {second} {b!r} disagree", f"{at}{second}")


# GA item shapes: per item type, its own fields (beyond id, type, object, status) and which of them
# are required; per message role, the content part types it may carry.
_ITEM_COMMON = {"id", "type", "object", "status"}
_ITEM_FIELDS = {
    "message": ({"role", "content"}, {"role", "content"}),
    "function_call": ({"name", "arguments", "call_id"}, {"name", "arguments"}),
    "function_call_output": ({"call_id", "output"}, {"call_id", "output"}),
}
_PARTS = {
    "system": {"input_text"},
    "user": {"input_text", "input_audio", "input_image"},
    "assistant": {"output_text", "output_audio"},
}
_PART_FIELDS = {"type", "text", "audio", "transcript", "image_url", "detail"}


def _check_item(item: dict[str, Any]) -> None:
    """``item`` has one GA conversation item's shape, or a ProtocolError names the field."""
    kind = item.get("type")
    if kind not in _ITEM_FIELDS:
        raise ProtocolError("invalid_value", f"item.type must be one of {sorted(_ITEM_FIELDS)}", "item.type")
    own, required = _ITEM_FIELDS[kind]
    known(item, own | _ITEM_COMMON, "item")
    for key in sorted(required):
        if key not in item:
            raise ProtocolError("missing_field", f"a {kind} item requires field {key!r}", f"item.{key}")
    for key in ("id", "name", "arguments", "call_id", "output"):
        if key in item and not isinstance(item[key], str):
            raise ProtocolError("invalid_value", f"item.{key} must be a string", f"item.{key}")
    if item.get("object", "realtime.item") != "realtime.item":
        raise ProtocolError("invalid_value", "item.object must be 'realtime.item'", "item.object")
    if item.get("status", "completed") not in ("completed", "incomplete", "in_progress"):
        raise ProtocolError("invalid_value", "item.status must be completed, incomplete or in_progress", "item.status")
    if "id" in item:
        _check_id(item["id"], "item.id")
    if kind != "message":
        return
    role = item["role"]
    if role not in _PARTS:
        raise ProtocolError("invalid_value", f"item.role must be one of {sorted(_PARTS)}", "item.role")
    content = item["content"]
    if not isinstance(content, list) or not all(isinstance(c, dict) for c in content):
        raise ProtocolError("invalid_value", "item.content must be a list of objects", "item.content")
    for i, part in enumerate(content):
        at = f"item.content[{i}]"
        if part.get("type") not in _PARTS[role]:
            raise ProtocolError(
                "invalid_value", f"a {role} message's content type must be one of {sorted(_PARTS[role])}", f"{at}.type"
            )
        known(part, _PART_FIELDS, at)
        for key, value in part.items():
            if key != "type" and value is not None and not isinstance(value, str):
                raise ProtocolError("invalid_value", f"{at}.{key} must be a string", f"{at}.{key}")


def event_to_dict(event: ServerEvent, *, duplex: bool) -> dict[str, Any]:
    """The JSON object of ``event``: Tier 2 fields only on duplex connections, never as null."""
    if event.TIER == 3 and not duplex:
        raise ValueError(f"{event.TYPE} is a duplex-only (Tier 3) event")
    out: dict[str, Any] = {"type": event.TYPE, "event_id": event.event_id}
    for f in dataclasses.fields(event):
        if f.name == "event_id":
            continue
        value = getattr(event, f.name)
        if is_tier2(f) and (not duplex or value is None):
            continue
        out[f.name] = value
    return out


def encode_event(event: ServerEvent, *, duplex: bool) -> str:
    return json.dumps(event_to_dict(event, duplex=duplex), separators=(",", ":"))


def decode_event(text: str | bytes) -> ServerEvent:
    """A server event from JSON (for clients); unknown extra fields are ignored."""
    obj = _parse_object(text)
    kind = obj.get("type")
    cls = EVENTS.get(kind) if isinstance(kind, str) else None  # a list or an object as the type: no event's
    if cls is None:
        raise ProtocolError("unknown_event_type", f"unknown event type {quoted(obj.get('type'))}", "type")
    names = {f.name for f in dataclasses.fields(cls)}
    try:
        return cls(**{k: v for k, v in obj.items() if k in names})
    except TypeError as exc:
        raise ProtocolError("missing_field", str(exc)) from None


def encode_command(command: ClientCommand) -> str:
    out: dict[str, Any] = {"type": command.TYPE}
    for f in dataclasses.fields(command):
        value = getattr(command, f.name)
        if value is not None:
            out[f.name] = value
    return json.dumps(out, separators=(",", ":"))
