"""State rule + carry + replay together on the real full-size Token2Wav flow and HiFT (GPU)."""

import pytest
import torch

from cadence_fx import transform
from cadence_fx.determinism import pin_deterministic
from cadence_fx.models.token2wav_carry import CarryStream, reference_flow
from cadence_fx.models.token2wav_stream import StockStream, build_hift, random_chunks, random_prompt

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

BLOCKS, CHUNKS = 3, 6


def _stream(stream, turns):
    mels, pcm, addresses = [], [], set()
    for turn, chunks in enumerate(turns):
        torch.manual_seed(turn)
        torch.cuda.manual_seed(turn)
        stream.setup() if turn == 0 else stream.reset_turn()
        for i, tokens in enumerate(chunks):
            out = stream.step(tokens, last_chunk=i == len(chunks) - 1)
            mels.append(out.mel.clone())
            pcm.append(out.speech.clone())
            addresses.add(stream.stream_cache["estimator_att_cache"].data_ptr())
    return mels, pcm, addresses


@torch.no_grad()
def test_transformed_stream_replays_bit_identical_to_eager():
    pin_deterministic()
    flow, contract, prompt_tokens = reference_flow("full")
    flow, hift = flow.cuda(), build_hift(device="cuda")
    prompt = random_prompt(0, n_tokens=prompt_tokens, device="cuda")
    turns = [random_chunks(50 + b, CHUNKS, device="cuda") for b in range(BLOCKS)]
    eager = _stream(StockStream(flow, hift, prompt), turns)
    again = _stream(StockStream(flow, hift, prompt), turns)
    assert all(torch.equal(a, b) for a, b in zip(eager[1], again[1])), "eager does not repeat itself"

    transformed, report = transform((flow, hift), contract)
    operators = transformed.bound.operators
    # The warm-up turns at construction verified every class and captured it; count from here.
    before = {name: (op.counters.stock, op.replay.counters.replays) for name, op in operators.items()}
    hift_before = report.replays["hift"].counters.replays
    mels, pcm, addresses = _stream(CarryStream(transformed, prompt), turns)
    assert [i for i, (a, b) in enumerate(zip(mels, eager[0])) if not torch.equal(a, b)] == []
    assert [i for i, (a, b) in enumerate(zip(pcm, eager[1])) if not torch.equal(a, b)] == []
    assert addresses == {report.carries["estimator_att_cache"].address}
    for name, op in operators.items():
        engine = op.replay.counters
        # The setup's call (the prompt: no class of the catalog) runs the stock code; every chunk replays.
        assert (op.counters.stock - before[name][0], engine.replays - before[name][1], engine.invalidations) == (
            1,
            BLOCKS * CHUNKS,
            0,
        ), op.explain() + "\n" + op.replay.explain()
        assert engine.captures == 4  # L = 302, 352, 402 and the 56-frame flush at 402
    hift_counters = report.replays["hift"].counters
    assert (hift_counters.replays - hift_before, hift_counters.invalidations) == (BLOCKS * CHUNKS, 0), report.replays[
        "hift"
    ].explain()
