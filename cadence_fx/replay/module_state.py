"""The module state a replay checks on every call: each parameter and buffer of the callable's
modules at the address it had when the first class was captured (a graph reads them by address,
so a tensor rebound or whose storage was swapped is drift)."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch


class ModuleState:
    """Where `modules` hold their parameters and buffers, and the addresses a replay expects there."""

    def __init__(self, modules: Sequence[torch.nn.Module]):
        self.modules = list(modules)
        self.places: list[tuple[dict, str, str]] = []  # remembered at the first capture
        self.ptrs: list[int] = []
        self.tables: list[dict] = []  # the places, split for C-level passes
        self.names: list[str] = []
        self.tensors: list[torch.Tensor] = []  # the tensor last seen at each place

    @property
    def remembered(self) -> bool:
        return bool(self.places)

    def find(self) -> list[tuple[dict, str, str]]:
        """Where `modules` hold their parameters and buffers: (the owning module's ``_parameters``
        or ``_buffers``, the name in it, the qualified name), each place once. A replay reads each
        place again, so a tensor that a module rebinds (``module.buf = torch.zeros(...)``) is
        drift as much as one whose storage was swapped (``.data =``)."""
        places: dict[tuple[int, str], tuple[dict, str, str]] = {}
        for root in self.modules:
            for prefix, module in root.named_modules(remove_duplicate=False):
                for table in (module._parameters, module._buffers):
                    for name, tensor in table.items():
                        if tensor is not None:
                            places.setdefault((id(table), name), (table, name, f"{prefix}.{name}" if prefix else name))
        return list(places.values())

    def now(self) -> list[int]:
        """The address each remembered place holds now (0 where it holds no tensor)."""
        return [0 if (t := table.get(name)) is None else t.data_ptr() for table, name, _ in self.places]

    def remember(self) -> None:
        """The module state every replay checks: where it is, the tensors there and their addresses."""
        self.places = self.find()
        self.ptrs = self.now()
        self.tables = [table for table, _, _ in self.places]
        self.names = [name for _, name, _ in self.places]
        self.tensors = [table[name] for table, name, _ in self.places]  # `find` keeps only tensors

    def unmoved(self) -> bool:
        """Every place holds a tensor at the address it held at the first capture. It runs on every
        replayed call over every parameter of the model, so in C-level passes over the tensor
        objects last seen there. A place that holds another object now (a module that rebinds a
        buffer) is decided by its address, as the check always was (a tensor rebound at the same
        address, with other strides, is not caught), and the new objects are remembered so the
        next call takes the C-level passes again."""
        now = list(map(dict.get, self.tables, self.names))
        if all(map(operator.is_, now, self.tensors)):
            return list(map(torch.Tensor.data_ptr, self.tensors)) == self.ptrs
        if self.now() != self.ptrs:
            return False
        held = [t for t in now if t is not None]
        if len(held) == len(now):  # a place now empty (address 0, as an empty tensor's) is checked by address again
            self.tensors = held
        return True

    def first_moved(self) -> str | None:
        """The first place whose tensor moved, with both addresses; None when none did."""
        if self.unmoved():
            return None
        for (table, name, qualified), ptr, now in zip(self.places, self.ptrs, self.now()):
            if now != ptr:
                held = table.get(name)
                what = "no tensor" if held is None else f"{tuple(held.shape)}"
                return f"module state {qualified} {what}: data_ptr expected {ptr:#x}, got {now:#x}"
        return None
