"""``token2wav-full`` on a GPU through a real uvicorn server: MiniCPM-o 4.5's Token2Wav at full
size, its CFM loop, encoder and HiFT replayed as CUDA graphs; the session's audio deltas are the
stock vendor stream of the reply's stand-in tokens from the stream's seed, sample for sample."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from servekit import Server, deltas_of, run, silence

from cadence_fx.models.token2wav_carry import reference_flow
from cadence_fx.models.token2wav_stream import StockStream, build_hift, random_chunks
from cadence_fx.serve.app import background_server
from cadence_fx.serve.plugins.token2wav import MIN_REPLY_CHUNKS, WARM_UP_CHUNKS, Token2WavPlugin, rng_seed, token_seed
from cadence_fx.serve.protocol import PCM24K
from cadence_fx.serve.protocol import audio as wire_audio
from cadence_fx.serve.session import Limits

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


def test_a_session_hears_the_stock_vendor_stream_of_its_tokens():
    plugins = []

    def build():
        plugins.append(Token2WavPlugin("full", seed=3))
        return plugins[-1]

    async def scenario(server: Server) -> list[dict]:
        sock = await server.connect()
        events = await sock.reply_to(silence(1000), timeout=30)
        await sock.close()
        return events

    with background_server(build, Limits(max_sessions=2)) as handle:
        events = run(scenario(Server(handle)))
        described = plugins[0].describe()
    plugin = plugins[0]
    flow, _, _ = reference_flow("full")
    stock = StockStream(flow.cuda(), build_hift(device="cuda"), plugin.prompt)
    tokens = random_chunks(token_seed(0, 0), MIN_REPLY_CHUNKS, device="cuda")
    with torch.random.fork_rng(devices=[0]), torch.no_grad():
        torch.cuda.manual_seed(rng_seed(plugin.seed, 0))
        stock.setup()
        expected = np.concatenate([stock.step(t, last_chunk=i == MIN_REPLY_CHUNKS - 1).speech.float().reshape(-1).cpu().numpy()
                                   for i, t in enumerate(tokens)])
    assert deltas_of(events) == wire_audio.encode_samples(expected, PCM24K)
    # Every chunk after the construction's prompt setup replayed: no eager call in a session.
    chunks = WARM_UP_CHUNKS + MIN_REPLY_CHUNKS
    replays = described["replays"]
    assert replays["cfm_loop"]["fallbacks"] == {"shape": 1} and replays["cfm_loop"]["replays"] == chunks
    assert replays["conformer_encoder"]["replays"] == chunks
    assert replays["hift"]["fallbacks"] == {} and replays["hift"]["replays"] == chunks
