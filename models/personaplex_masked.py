"""PersonaPlex's main transformer with a state per batch row: the masking Kyutai's moshi 0.2.13
has (per-row offsets, an exec mask, a reset mask), ported onto PersonaPlex's own modules.

PersonaPlex's fork keeps one offset for the whole batch: its `RingKVCache.end_offset`, its
attention's and its transformer's `offset` are tensors of one element, so every row of a batch is
at the same position. Kyutai's 0.2.13 keeps them per row and advances only the rows an exec mask
says execute (`torch.where(exec_mask, new, old)`), which is what lets sessions join, leave and
prime at their own pace in one batch. `mask_transformer(transformer, batch)` gives PersonaPlex's
main transformer that: each attention's ring and offsets, and the transformer's offsets, become
`(B,)` tensors in a `RowState` of its own, and the two forwards that read them (the attention's,
the transformer's) are replaced on those instances by `_attention_forward` and
`_transformer_forward`. Every operation of a row is the vendor's at batch 1, in the vendor's
order, on that row's values (the rotary embedding, the ring's positions and the attention bias
computed per row, as Kyutai's 0.2.13 computes them; the weights are the vendor's modules'):
`tests/test_personaplex_slots.py` checks a slot at batch 1 against PersonaPlex's own loop with
`torch.equal`.

What a masked row does, as in Kyutai's 0.2.13: it is computed (the batch always runs at B) and
its result is not kept: its offsets stay, its ring positions at and past its end offset are
written (they count as empty, and its next executed call writes them before it reads them).
A reset (`reset_rows`) zeroes the rows' offsets and leaves ring bodies alone (positions at or past
an end offset of 0 are all empty).

Only the main transformer is masked. The depformer enters a fresh streaming state at batch B
inside every call (`LMGen.depformer_step`), all rows at position 0: nothing of it outlives a call.
The layers' host-side `offset_cpu` counters are read only by weights per step, which the main
transformer has none of (`check_models` refuses them).
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["RowState", "mask_transformer", "reset_rows", "row_states", "set_exec"]


@dataclass
class RowState:
    """One streaming module's per-row state. The attention's: `cache` (the vendor's ring layout,
    `(2, B, heads, capacity, head_dim)`), `end` (each row's ring end offset) and `offset` (each
    row's position); the transformer's: `offset` only. `exec` is the batch's exec mask, the same
    tensor in every module (written in place by `set_exec`)."""

    offset: torch.Tensor
    exec: torch.Tensor
    cache: torch.Tensor | None = None
    end: torch.Tensor | None = None

    def reset(self) -> None:  # the vendor's `reset_streaming` of every row: use `reset_rows` for some
        self.offset.zero_()
        if self.end is not None:
            self.end.zero_()


def _rope(q: torch.Tensor, k: torch.Tensor, offset: torch.Tensor, max_period: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The vendor's `apply_rope` (`time_before_heads=False`) with a position per row: `ts` is
    `(B, 1, T, 1)` where the vendor's is `(1, T, 1)`; every other operation is the vendor's."""
    B, H, T, D = q.shape
    ds = torch.arange(D // 2, device=q.device, dtype=torch.float32)
    freqs = torch.exp(ds * (-math.log(max_period) * 2 / D))
    ts = offset.float().view(B, 1, 1, 1) + torch.arange(T, device=q.device, dtype=torch.float32).view(1, 1, T, 1)
    dims = q.shape[:-1]
    q = q.view(*dims, D // 2, 2)
    k = k.view(*dims, D // 2, 2)
    qr, qi = q[..., 0].float(), q[..., 1].float()
    kr, ki = k[..., 0].float(), k[..., 1].float()
    rotr = torch.cos(freqs * ts)
    roti = torch.sin(freqs * ts)
    qor = qr * rotr - qi * roti
    qoi = qr * roti + qi * rotr
    kor = kr * rotr - ki * roti
    koi = kr * roti + ki * rotr
    dtype = q.dtype
    qo = torch.stack([qor.to(dtype), qoi.to(dtype)], dim=-1)
    ko = torch.stack([kor.to(dtype), koi.to(dtype)], dim=-1)
    return qo.view(*dims, D), ko.view(*dims, D)


def _complete(state: RowState, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The vendor's `RingKVCache.complete` per row: every row's keys and values written at its own
    end offset, the positions of its ring computed from its own end offset (`(B, capacity)`); the
    end offset advanced where the row executes."""
    cache, ends = state.cache, state.end
    assert cache is not None and ends is not None  # an attention's RowState (`mask_transformer`) holds its ring
    B, H, T, D = k.shape
    capacity = cache.shape[3]
    indexes = (torch.arange(T, device=k.device, dtype=torch.long).view(1, T) + ends.view(B, 1)) % capacity
    scatter = indexes.view(B, 1, T, 1).expand(B, H, T, D)
    cache[0].scatter_(2, scatter, k)
    cache[1].scatter_(2, scatter, v)
    end = ends.view(B, 1) + T
    indexes = torch.arange(capacity, device=k.device, dtype=torch.long).view(1, capacity)
    invalid = indexes >= end
    delta = indexes - end % capacity
    positions = torch.where(delta <= 0, end + delta, end + delta - capacity)
    positions = torch.where(invalid, torch.full_like(positions, -1), positions)
    ends.copy_(torch.where(state.exec, ends + T, ends))
    return cache[0], cache[1], positions


def _attention_forward(self: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`StreamingMultiheadAttention.forward` (streaming, causal, no weights per step) with a
    `RowState`: positions, ring and bias per row."""
    from einops import rearrange

    state: RowState = self._streaming_state
    B, T = query.shape[:2]
    projected = F.linear(query, self.in_proj_weight)
    q, k, v = rearrange(projected, "b t (p h d) -> p b h t d", p=3, h=self.num_heads)
    if self.rope:
        q, k = _rope(q, k, state.offset, self.rope.max_period)
    k, v, pos_k = _complete(state, k, v)
    pos_k = pos_k.view(B, 1, 1, -1)
    pos_q = state.offset.view(B, 1, 1, 1) + torch.arange(T, device=q.device, dtype=torch.long).view(1, 1, -1, 1)
    delta = pos_q - pos_k
    attn_bias = (pos_k >= 0) & (delta >= 0)
    if self.context is not None:
        attn_bias = attn_bias & (delta < self.context)
    x = F.scaled_dot_product_attention(q, k, v, attn_bias, dropout_p=0.0)
    x = rearrange(x, "b h t d -> b t (h d)")
    x = self.out_proj(x)
    state.offset.copy_(torch.where(state.exec, state.offset + T, state.offset))
    return x


def _transformer_forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """`StreamingTransformer.forward` (rotary positions only, as PersonaPlex's LM has) with a
    `RowState`: the offset advanced where the row executes."""
    state: RowState = self._streaming_state
    B, T, C = x.shape
    if self.positional_embedding not in {"rope", "none"}:
        raise ValueError(f"a masked transformer takes rotary positions ('rope'); this one has {self.positional_embedding!r}")
    for layer in self.layers:
        x = layer(x, *args, **kwargs)
    state.offset.copy_(torch.where(state.exec, state.offset + T, state.offset))
    return x


def mask_transformer(transformer: Any, batch: int) -> torch.Tensor:
    """Put `transformer` (a PersonaPlex `StreamingTransformer`, not streaming) in streaming mode at
    `batch` with a `RowState` in itself and each attention (rings allocated as the vendor
    allocates them), and its two forwards replaced on these instances; its layers keep the
    vendor's state (their host counter). Returns the exec mask, `(batch,)` bool, all True: every
    module reads this one tensor (`set_exec` writes it)."""
    MHA = type(transformer.layers[0].self_attn)
    if transformer.is_streaming:
        raise ValueError("mask_transformer takes a transformer that is not streaming (it gives it a state per row)")
    device = next(transformer.parameters()).device
    exec_mask = torch.ones(batch, dtype=torch.bool, device=device)
    transformer.streaming_forever(batch)
    for module in transformer.modules():
        if isinstance(module, MHA):
            if module.weights_per_step or not module.causal or module.context is None:
                raise ValueError("a masked attention is causal, with a context and no weights per step")
            ring = module._streaming_state.kv_cache
            module._streaming_state = RowState(
                offset=torch.zeros(batch, dtype=torch.long, device=device),
                exec=exec_mask,
                cache=ring.cache,
                end=torch.zeros(batch, dtype=torch.long, device=device),
            )
            module.forward = types.MethodType(_attention_forward, module)
    transformer._streaming_state = RowState(offset=torch.zeros(batch, dtype=torch.long, device=device), exec=exec_mask)
    transformer.forward = types.MethodType(_transformer_forward, transformer)
    return exec_mask


def row_states(transformer: Any) -> dict[str, RowState]:
    """Every `RowState` of a masked transformer, by module name (`""`: the transformer)."""
    return {
        name: module._streaming_state
        for name, module in transformer.named_modules()
        if isinstance(getattr(module, "_streaming_state", None), RowState)
    }


def set_exec(exec_mask: torch.Tensor, rows: torch.Tensor) -> None:
    """Which rows the next calls execute: `rows`, `(B,)` bool, written into the shared mask."""
    exec_mask.copy_(rows)


def reset_rows(transformer: Any, rows: torch.Tensor) -> None:
    """The masked rows as a fresh streaming entry has them: offsets and ring end offsets zeroed
    (ring bodies left: an end offset of 0 makes every position empty); the other rows untouched."""
    for state in row_states(transformer).values():
        state.offset.copy_(torch.where(rows, torch.zeros_like(state.offset), state.offset))
        if state.end is not None:
            state.end.copy_(torch.where(rows, torch.zeros_like(state.end), state.end))
