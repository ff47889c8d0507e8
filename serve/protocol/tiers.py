"""The three tiers of the Realtime wire, as the command and event classes mark them.

Tier 1: OpenAI Realtime GA names and fields exactly.  Tier 2: the same names with our extra fields,
each made with ``tier2()`` and sent only on duplex connections.  Tier 3: our own names (a class's
``TIER = 3``), duplex connections only.  The classes: ``client_commands.py`` (what a client sends)
and ``events.py`` (what the server sends); ``codec`` is the only place that turns them into JSON
and back.
"""

from __future__ import annotations

from dataclasses import Field, field
from typing import Any

TIER2 = {"tier": 2}


def tier2(default: Any = None) -> Any:
    """A tier-2 field (ours, on a GA name), ``default`` unless given. Typed ``Any`` as
    ``dataclasses.field`` is, so that it stands for the field's value in the class body."""
    return field(default=default, metadata=TIER2)


def is_tier2(f: Field[Any]) -> bool:
    """Whether ``f`` was made with ``tier2()``: sent only on duplex connections, only when set."""
    return f.metadata.get("tier") == 2
