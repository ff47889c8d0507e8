"""Moshi (reduced size) on CUDA, transformed from its bindings: the four operators replayed, tokens and PCM bit-exact against the
vendor's eager loop, sampling and greedy.

The full-size comparison with the vendor's own CUDA graphs is `bench/moshi.py`.
"""

from __future__ import annotations

import pytest
import torch
from moshi.utils.compile import no_cuda_graph

from cadence_fx import determinism, transform
from cadence_fx.models.moshi import contract_for
from cadence_fx.models.moshi_bound import WARM_UP_FRAMES
from cadence_fx.models.moshi_stream import SMALL, build_models, random_pcm, stream_reference

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


@pytest.fixture(autouse=True, scope="module")
def _deterministic():
    """The determinism envelope, pinned by the caller for both arms (a transform sets no switch)."""
    with determinism.deterministic() as settings:
        yield settings


FRAMES = 20
STREAMS = [(True, 7), (False, 3), (True, 8)]  # (sampling, seed)


@torch.no_grad()
def test_replayed_stages_give_the_vendors_eager_tokens_and_pcm_and_move_its_counters():
    models = build_models(SMALL, device="cuda")
    transformed, _ = transform(models, contract_for(SMALL))
    for i, (sampling, seed) in enumerate(STREAMS):
        pcm = random_pcm(FRAMES, seed=100 + i, device="cuda")
        with no_cuda_graph():
            reference = stream_reference(models, pcm, sampling=sampling, seed=seed)
        tokens, audio = [], []
        with transformed.session(sampling=sampling, seed=seed) as step:
            for frame in pcm.split(models.mimi.frame_size, dim=-1):
                codes, out = step(frame)
                if codes is not None:
                    tokens.append(codes)
                    audio.append(out)
            # Replays run no Python: the binding moved the vendor's host counters as eager would.
            offset = transformed.models.lm.transformer.layers[0].self_attn._streaming_state.offset_cpu
        assert offset == FRAMES
        assert torch.equal(torch.cat(tokens, dim=-1), reference.tokens)
        assert torch.equal(torch.cat(audio, dim=-1), reference.pcm)
    counters = transformed.counters()
    # Every call ran its class's graph; past the first two of each class (verified beside the stock
    # call, at construction), every one replayed: one capture per class, the depformer's two
    # decoding modes two classes.
    for name, classes in (("mimi_encode", 1), ("lm_step", 1), ("mimi_decode", 1), ("depformer_step", 2)):
        bound, replay = counters[name], counters[name]["replay"]
        assert bound["stock"] == 0 and bound["graph_calls"] == bound["calls"] and bound["verified"] == 2 * classes, (name, bound)
        assert replay["captures"] == classes and replay["eager"] == 0 and replay["invalidations"] == 0, (name, replay)
        assert replay["replays"] == replay["calls"] == bound["calls"] - 2 * classes, (name, replay)
    assert counters["lm_step"]["calls"] == FRAMES * len(STREAMS) + 2 * WARM_UP_FRAMES
