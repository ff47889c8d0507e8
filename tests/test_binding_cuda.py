"""The bring-your-own-model transform on the GPU: a transformers Mistral sliding-window decoder
(tests/byom_example.py) bit-identical to the stock stream, its steady calls replayed as CUDA graphs."""

from __future__ import annotations

import pytest
import torch
from byom_example import TOKENS_PER_CALL, binding, build_model, contract, stream

from cadence_fx import transform
from cadence_fx.replay import Phase

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

CALLS = 8  # 16 tokens against a 4-token window: refilled four times over
STREAMS = 3


def test_three_streams_are_exact_on_one_address_and_every_steady_call_after_verification_replays():
    model, config = build_model("cuda")
    tokens = torch.randint(0, config.vocab_size, (1, CALLS * TOKENS_PER_CALL), generator=torch.Generator().manual_seed(1)).cuda()
    expected, _ = stream(model, config, tokens)
    bound, report = transform(model, contract(), binding())
    for _ in range(STREAMS):
        actual, addresses = stream(bound, config, tokens)
        assert all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))
        assert len(set(addresses)) == 1
    op = report.operators["decoder_step"]
    engine = report.replays["decoder_step"]
    print(op.explain())
    print(engine.explain())
    refused = {cls.name: cls.refused for cls in op.classes.values() if cls.refused}
    # Measured on the H200: the first call's class (nothing retained) is refused by verification.
    # The stock call lets SDPA apply its own causal mask (is_causal) there, while transformers
    # materialises the mask whenever torch.export traces; the two kernels round differently. The
    # stream stays exact: that call runs the stock code. Every other class is verified.
    assert set(refused) <= {"decoder_step[n=2,L=0]"}
    assert all(why.startswith("verification: ") for why in refused.values())
    assert op.counters.stock == STREAMS * len(refused)
    counters = engine.counters
    assert (counters.eager, counters.invalidations) == (0, 0)
    # Steady (L=4) calls: 6 per stream; the first two ever run beside the stock call
    # (verification), every later one goes to the engine and replays (the first one captures).
    # A verified non-steady class reaches the engine from the third stream on.
    verified_first_calls = 2 - len(refused)
    assert counters.calls == STREAMS * (CALLS - 2) - 2 + verified_first_calls * (STREAMS - 2)
    assert counters.replays == counters.calls
    assert engine.phase("decoder_step[n=2,L=4]") is Phase.REPLAY
