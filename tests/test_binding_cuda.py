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


def test_three_streams_are_exact_on_one_address_and_every_verified_class_replays_from_its_third_call():
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
    # Measured on the H200: the first call's class (nothing retained) is refused by verification,
    # its export building the causal mask another way than the stock call (named by the op); every
    # later stream's first call meets it refused. The steady class reads the cache's length: four
    # lengths are captured and replay, longer streams past them run the stock code
    # (`guard:cache.layers.0.cumulative_length`). The streams stay exact.
    assert set(refused) == {"decoder_step[n=2,L=0]"}
    assert all(why.startswith("verification: program: ") for why in refused.values())
    assert op.counters.stock_by_reason == {"verification": 1, "refused": 2, "guard:cache.layers.0.cumulative_length": 6}
    counters = engine.counters
    assert (counters.eager, counters.invalidations) == (0, 0)
    # Each of the 5 verified classes (L=2 and four lengths of L=4) is verified on its first two
    # calls (the first two streams) and replays on the third: one capture each, every engine call
    # a replay.
    assert (counters.calls, counters.captures, counters.replays) == (5, 5, 5)
    assert engine.phase("decoder_step[n=2,L=4]") is Phase.REPLAY
