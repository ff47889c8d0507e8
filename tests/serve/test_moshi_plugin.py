"""``moshi-tiny``, the default model: a stream's reply is the stock vendor stream of the same
ticks and seed, bit for bit, whichever worker process ticks it and whatever the other sessions do;
turns, cancel and clear map onto the duplex clock as documented; the replica pool is built ahead
of the first session; and a real session over uvicorn delivers exactly the vendor's samples."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading

import httpx
import numpy as np
import pytest

import torch
from servekit import AUDIO, Server, deltas_of, drain, interleaved_replies, read_wav, run

from cadence_fx.models.moshi_stream import SMALL, TINY, build_models, random_pcm, stream_reference
from cadence_fx.serve.app import background_server
from cadence_fx.serve.plugins import DEFAULT_PLUGIN, load_plugin, plugin_names
from cadence_fx.serve.plugins.moshi import FRAME_SAMPLES, SILENCE, MoshiPlugin
from cadence_fx.serve.protocol import PCM24K
from cadence_fx.serve.protocol import audio as wire_audio
from cadence_fx.serve.session import Limits


@pytest.fixture(scope="module")
def plugin():
    moshi = MoshiPlugin()
    yield moshi
    moshi.close()


@pytest.fixture(scope="module")
def models(plugin):
    """The plugin's weights, built here from its configuration and seed as each worker builds them."""
    return build_models(plugin.config)


