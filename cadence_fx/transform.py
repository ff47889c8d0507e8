"""`transform(model, contract)`: the entry point, and the report it returns.

With a binding, the one pipeline (`cadence_fx/pipeline/`) runs on any model. Without one, the family
registry (`families.py`) gives the family's binding, or its composer (a hook that transforms the
family's parts from their bindings on the same pipeline). The passes do the rewriting; this module
derives the catalog, dispatches and reports.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from . import determinism
from .audit import ShadowAuditor
from .binding import Binding
from .catalog import DEFAULT_BUDGET, Catalog, derive
from .contract import Contract
from .families import families, load
from .hf import derive_transformers, derived_caches, is_transformers_model
from .hf_model import transformed_model
from .pipeline import transform_bound
from .report import format_bytes, format_table

__all__ = ["TransformReport", "transform"]


@dataclass
class TransformReport:
    """What a transform did and why: sites, resized regions, carries, audit counters, stamps."""

    family: str
    catalog: Catalog
    sites: list = field(default_factory=list)  # passes.carry.RetentionSite
    resizes: list = field(default_factory=list)  # passes.state.Resize
    carries: dict = field(default_factory=dict)  # region -> passes.carry.Carry
    stamps: list[str] = field(default_factory=list)
    auditor: ShadowAuditor | None = None
    graphs: dict = field(default_factory=dict)  # name -> (before GraphModule, after GraphModule)
    replays: dict = field(default_factory=dict)  # operator -> replay.ExactShapeReplay
    determinism: dict = field(default_factory=dict)  # the kernel switches found in force (a transform sets none)
    operators: dict = field(default_factory=dict)  # operator -> pipeline.BoundOperator (bound models)

    @classmethod
    def merged(cls, reports: list[TransformReport]) -> TransformReport:
        """One report of a model transformed in parts (each part from its own binding), in order: a
        snapshot of the parts' reports as they stand (the first part's shadow auditor, if any)."""
        auditor = next((r.auditor for r in reports if r.auditor is not None), None)
        merged = cls(family=reports[0].family, catalog=reports[0].catalog, determinism=reports[0].determinism, auditor=auditor)
        for report in reports:
            merged.stamps.extend(report.stamps)
            merged.sites.extend(report.sites)
            merged.resizes.extend(report.resizes)
            for name in ("carries", "graphs", "replays", "operators"):
                getattr(merged, name).update(getattr(report, name))
        return merged

    def managed_bytes(self) -> dict[str, tuple[int, int]]:
        """Bytes of contract-managed state per region: (stock, after the transform)."""
        return {r.region: (r.stock_bytes, r.demand_bytes) for r in self.resizes}

    def to_dict(self) -> dict[str, Any]:
        return {
            "family": self.family,
            "sites": [dataclasses.asdict(s) for s in self.sites],
            "resizes": [dataclasses.asdict(r) for r in self.resizes],
            "carries": {name: {"shape": list(c.buffer.shape), "address": c.address} for name, c in self.carries.items()},
            "stamps": list(self.stamps),
            "audit": None if self.auditor is None else self.auditor.counters(),
            "replays": {name: engine.counters.as_dict() for name, engine in self.replays.items()},
            "determinism": dict(self.determinism),
            "operators": {name: op.counters.as_dict() for name, op in self.operators.items()},
        }

    def __str__(self) -> str:
        sites = format_table(
            ["graph", "node", "region", "axis", "kind", "rewritten", "why"],
            [[s.graph, s.node, s.region, str(s.axis), s.kind, "yes" if s.rewritten else "no", s.reason] for s in self.sites],
        )
        resizes = format_table(
            ["buffer", "region", "stock shape", "stock", "demand shape", "demand"],
            [
                [
                    r.path,
                    r.region,
                    "x".join(map(str, r.stock_shape)),
                    format_bytes(r.stock_bytes),
                    "x".join(map(str, r.demand_shape)),
                    format_bytes(r.demand_bytes),
                ]
                for r in self.resizes
            ],
        )
        before = sum(r.stock_bytes for r in self.resizes)
        after = sum(r.demand_bytes for r in self.resizes)
        lines = [
            f"transform of {self.family}",
            *(f"  {stamp}" for stamp in self.stamps),
            "",
            "retention sites",
            sites,
        ]
        if self.resizes:
            lines += ["", "state rule", resizes, f"contract-managed envelopes: {format_bytes(before)} -> {format_bytes(after)}"]
        if self.auditor is not None:
            lines += ["", f"shadow audit: {self.auditor.counters()}"]
        for name, engine in self.replays.items():
            lines += ["", engine.explain()]
        for op in self.operators.values():
            lines += ["", op.explain()]
        if self.determinism:
            lines += ["", "determinism: " + ", ".join(f"{k}={v}" for k, v in self.determinism.items())]
        return "\n".join(lines)


def transform(
    model: Any,
    contract: Contract | None = None,
    binding: Binding | None = None,
    *,
    audit: bool = False,
    capture: bool = True,
    replay: bool = True,
    budget: int = DEFAULT_BUDGET,
    **derive_options: Any,
):
    """Transform `model` under `contract`: returns (transformed model, TransformReport).

    With a `binding` (where each region lives, which methods are hot operators) the one generic
    pipeline runs (`cadence_fx.pipeline`): any model, no adapter. Without one, a registered family
    gives its own binding (the same pipeline) or its composer (`Family.compose`: a hook that
    transforms the model's parts from their bindings on the same pipeline).

    The input model is left untouched. With `audit=True` a shadow auditor evaluates the stock
    retention beside every carry write and raises `AuditMismatch` on the first difference.
    `capture=False` skips exporting the hot operators (their sites and graphs are then not in the
    report), which saves the export time when only the rewritten model is wanted. `replay=False`
    leaves the hot operators eager (the state rule alone: the ablation's S arm).

    Without a contract, a `transformers` model's contract and binding are derived from its config
    and the cache it builds (`cadence_fx.hf.derive_transformers`, which takes the keywords in
    `derive_options`: `tokens_per_call`, `max_tokens`, ...); any other model needs its contract.
    Such a model is returned as a shallow copy of it whose bound methods are its operators
    (`cadence_fx.hf_model`): called the stock way, `generate()` included, it runs the graphs.
    """
    caches = None  # a derived contract's caches, by operator: the model is returned as its shallow copy
    if contract is None:
        if binding is not None:
            raise TypeError("a binding was given without its contract: pass transform(model, contract, binding)")
        if not is_transformers_model(model):
            raise TypeError(
                f"no contract given, and {type(model).__name__} is no transformers model whose contract "
                "cadence-fx derives: pass transform(model, contract, binding) (README: Bring your own model)"
            )
        contract, binding = derive_transformers(model, **derive_options)
        caches = derived_caches(model, binding, derive_options.get("cache", "dynamic"))
    elif derive_options:
        raise TypeError(f"transform() got {sorted(derive_options)}: keywords of a derived contract, but a contract was given")
    if not isinstance(contract, Contract):
        raise TypeError(f"contract must be a cadence_fx.Contract, got {type(contract).__name__}")
    catalog = derive(contract, budget=budget)
    declared = families().get(contract.family)
    if binding is None and declared is not None and declared.binding is not None:
        binding = load(declared.binding)(model, contract)
    compose = declared.compose if binding is None and declared is not None else None
    if (binding is not None or compose is not None) and not capture:
        raise ValueError("a bound model's carries live in its rewritten graphs: capture=False has nothing to run")
    if binding is not None:
        report = TransformReport(family=contract.family, catalog=catalog, auditor=ShadowAuditor() if audit else None)
        report.determinism = determinism.settings()
        report.stamps.append(determinism.envelope())
        bound = transform_bound(model, contract, binding, catalog, report, replay=replay and not audit)
        return (bound if caches is None else transformed_model(model, bound, caches)), report
    if compose is not None:
        return load(compose)(model, contract, audit=audit, replay=replay, budget=budget)
    having = sorted(name for name, f in families().items() if f.binding or f.compose)
    raise ValueError(
        f"no binding given, and {contract.family!r} is no family with its own binding or composer ({having}): "
        "pass transform(model, contract, binding) (README: Bring your own model)"
    )
