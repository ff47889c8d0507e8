"""PersonaPlex (NVIDIA): its contract, and its Mimi and its LM bound as data on the one pipeline.

PersonaPlex is NVIDIA's fine-tune of Moshi with a voice prompt and a text role prompt
(github.com/NVIDIA/personaplex, commit 3428dfd). Its package is Kyutai's
`moshi` forked from an older release, installed here under its own import name,
`personaplex_moshi` (`.ci/install`), beside Kyutai's `moshi` 0.2.13. Nothing here imports it at
module import: the contract and the bindings are data.

How it differs from Kyutai's 0.2.13 (`models/moshi.py`), read from its source:

- `LMGen` keeps a delayed-token cache with a Python-int `offset` (no device-side offsets, no
  `exec_mask` / `reset_mask`); its main step is `LMModel.forward_codes` (`graphed_main`), its
  depformer step `LMGen.depformer_step(text_token, transformer_out, audio_tokens, audio_provided)`
  (`graphed_depth`), which generates `dep_q` = 16 codebooks a frame (the agent's 8 and the
  user's 8, those the user provided forced in place of the sampled ones), its ring (capacity 16,
  weights per step) entered afresh inside every call.
- Mimi's streaming convolutions keep no preallocated buffers: `RawStreamingConv1d.previous`,
  `RawStreamingConvTranspose1d.partial` and `StreamingAdd.previous_x` / `previous_y` are None
  until the first call, then a new tensor every call; `StreamingConv1d` keeps a host int,
  `padding_to_add`, that the first call moves to 0.

`personaplex_contract` is the contract; `MIMI_BINDING` (a streaming `MimiModel`) and `LM_BINDING`
(a streaming `LMGen`) bind its four operators. The family's other modules, by role:
`personaplex_stream.py` builds the models (`TINY` builds `LMModel` and `MimiModel` directly:
`loaders.get_moshi_lm` forces its own sizes) and runs the vendor's own session (`vendor_loop`,
`offline.py`, unchanged; `stream_reference` on the stock models); `personaplex_bound.py`
transforms both for one session at batch 1 (`transform_personaplex`), the bound LM steps standing
where the vendor's glue calls its own CUDA-graph wrappers (`graphed_main`, `graphed_depth`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from cadence_fx.binding import Binding, OperatorBinding, RegionBinding
from cadence_fx.contract import (
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
    from .personaplex_stream import PersonaPlexConfig, PersonaPlexModels

__all__ = [
    "AGENT",
    "FRAME_SIZE",
    "LM_BINDING",
    "MIMI_BINDING",
    "SAMPLE_RATE",
    "VENDOR",
    "check_models",
    "contract_for",
    "personaplex_contract",
]

#: The vendor's package under the import name `.ci/install` gives it.
VENDOR = "personaplex_moshi"
SAMPLE_RATE = 24_000
FRAME_SIZE = 1_920
#: The agent's audio codebooks in `LMGen.step`'s output (after the text token): what Mimi decodes.
AGENT = slice(1, 9)


def _vendor(name: str) -> Any:
    """A module of the vendor's package (`VENDOR`), imported on first use: the family's one way in."""
    return importlib.import_module(f"{VENDOR}.{name}")


# -- the contract --------------------------------------------------------------------------------


def personaplex_contract(
    *,
    mimi_context: int = 250,
    lm_context: int = 3000,
    codebooks: int = 16,
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
) -> Contract:
    """PersonaPlex 7B as its loaders build it by default (bf16 LM, fp32 Mimi), one session at batch 1.

    Moshi's contract (`models/moshi.py`) but for the depformer: `loaders.get_moshi_lm` sets
    `dep_q` = 16 (the agent's 8 codebooks and the user's 8), and with weights per step and no
    context its ring's capacity is `dep_q`, one position per codebook."""
    return Contract(
        family="personaplex",
        clocks=(
            Clock("frame", ClockKind.FRAMES),
            Clock("mimi_step", ClockKind.FRAMES),
            Clock("sample", ClockKind.SAMPLES),
            Clock("codebook", ClockKind.CODEBOOKS),
            Clock("text_token", ClockKind.TOKENS),
            Clock("turn", ClockKind.TURNS),
        ),
        rates=(
            Rate("sample", "frame", FRAME_SIZE, name="samples_per_frame"),
            Rate("mimi_step", "frame", 2, name="mimi_steps_per_frame"),
            Rate("codebook", "frame", codebooks, name="codebooks"),
            Rate("text_token", "frame", 1),
        ),
        quantities={
            "slots": 1,
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
            Operator("lm_step", "lm_kv", steady=1),  # `forward_codes` draws nothing: the text is sampled by the glue
            Operator("depformer_step", "depformer_kv", steady=1, effect=Effect.DEVICE_RNG),
            Operator("mimi_decode", "mimi_decoder_kv", steady=2),
        ),
        admission=Admission("frame", max_per_call=1),
        interactivity=Interactivity(stages=("mimi.encode", "lm.step", "lm.depformer", "mimi.decode")),
    )


