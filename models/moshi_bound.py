"""One Moshi session at a time (batch 1) on the one pipeline: the family's hook behind
`transform(models, moshi_contract(...))`.

Moshi is two models, Mimi and the LM, and its vendor's loop drives them through `LMGen`, which
holds the glue between the LM's two steps (the delayed-token cache, the text sampling). Each
model is transformed from its binding (`models/moshi.py`), as any user's model would be:
Mimi from `MIMI_BINDING`, a streaming `LMGen` from `MOSHI_LM_BINDING`; the vendor's glue then
calls the bound LM steps as its `graphed_main` and `graphed_depth`, as it calls its own CUDA-graph
wrappers. What this hook adds is only that assembly (`transform_moshi`) and the session loop
(`BoundMoshi.session`): nothing is rewritten here, every ring is the vendor's own, written in place.

The transformed model streams on its own copy of the modules around the caller's weights (shared,
not copied), always streaming at batch 1: a new session writes a fresh entry's state in place
(the vendor's `reset_streaming`), so every ring, offset and buffer keeps one address for the life
of the model and the graphs keep serving every session. The caller's modules never stream for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cadence_fx.binding import Binding
from cadence_fx.contract import Contract
from cadence_fx.multiplex import Transformed
from cadence_fx.pipeline import BoundModel
from cadence_fx.transform import TransformReport, transform

from .moshi import MIMI_BINDING, MOSHI_LM_BINDING
from .moshi_stream import MoshiModels, StreamOutput, streaming_copy

__all__ = ["BoundMoshi", "bind", "replays", "transform_moshi"]

#: Frames of silence streamed per decoding mode at construction: each operator's first two visits
#: are verified against the stock call, the next one (on a GPU) captured.
WARM_UP_FRAMES = 3


@dataclass
class _Slot:
    owner: Any  # a vendor State (or a RingKVCache inside one)
    attr: str
    tensor: torch.Tensor  # the original: the one address this slot keeps


def _is_vendor_object(value: Any) -> bool:
    from moshi.utils.compile import CUDAGraphed

    module = type(value).__module__
    return module.startswith("moshi.") and not isinstance(value, (CUDAGraphed, torch.nn.Module)) and hasattr(value, "__dict__")


@dataclass
class OwnedState:
    """The streaming state of some vendor modules, owned for the life of a transformed model:
    `tensors` keep one address each (state the vendor rebinds is written into the original:
    `keep_addresses`); `counters` are the host-side integers (`read`, `write`)."""

    tensors: list[_Slot] = field(default_factory=list)
    counters: list[tuple[Any, str]] = field(default_factory=list)

    @classmethod
    def of(cls, states: dict[str, dict[str, Any]]) -> OwnedState:
        """Every tensor and host integer reachable from `states` (module path -> its `get_streaming_state()`)."""
        owned = cls()
        seen: set[int] = set()
        for entries in states.values():
            for state in entries.values():
                owned._walk(state, seen)
        return owned

    def _walk(self, obj: Any, seen: set[int]) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        for attr, value in vars(obj).items():
            if isinstance(value, torch.Tensor):
                self.tensors.append(_Slot(obj, attr, value))
            elif type(value) is int:
                self.counters.append((obj, attr))
            elif _is_vendor_object(value):
                self._walk(value, seen)

    def addresses(self) -> list[int]:
        return [getattr(s.owner, s.attr).data_ptr() for s in self.tensors]

    def keep_addresses(self) -> None:
        """Attributes the vendor rebound during a call: the value written into the original."""
        for slot in self.tensors:
            current = getattr(slot.owner, slot.attr)
            if current is not slot.tensor:
                with torch.no_grad():
                    slot.tensor.copy_(current)
                setattr(slot.owner, slot.attr, slot.tensor)

    def read(self) -> list[int]:
        """The host counters' values (the engine's `HostCounters`)."""
        return [getattr(owner, attr) for owner, attr in self.counters]

    def write(self, values: Sequence[int]) -> None:
        for (owner, attr), value in zip(self.counters, values, strict=True):
            setattr(owner, attr, value)


class BoundMoshi(Transformed):
    """Mimi and the LM at batch 1, their four operators bound (`bound["mimi"]`, `bound["lm"]`).

    `session(sampling=..., seed=...)` starts a fresh stream and yields a `step(frame)` callable:
    one 1920-sample frame in, `(tokens, pcm)` out (both None until the acoustic delay has passed),
    as the vendor's loop (`moshi_stream.stream_reference`) computes them, bit for bit. The depformer
    binds the sampling switch as a mode, so sampled and greedy sessions each run their own graphs.
    Several streams take turns on it through `session_state` / `swap_in` / `swap_out`
    (`cadence_fx.multiplex`): the resident state is every tensor and host counter of the
    modules' streaming state (`OwnedState`), at one address each for the model's life. A fresh
    stream's state is the one a session starts from: take `session_state`s inside a session, before
    its first frame (outside one, the resident state is where the last session left it)."""

    def __init__(
        self,
        models: MoshiModels,
        lm_gen: Any,
        bound: dict[str, BoundModel],
        reports: dict[str, TransformReport],
        streaming: contextlib.ExitStack,
    ):
        self.models, self.lm_gen, self.bound, self.reports = models, lm_gen, bound, reports
        self._streaming = streaming
        self._state: OwnedState | None = None
        self._open = False

    @contextlib.contextmanager
    def session(self, *, sampling: bool, seed: int) -> Iterator[Callable[[torch.Tensor], tuple]]:
        from moshi.utils.compile import no_compile, no_cuda_graph

        if self._open:
            raise RuntimeError(
                "a session is already open on this model: one session at a time (several streams "
                "take turns through session_state / swap_in / swap_out)"
            )
        mimi, lm_gen = self.models.mimi, self.lm_gen
        encode, decode = self.bound["mimi"].operators["mimi_encode"], self.bound["mimi"].operators["mimi_decode"]

        def step(frame: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
            tokens = lm_gen.step(encode(frame))
            out = (None, None) if tokens is None else (tokens, decode(tokens[:, 1:]))
            if self._state is not None:
                # What the vendor's eager glue rebinds (LMGen's offsets; a stock fallback's state)
                # is written back into the one tensor each, where swap_in and swap_out find it.
                self._state.keep_addresses()
            return out

        self._open = True
        try:
            # The vendor's own CUDA-graph wrappers off (its flag, read on every call): the bound
            # operators replay instead, and the glue between them runs eagerly, as the vendor's does.
            with no_compile(), no_cuda_graph(), torch.no_grad():
                mimi.reset_streaming()
                lm_gen.reset_streaming()
                lm_gen.use_sampling = sampling
                torch.manual_seed(seed)
                yield step
        finally:
            self._open = False

    def stream(self, pcm: torch.Tensor, *, sampling: bool, seed: int) -> StreamOutput:
        """The whole of `pcm`, as `moshi_stream.stream_reference` computes it."""
        tokens, out = [], []
        with self.session(sampling=sampling, seed=seed) as step:
            for frame in pcm.split(self.models.mimi.frame_size, dim=-1):
                codes, audio = step(frame)
                if codes is not None:
                    tokens.append(codes)
                    out.append(audio)
        return StreamOutput(tokens=torch.cat(tokens, dim=-1), pcm=torch.cat(out, dim=-1))

    @property
    def report(self) -> TransformReport:
        """The two transforms' reports as one, as they stand now."""
        report = TransformReport.merged(list(self.reports.values()))
        report.stamps.append(
            "moshi: one session at a time at batch 1; the vendor's glue (LMGen.step) calls the bound "
            f"lm_step and depformer_step as its graphed_main and graphed_depth; {WARM_UP_FRAMES} frames "
            "of silence streamed in each decoding mode at construction"
        )
        return report

    @property
    def replays(self) -> dict[str, Any]:
        """Each operator's replay engine (none with `replay=False`)."""
        return replays(self.bound)

    def counters(self) -> dict[str, dict]:
        """Per operator: its bound operator's counters (calls, graph calls, verified, stock) and,
        under ``replay``, its replay engine's (captures, replays, eager calls and why)."""
        return {
            name: {**op.counters.as_dict(), **({"replay": op.replay.counters.as_dict()} if op.replay else {})}
            for model in self.bound.values()
            for name, op in model.operators.items()
        }

    @property
    def state(self) -> OwnedState:
        """The modules' streaming state, every tensor and host counter, as the bound operators hold
        it (they take their device-side counters at one address each at their first call)."""
        if self._state is None:
            self._state = OwnedState.of(
                {
                    "mimi": self.models.mimi.get_streaming_state(),
                    "lm": self.models.lm.get_streaming_state(),
                    "lm_gen": self.lm_gen.get_streaming_state(),
                }
            )
        return self._state

    def device(self) -> torch.device:
        return next(self.models.lm.parameters()).device

    def resident(self) -> tuple[list[torch.Tensor], list[int]]:
        return [slot.tensor for slot in self.state.tensors], self.state.read()

    def set_counters(self, counters: list[int]) -> None:
        self.state.write(counters)

    def close(self) -> None:
        """Leave streaming: the modules' streaming state can be freed."""
        self._streaming.close()


