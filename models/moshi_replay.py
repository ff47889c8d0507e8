"""Moshi under the compute rule: the adapter behind `transform(models, moshi_contract(...))`.

On Moshi the carry degenerates to the vendor's own `RingKVCache`: every attention cache is
preallocated at its capacity and written in place at a device-side offset, so the state rule has
nothing to resize (each ring already sits at its derived bound, checked here) and the catalog has
one class per stage. What the transform does:

* **one streaming state, at fixed addresses.** The vendor allocates fresh streaming state on
  every `streaming()` entry. The transformed model enters streaming once, keeps that state
  (`OwnedState`) and attaches it to the shared modules only while one of its sessions runs (the
  vendor's `get_streaming_state` / `set_streaming_state`); a new session writes the base state in
  place (zeros, ones, the ungenerated token id: exactly a fresh entry's values), so every ring,
  offset and conv buffer keeps one address for the life of the model. State the vendor writes by
  rebinding an attribute (`state.first = torch.where(...)` in the replicate-padded downsampling
  conv, inside Mimi encode; `LMGen`'s `offsets`, in its eager glue) is written into the original
  tensor in place instead, after each call; host-side counters (`offset_cpu`) are rewound after a
  probationary call and advanced after a replay, exactly as eager advances them;
* **vendor graphs off, cadence-fx replay on.** The vendor's `CUDAGraphed` wrappers are removed
  from the owned state (the plain modules put back) and each stage runs under
  `moshi.utils.compile.no_cuda_graph()`. That flag, like env `NO_CUDA_GRAPH`, is read on every call
  (`compile._is_cuda_graph_enabled`), so an untransformed model in the same process keeps its
  vendor graphs. Four `ExactShapeReplay` bindings take their place, one per contract operator, each
  a whole stage: Mimi encode (SEANet encoder, encoder transformer, downsampling conv and
  quantizer: the vendor runs the last two eagerly between its graphs), the LM main step
  (`forward_text`), the depformer step (all codebooks and their sampling, its fresh per-step
  streaming state included; one binding per decoding mode, since greedy and sampling are
  different programs) and Mimi decode. Their catalog is the contract's (K = 1 each), as exact
  signatures (a slice argument is copied to canonical strides first, unless only its size-1
  dimensions' strides differ, as for a frame split off a stream and the decoder's
  `tokens[:, 1:]`: those pass as they are); the owned state is registered with each binding as module state, so
  the engine rewinds it after a probe and checks its addresses on every replay (ring bodies
  excepted, see `OwnedState`).

No graph is rewritten for this family (`capture` has nothing to export: the rings need no
carry pass), and there is nothing for the shadow auditor to compare.

The input modules keep their parameters (the transform shares them, nothing is copied). It does
fill the lazily derived `_embedding` caches of the codebooks the calls use, exactly as the
vendor's first call would, because a binding refuses a callable that registers buffers while it
runs.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from cadence_fx.catalog import Catalog
from cadence_fx.contract import DTYPES, Contract
from cadence_fx.determinism import envelope, settings
from cadence_fx.passes.hoist import HostConstantHoist
from cadence_fx.passes.state import Resize
from cadence_fx.replay import ExactShapeReplay, ShapeClass, Signature, TensorSpec
from cadence_fx.report import format_bytes
from cadence_fx.transform import Adapter, TransformReport
from cadence_fx.transformed import Transformed

from .moshi import moshi_contract

__all__ = ["MoshiAdapter", "OwnedState", "Stage", "TransformedMoshi", "contract_for"]

#: Contract region of each ring, by the module that owns it.
RINGS = {
    "mimi.encoder_transformer": "mimi_encoder_kv",
    "mimi.decoder_transformer": "mimi_decoder_kv",
    "lm.transformer": "lm_kv",
    "lm.depformer": "depformer_kv",
}


def contract_for(config, slots: int = 1) -> Contract:
    """The Moshi contract of a `moshi_stream.MoshiConfig` (`FULL` gives the default contract), at
    batch `slots` (one session per slot: `models/moshi_slots.py`)."""
    lm, mimi = config.lm_kwargs, config.mimi["transformer"]
    return moshi_contract(
        slots=slots,
        mimi_context=mimi["context"],
        lm_context=lm["context"],
        codebooks=lm["dep_q"],
        mimi_layers=mimi["num_layers"],
        mimi_heads=mimi["num_heads"],
        mimi_dim=mimi["d_model"],
        lm_layers=lm["num_layers"],
        lm_heads=lm["num_heads"],
        lm_dim=lm["dim"],
        depformer_layers=lm["depformer_num_layers"],
        depformer_heads=lm["depformer_num_heads"],
        depformer_dim=lm["depformer_dim"],
        lm_dtype=str(config.lm_dtype).removeprefix("torch."),
    )


# ---------------------------------------------------------------------------------------------
# The owned streaming state


@dataclass
class _Slot:
    owner: Any  # a vendor State (or a RingKVCache inside one)
    attr: str
    tensor: torch.Tensor  # the original: the one address this slot keeps
    base: float | int | bool | torch.Tensor  # the value a fresh streaming entry writes


def _base(t: torch.Tensor) -> float | int | bool | torch.Tensor:
    """The value a fresh streaming entry writes into `t`: a scalar, or a copy in host memory (a
    few per model, such as LMGen's initial tokens; a reset copies it in). Uniformity is read off
    reductions, never an elementwise comparison: that would allocate a temporary as large as a
    ring (1.6 GB per LM layer at batch 64)."""
    if t.numel():
        uniform = bool(t.all()) or not bool(t.any()) if t.dtype == torch.bool else bool(t.amin() == t.amax())
        if uniform:
            return t.reshape(-1)[0].item()
    return t.to("cpu", copy=True)


def _is_vendor_object(value: Any) -> bool:
    from moshi.utils.compile import CUDAGraphed

    module = type(value).__module__
    return module.startswith("moshi.") and not isinstance(value, (CUDAGraphed, torch.nn.Module)) and hasattr(value, "__dict__")


@dataclass
class OwnedState:
    """The streaming state of some vendor modules, owned for the life of a transformed model.

    `tensors` keep one address each; `counters` are the host-side integers (with their base
    values). `holder` registers the tensors a binding must rewind after a probationary call as
    buffers, so a binding given it as a module snapshots them and checks their addresses on every
    replay. Ring bodies are left out of it (they are most of the state: 1.5 GiB for the full LM):
    a call writes a ring only at the slots its `end_offset` names, before it reads them
    (`RingKVCache.complete` scatters, then attends), so rewinding `end_offset` rewinds the ring.
    """

    states: dict[str, dict[str, Any]]  # module path -> its get_streaming_state()
    tensors: list[_Slot] = field(default_factory=list)
    counters: list[tuple[Any, str, int]] = field(default_factory=list)
    holder: torch.nn.Module = field(default_factory=torch.nn.Module)
    rebinds: int = 0  # attribute rebindings turned into in-place writes

    @classmethod
    def of(cls, states: dict[str, dict[str, Any]]) -> OwnedState:
        owned = cls(states)
        seen: set[int] = set()
        for root, entries in states.items():
            for name, state in entries.items():
                owned._walk(state, f"{root}.{name}" if name else root, seen)
        return owned

    def _walk(self, obj: Any, path: str, seen: set[int]) -> None:
        from moshi.modules.transformer import RingKVCache

        if id(obj) in seen:
            return
        seen.add(id(obj))
        for attr, value in vars(obj).items():
            if isinstance(value, torch.Tensor):
                self.tensors.append(_Slot(obj, attr, value, _base(value)))
                if not (isinstance(obj, RingKVCache) and attr == "cache"):
                    name = re.sub(r"\W", "_", f"{path}.{attr}")
                    self.holder.register_buffer(f"s{len(self.tensors)}_{name}", value, persistent=False)
            elif type(value) is int:
                self.counters.append((obj, attr, value))
            elif _is_vendor_object(value):
                self._walk(value, f"{path}.{attr}", seen)

    @property
    def nbytes(self) -> int:
        return sum(s.tensor.numel() * s.tensor.element_size() for s in self.tensors)

    def addresses(self) -> list[int]:
        return [getattr(s.owner, s.attr).data_ptr() for s in self.tensors]

    def reset(self) -> None:
        """A new session: the base state written in place, every binding back on its original."""
        with torch.no_grad():
            for slot in self.tensors:
                setattr(slot.owner, slot.attr, slot.tensor)
                if isinstance(slot.base, torch.Tensor):
                    slot.tensor.copy_(slot.base)
                else:
                    slot.tensor.fill_(slot.base)
        for owner, attr, base in self.counters:
            setattr(owner, attr, base)

    def keep_addresses(self) -> None:
        """Attributes the vendor rebound during a call: the value written into the original."""
        for slot in self.tensors:
            current = getattr(slot.owner, slot.attr)
            if current is not slot.tensor:
                with torch.no_grad():
                    slot.tensor.copy_(current)
                setattr(slot.owner, slot.attr, slot.tensor)
                self.rebinds += 1

    def read(self) -> list[int]:
        """The host counters' values (the engine's `HostCounters`)."""
        return [getattr(owner, attr) for owner, attr, _ in self.counters]

    def write(self, values: Sequence[int]) -> None:
        for (owner, attr, _), value in zip(self.counters, values, strict=True):
            setattr(owner, attr, value)


# ---------------------------------------------------------------------------------------------
# Stages


def _canonical(x: Any) -> Any:
    """A tensor whose layout matches the canonical one of its shape, so the call matches its
    catalog signature exactly: a slice of a larger tensor is copied (values unchanged) unless it
    differs only in the strides of size-1 dimensions, which a signature does not see (a frame
    split off a stream and the decoder's ``tokens[:, 1:]`` are passed as they are: no copy)."""
    if isinstance(x, torch.Tensor):
        shape = tuple(x.shape)
        if TensorSpec(shape, stride=tuple(x.stride())).key()[2] != TensorSpec(shape).key()[2]:
            return x.clone(memory_format=torch.contiguous_format)
    return x


class Stage:
    """One hot stage: a replay binding (or the stage itself, without replay) on the owned state.
    The binding rewinds the state's host counters after its probe and moves them after each
    replay as the eager call did (`HostCounters`)."""

    def __init__(self, name: str, fn: Callable[..., Any], classes: list[ShapeClass], state: OwnedState | None,
                 modules: list[torch.nn.Module], *, replay: bool, hooks: tuple = ()):
        self.name, self.fn, self.state = name, fn, state
        self.engine = (ExactShapeReplay(self._run, classes, name=name, modules=[*modules, *([state.holder] if state else [])],
                                        hooks=hooks, host_counters=state) if replay else None)

    def _run(self, *args: Any) -> Any:
        out = self.fn(*args)
        if self.state is not None:
            self.state.keep_addresses()
        return out

    def __call__(self, *args: Any) -> Any:
        from moshi.utils.compile import no_cuda_graph

        args = tuple(_canonical(a) for a in args)
        with no_cuda_graph():
            return self.engine(*args) if self.engine is not None else self._run(*args)


# ---------------------------------------------------------------------------------------------
# The transformed model


class TransformedMoshi(Transformed):
    """Mimi and the LM streaming on one owned state, the four stages under replay.

    `session(sampling=..., seed=...)` attaches the owned state (reset to its base in place) and
    yields a `step(frame)` callable: one 1920-sample frame in, `(tokens, pcm)` out (both None
    until the acoustic delay has passed), as the vendor loop computes them. Inside a session,
    several streams take turns on the one owned state through `session_state` / `swap_in` /
    `swap_out` (`cadence_fx.transformed`): the resident state is every owned tensor (rings
    included) and every host counter.
    """

    def __init__(self, models, lm_gen, state: OwnedState, glue: OwnedState, stages: dict[str, Stage],
                 depformer: dict[bool, Stage], report: TransformReport):
        self.models, self.lm_gen, self.state, self.glue = models, lm_gen, state, glue
        self.stages, self.depformer = stages, depformer
        self.report = report
        self.replays = report.replays

    @contextlib.contextmanager
    def session(self, *, sampling: bool, seed: int) -> Iterator[Callable[[torch.Tensor], tuple]]:
        from moshi.utils.compile import no_compile

        mimi, lm, lm_gen = self.models.mimi, self.models.lm, self.lm_gen
        modules = {"mimi": mimi, "lm": lm, "lm_gen": lm_gen}
        for path, module in modules.items():
            if module.is_streaming:
                raise RuntimeError(f"{path} is already streaming: one session at a time on these modules")
        torch.manual_seed(seed)
        try:
            for path, module in modules.items():
                module.set_streaming_state(self.state.states[path])
            self.state.reset()
            lm_gen.use_sampling = sampling
            lm_gen._streaming_state.graphed_depth = self.depformer[sampling]
            encode, decode = self.stages["mimi_encode"], self.stages["mimi_decode"]

            def step(frame: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
                tokens = lm_gen.step(encode(frame))
                self.glue.keep_addresses()  # LMGen rebinds its offsets each step
                return (None, None) if tokens is None else (tokens, decode(tokens[:, 1:]))

            with no_compile(), torch.no_grad():
                yield step
        finally:
            for module in modules.values():
                module._stop_streaming()

    def stream(self, pcm: torch.Tensor, *, sampling: bool, seed: int):
        """The whole of `pcm`, as `moshi_stream.stream_reference` computes it."""
        from .moshi_stream import StreamOutput

        tokens, out = [], []
        with self.session(sampling=sampling, seed=seed) as step:
            for frame in pcm.split(self.models.mimi.frame_size, dim=-1):
                codes, audio = step(frame)
                if codes is not None:
                    tokens.append(codes)
                    out.append(audio)
        return StreamOutput(tokens=torch.cat(tokens, dim=-1), pcm=torch.cat(out, dim=-1))

    def counters(self) -> dict[str, dict]:
        return {name: engine.counters.as_dict() for name, engine in self.replays.items()}

    def device(self) -> torch.device:
        return next(self.models.lm.parameters()).device

    def resident(self) -> tuple[list[torch.Tensor], list[int]]:
        return [slot.tensor for slot in self.state.tensors], self.state.read()

    def set_counters(self, counters: list[int]) -> None:
        self.state.write(counters)


def _rings(module: torch.nn.Module) -> list[tuple[int, ...]]:
    shapes = []
    for sub in module.modules():
        kv = getattr(getattr(sub, "_streaming_state", None), "kv_cache", None)
        if kv is not None:
            shapes.append(tuple(kv.cache.shape))
    return shapes


def _ring_resizes(models, contract: Contract, catalog: Catalog) -> list[Resize]:
    """Each ring region against the vendor's rings: the carry is the vendor's ring, at its bound."""
    modules = {
        "mimi.encoder_transformer": models.mimi.encoder_transformer,
        "mimi.decoder_transformer": models.mimi.decoder_transformer,
        "lm.transformer": models.lm.transformer,
        "lm.depformer": models.lm.depformer,
    }
    resizes = []
    for path, region_name in RINGS.items():
        rings = _rings(modules[path])
        region, derived = contract.region(region_name), catalog.region(region_name)
        if len(set(rings)) != 1:
            raise ValueError(f"{path}: rings of several shapes {sorted(set(rings))}")
        two, batch, heads, capacity, head_dim = rings[0]
        stock = (len(rings), two, batch, heads, capacity, head_dim)
        if stock != derived.shape:
            raise ValueError(f"{path}: the vendor's rings stack to {stock}, region {region_name!r} derives "
                             f"{derived.shape}: the contract does not describe this model")
        beta = DTYPES[region.dtype].itemsize
        resizes.append(Resize(f"{path} RingKVCache x{len(rings)}", region_name, stock, beta * math.prod(stock),
                              derived.shape, derived.bytes))
    return resizes


def _check_model(models, contract: Contract) -> None:
    mimi, lm = models.mimi, models.lm
    symbols = contract.symbols()
    found = {
        "codebooks": lm.dep_q,
        "samples_per_frame": mimi.frame_size,
        "mimi_steps_per_frame": mimi.encoder_frame_rate / mimi.frame_rate,
    }
    for name, actual in found.items():
        if symbols[name] != actual:
            raise ValueError(f"contract quantity {name}={symbols[name]} but the model has {actual}: declare {name}={actual}")
    if DTYPES[contract.region("lm_kv").dtype] != lm.dtype:
        raise ValueError(f"region 'lm_kv' declares {contract.region('lm_kv').dtype}, the LM runs in {lm.dtype}")
    for path, module in (("mimi", mimi), ("lm.transformer", lm.transformer)):
        stepped = [n for n, m in module.named_modules() if len(getattr(m, "in_projs", ())) > 1]
        if stepped:
            raise ValueError(f"{path}: attention with weights per step ({stepped[0]}) selects weights by a host "
                             "counter that a graph would freeze; only the depformer (fresh state per call) may")


def _classes(catalog: Catalog, operator: str, *specs: Any) -> list[ShapeClass]:
    op = catalog.operator(operator)
    if not op.in_scope:
        raise ValueError(f"{operator}: {op.verdict}")
    return [ShapeClass(f"{operator} ring={c.extent}", Signature.of(*specs), (("ring", c.extent),)) for c in op.classes]


def _used_codebooks(mimi) -> list[torch.nn.Module]:
    """The codebooks Mimi's calls read: the first `n_q` levels of each residual quantizer (Mimi
    ships 32 levels and streams 8). Filling the others would hold caches the vendor never makes."""
    from moshi.quantization.vq import ResidualVectorQuantizer

    return [layer._codebook for module in mimi.quantizer.modules() if isinstance(module, ResidualVectorQuantizer)
            for layer in module.vq.layers[:module.n_q]]


class MoshiAdapter(Adapter):
    family = "moshi"

    def transform(self, model, contract, catalog, *, audit, capture, replay):
        """`model` is a `moshi_stream.MoshiModels` (Mimi + LM, on one device)."""
        from moshi.models import LMGen

        mimi, lm = model.mimi, model.lm
        if contract.symbols()["slots"] != 1:
            raise ValueError(f"contract quantity slots={contract.symbols()['slots']}: transform() streams one session "
                             "at batch 1; sessions as slots of one batch: models/moshi_slots.py transform_slots")
        _check_model(model, contract)
        report = TransformReport(family=self.family, catalog=catalog)
        report.determinism = settings()
        report.stamps.append(envelope())
        with torch.no_grad():
            for codebook in _used_codebooks(mimi):
                if codebook._embedding is None:
                    codebook.embedding  # noqa: B018 - fills the vendor's lazily derived codebook cache
        lm_gen = LMGen(lm, use_sampling=False)
        mimi.streaming(1)
        lm_gen.streaming(1)
        with lm.depformer.streaming(1):
            report.resizes.extend(_ring_resizes(model, contract, catalog))
        states = {"mimi": mimi.get_streaming_state(), "lm": lm.get_streaming_state(), "lm_gen": lm_gen.get_streaming_state()}
        for module in (mimi, lm, lm_gen):
            module._stop_streaming()
        mimi_state, gen_state = states["mimi"][""], states["lm_gen"][""]
        removed = ["mimi.graphed_encoder", "mimi.graphed_tr_enc", "mimi.graphed_tr_dec", "mimi.graphed_decoder",
                   "lm_gen.graphed_main", "lm_gen.graphed_depth"]
        mimi_state.graphed_encoder, mimi_state.graphed_decoder = mimi.encoder, mimi.decoder
        mimi_state.graphed_tr_enc, mimi_state.graphed_tr_dec = mimi.encoder_transformer, mimi.decoder_transformer
        owned = OwnedState.of(states)
        mimi_owned = OwnedState.of({"mimi": states["mimi"]})
        lm_owned = OwnedState.of({"lm": states["lm"]})
        glue = OwnedState.of({"lm_gen": states["lm_gen"]})
        report.stamps.append(
            f"state: one owned streaming state, {len(owned.tensors)} tensors ({format_bytes(owned.nbytes)}) at fixed "
            f"addresses, {len(owned.counters)} host counters; vendor CUDAGraphed wrappers removed: {', '.join(removed)}"
        )

        param = next(lm.parameters())
        device = param.device
        hooks = (HostConstantHoist(),) if device.type == "cuda" else ()
        frame = TensorSpec((1, mimi.channels, mimi.frame_size), torch.float32, device)
        codes = TensorSpec((1, lm.dep_q, 1), torch.long, device)
        sequence = TensorSpec((1, lm.num_codebooks, 1), torch.long, device)
        text, hidden = TensorSpec((1,), torch.long, device), TensorSpec((1, 1, lm.dim), lm.dtype, device)
        stages = {
            "mimi_encode": Stage("mimi_encode", mimi.encode, _classes(catalog, "mimi_encode", frame), mimi_owned, [mimi],
                                 replay=replay, hooks=hooks),
            "lm_step": Stage("lm_step", lm.forward_text, _classes(catalog, "lm_step", sequence, None, None), lm_owned, [lm],
                             replay=replay, hooks=hooks),
            "mimi_decode": Stage("mimi_decode", mimi.decode, _classes(catalog, "mimi_decode", codes), mimi_owned, [mimi],
                                 replay=replay, hooks=hooks),
        }
        depformer_classes = _classes(catalog, "depformer_step", text, hidden)
        depformer = {
            sampling: Stage(f"depformer_step[{'sampling' if sampling else 'greedy'}]", lm_gen.depformer_step,
                            depformer_classes, None, [lm], replay=replay, hooks=hooks)
            for sampling in (True, False)
        }
        gen_state.graphed_main = stages["lm_step"]
        for stage in (*stages.values(), *depformer.values()):
            if stage.engine is not None:
                report.replays[stage.name] = stage.engine
        bound = ", ".join(f"{name} K={catalog.operator(name.split('[')[0]).width}" for name in
                          [*stages, *(s.name for s in depformer.values())])
        report.stamps.append(f"replay: {bound}" if replay else "replay: off (stages eager on the owned state)")
        if audit:
            report.stamps.append("audit: nothing to shadow: no retention is rewritten (the vendor writes its rings in place)")
        return TransformedMoshi(model, lm_gen, owned, glue, stages, depformer, report), report


ADAPTER = MoshiAdapter()
