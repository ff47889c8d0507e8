"""The garbage collector in a serving process: its pauses, measured, and kept short.

CPython's full collection (generation 2) walks every object the process tracks while it holds
the interpreter. A loaded server is some 310,000 objects (torch, the model, uvicorn) that live as
long as the process, and its sessions' short-lived objects, promoted into generation 2, make a
full collection come every few seconds. Traced by hand at 64 ``moshi-tiny`` sessions with each
tick a 57.5 ms sleep (2 CPU cores): full collections took 155 to 246 ms, every tick that took
over 100 ms had one inside it, and the replies that stalled most each had one such gap between two deltas
(``bench/results/history/serve_load_moshi_tiny_tick_double_64_e902e0c.json``: stall p95 130 ms).

``settle()``, once the process has loaded what it keeps for its life (the server after the
plugin's ``reserve``, a model worker after its batch), collects once and moves every object left
into the permanent generation (``gc.freeze``): later collections walk only what came after.
``PAUSES`` counts every collection and how long it held the interpreter, per generation, so
that a run's record shows the pauses it had (``/health``'s ``gc``, a worker's ``describe()``).
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

__all__ = ["PAUSES", "CollectorPauses", "settle"]


class CollectorPauses:
    """The collections of this process since ``watch()``: per generation, how many and the
    longest and total time each held the interpreter."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started: float | None = None
        self._watching = False
        self.counts = [0, 0, 0]
        self.max_s = [0.0, 0.0, 0.0]
        self.total_s = [0.0, 0.0, 0.0]

    def watch(self) -> None:
        """Start counting (once per process; later calls do nothing)."""
        with self._lock:
            if not self._watching:
                self._watching = True
                gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        # Called by the collecting thread, which holds the interpreter: no other callback runs meanwhile.
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            seconds, generation = time.perf_counter() - self._started, info["generation"]
            self._started = None
            self.counts[generation] += 1
            self.total_s[generation] += seconds
            self.max_s[generation] = max(self.max_s[generation], seconds)

    def record(self) -> dict[str, Any]:
        return {
            "frozen_objects": gc.get_freeze_count(),
            "generations": [
                {"collections": count, "max_ms": round(1e3 * longest, 2), "total_ms": round(1e3 * total, 2)}
                for count, longest, total in zip(self.counts, self.max_s, self.total_s)
            ],
        }


PAUSES = CollectorPauses()


def settle() -> None:
    """Everything the process holds now lives as long as the process: collect once, then leave it
    out of every later collection. Call it once startup is done, in a process the caller owns."""
    gc.collect()
    gc.freeze()
