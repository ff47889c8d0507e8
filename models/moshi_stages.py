"""The stages runtime's parts (`models/moshi_slots.py`, `transform_slots`): Moshi's vendor streaming
state owned at fixed addresses, and each hot stage an `ExactShapeReplay` on it.

On Moshi the carry degenerates to the vendor's own `RingKVCache`: every attention cache is
preallocated at its capacity and written in place at a device-side offset, so the state rule has
nothing to resize (each ring already sits at its derived bound, checked here: `_ring_resizes`) and
the catalog has one class per stage. What these parts do:

* **one streaming state, at fixed addresses** (`OwnedState`). Every tensor of the vendor's
  streaming state keeps one address for the life of the runtime; a reset writes the base state
  in place (zeros, ones, the ungenerated token id: exactly a fresh entry's values). State the
  vendor writes by rebinding an attribute (`state.first = torch.where(...)` in the
  replicate-padded downsampling conv, inside Mimi encode) is written into the original tensor in
  place instead, after each call; host-side counters (`offset_cpu`) are rewound after a
  probationary call and advanced after a replay, exactly as eager advances them. `BoundSlots` and
  `BoundMoshi` use it to observe the state (its addresses, its counters);
* **a `Stage` per hot operator**: the stage called under `moshi.utils.compile.no_cuda_graph()`
  (the vendor reads that flag on every call) through one `ExactShapeReplay`, its catalog the
  contract's (K = 1 each) as exact signatures (a slice argument is copied to canonical strides
  first, unless only its size-1 dimensions' strides differ: those pass as they are); the owned
  state is registered with each binding as module state, so the engine rewinds it after a probe
  and checks its addresses on every replay (ring bodies excepted, see `OwnedState`).

One Moshi session at batch 1 runs on the one pipeline instead (`models/moshi_bound.py`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from cadence_fx.catalog import Catalog
from cadence_fx.contract import DTYPES, Contract
from cadence_fx.passes.state import Resize
from cadence_fx.replay import ExactShapeReplay, ShapeClass, Signature, TensorSpec

__all__ = ["OwnedState", "Stage"]

#: Contract region of each ring, by the module that owns it.
RINGS = {
    "mimi.encoder_transformer": "mimi_encoder_kv",
    "mimi.decoder_transformer": "mimi_decoder_kv",
    "lm.transformer": "lm_kv",
    "lm.depformer": "depformer_kv",
}


# ---------------------------------------------------------------------------------------------
# The owned streaming state


@dataclass
class _Slot:
    owner: Any  # a vendor State (or a RingKVCache inside one)
    attr: str
    tensor: torch.Tensor  # the original: the one address this slot keeps
    base: float | int | bool | torch.Tensor  # the value a fresh streaming entry writes


def _base(t: torch.Tensor) -> float | int | bool | torch.Tensor:
    """The value a fresh streaming entry writes into `t`: a scalar, or a copy in host memory (a
    few per model, such as LMGen's initial tokens; a reset copies it in). Uniformity is read off
    reductions, never an elementwise comparison: that would allocate a temporary as large as a
    ring (1.6 GB per LM layer at batch 64)."""
    if t.numel():
        uniform = bool(t.all()) or not bool(t.any()) if t.dtype == torch.bool else bool(t.amin() == t.amax())
        if uniform:
            return t.reshape(-1)[0].item()
    return t.to("cpu", copy=True)


def _is_vendor_object(value: Any) -> bool:
    from moshi.utils.compile import CUDAGraphed

    module = type(value).__module__
    return module.startswith("moshi.") and not isinstance(value, (CUDAGraphed, torch.nn.Module)) and hasattr(value, "__dict__")


@dataclass
class OwnedState:
    """The streaming state of some vendor modules, owned for the life of a transformed model.

    `tensors` keep one address each; `counters` are the host-side integers (with their base
    values). `holder` registers the tensors a binding must rewind after a probationary call as
    buffers, so a binding given it as a module snapshots them and checks their addresses on every
    replay. Ring bodies are left out of it (they are most of the state: 1.5 GiB for the full LM):
    a call writes a ring only at the slots its `end_offset` names, before it reads them
    (`RingKVCache.complete` scatters, then attends), so rewinding `end_offset` rewinds the ring.
    """

    states: dict[str, dict[str, Any]]  # module path -> its get_streaming_state()
    tensors: list[_Slot] = field(default_factory=list)
    counters: list[tuple[Any, str, int]] = field(default_factory=list)
    holder: torch.nn.Module = field(default_factory=torch.nn.Module)
    rebinds: int = 0  # attribute rebindings turned into in-place writes

    @classmethod
    def of(cls, states: dict[str, dict[str, Any]]) -> OwnedState:
        owned = cls(states)
        seen: set[int] = set()
        for root, entries in states.items():
            for name, state in entries.items():
                owned._walk(state, f"{root}.{name}" if name else root, seen)
        return owned

    def _walk(self, obj: Any, path: str, seen: set[int]) -> None:
        from moshi.modules.transformer import RingKVCache

        if id(obj) in seen:
            return
        seen.add(id(obj))
        for attr, value in vars(obj).items():
            if isinstance(value, torch.Tensor):
                self.tensors.append(_Slot(obj, attr, value, _base(value)))
                if not (isinstance(obj, RingKVCache) and attr == "cache"):
                    name = re.sub(r"\W", "_", f"{path}.{attr}")
                    self.holder.register_buffer(f"s{len(self.tensors)}_{name}", value, persistent=False)
            elif type(value) is int:
                self.counters.append((obj, attr, value))
            elif _is_vendor_object(value):
                self._walk(value, f"{path}.{attr}", seen)

    @property
    def nbytes(self) -> int:
        return sum(s.tensor.numel() * s.tensor.element_size() for s in self.tensors)

    def addresses(self) -> list[int]:
        return [getattr(s.owner, s.attr).data_ptr() for s in self.tensors]

    def reset(self) -> None:
        """A new session: the base state written in place, every binding back on its original."""
        with torch.no_grad():
            for slot in self.tensors:
                setattr(slot.owner, slot.attr, slot.tensor)
                if isinstance(slot.base, torch.Tensor):
                    slot.tensor.copy_(slot.base)
                else:
                    slot.tensor.fill_(slot.base)
        for owner, attr, base in self.counters:
            setattr(owner, attr, base)

    def keep_addresses(self) -> None:
        """Attributes the vendor rebound during a call: the value written into the original."""
        for slot in self.tensors:
            current = getattr(slot.owner, slot.attr)
            if current is not slot.tensor:
                with torch.no_grad():
                    slot.tensor.copy_(current)
                setattr(slot.owner, slot.attr, slot.tensor)
                self.rebinds += 1

    def read(self) -> list[int]:
        """The host counters' values (the engine's `HostCounters`)."""
        return [getattr(owner, attr) for owner, attr, _ in self.counters]

    def write(self, values: Sequence[int]) -> None:
        for (owner, attr, _), value in zip(self.counters, values, strict=True):
            setattr(owner, attr, value)


# ---------------------------------------------------------------------------------------------
# Stages


def _canonical(x: Any) -> Any:
    """A tensor whose layout matches the canonical one of its shape, so the call matches its
    catalog signature exactly: a slice of a larger tensor is copied (values unchanged) unless it
    differs only in the strides of size-1 dimensions, which a signature does not see (a frame
    split off a stream and the decoder's ``tokens[:, 1:]`` are passed as they are: no copy)."""
    if isinstance(x, torch.Tensor):
        shape = tuple(x.shape)
        if TensorSpec(shape, stride=tuple(x.stride())).key()[2] != TensorSpec(shape).key()[2]:
            return x.clone(memory_format=torch.contiguous_format)
    return x


class Stage:
    """One hot stage: a replay binding (or the stage itself, without replay) on the owned state.
    The binding rewinds the state's host counters after its probe and moves them after each
    replay as the eager call did (`HostCounters`)."""

    def __init__(self, name: str, fn: Callable[..., Any], classes: list[ShapeClass], state: OwnedState | None,
                 modules: list[torch.nn.Module], *, replay: bool, hooks: tuple = ()):
        self.name, self.fn, self.state = name, fn, state
        self.engine = (ExactShapeReplay(self._run, classes, name=name, modules=[*modules, *([state.holder] if state else [])],
                                        hooks=hooks, host_counters=state) if replay else None)

    def _run(self, *args: Any) -> Any:
        out = self.fn(*args)
        if self.state is not None:
            self.state.keep_addresses()
        return out

    def __call__(self, *args: Any) -> Any:
        from moshi.utils.compile import no_cuda_graph

        args = tuple(_canonical(a) for a in args)
        with no_cuda_graph():
            return self.engine(*args) if self.engine is not None else self._run(*args)


def _rings(module: torch.nn.Module) -> list[tuple[int, ...]]:
    shapes = []
    for sub in module.modules():
        kv = getattr(getattr(sub, "_streaming_state", None), "kv_cache", None)
        if kv is not None:
            shapes.append(tuple(kv.cache.shape))
    return shapes


def _ring_resizes(models, contract: Contract, catalog: Catalog) -> list[Resize]:
    """Each ring region against the vendor's rings: the carry is the vendor's ring, at its bound."""
    modules = {
        "mimi.encoder_transformer": models.mimi.encoder_transformer,
        "mimi.decoder_transformer": models.mimi.decoder_transformer,
        "lm.transformer": models.lm.transformer,
        "lm.depformer": models.lm.depformer,
    }
    resizes = []
    for path, region_name in RINGS.items():
        rings = _rings(modules[path])
        region, derived = contract.region(region_name), catalog.region(region_name)
        if len(set(rings)) != 1:
            raise ValueError(f"{path}: rings of several shapes {sorted(set(rings))}")
        two, batch, heads, capacity, head_dim = rings[0]
        stock = (len(rings), two, batch, heads, capacity, head_dim)
        if stock != derived.shape:
            raise ValueError(f"{path}: the vendor's rings stack to {stock}, region {region_name!r} derives "
                             f"{derived.shape}: the contract does not describe this model")
        beta = DTYPES[region.dtype].itemsize
        resizes.append(Resize(f"{path} RingKVCache x{len(rings)}", region_name, stock, beta * math.prod(stock),
                              derived.shape, derived.bytes))
    return resizes


def _classes(catalog: Catalog, operator: str, *specs: Any) -> list[ShapeClass]:
    op = catalog.operator(operator)
    if not op.in_scope:
        raise ValueError(f"{operator}: {op.verdict}")
    return [ShapeClass(f"{operator} ring={c.extent}", Signature.of(*specs), (("ring", c.extent),)) for c in op.classes]
