"""Token2Wav streams batched as rows of one call, each bit-identical to itself run alone.

A session is a row (`Row`): its prompt, its flow caches and HiFT caches (batch 1 each, in the
vendor's layout), its prompt state for turn resets, and its own counter-based RNG (`StreamRng`).
`BatchedStreams.step` takes one chunk for any set of rows, groups the rows by catalog class and
runs each group in calls of at most `capacity` rows, under the batch-invariant envelope
(`token2wav_envelope`). Rows of different classes never share a call: a class is every input
shape of the call (the CFM loop's call and cache extent, the conformer's cache extent, the flush,
HiFT's mel and source extents; and the prompt's length, which the caller's trim keeps), which is the catalog's
class pair of the flow and HiFT for the row's contract. A row
joins, leaves, starts a turn or resets only between steps, that is, at a chunk boundary; its flush
is its own (`last_chunk` per row).

The exactness reference is the vendor's stream (`StockStream`) run alone under the same envelope
(one stream, padded to the same capacity, drawing from the same `StreamRng`): each row's mel and
PCM equal it bit for bit, whatever rows share its calls (`tests/test_token2wav_batch.py`).

What the batched call runs. The vendor's modules, batch-general where the vendor's glue is not:
the flow's speaker projection, token embedding, conformer encoder (`encoder.forward_chunk`, which
takes a batch) and its projection; the CFM Euler loop as `CausalConditionalCFM.solve_euler_chunk`
does it, with the CFG pairs of n rows laid out as the vendor lays out one ([the n conditional rows
| the n unconditional rows]) and the DiT's `forward_chunk` writing into buffers of batch 2n (the
vendor's are of batch 2, one CFG pair); the caller's trim; HiFT (`HiFTGenerator.forward` takes a
batch) and the stream's cross-fade and cache update as `Token2wav.stream` does them. A row's turn
start runs the vendor's `flow.setup_cache` for that row alone under the envelope (its prompt is its
own length, so it shares no call) and keeps the prompt state for the row's resets; rows of one
prompt given to `share_prompt` (a server's voice) start from its state, computed once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from cadence_fx.models.vendor import VendorFlow, token2wav_vendor
from cadence_fx.passes.carry import stock_trim

from .token2wav_envelope import StreamRng, batch_invariant
from .token2wav_precision import FLOAT32, Precision
from .token2wav_stream import N_TIMESTEPS, SILENCE_TOKEN, ChunkOut, Prompt, Vocoder

__all__ = ["BatchedStreams", "Row", "row_class"]

MEL_CACHE, SOURCE_CACHE, RETAINED = 8, 8 * 480, 100
#: The flow cache's entries and the axis that holds a row (the estimator's hold CFG pairs).
ROW_AXIS = {"conformer_cnn_cache": 0, "conformer_att_cache": 1, "estimator_cnn_cache": 2, "estimator_att_cache": 2}


@dataclass
class Row:
    """One session's stream: everything that is its own between chunks (`base`, its prompt state for
    turn resets, in host memory; the rest on the flow's device)."""

    prompt: Prompt
    rng: StreamRng
    base: dict[str, torch.Tensor] = field(default_factory=dict)
    cache: dict[str, torch.Tensor] = field(default_factory=dict)
    hift: dict[str, torch.Tensor] = field(default_factory=dict)
    chunks: int = 0  # chunks since the turn started


def row_class(row: Row, last_chunk: bool) -> tuple:
    """The row's class for its next chunk: every input shape of its calls, named by what it is."""
    return (
        ("prompt", row.prompt.mels.shape[1]),  # the trim keeps it: rows of two prompts may meet at one L
        ("f", 56 if last_chunk else 50),
        ("L", row.cache["estimator_att_cache"].shape[4]),
        ("conformer_L", row.cache["conformer_att_cache"].shape[3]),
        ("hift_mel", row.hift["mel"].shape[2]),
        ("hift_source", row.hift["source"].shape[2]),
        ("hift_speech", row.hift["speech"].shape[1]),
    )


def _stack(values: list[torch.Tensor], key: str) -> torch.Tensor:
    """Rows' caches as one call's: CFG pairs as [conditional rows | unconditional rows]."""
    axis = ROW_AXIS[key]
    if key.startswith("estimator"):
        index = (slice(None),) * axis
        return torch.cat([v[index + (slice(0, 1),)] for v in values] + [v[index + (slice(1, 2),)] for v in values], dim=axis)
    return torch.cat(values, dim=axis)


