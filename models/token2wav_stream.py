"""MiniCPM-o 4.5 Token2Wav at its real size with random weights, and the stock streaming loop.

Built from minicpmo-utils 1.0.6 (see ``vendor.py``). :class:`StockStream` mirrors
``stepaudio2/token2wav.py`` ``Token2wav.set_stream_cache`` and ``Token2wav.stream`` line for line,
minus prompt preparation (audio tokenizer, speaker model, prompt mel: a seeded random
:class:`Prompt` replaces them) and the final PCM encoding.

Retained state. P = 302 prompt mel frames (151 prompt tokens; setup appends 3 look-ahead silence
tokens 4218). A chunk is 28 tokens (25 + 3 look-ahead) -> 50 mel frames, 56 on the last chunk.
T is the time length of the attention caches.

* ``conformer_att_cache`` (10, 1, 8, T, 128): encoder block (0-5 token rate, 6-9 mel rate),
  batch, head, time, [key 64 | value 64]. Blocks 0-5 store their T/2 token-rate keys tiled twice
  and read back the first half.
* ``conformer_cnn_cache`` (1, 512, 6): batch, channel, 2 pre-lookahead + 4 upsample frames.
* ``estimator_att_cache`` (16, 16, 2, 8, T, 128): Euler-step slot (10 used), DiT block slot (16
  whatever the depth), CFG batch, head, time, [key 64 | value 64].
* ``estimator_cnn_cache`` (16, 16, 2, 1024, 2): step slot, block slot, CFG batch, conv1 | conv2
  channels, 2 frames.
* HiFT: mel (1, 80, 8), source (1, 1, 3840), speech (1, 3840); HiFT sees 50, 58, 58, ... mel
  frames (64 on the last chunk) and the stream cross-fades 3,840 samples with a Hamming window.

T after setup 302, after chunk 1 352, after chunk 2 402 (not above P + 100: kept), after chunk 3
and every later one 452 (458 on the last chunk), which :meth:`StockStream.retain` cuts to 402.
So chunk n attends 302, 352, 402, 402, ... cached frames plus its own 50; setup runs 302 frames
with no cache.

Retention sites in the vendor package (``site-packages/stepaudio2``):

* DiT prepends: ``cosyvoice2/flow/decoder_dit.py:142-143`` ``k = torch.cat([k, k_cache], dim=2)``
  (:137-138 is the masked branch, which eager never takes), :146 ``cat([k, v], dim=3)``, :582
  copies into ``DiT.att_cache_buffer`` (16, 2, 8, 1000, 128), :571 returns a view of it;
  ``cosyvoice2/flow/flow_matching.py:166`` copies that into ``CFM.att_cache_buffer``
  (16, 16, 2, 8, 1000, 128), :169 returns a view. Conv: decoder_dit.py:233-234 (cat, keep the
  last 2 frames), :291, :581; flow_matching.py:165 (``CFM.cnn_cache_buffer``, returned whole).
* Conformer appends: ``cosyvoice2/transformer/attention.py:297-298``
  ``k = torch.cat([key_cache, k], dim=2)``, :301 ``cat((k, v), dim=-1)``;
  ``cosyvoice2/transformer/upsample_encoder_v2.py:429`` reads the first half for blocks 0-5,
  :451/:472 stack, :478 ``cat([new_att_cache1.repeat(1, 1, 1, 2, 1), new_att_cache2], dim=0)``.
  Conv: :134 (pre-lookahead), :80 (upsample), :479.
* Caller: ``token2wav.py:192-196`` (estimator, axis 4) and :200-204 (conformer, axis 3) keep
  ``cat([c[.., :P], c[.., -100:]])`` once the length exceeds P + 100; HiFT: :210 (mel cat),
  :222-226 (keep the last 8 mel frames / 3,840 samples), ``flashcosyvoice/modules/hifigan.py:247``
  writes the cached source over the first 3,840 source samples.

What the trim keeps (g_n: the 50 frames of chunk n in time order, t_n its 25 tokens, p: prompt):

* estimator, newest chunk first: after chunk n in 3..6, [g_n ... g_1 p[0:302-50n] | p[202:302]];
  from chunk 7 on, [g_n ... g_(n-5) g_(n-6)[0:2] | p[202:302]]. The prompt tail p[202:302] stays
  forever.
* conformer blocks 6-9, oldest first: [p[0:302] | the newest 100 frames].
* conformer blocks 0-5: of A = [p t_1 ... t_n] (226 tokens) tiled, the kept 402 columns are
  [A[0:226] A[0:76] | A[126:226]] and the next chunk reads back A[0:201] = [p t_1 t_2]: from
  chunk 4 on these blocks attend the prompt, t_1, t_2 and the current chunk only.

The cache dict aliases module buffers (``CFM.att_cache_buffer``/``cnn_cache_buffer``) exactly as
the vendor's does, so one flow serves one stream at a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cadence_fx.models.vendor import VendorDiT, VendorFlow, token2wav_vendor
from cadence_fx.passes.carry import stock_trim

__all__ = [
    "FULL_DEPTH",
    "REDUCED_DEPTH",
    "TINY_DEPTH",
    "ChunkOut",
    "FlowDepth",
    "REDUCED_HIFT_CHANNELS",
    "Prompt",
    "StockStream",
    "Vocoder",
    "build_flow",
    "build_hift",
    "random_chunks",
    "random_prompt",
    "redraw_zero_parameters",
]

SILENCE_TOKEN = 4218
VOCAB_SIZE = 6561
PROMPT_TOKENS = 151
CHUNK_TOKENS = 28
N_TIMESTEPS = 10

#: HiFT as the stream calls it: (mel, cached source) -> (speech, source). The vendor's
#: HiFTGenerator, its exact-shape replay, or a wrapper that seeds its RNG around the call.
Vocoder = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class FlowDepth:
    encoder_blocks: int = 6
    up_blocks: int = 4
    dit_blocks: int = 16


FULL_DEPTH = FlowDepth()
REDUCED_DEPTH = FlowDepth(encoder_blocks=1, up_blocks=1, dit_blocks=2)
#: The demo's: one DiT block, so that the demo's work (four CFM-loop exports) stays under a minute on a CPU.
TINY_DEPTH = FlowDepth(encoder_blocks=1, up_blocks=1, dit_blocks=1)
#: HiFT narrowed for CPU tests (`build_hift(base_channels=...)`): every conv eight times narrower.
REDUCED_HIFT_CHANNELS = 64


def redraw_zero_parameters(module: torch.nn.Module, generator: torch.Generator) -> list[str]:
    """Re-draw every all-zero parameter (DiT zeroes adaLN, the final layer and all Linear biases).

    Matrices get Xavier-uniform, vectors N(0, 0.02); returns the names re-drawn.
    """
    redrawn = []
    with torch.no_grad():
        for name, param in module.named_parameters():
            if param.count_nonzero() == 0:
                if param.dim() >= 2:
                    torch.nn.init.xavier_uniform_(param, generator=generator)
                else:
                    param.normal_(0.0, 0.02, generator=generator)
                redrawn.append(name)
    return redrawn


def build_flow(
    depth: FlowDepth = FULL_DEPTH,
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> VendorFlow:
    """CausalMaskedDiffWithXvec at the MiniCPM-o 4.5 flow.yaml config, random weights, eval mode.

    Built on the CPU under ``seed`` (which also fixes ``CFM.rand_noise``, drawn at construction),
    then moved, as Token2wav.__init__ does; the caller's RNG state is left untouched.
    """
    vendor = token2wav_vendor()
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed)
        encoder = vendor.encoder(
            input_size=512,
            output_size=512,
            input_layer="linear",
            pre_lookahead_len=3,
            num_blocks=depth.encoder_blocks,
            num_up_blocks=depth.up_blocks,
            up_stride=2,
            up_scale_factor=2,
            attention_heads=8,
            pos_enc_layer_type="rel_pos_espnet",
            selfattention_layer_type="rel_selfattn",
            key_bias=True,
            linear_units=2048,
            dropout_rate=0.1,
            positional_dropout_rate=0.1,
            attention_dropout_rate=0.1,
            normalize_before=True,
        )
        estimator = vendor.estimator(
            in_channels=320,
            out_channels=80,
            mlp_ratio=4.0,
            depth=depth.dit_blocks,
            num_heads=8,
            head_dim=64,
            hidden_size=512,
        )
        decoder = vendor.cfm(estimator=estimator, inference_cfg_rate=0.7)
        flow = vendor.flow(
            input_size=512,
            output_size=80,
            spk_embed_dim=192,
            output_type="mel",
            vocab_size=VOCAB_SIZE,
            encoder=encoder,
            decoder=decoder,
        )
    redraw_zero_parameters(flow, torch.Generator().manual_seed(seed))
    if dtype != torch.float32:
        flow.to(dtype)
    return flow.to(device).eval()


def build_hift(*, seed: int = 0, device: str | torch.device = "cpu", base_channels: int = 512) -> torch.nn.Module:
    """HiFTGenerator() of minicpmo-utils 1.0.6 at its defaults, which is what Token2wav builds.

    `base_channels` below 512 (`REDUCED_HIFT_CHANNELS`) narrows every conv for CPU tests; the
    upsampling (480 samples a mel frame) and the sine source stay the vendor's.

    24 kHz, 80 mels, base 512, upsample [8, 5, 3] x istft hop 4 (480 samples per mel frame),
    n_fft 16, 8 harmonics (SourceModuleHnNSF2/SineGen2). Weight norm is
    ``torch.nn.utils.parametrizations.weight_norm`` (parametrizations.weight.original0 = g,
    original1 = v, recomputed on every call) on conv_pre, ups, conv_post, every ResBlock conv and
    the F0 predictor's 5 convs; source_downs, m_source.l_linear and the F0 classifier are plain.
    """
    vendor = token2wav_vendor()
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed)
        hift = vendor.hift() if base_channels == 512 else vendor.hift(base_channels=base_channels)
    redraw_zero_parameters(hift, torch.Generator().manual_seed(seed))
    return hift.to(device).eval()


@dataclass(frozen=True)
class Prompt:
    """What Token2wav._prepare_prompt returns, minus the lengths."""

    tokens: torch.Tensor  # (1, 151) int32 speech tokens
    mels: torch.Tensor  # (1, 302, 80) prompt mel, time-major
    spk: torch.Tensor  # (1, 192) speaker embedding

    def to(self, device: str | torch.device) -> Prompt:
        return Prompt(self.tokens.to(device), self.mels.to(device), self.spk.to(device))


def random_prompt(
    seed: int = 0,
    *,
    n_tokens: int = PROMPT_TOKENS,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Prompt:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB_SIZE, (1, n_tokens), generator=generator, dtype=torch.int32)
    mels = torch.randn(1, 2 * n_tokens, 80, generator=generator)
    spk = torch.randn(1, 192, generator=generator)
    return Prompt(tokens.to(device), mels.to(device, dtype), spk.to(device, dtype))


def random_chunks(
    seed: int, n_chunks: int, *, chunk_tokens: int = CHUNK_TOKENS, device: str | torch.device = "cpu"
) -> list[torch.Tensor]:
    """``n_chunks`` token chunks of shape (1, chunk_tokens), int32 as Token2wav.stream builds them."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB_SIZE, (n_chunks, 1, chunk_tokens), generator=generator, dtype=torch.int32)
    return [chunk.to(device) for chunk in tokens]


