"""Dependencies point one way: serve -> models -> passes -> core. The core imports neither models
nor serve, the passes neither, the models no serve; the service may import them all. Inside the
service, the protocol layer imports no engine, model, tensor library or web framework; the session
layer and the plugin seam no web framework.

Importing any ``cadence_fx.*`` module runs the core's ``__init__`` first, so the checks read the
layers' own import statements, function-local ones included (and, at run time, what a layer adds
on top of the core)."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

from cadence_fx.cli import SERVICE

ROOT = Path(__file__).resolve().parents[2]
SERVE = ROOT / "serve"
STDLIB = set(sys.stdlib_module_names) | {"__future__"}

# The four layers: the folder of each and the package it installs as (pyproject.toml's package-dir).
LAYERS = {
    "core": (ROOT / "cadence_fx", "cadence_fx"),
    "passes": (ROOT / "passes", "cadence_fx.passes"),
    "models": (ROOT / "models", "cadence_fx.models"),
    "serve": (SERVE, "cadence_fx.serve"),
}
FORBIDDEN = {"core": {"models", "serve"}, "passes": {"models", "serve"}, "models": {"serve"}, "serve": set()}


def _modules(layer: str) -> list[tuple[Path, str]]:
    """Every source file of a layer, with the package its relative imports start from."""
    folder, package = LAYERS[layer]
    return [(path, ".".join([package, *path.parent.relative_to(folder).parts])) for path in sorted(folder.rglob("*.py"))]


def _imported(path: Path, package: str) -> set[str]:
    """Every module `path` imports, as an absolute name, wherever the import statement is; for
    ``from X import Y``, both X and X.Y (Y may be a submodule)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module
            if node.level:  # from the package `level - 1` levels above this file's
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return found


def _layer(module: str) -> str | None:
    """The layer a module belongs to, or None outside cadence_fx."""
    if module != "cadence_fx" and not module.startswith("cadence_fx."):
        return None
    for layer in ("passes", "models", "serve"):
        if module == LAYERS[layer][1] or module.startswith(LAYERS[layer][1] + "."):
            return layer
    return "core"


def test_each_layer_imports_no_layer_above_it():
    for layer, forbidden in FORBIDDEN.items():
        modules = _modules(layer)
        assert modules, layer
        for path, package in modules:
            above = {m for m in _imported(path, package) if _layer(m) in forbidden}
            assert above == set(), f"{layer}: {path.relative_to(ROOT)} imports {sorted(above)}"


def test_the_import_reader_sees_relative_function_local_and_submodule_imports(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text(
        "from . import models\ndef f():\n    from ..serve.app import run_server\n    import cadence_fx.passes.window\n"
    )
    found = _imported(source, "cadence_fx.replay")
    assert {"cadence_fx.replay.models", "cadence_fx.serve.app", "cadence_fx.passes.window"} <= found
    assert {_layer(m) for m in found} == {"core", "serve", "passes"}
    assert _layer("cadence_fx.models") == "models" and _layer("torch") is None


def test_the_core_names_the_service_in_one_place_and_no_model_at_all():
    """What the core reaches above itself by "module:attribute" is the command line's SERVICE table;
    model families come through their registry (entry points), never named by the core."""
    reference = re.compile(r"cadence_fx\.(models|serve)(\.\w+)*(:\w+)?")
    named = [
        (path.name, node.value)
        for path, _ in _modules("core")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and reference.fullmatch(node.value)
    ]
    assert sorted(named) == sorted(("cli.py", value) for value in SERVICE.values())


# Per layer: the third-party packages and the sibling serve layers it may import.
ALLOWED = {
    "protocol": ({"numpy", "scipy"}, {"protocol"}),
    # runtime: the seam a plugin's stream hands its text through (runtime/text.py)
    "session": ({"numpy", "scipy"}, {"session", "protocol", "plugins", "runtime"}),
    # Model plugins run models: the tensor library and cadence-fx's models, never a web framework.
    "plugins": ({"numpy", "torch", "cadence_fx"}, {"plugins", "runtime"}),
    # Where a plugin's sessions run (slots of a batch, the process's collector): the standard library only.
    "runtime": (set(), {"runtime"}),
}


def _imports(path: Path, layer: str) -> tuple[set[str], set[str]]:
    """(third-party top-level packages, serve layers) that ``path`` imports."""
    external, layers = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            external |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                external.add(node.module.split(".")[0])
            elif node.level == 1:
                layers.add(layer)
            else:
                layers.add((node.module or "").split(".")[0])
    return external - STDLIB, layers


def test_each_serve_layer_imports_only_what_it_may():
    for layer, (packages, siblings) in ALLOWED.items():
        files = sorted((SERVE / layer).glob("*.py"))
        assert files, layer
        for path in files:
            external, layers = _imports(path, layer)
            assert external <= packages, f"{path.name} imports {sorted(external - packages)}"
            assert layers <= siblings, f"{path.name} imports serve layers {sorted(layers - siblings)}"


_PROBE = """
import json, pkgutil, sys
import cadence_fx, cadence_fx.replay
for package in (cadence_fx, cadence_fx.replay):
    for module in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
        __import__(module.name)
core = set(sys.modules)
import cadence_fx.serve.protocol
protocol = set(sys.modules)
import cadence_fx.serve.session
session = set(sys.modules) - protocol
print(json.dumps({"core": sorted(core), "protocol": sorted(protocol - core), "session": sorted(session)}))
"""


def _probe() -> dict[str, set[str]]:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True).stdout
    return {k: set(v) for k, v in json.loads(out.splitlines()[-1]).items()}


