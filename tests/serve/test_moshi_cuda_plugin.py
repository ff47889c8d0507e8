"""Moshi served on a GPU: the plugin ticks in the server process, its stages replayed as CUDA
graphs, and a session's audio is the vendor's own eager stream of the same ticks and seed, bit for
bit. At SMALL size (``moshi-small-cuda``): the same plugin and device path as ``moshi-full``,
with weights that build in seconds. ``bench/serve_load.py --plugin moshi-full`` measures FULL."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moshi.utils.compile import no_cuda_graph
from servekit import AUDIO, Server, deltas_of, interleaved_replies, read_wav, run

from cadence_fx.models.moshi_stream import SMALL, build_models, random_pcm, stream_reference
from cadence_fx.serve.app import background_server
from cadence_fx.serve.plugins.moshi import FRAME_SAMPLES, SILENCE, MoshiPlugin
from cadence_fx.serve.protocol import PCM24K
from cadence_fx.serve.protocol import audio as wire_audio
from cadence_fx.serve.session import Limits

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


@pytest.fixture(scope="module")
def models():
    """The plugin's weights, built here on the GPU from SMALL and its seed as the plugin builds them."""
    return build_models(SMALL, device="cuda")


def user_frames(n: int, seed: int) -> list[np.ndarray]:
    return list(random_pcm(n, seed=seed).reshape(n, FRAME_SAMPLES).numpy())


def stock(models, ticks: list[np.ndarray], seed: int = 0) -> np.ndarray:
    """The vendor's eager stream of these tick inputs on the GPU (sampling on): row ``k`` is the
    output of tick ``k + 1``. Run after the plugin's transform, so under the same pinned kernels."""
    pcm = torch.from_numpy(np.concatenate(ticks)).view(1, 1, -1).to("cuda")
    with no_cuda_graph():
        out = stream_reference(models, pcm, sampling=True, seed=seed).pcm
    return out.reshape(-1, FRAME_SAMPLES).cpu().numpy()


def test_interleaved_streams_on_cuda_are_each_the_vendor_stream_and_every_call_replays(models):
    turns = [user_frames(4, seed=50), user_frames(4, seed=51)]
    plugin = MoshiPlugin(size="small", device="cuda")
    try:
        plugin.reserve(2)
        out_a, out_b = interleaved_replies(plugin.open_stream(), plugin.open_stream(), turns, 4)
        described = plugin.describe()
    finally:
        plugin.close()

    assert np.array_equal(np.stack(out_a), stock(models, turns[0] + [SILENCE] * 4)[3:7])
    assert np.array_equal(np.stack(out_b), stock(models, turns[1] + [SILENCE] * 4)[3:7])
    assert (plugin.name, described["device"], described["processes"]) == ("moshi-small-cuda", "cuda", 0)
    assert (described["replicas"], described["replicas_on_demand"], described["frames"]["ticks"]) == (2, 0, 16)
    replays = described["transform"]["replays"]
    for name in ("mimi_encode", "lm_step", "mimi_decode", "depformer_step[sampling]"):
        # Each replica captured its graphs while it was built; in the sessions every call replayed.
        assert replays[name]["captures"] == 2 and replays[name]["eager"] == 0, (name, replays[name])
        assert replays[name]["replays"] == replays[name]["calls"], (name, replays[name])


def test_a_session_over_uvicorn_on_cuda_delivers_the_vendors_samples(models):
    samples, rate = read_wav(AUDIO / "question_24k.wav")
    question = wire_audio.encode_samples(samples, PCM24K)
    fed = -(-len(samples) // FRAME_SAMPLES)  # the commit pads the last frame
    reply_frames = 8

    async def scenario(server: Server):
        sock = await server.connect("/v1/duplex")
        events = await sock.reply_to(question, timeout=50)
        await sock.close()
        return events

    factory = lambda: MoshiPlugin(size="small", device="cuda", max_reply_frames=reply_frames)  # noqa: E731
    with background_server(factory, Limits(max_sessions=2)) as handle:
        events = run(scenario(Server(handle)))

    deltas = [e for e in events if e["type"] == "response.output_audio.delta"]
    assert [d["audio_offset"] for d in deltas] == list(range(0, reply_frames * FRAME_SAMPLES, FRAME_SAMPLES))
    padded = np.concatenate([samples, np.zeros(fed * FRAME_SAMPLES - len(samples), dtype=np.float32)])
    ticks = list(padded.reshape(fed, FRAME_SAMPLES)) + [SILENCE] * reply_frames
    want = stock(models, ticks)[fed - 1 : fed - 1 + reply_frames]
    assert rate == 24_000
    assert deltas_of(events) == wire_audio.encode_samples(want.reshape(-1), PCM24K)
