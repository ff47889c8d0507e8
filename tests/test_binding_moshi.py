"""Moshi on the one pipeline, its four stages bound as data (`models/moshi.py`), no adapter code.

Mimi (`MIMI_BINDING`): encode and decode of a streaming `MimiModel`, their rings and every
streaming convolution's state found at any depth (`**`); the first-call flags the vendor rebinds
(`state.first = torch.where(...)`) are read back after each call and kept at one address.

The LM (`MOSHI_LM_BINDING`): the vendor's two per-frame steps of a streaming `LMGen`. The main step's rings are written in
place by the vendor's own scatter, so nothing is rewritten: the pipeline exports each step once,
verifies it against the stock call (the RNG rewound between the two: the depformer samples 8
tokens a frame), then runs the exported graphs (replayed on CUDA) with the rings aliased at one
address per layer. A reset (`reset_streaming`, as a new session does) writes the offsets in place,
so the graphs keep serving the next stream."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cadence_fx import BindingError, RegionBinding, transform
from cadence_fx.models.moshi import MIMI_BINDING, MOSHI_LM_BINDING, contract_for
from cadence_fx.models.moshi_stream import FRAME_SIZE, TINY, LMGen, build_models, no_compile, random_pcm

FRAMES = 6
DEPFORMER = "depformer_step[n=1,L=8]{self.use_sampling=True, self.temp=0.8, self.top_k=250, self.cfg_coef=1.0}"


def frames(lm, seed: int) -> list[torch.Tensor]:
    """`FRAMES` frames of (1, 17, 1) tokens: text in [0, text_card), audio in [0, card)."""
    generator = torch.Generator().manual_seed(seed)
    text = torch.randint(0, lm.text_card, (FRAMES, 1, 1, 1), generator=generator)
    audio = torch.randint(0, lm.card, (FRAMES, 1, lm.num_codebooks - 1, 1), generator=generator)
    return list(torch.cat([text, audio], dim=2))


def stream(lm_step, depformer_step, lm_gen, tokens: list[torch.Tensor], device: str, seed: int):
    """Each frame: the main step, its greedy text token, the depformer's sampled audio tokens."""
    outputs, addresses = [], set()
    torch.manual_seed(seed)
    with torch.no_grad():
        for frame in tokens:
            out, text_logits = lm_step(frame.to(device))
            text = text_logits[:, 0, 0].argmax(dim=-1)
            outputs.append((out, text_logits, depformer_step(text, out)))
            layers = lm_gen.lm_model.transformer.layers
            addresses.add(tuple(layer.self_attn._streaming_state.kv_cache.cache.data_ptr() for layer in layers))
    return outputs, addresses


def run_lm(device: str, streams: int):
    with no_compile():  # the vendor compiles its rope and gating with torch.compile unless told not to
        stock, lm_gen = (LMGen(build_models(TINY, device).lm, use_sampling=True) for _ in range(2))
        stock.streaming_forever(1)
        lm_gen.streaming_forever(1)
        bound, report = transform(lm_gen, contract_for(TINY), MOSHI_LM_BINDING)
        for seed in range(streams):
            tokens = frames(lm_gen.lm_model, seed)
            expected, _ = stream(stock.lm_model.forward_text, stock.depformer_step, stock, tokens, device, seed)
            actual, addresses = stream(
                bound.operators["lm_step"], bound.operators["depformer_step"], lm_gen, tokens, device, seed
            )
            for got, want in zip(actual, expected, strict=True):
                assert all(torch.equal(a, e) for a, e in zip(got, want, strict=True))
            assert len(addresses) == 1  # every frame of every stream on the same ring
            stock.reset_streaming()
            lm_gen.reset_streaming()
    return report