def bind(
    models: MoshiModels, lm_gen: Any, contract: Contract, mimi_binding: Binding, lm_binding: Binding, **options: Any
) -> tuple[dict[str, BoundModel], dict[str, TransformReport]]:
    """Mimi and a streaming `LMGen` transformed from their bindings on the one pipeline (`options`
    are `transform`'s), keyed "mimi" and "lm"; the vendor's glue (`LMGen.step`) then calls the bound
    LM steps where it calls its own CUDA-graph wrappers, as its `graphed_main` and `graphed_depth`."""
    bound, reports = {}, {}
    bound["mimi"], reports["mimi"] = transform(models.mimi, contract, mimi_binding, **options)
    bound["lm"], reports["lm"] = transform(lm_gen, contract, lm_binding, **options)
    gen_state = lm_gen._streaming_state
    gen_state.graphed_main = bound["lm"].operators["lm_step"]
    gen_state.graphed_depth = bound["lm"].operators["depformer_step"]
    return bound, reports


def replays(bound: dict[str, BoundModel]) -> dict[str, Any]:
    """Each bound operator's replay engine, by operator name (none with `replay=False`)."""
    return {name: op.replay for model in bound.values() for name, op in model.operators.items() if op.replay is not None}


def transform_moshi(
    models: MoshiModels, contract: Contract, *, audit: bool, replay: bool, budget: int
) -> tuple[BoundMoshi, TransformReport]:
    """The family's hook (`Family.compose`): `models` (Mimi + LM, one device) for one session at a
    time, each model transformed from its binding on the one pipeline. The lazily derived codebook
    caches the calls read are filled in `models` first, as the vendor's first call would. It then
    streams `WARM_UP_FRAMES` of silence in each decoding mode (the caller's generators untouched),
    so every class is verified (and on a GPU captured) and the state settled before the first
    session."""
    if contract.symbols()["slots"] != 1:
        raise ValueError(
            f"contract quantity slots={contract.symbols()['slots']}: transform() streams one session "
            "at batch 1; sessions as slots of one batch: models/moshi_slots.py transform_slots"
        )
    models, lm_gen, streaming = streaming_copy(models, contract, 1, use_sampling=True)
    try:
        bound, reports = bind(models, lm_gen, contract, MIMI_BINDING, MOSHI_LM_BINDING, audit=audit, replay=replay, budget=budget)
        transformed = BoundMoshi(models, lm_gen, bound, reports, streaming)
        device = transformed.device()
        silence = torch.zeros(1, models.mimi.channels, models.mimi.frame_size, device=device)
        # Every generator `session` seeds (`torch.manual_seed`: the CPU's and every GPU's) put back after.
        with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if device.type == "cuda" else []):
            for sampling in (True, False):
                with transformed.session(sampling=sampling, seed=0) as step:
                    for _ in range(WARM_UP_FRAMES):
                        step(silence)
        transformed.state  # noqa: B018 - settles the resident state: its addresses from here on
    except BaseException:
        streaming.close()
        raise
    return transformed, transformed.report
