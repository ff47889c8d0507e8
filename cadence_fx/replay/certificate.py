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

    @property
    def reads_device_rng(self) -> bool:
        return any(self.device_rng_advance)

    def explain(self) -> str:
        verdict = "admitted" if self.admitted else "REJECTED"
        lines = [f"class {self.shape_class}: {verdict} ({self.reason})",
                 f"  signature: {self.signature.describe()}"]
        if self.captured:
            lines.append(f"  captured: {self.segments} graph segment(s)")
        lines.append("  checked: " + ", ".join(self.checks))
        rng = ", ".join(f"+{a}" for a in self.device_rng_advance if a) or "none"
        lines.append(f"  host RNG: {', '.join(self.host_rng) or 'none'}; device RNG philox offset: {rng}")
        for title, items in (("aliased", self.aliased), ("copied", self.copied), ("writes", self.writes),
                             ("written back", self.written_back)):
            if items:
                lines.append(f"  {title}: {', '.join(items)}")
        lines += [f"  host constant {c}" for c in self.host_constants]
        lines += [f"  cut {c}" for c in self.cuts]
        return "\n".join(lines)
