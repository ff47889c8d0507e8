"""Stock Moshi streaming (Mimi + LM) with random weights: the reference cadence-fx must reproduce.

Vendor package, installed without its dependency pins so that torch 2.13 stays in place
(`moshi` 0.2.13 declares torch<2.10, numpy<2.3, safetensors<0.8, huggingface-hub<1.0); what its
code imports at run time is installed with its own dependencies (`.ci/install` is the truth)::

    pip install --no-deps moshi==0.2.13
    pip install einops==0.8.1 sentencepiece==0.2.1 tqdm==4.67.1 'safetensors>=0.7' 'huggingface-hub>=1.17' requests

`moshi.models.loaders`
imports huggingface_hub (and through it tqdm), safetensors and sentencepiece at module import,
although nothing here downloads or tokenizes.

Models are built offline, `loaders.get_mimi(None, ...)` and `loaders.get_moshi_lm(None,
lm_kwargs=...)`, under a fixed seed. Mimi's VQ codebooks (`embedding_sum`) start at zero and
are drawn here (and their `_initialized` flags set, as a checkpoint would have them); every
parameter still all-zero after the vendor's init (Mimi's transformer LayerNorm biases) is
re-drawn as well.

The vendor graphs four stages with `moshi/utils/compile.py::CUDAGraphed`. Each wrapper records one
CUDA graph per wrapped callable on its second call (`warmup_steps=1`), copies every tensor
argument into its static clone on each later call, raises on a shape change or a changed
non-tensor argument, and is a plain call off CUDA, under `NO_CUDA_GRAPH=1` (any value but
"", 0, no, n) or inside `compile.no_cuda_graph()`.

============  ====================================================  ==============================
stage         wrappers (created in `_init_streaming_state`)         run eagerly between them
============  ====================================================  ==============================
Mimi encode   `MimiModel`: `graphed_encoder` (SEANet encoder),      `_to_framerate` (streaming
              `graphed_tr_enc` (encoder transformer)                conv downsample),
                                                                    `quantizer.encode`
Mimi decode   `MimiModel`: `graphed_tr_dec` (decoder transformer),  `quantizer.decode`,
              `graphed_decoder` (SEANet decoder)                    `_to_encoder_framerate`
                                                                    (streaming conv upsample)
LM main step  `LMGen`: `graphed_main` = `lm_model.forward_text`     delayed-token cache
                                                                    scatter/gather, text
                                                                    `sample_token`
depformer     `LMGen`: `graphed_depth` = `LMGen.depformer_step`     (none: all 8 codebooks and
step          (enters `depformer.streaming(B)` inside, so its       their sampling are inside)
              state is fresh each frame)
============  ====================================================  ==============================

`StreamingModule.set_exec_mask` is graphed too (`_set_exec_mask_graphed`), but a plain stream
never calls it.

Ring caches (`modules/transformer.py::RingKVCache`, one per attention layer, tensor
`(2, B, heads, context, head_dim)` in the layer's dtype plus an int64 `end_offset` of shape
`(B,)`, or `(1,)` with weights per step; positions and offsets stay on the device):

- Mimi encoder and decoder transformers: 8 layers each, `(2, B, 8, 250, 64)` float32. They
  run at 25 Hz, before the stride-2 downsample and after the upsample, so each 1920-sample frame
  writes 2 positions: the ring wraps after 125 frames (10 s).
- LM main transformer: 32 layers, `(2, B, 32, 3000, 128)` bfloat16, 1 position per frame.
- Depformer: 6 layers, `(2, B, 16, 8, 64)` bfloat16, allocated afresh on every frame and
  filled with one position per codebook.

Per-frame random draws with sampling on (none when greedy), all from the default generator
through `utils/sampling.py::multinomial`, one `torch.empty_like(p).exponential_(1)` per sampled
token: 1 for text over the top 25 (`top_k_text`), then 8 in the depformer over the top 250
(`top_k`), in codebook order: 9 calls and 2,025 values per frame, the text one outside any graph
and the 8 depformer ones inside `graphed_depth`. Frame 0 samples too, although `LMGen.step`
returns None until the acoustic delay (1 frame) has passed.
"""

from __future__ import annotations

import copy
import itertools
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch
from moshi.models import LMGen, loaders
from moshi.models.compression import MimiModel
from moshi.models.lm import LMModel
from moshi.quantization.core_vq import EuclideanCodebook
from moshi.utils.compile import no_compile

__all__ = [
    "FULL",
    "no_compile",
    "SMALL",
    "MoshiConfig",
    "MoshiModels",
    "StreamOutput",
    "build_models",
    "random_pcm",
    "ring_caches",
    "streaming_copy",
    "stream_reference",
    "time_frames",
]

SAMPLE_RATE = 24_000
FRAME_SIZE = 1_920


@dataclass(frozen=True)
class MoshiConfig:
    """Arguments to the vendor loaders. `FULL` is Moshi 7B + Mimi as shipped; `SMALL` for CPU."""

    mimi: dict[str, Any]
    lm_kwargs: dict[str, Any]
    lm_dtype: torch.dtype
    seed: int = 0


