"""PersonaPlex with random weights and its vendor's own session: the reference cadence-fx must reproduce.

`build_models` builds Mimi and the LM as `loaders.get_mimi` and `loaders.get_moshi_lm` build them,
their classes called directly (`get_moshi_lm` forces its own sizes), at a `PersonaPlexConfig`'s
sizes: `FULL` is PersonaPlex 7B as its loaders build it, `TINY` a cut for the CPU (both read from
the vendor's loaders on first use: importing this module loads no vendor code). `vendor_loop` is
the vendor's session (`offline.py`), unchanged: the prompt phase (`personaplex_prompt.prime`), then
`user_phase`; `stream_reference` runs it on the stock models, `BoundPersonaPlex.stream`
(`personaplex_bound.py`) on the bound ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .personaplex import AGENT, FRAME_SIZE, SAMPLE_RATE, _vendor

# FULL and TINY come from the module's __getattr__ (the vendor loaders run on first use).
__all__ = [
    "FULL",  # noqa: F822
    "TINY",  # noqa: F822
    "PersonaPlexConfig",
    "PersonaPlexModels",
    "StreamOutput",
    "build_models",
    "lm_gen",
    "role_prompt",
    "stream_reference",
    "user_phase",
    "vendor_loop",
]


# -- a random-weight build -----------------------------------------------------------------------


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
