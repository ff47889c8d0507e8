"""Replay journal: a session's newest encoded events, by ``server_event_seq``, within a byte budget.

Encoded events are ASCII JSON, so a text's length is its size in bytes.
"""

from __future__ import annotations

from collections import deque


class Journal:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.last_seq = 0  # the newest seq handed out
        self._entries: deque[tuple[int, str]] = deque()
        self.bytes = 0
        self.evicted = 0  # entries dropped for room before the client acknowledged them

    def next_seq(self) -> int:
        self.last_seq += 1
        return self.last_seq

    def append(self, seq: int, text: str) -> None:
        assert seq == self.last_seq
        self._entries.append((seq, text))
        self.bytes += len(text)
        while self.bytes > self.max_bytes:
            self._drop()
            self.evicted += 1

    def ack(self, seq: int) -> None:
        while self._entries and self._entries[0][0] <= seq:
            self._drop()

    @property
    def oldest_seq(self) -> int:
        """The oldest seq still replayable (``last_seq + 1`` when the journal is empty)."""
        return self._entries[0][0] if self._entries else self.last_seq + 1

    def since(self, last_seen: int) -> list[str] | None:
        """Every event after ``last_seen`` in order, or None if any of them is gone (or never was)."""
        if last_seen > self.last_seq or last_seen + 1 < self.oldest_seq:
            return None
        return [text for seq, text in self._entries if seq > last_seen]

    def _drop(self) -> None:
        _, text = self._entries.popleft()
        self.bytes -= len(text)
