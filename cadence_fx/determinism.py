"""Determinism envelope: bit-exactness is defined against a deterministic eager baseline.

With default cuDNN settings some eager programs are not equal to themselves (the
Token2Wav HiFT's convolutions picked a nondeterministic algorithm and two eager runs from one RNG state
differed). So every arm that claims bit-exactness pins deterministic kernels, reports the settings
it ran under, and first checks eager against itself with `check_repeatable`.

The switches are process-wide, so pinning them is the caller's explicit step, taken once before
any stream runs, the reference stream included: `pin_deterministic()`, or `deterministic()` for a
scope. A transform sets none of them; its report records those it found (`settings()`) and says
whether they are pinned (`envelope()`).

`RngState` and `StateSnapshot` are the two halves of "run this call again from the same state":
the replay engine uses them to make its probationary call invisible.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = [
    "RngState",
    "StateSnapshot",
    "Repeatability",
    "settings",
    "pinned",
    "envelope",
    "pin_deterministic",
    "deterministic",
    "check_repeatable",
]

_CUBLAS_WORKSPACE = ":4096:8"


def settings() -> dict[str, Any]:
    """Every switch that decides which kernels run, as a flat dict for reports."""
    report: dict[str, Any] = {
        "torch": torch.__version__,
        "cudnn.deterministic": torch.backends.cudnn.deterministic,
        "cudnn.benchmark": torch.backends.cudnn.benchmark,
        "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        "cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_algorithms.warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    return report


def pinned() -> bool:
    """Whether the switches bit-exactness is defined under are in force: cuDNN deterministic, its
    autotuning off."""
    return torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark


def envelope() -> str:
    """One line for a report: the determinism envelope found in force, and what to do if it is not."""
    if pinned():
        return "determinism envelope: pinned (cudnn.deterministic=True, cudnn.benchmark=False)"
    return (
        f"determinism envelope: NOT pinned (cudnn.deterministic={torch.backends.cudnn.deterministic}, "
        f"cudnn.benchmark={torch.backends.cudnn.benchmark}): eager may not repeat itself on a GPU, so neither "
        "can the transformed model; call cadence_fx.determinism.pin_deterministic() before running any stream"
    )


def pin_deterministic(*, algorithms: bool = False) -> dict[str, Any]:
    """Pin deterministic kernels for the rest of the process; returns `settings()`.

    cuDNN is the switch the measured models need (deterministic on, autotuning off: benchmark mode
    may pick a different algorithm per process). `algorithms=True` additionally turns on
    `torch.use_deterministic_algorithms`, which raises on ops that have no deterministic kernel
    and needs a fixed cuBLAS workspace (set here if the environment does not already set one).
    """
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    if algorithms:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", _CUBLAS_WORKSPACE)
        torch.use_deterministic_algorithms(True)
    return settings()


@contextlib.contextmanager
def deterministic(*, algorithms: bool = False) -> Iterator[dict[str, Any]]:
    """`pin_deterministic` for a scope; restores the previous switches on exit."""
    before = (
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )
    try:
        yield pin_deterministic(algorithms=algorithms)
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[0], before[1]
        torch.use_deterministic_algorithms(before[2], warn_only=before[3])
        if before[4] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = before[4]


def _philox(state: torch.Tensor) -> tuple[int, int]:
    raw = bytes(state.tolist())
    return int.from_bytes(raw[:8], "little"), int.from_bytes(raw[8:16], "little", signed=True)


@dataclass(frozen=True)
class RngState:
    """Host RNGs (torch CPU generator, `random`, numpy if imported) and each default CUDA generator.

    A CUDA generator's state is its (seed, philox offset) pair; reading it needs no sync.
    """

    torch_cpu: bytes
    python: Any
    numpy: Any
    cuda: tuple[tuple[int, int], ...]

    @classmethod
    def capture(cls) -> RngState:
        np = sys.modules.get("numpy")
        cuda: tuple[tuple[int, int], ...] = ()
        if torch.cuda.is_available():
            cuda = tuple(_philox(s) for s in torch.cuda.get_rng_state_all())
        return cls(
            torch_cpu=bytes(torch.get_rng_state().tolist()),
            python=random.getstate(),
            numpy=np.random.get_state() if np is not None else None,
            cuda=cuda,
        )

    def restore(self) -> None:
        # Generator states are CPU byte tensors, whatever the default device (torch.set_default_device)
        torch.set_rng_state(torch.tensor(list(self.torch_cpu), dtype=torch.uint8, device="cpu"))
        random.setstate(self.python)
        np = sys.modules.get("numpy")
        if self.numpy is not None and np is not None:
            np.random.set_state(self.numpy)
        for device, (seed, offset) in enumerate(self.cuda):
            raw = seed.to_bytes(8, "little") + offset.to_bytes(8, "little", signed=True)
            torch.cuda.set_rng_state(torch.tensor(list(raw), dtype=torch.uint8, device="cpu"), device)

    def host_readers(self, after: RngState) -> tuple[str, ...]:
        """Which host RNGs changed between `self` and `after`."""
        changed = []
        if self.torch_cpu != after.torch_cpu:
            changed.append("torch.get_rng_state")
        if self.python != after.python:
            changed.append("random")
        if self.numpy is not None and after.numpy is not None and not _numpy_state_equal(self.numpy, after.numpy):
            changed.append("numpy.random")
        return tuple(changed)

    def device_advance(self, after: RngState) -> tuple[int, ...]:
        """Philox offset advance of each CUDA default generator between `self` and `after`."""
        return tuple(b[1] - a[1] for a, b in zip(self.cuda, after.cuda))


def _numpy_state_equal(a: Any, b: Any) -> bool:
    import numpy as np

    return a[0] == b[0] and np.array_equal(a[1], b[1]) and tuple(a[2:]) == tuple(b[2:])


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version counter
        return None


@dataclass
class StateSnapshot:
    """Clones of the tensors a call may write (its tensor arguments, the modules' buffers).

    Clones of CUDA tensors are kept in host memory, so taking a snapshot (of a multi-GiB cache,
    say) adds nothing to the device's peak; certification costs a device-to-host copy instead.
    `restore` writes back in place, so every address is kept, and only into tensors whose version
    counter moved (inference tensors, which have none, when their values changed). `written`
    names the tensors that the call wrote.
    """

    tensors: list[tuple[str, torch.Tensor, torch.Tensor, int | None]] = field(default_factory=list)

    @classmethod
    def of(cls, named: Iterable[tuple[str, torch.Tensor]]) -> StateSnapshot:
        seen: set[int] = set()
        entries = []
        for name, t in named:
            if id(t) in seen:
                continue
            seen.add(id(t))
            saved = t.detach().to("cpu", copy=True) if t.is_cuda else t.detach().clone()
            entries.append((name, t, saved, _version(t)))
        return cls(entries)

    @staticmethod
    def _changed(t: torch.Tensor, saved: torch.Tensor, version: int | None) -> bool:
        # Inference tensors keep no version counter: compare their values instead.
        return not torch.equal(t.to(saved.device), saved) if version is None else _version(t) != version

    def written(self) -> tuple[str, ...]:
        return tuple(name for name, t, saved, v in self.tensors if self._changed(t, saved, v))

    def restore(self) -> None:
        for _, t, saved, v in self.tensors:
            if self._changed(t, saved, v):
                with torch.inference_mode(t.is_inference()):
                    t.copy_(saved)


@dataclass(frozen=True)
class Repeatability:
    """Outcome of running one call twice from the same state."""

    equal: bool
    mismatches: tuple[str, ...]

    def __bool__(self) -> bool:
        return self.equal


def check_repeatable(
    fn: Callable[..., Any], *args: Any, runs: int = 2, modules: Iterable[torch.nn.Module] = (), **kwargs: Any
) -> Repeatability:
    """Run `fn(*args, **kwargs)` `runs` times from one RNG and tensor state; compare bit for bit.

    State (RNG, tensor arguments, module buffers) is rewound before each run and left as the last
    run leaves it, as one eager call would.
    """
    leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    named = [(f"arg{i}", t) for i, t in enumerate(leaves)]
    named += [(f"buffer {n}", b) for m in modules for n, b in m.named_buffers()]
    snapshot, rng = StateSnapshot.of(named), RngState.capture()
    outputs = []
    for i in range(runs):
        if i:
            snapshot.restore()
            rng.restore()
        with torch.no_grad():
            outputs.append(pytree.tree_leaves(fn(*args, **kwargs)))
    mismatches = []
    for i, out in enumerate(outputs[1:], start=1):
        if len(out) != len(outputs[0]):
            mismatches.append(f"run {i}: {len(out)} outputs, run 0: {len(outputs[0])}")
            continue
        for j, (a, b) in enumerate(zip(outputs[0], out)):
            if isinstance(a, torch.Tensor):
                if not torch.equal(a, b):
                    diff = (a.double() - b.double()).abs()
                    mismatches.append(
                        f"run {i} output {j}: {int((diff != 0).sum())} of {a.numel()} elements differ, "
                        f"max |diff| {float(diff.max()):.3g}"
                    )
            elif a != b:
                mismatches.append(f"run {i} output {j}: {b!r} != {a!r}")
    return Repeatability(not mismatches, tuple(mismatches))
