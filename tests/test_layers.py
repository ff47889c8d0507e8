"""Dependencies point one way: serve -> models -> passes -> core. The library core finds model
families through its registry (`cadence_fx.families`, entry points), never by import; the two
application entry points beside it, the CLI and the docs generator, compose every layer."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# package folder -> the cadence_fx sub-packages its modules may not import
FORBIDDEN = {
    "cadence_fx": {"cadence_fx.models", "cadence_fx.serve"},
    "passes": {"cadence_fx.models", "cadence_fx.serve"},
    "models": {"cadence_fx.serve"},
}
APPLICATIONS = {ROOT / "cadence_fx" / "cli.py", ROOT / "cadence_fx" / "docs.py"}


def _imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level >= 2:
            names.add("cadence_fx." + (node.module or ""))  # from ..x inside cadence_fx.<pkg>
    return names


def test_each_layer_imports_no_layer_above_it():
    checked = 0
    for folder, forbidden in FORBIDDEN.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path in APPLICATIONS:
                continue
            bad = {name for name in _imported(path) for f in forbidden if name == f or name.startswith(f + ".")}
            assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"
            checked += 1
    assert checked > 30


def test_the_core_finds_families_by_name_only():
    from cadence_fx.families import families

    assert sorted(families()) == ["freeze_omni", "llm_backbone", "moshi", "token2wav"]
