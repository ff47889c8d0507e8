"""A ``playback.ack``, checked: how much of a response the client says it played.

Two shapes name the same number: ours (``response_id``, ``audio_end_ms``) and vLLM-Omni's
(``played_ms``, ``committed_ms``, optional ``response_id`` and ``item_id``); the codec already
requires one of the two names and that they agree (``codec._ONE_OF``).
"""

from __future__ import annotations

from ..protocol import ProtocolError, client_commands, quoted


def ack_played_ms(cmd: client_commands.PlaybackAck, response_id: str, item_id: str, delivered_ms: int) -> int:
    """The ack's played time for the response ``response_id`` (whose item is ``item_id`` and which
    has sent ``delivered_ms`` of audio), capped at what it sent; ProtocolError naming the field."""
    if cmd.item_id is not None and cmd.item_id != item_id:
        raise ProtocolError(
            "invalid_value",
            f"item {quoted(cmd.item_id)} is not response {quoted(response_id)}'s ({item_id!r})",
            "item_id",
        )
    played = cmd.audio_end_ms if cmd.audio_end_ms is not None else cmd.played_ms
    assert played is not None, "the codec requires audio_end_ms or played_ms"
    for name, value in (("played_ms", played), ("committed_ms", cmd.committed_ms)):
        if value is not None and not 0 <= value < float("inf"):
            raise ProtocolError("invalid_value", f"{name} must be a finite number of ms, at least 0", name)
    if cmd.committed_ms is not None and cmd.committed_ms > played:
        raise ProtocolError("invalid_value", f"committed_ms {cmd.committed_ms!r} is past played_ms {played!r}", "committed_ms")
    return min(int(played), delivered_ms)
