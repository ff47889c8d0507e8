"""``serve/runtime/heap.py``: the collections a serving process had, counted per generation, and the
settled heap that later collections leave out."""

from __future__ import annotations

import gc
import subprocess
import sys

from cadence_fx.serve.runtime.heap import CollectorPauses


def test_every_collection_is_counted_in_its_generation():
    pauses = CollectorPauses()
    enabled = gc.isenabled()
    gc.disable()  # no automatic collection between the ones the test makes
    pauses.watch()
    pauses.watch()  # once per process: a second watch adds no second count
    try:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    finally:
        gc.callbacks.remove(pauses._callback)
        if enabled:
            gc.enable()
    record = pauses.record()
    assert [g["collections"] for g in record["generations"]] == [1, 0, 2]
    assert all(g["max_ms"] <= g["total_ms"] for g in record["generations"])
    assert record["generations"][1] == {"collections": 0, "max_ms": 0.0, "total_ms": 0.0}


def test_settle_leaves_everything_alive_out_of_later_collections():
    # In a process of its own: a frozen heap stays frozen for the process's life.
    code = (
        "import gc; from cadence_fx.serve.runtime.heap import settle; kept = [[i] for i in range(10000)]; "
        "assert gc.get_freeze_count() == 0; settle(); frozen = gc.get_freeze_count(); "
        "assert frozen >= 10000, frozen; assert gc.get_count()[0] < 10, gc.get_count(); print('settled')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, "settled\n", "")
