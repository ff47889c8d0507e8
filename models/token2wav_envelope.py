"""Batch-invariant envelope: a Token2Wav stream's bits do not depend on the streams batched with it.

Declared the way `cadence_fx.determinism` declares the determinism envelope: what it is made of
(`OP_CLASSES`), the settings a record reports (`settings`), a one-line report (`envelope`), and
the scope that puts it in force (`batch_invariant`). It is opt-in: outside it Token2Wav runs the
stock kernels at the stock shapes, exact to the vendor as before.

Two routes (`ROUTES`, by device). On the CPU, `per_row`: every batch-sensitive op (the table
below) is called once a row, on a fresh contiguous copy of that row, so each call has exactly the
shape, values and memory layout the row has alone, and cannot see its neighbours: invariant by
construction, given a kernel that repeats itself on one shape (the determinism envelope). On CUDA,
`padded` (declared; the cuda tests decide it): every batch operand is tiled up to `capacity` rows
per row of a stream, so a kernel sees one shape whether one row or all are live, and the vendor's
own code run alone computes each op at the batched call's shape. Padding to buckets of several
sizes would not do: each bucket picks its own kernels. The padded route relies on what a kernel
does not promise, that at one shape a row's result depends neither on the other rows' values nor
on its position; on the CPU it failed twice while this was built (a linear of one vector a row at
5 to 7 and 9 to 11 rows, oneDNN's small-M path; HiFT's strided conv, row 1 of 3), which is why the
CPU runs per row, and why linears of one vector a row run per row on both devices.

Padding is cyclic: the call's rows are tiled up to the capacity (an operand of one row, shared by
every stream, e.g. the conformer's relative positions, is tiled like any other), always through a
fresh contiguous copy, so the kernel's input layout never depends on how the rows arrived.

HiFT draws noise on every call. Under the envelope each stream draws from its own counter-based
state (`StreamRng`: a seed and an offset, nothing else): draw k of a stream comes from a generator
seeded by (seed, k) alone, so its noise never depends on its neighbours, on how many streams share
the call, or on the process generator. The state is two integers, so saving and restoring a row's
RNG is a copy of a tuple. Each draw seeds a fresh generator with splitmix64(seed, k) (`_mix`): on
the CPU torch's generator is a Mersenne Twister whose state is 5 KB, so the counter is folded into
the seed; on CUDA the generator is a Philox whose state is that seed and a zero offset (Philox's own
offset is not used as the counter: a draw consumes a shape-dependent stretch of it).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from cadence_fx.determinism import pinned as determinism_pinned

__all__ = [
    "OP_CLASSES",
    "BatchInvariant",
    "OpClass",
    "StreamRng",
    "batch_invariant",
    "envelope",
    "in_force",
    "settings",
]


@dataclass(frozen=True)
class OpClass:
    """One class of op the flow (conformer encoder, CFM estimator) and HiFT run, and how it is made
    batch-invariant on each device. `functions` are the torch entry points the envelope pads
    (empty: the class is left as it runs, and why is in `cpu`)."""

    name: str
    functions: tuple[Callable[..., Any], ...]
    #: Positional arguments that carry the batch (others, e.g. weights, are left alone).
    operands: tuple[int, ...]
    cpu: str
    cuda: str


_ROW = "one call a row, a fresh contiguous copy each"
_FIXED = "padded to the capacity's rows: one shape per class"
OP_CLASSES: tuple[OpClass, ...] = (
    OpClass(
        "linear",
        (F.linear,),
        (0,),
        cpu=f"{_ROW} (every projection and MLP, adaLN, the timestep MLP, the speaker projection, HiFT's source merge)",
        cuda=f"{_FIXED}, under pin_deterministic(algorithms=True); a linear of one vector a row: {_ROW} (padded, "
        "oneDNN gave such rows other bits by position on the CPU)",
    ),
    OpClass(
        "matmul",
        (torch.matmul, torch.Tensor.matmul, torch.bmm),
        (0, 1),
        cpu=f"{_ROW} (the conformer's scores, relative-position term and values; operands of 3+ dims)",
        cuda=_FIXED,
    ),
    OpClass(
        "attention",
        (F.scaled_dot_product_attention,),
        (0, 1, 2, 3),
        cpu=f"{_ROW} (the DiT's SDPA, no mask, each row attending its own cache)",
        cuda=f"{_FIXED}; the backend is chosen by shape, so one backend",
    ),
    OpClass(
        "conv1d",
        (torch.conv1d, F.conv1d),
        (0,),
        cpu=f"{_ROW} (DiT causal convs, conformer pre-lookahead and upsample, HiFT)",
        cuda=f"{_FIXED}; cudnn.deterministic on, benchmark off (an algorithm per shape, never autotuned)",
    ),
    OpClass(
        "conv_transpose1d",
        (torch.conv_transpose1d, F.conv_transpose1d),
        (0,),
        cpu=f"{_ROW} (HiFT's upsampling)",
        cuda=f"{_FIXED}; as conv1d",
    ),
    OpClass(
        "norms",
        (F.layer_norm, torch.softmax, torch.Tensor.softmax, F.softmax, F.normalize),
        (0,),
        cpu=f"{_ROW} (layer norm, softmax, the speaker embedding's L2 norm)",
        cuda=_FIXED,
    ),
    OpClass(
        "spectral",
        (torch.stft, torch.istft),
        (0,),
        cpu=f"{_ROW} (HiFT's source analysis and synthesis)",
        cuda=f"{_FIXED}; cuFFT plans are per shape",
    ),
    OpClass(
        "scan and resample",
        (torch.cumsum, torch.Tensor.cumsum, F.interpolate),
        (0,),
        cpu=f"{_ROW} (HiFT's sine source: phase cumsum along time, linear and nearest resampling)",
        cuda=_FIXED,
    ),
    OpClass(
        "elementwise",
        (),
        (),
        cpu="left as it runs (additions, activations, exp/sin, concatenation, slicing, the cross-fade): each "
        "output element is its inputs' function alone; the stream tests check it holds at every batch "
        "size they run",
        cuda="left as it runs; same argument, checked by the cuda tests",
    ),
    OpClass(
        "random draws",
        (torch.rand, torch.randn, torch.rand_like, torch.randn_like),
        (),
        cpu="each row drawn from its stream's StreamRng (seed, offset), never the process generator; any other "
        "random op under the envelope is refused",
        cuda="each row's StreamRng: a Philox generator seeded per draw with splitmix64(seed, offset)",
    ),
)

_PADDED: dict[Callable[..., Any], OpClass] = {f: c for c in OP_CLASSES if c.name != "random draws" for f in c.functions}
_DRAWS = {torch.rand: torch.rand, torch.randn: torch.randn, torch.rand_like: torch.rand, torch.randn_like: torch.randn}
_REFUSED_DRAWS = (
    torch.randint,
    torch.randint_like,
    torch.normal,
    torch.bernoulli,
    torch.multinomial,
    torch.poisson,
    torch.randperm,
    torch.Tensor.uniform_,
    torch.Tensor.normal_,
    torch.Tensor.random_,
    torch.Tensor.exponential_,
    torch.Tensor.bernoulli_,
    torch.Tensor.geometric_,
    torch.Tensor.log_normal_,
    torch.Tensor.cauchy_,
)


def _mix(seed: int, offset: int) -> int:
    """splitmix64 of (seed, offset): a CPU generator seed that is a function of the pair alone."""
    z = (seed * 0x9E3779B97F4A7C15 + offset + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


@dataclass
class StreamRng:
    """A stream's own counter-based RNG state: draw k is a function of (seed, offset=k) alone."""

    seed: int
    offset: int = 0

    def __post_init__(self) -> None:
        for name in ("seed", "offset"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"StreamRng.{name} must be a non-negative int, got {value!r}")

    def state(self) -> tuple[int, int]:
        return self.seed, self.offset

    def draw(self, kind: Callable[..., torch.Tensor], shape: Sequence[int], *, dtype, device) -> torch.Tensor:
        """One draw of `shape`; the offset advances by one whatever the shape."""
        generator = torch.Generator(device=torch.device(device))
        # Not Philox's own offset on CUDA: a draw consumes a shape-dependent stretch of counters, so
        # draw k at offset k would overlap draw k + 1. A seed per (seed, k) keeps draws apart.
        generator.manual_seed(_mix(self.seed, self.offset))
        self.offset += 1
        return kind(*shape, generator=generator, dtype=dtype, device=device)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """`t`'s rows tiled up to `rows`, always a fresh contiguous copy."""
    copies = -(-rows // t.shape[0])
    return torch.cat([t] * copies)[:rows].contiguous() if copies > 1 else t.contiguous().clone()


class BatchInvariant(TorchFunctionMode):
    """The envelope in force for one call of `streams` rows (1: the vendor's code run alone), by
    `route` ("per_row" or "padded", `ROUTES` by device)."""

    def __init__(self, capacity: int, rngs: Sequence[StreamRng], route: str):
        super().__init__()
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        if not 1 <= len(rngs) <= capacity:
            raise ValueError(f"a call holds 1 to capacity={capacity} streams, got {len(rngs)}")
        if route not in ("per_row", "padded"):
            raise ValueError(f"route must be 'per_row' or 'padded', got {route!r}")
        self.capacity, self.rngs, self.streams, self.route = capacity, list(rngs), len(rngs), route
        self.padded_calls = self.per_row_calls = 0

    def _check_rows(self, rows: int, name: str) -> None:
        if rows != 1 and rows % self.streams:
            raise RuntimeError(
                f"batch-invariant envelope: {name} got {rows} rows for {self.streams} streams; "
                "expected a multiple of the streams (or 1, an operand every stream shares)"
            )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("generator") is not None:  # a draw from a generator of its own, not the process's
            return func(*args, **kwargs)
        if func in _DRAWS:
            return self._draw(func, args, kwargs)
        if func in _REFUSED_DRAWS:
            raise RuntimeError(
                f"batch-invariant envelope: {getattr(func, '__name__', func)} would draw from the process "
                "generator; only rand, randn, rand_like and randn_like draw per stream (or pass a generator)"
            )
        op = _PADDED.get(func)
        if op is None:
            return func(*args, **kwargs)
        args, kwargs = list(args), dict(kwargs)
        positions = [i for i in op.operands if i < len(args) and isinstance(args[i], torch.Tensor)]
        if op.name == "matmul":  # a 2-D operand is a weight, not a batch
            positions = [i for i in positions if args[i].dim() >= 3]
        if not positions:
            return func(*args, **kwargs)
        mask = kwargs.get("attn_mask") if op.name == "attention" else None
        batched_mask = isinstance(mask, torch.Tensor) and mask.dim() == 4
        rows = max(args[i].shape[0] for i in positions)
        for i in positions:
            self._check_rows(args[i].shape[0], op.name)
        vector_linear = op.name == "linear" and args[0].numel() == rows * args[0].shape[-1]
        if self.route == "per_row" or vector_linear:
            return self._per_row(func, args, kwargs, positions, batched_mask, rows)
        return self._padded(func, args, kwargs, positions, batched_mask, rows)

    def _padded(self, func, args: list, kwargs: dict, positions: list[int], batched_mask: bool, rows: int):
        """Every batch operand tiled to the capacity's rows: one shape whatever is live."""
        target = self.capacity * math.ceil(rows / self.streams)
        for i in positions:
            args[i] = _pad_rows(args[i], target)
        if batched_mask:
            kwargs["attn_mask"] = _pad_rows(kwargs["attn_mask"], target)
        self.padded_calls += 1
        out = func(*args, **kwargs)
        if isinstance(out, tuple):
            return tuple(o[:rows] if isinstance(o, torch.Tensor) else o for o in out)
        return out[:rows]

    def _per_row(self, func, args: list, kwargs: dict, positions: list[int], batched_mask: bool, rows: int):
        """One call a row, each operand a fresh contiguous copy: every call has the shape and the
        memory layout of a stream's row alone, so it cannot see its neighbours. (Fresh copies: a
        row sliced from a batch sits at another alignment than a tensor of its own.)"""
        outs = []
        for r in range(rows):
            call_args, call_kwargs = list(args), dict(kwargs)
            for i in positions:
                t = args[i]
                call_args[i] = (t[r : r + 1] if t.shape[0] == rows else t).clone(memory_format=torch.contiguous_format)
            if batched_mask and kwargs["attn_mask"].shape[0] == rows:
                call_kwargs["attn_mask"] = kwargs["attn_mask"][r : r + 1]
            outs.append(func(*call_args, **call_kwargs))
        self.per_row_calls += 1
        if isinstance(outs[0], tuple):
            return tuple(torch.cat(parts) if isinstance(parts[0], torch.Tensor) else parts[0] for parts in zip(*outs))
        return torch.cat(outs)

    def _draw(self, func, args, kwargs):
        like = func in (torch.rand_like, torch.randn_like)
        if like:
            base = args[0]
            shape, dtype, device = tuple(base.shape), kwargs.get("dtype") or base.dtype, kwargs.get("device") or base.device
        else:
            shape = tuple(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else tuple(args)
            dtype, device = kwargs.get("dtype") or torch.get_default_dtype(), kwargs.get("device") or "cpu"
        if not shape or shape[0] != self.streams:
            raise RuntimeError(
                f"batch-invariant envelope: a draw of shape {shape} under {self.streams} stream(s); "
                "expected one row per stream along dimension 0"
            )
        kind = _DRAWS[func]
        rows = [rng.draw(kind, (1, *shape[1:]), dtype=dtype, device=device) for rng in self.rngs]
        return torch.cat(rows) if len(rows) > 1 else rows[0]


_ACTIVE: list[BatchInvariant] = []


#: The route each device runs under the envelope (see the module's docstring and `OP_CLASSES`).
ROUTES = {"cpu": "per_row", "cuda": "padded"}


def route_for(device: torch.device | str) -> str:
    kind = torch.device(device).type
    if kind not in ROUTES:
        raise ValueError(f"the batch-invariant envelope is declared for {sorted(ROUTES)}, not {kind!r}")
    return ROUTES[kind]


@contextlib.contextmanager
def batch_invariant(capacity: int, rngs: Sequence[StreamRng], device: torch.device | str = "cpu") -> Iterator[BatchInvariant]:
    """The batch-invariant envelope for one call of `len(rngs)` streams at `capacity` rows on `device`."""
    mode = BatchInvariant(capacity, rngs, route_for(device))
    _ACTIVE.append(mode)
    try:
        with mode:
            yield mode
    finally:
        _ACTIVE.pop()


def in_force() -> BatchInvariant | None:
    """The envelope in force on this thread's call, if any."""
    return _ACTIVE[-1] if _ACTIVE else None


def settings(capacity: int) -> dict[str, Any]:
    """What a record states about the envelope it ran under."""
    return {
        "route": "fixed padded shape per class",
        "capacity": capacity,
        "op_classes": {c.name: {"cpu": c.cpu, "cuda": c.cuda} for c in OP_CLASSES},
        "rng": "StreamRng per stream (seed, offset)",
        "determinism_pinned": determinism_pinned(),
    }


def envelope(capacity: int | None) -> str:
    """One line for a report: which exactness a batched Token2Wav run claims."""
    if capacity is None:
        return "batch-invariant envelope: off (one stream a call, stock kernels, exact to the vendor's stream)"
    return (
        f"batch-invariant envelope: capacity {capacity} (every batch-sensitive op at {capacity} rows a stream row, "
        "noise per stream): each stream exact to the vendor's stream run alone under the same envelope"
    )
