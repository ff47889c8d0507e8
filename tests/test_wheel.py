"""The built wheel installs the public API under cadence_fx and nothing else at top level."""

import os
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(ROOT)],
        check=True,
    )
    (wheel,) = (tmp_path / "dist").glob("cadence_fx-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    assert top_level == {"cadence_fx", wheel.name.split("-py")[0] + ".dist-info"}
    page = {"index.html", "app.js", "capture-worklet.js", "style.css"}
    assert {n.removeprefix("cadence_fx/serve/static/") for n in names if n.startswith("cadence_fx/serve/static/")} == page

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)], check=True)
    # The venv borrows torch, sympy and networkx from this interpreter through a plain path entry;
    # a path entry does not run the .pth hooks there, so this checkout's editable install stays out.
    venv_site = next((env_dir / "lib").glob("python3*/site-packages"))
    (venv_site / "borrowed.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    probe = (
        "import importlib.util, cadence_fx, cadence_fx.models, cadence_fx.passes, cadence_fx.serve\n"
        "from cadence_fx import transform, derive, Contract, ContractError, ExactShapeReplay\n"
        f"assert cadence_fx.__file__.startswith({str(env_dir)!r}), cadence_fx.__file__\n"
        "assert all(importlib.util.find_spec(n) is None for n in ('models', 'serve', 'passes'))\n"
        "from cadence_fx.families import family, load\n"
        "print(derive(load(family('token2wav').contract)()).operator('cfm_loop').width)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([str(python), "-c", probe], check=True, capture_output=True, text=True, cwd=tmp_path, env=env)
    assert out.stdout.strip() == "3"
    cli = subprocess.run(
        [str(env_dir / "bin" / "cadence-fx"), "catalog", "moshi", "--json"], capture_output=True, text=True, env=env
    )
    assert cli.returncode == 0, cli.stderr
    assert '"family": "moshi"' in cli.stdout
