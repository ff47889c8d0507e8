"""The one exception the protocol layer raises: it becomes a Realtime ``error`` event."""

from __future__ import annotations

# An error never echoes more of a client's text than this: a message quotes at most
# QUOTED_CHARS of any client string, and is cut at MESSAGE_CHARS in all.
QUOTED_CHARS = 64
MESSAGE_CHARS = 512

# Every code the service sends, so clients and tests can match on them exactly.
ERROR_CODES = frozenset(
    {
        "invalid_json",
        "frame_too_large",
        "unknown_event_type",
        "unknown_parameter",
        "missing_field",
        "invalid_value",
        "invalid_base64",
        "invalid_audio_length",
        "unsupported_audio_format",
        "unsupported_in_realtime_mode",
        "session_not_found",
        "session_mismatch",
        "session_not_bound",
        "invalid_resume_token",
        "generation_mismatch",
        "resource_exhausted",
        "input_backpressure",
        "input_audio_buffer_commit_empty",
        "conversation_already_has_active_response",
        "response_cancel_not_active",
        "item_not_found",
        # OpenAI's codes for a missing or duplicate item, which clients match on (pipecat, livekit)
        "item_retrieve_invalid_item_id",
        "item_truncate_invalid_item_id",
        "item_delete_invalid_item_id",
        "item_create_duplicate_item_id",
        "server_error",
        # a duplex extension field or command this server does not serve, refused by name
        "unsupported_feature",
    }
)


class ProtocolError(Exception):
    """A client error with a stable ``code`` and the offending ``param`` (a dotted path)."""

    def __init__(self, code: str, message: str, param: str | None = None, event_id: str | None = None) -> None:
        assert code in ERROR_CODES, code
        message = message[:MESSAGE_CHARS]
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.event_id = event_id
        # An append refused after its audio was decoded: how many bytes it carried (the input ledger's
        # rejected_bytes). Zero for any other error.
        self.audio_bytes = 0

    @property
    def type(self) -> str:
        return "server_error" if self.code == "server_error" else "invalid_request_error"


def quoted(value: object) -> str:
    """A client-supplied value as an error message shows it: its ``repr``, cut to QUOTED_CHARS."""
    text = repr(value)
    if len(text) <= QUOTED_CHARS:
        return text
    return f"{text[:QUOTED_CHARS]}... ({len(text)} characters)"