@dataclass(frozen=True)
class ChunkOut:
    mel: torch.Tensor  # (1, 80, 50) flow output, (1, 80, 56) on the last chunk
    speech: torch.Tensor  # (1, 24000) emitted samples; the last chunk also flushes its tail


class StockStream:
    """The vendor's streaming Token2Wav for one prompt.

    Mirrors ``stepaudio2/token2wav.py`` (minicpmo-utils 1.0.6): :meth:`setup` is
    ``Token2wav.set_stream_cache``, :meth:`step` is ``Token2wav.stream(..., return_waveform=True)``
    with its cache trim split out as :meth:`retain`, the one step a retention pass replaces.
    Without a vocoder (``hift=None``) it streams the flow alone (:meth:`flow_chunk`).
    """

    mel_cache_len = 8
    source_cache_len = 8 * 480
    retained_frames = 100

    def __init__(
        self,
        flow: VendorFlow,
        hift: Vocoder | None,
        prompt: Prompt,
        *,
        n_timesteps: int = N_TIMESTEPS,
        float16: bool = False,
    ) -> None:
        self.flow = flow
        self.hift = hift
        self.prompt = prompt
        self.n_timesteps = n_timesteps
        self.float16 = float16
        self.device = prompt.mels.device
        # float64 like the vendor's np.hamming window: fade_in_out blends in float64.
        self.speech_window = torch.from_numpy(np.hamming(2 * self.source_cache_len)).to(self.device)
        self.fade_in_out = token2wav_vendor().fade_in_out
        self.stream_cache: dict[str, torch.Tensor] | None = None
        self.hift_cache_dict: dict[str, torch.Tensor] = {}

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        # Token2wav.stream wraps the flow in autocast("cuda", fp16 or fp32), which leaves CPU ops alone.
        if not torch.cuda.is_available():
            return contextlib.nullcontext()
        return torch.amp.autocast("cuda", dtype=torch.float16 if self.float16 else torch.float32)

    def setup(self) -> None:
        """Token2wav.set_stream_cache: prompt tokens + 3 silence tokens through the flow, no cache."""
        tokens, mels, spk = self.prompt.tokens, self.prompt.mels, self.prompt.spk
        right_pad_speech_tokens = torch.ones(1, 3, device=tokens.device, dtype=tokens.dtype) * SILENCE_TOKEN
        self.stream_cache = self.setup_cache(torch.cat([tokens, right_pad_speech_tokens], dim=1), mels, spk)
        self.reset_vocoder()

    def setup_cache(self, tokens: torch.Tensor, mels: torch.Tensor, spk: torch.Tensor) -> dict[str, torch.Tensor]:
        # Token2wav.set_stream_cache runs the flow with no autocast, which fails in its own float16
        # configuration (the halved speaker projection meets the float32 speaker embedding: "mat1 and
        # mat2 must have the same dtype", seen on an H100). In float16 the setup runs under the
        # stream's autocast, as BatchedStreams runs it; in float32 as the vendor runs it.
        with self._autocast() if self.float16 else contextlib.nullcontext():
            return self.flow.setup_cache(tokens, mels, spk, n_timesteps=self.n_timesteps)

    def reset_turn(self) -> None:
        """A turn boundary: the caches return to the prompt state, as a fresh setup computes it."""
        self.setup()

    def reset_vocoder(self) -> None:
        mels = self.prompt.mels
        self.hift_cache_dict = dict(
            mel=torch.zeros(1, mels.shape[2], 0, device=self.device),
            source=torch.zeros(1, 1, 0, device=self.device),
            speech=torch.zeros(1, 0, device=self.device),
        )

    def retain(self, cache: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The caller-side trim of token2wav.py:192-204: keep [:P] and [-100:] along time."""
        prompt_len = self.prompt.mels.shape[1]
        for key, axis in (("estimator_att_cache", 4), ("conformer_att_cache", 3)):
            if cache[key].shape[axis] > (prompt_len + self.retained_frames):
                cache[key] = stock_trim(cache[key], axis, prompt_len, self.retained_frames)
        return cache

    def flow_chunk(self, tokens: torch.Tensor, last_chunk: bool = False) -> torch.Tensor:
        """The flow half of Token2wav.stream: one chunk of (1, 28) tokens to mel, cache retained."""
        if self.stream_cache is None:
            raise ValueError("stream_cache is not set: call setup() first")
        with self._autocast():
            chunk_mel, self.stream_cache = self.flow.inference_chunk(
                token=tokens,
                spk=self.prompt.spk,
                cache=self.stream_cache,
                last_chunk=last_chunk,
                n_timesteps=self.n_timesteps,
            )
        self.stream_cache = self.retain(self.stream_cache)
        return chunk_mel

    def step(self, tokens: torch.Tensor, last_chunk: bool = False) -> ChunkOut:
        """Token2wav.stream for one chunk of (1, 28) tokens."""
        if self.hift is None:
            raise ValueError("this stream has no vocoder (hift=None): flow_chunk() streams the flow alone, step() needs HiFT")
        chunk_mel = self.flow_chunk(tokens, last_chunk)

        hift_cache_mel = self.hift_cache_dict["mel"]
        hift_cache_source = self.hift_cache_dict["source"]
        hift_cache_speech = self.hift_cache_dict["speech"]
        mel = torch.concat([hift_cache_mel, chunk_mel], dim=2)

        speech, source = self.hift(mel, hift_cache_source)

        if hift_cache_speech.shape[-1] > 0:
            speech = self.fade_in_out(speech, hift_cache_speech, self.speech_window)

        is_first_chunk = hift_cache_speech.shape[-1] == 0

        self.hift_cache_dict = dict(
            mel=mel[..., -self.mel_cache_len :].clone().detach(),
            source=source[:, :, -self.source_cache_len :].clone().detach(),
            speech=speech[:, -self.source_cache_len :].clone().detach(),
        )

        if not last_chunk:
            if is_first_chunk:
                silence_padding = torch.zeros(1, self.source_cache_len, device=speech.device)
                speech = torch.cat([silence_padding, speech[:, : -self.source_cache_len]], dim=1)
            else:
                speech = speech[:, : -self.source_cache_len]
        return ChunkOut(mel=chunk_mel, speech=speech)

    def run(self, chunks: Sequence[torch.Tensor], *, rng_seed: int = 0, last_chunk: bool = True) -> list[ChunkOut]:
        """:meth:`setup`, then :meth:`step` per chunk; the final one is the last chunk if ``last_chunk``.

        HiFT draws from the default generator on every call, so the CPU generator (and the
        stream device's, on CUDA) is seeded with ``rng_seed`` first and restored afterwards.
        """
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.random.default_generator.manual_seed(rng_seed)
            if devices:
                index = self.device.index if self.device.index is not None else torch.cuda.current_device()
                torch.cuda.default_generators[index].manual_seed(rng_seed)
            self.setup()
            final = len(chunks) - 1 if last_chunk else -1
            return [self.step(chunk, last_chunk=i == final) for i, chunk in enumerate(chunks)]


def rebucket_vendor_graphs(estimator: VendorDiT, buckets: dict[int, int]) -> None:
    """The vendor's own CUDA-graph branch of the DiT, with its chunk buckets re-chosen.

    ``DiT._init_cuda_graph_chunk`` (decoder_dit.py:433) captures one graph per chunk size in
    [30, 48, 96], for caches padded to 500 or 1000 frames, so live chunks (50, 56) never take it.
    This does the same for ``buckets`` {chunk size: largest cached length}: static inputs and
    outputs as the vendor allocates them, one eager call, then the capture of
    ``blocks_forward_chunk``; ``forward_chunk`` then pads the mask and the cache to the bucket and
    replays (the masked SDPA branch, where eager passes no mask).
    """
    if not torch.cuda.is_available() or estimator.cnn_cache_buffer.device.type != "cuda":
        raise RuntimeError("the vendor's CUDA-graph branch needs the estimator on a CUDA device")
    depth = len(estimator.blocks)
    dtype, device = estimator.cnn_cache_buffer.dtype, estimator.cnn_cache_buffer.device
    heads, head_dim = estimator.att_cache_buffer.shape[2], estimator.att_cache_buffer.shape[4]
    channels = estimator.cnn_cache_buffer.shape[2]
    with torch.no_grad():
        for chunk_size, max_size in buckets.items():
            estimator.max_size_chunk[chunk_size] = max_size
            static_inputs = [
                torch.zeros((2, 320, chunk_size), dtype=dtype, device=device),
                torch.zeros((2, 1, 512), dtype=dtype, device=device),
                torch.ones((2, chunk_size, max_size + chunk_size), dtype=torch.bool, device=device),
                torch.zeros((depth, 2, channels, 2), dtype=dtype, device=device),
                torch.zeros((depth, 2, heads, max_size, head_dim), dtype=dtype, device=device),
            ]
            new_cnn = torch.zeros((depth, 2, channels, 2), dtype=dtype, device=device)
            new_att = torch.zeros((depth, 2, heads, max_size + chunk_size, head_dim), dtype=dtype, device=device)
            estimator.blocks_forward_chunk(*static_inputs, new_cnn, new_att)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = estimator.blocks_forward_chunk(*static_inputs, new_cnn, new_att)
            estimator.inference_buffers_chunk[chunk_size] = {
                "static_inputs": static_inputs,
                "static_outputs": [out, new_cnn, new_att],
            }
            estimator.graph_chunk[chunk_size] = graph
    estimator.use_cuda_graph = True
