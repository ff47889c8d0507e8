"""The vendor's Freeze-Omni encoder streaming path, ported operation for operation, for tests.

VITA-MLLM/Freeze-Omni is not installable, so this module re-states what its code does on the
path that matters here, in the same order of tensor operations, under the same attribute names
(so the same state-dict keys), with none of this repository's code:

- `models/utils.py::init_encoder_llm` + `load_checkpoint`: the CMVN from the JSON `global_cmvn`
  (float64 via numpy, then float32), the encoder from `train.yaml`'s `encoder_conf` over the
  defaults of the vendor's argument parsers, then `torch.load(final.pt)` and
  `load_state_dict(strict=False)` on the audio LLM, whose encoder sits at `.encoder`;
- `models/encoder/{encoder,subsampling,transformer,attention,cmvn}.py`: the modules and their
  `infer` (the streaming path), with the options the released configuration uses or may use:
  linear feed-forward, relative positions, `normalize_before`, `concat_after`;
- `models/audioLLM.py::recognize` and `bin/inference.py::audioEncoderProcessor`: the buffer list
  starts as `[None] * num_blocks`, `pe_index` as the int 0, and each call gets the last 3 fbank
  frames of the previous window (zeros at first) followed by 16 new ones.

Dropout modules are kept (their parameters are none; they are identities in eval mode and the
streaming path never calls them); the non-streaming `forward` and the conv feed-forwards, which
the vendor's streaming path cannot run beside its list-based K/V cache, are left out.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import yaml
from torch import nn

_DEFAULTS = {
    "encoder_layer_config": "tdnn-dtc",
    "encoder_input_dim": 256,
    "encoder_output_dim": 256,
    "transformer_input_dim": 256,
    "transformer_output_dim": 4,
    "transformer_attention_dim": 256,
    "transformer_attention_heads": 4,
    "transformer_linear_units": 1024,
    "transformer_num_blocks": 6,
    "transformer_dropout_rate": 0.1,
    "transformer_attention_dropout_rate": 0.0,
    "transformer_positional_dropout_rate": 0.1,
    "transformer_input_layer": "linear",
    "transformer_pos_enc_class": "abs-enc",
    "transformer_normalize_before": True,
    "transformer_concat_after": False,
    "transformer_positionwise_layer_type": "linear",
    "transformer_positionwise_conv_kernel_size": 1,
    "transformer_chunk_size": -1,
    "transformer_left_chunks": -1,
    "transformer_dynamic_chunks": True,
    "subsampling_rate": 4,
    "subsampling_input_dim": 256,
    "subsampling_output_dim": 256,
    "subsampling_dropout_rate": 0.1,
}


def _assign(args: SimpleNamespace, entries: dict) -> None:
    for key, value in entries.items():
        name = key.replace("-", "_")
        if hasattr(args, name):
            setattr(args, name, value)


class GlobalCMVN(nn.Module):
    def __init__(self, mean: torch.Tensor, istd: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("mean", mean)
        self.register_buffer("istd", istd)

    def forward(self, x):
        x = x - self.mean
        return x * self.istd


def load_cmvn(path) -> tuple[np.ndarray, np.ndarray]:
    with open(path) as f:
        stats = json.load(f)
    means, variance, count = stats["mean_stat"], stats["var_stat"], stats["frame_num"]
    for i in range(len(means)):
        means[i] /= count
        variance[i] = variance[i] / count - means[i] * means[i]
        if variance[i] < 1.0e-20:
            variance[i] = 1.0e-20
        variance[i] = 1.0 / math.sqrt(variance[i])
    table = np.array([means, variance])
    return table[0], table[1]


class Conv2dSubsampling4(nn.Module):
    def __init__(self, idim: int, odim: int) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, odim, 3, 2), nn.ReLU(), nn.Conv2d(odim, odim, 3, 2), nn.ReLU())
        self.out = nn.Sequential(nn.Linear(odim * (((idim - 1) // 2 - 1) // 2), odim))

    def infer(self, x, buffer, buffer_index, buffer_out):
        x = self.conv(x.unsqueeze(1))
        b, c, t, f = x.size()
        x = self.out(x.transpose(1, 2).contiguous().view(b, t, c * f))
        return x, buffer, buffer_index, buffer_out


class Subsampling(nn.Module):
    def __init__(self, args) -> None:
        super().__init__()
        assert args.subsampling_rate == 4
        self.core = Conv2dSubsampling4(args.subsampling_input_dim, args.subsampling_output_dim)

    def infer(self, x, buffer, buffer_index, buffer_out, pe_index):
        x, buffer, buffer_index, buffer_out = self.core.infer(x, buffer, buffer_index, buffer_out)
        return x, buffer, buffer_index, buffer_out, pe_index


class RelPositionalEncoding(nn.Module):
    def __init__(self, d_model: int, dropout_rate: float, chunk_size: int, left_chunks: int, max_len: int = 5000):
        super().__init__()
        self.d_model = d_model
        self.xscale = math.sqrt(d_model)
        self.dropout = nn.Dropout(p=dropout_rate)
        self.chunk_size = chunk_size
        self.full_chunk_size = (left_chunks + 1) * chunk_size
        self.div_term = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * -(math.log(10000.0) / d_model))
        self.max_len = chunk_size * (max_len // chunk_size) - self.full_chunk_size

    def infer(self, xs, pe_index, pe_length):
        pe_index = pe_index % self.max_len
        xs = xs * self.xscale
        pe = torch.zeros(pe_length, self.d_model, device=xs.device)
        start = max(0, pe_index - self.full_chunk_size)
        position = torch.arange(start, start + pe_length, dtype=torch.float32, device=xs.device).unsqueeze(1)
        div_term = self.div_term.to(xs.device)
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        return xs, pe.unsqueeze(0), pe_index + self.chunk_size


class PositionwiseFeedForward(nn.Module):
    def __init__(self, idim: int, hidden_units: int, dropout_rate: float) -> None:
        super().__init__()
        self.w_1 = nn.Linear(idim, hidden_units)
        self.w_2 = nn.Linear(hidden_units, idim)
        self.dropout = nn.Dropout(dropout_rate)

    def infer(self, xs, buffer, buffer_index, buffer_out):
        return self.w_2(torch.relu(self.w_1(xs))), buffer, buffer_index, buffer_out


class MultiHeadedAttention(nn.Module):
    def __init__(self, n_head: int, n_feat: int, dropout_rate: float, chunk_size: int, left_chunks: int, pos_enc_class: str):
        super().__init__()
        assert pos_enc_class == "rel-enc" and chunk_size > 0 and left_chunks > 0
        self.d_k = n_feat // n_head
        self.h = n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.dropout = nn.Dropout(p=dropout_rate)
        self.buffersize = chunk_size * left_chunks
        self.linear_pos = nn.Linear(n_feat, n_feat, bias=False)
        self.pos_bias_u = nn.Parameter(torch.empty(self.h, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.empty(self.h, self.d_k))
        nn.init.xavier_uniform_(self.pos_bias_u)
        nn.init.xavier_uniform_(self.pos_bias_v)

    def infer(self, query, key, value, pos_emb, buffer, buffer_index, buffer_out):
        n_batch = query.size(0)
        q = self.linear_q(query).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        k = self.linear_k(key).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(value).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        kept = buffer[buffer_index]
        if kept is None:
            buffer[buffer_index] = [None, None]
            key_buffer, value_buffer = k, v
        else:
            key_buffer = torch.cat([kept[0], k], dim=2)
            value_buffer = torch.cat([kept[1], v], dim=2)
        if key_buffer.size(2) > self.buffersize:
            buffer[buffer_index][0] = key_buffer[:, :, -self.buffersize :, :]
            buffer[buffer_index][1] = value_buffer[:, :, -self.buffersize :, :]
        else:
            buffer[buffer_index] = [key_buffer, value_buffer]
        buffer_index += 1
        q = q.transpose(1, 2)
        p = self.linear_pos(pos_emb).view(pos_emb.size(0), -1, self.h, self.d_k).transpose(1, 2)
        q_with_bias_u = (q + self.pos_bias_u).transpose(1, 2)
        q_with_bias_v = (q + self.pos_bias_v).transpose(1, 2)
        matrix_ac = torch.matmul(q_with_bias_u, key_buffer.transpose(-2, -1))
        matrix_bd = torch.matmul(q_with_bias_v, p.transpose(-2, -1))
        scores = (matrix_ac + matrix_bd) / math.sqrt(self.d_k)
        attn = torch.softmax(scores, dim=-1)
        x = torch.matmul(attn, value_buffer).transpose(1, 2).reshape(n_batch, -1, self.h * self.d_k)
        return self.linear_out(x), buffer, buffer_index, buffer_out


class TransformerLayer(nn.Module):
    def __init__(self, size, self_attn, feed_forward, dropout_rate, normalize_before, concat_after):
        super().__init__()
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.norm1 = nn.LayerNorm(size)
        self.norm2 = nn.LayerNorm(size)
        self.dropout = nn.Dropout(dropout_rate)
        self.normalize_before = normalize_before
        self.concat_after = concat_after
        self.concat_linear = nn.Linear(size + size, size) if concat_after else nn.Identity()

    def infer(self, x, pos_emb, buffer, buffer_index, buffer_out):
        residual = x.clone()
        if self.normalize_before:
            x = self.norm1(x)
        x_att, buffer, buffer_index, buffer_out = self.self_attn.infer(x, x, x, pos_emb, buffer, buffer_index, buffer_out)
        if self.concat_after:
            x = residual + self.concat_linear(torch.cat((x, x_att), dim=-1))
        else:
            x = residual + x_att
        if not self.normalize_before:
            x = self.norm1(x)
        residual = x.clone()
        if self.normalize_before:
            x = self.norm2(x)
        x_feed, buffer, buffer_index, buffer_out = self.feed_forward.infer(x, buffer, buffer_index, buffer_out)
        x = residual + x_feed
        if not self.normalize_before:
            x = self.norm2(x)
        return x, pos_emb, buffer, buffer_index, buffer_out


class Transformer(nn.Module):
    def __init__(self, args) -> None:
        super().__init__()
        assert args.transformer_input_layer == "linear" and args.transformer_positionwise_layer_type == "linear"
        d = args.transformer_attention_dim
        self.num_blocks = args.transformer_num_blocks
        self.normalize_before = args.transformer_normalize_before
        self.embed = nn.Sequential(
            nn.Linear(args.transformer_input_dim, d), nn.LayerNorm(d), nn.Dropout(args.transformer_dropout_rate), nn.ReLU()
        )
        self.pe = RelPositionalEncoding(
            d, args.transformer_positional_dropout_rate, args.transformer_chunk_size, args.transformer_left_chunks
        )
        self.encoders = nn.Sequential(
            *[
                TransformerLayer(
                    d,
                    MultiHeadedAttention(
                        args.transformer_attention_heads,
                        d,
                        args.transformer_attention_dropout_rate,
                        args.transformer_chunk_size,
                        args.transformer_left_chunks,
                        args.transformer_pos_enc_class,
                    ),
                    PositionwiseFeedForward(d, args.transformer_linear_units, args.transformer_dropout_rate),
                    args.transformer_dropout_rate,
                    args.transformer_normalize_before,
                    args.transformer_concat_after,
                )
                for _ in range(self.num_blocks)
            ]
        )
        if self.normalize_before:
            self.after_norm = nn.LayerNorm(d)

    def infer(self, xs, buffer, buffer_index, buffer_out, pe_index):
        xs = self.embed(xs)
        pe_length = xs.size(1) if buffer[0] is None else buffer[0][0].size(2) + xs.size(1)
        xs, pos_emb, pe_index = self.pe.infer(xs, pe_index, pe_length)
        for layer in self.encoders:
            xs, pos_emb, buffer, buffer_index, buffer_out = layer.infer(xs, pos_emb, buffer, buffer_index, buffer_out)
        if self.normalize_before:
            xs = self.after_norm(xs)
        return xs, buffer, buffer_index, buffer_out, pe_index


class SpeechEncoder(nn.Module):
    def __init__(self, global_cmvn: GlobalCMVN, overview_conf: dict, para_conf: dict) -> None:
        super().__init__()
        args = SimpleNamespace(**_DEFAULTS)
        _assign(args, overview_conf)
        self.global_cmvn = global_cmvn
        self.enc = nn.ModuleList()
        for name in args.encoder_layer_config.split("-"):
            _assign(args, para_conf[name])
            self.enc.append({"subsampling": Subsampling, "transformer": Transformer}[name](args))

    def infer(self, xs, buffer, buffer_index, buffer_out, pe_index):
        xs = self.global_cmvn(xs)
        for module in self.enc:
            xs, buffer, buffer_index, buffer_out, pe_index = module.infer(xs, buffer, buffer_index, buffer_out, pe_index)
        return xs, buffer, buffer_index, buffer_out, pe_index


class AudioLLM(nn.Module):
    """The audio LLM as far as `final.pt`'s `encoder.` entries go."""

    def __init__(self, encoder: SpeechEncoder) -> None:
        super().__init__()
        self.encoder = encoder