def _small_mimi() -> dict[str, Any]:
    mimi: dict[str, Any] = {key: dict(value) if isinstance(value, dict) else value for key, value in loaders._mimi_config.items()}
    mimi["seanet"].update(n_filters=8, dimension=128)
    mimi["quantizer"].update(dimension=64, input_dimension=128, output_dimension=128)
    mimi["transformer"].update(
        d_model=128,
        num_heads=2,
        num_layers=2,
        dim_feedforward=256,
        input_dimension=128,
        output_dimensions=[128],
    )
    return mimi


FULL = MoshiConfig(mimi=loaders._mimi_config, lm_kwargs=loaders._lm_kwargs, lm_dtype=torch.bfloat16)

# Ring capacities, codebook counts, delays, vocabularies and sampling widths stay real; widths,
# depths and head counts shrink.
SMALL = MoshiConfig(
    mimi=_small_mimi(),
    lm_kwargs=loaders._lm_kwargs
    | dict(
        dim=128,
        num_heads=4,
        num_layers=2,
        depformer_dim=64,
        depformer_dim_feedforward=128,
        depformer_num_heads=4,
        depformer_num_layers=2,
    ),
    lm_dtype=torch.float32,
)


@dataclass
class MoshiModels:
    mimi: MimiModel
    lm: LMModel
    config: MoshiConfig = field(repr=False)


@dataclass(frozen=True)
class StreamOutput:
    """`tokens`: `(1, 1 + dep_q, frames - 1)` int64, text first. `pcm`: `(1, 1, 1920 * that)`."""

    tokens: torch.Tensor
    pcm: torch.Tensor


@torch.no_grad()
def build_models(config: MoshiConfig = SMALL, device: str | torch.device = "cpu") -> MoshiModels:
    """Random-weight Mimi and LM from `config.seed`; the caller's RNG state is left as it was."""
    device = torch.device(device)
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(config.seed)
        num_codebooks = config.lm_kwargs["dep_q"]
        mimi = loaders.get_mimi(None, config.mimi, device=device, num_codebooks=num_codebooks)
        lm = loaders.get_moshi_lm(None, lm_kwargs=config.lm_kwargs, device=device, dtype=config.lm_dtype)
        _draw_codebooks(mimi)
        for model in (mimi, lm):
            for param in model.parameters():
                if not torch.any(param):
                    param.normal_(0.0, 0.02)
    return MoshiModels(mimi=mimi, lm=lm, config=config)


def _draw_codebooks(mimi: MimiModel) -> None:
    for module in mimi.quantizer.modules():
        if isinstance(module, EuclideanCodebook):
            module.embedding_sum.normal_(0.0, 1.0)
            module._initialized.fill_(1.0)
            module.register_buffer("_embedding", None, persistent=False)  # derived from the sum: recomputed on use


def streaming_copy(models: MoshiModels, contract: Any, batch: int, **lm_gen_options: Any) -> tuple[MoshiModels, LMGen, ExitStack]:
    """What every transformed Moshi streams on: `models` checked against `contract`
    (`moshi.check_models`), the lazily derived codebook caches the calls read filled in `models`
    (as the vendor's first call would), then the modules deep-copied with every parameter and
    buffer shared (the runtime's streaming state is its own, the caller's modules never stream for
    it), an `LMGen(lm, **lm_gen_options)` on the copy, and both streaming at `batch`, entered on the
    returned stack."""
    from .moshi import check_models, used_codebooks

    check_models(models, contract)
    with torch.no_grad():
        for codebook in used_codebooks(models.mimi):
            if codebook._embedding is None:
                codebook.embedding  # noqa: B018 - fills the vendor's lazily derived codebook cache
    shared = {id(t): t for module in (models.mimi, models.lm) for t in itertools.chain(module.parameters(), module.buffers())}
    models = copy.deepcopy(models, shared)
    lm_gen = LMGen(models.lm, **lm_gen_options)
    streaming = ExitStack()
    try:
        streaming.enter_context(models.mimi.streaming(batch))
        streaming.enter_context(lm_gen.streaming(batch))
    except BaseException:
        streaming.close()
        raise
    return models, lm_gen, streaming


def random_pcm(frames: int, seed: int = 0, device: str | torch.device = "cpu") -> torch.Tensor:
    """`(1, 1, 1920 * frames)` float32 noise at speech-like level."""
    generator = torch.Generator().manual_seed(seed)
    pcm = 0.1 * torch.randn(1, 1, FRAME_SIZE * frames, generator=generator)
    return pcm.to(device)


def _vendor_compile(enabled: bool) -> ExitStack:
    stack = ExitStack()
    if not enabled:
        stack.enter_context(no_compile())
    return stack


