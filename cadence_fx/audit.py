"""The shadow auditor: the stock retention evaluated beside every carry write, compared elementwise."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["AuditMismatch", "ShadowAuditor"]


class AuditMismatch(AssertionError):
    def __init__(self, site: str, chunk: int, index: tuple[int, ...] | None, detail: str):
        self.site, self.chunk, self.index = site, chunk, index
        super().__init__(f"audit mismatch at site {site!r}, chunk {chunk}: {detail}")


@dataclass
class ShadowAuditor:
    """Counts every retention it audits; raises `AuditMismatch` on the first difference."""

    retentions: int = 0  # retentions observed (one per site per chunk)
    applications: int = 0  # of those, the ones where the stock code evicted units
    mismatches: int = 0
    addresses: dict[str, set[int]] = field(default_factory=dict)

    def check(self, site: str, chunk: int, expected: torch.Tensor, carried: torch.Tensor, *, evicted: bool, address: int):
        self.retentions += 1
        self.applications += int(evicted)
        self.addresses.setdefault(site, set()).add(address)
        if carried.shape != expected.shape:
            self.mismatches += 1
            raise AuditMismatch(site, chunk, None, f"shape {tuple(carried.shape)} against stock {tuple(expected.shape)}")
        if not torch.equal(carried, expected):
            self.mismatches += 1
            differing = (carried != expected) & ~(torch.isnan(carried) & torch.isnan(expected))
            index = tuple(int(i) for i in differing.nonzero()[0]) if differing.any() else None
            raise AuditMismatch(
                site,
                chunk,
                index,
                f"first differing index {index}: carry {carried[index].item() if index else 'nan'} "
                f"against stock {expected[index].item() if index else 'nan'}",
            )

    def counters(self) -> dict:
        return {
            "retentions": self.retentions,
            "applications": self.applications,
            "mismatches": self.mismatches,
            "distinct_carry_addresses": {site: len(a) for site, a in sorted(self.addresses.items())},
        }
