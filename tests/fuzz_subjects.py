"""Every subject of the differential fuzzer, by name: the counter-branching models of
`fuzzkit.py`, the tests' probes and examples (`fuzz_probes.py`) and the families at their tiny
depths (`fuzz_families.py`). Each entry builds its subject (a transform) when called."""

from __future__ import annotations

from collections.abc import Callable

from fuzz_families import FAMILIES
from fuzz_probes import PROBES
from fuzzkit import TOYS, Subject

SUBJECTS: dict[str, Callable[[], Subject]] = {**TOYS, **PROBES, **FAMILIES}
