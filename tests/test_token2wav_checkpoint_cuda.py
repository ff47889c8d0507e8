"""``token2wav-full`` on a checkpoint in the published format at full size (random weights, written
here): a reply's audio is, sample for sample, the vendor's own ``Token2wav.stream`` of the same
tokens from the same files, prompt and RNG state, with the CFM loop, encoder and HiFT replayed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from checkpointkit import vendor_token2wav, write_assets

from cadence_fx.models import token2wav_checkpoint as checkpoint
from cadence_fx.models.token2wav_carry import warm_up_chunks
from cadence_fx.models.token2wav_stream import FULL_DEPTH, PROMPT_TOKENS, SILENCE_TOKEN, random_chunks, random_prompt
from cadence_fx.serve.plugins.token2wav import (
    FRAME_SAMPLES,
    INPUT_RATE,
    MIN_REPLY_CHUNKS,
    WARM_UP_CHUNKS,
    Token2WavPlugin,
    rng_seed,
    token_seed,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

SEED = 7


def test_a_reply_on_the_full_size_checkpoint_is_the_vendors_own_stream(tmp_path):
    assets = tmp_path / "MiniCPM-o-4_5" / "assets" / "token2wav"
    write_assets(assets, FULL_DEPTH)
    prompt = random_prompt(3, n_tokens=PROMPT_TOKENS)
    checkpoint.save_prompt(prompt, tmp_path / "voice.safetensors")

    plugin = Token2WavPlugin(
        "full", seed=SEED, weights=assets.parents[1], prompt=tmp_path / "voice.safetensors", lanes=1
    )  # the checkpoint is under test here: one lane
    stream = plugin.open_stream()
    for _ in range(round(MIN_REPLY_CHUNKS * INPUT_RATE / FRAME_SAMPLES)):
        stream.feed(np.zeros(FRAME_SAMPLES, dtype=np.float32))
    stream.begin_response()
    heard = []
    while (chunk := stream.step()) is not None:
        heard.append(chunk)
    described = plugin.describe()
    del plugin, stream

    # The vendor's Token2wav on the same files; its prompt state set as set_stream_cache sets it
    # after _prepare_prompt (whose ONNX models are not written here).
    vendor = vendor_token2wav(assets, seed=SEED, on_cpu=False)
    tokens, mels, spk = (t.cuda() for t in (prompt.tokens, prompt.mels, prompt.spk))
    lengths = (torch.tensor([tokens.shape[1]], device="cuda"), torch.tensor([mels.shape[1]], device="cuda"))
    vendor.cache = (tokens, lengths[0], spk, mels, lengths[1])
    chunks = random_chunks(token_seed(0, 0), MIN_REPLY_CHUNKS)
    expected = []
    with torch.random.fork_rng(devices=[0]), torch.no_grad():
        torch.cuda.manual_seed(rng_seed(SEED, 0))
        pad = torch.full((1, 3), SILENCE_TOKEN, dtype=tokens.dtype, device="cuda")
        vendor.stream_cache = vendor.flow.setup_cache(torch.cat([tokens, pad], dim=1), mels, spk, n_timesteps=10)
        vendor.hift_cache_dict = dict(
            mel=torch.zeros(1, 80, 0, device="cuda"),
            source=torch.zeros(1, 1, 0, device="cuda"),
            speech=torch.zeros(1, 0, device="cuda"),
        )
        for i, chunk in enumerate(chunks):
            expected.append(
                vendor.stream(chunk[0].tolist(), None, last_chunk=i == MIN_REPLY_CHUNKS - 1, return_waveform=True).reshape(-1)
            )

    assert len(heard) == MIN_REPLY_CHUNKS
    assert [np.array_equal(a, b) for a, b in zip(heard, expected)] == [True] * MIN_REPLY_CHUNKS
    replays, chunks_run = described["replays"], WARM_UP_CHUNKS + MIN_REPLY_CHUNKS
    # The flow's bound operators also replay the transform's own warm-up turns, less each class's
    # two verified visits (4 classes); HiFT is not in that warm-up.
    flow_warm_up = warm_up_chunks("cuda") - 2 * 4
    assert replays["cfm_loop"]["replays"] == chunks_run + flow_warm_up and replays["hift"]["replays"] == chunks_run
