"""Dependencies point one way, from the bottom up: the core's declarations and replay engine
(contract, catalog, binding, guards, program, replay, ...) <- passes <- the pipeline that runs them
<- transform <- models <- serve. The library core finds model families through its registry
(`cadence_fx.families`, entry points), never by import; the application entry points beside it
(the CLI, the docs generator) and the package's own `__init__` compose every layer."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Each layer's package (as installed) and the layers above it, which it may not import.
ORDER = ["core", "passes", "pipeline", "transform", "models", "serve"]
PACKAGES = {
    "passes": "cadence_fx.passes",
    "pipeline": "cadence_fx.pipeline",
    "models": "cadence_fx.models",
    "serve": "cadence_fx.serve",
}
#: The core's modules that stand above the pipeline: the transform, what reports on it, and the
#: derivation of a `transformers` model's contract and binding (it names the retention policies).
TRANSFORM = {
    "cadence_fx.transform",
    "cadence_fx.diff",
    "cadence_fx.diff_page",
    "cadence_fx.diff_svg",
    "cadence_fx.hf",
    "cadence_fx.hf_mimi",
    "cadence_fx.hf_model",
}
APPLICATIONS = {ROOT / "cadence_fx" / "cli.py", ROOT / "cadence_fx" / "docs.py", ROOT / "cadence_fx" / "__init__.py"}


def _module(path: Path) -> str:
    """The file's module name as installed (`passes/window.py` is `cadence_fx.passes.window`)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] != "cadence_fx":
        parts.insert(0, "cadence_fx")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> str:
    if module in TRANSFORM:
        return "transform"
    for layer, package in PACKAGES.items():
        if module == package or module.startswith(package + "."):
            return layer
    return "core"


def _imported(path: Path) -> set[str]:
    """Every cadence_fx module the file imports, relative imports resolved."""
    module = _module(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names |= {f"{base}.{alias.name}" for alias in node.names}
    return {name for name in names if name == "cadence_fx" or name.startswith("cadence_fx.")}


def _files() -> list[Path]:
    return sorted(
        p
        for folder in ("cadence_fx", "passes", "models", "serve")
        for p in (ROOT / folder).rglob("*.py")
        if p not in APPLICATIONS
    )


def test_each_layer_imports_no_layer_above_it():
    checked = 0
    for path in _files():
        rank = ORDER.index(_layer(_module(path)))
        above = {name for name in _imported(path) if name != "cadence_fx" and ORDER.index(_layer(name)) > rank}
        assert not above, f"{path.relative_to(ROOT)} ({_layer(_module(path))}) imports {sorted(above)} from a layer above it"
        checked += 1
    assert checked > 60


def test_the_layers_are_read_as_installed():
    assert _module(ROOT / "passes" / "window.py") == "cadence_fx.passes.window"
    assert _layer("cadence_fx.pipeline.verify") == "pipeline" and _layer("cadence_fx.replay.engine") == "core"
    assert "cadence_fx.passes.window" in _imported(ROOT / "cadence_fx" / "pipeline" / "rewrite.py")
    assert "cadence_fx.contract" in _imported(ROOT / "cadence_fx" / "catalog.py")


def test_the_core_finds_families_by_name_only():
    from cadence_fx.families import families

    assert sorted(families()) == ["freeze_omni", "llm_backbone", "moshi", "token2wav"]