def test_the_lm_steps_stream_bit_identically_through_the_pipeline_from_their_binding():
    report = run_lm("cpu", streams=2)
    lm, depformer = report.operators["lm_step"], report.operators["depformer_step"]
    assert [cls.name for cls in lm.classes.values()] == ["lm_step[n=1,L=3000]"]
    # The depformer's sampling switch and parameters are its modes: the class is the one sampling.
    assert [cls.name for cls in depformer.classes.values()] == [DEPFORMER]
    # The first frame adopts each layer's ring and its three device-side offsets into the carries.
    assert lm.counters.as_dict() == {
        "calls": 2 * FRAMES,
        "graph_calls": 2 * FRAMES,
        "verified": 2,
        "stock": 0,
        "adopted": 4,
        "stock_by_reason": {},
    }
    # The depformer's ring lives inside each call: nothing to adopt, every call through its graph.
    assert depformer.counters.as_dict() == {
        "calls": 2 * FRAMES,
        "graph_calls": 2 * FRAMES,
        "verified": 2,
        "stock": 0,
        "adopted": 0,
        "stock_by_reason": {},
    }
    # The ring's path starts at the model, so both operators bind it; only the main step writes it.
    ring = "self.lm_model.transformer.layers.0.self_attn._streaming_state.kv_cache.cache"
    assert [(s.graph, s.kind, s.rewritten, s.reason) for s in report.sites] == [
        (
            "lm_step[n=1,L=3000]",
            "ring",
            False,
            f"{ring}: written in place by the step (scatter__1): the carry is the ring, nothing to rewrite",
        ),
        (DEPFORMER, "ring", False, f"{ring}: not written by the step: passed through at its address"),
    ]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_the_lm_steps_replay_every_steady_frame_on_one_ring():
    report = run_lm("cuda", streams=3)
    # The first two frames ever are verified beside the stock call; every later one replays, the
    # depformer's sampling included.
    for name in ("lm_step", "depformer_step"):
        assert report.replays[name].counters.as_dict() == {
            "calls": 3 * FRAMES - 2,
            "captures": 1,
            "replays": 3 * FRAMES - 2,
            "eager": 0,
            "invalidations": 0,
            "fallbacks": {},
        }


def test_a_per_call_region_is_declared_without_paths_and_only_for_a_ring():
    lm_gen = LMGen(build_models(TINY).lm)
    contract = contract_for(TINY)
    regions = MOSHI_LM_BINDING.regions
    with pytest.raises(
        BindingError,
        match=r"binding.regions\[1\]: region 'depformer_kv' is per_call \(allocated inside "
        r"each call\): it has no paths to keep, got at=\('self.x',\) out=\(\)",
    ):
        transform(
            lm_gen,
            contract,
            dataclasses.replace(
                MOSHI_LM_BINDING, regions=(regions[0], RegionBinding("depformer_kv", at=("self.x",), per_call=True))
            ),
        )
    with pytest.raises(
        BindingError,
        match=r"binding.regions\[2\].per_call: region 'mimi_decoder_kv' is allocated inside "
        r"each call of its operator, but no bound operator has it as its region",
    ):
        transform(
            lm_gen,
            contract,
            dataclasses.replace(MOSHI_LM_BINDING, regions=(*regions, RegionBinding("mimi_decoder_kv", per_call=True))),
        )


def mimi_stream(encode, decode, mimi, pcm: torch.Tensor) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], set]:
    """Each 1,920-sample frame encoded to codes, the codes decoded back to PCM."""
    outputs, addresses = [], set()
    with torch.no_grad():
        for start in range(0, pcm.shape[-1], FRAME_SIZE):
            codes = encode(pcm[..., start : start + FRAME_SIZE])
            outputs.append((codes, decode(codes)))
            rings = [
                t.transformer.layers[0].self_attn._streaming_state.kv_cache.cache
                for t in (mimi.encoder_transformer, mimi.decoder_transformer)
            ]
            addresses.add(tuple(ring.data_ptr() for ring in rings))
    return outputs, addresses


