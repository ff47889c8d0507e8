"""The dispatcher: which class of the catalog a call's `Signature` is, and that class's life so far
(`ClassState`: its phase, certificate, graphs). It runs no call; the runner (`replay/runner.py`)
certifies, captures and replays the classes it admits, and the engine (`ExactShapeReplay`)
joins the two."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .certificate import Certificate
from .signature import (
    _T,
    Miss,
    MissReason,
    ReplayCatalog,
    ShapeClass,
    Signature,
    _leaf_owners,
)

#: Misses remembered per dispatcher (a signature met again is refused without a second diff).
MISSES_KEPT = 1024


class Phase(str, enum.Enum):
    EAGER = "eager"
    CAPTURE = "capture"
    REPLAY = "replay"


@dataclass
class ClassState:
    """One admitted class: its name, argument names and aliased positions, and what the runner
    made of it (phase, certificate or refusal, graphs, staged buffers, outputs)."""

    shape_class: ShapeClass
    names: list[str]
    aliased: list[int]
    phase: Phase = Phase.EAGER
    certificate: Certificate | None = None
    refused: Miss | None = None
    capturable: bool = True
    invalidations: int = 0
    aliased_ptrs: list[tuple[int, int]] = field(default_factory=list)
    steps: list = field(default_factory=list)
    guarded: bool = False
    copy_in: list[tuple[int, Any]] = field(default_factory=list)
    write_back: list[tuple[int, Any]] = field(default_factory=list)
    out_leaves: list[Any] = field(default_factory=list)
    out_clone: list[bool] = field(default_factory=list)
    out_spec: Any = None
    host_advance: tuple[int, ...] = ()  # how far one call of this class moves each host counter

    def drop_graphs(self) -> None:
        self.phase = Phase.EAGER
        self.steps, self.copy_in, self.write_back, self.out_leaves, self.out_clone = [], [], [], [], []


class Dispatcher:
    """Signature -> `ClassState`, from a catalog of `ShapeClass`es or `Signature`s (a miss then
    names the nearest class and how the call differs from it), or from a predicate over
    `Signature` returning a class name, a `ShapeClass`, True (a generated name) or a falsy value
    (a miss: `not_in_catalog`). `aliased`: the argument positions or names whose tensors are
    passed by address."""

    def __init__(self, catalog: ReplayCatalog, aliased: frozenset[int | str]):
        self.aliased = aliased
        self.classes: dict[Signature, ClassState] = {}
        self.misses: dict[Signature, Miss] = {}
        self.predicate: Callable[[Signature], Any] | None = None
        self.catalog: dict[tuple, ShapeClass] = {}
        if callable(catalog) and not isinstance(catalog, (list, tuple)):
            self.predicate = catalog
        else:
            for i, entry in enumerate(catalog):
                sc = entry if isinstance(entry, ShapeClass) else ShapeClass(f"class{i}", entry)
                self.catalog[sc.signature.catalog_key] = sc

    def admit(self, sig: Signature) -> ClassState | None:
        """The call's class, made at its first call; None for a miss (`misses[sig]` says why)."""
        st = self.classes.get(sig)
        if st is not None:
            return st
        if sig in self.misses:
            return None
        sc: ShapeClass | None
        if self.predicate is not None:
            verdict = self.predicate(sig)
            if isinstance(verdict, ShapeClass):
                sc = verdict
            elif isinstance(verdict, str):
                sc = ShapeClass(verdict, sig)
            elif verdict:
                sc = ShapeClass(f"class{len(self.classes)}", sig)
            else:
                self._remember_miss(sig, Miss(MissReason.NOT_IN_CATALOG, ("the catalog predicate refused it",)))
                return None
        else:
            sc = self.catalog.get(sig.catalog_key)
            if sc is None:
                self._remember_miss(sig, self._nearest_miss(sig))
                return None
        if any(st.shape_class.name == sc.name for st in self.classes.values()):
            sc = ShapeClass(f"{sc.name}{list(sig.context)}", sc.signature, sc.extents)
        owners = _leaf_owners(sig.spec)
        aliased = [i for i, o in enumerate(owners) if o in self.aliased and sig.leaves[i][0] == _T]
        st = self.classes[sig] = ClassState(sc, sig.names(), aliased)
        return st

    def reset(self) -> None:
        """Forget every class and miss (their graphs dropped)."""
        for st in self.classes.values():
            st.drop_graphs()
        self.classes.clear()
        self.misses.clear()

    def _remember_miss(self, sig: Signature, miss: Miss) -> None:
        if len(self.misses) >= MISSES_KEPT:
            self.misses.clear()
        self.misses[sig] = miss

    def _nearest_miss(self, sig: Signature) -> Miss:
        best: tuple[int, MissReason, tuple[str, ...]] | None = None
        for sc in self.catalog.values():
            reason, lines = sig.diff(sc.signature)
            score = 10**6 if reason is MissReason.STRUCTURE else len(lines)
            if best is None or score < best[0]:
                best = (score, reason, (f"nearest class {sc.name}",) + lines)
        if best is None:
            return Miss(MissReason.NOT_IN_CATALOG, ("empty catalog",))
        return Miss(best[1], best[2])
