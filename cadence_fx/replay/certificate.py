"""Certificates: what was checked for one class before capture and the verdict, with the host
constants hoisted and the operators cut for it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .signature import Signature


@dataclass(frozen=True)
class HoistedConstant:
    """A host-computed, configuration-only tensor now resident on the device (passes/hoist.py)."""

    site: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str
    nbytes: int
    shared: bool = True

    def __str__(self) -> str:
        how = "shared buffer" if self.shared else "device copy per call (the callable writes it)"
        return f"{self.site}: {str(self.dtype).removeprefix('torch.')}{list(self.shape)} -> {self.device}, {how}"


@dataclass(frozen=True)
class CutRecord:
    """An operator run eagerly between captured segments (passes/piecewise.py)."""

    name: str
    reason: str
    count: int

    def __str__(self) -> str:
        return f"{self.name} x{self.count}: {self.reason}"


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


@dataclass(frozen=True)
class Certificate:
    """What was checked for one class before capture, and the verdict."""

    shape_class: str
    signature: Signature
    admitted: bool
    reason: str
    captured: bool = False
    segments: int = 0
    host_rng: tuple[str, ...] = ()
    device_rng_advance: tuple[int, ...] = ()
    writes: tuple[str, ...] = ()
    aliased: tuple[str, ...] = ()
    copied: tuple[str, ...] = ()
    written_back: tuple[str, ...] = ()
    host_constants: tuple[HoistedConstant, ...] = ()
    cuts: tuple[CutRecord, ...] = ()
    checks: tuple[str, ...] = ()
    thread: str = ""
    # Memory of a captured class (CUDA only): the static input buffers it stages per call (what the
    # memory model charges a class: inputs that are not aliased), the growth
    # of `torch.cuda.memory_reserved` over the capture itself (the graph pool's new segments: the
    # intermediates the model does not price; a piecewise capture's cut statics included), and over
    # the whole capture phase (staging included).
    staged_bytes: int | None = None
    pool_reserved_bytes: int | None = None
    reserved_bytes: int | None = None

    @property
    def reads_device_rng(self) -> bool:
        return any(self.device_rng_advance)

    def explain(self) -> str:
        verdict = "admitted" if self.admitted else "REJECTED"
        lines = [f"class {self.shape_class}: {verdict} ({self.reason})", f"  signature: {self.signature.describe()}"]
        if self.captured:
            lines.append(f"  captured: {self.segments} graph segment(s) on thread {self.thread!r}")
        if self.pool_reserved_bytes is not None:
            lines.append(
                f"  memory: staging {_mib(self.staged_bytes)} (the memory model's charge), graph pool grew "
                f"{_mib(self.pool_reserved_bytes)}, reserved grew {_mib(self.reserved_bytes)} in all"
            )
        elif not self.admitted:
            lines.append(f"  refused on thread {self.thread!r}")
        lines.append("  checked: " + ", ".join(self.checks))
        rng = ", ".join(f"+{a}" for a in self.device_rng_advance if a) or "none"
        lines.append(f"  host RNG: {', '.join(self.host_rng) or 'none'}; device RNG philox offset: {rng}")
        for title, items in (
            ("aliased", self.aliased),
            ("copied", self.copied),
            ("writes", self.writes),
            ("written back", self.written_back),
        ):
            if items:
                lines.append(f"  {title}: {', '.join(items)}")
        lines += [f"  host constant {c}" for c in self.host_constants]
        lines += [f"  cut {c}" for c in self.cuts]
        return "\n".join(lines)