def contract_for(config: PersonaPlexConfig) -> Contract:
    """The contract of a `PersonaPlexConfig` (`FULL` gives the default contract)."""
    lm, mimi = config.lm_kwargs, config.transformer
    return personaplex_contract(
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


# -- the bindings --------------------------------------------------------------------------------

_TRANSFORMER = "self.lm_model.transformer"
_ATTENTION = f"{_TRANSFORMER}.layers.*.self_attn._streaming_state"

#: What `LMGen.depformer_step` reads of `LMGen` to choose how it samples each codebook.
_SAMPLING = ("self.use_sampling", "self.temp", "self.top_k")

#: Host values of the `LMGen` that neither LM step reads, each moved by a session or by the glue:
#: - `self._streaming_state.offset`: the delayed-token cache's position, a Python int the vendor's
#:   glue (`LMGen.step`) advances after the two steps of every frame, read only by that glue;
#: - the prompts a session sets (`text_prompt_tokens`, a list of ints; `load_voice_prompt`'s
#:   `voice_prompt`, `voice_prompt_audio`, `voice_prompt_cache`, `voice_prompt_embeddings`), read
#:   only by the prompt phase's glue (`step_system_prompts`);
#: - the main transformer's host offsets (`offset_cpu`), read only by weights per step, which the
#:   main transformer has none of (the depformer, which has, enters a fresh streaming state at 0
#:   inside every call).
_LM_UNREAD = tuple(
    Unread(path)
    for path in (
        "self._streaming_state.offset",
        "self.text_prompt_tokens",
        "self.voice_prompt",
        "self.voice_prompt_audio",
        "self.voice_prompt_cache",
        "self.voice_prompt_embeddings",
        f"{_TRANSFORMER}.layers.*._streaming_state.offset_cpu",
        f"{_ATTENTION}.offset_cpu",
    )
)

#: The main step (`lm_model.forward_codes`) reads nothing of `LMGen` but its `lm_model`: the
#: sampling switch a session sets, the depformer's mode, is unread by it too.
_MAIN_UNREAD = (*_LM_UNREAD, Unread("self.use_sampling"))

LM_BINDING = Binding(
    regions=(
        # `RingKVCache.complete` writes a call's keys and values at `end_offset` (`index_copy_`), then attends.
        RegionBinding("lm_kv", at=(f"{_ATTENTION}.kv_cache.cache",), write_before_read=True),
        RegionBinding("depformer_kv", per_call=True),  # `depformer_step` enters `depformer.streaming(B)` itself
    ),
    operators=(
        OperatorBinding(
            "lm_step",
            method="lm_model.forward_codes",
            units=1,
            counters=(
                f"{_ATTENTION}.kv_cache.end_offset",
                f"{_ATTENTION}.offset",
                f"{_TRANSFORMER}._streaming_state.offset",
            ),
            regimes=_MAIN_UNREAD,
        ),
        # The sampling switch and its parameters choose the program: each value its own graphs.
        OperatorBinding("depformer_step", method="depformer_step", units=1, modes=_SAMPLING, regimes=_LM_UNREAD),
    ),
)


def _mimi_counters(*parts: str) -> tuple[str, ...]:
    """The per-stream state of Mimi's `parts` besides their rings, at any depth (`**`): the
    streaming convolutions' kept inputs and outputs and first-call padding, the residual adds'
    leftovers, the transformers' offsets and ring ends."""
    state = ("previous", "partial", "previous_x", "previous_y", "padding_to_add", "offset", "kv_cache.end_offset")
    return tuple(f"self.{part}.**._streaming_state.{name}" for part in parts for name in state)


def _mimi_unread(own: str, other: str) -> tuple[Unread, ...]:
    """What one of Mimi's stages never reads. The other stage's modules, whose host values its calls
    move: its SEANet half and its resampling convolution (each `StreamingConv1d`'s `padding_to_add`,
    and the None a reset leaves in each streaming convolution's and residual add's state until the
    first call), and its transformer (host offsets). And its own transformer's host offsets, read
    only by weights per step, which Mimi has none of."""
    layers = f"self.{own}_transformer.transformer.layers.*"
    resample = {"encoder": "downsample", "decoder": "upsample"}[other]
    return (
        Unread(f"self.{other}"),
        Unread(f"self.{resample}"),
        Unread(f"self.{other}_transformer"),
        Unread(f"{layers}._streaming_state.offset_cpu"),
        Unread(f"{layers}.self_attn._streaming_state.offset_cpu"),
    )


MIMI_BINDING = Binding(
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
            counters=_mimi_counters("encoder", "downsample", "encoder_transformer"),
            regimes=_mimi_unread("encoder", "decoder"),
        ),
        OperatorBinding(
            "mimi_decode",
            method="decode",
            units=2,
            counters=_mimi_counters("decoder", "upsample", "decoder_transformer"),
            regimes=_mimi_unread("decoder", "encoder"),
        ),
    ),
)


