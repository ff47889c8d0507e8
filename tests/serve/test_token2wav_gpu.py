"""``token2wav-full`` on a GPU through a real uvicorn server: MiniCPM-o 4.5's Token2Wav at full
size, its CFM loop, encoder and HiFT replayed as CUDA graphs, two sessions at once on two replay
lanes; each session's audio deltas are the stock vendor stream of its reply's stand-in tokens from
its stream's seed, sample for sample, as if it ran alone."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from servekit import Server, deltas_of, run, silence

from cadence_fx.models.token2wav_carry import reference_flow, warm_up_chunks
from cadence_fx.models.token2wav_stream import StockStream, build_hift, random_chunks
from cadence_fx.serve.app import background_server, health_of
from cadence_fx.serve.plugins.token2wav import MIN_REPLY_CHUNKS, WARM_UP_CHUNKS, Token2WavPlugin, rng_seed, token_seed
from cadence_fx.serve.protocol import PCM24K
from cadence_fx.serve.protocol import audio as wire_audio
from cadence_fx.serve.session import Limits

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


def test_two_sessions_on_two_lanes_each_hear_the_stock_vendor_stream_of_their_tokens():
    plugins = []

    def build():
        plugins.append(Token2WavPlugin("full", seed=3, lanes=2))
        return plugins[-1]

    async def scenario(server: Server) -> tuple[list[list[dict]], list[dict], dict]:
        socks = [await server.connect(), await server.connect()]  # streams 0 and 1: lanes 0 and 1
        health = server.on_loop(lambda: health_of(server.handle.manager))
        events = await asyncio.gather(*(sock.reply_to(silence(1000), timeout=30) for sock in socks))
        for sock in socks:
            await sock.close()
        return list(events), [sock.rate_limits for sock in socks], health

    # A full-size lane exports its flow's classes at start-up (about 161 s for the first on the H200,
    # bench/results/token2wav_setup_full.json): the server's start waits for both lanes.
    with background_server(build, Limits(max_sessions=2), start_timeout_s=900) as handle:
        events, rate_limits, health = run(scenario(Server(handle)))
        described = plugins[0].describe()
    plugin = plugins[0]
    # Admission is a lane with room: one stream on each of the two lanes, none left.
    assert [limits[0]["remaining"] for limits in rate_limits] == [1, 0]
    assert (health["free_slots"], health["admits"]) == (0, 0)
    assert [lane["chunks"] for lane in described["lanes"]] == [MIN_REPLY_CHUNKS, MIN_REPLY_CHUNKS]
    flow, _, _ = reference_flow("full")
    stock = StockStream(flow.cuda(), build_hift(device="cuda"), plugin.prompt)
    for stream, got in enumerate(events):
        tokens = random_chunks(token_seed(stream, 0), MIN_REPLY_CHUNKS, device="cuda")
        with torch.random.fork_rng(devices=[0]), torch.no_grad():
            torch.cuda.manual_seed(rng_seed(plugin.seed, stream))
            stock.setup()
            expected = np.concatenate(
                [
                    stock.step(t, last_chunk=i == MIN_REPLY_CHUNKS - 1).speech.float().reshape(-1).cpu().numpy()
                    for i, t in enumerate(tokens)
                ]
            )
        assert deltas_of(got) == wire_audio.encode_samples(expected, PCM24K), f"stream {stream}"
    # Every chunk after each lane's construction-time prompt setup replayed: no eager call in a
    # session. Each lane's flow also replays its transform's own warm-up turns, less each class's
    # two verified visits (4 classes); HiFT is not in that warm-up.
    chunks = 2 * (WARM_UP_CHUNKS + MIN_REPLY_CHUNKS)
    flow_warm_up = 2 * (warm_up_chunks("cuda") - 2 * 4)
    replays = described["replays"]
    assert replays["cfm_loop"]["fallbacks"] == {} and replays["cfm_loop"]["replays"] == chunks + flow_warm_up
    assert replays["conformer_encoder"]["replays"] == chunks + flow_warm_up
    assert replays["hift"]["fallbacks"] == {} and replays["hift"]["replays"] == chunks