@torch.no_grad()
def stream_reference(
    models: MoshiModels,
    pcm: torch.Tensor,
    *,
    sampling: bool,
    seed: int,
    torch_compile: bool = False,
) -> StreamOutput:
    """The vendor's own loop, batch 1: per 1920-sample frame, `mimi.encode` -> `LMGen.step` ->
    `mimi.decode` of the 8 generated audio codebooks, as `moshi/server.py` does.

    Reseeds the default generators with `seed` first: the vendor samples from them.
    `LMGen` keeps its defaults (temp 0.8, text 0.7, top-k 250, text 25).

    `torch_compile=True` lets the vendor's lazily compiled kernels (`gating_forward_kernel`,
    `apply_rope`, `_rms_norm`, all `utils/compile.py::torch_compile_lazy`) go through
    `torch.compile` on first use, as stock Moshi does unless `NO_TORCH_COMPILE` was set before
    import. On CUDA that is all three everywhere; on CPU the transformer layers opt out, so only
    the LM's `out_norm` compiles, which costs about 40 s on the first frame here. Off (the
    default), `moshi.utils.compile.no_compile()` runs them eagerly.
    """
    lm_gen = LMGen(models.lm, use_sampling=sampling)
    mimi = models.mimi
    torch.manual_seed(seed)
    tokens, out = [], []
    with _vendor_compile(torch_compile), mimi.streaming(1), lm_gen.streaming(1):
        for frame in pcm.split(mimi.frame_size, dim=-1):
            codes = mimi.encode(frame)
            step = lm_gen.step(codes)
            if step is None:
                continue
            tokens.append(step)
            out.append(mimi.decode(step[:, 1:]))
    return StreamOutput(tokens=torch.cat(tokens, dim=-1), pcm=torch.cat(out, dim=-1))


def ring_caches(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Shape of every live `RingKVCache` under `module` (call inside `module.streaming(...)`)."""
    shapes = {}
    for name, sub in module.named_modules():
        state = getattr(sub, "_streaming_state", None)
        kv_cache = getattr(state, "kv_cache", None)
        if kv_cache is not None:
            shapes[name] = tuple(kv_cache.cache.shape)
    return shapes


@torch.no_grad()
def time_frames(
    models: MoshiModels, frames: int, *, sampling: bool, seed: int = 0, torch_compile: bool = False
) -> dict[str, float]:
    """Mean CPU wall seconds per frame of each stock stage over `frames` frames (after frame 0)."""
    lm_gen = LMGen(models.lm, use_sampling=sampling)
    mimi = models.mimi
    pcm = random_pcm(frames, seed, device=next(mimi.parameters()).device)
    torch.manual_seed(seed)
    totals = {"mimi_encode": 0.0, "lm_step": 0.0, "mimi_decode": 0.0}
    with _vendor_compile(torch_compile), mimi.streaming(1), lm_gen.streaming(1):
        for index, frame in enumerate(pcm.split(mimi.frame_size, dim=-1)):
            t0 = time.perf_counter()
            codes = mimi.encode(frame)
            t1 = time.perf_counter()
            step = lm_gen.step(codes)
            t2 = time.perf_counter()
            if step is not None:
                mimi.decode(step[:, 1:])
            t3 = time.perf_counter()
            if index > 0:
                totals["mimi_encode"] += t1 - t0
                totals["lm_step"] += t2 - t1
                totals["mimi_decode"] += t3 - t2
    return {stage: total / (frames - 1) for stage, total in totals.items()}


def _tiny_mimi() -> dict[str, Any]:
    mimi = _small_mimi()
    mimi["seanet"].update(n_filters=4, dimension=32, n_residual_layers=0)
    mimi["quantizer"].update(dimension=8, input_dimension=32, output_dimension=32)
    mimi["transformer"].update(
        d_model=32,
        num_layers=1,
        dim_feedforward=64,
        input_dimension=32,
        output_dimensions=[32],
    )
    return mimi


# The duplex service's embedded default (`moshi-tiny` in serve/plugins/moshi.py), cut down for
# 8 sessions on 2 CPU cores, where a frame is bound by per-operator overhead (what 8 sessions
# measured: bench/results/history/serve_load_moshi.json). SMALL with one layer in each transformer (Mimi's
# encoder and decoder transformers, the LM, the depformer), widths of 32 (Mimi's latent and
# transformers, the LM, the depformer; feed-forwards of 64), 8-dimensional codebook vectors, 4
# SEANet base filters and no residual units in SEANet. Widths went from 64 to 32 (and SEANet's
# filters from 8 to 4) when 8 sessions did not keep real time: the operators are the same, but
# every frame reads half the weights and ring bytes (the LM's 32,000-way text projection alone
# was 8 MB of float32 per frame). Everything else SMALL keeps real stays real: head counts, ring
# capacities, codebook counts and bins, delays, vocabularies, sampling widths, the SEANet strides
# and the 80 ms frame.
TINY = MoshiConfig(
    mimi=_tiny_mimi(),
    lm_kwargs=SMALL.lm_kwargs
    | dict(
        dim=32,
        num_layers=1,
        depformer_dim=32,
        depformer_dim_feedforward=64,
        depformer_num_layers=1,
    ),
    lm_dtype=torch.float32,
)
