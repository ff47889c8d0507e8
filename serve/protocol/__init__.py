"""The Realtime wire: typed commands (client_commands) and events, the codec, session config and audio formats.

This layer imports no engine, model or web framework (tests/serve/test_import_boundary.py).
"""

from . import client_commands, events
from .audio import PCM24K, PCMA, PCMU, AudioFormat, StreamResampler, parse_format
from .codec import decode_command, decode_event, encode_command, encode_event, event_to_dict
from .config import ResponseParams, SessionConfig, TurnDetection
from .errors import ERROR_CODES, ProtocolError, quoted

__all__ = [
    "ERROR_CODES",
    "PCM24K",
    "PCMA",
    "PCMU",
    "AudioFormat",
    "ProtocolError",
    "ResponseParams",
    "SessionConfig",
    "StreamResampler",
    "TurnDetection",
    "client_commands",
    "decode_command",
    "decode_event",
    "encode_command",
    "encode_event",
    "event_to_dict",
    "events",
    "parse_format",
    "quoted",
]