def _unstack(value: torch.Tensor, key: str, n: int) -> list[torch.Tensor]:
    axis = ROW_AXIS[key]
    index = (slice(None),) * axis
    if key.startswith("estimator"):
        return [
            torch.cat([value[index + (slice(i, i + 1),)], value[index + (slice(n + i, n + i + 1),)]], dim=axis) for i in range(n)
        ]
    return [value[index + (slice(i, i + 1),)].clone() for i in range(n)]


class BatchedStreams:
    """Rows of Token2Wav streams over one flow and one HiFT, batched per class at `capacity`."""

    def __init__(
        self,
        flow: VendorFlow,
        hift: Vocoder,
        *,
        capacity: int,
        n_timesteps: int = N_TIMESTEPS,
        precision: Precision = FLOAT32,
        record: bool = True,
    ):
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"capacity must be a positive int (rows a call), got {capacity!r}")
        precision.check_device(flow.decoder.rand_noise.device)
        if flow.decoder.rand_noise.dtype != precision.flow_dtype:
            raise ValueError(
                f"precision {precision.name!r} runs the flow in {precision.flow_dtype}, "
                f"the flow given is {flow.decoder.rand_noise.dtype}"
            )
        if getattr(flow.decoder.estimator, "use_cuda_graph", False):
            raise ValueError("the flow's DiT has the vendor's CUDA-graph branch on (batch 2 only): build it without")
        self.flow, self.hift, self.capacity, self.n_timesteps = flow, hift, capacity, n_timesteps
        self.precision = precision
        self.rows: dict[Hashable, Row] = {}
        self.device = flow.decoder.rand_noise.device
        self.depth = len(flow.decoder.estimator.blocks)
        self.window = torch.from_numpy(np.hamming(2 * SOURCE_CACHE)).to(self.device)
        self.fade_in_out = token2wav_vendor().fade_in_out
        #: (class, the rows' keys) of every batched call, in order, with `record` (a server's runs
        #: forever: it keeps `call_rows` alone).
        self.calls: list[tuple[tuple, tuple]] | None = [] if record else None
        self.call_rows: dict[int, int] = {}  # calls by the rows they held
        self._shared: dict[int, tuple[Prompt, dict[str, torch.Tensor]]] = {}  # `share_prompt`'s, by id

    # -- rows join, leave and reset between steps ---------------------------------------------------

    def join(self, key: Hashable, prompt: Prompt, seed: int) -> None:
        """A new row: its turn starts from `prompt`; its noise is `StreamRng(seed)`'s."""
        if key in self.rows:
            raise ValueError(f"stream {key!r} has already joined")
        if prompt.tokens.shape[0] != 1 or prompt.mels.shape[0] != 1 or prompt.spk.shape[0] != 1:
            raise ValueError(f"a row's prompt is one stream's (batch 1), got tokens {tuple(prompt.tokens.shape)}")
        row = Row(prompt, StreamRng(seed))
        self._setup(row)
        self.rows[key] = row

    def leave(self, key: Hashable) -> None:
        self._row(key)
        del self.rows[key]

    def reset_turn(self, key: Hashable) -> None:
        """The row's turn boundary: its caches return to its prompt state."""
        self._reset(self._row(key))

    def _reset(self, row: Row) -> None:
        """The row at its prompt state: its flow caches a copy of `base`, its HiFT caches empty."""
        row.cache = {k: v.to(self.device, copy=True) for k, v in row.base.items()}
        row.chunks = 0
        row.hift = dict(
            mel=torch.zeros(1, row.prompt.mels.shape[2], 0, device=self.device),
            source=torch.zeros(1, 1, 0, device=self.device),
            speech=torch.zeros(1, 0, device=self.device),
        )

    def _row(self, key: Hashable) -> Row:
        if key not in self.rows:
            raise ValueError(f"no stream {key!r} has joined (joined: {sorted(map(repr, self.rows))})")
        return self.rows[key]

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        # As StockStream: the vendor's autocast("cuda", its precision), which leaves CPU ops alone.
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        return torch.amp.autocast("cuda", dtype=self.precision.autocast_dtype)

    def share_prompt(self, prompt: Prompt) -> None:
        """Rows that join with `prompt` (this object) start from one prompt state, computed now,
        instead of each computing it at its join (which holds up every row's next step). The state
        is the same for every row: the prompt's setup is the row's alone under the envelope, and
        it draws no noise (checked: a setup that draws is refused)."""
        self._shared[id(prompt)] = (prompt, self._prompt_state(prompt, StreamRng(0)))

    def _setup(self, row: Row) -> None:
        """Token2wav.set_stream_cache for this row alone, under the envelope (or its shared prompt's)."""
        shared = self._shared.get(id(row.prompt))
        row.base = shared[1] if shared is not None and shared[0] is row.prompt else self._prompt_state(row.prompt, row.rng)
        self._reset(row)

    def _prompt_state(self, prompt: Prompt, rng: StreamRng) -> dict[str, torch.Tensor]:
        """The flow caches after `prompt` (the live slots kept), in (pinned) host memory, where it
        waits for the row's turn starts, as TransformedFlow's does."""
        tokens, mels, spk = prompt.tokens, prompt.mels, prompt.spk
        pad = torch.full((1, 3), SILENCE_TOKEN, device=tokens.device, dtype=tokens.dtype)
        drawn = rng.offset
        with torch.inference_mode(), self._autocast(), batch_invariant(self.capacity, [rng], self.device):
            cache = self.flow.setup_cache(torch.cat([tokens, pad], dim=1), mels, spk, n_timesteps=self.n_timesteps)
        if rng.offset != drawn:
            raise RuntimeError("the flow's prompt setup drew noise: its state would be the row's, not the prompt's")
        live = (slice(0, self.n_timesteps), slice(0, self.depth))
        cache = {k: (v[live] if k.startswith("estimator") else v) for k, v in cache.items()}
        return {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=v.is_cuda).copy_(v) for k, v in cache.items()}

    # -- one chunk for any rows ---------------------------------------------------------------------

    def step(self, chunks: Mapping[Hashable, torch.Tensor], last: frozenset | set = frozenset()) -> dict[Hashable, ChunkOut]:
        """One chunk of (1, 28) tokens for each row in `chunks`; rows in `last` flush (their last chunk).

        Rows are grouped by `row_class`; each group runs in calls of at most `capacity` rows."""
        unknown = [k for k in (*chunks, *last) if k not in self.rows]
        if unknown:
            raise ValueError(f"streams {unknown!r} have not joined")
        stray = [k for k in last if k not in chunks]
        if stray:
            raise ValueError(f"streams {stray!r} flush but have no chunk in this step")
        for key, tokens in chunks.items():
            if tokens.dim() != 2 or tokens.shape[0] != 1 or tokens.dtype not in (torch.int32, torch.int64):
                raise ValueError(
                    f"stream {key!r}: a chunk is (1, 28) integer speech tokens, got {tuple(tokens.shape)} {tokens.dtype}"
                )
        groups: dict[tuple, list[Hashable]] = {}
        for key in chunks:
            groups.setdefault(row_class(self.rows[key], key in last), []).append(key)
        outs: dict[Hashable, ChunkOut] = {}
        for cls in sorted(groups, key=repr):
            keys = groups[cls]
            for start in range(0, len(keys), self.capacity):
                part = keys[start : start + self.capacity]
                if self.calls is not None:
                    self.calls.append((cls, tuple(part)))
                self.call_rows[len(part)] = self.call_rows.get(len(part), 0) + 1
                outs.update(self._call(part, [chunks[k] for k in part], dict(cls)["f"] == 56))
        return outs

    def _call(self, keys: list[Hashable], tokens: list[torch.Tensor], last_chunk: bool) -> dict[Hashable, ChunkOut]:
        rows = [self.rows[k] for k in keys]
        rngs = [r.rng for r in rows]
        with torch.inference_mode(), self._autocast(), batch_invariant(self.capacity, rngs, self.device):
            mel, caches = self._flow_chunk(rows, torch.cat(tokens), last_chunk)
        for row, cache in zip(rows, caches):
            row.cache = cache
        with torch.inference_mode(), batch_invariant(self.capacity, rngs, self.device):
            speech = self._hift_chunk(rows, mel, last_chunk)
        out = {}
        for i, (key, row) in enumerate(zip(keys, rows)):
            row.chunks += 1
            out[key] = ChunkOut(mel=mel[i : i + 1].clone(), speech=speech[i])
        return out

    def _flow_chunk(
        self, rows: list[Row], tokens: torch.Tensor, last_chunk: bool
    ) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
        """`CausalMaskedDiffWithXvec.inference_chunk` for n rows, then the caller's trim."""
        flow, n = self.flow, len(rows)
        cache = {k: _stack([r.cache[k] for r in rows], k) for k in ROW_AXIS}
        spk = torch.cat([r.prompt.spk for r in rows])
        spk = flow.spk_embed_affine_layer(F.normalize(spk, dim=1))
        token = flow.input_embedding(tokens)
        h, conformer_cnn, conformer_att = flow.encoder.forward_chunk(
            xs=token, last_chunk=last_chunk, cnn_cache=cache["conformer_cnn_cache"], att_cache=cache["conformer_att_cache"]
        )
        h = flow.encoder_proj(h)
        cond = torch.zeros_like(h)
        mel, estimator_cnn, estimator_att = self._cfm(
            h.transpose(1, 2).contiguous(),
            spk,
            cond.transpose(1, 2).contiguous(),
            cache["estimator_cnn_cache"],
            cache["estimator_att_cache"],
        )
        new = {
            "conformer_cnn_cache": conformer_cnn,
            "conformer_att_cache": conformer_att,
            "estimator_cnn_cache": estimator_cnn,
            "estimator_att_cache": estimator_att,
        }
        prompt_frames = rows[0].prompt.mels.shape[1]
        for key, axis in (("estimator_att_cache", 4), ("conformer_att_cache", 3)):
            if new[key].shape[axis] > prompt_frames + RETAINED:
                new[key] = stock_trim(new[key], axis, prompt_frames, RETAINED)
        per_row = {k: _unstack(v, k, n) for k, v in new.items()}
        return mel, [{k: per_row[k][i] for k in ROW_AXIS} for i in range(n)]

    def _cfm(
        self, mu: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor, cnn_cache: torch.Tensor, att_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`CausalConditionalCFM.forward_chunk` and `solve_euler_chunk` for n rows (n CFG pairs)."""
        cfm, estimator, n = self.flow.decoder, self.flow.decoder.estimator, mu.shape[0]
        offset = att_cache.shape[4]
        z = cfm.rand_noise[:, :, offset : offset + mu.size(2)] * 1.0
        t_span = torch.linspace(0, 1, self.n_timesteps + 1, device=mu.device, dtype=mu.dtype)
        t_span = 1 - torch.cos(t_span * 0.5 * torch.pi)
        t, dt = t_span[0].unsqueeze(dim=0), t_span[1] - t_span[0]
        x = z.repeat(n, 1, 1)
        mu_in = torch.cat([mu, torch.zeros_like(mu)], dim=0)
        spks_in = torch.cat([spks, torch.zeros_like(spks)], dim=0)
        cond_in = torch.cat([cond, torch.zeros_like(cond)], dim=0)
        new_cnn, new_att = [], []
        own = estimator.cnn_cache_buffer, estimator.att_cache_buffer
        try:
            for step in range(1, len(t_span)):
                step_cnn, step_att = cnn_cache[step - 1], att_cache[step - 1]
                estimator.cnn_cache_buffer = step_cnn.new_zeros(step_cnn.shape)
                estimator.att_cache_buffer = step_att.new_zeros(
                    (*step_att.shape[:3], step_att.shape[3] + mu.shape[2], step_att.shape[4])
                )
                dphi_dt, step_new_cnn, step_new_att = estimator.forward_chunk(
                    x=x.repeat(2, 1, 1),
                    mu=mu_in,
                    t=t.repeat(2 * n),
                    spks=spks_in,
                    cond=cond_in,
                    cnn_cache=step_cnn,
                    att_cache=step_att,
                )
                dphi_dt, cfg_dphi_dt = dphi_dt.chunk(2, dim=0)
                dphi_dt = (1.0 + cfm.inference_cfg_rate) * dphi_dt - cfm.inference_cfg_rate * cfg_dphi_dt
                x = x + dt * dphi_dt
                t = t + dt
                if step < len(t_span) - 1:
                    dt = t_span[step + 1] - t
                new_cnn.append(step_new_cnn)
                new_att.append(step_new_att)
        finally:
            estimator.cnn_cache_buffer, estimator.att_cache_buffer = own
        return x, torch.stack(new_cnn), torch.stack(new_att)

    def _hift_chunk(self, rows: list[Row], chunk_mel: torch.Tensor, last_chunk: bool) -> list[torch.Tensor]:
        """HiFT and the stream's cross-fade and caches, as `Token2wav.stream` does them, for n rows."""
        mel = torch.cat([torch.cat([r.hift["mel"] for r in rows]), chunk_mel], dim=2)
        speech, source = self.hift(mel, torch.cat([r.hift["source"] for r in rows]))
        cached = torch.cat([r.hift["speech"] for r in rows])
        first = cached.shape[-1] == 0
        if not first:
            speech = self.fade_in_out(speech, cached, self.window)
        outs = []
        for i, row in enumerate(rows):
            row.hift = dict(
                mel=mel[i : i + 1, :, -MEL_CACHE:].clone(),
                source=source[i : i + 1, :, -SOURCE_CACHE:].clone(),
                speech=speech[i : i + 1, -SOURCE_CACHE:].clone(),
            )
            own = speech[i : i + 1]
            if not last_chunk:
                own = own[:, :-SOURCE_CACHE]
                if first:
                    own = torch.cat([torch.zeros(1, SOURCE_CACHE, device=own.device), own], dim=1)
            outs.append(own.clone())
        return outs
