"""Freeze-Omni's chunk-wise streaming speech encoder, in this repository, at its real size.

Freeze-Omni (VITA-MLLM) ships no package, so this module re-implements the encoder from the
public source, under upstream's parameter names; `build_encoder` gives it random weights from a
seed, `freeze_omni_checkpoint.load_encoder` the published ones.
What it follows, file by file (VITA-MLLM/Freeze-Omni and its forks, `models/encoder/`):

- `encoder.py::speechEncoder`: global CMVN, then `enc = [Subsampling, Transformer]`; `infer`
  threads `(xs, buffer, buffer_index, buffer_out, pe_index)` through both components.
- `subsampling.py::Conv2dSubsampling4`: two `Conv2d(k=3, s=2)` + ReLU, then
  `Linear(odim * (((idim - 1) // 2 - 1) // 2), odim)`; its `infer` keeps no state, because the
  caller feeds 16 new fbank frames plus 3 overlapping ones (`bin/inference.py::
  audioEncoderProcessor`: `chunk_size = 16`, `chunk_overlap = 3`, 80 mel bins, 25 ms / 10 ms), so
  each chunk of 19 frames becomes exactly 4 encoder frames.
- `transformer.py::Transformer.infer`: `embed` (Linear, LayerNorm, Dropout, ReLU); `pe_length` is
  the first layer's retained keys plus the new frames; `RelPositionalEncoding.infer` scales by
  sqrt(d), builds sin/cos rows for `arange(max(0, pe_index - full_chunk_size), ... + pe_length)`
  and advances `pe_index` by `chunk_size`; every `TransformerLayer.infer` is attention then
  feed-forward, each LayerNorm before its block (`normalize_before`, with `after_norm` at the end)
  or after its residual sum; `concat_after` routes the attention through `concat_linear`.
- `attention.py::MultiHeadedAttention.infer`: `key_buffer = cat([kv_buffer[0], k], dim=2)` (the
  new keys alone on the first chunk), attend over the whole `key_buffer`, keep only its last
  `chunk_size * left_chunks` frames once longer. Relative-position scores are
  `(q + pos_bias_u) k^T + (q + pos_bias_v) p^T` without `rel_shift`, over sqrt(d_k).
- `attention.py::PositionwiseFeedForward.infer`: `w_2(relu(w_1(x)))`, no retention (the
  `transformer-positionwise-layer-type: linear` of the released encoder).
- `attention.py::Conv1dLinear.infer` (`conv1d-linear`): depthwise `Conv1d(k)` + pointwise `Conv1d`
  + ReLU + `Linear`; `x = cat([cnn_buffer, x], dim=2)` and the last `lorder = k - 1` frames
  become the next `cnn_buffer`.

Where this module departs from that source, and why:

- With the linear feed-forward the buffer list is upstream's own, `[kv_0, kv_1, ...]`. With the
  conv feed-forward one flat Python list holds both retentions, `[kv_0, cnn_0, kv_1, cnn_1, ...]`,
  threaded by `buffer_index`: upstream keeps K/V in a per-layer list but reads the conv buffer as a
  slice of a flat tensor (`buffer[buffer_index : buffer_index + buffer_size]`) and writes it to
  `buffer_out`, so its conv feed-forward cannot run beside its own list-based K/V cache. The list
  keeps both retentions as plain `cat` + slice, each in its own slot.
- `pe_index` is a 0-dim int64 tensor rather than a Python int, so one exported step serves every
  call instead of baking the offset in as a constant. The positions it yields are the same
  integers upstream computes with a float `arange`.
- `infer` copies the list instead of mutating the caller's, so one step is a pure function of
  `(chunk, buffer, pe_index)`.

Dimensions: 80 mel bins, width 1024, 16 heads, 4096 feed-forward units, 24 blocks, relative
positions, 4x subsampling, chunk_size 4 encoder frames: the published `audiollm/train.yaml` (as
a public mirror of the release holds it; `FreezeOmniEncoderConfig.released()`), which also lists
`positionwise-layer-type: linear`, `left_chunks: 16`, `normalize-before: true` and
`concat-after: false`. The default configuration
keeps this project's earlier operator choice, the conv feed-forward with one
left chunk: the attended extent is then 4 frames on the first call and 8 afterwards, two shape
classes; with L left chunks it grows by 4 frames a call up to 4 (L + 1), L + 1 classes.
`freeze_omni_checkpoint.py` loads a released checkpoint into this module.

`forward` is upstream's non-streaming `forward`: the whole utterance at once under a static chunk
mask. It is a different computation from `infer` (subsampling is aligned differently because of
the 3-frame overlap, and positions do not advance the same way), so it is a reference for shapes
and masking, not for bit equality with the stream.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import cast

import torch
from torch import nn

__all__ = [
    "FreezeOmniEncoderConfig",
    "FreezeOmniEncoder",
    "InferStep",
    "build_encoder",
    "stream_utterance",
]


#: The vendor's feed-forward types (`transformer-positionwise-layer-type`) this encoder builds:
#: the plain linear one (the released encoder's) and the conv one, which keeps a left context.
FEED_FORWARDS = ("linear", "conv1d-linear")


@dataclass(frozen=True)
class FreezeOmniEncoderConfig:
    """Shape and options of the encoder, named after the vendor's `train.yaml` entries.

    The defaults are the real size with this project's operator choice (conv feed-forward, one
    left chunk); `released()` is the configuration of the published checkpoint; `small()` is for
    CPU tests. Options that have no streaming path (the vendor's `conv1d` feed-forward, absolute
    positions, no left chunk) are refused here, with the reason.
    """

    input_dim: int = 80
    attention_dim: int = 1024
    attention_heads: int = 16
    linear_units: int = 4096
    num_blocks: int = 24
    feed_forward: str = "conv1d-linear"
    conv_kernel_size: int = 3
    left_chunks: int = 1
    normalize_before: bool = True
    concat_after: bool = False
    pos_enc: str = "rel-enc"
    chunk_frames: int = 16
    chunk_overlap: int = 3
    pe_max_len: int = 5000
    seed: int = 0

    def __post_init__(self) -> None:
        if self.feed_forward not in FEED_FORWARDS:
            raise ValueError(
                f"feed_forward {self.feed_forward!r}: expected one of {FEED_FORWARDS} (the vendor's "
                "'conv1d', MultiLayeredConv1d, has no streaming infer)"
            )
        if self.pos_enc != "rel-enc":
            raise ValueError(
                f"pos_enc {self.pos_enc!r}: only 'rel-enc' streams (the vendor's Transformer.infer calls "
                "pe.infer, which only its RelPositionalEncoding has)"
            )
        if self.left_chunks < 1:
            raise ValueError(f"left_chunks {self.left_chunks}: a streaming encoder attends to at least one left chunk")
        if self.conv_feed_forward and self.conv_kernel_size < 2:
            raise ValueError(
                f"conv_kernel_size {self.conv_kernel_size}: the conv feed-forward needs a kernel of 2 or more "
                "(a left context of kernel - 1 frames)"
            )
        if self.attention_dim % self.attention_heads:
            raise ValueError(f"attention_dim {self.attention_dim} is not a multiple of attention_heads {self.attention_heads}")

    @classmethod
    def small(cls, **overrides) -> FreezeOmniEncoderConfig:
        return replace(cls(attention_dim=64, attention_heads=4, linear_units=128, num_blocks=2), **overrides)

    @classmethod
    def released(cls, **overrides) -> FreezeOmniEncoderConfig:
        """The published encoder's options (`audiollm/train.yaml`): linear feed-forward, 16 left chunks."""
        return replace(cls(feed_forward="linear", left_chunks=16), **overrides)

    @property
    def chunk_size(self) -> int:
        """Encoder frames per chunk: what two stride-2, kernel-3 convolutions leave of 16 + 3."""
        frames = self.chunk_frames + self.chunk_overlap
        return ((frames - 1) // 2 - 1) // 2

    @property
    def conv_feed_forward(self) -> bool:
        """Whether each layer's feed-forward keeps a conv left context (a second buffer-list slot)."""
        return self.feed_forward == "conv1d-linear"

    @property
    def lorder(self) -> int:
        """Frames of conv left context each layer keeps (the conv feed-forward only)."""
        return self.conv_kernel_size - 1

    @property
    def kv_frames(self) -> int:
        """Keys and values each attention layer keeps between calls."""
        return self.chunk_size * self.left_chunks


class GlobalCMVN(nn.Module):
    mean: torch.Tensor  # buffers, declared for the checker
    istd: torch.Tensor

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("istd", torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) * self.istd


class Conv2dSubsampling4(nn.Module):
    def __init__(self, idim: int, odim: int) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, odim, 3, 2), nn.ReLU(), nn.Conv2d(odim, odim, 3, 2), nn.ReLU())
        self.out = nn.Sequential(nn.Linear(odim * (((idim - 1) // 2 - 1) // 2), odim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x.unsqueeze(1))
        b, c, t, f = x.size()
        return self.out(x.transpose(1, 2).contiguous().view(b, t, c * f))


class Subsampling(nn.Module):
    def __init__(self, idim: int, odim: int) -> None:
        super().__init__()
        self.core = Conv2dSubsampling4(idim, odim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.core(x)


class RelPositionalEncoding(nn.Module):
    div_term: torch.Tensor  # buffers, declared for the checker
    pe: torch.Tensor

    def __init__(self, d_model: int, chunk_size: int, left_chunks: int, max_len: int) -> None:
        super().__init__()
        self.d_model = d_model
        self.xscale = math.sqrt(d_model)
        self.chunk_size = chunk_size
        self.full_chunk_size = (left_chunks + 1) * chunk_size
        div_term = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * -(math.log(10000.0) / d_model))
        position = torch.arange(0, max_len, dtype=torch.float32).unsqueeze(1)
        pe = torch.zeros(max_len, d_model)
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("div_term", div_term, persistent=False)
        self.register_buffer("pe", pe.unsqueeze(0), persistent=False)
        self.max_len = chunk_size * (max_len // chunk_size) - self.full_chunk_size

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * self.xscale, self.pe[:, : x.size(1)]

    def infer(self, xs: torch.Tensor, pe_index: torch.Tensor, pe_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pe_index = pe_index % self.max_len
        xs = xs * self.xscale
        start = torch.clamp(pe_index - self.full_chunk_size, min=0)
        position = (start + torch.arange(pe_length, device=xs.device)).to(torch.float32)
        position = position.unsqueeze(1)
        pe = torch.zeros(pe_length, self.d_model, device=xs.device)
        pe[:, 0::2] = torch.sin(position * self.div_term)
        pe[:, 1::2] = torch.cos(position * self.div_term)
        return xs, pe.unsqueeze(0), pe_index + self.chunk_size


class PositionwiseFeedForward(nn.Module):
    """Linear feed-forward (the released encoder's): it retains nothing, so it has no buffer-list slot."""

    def __init__(self, idim: int, hidden_units: int) -> None:
        super().__init__()
        self.w_1 = nn.Linear(idim, hidden_units)
        self.w_2 = nn.Linear(hidden_units, idim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(torch.relu(self.w_1(x)))

    def infer(self, x: torch.Tensor, buffer: list, buffer_index: int) -> tuple[torch.Tensor, list, int]:
        return self.forward(x), buffer, buffer_index


class Conv1dLinear(nn.Module):
    """Conv feed-forward: its retention is the last `lorder` input frames (`cnn_buffer`)."""

    def __init__(self, in_chans: int, hidden_chans: int, kernel_size: int) -> None:
        super().__init__()
        self.lorder = kernel_size - 1
        self.w_1 = nn.Sequential(
            nn.Conv1d(in_chans, in_chans, kernel_size, stride=1, padding=0, groups=in_chans),
            nn.Conv1d(in_chans, hidden_chans, 1, padding=0),
        )
        self.w_2 = nn.Linear(hidden_chans, in_chans)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.pad(x.transpose(-1, 1), (self.lorder, 0))
        return self.w_2(torch.relu(self.w_1(x)).transpose(-1, 1))

    def infer(self, x: torch.Tensor, buffer: list, buffer_index: int) -> tuple[torch.Tensor, list, int]:
        x = x.transpose(-1, 1)
        cnn_buffer = buffer[buffer_index]
        x = torch.cat([cnn_buffer, x], dim=2)
        buffer[buffer_index] = x[:, :, -self.lorder :]
        x = self.w_1(x)
        x = torch.relu(x).transpose(-1, 1)
        return self.w_2(x), buffer, buffer_index + 1


class MultiHeadedAttention(nn.Module):
    """Chunk attention with relative positions: its retention is the last keys and values."""

    def __init__(self, n_head: int, n_feat: int, chunk_size: int, left_chunks: int) -> None:
        super().__init__()
        self.d_k = n_feat // n_head
        self.h = n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.linear_pos = nn.Linear(n_feat, n_feat, bias=False)
        self.pos_bias_u = nn.Parameter(torch.empty(n_head, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.empty(n_head, self.d_k))
        nn.init.xavier_uniform_(self.pos_bias_u)
        nn.init.xavier_uniform_(self.pos_bias_v)
        self.buffersize = chunk_size * left_chunks
        self.min_value = float(torch.finfo(torch.float16).min)

    def _scores(self, q: torch.Tensor, k: torch.Tensor, pos_emb: torch.Tensor) -> torch.Tensor:
        q = q.transpose(1, 2)
        p = self.linear_pos(pos_emb).view(pos_emb.size(0), -1, self.h, self.d_k).transpose(1, 2)
        q_with_bias_u = (q + self.pos_bias_u).transpose(1, 2)
        q_with_bias_v = (q + self.pos_bias_v).transpose(1, 2)
        matrix_ac = torch.matmul(q_with_bias_u, k.transpose(-2, -1))
        matrix_bd = torch.matmul(q_with_bias_v, p.transpose(-2, -1))
        return (matrix_ac + matrix_bd) / math.sqrt(self.d_k)

    def _heads(self, linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return linear(x).view(x.size(0), -1, self.h, self.d_k).transpose(1, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, pos_emb: torch.Tensor) -> torch.Tensor:
        n_batch = x.size(0)
        q, k, v = (self._heads(lin, x) for lin in (self.linear_q, self.linear_k, self.linear_v))
        scores = self._scores(q, k, pos_emb)
        masked = mask.unsqueeze(1).eq(0)
        scores = scores.masked_fill(masked, self.min_value)
        attn = torch.softmax(scores, dim=-1).masked_fill(masked, 0.0)
        x = torch.matmul(attn, v).transpose(1, 2).contiguous().view(n_batch, -1, self.h * self.d_k)
        return self.linear_out(x)

    def infer(self, x: torch.Tensor, pos_emb: torch.Tensor, buffer: list, buffer_index: int) -> tuple[torch.Tensor, list, int]:
        n_batch = x.size(0)
        q, k, v = (self._heads(lin, x) for lin in (self.linear_q, self.linear_k, self.linear_v))
        kv_buffer = buffer[buffer_index]
        if kv_buffer is None:
            key_buffer = k
            value_buffer = v
        else:
            key_buffer = torch.cat([kv_buffer[0], k], dim=2)
            value_buffer = torch.cat([kv_buffer[1], v], dim=2)
        if key_buffer.size(2) > self.buffersize:
            buffer[buffer_index] = [
                key_buffer[:, :, -self.buffersize :, :],
                value_buffer[:, :, -self.buffersize :, :],
            ]
        else:
            buffer[buffer_index] = [key_buffer, value_buffer]
        scores = self._scores(q, key_buffer, pos_emb)
        attn = torch.softmax(scores, dim=-1)
        x = torch.matmul(attn, value_buffer).transpose(1, 2).reshape(n_batch, -1, self.h * self.d_k)
        return self.linear_out(x), buffer, buffer_index + 1


class TransformerLayer(nn.Module):
    """Attention then feed-forward, each in a residual; `normalize_before` puts each LayerNorm
    before its block (else after the residual sum), `concat_after` feeds the attention's input and
    output through `concat_linear` instead of adding the output alone (upstream's options)."""

    def __init__(
        self,
        size: int,
        self_attn: MultiHeadedAttention,
        feed_forward: PositionwiseFeedForward | Conv1dLinear,
        normalize_before: bool,
        concat_after: bool,
    ) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.norm1 = nn.LayerNorm(size)
        self.norm2 = nn.LayerNorm(size)
        self.normalize_before = normalize_before
        self.concat_after = concat_after
        if concat_after:
            self.concat_linear = nn.Linear(size + size, size)

    def _attention_residual(self, x: torch.Tensor, x_att: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.concat_after:
            x = residual + self.concat_linear(torch.cat((x, x_att), dim=-1))
        else:
            x = residual + x_att
        return x if self.normalize_before else self.norm1(x)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, pos_emb: torch.Tensor) -> torch.Tensor:
        residual = x
        if self.normalize_before:
            x = self.norm1(x)
        x = self._attention_residual(x, self.self_attn(x, mask, pos_emb), residual)
        residual = x
        if self.normalize_before:
            x = self.norm2(x)
        x = residual + self.feed_forward(x)
        return x if self.normalize_before else self.norm2(x)

    def infer(self, x: torch.Tensor, pos_emb: torch.Tensor, buffer: list, buffer_index: int) -> tuple[torch.Tensor, list, int]:
        residual = x
        if self.normalize_before:
            x = self.norm1(x)
        x_att, buffer, buffer_index = self.self_attn.infer(x, pos_emb, buffer, buffer_index)
        x = self._attention_residual(x, x_att, residual)
        residual = x
        if self.normalize_before:
            x = self.norm2(x)
        x_feed, buffer, buffer_index = self.feed_forward.infer(x, buffer, buffer_index)
        x = residual + x_feed
        return (x if self.normalize_before else self.norm2(x)), buffer, buffer_index


def subsequent_chunk_mask(size: int, chunk_size: int, left_chunks: int) -> torch.Tensor:
    """Frame i sees its own chunk and `left_chunks` chunks before it (upstream `masks.py`)."""
    chunk = torch.arange(size) // chunk_size
    start = torch.clamp((chunk - left_chunks) * chunk_size, min=0)
    end = torch.clamp((chunk + 1) * chunk_size, max=size)
    j = torch.arange(size)
    return (j[None, :] >= start[:, None]) & (j[None, :] < end[:, None])


class Transformer(nn.Module):
    def __init__(self, config: FreezeOmniEncoderConfig) -> None:
        super().__init__()
        d = config.attention_dim
        self.chunk_size = config.chunk_size
        self.left_chunks = config.left_chunks
        self.num_blocks = config.num_blocks
        self.normalize_before = config.normalize_before
        self.embed = nn.Sequential(nn.Linear(d, d), nn.LayerNorm(d), nn.Dropout(0.1), nn.ReLU())
        self.pe = RelPositionalEncoding(d, config.chunk_size, config.left_chunks, config.pe_max_len)
        self.encoders = nn.ModuleList(
            TransformerLayer(
                d,
                MultiHeadedAttention(config.attention_heads, d, config.chunk_size, config.left_chunks),
                Conv1dLinear(d, config.linear_units, config.conv_kernel_size)
                if config.conv_feed_forward
                else PositionwiseFeedForward(d, config.linear_units),
                config.normalize_before,
                config.concat_after,
            )
            for _ in range(config.num_blocks)
        )
        if config.normalize_before:
            self.after_norm = nn.LayerNorm(d)

    def forward(self, xs: torch.Tensor) -> torch.Tensor:
        mask = subsequent_chunk_mask(xs.size(1), self.chunk_size, self.left_chunks)
        mask = mask.to(xs.device).unsqueeze(0)
        xs, pos_emb = self.pe(self.embed(xs))
        for layer in self.encoders:
            xs = layer(xs, mask, pos_emb)
        return self.after_norm(xs) if self.normalize_before else xs

    def infer(self, xs: torch.Tensor, buffer: list, pe_index: torch.Tensor) -> tuple[torch.Tensor, list, torch.Tensor]:
        xs = self.embed(xs)
        if buffer[0] is None:
            pe_length = xs.size(1)
        else:
            pe_length = buffer[0][0].size(2) + xs.size(1)
        xs, pos_emb, pe_index = self.pe.infer(xs, pe_index, pe_length)
        buffer_index = 0
        for layer in self.encoders:
            # nn.ModuleList is not generic: its items are typed Module, these are TransformerLayers.
            xs, buffer, buffer_index = cast(TransformerLayer, layer).infer(xs, pos_emb, buffer, buffer_index)
        return (self.after_norm(xs) if self.normalize_before else xs), buffer, pe_index


class FreezeOmniEncoder(nn.Module):
    """CMVN, 4x conv2d subsampling, chunk-attention transformer (linear or conv feed-forward).

    Parameter names follow upstream (`global_cmvn`, `enc.0.core.*`, `enc.1.encoders.N.*`).
    """

    def __init__(self, config: FreezeOmniEncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.global_cmvn = GlobalCMVN(config.input_dim)
        self.enc = nn.ModuleList([Subsampling(config.input_dim, config.attention_dim), Transformer(config)])

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        """Whole utterance `(1, T, 80)` -> `(1, ((T - 1) // 2 - 1) // 2, D)`, non-streaming."""
        return self.enc[1](self.enc[0](self.global_cmvn(feats)))

    def init_buffers(self) -> list:
        """Retention before the first chunk: per layer, no keys yet (None), then, with the conv
        feed-forward, its zero left context. The linear feed-forward's list is upstream's own,
        `[None] * num_blocks`."""
        c = self.config
        param = self.global_cmvn.mean
        buffer: list = []
        for _ in range(c.num_blocks):
            buffer.append(None)
            if c.conv_feed_forward:
                buffer.append(torch.zeros(1, c.attention_dim, c.lorder, dtype=param.dtype, device=param.device))
        return buffer

    def init_pe_index(self) -> torch.Tensor:
        return torch.zeros((), dtype=torch.long, device=self.global_cmvn.mean.device)

    def infer(self, chunk: torch.Tensor, buffer: list, pe_index: torch.Tensor) -> tuple[torch.Tensor, list, torch.Tensor]:
        """One chunk `(1, 19, 80)` -> `(1, 4, D)`, the next buffer list and the next `pe_index`."""
        buffer = list(buffer)
        xs = self.enc[0](self.global_cmvn(chunk))
        return cast(Transformer, self.enc[1]).infer(xs, buffer, pe_index)  # nn.ModuleList items are typed Module


class InferStep(nn.Module):
    """`FreezeOmniEncoder.infer` as a module's forward, for `torch.export`."""

    def __init__(self, encoder: FreezeOmniEncoder) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, chunk: torch.Tensor, buffer: list, pe_index: torch.Tensor) -> tuple[torch.Tensor, list, torch.Tensor]:
        return self.encoder.infer(chunk, buffer, pe_index)


@torch.no_grad()
def build_encoder(config: FreezeOmniEncoderConfig | None = None) -> FreezeOmniEncoder:
    """Random weights from `config.seed`, eval mode; the global RNG is left as it was.

    Upstream init leaves LayerNorm biases and the CMVN statistics at zero or one; those are drawn
    too, so no parameter or buffer is constant.
    """
    config = config or FreezeOmniEncoderConfig()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        encoder = FreezeOmniEncoder(config)
        for name, param in encoder.named_parameters():
            if name.endswith("bias") and not torch.any(param):
                param.normal_(0.0, 0.02)
            elif torch.all(param == 1):
                param.normal_(1.0, 0.02)
        encoder.global_cmvn.mean.normal_(0.0, 1.0)
        encoder.global_cmvn.istd.uniform_(0.5, 1.5)
    return encoder.eval()


@torch.no_grad()
def stream_utterance(encoder: FreezeOmniEncoder, feats: torch.Tensor) -> list[torch.Tensor]:
    """Feed `(1, T, 80)` fbank frames chunk by chunk, as upstream's `audioEncoderProcessor` does.

    Each call sees the last 3 frames of the previous chunk (zeros before the first) and 16 new
    ones; a final partial chunk is zero-padded. Returns one `(1, chunk_size, D)` output per chunk.
    """
    c = encoder.config
    window = feats.new_zeros(1, c.chunk_frames + c.chunk_overlap, feats.size(2))
    buffer = encoder.init_buffers()
    pe_index = encoder.init_pe_index()
    outputs = []
    for new_frames in feats.split(c.chunk_frames, dim=1):
        pad = c.chunk_frames - new_frames.size(1)
        new_frames = nn.functional.pad(new_frames, (0, 0, 0, pad))
        window = torch.cat([window[:, -c.chunk_overlap :], new_frames], dim=1)
        ys, buffer, pe_index = encoder.infer(window, buffer, pe_index)
        outputs.append(ys)
    return outputs
