"""The service's part of the generated docs: the blocks of docs/service.md, written from the
service's event classes, error codes and limits (and, for the GA events the service does not send,
from the `openai` SDK's event types). The core's doc generator (`cadence_fx/docs.py`) imports no
service code: it names `service_blocks` in the core command line's `SERVICE` table."""

from __future__ import annotations

import dataclasses
import types
import typing

__all__ = ["service_blocks"]


def _fields(cls) -> str:
    from cadence_fx.serve.protocol.tiers import is_tier2

    names = []
    for f in dataclasses.fields(cls):
        if f.name in ("event_id", "server_event_seq", "session_id") and f.name not in cls.__annotations__:
            continue  # the fields every command or event has, listed once in the prose
        names.append(f"`{f.name}`" + (" (tier 2)" if is_tier2(f) else ""))
    return ", ".join(names) or "-"


def _ga_types(annotation) -> list[str]:
    """The `type` literals of the openai SDK's event models in a (discriminated) union."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _ga_types(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [name for member in typing.get_args(annotation) for name in _ga_types(member)]
    return [typing.get_args(annotation.model_fields["type"].annotation)[0]]


def service_blocks() -> dict[str, str]:
    """The generated blocks of docs/service.md, by name."""
    from openai.types.realtime import RealtimeClientEvent, RealtimeServerEvent

    from cadence_fx.serve.protocol import client_commands, events
    from cadence_fx.serve.protocol.errors import ERROR_CODES
    from cadence_fx.serve.session import Limits

    commands = ["| command | tier | fields |", "|---|---|---|"] + [
        f"| `{name}` | {cls.TIER} | {_fields(cls)} |" for name, cls in client_commands.COMMANDS.items()
    ]
    served = ["| event | tier | replayed on resume | fields |", "|---|---|---|---|"] + [
        f"| `{name}` | {cls.TIER} | {'yes' if cls.JOURNALED else 'no'} | {_fields(cls)} |" for name, cls in events.EVENTS.items()
    ]
    not_sent = sorted(set(_ga_types(RealtimeServerEvent)) - set(events.EVENTS))
    not_read = sorted(set(_ga_types(RealtimeClientEvent)) - set(client_commands.COMMANDS))
    ga = [
        f"GA server events never sent ({len(not_sent)}): " + ", ".join(f"`{t}`" for t in not_sent) + ".",
        "",
        "GA client events answered with `unknown_event_type` "
        f"({len(not_read)}): " + (", ".join(f"`{t}`" for t in not_read) or "none") + ".",
    ]
    defaults = Limits()
    limits = ["| limit | default |", "|---|---|"] + [
        f"| `{f.name}` | `{getattr(defaults, f.name)}` |" for f in dataclasses.fields(Limits)
    ]
    return {
        "commands": "\n".join(commands),
        "events": "\n".join(served),
        "ga_unserved": "\n".join(ga),
        "errors": ", ".join(f"`{code}`" for code in sorted(ERROR_CODES)),
        "limits": "\n".join(limits),
    }
