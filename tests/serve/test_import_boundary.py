"""Dependencies point one way: serve -> models -> passes -> core. The protocol layer imports no
engine, model, tensor library or web framework; the session layer and the plugin seam no web
framework.

Importing any ``cadence_fx.*`` module runs the core's ``__init__`` first, so the checks read the
layers' own import statements (and, at run time, what a layer adds on top of the core)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

SERVE = Path(__file__).resolve().parents[2] / "serve"
STDLIB = set(sys.stdlib_module_names) | {"__future__"}

# Per layer: the third-party packages and the sibling serve layers it may import.
ALLOWED = {
    "protocol": ({"numpy", "scipy"}, {"protocol"}),
    "session": ({"numpy", "scipy"}, {"session", "protocol", "plugins"}),
    # Model plugins run models: the tensor library and cadence-fx's models, never a web framework.
    "plugins": ({"numpy", "torch", "cadence_fx"}, {"plugins", "runtime"}),
    # Where a plugin's sessions run (slots of a batch): the standard library only.
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
import json, sys
import cadence_fx
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


def test_layers_load_no_framework_at_run_time_and_core_loads_no_service():
    loaded = _probe()
    frameworks = {"torch", "fastapi", "starlette", "uvicorn", "openai", "websockets"}
    assert {m.split(".")[0] for m in loaded["protocol"]} & frameworks == set()
    assert not any(
        m.startswith(("cadence_fx.models", "cadence_fx.passes", "cadence_fx.serve.session")) for m in loaded["protocol"]
    )
    assert {m.split(".")[0] for m in loaded["session"]} & (frameworks - {"torch"}) == set()
    assert [m for m in loaded["core"] if m.startswith("cadence_fx.serve")] == []
