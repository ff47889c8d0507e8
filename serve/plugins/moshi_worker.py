"""Moshi's ticks where they run (a worker process, or a thread of the server process): a place's
``_Engine`` holds its weights and its batch of slots, and ``_worker_main`` answers a worker's
requests with one. What places are and why they run where they do: ``moshi_places.py``.

A tick's answer for a slot is ``(pcm, text)``: its 1920 output samples and the id of the text
token sampled with them (the vendor's ``tokens[:, 0]``), or None before the slot's acoustic delay.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from cadence_fx.determinism import pin_deterministic
from cadence_fx.memory import DeviceMemory
from cadence_fx.models.moshi import contract_for
from cadence_fx.models.moshi_checkpoint import MoshiCheckpoint
from cadence_fx.models.moshi_slots import MoshiSlots, Tick, transform_slots
from cadence_fx.models.moshi_stream import FULL, SMALL, TINY, MoshiConfig, build_models, no_compile

from ..runtime.heap import PAUSES, settle

SIZES: dict[str, MoshiConfig] = {"tiny": TINY, "small": SMALL, "full": FULL}
WORKER_OPS = ("tick", "start", "parameters", "describe")
#: A slot's answer to one tick: its output samples and its text token's id; None before its acoustic delay.
Spoken = tuple[np.ndarray, int]


class _Engine:
    """A place's weights (a checkpoint's, else random from the seed) and its batch of slots
    (``MoshiSlots``: Moshi's slots bindings on the one pipeline), on one device."""

    def __init__(self, config: MoshiConfig, sampling: bool, device: str, checkpoint: MoshiCheckpoint | None) -> None:
        self.config, self.sampling, self.device = config, sampling, torch.device(device)
        self.models = build_models(config, self.device) if checkpoint is None else checkpoint.load(self.device, config.lm_dtype)
        self.runtime: MoshiSlots | None = None
        self.start_error: str | None = None  # why the batch could not be built, for every tick after
        self.ticks = 0  # batched calls
        self.tick_seconds = 0.0  # spent ticking: this place's load
        self.tick_cpu_seconds = 0.0  # of which its thread ran on a core (less: others had it, or the GPU worked)
        # The tick's wall time in its parts: the frames made tensors; the batched call (on a GPU:
        # its launches and the vendor glue's waits); its outputs copied to the host in one copy
        # (on a GPU: the wait for the device's last stage) and split into the slots' rows.
        self.phase_seconds = {"inputs": 0.0, "call": 0.0, "outputs": 0.0}
        # On a GPU, also the device's span from the call's first launch to the end of its last
        # stage (CUDA events, read once the outputs' copy has waited past them): beyond the
        # stages' own device time, the device waited for the host inside the tick.
        if self.device.type == "cuda":
            self.phase_seconds["device"] = 0.0
        # This process's device memory (peak allocated, reserved, footprint): a worker process's
        # own, which the server process, holding no CUDA memory of its own, cannot see.
        self.memory = DeviceMemory(self.device) if self.device.type == "cuda" else None

    def handle(self, op: str, args: tuple) -> Any:
        if op == "tick":
            started, cpu = time.perf_counter(), time.thread_time()
            outs = self.tick(*args)
            self.tick_seconds += time.perf_counter() - started
            self.tick_cpu_seconds += time.thread_time() - cpu
            return outs
        if op == "start":
            return self.start(*args)
        if op == "describe":
            return self.describe()
        if op == "parameters":
            return tuple(sum(p.numel() for p in m.parameters()) for m in (self.models.mimi, self.models.lm))
        raise ValueError(f"unknown worker operation {op!r}; expected one of {', '.join(WORKER_OPS)}")

    def start(self, slots: int) -> None:
        """The batch of ``slots`` slots, built (its stages warmed up: certified on a CPU, captured
        on a GPU) and reset to a fresh streaming state, so no session's frame pays for it."""
        try:
            self.runtime, _ = transform_slots(
                self.models, contract_for(self.config, slots=slots), sampling=self.sampling, seed=self.config.seed
            )
        except Exception as error:
            self.start_error = f"{type(error).__name__}: {error}"
            raise

    def tick(self, frames: dict[int, np.ndarray], joins: tuple[int, ...]) -> dict[int, Spoken | None]:
        """One batched call: each live slot's 1920 output samples and text token's id (None before
        its acoustic delay)."""
        if self.runtime is None:
            why = f"its start failed: {self.start_error}" if self.start_error else "its start never ran"
            raise RuntimeError(f"this place has no batch: {why}")
        started = time.perf_counter()
        tick = Tick({slot: torch.from_numpy(frame) for slot, frame in frames.items()}, joins)
        on_gpu = self.device.type == "cuda"
        if on_gpu:
            first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            first.record()
        called = time.perf_counter()
        out = self.runtime.tick(tick)
        returned = time.perf_counter()
        if on_gpu:
            last.record()
        pcm = out.pcm.to("cpu").numpy()  # one copy for the batch, fresh each tick: its rows are the outputs
        if on_gpu:
            self.phase_seconds["device"] += first.elapsed_time(last) / 1e3  # done: the copy waited past it
        text = out.tokens[:, 0].tolist()  # each row's text token id (B ints: one small copy more)
        speaking = set(out.speaking)
        outputs = {slot: (pcm[slot], text[slot]) if slot in speaking else None for slot in frames}
        ended = time.perf_counter()
        for phase, seconds in (("inputs", called - started), ("call", returned - called), ("outputs", ended - returned)):
            self.phase_seconds[phase] += seconds
        self.ticks += 1
        return outputs

    def close(self) -> None:
        if self.runtime is not None:
            self.runtime.close()

    def describe(self) -> dict[str, Any]:
        runtime = self.runtime
        return {
            "slots": None if runtime is None else runtime.slots,
            "warm_up_ticks": 0 if runtime is None else runtime.warm_up_ticks,
            "ticks": self.ticks,
            "tick_seconds": round(self.tick_seconds, 3),
            "tick_cpu_seconds": round(self.tick_cpu_seconds, 3),
            "phase_seconds": {phase: round(seconds, 3) for phase, seconds in self.phase_seconds.items()},
            "stamps": [] if runtime is None else list(runtime.report.stamps),
            "replays": {} if runtime is None else runtime.counters(),
            "memory": None if self.memory is None else self.memory.record(),
            "gc": PAUSES.record(),
        }


def _worker_main() -> None:
    """A worker process (started by ``_Worker``): answers requests ``(op, args)`` on the
    connection at file descriptor ``argv[2]``, one at a time, until None or the server is gone."""
    options = json.loads(sys.argv[1])
    conn = Connection(int(sys.argv[2]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when its workers stop
    if options["cores"]:
        os.sched_setaffinity(0, options["cores"])
    torch.set_num_threads(options["threads"])
    torch.set_grad_enabled(False)
    config = dataclasses.replace(SIZES[options["size"]], seed=options["seed"])
    checkpoint = None if options["weights"] is None else MoshiCheckpoint.from_json(options["weights"])
    if options["device"] == "cuda":
        pin_deterministic()  # this process's: a stream is bit-exact against deterministic eager
    with no_compile():
        engine = _Engine(config, options["sampling"], options["device"], checkpoint)
        while True:
            try:
                request = conn.recv()
            except EOFError:
                return
            if request is None:
                return
            op, args = request
            try:
                answer = engine.handle(op, args)
            except Exception:
                conn.send(("error", traceback.format_exc()))
                continue
            if op == "start":
                settle()  # the weights and the batch live as long as the process: no collection walks them again
                PAUSES.watch()  # the collections while it ticks
            conn.send(("ok", answer))
