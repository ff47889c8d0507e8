"""PersonaPlex (NVIDIA): its Mimi and its LM bound as data on the one pipeline, and a tiny random-weight build.

PersonaPlex is NVIDIA's fine-tune of Moshi with a voice prompt and a text role prompt
(github.com/NVIDIA/personaplex, commit 3428dfd; DESIGN.md section 4). Its package is Kyutai's
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
(a streaming `LMGen`) bind its four operators; `transform_personaplex` transforms both for one
session at batch 1 and puts the bound LM steps where the vendor's glue calls its own CUDA-graph
wrappers (`graphed_main`, `graphed_depth`). `TINY` builds `LMModel` and `MimiModel` directly
(`loaders.get_moshi_lm` forces its own sizes); `vendor_loop` is the vendor's own session
(`offline.py`), unchanged, which `stream_reference` runs on the stock models and
`BoundPersonaPlex.stream` on the bound ones.

What the pipeline does not do yet for Mimi's None-until-first-call state (tests/test_personaplex.py):
a counter is taken as a tensor (state at one address) or a host value once, at the operator's first
call, so `transform_personaplex` primes Mimi first (`_prime_mimi`). A reset's Nones change the
module settings' paths; each set of paths keeps its version, so each stage has three programs (the
priming frame, a reset's first frame, the steady frame) and every frame runs its graph.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch

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

# FULL and TINY come from the module's __getattr__ (the vendor loaders run on first use).
__all__ = [
    "FULL",  # noqa: F822
    "LM_BINDING",
    "MIMI_BINDING",
    "TINY",  # noqa: F822
    "BoundPersonaPlex",
    "PersonaPlexConfig",
    "PersonaPlexModels",
    "StreamOutput",
    "build_models",
    "role_prompt",
    "check_models",
    "contract_for",
    "lm_gen",
    "personaplex_contract",
    "stream_reference",
    "transform_personaplex",
    "used_codebooks",
    "user_phase",
    "vendor_loop",
]

#: The vendor's package under the import name `.ci/install` gives it.
VENDOR = "personaplex_moshi"
SAMPLE_RATE = 24_000
FRAME_SIZE = 1_920
#: The agent's audio codebooks in `LMGen.step`'s output (after the text token): what Mimi decodes.
AGENT = slice(1, 9)


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


# -- a random-weight build -----------------------------------------------------------------------


def _vendor(name: str) -> Any:
    import importlib

    return importlib.import_module(f"{VENDOR}.{name}")


def _full_config() -> dict[str, Any]:
    loaders = _vendor("models.loaders")
    # `get_moshi_lm` copies `_lm_kwargs` and sets dep_q = 16 before building.
    return dict(
        seanet=dict(loaders._seanet_kwargs),
        quantizer=dict(loaders._quantizer_kwargs),
        transformer=dict(loaders._transformer_kwargs),
        lm_kwargs=dict(loaders._lm_kwargs, dep_q=16),
    )


@dataclass(frozen=True)
class PersonaPlexConfig:
    """What `loaders.get_mimi` and `loaders.get_moshi_lm` build, as arguments to the classes they call."""

    seanet: dict[str, Any]
    quantizer: dict[str, Any]
    transformer: dict[str, Any]
    lm_kwargs: dict[str, Any]
    lm_dtype: torch.dtype
    seed: int = 0


def _full() -> PersonaPlexConfig:
    return PersonaPlexConfig(**_full_config(), lm_dtype=torch.bfloat16)


def _tiny() -> PersonaPlexConfig:
    """Cut as Kyutai's `moshi_stream.TINY` cuts Moshi: Mimi 32 wide (2 heads, feed-forward 64) with
    8-dimensional codebook vectors and 4 SEANet filters, one layer in each transformer, the LM and
    the depformer 32 wide with 4 heads (feed-forwards 132 and 64), float32. Everything else as the
    loaders set it: ring capacities (Mimi 250, LM 3000, depformer 16), the 16 depformer codebooks with
    weights per step, card 2048 and text card 32000, the delays, the SEANet strides and its one
    residual unit per stage (kept: its `StreamingAdd` is streaming state too), the 80 ms frame."""
    full = _full_config()
    full["seanet"].update(n_filters=4, dimension=32)
    full["quantizer"].update(dimension=8, input_dimension=32, output_dimension=32)
    full["transformer"].update(
        d_model=32, num_heads=2, num_layers=1, dim_feedforward=64, input_dimension=32, output_dimensions=[32]
    )
    full["lm_kwargs"].update(
        dim=32,
        num_heads=4,
        num_layers=1,
        depformer_dim=32,
        depformer_dim_feedforward=64,
        depformer_num_heads=4,
        depformer_num_layers=1,
    )
    return PersonaPlexConfig(**full, lm_dtype=torch.float32)


_CONFIGS: dict[str, PersonaPlexConfig] = {}


def __getattr__(name: str) -> Any:
    """`FULL` and `TINY`, read from the vendor's loaders on first use (importing this module loads no vendor code)."""
    if name in ("FULL", "TINY"):
        if name not in _CONFIGS:
            _CONFIGS[name] = _full() if name == "FULL" else _tiny()
        return _CONFIGS[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass
class PersonaPlexModels:
    mimi: Any  # personaplex_moshi.models.compression.MimiModel
    lm: Any  # personaplex_moshi.models.lm.LMModel
    config: PersonaPlexConfig = field(repr=False)


@torch.no_grad()
def build_models(config: PersonaPlexConfig, device: str | torch.device = "cpu") -> PersonaPlexModels:
    """Random-weight Mimi and LM built as `loaders.get_mimi` and `loaders.get_moshi_lm` build them
    (their classes called directly, at `config`'s sizes), from `config.seed`; the caller's RNG
    state is left as it was. Mimi's VQ codebooks (`embedding_sum`, zero at init) are drawn and
    marked initialized, as a checkpoint has them; every parameter still all-zero is re-drawn."""
    modules, compression, lm_module = _vendor("modules"), _vendor("models.compression"), _vendor("models.lm")
    quantization = _vendor("quantization")
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        torch.manual_seed(config.seed)
        encoder = modules.SEANetEncoder(**config.seanet)
        decoder = modules.SEANetDecoder(**config.seanet)
        encoder_transformer = modules.transformer.ProjectedTransformer(device=device, **config.transformer)
        decoder_transformer = modules.transformer.ProjectedTransformer(device=device, **config.transformer)
        quantizer = quantization.SplitResidualVectorQuantizer(**config.quantizer)
        mimi = compression.MimiModel(
            encoder,
            decoder,
            quantizer,
            channels=1,
            sample_rate=SAMPLE_RATE,
            frame_rate=12.5,
            encoder_frame_rate=SAMPLE_RATE / encoder.hop_length,
            causal=True,
            resample_method="conv",
            encoder_transformer=encoder_transformer,
            decoder_transformer=decoder_transformer,
        ).to(device=device)
        mimi.eval()
        mimi.set_num_codebooks(8)
        lm = lm_module.LMModel(device=device, dtype=config.lm_dtype, **config.lm_kwargs)
        lm.to(device=device, dtype=config.lm_dtype)
        lm.eval()
        for module in mimi.quantizer.modules():
            if hasattr(module, "embedding_sum"):
                module.embedding_sum.normal_(0.0, 1.0)
                module._initialized.fill_(1.0)
                module._embedding = None
        for model in (mimi, lm):
            for param in model.parameters():
                if not torch.any(param):
                    param.normal_(0.0, 0.02)
    return PersonaPlexModels(mimi=mimi, lm=lm, config=config)


# -- the vendor's loop ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamOutput:
    """`tokens`: `(1, 1 + dep_q, frames - 1)` int64, text first (the user's frames only, the prompt
    phase's steps return nothing the vendor keeps). `pcm`: the agent's audio, `(1, 1, 1920 * that)`."""

    tokens: torch.Tensor
    pcm: torch.Tensor


def role_prompt(text: str) -> str:
    """A role prompt as the vendor's `offline.py` gives it to its tokenizer: wrapped in
    `<system>` tags (`wrap_with_system_tags`) unless it already is."""
    return _vendor("offline").wrap_with_system_tags(text)


def lm_gen(lm: Any, *, sampling: bool) -> Any:
    """An `LMGen` as the vendor's `offline.py` makes one (its defaults otherwise: temperatures 0.8
    and 0.7, top-k 250 and 25): half a second of silence after each prompt, Mimi's rates."""
    LMGen = _vendor("models.lm").LMGen
    return LMGen(
        lm,
        device=lm.device,
        use_sampling=sampling,
        audio_silence_frame_cnt=int(0.5 * 12.5),
        sample_rate=SAMPLE_RATE,
        frame_rate=12.5,
    )


@torch.no_grad()
def vendor_loop(
    mimi: Any,
    gen: Any,
    pcm: torch.Tensor,
    *,
    seed: int,
    text_prompt_tokens: Sequence[int],
    voice_prompt: str | None = None,
    voice_prompt_embeddings: str | None = None,
) -> StreamOutput:
    """The vendor's session (`offline.py` `run_inference`, steps 6 to 9), on streaming `mimi` and
    `gen`, unchanged: the default generators seeded with `seed`, then `personaplex_prompt.prime`
    (the voice prompt loaded where given, from a wav file or from saved embeddings, the text prompt
    tokens set, every streaming state reset, the system prompts stepped (`step_system_prompts`: the
    voice prompt's frames Mimi-encoded and stepped, half a second of silence, the text prompt token
    by token, half a second of silence), Mimi reset), then `user_phase`. Loading a voice prompt
    and the resets draw nothing, so seeding first is seeding where `offline.py` does. The vendor's
    warm-up (4 frames of zeros, then the same resets) only primes its CUDA graphs and is left out."""
    from .personaplex_prompt import prime

    torch.manual_seed(seed)
    prime(
        mimi,
        gen,
        text_prompt_tokens=text_prompt_tokens,
        voice_prompt=voice_prompt,
        voice_prompt_embeddings=voice_prompt_embeddings,
    )
    return user_phase(mimi, gen, pcm)


@torch.no_grad()
def user_phase(mimi: Any, gen: Any, pcm: torch.Tensor) -> StreamOutput:
    """The user's phase of the vendor's session, on a primed `gen`: per 1920-sample frame of `pcm`
    (the user's audio), `mimi.encode` -> `LMGen.step` -> `mimi.decode` of the agent's 8 codebooks."""
    tokens, out = [], []
    for frame in pcm.split(FRAME_SIZE, dim=-1):
        codes = mimi.encode(frame)
        step = gen.step(codes)
        if step is None:
            continue
        tokens.append(step)
        out.append(mimi.decode(step[:, AGENT]))
    return StreamOutput(tokens=torch.cat(tokens, dim=-1), pcm=torch.cat(out, dim=-1))


def stream_reference(
    models: PersonaPlexModels,
    pcm: torch.Tensor,
    *,
    sampling: bool,
    seed: int,
    text_prompt_tokens: Sequence[int],
    voice_prompt: str | None = None,
) -> StreamOutput:
    """PersonaPlex's own loop on `models` as they are, batch 1: `vendor_loop` on a fresh `LMGen`,
    both models streaming, the vendor's lazily compiled kernels run eagerly (`no_compile`)."""
    no_compile = _vendor("utils.compile").no_compile
    gen = lm_gen(models.lm, sampling=sampling)
    with no_compile(), models.mimi.streaming(1), gen.streaming(1):
        return vendor_loop(models.mimi, gen, pcm, seed=seed, text_prompt_tokens=text_prompt_tokens, voice_prompt=voice_prompt)


# -- transformed ---------------------------------------------------------------------------------


@dataclass
class BoundPersonaPlex:
    """Mimi and the LM at batch 1, their four operators bound (`bound["mimi"]`, `bound["lm"]`):
    `stream(...)` runs `vendor_loop` on them, the vendor's glue calling the bound operators."""

    models: PersonaPlexModels
    lm_gen: Any
    bound: dict[str, Any]
    reports: dict[str, Any]
    streaming: ExitStack

    def stream(
        self, pcm: torch.Tensor, *, sampling: bool, seed: int, text_prompt_tokens: Sequence[int], voice_prompt: str | None = None
    ) -> StreamOutput:
        """As `stream_reference` computes it, on the bound operators."""
        compile_ = _vendor("utils.compile")
        gen = self.lm_gen
        gen.use_sampling = sampling
        # The vendor's own CUDA-graph wrappers off (its flag, read on every call): the bound operators
        # replay instead, the glue between them runs eagerly, as the vendor's does.
        with compile_.no_compile(), compile_.no_cuda_graph():
            return vendor_loop(
                self.bound["mimi"], gen, pcm, seed=seed, text_prompt_tokens=text_prompt_tokens, voice_prompt=voice_prompt
            )

    def prompt_state(
        self,
        *,
        voice: str,
        text_prompt_tokens: Sequence[int],
        voice_prompt: str | None = None,
        voice_prompt_embeddings: str | None = None,
    ) -> Any:
        """The vendor's priming stepped once on the bound operators (`personaplex_prompt.prime`),
        its state captured (`personaplex_prompt.capture`, keyed by `voice` and the role's tokens).
        The caller's generators are left as they were (priming draws, and throws its draws away)."""
        from .personaplex_prompt import capture, prime

        compile_ = _vendor("utils.compile")
        device = self.models.lm.device
        with (
            torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []),
            compile_.no_compile(),
            compile_.no_cuda_graph(),
        ):
            prime(
                self.bound["mimi"],
                self.lm_gen,
                text_prompt_tokens=text_prompt_tokens,
                voice_prompt=voice_prompt,
                voice_prompt_embeddings=voice_prompt_embeddings,
            )
        return capture(self.lm_gen, voice=voice, role=text_prompt_tokens)

    def stream_primed(self, state: Any, pcm: torch.Tensor, *, sampling: bool, generator: torch.Tensor) -> StreamOutput:
        """A session that starts from a prompt state instead of stepping its prompts: Mimi reset,
        `state` copied into the `LMGen` (`personaplex_prompt.restore`), the device's generator set to
        `generator` (the session's draws start there), then `user_phase` on the bound operators."""
        from cadence_fx.multiplex import rng_set

        from .personaplex_prompt import restore

        compile_ = _vendor("utils.compile")
        self.lm_gen.use_sampling = sampling
        with compile_.no_compile(), compile_.no_cuda_graph(), torch.no_grad():
            self.bound["mimi"].reset_streaming()
            restore(self.lm_gen, state)
            rng_set(self.models.lm.device, generator)
            return user_phase(self.bound["mimi"], self.lm_gen, pcm)

    @property
    def report(self) -> Any:
        from cadence_fx.transform import TransformReport

        return TransformReport.merged(list(self.reports.values()))

    def close(self) -> None:
        self.streaming.close()


