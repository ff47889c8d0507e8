"""How a model stream hands out the text it speaks (Moshi's text tokens, detokenized, say).

A stream that produces text with its audio defines ``take_text()``: the text its latest ``step``
produced, already detokenized ("" for none). The session calls it in the same worker-thread call,
right after each ``step``, and sends what it gets as ``response.output_audio_transcript.delta``
after that chunk's audio (and the whole as ``response.output_audio_transcript.done`` and in the
reply's item). A stream without it has no text, and the session sends no transcript events.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class TextSource(Protocol):
    def take_text(self) -> str:
        """The text of the latest ``step``'s chunk ("" for none)."""


def text_of(stream: object) -> Callable[[], str] | None:
    """``stream``'s ``take_text``, or None for a stream that produces no text."""
    take = getattr(stream, "take_text", None)
    return take if callable(take) else None
