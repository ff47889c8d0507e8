"""`InPlace`: a buffer of one fixed shape that every call overwrites in place (``copy_``, an indexed
write): a convolution's padding cache, a recurrent scan state. It advances along no clock, so its
region declares none, its catalog is one class, and its carry is the buffer itself."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import ClassVar

import sympy

from cadence_fx.contract import ContractError, Region, Retention


@dataclass(frozen=True)
class InPlace(Retention):
    """A buffer of one fixed shape (`dims`) that every call overwrites in place (``copy_``, an
    indexed write): a convolution's padding cache, a recurrent scan state. It advances along no
    clock, so its region declares none (no `clock`, `axis` or `stride`), and an operator whose
    region it is counts its units in the admission's clock."""

    fixed: ClassVar[bool] = True
    clocked: ClassVar[bool] = False

    def check(self, path: str, region: Region, symbols: Mapping[str, int | Fraction]) -> None:
        """One fixed shape over the contract's quantities, no clock to advance."""
        for attr, unset in (("clock", None), ("axis", None), ("stride", 0)):
            if getattr(region, attr) != unset:
                raise ContractError(
                    f"{path}.{attr}",
                    "declaration",
                    f"an InPlace region has one fixed shape and advances along no clock: leave "
                    f"`{attr}` unset, got {getattr(region, attr)!r} (a buffer that grows or rolls "
                    "along a clock retains by SlidingWindow or RingCache)",
                )
        if not region.dims:
            raise ContractError(f"{path}.dims", "declaration", "an InPlace region needs at least one dim")
        for j, dim in enumerate(region.dims):
            unknown = {str(s) for s in sympy.sympify(dim).free_symbols} - set(symbols)
            if unknown:
                raise ContractError(
                    f"{path}.dims[{j}]",
                    "declaration",
                    f"an InPlace region's dims are fixed: {sorted(unknown)} is not a quantity or "
                    f"named rate of the contract; usable: {sorted(symbols)}",
                )

    def retained(self, region: Region) -> sympy.Expr:
        """Its last dim, which never changes (the axis its carry measures)."""
        return sympy.sympify(region.dims[-1])