def test_layers_load_no_framework_at_run_time_and_the_core_loads_no_model_or_service():
    loaded = _probe()
    frameworks = {"torch", "fastapi", "starlette", "uvicorn", "openai", "websockets"}
    assert {m.split(".")[0] for m in loaded["protocol"]} & frameworks == set()
    assert not any(
        m.startswith(("cadence_fx.models", "cadence_fx.passes", "cadence_fx.serve.session")) for m in loaded["protocol"]
    )
    assert {m.split(".")[0] for m in loaded["session"]} & (frameworks - {"torch"}) == set()
    assert [m for m in loaded["core"] if m.startswith(("cadence_fx.models", "cadence_fx.serve"))] == []


# The session layer's modules, bottom up: a module imports only modules of a lower tier, under
# TYPE_CHECKING too (the reader walks every import statement). A Session's pieces form a line
# (base <- conversation <- fence <- turns <- lifetime <- session); the manager owns sessions, and a
# connection routes to the manager and its session. A new module has to be placed here.
SESSION_TIERS = (
    {"codes", "journal", "lease", "ledger", "limits", "playback", "port", "transport", "vad"},
    {"input_path", "messages"},
    {"base"},
    {"conversation"},
    {"fence"},
    {"turns"},
    {"lifetime"},
    {"session"},
    {"manager"},
    {"connection"},
    {"__init__"},
)
SESSION = "cadence_fx.serve.session"


def _session_imports_above(folder: Path) -> list[str]:
    """Every import in ``folder``'s modules of a session-layer module not below the importer's tier
    (the package itself counts as its ``__init__``: import a sibling by its own name)."""
    tier = {name: level for level, names in enumerate(SESSION_TIERS) for name in names}
    found = set()
    for path in sorted(folder.glob("*.py")):
        for module in sorted(_imported(path, SESSION)):
            if module != SESSION and not module.startswith(SESSION + "."):
                continue
            name = module.removeprefix(SESSION).removeprefix(".").split(".")[0] or "__init__"
            if name in tier and tier[name] >= tier[path.stem]:
                found.add(f"{path.stem} imports {name}")
    return sorted(found)


def test_session_modules_import_only_modules_below_them():
    names = {path.stem for path in (SERVE / "session").glob("*.py")}
    assert names == set().union(*SESSION_TIERS), "place every serve/session module in SESSION_TIERS"
    assert _session_imports_above(SERVE / "session") == []


def test_the_session_tier_check_sees_an_upward_import_under_type_checking(tmp_path):
    (tmp_path / "session.py").write_text(
        "from typing import TYPE_CHECKING\nfrom .codes import CLOSE_NORMAL\n"
        "if TYPE_CHECKING:\n    from .manager import SessionManager\n"
    )
    (tmp_path / "manager.py").write_text("from .connection import Connection\nfrom .session import Session\n")
    (tmp_path / "codes.py").write_text("from cadence_fx.serve.session import Limits\n")
    assert _session_imports_above(tmp_path) == ["codes imports __init__", "manager imports connection", "session imports manager"]
