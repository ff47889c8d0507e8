"""Where a plugin's sessions run: ``slots.py``, sessions as the slots of one batched model
(admission is a free slot; every slot with a frame waiting runs it in one shared call);
``heap.py``, the serving process's garbage collector (its pauses counted, the startup heap
left out of later collections)."""

from .slots import SlotScheduler, SlotsFull

__all__ = ["SlotScheduler", "SlotsFull"]