def transform_personaplex(models: PersonaPlexModels, contract: Contract, **options: Any) -> BoundPersonaPlex:
    """`models` for one session at a time at batch 1, each transformed from its binding on the one
    pipeline (`options` are `transform`'s): the modules deep-copied around the caller's weights
    (shared, not copied), an `LMGen` on the copy, both streaming for good; Mimi from `MIMI_BINDING`,
    the `LMGen` from `LM_BINDING`, whose bound steps then stand where the vendor's glue calls its own
    CUDA-graph wrappers (`graphed_main`, `graphed_depth`). The lazily derived codebook caches the
    calls read are filled first, as the vendor's first call would."""
    from cadence_fx.transform import transform

    check_models(models, contract)
    with torch.no_grad():
        for codebook in used_codebooks(models.mimi):
            if codebook._embedding is None:
                codebook.embedding  # noqa: B018 - fills the vendor's lazily derived codebook cache
    shared = {id(t): t for module in (models.mimi, models.lm) for t in itertools.chain(module.parameters(), module.buffers())}
    models = copy.deepcopy(models, shared)
    gen = lm_gen(models.lm, sampling=True)
    streaming = ExitStack()
    try:
        streaming.enter_context(models.mimi.streaming(1))
        streaming.enter_context(gen.streaming(1))
        bound, reports = {}, {}
        bound["mimi"], reports["mimi"] = transform(models.mimi, contract, MIMI_BINDING, **options)
        bound["lm"], reports["lm"] = transform(gen, contract, LM_BINDING, **options)
        state = gen._streaming_state
        state.graphed_main = bound["lm"].operators["lm_step"]
        state.graphed_depth = bound["lm"].operators["depformer_step"]
        _prime_mimi(models.mimi, bound["mimi"])
    except BaseException:
        streaming.close()
        raise
    return BoundPersonaPlex(models, gen, bound, reports, streaming)


