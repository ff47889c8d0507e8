"""Batched Token2Wav rows on a GPU (the padded route: every batch-sensitive op at the capacity's
shape), each stream bit-identical to the vendor's stream alone under the same envelope; float32 at
reduced and full depth, and the vendor's float16 configuration. For the GPU issue to run."""

import pytest
import torch
from token2wav_batchkit import plans, run_alone, run_batched

from cadence_fx.determinism import deterministic
from cadence_fx.models.token2wav_batch import BatchedStreams
from cadence_fx.models.token2wav_envelope import StreamRng, batch_invariant
from cadence_fx.models.token2wav_precision import FLOAT16, FLOAT32, build_models
from cadence_fx.models.token2wav_stream import FULL_DEPTH, PROMPT_TOKENS, REDUCED_DEPTH

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]


def _check(precision, depth, *, capacity, streams, seed, prompt_tokens):
    with deterministic(algorithms=True):
        flow, hift = build_models(precision, depth, device="cuda")
        schedule = plans(seed, streams, prompt_tokens=prompt_tokens, device="cuda")
        batched = BatchedStreams(flow, hift, capacity=capacity, precision=precision)
        outs, call_classes = run_batched(batched, schedule, prompt_tokens=prompt_tokens, device="cuda")
        assert all(len(set(c)) == 1 and len(c) <= capacity for c in call_classes)
        assert any(len(c) > 1 for c in call_classes)
        for s, plan in enumerate(schedule):
            alone = run_alone(
                flow,
                hift,
                plan,
                capacity=capacity,
                prompt_tokens=prompt_tokens,
                n_timesteps=10,
                device="cuda",
                float16=precision.float16,
            )
            assert [torch.equal(a.mel, b.mel) for a, b in zip(alone, outs[s])] == [True] * len(alone), f"stream {s} mel"
            assert [torch.equal(a.speech, b.speech) for a, b in zip(alone, outs[s])] == [True] * len(alone), f"stream {s} PCM"


@pytest.mark.parametrize("seed", [1, 2])
def test_reduced_float32_rows_exact(seed):
    _check(FLOAT32, REDUCED_DEPTH, capacity=4, streams=6, seed=seed, prompt_tokens=51)


def test_full_float32_rows_exact():
    _check(FLOAT32, FULL_DEPTH, capacity=8, streams=8, seed=3, prompt_tokens=PROMPT_TOKENS)


def test_reduced_float16_rows_exact():
    _check(FLOAT16, REDUCED_DEPTH, capacity=4, streams=6, seed=4, prompt_tokens=51)


def test_the_padded_route_runs_on_cuda_and_draws_per_stream():
    x = torch.randn(3, 50, 512, device="cuda")
    weight = torch.randn(512, 512, device="cuda")
    rngs = [StreamRng(s) for s in range(3)]
    with batch_invariant(8, rngs, "cuda") as mode:
        together, noise = torch.nn.functional.linear(x, weight), torch.rand(3, 9, device="cuda")
    assert mode.padded_calls == 1 and mode.per_row_calls == 0
    for i in range(3):
        own = StreamRng(i)
        with batch_invariant(8, [own], "cuda"):
            assert torch.equal(torch.nn.functional.linear(x[i : i + 1], weight), together[i : i + 1])
            assert torch.equal(torch.rand(1, 9, device="cuda"), noise[i : i + 1])
