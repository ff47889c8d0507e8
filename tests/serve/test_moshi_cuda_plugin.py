"""Moshi served on a GPU: the plugin ticks in one worker process (or the server process), its sessions the slots of one
batch whose stages replay as CUDA graphs, and a session's audio is its slot's row of the vendor's
own batched eager loop over the same ticks (frames, joins, seed), bit for bit. At SMALL size
(``moshi-small-cuda``): the same plugin and device path as ``moshi-full``, with weights that build
in seconds. ``bench/serve_load.py --plugin moshi-full`` measures FULL."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from servekit import AUDIO, Server, deltas_of, read_wav, run, same, slot_reference, two_streams_are_their_slots_rows

from cadence_fx.determinism import pin_deterministic
from cadence_fx.models.moshi_stream import SMALL, build_models, random_pcm
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
    """The plugin's weights, built here on the GPU from SMALL and its seed as the plugin builds them.
    The references run under the deterministic kernels the ticking process pins (a worker pins its own)."""
    pin_deterministic()
    return build_models(SMALL, device="cuda")


def user_frames(n: int, seed: int) -> list[np.ndarray]:
    return list(random_pcm(n, seed=seed).reshape(n, FRAME_SAMPLES).numpy())


@pytest.mark.parametrize("processes", [1, 0])
def test_interleaved_streams_on_cuda_are_each_their_slots_row_and_every_call_replays(models, processes):
    """Two interleaved streams, each its slot's row of the vendor's batched loop, in a worker or
    the server process."""
    turns = [user_frames(4, seed=50), user_frames(4, seed=51)]
    plugin = MoshiPlugin(size="small", device="cuda", record=True, processes=processes)
    try:
        plugin.reserve(2)
    except BaseException:
        plugin.close()
        raise
    described = two_streams_are_their_slots_rows(plugin, models, turns, 4)

    assert (plugin.name, described["device"], described["processes"]) == ("moshi-small-cuda", "cuda", processes)
    # The ticking process's own device memory, a worker's included.
    (memory,) = described["memory_per_process"]
    assert memory["peak_allocated_bytes"] > 0 and memory["reserved_bytes_max"] >= memory["peak_allocated_bytes"]
    assert (described["slots_per_process"], described["frames"]["ticks"]) == ([2], 14)  # 4 fed and 3 of silence each
    # The batch ticked three times while it was built: its stages' two verified calls, then their captures.
    assert described["warm_up_ticks_per_process"] == [3]
    replays = described["transform"]["replays"]
    for name in ("mimi_encode", "lm_step", "depformer_step", "mimi_decode"):
        # Each stage captured its graph while the batch was built; every call since replayed it.
        assert replays[name]["captures"] == 1 and replays[name]["eager"] == 0, (name, replays[name])
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

    served = MoshiPlugin(size="small", device="cuda", max_reply_frames=reply_frames, record=True)
    with background_server(lambda: served, Limits(max_sessions=2)) as handle:
        events = run(scenario(Server(handle)))

    deltas = [e for e in events if e["type"] == "response.output_audio.delta"]
    assert [d["audio_offset"] for d in deltas] == list(range(0, reply_frames * FRAME_SAMPLES, FRAME_SAMPLES))
    padded = np.concatenate([samples, np.zeros(fed * FRAME_SAMPLES - len(samples), dtype=np.float32)])
    sent, got = slot_reference(models, served, place=0, slot=0, session=0)
    assert same(sent, list(padded.reshape(fed, FRAME_SAMPLES)) + [SILENCE] * (reply_frames - 1))
    assert rate == 24_000
    assert deltas_of(events) == wire_audio.encode_samples(np.concatenate(got[fed - 1 :]), PCM24K)  # from the turn's last frame