def used_codebooks(mimi: Any) -> list[torch.nn.Module]:
    """The codebooks Mimi's calls read: the first `n_q` levels of each residual quantizer (Mimi
    ships 32 levels and streams 8). A transform fills their lazily derived caches first, as the
    vendor's first call would; filling the others would hold caches the vendor never makes."""
    ResidualVectorQuantizer = _vendor("quantization.vq").ResidualVectorQuantizer
    return [
        layer._codebook
        for module in mimi.quantizer.modules()
        if isinstance(module, ResidualVectorQuantizer)
        for layer in module.vq.layers[: module.n_q]
    ]


def _prime_mimi(mimi: Any, bound: Any) -> None:
    """One frame of silence through stock Mimi, then one through the bound operators, then the
    vendor's reset. A bound operator takes the counters it finds at its first call as what they are
    then (a tensor: state kept at one address; anything else: a host value), and Mimi's streaming
    convolutions make their tensors (`previous`, `partial`, `previous_x`, `previous_y`) only at
    their first call: so the bound operators' first call comes after a stock one. The caller's
    generators are left as they were (Mimi draws none)."""
    no_compile = _vendor("utils.compile").no_compile
    silence = torch.zeros(1, mimi.channels, FRAME_SIZE, device=next(mimi.parameters()).device)
    with no_compile(), torch.no_grad():
        mimi.decode(mimi.encode(silence))
        bound.operators["mimi_decode"](bound.operators["mimi_encode"](silence))
        mimi.reset_streaming()