@pytest.fixture(scope="module", autouse=True)
def one_thread_like_the_plugin():
    """The reference runs here with the workers' thread count: kernels may split reductions by thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def user_frames(n: int, seed: int) -> list[np.ndarray]:
    return list(random_pcm(n, seed=seed).reshape(n, FRAME_SAMPLES).numpy())


def stock(models, ticks: list[np.ndarray], seed: int = 0) -> np.ndarray:
    """The vendor stream of these tick inputs (sampling on): row ``k`` is the output of tick ``k + 1``."""
    pcm = torch.from_numpy(np.concatenate(ticks)).view(1, 1, -1)
    out = stream_reference(models, pcm, sampling=True, seed=seed).pcm
    return out.reshape(-1, FRAME_SAMPLES).numpy()


def feed(stream, frames: list[np.ndarray]) -> None:
    for frame in frames:
        stream.feed(frame)


def reply(stream) -> list[np.ndarray]:
    stream.begin_response()
    return drain(stream)


def test_registered_as_the_default_without_loading_the_vendor_on_import():
    probe = "import sys, cadence_fx.serve.plugins as p; print(p.DEFAULT_PLUGIN, 'moshi' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["moshi-tiny", "False"]
    assert {DEFAULT_PLUGIN, "moshi-small", "moshi-full"} <= set(plugin_names())


def test_native_clock_is_24khz_frames_of_80ms(plugin):
    info = plugin.info
    assert (info.name, info.input_rate, info.output_rate, info.frame_samples) == ("moshi-tiny", 24_000, 24_000, 1920)


def test_tiny_differs_from_small_only_in_depth_and_width(plugin):
    def changes(tiny: dict, small: dict) -> dict:
        return {key: (small[key], tiny[key]) for key in small if tiny[key] != small[key]}

    assert plugin.config == TINY and plugin.processes == 2
    assert changes(TINY.lm_kwargs, SMALL.lm_kwargs) == {
        "dim": (128, 32),
        "num_layers": (2, 1),
        "depformer_dim": (64, 32),
        "depformer_dim_feedforward": (128, 64),
        "depformer_num_layers": (2, 1),
    }
    assert changes(TINY.mimi["seanet"], SMALL.mimi["seanet"]) == {
        "n_filters": (8, 4),
        "dimension": (128, 32),
        "n_residual_layers": (1, 0),
    }
    assert changes(TINY.mimi["quantizer"], SMALL.mimi["quantizer"]) == {
        "dimension": (64, 8),
        "input_dimension": (128, 32),
        "output_dimension": (128, 32),
    }
    assert changes(TINY.mimi["transformer"], SMALL.mimi["transformer"]) == {
        "d_model": (128, 32),
        "num_layers": (2, 1),
        "dim_feedforward": (256, 64),
        "input_dimension": (128, 32),
        "output_dimensions": ([128], [32]),
    }
    assert {k: v for k, v in TINY.mimi.items() if not isinstance(v, dict)} == {
        k: v for k, v in SMALL.mimi.items() if not isinstance(v, dict)
    }


def test_each_worker_process_ticks_on_a_core_of_its_own_when_there_are_enough(plugin):
    available = sorted(os.sched_getaffinity(0))
    pinned = [[available[0]], [available[1]]] if len(available) >= 2 else []
    assert plugin.cores == pinned
    assert [sorted(os.sched_getaffinity(w.process.pid)) for w in plugin._places] == (pinned or [available] * 2)


def test_replies_are_the_vendor_stream_of_the_same_ticks_bit_for_bit(plugin, models):
    first, second = user_frames(6, seed=11), user_frames(3, seed=12)
    stream = plugin.open_stream()
    feed(stream, first)
    reply_1 = reply(stream)
    feed(stream, second)
    reply_2 = reply(stream)
    listened = stream.listened
    stream.close()

    # Ticks: 6 user, 6 silence (reply), 3 user, 3 silence (reply); tick k's output is row k - 1.
    want = stock(models, first + [SILENCE] * 6 + second + [SILENCE] * 3)
    assert np.array_equal(np.stack(reply_1), want[5:11])
    assert np.array_equal(np.stack(reply_2), want[14:17])
    assert listened == 5 + 3  # what Moshi said while the user spoke; tick 0 says nothing


@pytest.mark.parametrize(("fed", "frames", "ticks"), [(0, 1, 2), (1, 1, 2), (5, 5, 10)])
def test_a_reply_is_as_long_as_the_turn_in_whole_frames(plugin, fed, frames, ticks):
    stream = plugin.open_stream()
    feed(stream, user_frames(fed, seed=13) if fed else [])
    chunks = reply(stream)
    stream.close()
    assert [(c.shape, c.dtype) for c in chunks] == [((FRAME_SAMPLES,), np.float32)] * frames
    # With nothing fed, the reply's first tick only passes the acoustic delay.
    assert (stream.ticks, stream.replied) == (ticks, frames)


def test_cancel_drops_the_rest_of_the_reply_and_the_clock_goes_on(plugin, models):
    first, second = user_frames(4, seed=14), user_frames(2, seed=15)
    stream = plugin.open_stream()
    feed(stream, first)
    stream.begin_response()
    assert stream.step() is not None
    stream.cancel()
    assert stream.step() is None
    feed(stream, second)
    after = reply(stream)
    stream.close()

    want = stock(models, first + [SILENCE] + second + [SILENCE] * 2)
    assert np.array_equal(np.stack(after), want[6:8])


def test_a_frame_fed_during_a_reply_is_the_replys_next_frame(plugin, models):
    turn, overlap = user_frames(3, seed=16), user_frames(1, seed=17)
    stream = plugin.open_stream()
    feed(stream, turn)
    stream.begin_response()
    out = [stream.step()]
    feed(stream, overlap)  # the user talks over the reply; no barge-in cancelled it
    out += drain(stream)
    next_turn = stream.turn_frames
    stream.close()

    want = stock(models, turn + [SILENCE] + overlap + [SILENCE])
    assert np.array_equal(np.stack(out), want[2:5])
    assert next_turn == 1


def test_clear_input_shortens_the_turn_but_the_model_heard_it(plugin, models):
    cleared, kept = user_frames(5, seed=18), user_frames(2, seed=19)
    stream = plugin.open_stream()
    feed(stream, cleared)
    stream.clear_input()
    feed(stream, kept)
    out = reply(stream)
    stream.close()

    want = stock(models, cleared + kept + [SILENCE] * 2)
    assert np.array_equal(np.stack(out), want[6:8])


def test_interleaved_sessions_each_get_their_own_replica_and_the_same_audio(plugin, models):
    frames = user_frames(3, seed=20)
    out_a, out_b = interleaved_replies(plugin.open_stream(), plugin.open_stream(), [frames, frames], 3)
    before = plugin.describe()
    c = plugin.open_stream()
    feed(c, frames)
    out_c = reply(c)
    c.close()
    after = plugin.describe()

    want = stock(models, frames + [SILENCE] * 3)[2:5]
    assert np.array_equal(np.stack(out_a), want) and np.array_equal(np.stack(out_b), want)
    assert np.array_equal(np.stack(out_c), want)  # a reused replica starts from the base state
    # a and b went to the two workers (fewest open streams first), c to the first one again.
    assert before["replicas_per_process"] == after["replicas_per_process"] == [1, 1]
    assert (after["replicas"], after["replicas_on_demand"]) == (2, 2)  # no reserve: built by the first ticks


def test_sessions_ticking_at_once_on_both_workers_keep_their_own_audio(plugin, models):
    turns = {seed: user_frames(4, seed=seed) for seed in (30, 31, 32, 33)}
    replies: dict[int, list[np.ndarray]] = {}

    def converse(seed: int) -> None:
        stream = plugin.open_stream()
        feed(stream, turns[seed])
        replies[seed] = reply(stream)
        stream.close()

    threads = [threading.Thread(target=converse, args=(seed,)) for seed in turns]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    for seed, frames in turns.items():
        assert np.array_equal(np.stack(replies[seed]), stock(models, frames + [SILENCE] * 4)[3:7]), seed


def test_describe_counts_every_tick_in_the_transforms_replay_counters(plugin):
    before = plugin.describe()
    stream = plugin.open_stream()
    feed(stream, user_frames(2, seed=21))
    reply(stream)
    stream.close()
    after = plugin.describe()

    ticks = after["frames"]["ticks"] - before["frames"]["ticks"]
    calls = {
        name: after["transform"]["replays"][name]["calls"] - before["transform"]["replays"][name]["calls"]
        for name in ("mimi_encode", "lm_step", "mimi_decode")
    }
    assert ticks == 4
    assert calls == {"mimi_encode": 4, "lm_step": 4, "mimi_decode": 3}  # tick 0 decodes nothing
    assert any(stamp.startswith("replay: mimi_encode K=1") for stamp in after["transform"]["stamps"])


def test_a_session_over_uvicorn_delivers_the_vendors_samples(models, capfd):
    samples, rate = read_wav(AUDIO / "question_24k.wav")
    question = wire_audio.encode_samples(samples, PCM24K)
    fed = -(-len(samples) // FRAME_SAMPLES)  # the commit pads the last frame
    reply_frames = 8  # the cap, well under the turn's 56 frames

    async def scenario(server: Server):
        sock = await server.connect("/v1/duplex")
        events = await sock.reply_to(question, timeout=50)
        ledgers = server.on_loop(lambda: server.session(sock.session_id).ledgers.to_dict())
        await sock.close()
        return events, ledgers

    with background_server(lambda: MoshiPlugin(max_reply_frames=reply_frames), Limits(max_sessions=3)) as handle:
        progress = capfd.readouterr().err
        events, ledgers = run(scenario(Server(handle)))
        described = httpx.get(handle.http_url + "/v1/models").json()["data"][0]["plugin"]

    # The server reserved its 3 sessions' replicas at startup: 2 per worker, before any session.
    lines = re.findall(r"moshi-tiny: replica (\d)/4 ready \(\d+\.\d s\)", progress)
    assert lines == ["1", "2", "3", "4"]
    assert (described["replicas_per_process"], described["replicas_on_demand"], described["streams"]) == ([2, 2], 0, 1)
    assert described["frames"]["ticks"] == fed + reply_frames

    assert rate == 24_000
    committed = next(e for e in events if e["type"] == "input_audio_buffer.committed")
    assert committed["audio_bytes"] == len(question)
    deltas = [e for e in events if e["type"] == "response.output_audio.delta"]
    assert [d["audio_offset"] for d in deltas] == list(range(0, reply_frames * FRAME_SAMPLES, FRAME_SAMPLES))
    assert events[-1]["playback"]["audio_samples"] == reply_frames * FRAME_SAMPLES
    assert (ledgers["input"]["fed_samples"], ledgers["input"]["padded_samples"]) == (
        fed * FRAME_SAMPLES,
        fed * FRAME_SAMPLES - len(samples),
    )
    assert ledgers["playback"]["generated_samples"] == ledgers["playback"]["delivered_samples"] == reply_frames * 1920

    padded = np.concatenate([samples, np.zeros(fed * FRAME_SAMPLES - len(samples), dtype=np.float32)])
    ticks = list(padded.reshape(fed, FRAME_SAMPLES)) + [SILENCE] * reply_frames
    want = stock(models, ticks)[fed - 1 : fed - 1 + reply_frames]
    audio = deltas_of(events)
    assert len(audio) == reply_frames * FRAME_SAMPLES * 2
    assert audio == wire_audio.encode_samples(want.reshape(-1), PCM24K)


def test_moshi_full_without_a_gpu_fails_at_once_naming_what_is_missing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError) as refused:
        load_plugin("moshi-full")
    message = str(refused.value)
    assert message.startswith("moshi-full runs on an NVIDIA GPU (device 'cuda') and there is none here: ")
    assert message.endswith("torch.cuda.is_available() is False. On a CPU, serve moshi-tiny or moshi-small.")


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"size": "huge"}, "unknown Moshi size 'huge'; expected one of tiny, small, full"),
        ({"device": "tpu"}, "unknown device 'tpu' for Moshi; expected 'cpu' or 'cuda'"),
        ({"processes": -1}, "processes must be 0 (ticks in the server process) or more, got -1"),
        ({"size": "full", "processes": 2}, "on cuda the ticks run in the server process (processes=0), not in 2 "),
        ({"processes": 0, "threads": 2}, "threads is the torch thread count of each worker process; "),
        ({"threads": 0}, "threads must be at least 1, got 0"),
    ],
)
def test_a_bad_size_device_or_place_is_refused_before_anything_is_built(options, error):
    with pytest.raises(ValueError) as refused:
        MoshiPlugin(**options)
    assert str(refused.value).startswith(error)


def test_ticks_in_the_server_process_are_the_vendor_stream_bit_for_bit(models):
    """``processes=0``, the GPU's place, on a CPU: two interleaved streams, each the stock stream."""
    turns = [user_frames(3, seed=40), user_frames(3, seed=41)]
    local = MoshiPlugin(processes=0)
    try:
        out_a, out_b = interleaved_replies(local.open_stream(), local.open_stream(), turns, 3)
        described = local.describe()
    finally:
        local.close()

    assert np.array_equal(np.stack(out_a), stock(models, turns[0] + [SILENCE] * 3)[2:5])
    assert np.array_equal(np.stack(out_b), stock(models, turns[1] + [SILENCE] * 3)[2:5])
    assert (local.name, described["device"], described["processes"], described["threads"]) == ("moshi-tiny", "cpu", 0, None)
    assert (described["replicas_per_process"], described["frames"]["ticks"]) == ([2], 12)