def check_models(models: PersonaPlexModels, contract: Contract) -> None:
    """What the contract says that the bindings cannot check: Mimi's and the LM's rates and dtype,
    the depformer's ring (allocated inside each call), and no attention outside the depformer that
    picks its weights by a host counter (a graph would freeze it)."""
    from cadence_fx.contract import DTYPES

    mimi, lm = models.mimi, models.lm
    symbols = contract.symbols()
    attention = lm.depformer.layers[0].self_attn
    found = {
        "codebooks": lm.dep_q,
        "samples_per_frame": int(mimi.sample_rate / mimi.frame_rate),  # as `offline.py` computes it
        "mimi_steps_per_frame": mimi.encoder_frame_rate / mimi.frame_rate,
        "depformer_layers": len(lm.depformer.layers),
        "depformer_heads": attention.num_heads,
        "depformer_head_dim": attention.embed_dim // attention.num_heads,
    }
    for name, actual in found.items():
        if symbols[name] != actual:
            raise ValueError(f"contract quantity {name}={symbols[name]} but the model has {actual}: declare {name}={actual}")
    if DTYPES[contract.region("lm_kv").dtype] != next(lm.parameters()).dtype:
        raise ValueError(
            f"region 'lm_kv' declares {contract.region('lm_kv').dtype}, the LM runs in {next(lm.parameters()).dtype}"
        )
    for path, module in (("mimi", mimi), ("lm.transformer", lm.transformer)):
        stepped = [n for n, m in module.named_modules() if getattr(m, "weights_per_step", 0)]
        if stepped:
            raise ValueError(
                f"{path}: weights per step ({stepped[0]}) selects weights by a host counter that a graph "
                "would freeze; only the depformer (fresh state per call) may"
            )
