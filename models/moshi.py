"""Moshi (Kyutai): the contract of Mimi and the Moshi LM with its depformer.

Every attention cache is the vendor's preallocated `RingCache`, written in place at a device-side
offset, so shapes never change: the derived catalog width is 1 for every operator.

`MIMI_BINDING` (on a streaming `MimiModel`) and `MOSHI_LM_BINDING` (on a streaming `LMGen`) bind
the four stages as data for the one pipeline (`transform(lm_gen, contract, MOSHI_LM_BINDING)`):
Mimi's encode and decode with their rings and every streaming convolution's state; the LM's main
step (`LMModel.forward_text`), whose ring caches are its region and whose device-side offsets and
host-side `offset_cpu`s are its counters; and the depformer step (`LMGen.depformer_step`: all
codebooks and their sampling), whose ring the vendor allocates afresh inside every call
(`per_call`) and whose sampling switch and parameters are its `modes`. `transform(models,
moshi_contract())` transforms both for one session at a time (`moshi_bound.py`, the family's
hook). `MIMI_SLOTS_BINDING` and `MOSHI_LM_SLOTS_BINDING` are the same at a batch of slots,
with every module's exec mask (`models/moshi_slots.py`, `transform_slots`), which the service's
batched runtime runs (`serve/plugins/moshi.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from cadence_fx.binding import Binding, OperatorBinding, RegionBinding
from cadence_fx.contract import (
    DTYPES,
    Admission,
    Clock,
    ClockKind,
    Contract,
    Effect,
    Interactivity,
    Lifetime,
    Operator,
    Rate,
    Region,
)
from cadence_fx.guards import Unread
from cadence_fx.passes.retention import RingCache

if TYPE_CHECKING:
    from moshi.quantization.core_vq import EuclideanCodebook

__all__ = [
    "MIMI_BINDING",
    "MIMI_SLOTS_BINDING",
    "MOSHI_LM_BINDING",
    "MOSHI_LM_SLOTS_BINDING",
    "check_models",
    "contract_for",
    "moshi_contract",
    "used_codebooks",
]

# The vendor keeps a streaming module's state in its `_streaming_state` (entered by `streaming()`).
_TRANSFORMER = "self.lm_model.transformer"
_ATTENTION = f"{_TRANSFORMER}.layers.*.self_attn._streaming_state"

# At a batch of slots every streaming module also reads its exec mask (the rows that run), which
# `set_exec_mask` writes in place between the calls: each stage binds the masks of the modules it
# runs as device-side counters (`models/moshi_slots.py`).
_MASK = "exec_mask"


#: What `LMGen.depformer_step` reads of `LMGen` to choose how it samples each codebook.
_SAMPLING = ("self.use_sampling", "self.temp", "self.top_k", "self.cfg_coef")

#: Host values of the LM that neither step's computation reads: the main transformer's host
#: offsets (read only by per-step weights, which the main transformer has none of; the depformer
#: enters its own streaming state, at 0, every call) and the vendor's table of the depformer's
#: module names, and `LMGen`'s own host frame count (read by its glue, `LMGen.step`, not by either
#: step). Verified at two values of each per class (the programs compared).
_LM_UNREAD = tuple(
    Unread(path)
    for path in (
        f"{_TRANSFORMER}.layers.*._streaming_state.offset_cpu",
        f"{_ATTENTION}.offset_cpu",
        "self.lm_model.depformer._cached_children",
        "self._streaming_state.offset_cpu",
    )
)


def _lm_binding(masked: bool) -> Binding:
    masks = (
        (f"{_ATTENTION}.{_MASK}", f"{_TRANSFORMER}._streaming_state.{_MASK}", f"{_TRANSFORMER}.layers.*._streaming_state.{_MASK}")
        if masked
        else ()
    )
    return Binding(
        regions=(
            # `RingKVCache.complete` scatters a call's keys and values at `end_offset`, then attends.
            RegionBinding("lm_kv", at=(f"{_ATTENTION}.kv_cache.cache",), write_before_read=True),
            RegionBinding("depformer_kv", per_call=True),  # `depformer_step` enters `depformer.streaming()` itself
        ),
        operators=(
            OperatorBinding(
                "lm_step",
                method="lm_model.forward_text",
                units=1,
                counters=(
                    f"{_ATTENTION}.kv_cache.end_offset",
                    f"{_ATTENTION}.offset",
                    f"{_ATTENTION}.offset_cpu",
                    f"{_TRANSFORMER}._streaming_state.offsets",
                    f"{_TRANSFORMER}.layers.*._streaming_state.offset_cpu",
                    *masks,
                    # The main step reads none of the depformer's sampling settings.
                ),
                regimes=_LM_UNREAD + tuple(Unread(path) for path in _SAMPLING),
            ),
            # The sampling switch and its parameters choose the program: each value its own graphs.
            OperatorBinding("depformer_step", method="depformer_step", units=1, modes=_SAMPLING, regimes=_LM_UNREAD),
        ),
    )


def _mimi_counters(*parts: str, masked: bool) -> tuple[str, ...]:
    """The per-stream state of Mimi's `parts` besides their rings, at any depth (`**`): the streaming
    convolutions' buffers and first-call flags, the transformers' offsets and ring ends (and, at a
    batch of slots, every module's exec mask)."""
    state: tuple[str, ...] = ("previous", "first", "partial", "offset", "offsets", "offset_cpu", "kv_cache.end_offset")
    state += (_MASK,) if masked else ()
    return tuple(f"self.{part}.**._streaming_state.{name}" for part in parts for name in state)


def _mimi_unread(own: str, other: str) -> tuple[Unread, ...]:
    """What one of Mimi's stages never reads: the other stage's transformer (whose host values its
    calls move) and its own transformer's host offsets (read only by per-step weights, which Mimi
    has none of). Verified at two values of each per class (the programs compared)."""
    layers = f"self.{own}_transformer.transformer.layers.*"
    return (
        Unread(f"self.{other}_transformer"),
        Unread(f"{layers}._streaming_state.offset_cpu"),
        Unread(f"{layers}.self_attn._streaming_state.offset_cpu"),
    )


def _mimi_binding(masked: bool) -> Binding:
    return Binding(
        regions=(
            RegionBinding(
                "mimi_encoder_kv",
                at=("self.encoder_transformer.transformer.layers.*.self_attn._streaming_state.kv_cache.cache",),
                write_before_read=True,
            ),
            RegionBinding(
                "mimi_decoder_kv",
                at=("self.decoder_transformer.transformer.layers.*.self_attn._streaming_state.kv_cache.cache",),
                write_before_read=True,
            ),
        ),
        operators=(
            OperatorBinding(
                "mimi_encode",
                method="encode",
                units=2,
                counters=_mimi_counters("encoder", "downsample", "encoder_transformer", masked=masked),
                regimes=_mimi_unread("encoder", "decoder"),
            ),
            OperatorBinding(
                "mimi_decode",
                method="decode",
                units=2,
                counters=_mimi_counters("decoder", "upsample", "decoder_transformer", masked=masked),
                regimes=_mimi_unread("decoder", "encoder"),
            ),
        ),
    )


#: Where a streaming `LMGen`'s per-frame operators keep their state. The main step's is each
#: attention layer's `RingKVCache` (keys and values stacked, as the contract's `lm_kv` lays them
#: out), written in place at `end_offset`, the device-side offsets (rope positions, ring ends) each
#: call advances in place, and the host-side `offset_cpu`s it counts. One call is one frame.
MOSHI_LM_BINDING = _lm_binding(masked=False)

#: Where a streaming `MimiModel`'s encode and decode keep their state: each transformer's rings
#: (the contract's `mimi_encoder_kv` / `mimi_decoder_kv`), and everything else each stage moves,
#: found at any depth so one binding fits every SEANet layout. A call is one 80 ms frame: two
#: steps of the transformers' 25 Hz clock.
MIMI_BINDING = _mimi_binding(masked=False)

#: The two at a batch of slots (`models/moshi_slots.py`, `transform_slots`): the same, and every module's exec mask.
MOSHI_LM_SLOTS_BINDING = _lm_binding(masked=True)
MIMI_SLOTS_BINDING = _mimi_binding(masked=True)


def moshi_contract(
    *,
    mimi_context: int = 250,
    lm_context: int = 3000,
    codebooks: int = 8,
    mimi_layers: int = 8,
    mimi_heads: int = 8,
    mimi_dim: int = 512,
    lm_layers: int = 32,
    lm_heads: int = 32,
    lm_dim: int = 4096,
    depformer_layers: int = 6,
    depformer_heads: int = 16,
    depformer_dim: int = 1024,
    lm_dtype: str = "bfloat16",
    slots: int = 1,
) -> Contract:
    """The full-size Moshi 7B configuration by default (bf16 LM, fp32 Mimi).

    `slots` is the batch B that every region and operator is declared at: B sessions, one per
    batch row, each its own interactive session (C3 holds per slot: nothing is batched inside a
    session). One B per contract, so each operator's catalog stays one class (K = 1)."""
    return Contract(
        family="moshi",
        clocks=(
            Clock("frame", ClockKind.FRAMES),
            Clock("mimi_step", ClockKind.FRAMES),
            Clock("sample", ClockKind.SAMPLES),
            Clock("codebook", ClockKind.CODEBOOKS),
            Clock("text_token", ClockKind.TOKENS),
            Clock("turn", ClockKind.TURNS),
        ),
        rates=(
            Rate("sample", "frame", 1920, name="samples_per_frame"),
            Rate("mimi_step", "frame", 2, name="mimi_steps_per_frame"),
            Rate("codebook", "frame", codebooks, name="codebooks"),
            Rate("text_token", "frame", 1),
        ),
        quantities={
            "slots": slots,
            "mimi_layers": mimi_layers,
            "mimi_heads": mimi_heads,
            "mimi_head_dim": mimi_dim // mimi_heads,
            "lm_layers": lm_layers,
            "lm_heads": lm_heads,
            "lm_head_dim": lm_dim // lm_heads,
            "depformer_layers": depformer_layers,
            "depformer_heads": depformer_heads,
            "depformer_head_dim": depformer_dim // depformer_heads,
        },
        regions=(
            Region(
                "mimi_encoder_kv",
                dims=("mimi_layers", 2, "slots", "mimi_heads", "mimi_step", "mimi_head_dim"),
                axis=4,
                clock="mimi_step",
                stride=2,
                dtype="float32",
                lifetime=Lifetime.PER_STREAM,
                retention=RingCache(mimi_context),
            ),
            Region(
                "mimi_decoder_kv",
                dims=("mimi_layers", 2, "slots", "mimi_heads", "mimi_step", "mimi_head_dim"),
                axis=4,
                clock="mimi_step",
                stride=2,
                dtype="float32",
                lifetime=Lifetime.PER_STREAM,
                retention=RingCache(mimi_context),
            ),
            Region(
                "lm_kv",
                dims=("lm_layers", 2, "slots", "lm_heads", "frame", "lm_head_dim"),
                axis=4,
                clock="frame",
                stride=1,
                dtype=lm_dtype,
                lifetime=Lifetime.PER_STREAM,
                retention=RingCache(lm_context),
            ),
            Region(
                "depformer_kv",
                dims=("depformer_layers", 2, "slots", "depformer_heads", "codebook", "depformer_head_dim"),
                axis=4,
                clock="codebook",
                stride=1,
                dtype=lm_dtype,
                lifetime=Lifetime.PER_STREAM,
                retention=RingCache(codebooks),
            ),
        ),
        operators=(
            Operator("mimi_encode", "mimi_encoder_kv", steady=2),
            Operator("lm_step", "lm_kv", steady=1, effect=Effect.DEVICE_RNG),
            Operator("depformer_step", "depformer_kv", steady=1, effect=Effect.DEVICE_RNG),
            Operator("mimi_decode", "mimi_decoder_kv", steady=2),
        ),
        admission=Admission("frame", max_per_call=1),
        interactivity=Interactivity(stages=("mimi.encode", "lm.step", "lm.depformer", "mimi.decode")),
    )


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


def check_models(models: Any, contract: Contract) -> None:
    """What the contract says that the bindings cannot check: Mimi's and the LM's rates and dtype,
    the depformer's ring (allocated inside each call), and no attention that picks its weights by a
    host counter (a graph would freeze it)."""
    mimi, lm = models.mimi, models.lm
    symbols = contract.symbols()
    attention = lm.depformer.layers[0].self_attn
    found = {
        "codebooks": lm.dep_q,
        "samples_per_frame": mimi.frame_size,
        "mimi_steps_per_frame": mimi.encoder_frame_rate / mimi.frame_rate,
    }
    # The depformer's ring lives inside each call (no path to check it at): its shape here.
    depformer = {
        "depformer_layers": len(lm.depformer.layers),
        "depformer_heads": attention.num_heads,
        "depformer_head_dim": attention.embed_dim // attention.num_heads,
    }
    for name, actual in found.items():
        if symbols[name] != actual:
            raise ValueError(f"contract quantity {name}={symbols[name]} but the model has {actual}: declare {name}={actual}")
    if DTYPES[contract.region("lm_kv").dtype] != lm.dtype:
        raise ValueError(f"region 'lm_kv' declares {contract.region('lm_kv').dtype}, the LM runs in {lm.dtype}")
    for name, actual in depformer.items():
        if symbols[name] != actual:
            raise ValueError(f"contract quantity {name}={symbols[name]} but the model has {actual}: declare {name}={actual}")
    for path, module in (("mimi", mimi), ("lm.transformer", lm.transformer)):
        stepped = [n for n, m in module.named_modules() if len(getattr(m, "in_projs", ())) > 1]
        if stepped:
            raise ValueError(
                f"{path}: attention with weights per step ({stepped[0]}) selects weights by a host "
                "counter that a graph would freeze; only the depformer (fresh state per call) may"
            )


def used_codebooks(mimi: Any) -> list[EuclideanCodebook]:
    """The codebooks Mimi's calls read: the first `n_q` levels of each residual quantizer (Mimi
    ships 32 levels and streams 8). A transform fills their lazily derived caches first, as the
    vendor's first call would; filling the others would hold caches the vendor never makes."""
    from moshi.quantization.core_vq import VectorQuantization
    from moshi.quantization.vq import ResidualVectorQuantizer

    return [
        cast(VectorQuantization, layer)._codebook  # nn.ModuleList is not generic: its items are typed Module
        for module in mimi.quantizer.modules()
        if isinstance(module, ResidualVectorQuantizer)
        for layer in module.vq.layers[: module.n_q]
    ]
