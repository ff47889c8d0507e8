import pytest
import torch
from moshi.models import LMGen, loaders
from torch.overrides import TorchFunctionMode

from cadence_fx.models.moshi_stream import (
    FULL,
    SMALL,
    build_models,
    random_pcm,
    ring_caches,
    stream_reference,
)

FRAMES = 10


class _ExponentialDraws(TorchFunctionMode):
    """Records the shape of every `exponential_` draw: the vendor's sampling noise."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.exponential_:
            self.shapes.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def models():
    return build_models(SMALL)


@pytest.fixture(scope="module")
def pcm():
    return random_pcm(FRAMES, seed=1)


@pytest.fixture(scope="module")
def sampled(models, pcm):
    return stream_reference(models, pcm, sampling=True, seed=7)


def test_ten_frames_give_nine_token_frames_and_their_pcm(sampled):
    assert sampled.tokens.shape == (1, 9, FRAMES - 1)
    assert sampled.tokens.dtype == torch.long
    assert sampled.pcm.shape == (1, 1, 1920 * (FRAMES - 1))


def test_sampling_with_the_same_seed_repeats_tokens_and_pcm_exactly(models, pcm, sampled):
    again = stream_reference(models, pcm, sampling=True, seed=7)
    assert torch.equal(again.tokens, sampled.tokens)
    assert torch.equal(again.pcm, sampled.pcm)


def test_greedy_repeats_tokens_and_pcm_exactly_whatever_the_seed(models, pcm):
    first = stream_reference(models, pcm, sampling=False, seed=0)
    second = stream_reference(models, pcm, sampling=False, seed=1)
    assert torch.equal(first.tokens, second.tokens)
    assert torch.equal(first.pcm, second.pcm)


def test_sampling_draws_one_text_and_eight_audio_exponentials_per_frame(models):
    frames = 3
    with _ExponentialDraws() as draws:
        stream_reference(models, random_pcm(frames), sampling=True, seed=0)
    assert draws.shapes == ([(1, 25)] + [(1, 250)] * 8) * frames


def test_no_codebook_embedding_sum_is_zero(models):
    sums = {name: t for name, t in models.mimi.named_buffers() if name.endswith("embedding_sum")}
    assert len(sums) == 32
    assert [name for name, t in sums.items() if not torch.any(t)] == []


def test_no_parameter_or_buffer_is_all_zero(models):
    tensors = [
        (name, t)
        for model in (models.mimi, models.lm)
        for name, t in list(model.named_parameters()) + list(model.named_buffers())
    ]
    assert [name for name, t in tensors if not torch.any(t)] == []


def test_same_seed_builds_the_same_weights(models):
    again = build_models(SMALL)
    for a, b in ((models.mimi, again.mimi), (models.lm, again.lm)):
        pairs = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
        assert all(torch.equal(x, y) for x, y in pairs)


def test_small_config_keeps_the_real_ring_capacities(models):
    lm_gen = LMGen(models.lm, use_sampling=False)
    with models.mimi.streaming(1), lm_gen.streaming(1):
        mimi, lm = ring_caches(models.mimi), ring_caches(models.lm)
    with models.lm.depformer.streaming(1):
        depformer = ring_caches(models.lm.depformer)
    assert (len(mimi), set(mimi.values())) == (4, {(2, 1, 2, 250, 64)})
    assert (len(lm), set(lm.values())) == (2, {(2, 1, 4, 3000, 32)})
    assert (len(depformer), set(depformer.values())) == (2, {(2, 1, 4, 8, 16)})


@pytest.mark.slow
def test_full_size_ring_caches_on_the_meta_device():
    mimi = loaders.get_mimi(None, FULL.mimi, device="meta")
    lm = loaders.get_moshi_lm(None, lm_kwargs=FULL.lm_kwargs, device="meta", dtype=FULL.lm_dtype)
    assert sum(p.numel() for p in lm.parameters()) == 7_687_729_152
    with mimi.streaming(1), lm.streaming(1):
        mimi_rings, lm_rings = ring_caches(mimi), ring_caches(lm)
    with lm.depformer.streaming(1):
        depformer_rings = ring_caches(lm.depformer)
    assert (len(mimi_rings), set(mimi_rings.values())) == (16, {(2, 1, 8, 250, 64)})
    assert (len(lm_rings), set(lm_rings.values())) == (32, {(2, 1, 32, 3000, 128)})
    assert (len(depformer_rings), set(depformer_rings.values())) == (6, {(2, 1, 16, 8, 64)})
