"""vLLM-Omni's client modules, imported without its package ``__init__``.

``vllm_omni/__init__.py`` imports torch's CUDA paths and vllm (not installed here), while its
``clients`` package imports neither. So ``vllm_omni`` is registered as a bare package over the
installed wheel's folder (its ``__init__`` never runs), and the client modules are then imported
normally, their code unmodified. ``.ci/install`` installs the wheel ``--no-deps``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path


def _register_bare_package() -> None:
    if "vllm_omni" in sys.modules:
        return
    spec = importlib.util.find_spec("vllm_omni")
    assert spec is not None and spec.submodule_search_locations, "vllm-omni is not installed (.ci/install)"
    package = types.ModuleType("vllm_omni")
    package.__path__ = list(spec.submodule_search_locations)
    package.__file__ = str(Path(package.__path__[0]) / "__init__.py")
    sys.modules["vllm_omni"] = package


_register_bare_package()
duplex = importlib.import_module("vllm_omni.clients.duplex")
personaplex = importlib.import_module("vllm_omni.clients.personaplex")
minicpmo = importlib.import_module("vllm_omni.clients.minicpmo_4_5")
