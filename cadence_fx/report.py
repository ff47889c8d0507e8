"""Human-readable renderings of derivations and transform reports."""

from __future__ import annotations

import os
import statistics
import subprocess

from .catalog import Catalog

__all__ = ["catalog_table", "format_bytes", "format_table", "latency_stats", "measured_commit"]


def latency_stats(values: list[float]) -> dict | None:
    """p50, p95 (nearest rank), mean and count of a benchmark's samples; None for no samples."""
    ordered = sorted(values)
    if not ordered:
        return None
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {"p50": statistics.median(ordered), "p95": p95, "mean": statistics.fmean(ordered), "n": len(ordered)}


def measured_commit() -> str | None:
    """The commit a benchmark measured: `CADENCE_COMMIT` where the tree travelled without git
    metadata (the GPU machine's copy), else git's HEAD; None when neither is known."""
    if os.environ.get("CADENCE_COMMIT"):
        return os.environ["CADENCE_COMMIT"]
    done = subprocess.run(["git", "rev-parse", "--verify", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def format_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def format_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = ["  ".join(str(cell).ljust(w) for cell, w in zip(line, widths)).rstrip() for line in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def catalog_table(catalog: Catalog) -> str:
    regions = format_table(
        ["region", "retained r(t)", "A-", "A", "K-window", "demand shape", "demand", "stock shape", "stock", "rho"],
        [
            [
                r.name,
                str(r.retained),
                str(r.lower),
                "unbounded" if r.bound is None else str(r.bound),
                "-" if r.window is None else f"W={r.window} s={r.stride}",
                "-" if r.shape is None else "x".join(map(str, r.shape)),
                format_bytes(r.bytes),
                "-" if r.stock_shape is None else "x".join(map(str, r.stock_shape)),
                format_bytes(r.stock_bytes),
                "-" if r.rho is None else f"{float(r.rho):.2f}",
            ]
            for r in catalog.regions
        ],
    )
    operators = format_table(
        ["operator", "region", "K", "steady extents", "flush classes (call@extent)", "verdict"],
        [
            [
                o.name,
                o.region,
                "-" if o.width is None else str(o.width),
                "-" if o.grid is None else ", ".join(map(str, o.grid)),
                ", ".join(f"{c.call}@{c.extent}" for c in o.flush_classes) or "-",
                o.verdict,
            ]
            for o in catalog.operators
        ],
    )
    return f"catalog of {catalog.family} (budget {catalog.budget} classes per operator)\n\n{regions}\n\n{operators}"