def run_mimi(device: str, streams: int):
    from moshi.utils.compile import no_cuda_graph

    # The vendor's own CUDA graphs off (its flag, read on every call): the pipeline's replay runs instead.
    with no_compile(), no_cuda_graph():
        stock, mimi = build_models(TINY, device).mimi, build_models(TINY, device).mimi
        stock.streaming_forever(1)
        mimi.streaming_forever(1)
        bound, report = transform(mimi, contract_for(TINY), MIMI_BINDING)
        for seed in range(streams):
            pcm = random_pcm(FRAMES, seed, device=device)
            expected, _ = mimi_stream(stock.encode, stock.decode, stock, pcm)
            actual, addresses = mimi_stream(bound.operators["mimi_encode"], bound.operators["mimi_decode"], mimi, pcm)
            for got, want in zip(actual, expected, strict=True):
                assert all(torch.equal(a, e) for a, e in zip(got, want, strict=True))
            assert len(addresses) == 1
            stock.reset_streaming()
            mimi.reset_streaming()
    return report


def test_mimi_streams_bit_identically_through_the_pipeline_from_its_binding():
    report = run_mimi("cpu", streams=2)
    encode, decode = report.operators["mimi_encode"], report.operators["mimi_decode"]
    # The first encode ever computes each codebook's table and keeps it in a buffer registered empty
    # (a guarded value): that call is a program of its own, every later one reads the table.
    assert [cls.name for cls in encode.classes.values()] == ["mimi_encode[n=2,L=250]", "mimi_encode[n=2,L=250]#2"]
    assert [cls.name for cls in decode.classes.values()] == ["mimi_decode[n=2,L=250]"]
    # `**` found every piece of state at this depth: the encoder's 7 streaming convolutions (buffer
    # and first-call flag each), its transformer's offsets and ring end, and the ring itself (the
    # decoder's ring too: both paths start at the model, so encode passes it through untouched).
    assert [s.path.split("self.", 1)[1] for s in encode.sites] == [
        "encoder_transformer.transformer.layers.0.self_attn._streaming_state.kv_cache.cache",
        "decoder_transformer.transformer.layers.0.self_attn._streaming_state.kv_cache.cache",
        *[f"encoder.model.{i}._streaming_state.previous" for i in (0, 2, 4, 6, 8, 10)],
        *[f"encoder.model.{i}._streaming_state.first" for i in (0, 2, 4, 6, 8, 10)],
        "downsample.conv._streaming_state.previous",
        "downsample.conv._streaming_state.first",
        "encoder_transformer.transformer.layers.0.self_attn._streaming_state.offset",
        "encoder_transformer.transformer._streaming_state.offsets",
        "encoder_transformer.transformer.layers.0.self_attn._streaming_state.kv_cache.end_offset",
    ]
    for op, verified in ((encode, 3), (decode, 2)):
        assert op.counters.graph_calls == op.counters.calls == 2 * FRAMES and op.counters.stock == 0
        assert op.counters.verified == verified
    assert all(not s.rewritten for s in report.sites)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_mimi_replays_every_steady_frame():
    report = run_mimi("cuda", streams=3)
    # encode: its first call ever (the codebooks' tables not computed yet) is a class of its own,
    # verified only; the steady class is verified twice, then replays
    for name, verified in (("mimi_encode", 3), ("mimi_decode", 2)):
        assert report.replays[name].counters.as_dict() == {
            "calls": 3 * FRAMES - verified,
            "captures": 1,
            "replays": 3 * FRAMES - verified,
            "eager": 0,
            "invalidations": 0,
            "fallbacks": {},
        }


def test_a_deep_pattern_has_no_out_counterpart():
    mimi = build_models(TINY).mimi
    with pytest.raises(BindingError, match=r"binding.regions\[0\].out: '\*\*' matches paths of any depth"):
        transform(
            mimi,
            contract_for(TINY),
            dataclasses.replace(
                MIMI_BINDING,
                regions=(
                    RegionBinding("mimi_encoder_kv", at=("self.**.cache",), out=("return.**.cache",)),
                    MIMI_BINDING.regions[1],
                ),
            ),
        )