def load_vendor_encoder(model_path: Path) -> SpeechEncoder:
    """`inferencePipeline.__init__` for the encoder: configs, CMVN file, then the loose checkpoint load."""
    configs = yaml.safe_load((model_path / "audiollm" / "train.yaml").read_text())
    mean, istd = load_cmvn(model_path / "audiollm" / "global_cmvn")
    cmvn = GlobalCMVN(torch.from_numpy(mean).float(), torch.from_numpy(istd).float())
    model = AudioLLM(SpeechEncoder(cmvn, **configs["encoder_conf"]))
    checkpoint = torch.load(model_path / "audiollm" / "final.pt", map_location="cpu")
    model.load_state_dict(checkpoint, strict=False)
    return model.encoder.eval()


@torch.no_grad()
def stream(encoder: SpeechEncoder, feats: torch.Tensor, chunk_size: int = 16, chunk_overlap: int = 3):
    """Per call: the encoder output, the buffer list it returns, and the next `pe_index`."""
    input_chunk = torch.zeros([1, chunk_size + chunk_overlap, feats.size(2)])
    buffer, pe_index, calls = None, 0, []
    for xs in feats.split(chunk_size, dim=1):
        input_chunk[:, :chunk_overlap, :] = input_chunk[:, -chunk_overlap:, :].clone()
        input_chunk[:, chunk_overlap:, :] = xs.squeeze(0)
        if buffer is None:
            buffer = [None] * encoder.enc[1].num_blocks
        out, buffer, _, _, pe_index = encoder.infer(input_chunk.clone(), buffer, 0, None, pe_index)
        calls.append((out, [list(kv) for kv in buffer], pe_index))
    return calls
