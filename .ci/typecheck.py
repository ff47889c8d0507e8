"""The type check CI runs: mypy over the package as it installs.

The repository's top-level folders are sub-packages of `cadence_fx` once installed (pyproject.toml's
`package-dir`), and mypy follows no import hook, so it cannot see `cadence_fx.passes` in a checkout.
This script lays the package out as it installs, as symbolic links in a temporary folder, runs mypy
there with the `[tool.mypy]` settings of pyproject.toml, and prints each error at its path in the
checkout. Exit status: mypy's.

    python .ci/typecheck.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def package_dirs() -> dict[str, str]:
    """Every top-level package folder of the install, by its installed name: pyproject.toml's
    `package-dir` entries whose folder is not inside another entry's folder."""
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    folders = {name: folder for name, folder in table.items()}
    return {
        name: folder
        for name, folder in folders.items()
        if not any(folder != other and folder.startswith(other + "/") for other in folders.values())
    }


def lay_out(into: Path) -> dict[str, str]:
    """Link every top-level folder into `into` at its installed place; the map from each installed
    path prefix back to the checkout's."""
    back = {}
    for name, folder in sorted(package_dirs().items(), key=lambda item: item[0].count(".")):
        place = into.joinpath(*name.split("."))
        place.parent.mkdir(parents=True, exist_ok=True)
        if name == "cadence_fx":  # the core: its entries linked one by one, so the others can sit inside
            place.mkdir()
            for entry in (ROOT / folder).iterdir():
                if entry.name != "__pycache__":
                    (place / entry.name).symlink_to(entry)
        else:
            place.symlink_to(ROOT / folder, target_is_directory=True)
        back["/".join(name.split(".")) + "/"] = folder + "/"
    return back


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="cadence_fx_typecheck_") as tmp:
        back = lay_out(Path(tmp))
        command = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "-p", "cadence_fx"]
        done = subprocess.run(command, cwd=tmp, capture_output=True, text=True, env={**os.environ, "MYPYPATH": tmp})
        longest_first = sorted(back, key=len, reverse=True)
        for line in (done.stdout + done.stderr).splitlines():
            for prefix in longest_first:
                if line.startswith(prefix):
                    line = back[prefix] + line[len(prefix) :]
                    break
            print(re.sub(re.escape(tmp) + "/?", "", line))
        return done.returncode


if __name__ == "__main__":
    sys.exit(main())
