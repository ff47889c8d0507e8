"""Freeze-Omni's encoder at full size on CUDA: the window carries under replay, bit-exact.

The transformed step (carries in place of the stock concat-and-slice retention) replays one CUDA
graph per catalog class; every chunk of utterances crossing every class is `torch.equal` to the
stock encoder's eager output, under the deterministic settings the test pins for both arms. Two
configurations: the default (conv feed-forward, one left chunk: K = 2) and the released one
(linear feed-forward, 16 left chunks: K = 17, so 17 exports and captures at full size).
"""

from __future__ import annotations

import time

import pytest
import torch

from cadence_fx import determinism, transform
from cadence_fx.models.freeze_omni import encoder_contract, reference_encoder
from cadence_fx.models.freeze_omni_encoder import FreezeOmniEncoderConfig, build_encoder, stream_utterance


def class_name(extent: int, chunk: int = 4) -> str:
    return f"encoder_chunk[n={chunk},L={extent}]"


pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


@pytest.fixture(autouse=True, scope="module")
def _deterministic():
    """The determinism envelope, pinned by the caller for both arms (a transform sets no switch)."""
    with determinism.deterministic() as settings:
        yield settings


CHUNKS = (3, 6, 4)  # chunks per utterance: each crosses both classes
MEASURED: dict[str, float] = {}  # recorded by bench/gpu_tests.py, never asserted


def _steady_chunk_ms(encoder, feats: torch.Tensor, n: int = 20) -> float:
    """Mean wall time of a steady chunk (the second class), CUDA-synchronised."""
    c = encoder.config
    window = feats[:, : c.chunk_frames + c.chunk_overlap]
    buffer, pe_index = encoder.init_buffers(), encoder.init_pe_index()
    _, buffer, pe_index = encoder.infer(window, buffer, pe_index)
    _, buffer, pe_index = encoder.infer(window, buffer, pe_index)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        _, buffer, pe_index = encoder.infer(window, buffer, pe_index)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e3


@torch.no_grad()
def test_full_size_encoder_replays_both_classes_bit_exact():
    encoder, contract = reference_encoder("full")
    encoder = encoder.cuda()
    transformed, report = transform(encoder, contract)
    c = encoder.config
    generator = torch.Generator().manual_seed(0)
    equal = []
    for chunks in CHUNKS:
        feats = torch.randn(1, chunks * c.chunk_frames, c.input_dim, generator=generator).cuda()
        stock = stream_utterance(encoder, feats)
        replayed = stream_utterance(transformed, feats)
        equal += [torch.equal(a, b) for a, b in zip(stock, replayed, strict=True)]
    assert equal == [True] * sum(CHUNKS)
    op = report.operators["encoder_chunk"]
    assert all(cls.refused is None for cls in op.classes.values())
    # The first two visits of each class run beside the stock call (verification); every later
    # one goes to the replay engine: the first class's third visit, the steady class's eight last.
    engine = op.replay
    assert engine.counters.as_dict() == {
        "calls": sum(CHUNKS) - 4,
        "captures": 2,
        "replays": sum(CHUNKS) - 4,
        "eager": 0,
        "invalidations": 0,
        "fallbacks": {},
    }
    assert sorted(engine.certificates) == sorted([class_name(0), class_name(c.kv_frames)])
    assert all(cert.captured for cert in engine.certificates.values())
    assert transformed.calls == {class_name(0): len(CHUNKS), class_name(c.kv_frames): sum(CHUNKS) - len(CHUNKS)}
    # After the last chunk the key and value carries (buffer.{2l}.0 and .1) retain what the stock step retains.
    assert {carry.extent for path, carry in transformed.carries.items() if path.count(".") == 2} == {c.kv_frames}
    MEASURED["steady_chunk_eager_ms"] = _steady_chunk_ms(encoder, feats)
    MEASURED["steady_chunk_replay_ms"] = _steady_chunk_ms(transformed, feats)


@torch.no_grad()
def test_full_size_released_configuration_replays_all_seventeen_classes_bit_exact():
    """The published encoder's options (linear feed-forward, 16 left chunks): K = 17 graphs."""
    config = FreezeOmniEncoderConfig.released()
    encoder = build_encoder(config).cuda()
    transformed, report = transform(encoder, encoder_contract(config))
    extents = [config.chunk_size * i for i in range(config.left_chunks + 1)]
    # The first two utterances' visits of every class are verified against the stock call; the
    # third utterance's go to the replay engine, which captures all 17 classes.
    chunks = (config.left_chunks + 3, config.left_chunks + 1, config.left_chunks + 1)
    generator = torch.Generator().manual_seed(1)
    equal = []
    for n in chunks:
        feats = torch.randn(1, n * config.chunk_frames, config.input_dim, generator=generator).cuda()
        pairs = zip(stream_utterance(encoder, feats), stream_utterance(transformed, feats), strict=True)
        equal += [torch.equal(a, b) for a, b in pairs]
    assert equal == [True] * sum(chunks)
    assert list(report.carries) == ["attention_kv"]
    assert transformed.calls == {class_name(e): len(chunks) for e in extents[:-1]} | {
        class_name(extents[-1]): sum(chunks) - len(chunks) * config.left_chunks
    }
    engine = report.operators["encoder_chunk"].replay
    engine_calls = sum(chunks) - 2 * len(extents)
    assert engine.counters.as_dict() == {
        "calls": engine_calls,
        "captures": len(extents),
        "replays": engine_calls,
        "eager": 0,
        "invalidations": 0,
        "fallbacks": {},
    }
    assert sorted(engine.certificates) == sorted(class_name(e) for e in extents)
    assert all(cert.captured for cert in engine.certificates.values())
