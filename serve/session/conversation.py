"""The conversation piece of a ``Session``: its history of items, and the conversation.item.*
commands (create, retrieve, truncate, delete). Each item's JSON counts against the input budget;
a committed user turn's audio is kept with its item until the budget needs the room."""

from __future__ import annotations

import json

from ..protocol import ProtocolError, client_commands, quoted
from ..protocol import audio as wire_audio
from ..protocol import events as ev
from .base import SessionBase, new_id


class Conversation(SessionBase):
    def _add_item(self, item: dict, previous: str | None, done: bool = True) -> None:
        index = 0
        if previous is not None:
            after = self._find(previous)
            assert after is not None, f"{previous}: the callers name an item of the history (checked, or its last)"
            index = self.history.index(after) + 1
        self.history.insert(index, item)
        self._measure(item)
        self.ledgers.history_items = len(self.history)
        self.emit(ev.ConversationItemAdded(item=item, previous_item_id=previous))
        if done:
            self.emit(ev.ConversationItemDone(item=item, previous_item_id=previous))

    def _measure(self, item: dict) -> None:
        """Count ``item``'s JSON against the input budget (again, when it has changed)."""
        size = len(json.dumps(item, separators=(",", ":")))
        self._items_bytes += size - self._item_bytes.get(item["id"], 0)
        self._item_bytes[item["id"]] = size

    def _find(self, item_id: str) -> dict | None:
        return next((item for item in self.history if item["id"] == item_id), None)

    def _require_item(self, item_id: str, verb: str) -> dict:
        """The item, or OpenAI's error for ``verb`` (retrieve, truncate, delete) on a missing one."""
        item = self._find(item_id)
        if item is None:
            raise ProtocolError(
                f"item_{verb}_invalid_item_id",
                f"Error {verb.removesuffix('e')}ing item: the item with id {quoted(item_id)} does not exist.",
                "item_id",
            )
        return item

    async def _item_create(self, cmd: client_commands.ConversationItemCreate) -> None:
        item = dict(cmd.item)
        if any(i["id"] == item.get("id") for i in self.history):
            raise ProtocolError("item_create_duplicate_item_id", f"Item with id {quoted(item['id'])} already exists.", "item.id")
        previous = cmd.previous_item_id
        if previous is not None and previous != "root" and self._find(previous) is None:
            raise ProtocolError("item_not_found", f"no item {quoted(previous)}", "previous_item_id")
        item.setdefault("id", new_id("item"))
        item["object"] = "realtime.item"
        item.setdefault("status", "completed")
        self._kept()
        if previous is None:
            previous = self.history[-1]["id"] if self.history else None
        elif previous == "root":  # GA: insert at the start of the conversation
            previous = None
        self._add_item(item, previous)

    async def _item_retrieve(self, cmd: client_commands.ConversationItemRetrieve) -> None:
        item = self._require_item(cmd.item_id, "retrieve")
        if cmd.item_id in self._user_audio:
            audio = wire_audio.b64encode(self._user_audio[cmd.item_id])
            item = {**item, "content": [{"type": "input_audio", "transcript": None, "audio": audio}]}
        self.emit(ev.ConversationItemRetrieved(item=item))

    async def _item_truncate(self, cmd: client_commands.ConversationItemTruncate) -> None:
        self._require_item(cmd.item_id, "truncate")
        response = next((r for r in self.responses.values() if r.item_id == cmd.item_id), None)
        if response is None:
            raise ProtocolError("invalid_value", "only assistant audio items can be truncated", "item_id")
        if cmd.content_index != 0:
            raise ProtocolError("invalid_value", "assistant audio items have one content part", "content_index")
        played_ms = response.output_format.ms(response.out_samples)
        if cmd.audio_end_ms > played_ms:
            raise ProtocolError(
                "invalid_value", f"audio_end_ms {cmd.audio_end_ms} is past the item's {played_ms} ms", "audio_end_ms"
            )
        self.ledgers.playback.truncated_ms += played_ms - cmd.audio_end_ms
        self.emit(ev.ConversationItemTruncated(item_id=cmd.item_id, content_index=0, audio_end_ms=cmd.audio_end_ms))

    async def _item_delete(self, cmd: client_commands.ConversationItemDelete) -> None:
        item = self._require_item(cmd.item_id, "delete")
        self.history.remove(item)
        self._user_audio_bytes -= len(self._user_audio.pop(cmd.item_id, b""))
        self._items_bytes -= self._item_bytes.pop(cmd.item_id)
        self.ledgers.history_items = len(self.history)
        self.emit(ev.ConversationItemDeleted(item_id=cmd.item_id))
