"""The binding pipeline on a functional step: the Freeze-Omni encoder's `infer(chunk, buffer,
pe_index)` returns its new buffer list instead of mutating one. The contract is the family's, the
binding is data; the transformed encoder drops into the stock streaming driver."""

from __future__ import annotations

import torch

from cadence_fx import Binding, OperatorBinding, RegionBinding, transform
from cadence_fx.models.freeze_omni import freeze_omni_binding, freeze_omni_contract
from cadence_fx.models.freeze_omni_encoder import FreezeOmniEncoderConfig, build_encoder, stream_utterance

BINDING = Binding(
    regions=(
        RegionBinding("attention_kv", at=("buffer.[0::2].0", "buffer.[0::2].1"), out=("return.1.[0::2].0", "return.1.[0::2].1")),
        RegionBinding("conv_left_context", at=("buffer.[1::2]",), out=("return.1.[1::2]",)),
    ),
    operators=(OperatorBinding("encoder_chunk", method="infer", units=4),),
)


def test_the_bound_encoder_streams_bit_for_bit_on_fixed_carries():
    config = FreezeOmniEncoderConfig.small()
    encoder = build_encoder(config)
    contract = freeze_omni_contract(
        blocks=config.num_blocks,
        d_model=config.attention_dim,
        heads=config.attention_heads,
        chunk_frames=config.chunk_size,
        left_chunks=config.left_chunks,
        lorder=config.lorder,
    )
    feats = torch.randn(1, 16 * 6, 80, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = stream_utterance(encoder, feats)
    assert freeze_omni_binding(encoder, contract) == BINDING  # the family's own binding is this data
    bound, report = transform(encoder, contract, BINDING)
    for _ in range(2):  # two utterances over the same carries
        with torch.no_grad():
            actual = stream_utterance(bound, feats)
        assert len(actual) == 6 and all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))
    op = report.operators["encoder_chunk"]
    assert [cls.name for cls in op.classes.values()] == ["encoder_chunk[n=4,L=0]", "encoder_chunk[n=4,L=4]"]
    assert all(cls.refused is None for cls in op.classes.values())
    assert op.counters.as_dict() == {
        "calls": 12,
        "graph_calls": 12,
        "verified": 4,
        "stock": 0,
        "adopted": 2 * config.num_blocks,
        "stock_by_reason": {},
    }
