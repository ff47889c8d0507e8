"""A session's mailbox messages: what its owner task handles, one at a time, in arrival order.

Connections put commands, rejects, resumes, detaches and releases; the reply's task puts its end;
the manager's reaper puts ticks; the server's shutdown puts a stop. ``Chunk`` is not a mailbox
message: the reply's task hands each chunk to the fence itself (``ResponseFence._on_chunk``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ..protocol import ProtocolError, client_commands
from .transport import Transport


def b64_decoded_len(text: str) -> int:
    """Exact decoded length of valid base64 (an estimate for invalid input)."""
    pad = 2 if text.endswith("==") else 1 if text.endswith("=") else 0
    return max(0, len(text) * 3 // 4 - pad)


@dataclass
class Inbound:
    command: client_commands.ClientCommand
    transport: Transport
    pending_bytes: int = 0  # decoded audio of an append
    budgeted_bytes: int = 0  # the frame of a data command, while queued (the input budget)


@dataclass
class Reject:
    error: ProtocolError
    transport: Transport


@dataclass
class Chunk:  # not a mailbox message: the reply's task hands it to ``_on_chunk`` itself
    epoch: int
    response_id: str
    model_samples: int
    data: bytes
    text: str = ""  # what the model said with this chunk (a stream with ``take_text``)


@dataclass
class ReplyEnd:
    epoch: int
    response_id: str
    error: str | None


@dataclass
class Resume:
    command: client_commands.SessionResume
    transport: Transport
    future: asyncio.Future


@dataclass
class Detach:
    transport: Transport


@dataclass
class Release:
    transport: Transport


@dataclass
class Tick:
    pass


@dataclass
class Open:
    command: client_commands.SessionUpdate


@dataclass
class Stop:
    reason: str


@dataclass
class Lost:
    """The socket closed under a Realtime session (its client read too slowly, or is gone)."""


# Commands that bring data the session keeps or holds while they wait: the input budget covers them.
DATA_COMMANDS = (
    client_commands.InputAudioBufferAppend,
    client_commands.ConversationItemCreate,
    client_commands.SessionUpdate,
    client_commands.ResponseCreate,
    client_commands.TurnSignal,
)
