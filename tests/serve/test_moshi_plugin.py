"""``moshi-tiny``, the default model: each place ticks its sessions as the slots of one batch,
and a stream's reply is its slot's row of the vendor's own batched loop over the same ticks (the
frames, joins and seed the place recorded), bit for bit, whatever the other sessions do; turns,
cancel and clear map onto the duplex clock as documented; admission is a free slot; the batch
is built ahead of the first session; and a real session over uvicorn delivers exactly the
vendor's samples."""

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
from servekit import AUDIO, Server, deltas_of, drain, read_wav, run, same, slot_reference, two_streams_are_their_slots_rows

from cadence_fx.models.moshi_stream import SMALL, TINY, build_models, random_pcm
from cadence_fx.serve.app import background_server
from cadence_fx.serve.plugins import DEFAULT_PLUGIN, load_plugin, plugin_names
from cadence_fx.serve.plugins.moshi import FRAME_SAMPLES, SILENCE, MoshiPlugin
from cadence_fx.serve.protocol import PCM24K
from cadence_fx.serve.protocol import audio as wire_audio
from cadence_fx.serve.runtime import SlotsFull
from cadence_fx.serve.session import Limits

SLOTS = 4


@pytest.fixture(scope="module")
def plugin():
    moshi = MoshiPlugin(slots=SLOTS, record=True)
    yield moshi
    moshi.close()


@pytest.fixture(scope="module")
def models(plugin):
    """The plugin's weights, built here from its configuration and seed as each worker builds them."""
    return build_models(plugin.config)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the reference and the runtime on one thread


def user_frames(n: int, seed: int) -> list[np.ndarray]:
    return list(random_pcm(n, seed=seed).reshape(n, FRAME_SAMPLES).numpy())


def opened(plugin) -> tuple:
    """A new stream and which of its slot's sessions it is (its slot's joins so far)."""
    stream = plugin.open_stream()
    return stream, sum(stream.slot in record.joins for record in plugin.history(stream.place))


def feed(stream, frames: list[np.ndarray]) -> None:
    for frame in frames:
        stream.feed(frame)


def reply(stream) -> list[np.ndarray]:
    stream.begin_response()
    return drain(stream)


def all_ticked(plugin, stream) -> None:
    """Returns once every frame fed to the stream's slot has been ticked."""
    scheduler = plugin._places[stream.place].scheduler
    while scheduler.queued(stream.slot):
        threading.Event().wait(0.01)


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

    assert plugin.config == TINY and plugin.processes == 1
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


def test_the_worker_process_ticks_on_a_core_of_its_own(plugin):
    available = sorted(os.sched_getaffinity(0))
    assert plugin.cores == [[available[0]]]
    assert [sorted(os.sched_getaffinity(w.process.pid)) for w in plugin._places] == [[available[0]]]


def test_replies_are_the_slots_row_of_the_vendors_batched_loop_bit_for_bit(plugin, models):
    first, second = user_frames(6, seed=11), user_frames(3, seed=12)
    stream, session = opened(plugin)
    feed(stream, first)
    reply_1 = reply(stream)
    feed(stream, second)
    reply_2 = reply(stream)
    listened = stream.listened
    stream.close()

    # Ticks: 6 user, 5 silence (reply), 3 user, 2 silence (reply); tick 0 says nothing. Each reply
    # opens with what Moshi said on its turn's last frame (ticks 5 and 13).
    sent, got = slot_reference(models, plugin, stream.place, stream.slot, session)
    assert same(sent, first + [SILENCE] * 5 + second + [SILENCE] * 2)
    assert got[0] is None and same(reply_1, got[5:11]) and same(reply_2, got[13:16])
    assert listened == 4 + 2  # what Moshi said while the user spoke, before each turn's last frame


@pytest.mark.parametrize(("fed", "frames", "ticks"), [(0, 1, 2), (1, 1, 2), (2, 2, 3), (5, 5, 9)])
def test_a_reply_is_as_long_as_the_turn_in_whole_frames(plugin, fed, frames, ticks):
    stream = plugin.open_stream()
    feed(stream, user_frames(fed, seed=13) if fed else [])
    chunks = reply(stream)
    stream.close()
    assert [(c.shape, c.dtype) for c in chunks] == [((FRAME_SAMPLES,), np.float32)] * frames
    # A reply opens with the output of the turn's last frame, then ticks its other frames on silence;
    # with nothing fed it ticks its own (and a stream's first tick only passes the acoustic delay).
    assert (stream.ticks, stream.replied) == (ticks, frames)


def test_cancel_drops_the_rest_of_the_reply_and_the_clock_goes_on(plugin, models):
    first, second = user_frames(4, seed=14), user_frames(2, seed=15)
    stream, session = opened(plugin)
    feed(stream, first)
    stream.begin_response()
    assert stream.step() is not None
    stream.cancel()
    assert stream.step() is None
    feed(stream, second)
    after = reply(stream)
    stream.close()

    # The reply opened with what Moshi said on the turn's last frame (tick 3) and ticked its next
    # two frames ahead of the cancel: the model heard that silence too. The next reply opens with
    # tick 7, the second turn's last frame.
    sent, got = slot_reference(models, plugin, stream.place, stream.slot, session)
    assert same(sent, first + [SILENCE] * 2 + second + [SILENCE] * 1)
    assert same(after, got[7:9])


def test_a_frame_fed_during_a_reply_comes_after_the_frames_ticked_ahead(plugin, models):
    turn, overlap = user_frames(3, seed=16), user_frames(1, seed=17)
    stream, session = opened(plugin)
    feed(stream, turn)
    stream.begin_response()
    out = [stream.step()]
    feed(stream, overlap)  # the user talks over the reply; no barge-in cancelled it
    out += drain(stream)
    next_turn = stream.turn_frames
    stream.close()

    # The reply opened with the turn's last frame (tick 2) and its first step ticked the other two
    # ahead on silence, before the overlap came: Moshi heard the overlap after its reply, and what
    # it said then is dropped, as is what it said on the turn's second frame.
    sent, got = slot_reference(models, plugin, stream.place, stream.slot, session)
    assert same(sent, turn + [SILENCE] * 2 + overlap)
    assert same(out, got[2:5])
    assert (next_turn, stream.listened) == (1, 2)


def test_a_reply_opens_with_the_turns_last_frame_when_its_tick_is_long_done(plugin, models):
    turn = user_frames(3, seed=20)
    stream, session = opened(plugin)
    feed(stream, turn)
    all_ticked(plugin, stream)  # before the reply is asked for
    out = reply(stream)
    ticks, listened = stream.ticks, stream.listened
    stream.close()

    sent, got = slot_reference(models, plugin, stream.place, stream.slot, session)
    assert same(sent, turn + [SILENCE] * 2)
    assert same(out, got[2:5])
    assert (ticks, listened, stream.listened) == (5, 1, 1)


def test_what_moshi_said_last_is_counted_as_listened_when_no_reply_opens_with_it(plugin):
    stream = plugin.open_stream()
    feed(stream, user_frames(3, seed=22))
    stream.close()
    assert (stream.ticks, stream.listened, stream.replied) == (3, 2, 0)  # the first tick says nothing


def test_clear_input_shortens_the_turn_but_the_model_heard_it(plugin, models):
    cleared, kept = user_frames(5, seed=18), user_frames(2, seed=19)
    stream, session = opened(plugin)
    feed(stream, cleared)
    stream.clear_input()
    feed(stream, kept)
    out = reply(stream)
    stream.close()

    sent, got = slot_reference(models, plugin, stream.place, stream.slot, session)
    assert same(sent, cleared + kept + [SILENCE] * 1)
    assert same(out, got[6:8])  # it opens with the last kept frame's output


def test_a_reply_cancelled_before_its_first_frame_counts_that_frame_as_listened(plugin):
    stream = plugin.open_stream()
    feed(stream, user_frames(3, seed=25))
    all_ticked(plugin, stream)  # the reply will open with an output already computed
    stream.begin_response()
    stream.cancel()
    stream.close()
    assert (stream.ticks, stream.listened, stream.replied) == (3, 2, 0)  # every output said: the first tick says nothing


def test_a_one_frame_reply_leaves_no_tick_waiting_for_its_slot(plugin):
    a, b = plugin.open_stream(), plugin.open_stream()
    feed(a, user_frames(2, seed=26))
    reply(a)
    before = plugin.describe()["follow_misses_per_process"][0]
    feed(a, user_frames(1, seed=27))
    assert len(reply(a)) == 1  # opens with that frame's output: nothing is asked for after it
    feed(b, user_frames(1, seed=28))
    b.close()
    a.close()
    assert plugin.describe()["follow_misses_per_process"][0] == before  # b's tick did not wait for a


def test_a_reply_to_a_turn_cleared_whole_opens_with_a_tick_of_its_own(plugin, models):
    cleared = user_frames(3, seed=24)
    stream, session = opened(plugin)
    feed(stream, cleared)
    stream.clear_input()
    out = reply(stream)
    stream.close()

    sent, got = slot_reference(models, plugin, stream.place, stream.slot, session)
    assert same(sent, cleared + [SILENCE])
    assert same(out, got[3:4]) and stream.listened == 2  # what Moshi said on the cleared frames is dropped


def test_sessions_at_once_share_batched_ticks_and_each_gets_its_slots_row(plugin, models):
    """The first session's turn is one request of 10 frames (10 ticks); the others arrive while
    it runs and ride its ticks."""
    turns = {seed: user_frames(10 if seed == 30 else 4, seed=seed) for seed in (30, 31, 32, 33)}
    streams = {seed: opened(plugin) for seed in turns}
    replies: dict[int, list[np.ndarray]] = {}
    ticks_before = len(plugin.history())

    def converse(seed: int) -> None:
        stream, _ = streams[seed]
        stream.feed_frames(turns[seed])
        replies[seed] = reply(stream)

    threads = [threading.Thread(target=converse, args=(seed,)) for seed in turns]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for stream, _ in streams.values():
        stream.close()

    assert sorted(stream.slot for stream, _ in streams.values()) == [0, 1, 2, 3]
    for seed, (stream, session) in streams.items():
        sent, got = slot_reference(models, plugin, stream.place, stream.slot, session)
        n = len(turns[seed])
        assert same(sent, turns[seed] + [SILENCE] * (n - 1)), seed
        assert same(replies[seed], got[n - 1 :]), seed
    run_ticks = plugin.history()[ticks_before:]
    assert sum(len(record.frames) for record in run_ticks) == 2 * (10 + 4 + 4 + 4) - 4
    assert max(len(record.frames) for record in run_ticks) > 1  # ticks carried several sessions


def test_describe_counts_every_tick_in_the_transforms_replay_counters(plugin):
    before = plugin.describe()
    stream = plugin.open_stream()
    feed(stream, user_frames(2, seed=21))
    reply(stream)
    stream.close()
    after = plugin.describe()

    frames = after["frames"]["ticks"] - before["frames"]["ticks"]
    batched = after["batched_ticks_per_process"][0] - before["batched_ticks_per_process"][0]
    calls = {
        name: after["transform"]["replays"][name]["calls"] - before["transform"]["replays"][name]["calls"]
        for name in ("mimi_encode", "lm_step", "depformer_step", "mimi_decode")
    }
    assert frames == batched == 3  # alone in its batch: one frame per batched call (2 fed, 1 of silence)
    assert calls == {"mimi_encode": 3, "lm_step": 3, "depformer_step": 3, "mimi_decode": 3}
    assert (after["slots_per_process"], after["slots_taken_per_process"], after["warm_up_ticks_per_process"]) == (
        [SLOTS],
        [0],
        [2],
    )
    assert after["transform"]["stamps"][-1] == (
        "slots: batch of 4, mimi_encode K=1, mimi_decode K=1, lm_step K=1, depformer_step K=1; the vendor's glue "
        "calls the bound lm_step and depformer_step as its graphed_main and graphed_depth"
    )


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

    served = MoshiPlugin(max_reply_frames=reply_frames, record=True)
    with background_server(lambda: served, Limits(max_sessions=3)) as handle:
        progress = capfd.readouterr().err
        events, ledgers = run(scenario(Server(handle)))
        described = httpx.get(handle.http_url + "/v1/models").json()["data"][0]["plugin"]

    # The server sized the batch for its 3 sessions at startup and built it before any session.
    assert re.findall(r"moshi-tiny: (\d) slots ready in place (\d) \(\d+\.\d s\)", progress) == [("3", "0")]
    assert (described["slots_per_process"], described["streams"]) == ([3], 1)
    assert described["frames"]["ticks"] == described["batched_ticks_per_process"][0] == fed + reply_frames - 1
    assert sum(described["frames"]["queued_at_reply_start"]) == 1  # the one reply, counted once

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
    sent, got = slot_reference(models, served, place=0, slot=0, session=0)
    assert same(sent, list(padded.reshape(fed, FRAME_SAMPLES)) + [SILENCE] * (reply_frames - 1))
    audio = deltas_of(events)
    assert len(audio) == reply_frames * FRAME_SAMPLES * 2
    assert audio == wire_audio.encode_samples(np.concatenate(got[fed - 1 :]), PCM24K)  # from the turn's last frame


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
        (
            {"size": "full", "processes": 2},
            "on cuda the ticks run in one worker process (processes=1) or in the server process (processes=0), not in 2 ",
        ),
        ({"processes": 0, "threads": 2}, "threads is the torch thread count of each worker process; "),
        ({"threads": 0}, "threads must be at least 1, got 0"),
        ({"slots": 0}, "slots must be a batch of 1 to 64 sessions per place, got 0"),
        ({"slots": 65}, "slots must be a batch of 1 to 64 sessions per place, got 65"),
        ({"slots": True}, "slots must be a batch of 1 to 64 sessions per place, got True"),
        ({"slots": 2.0}, "slots must be a batch of 1 to 64 sessions per place, got 2.0"),
    ],
)
def test_a_bad_size_device_or_place_is_refused_before_anything_is_built(options, error):
    with pytest.raises(ValueError) as refused:
        MoshiPlugin(**options)
    assert str(refused.value).startswith(error)


def test_ticks_in_the_server_process_are_the_vendors_batched_loop_bit_for_bit(models):
    """``processes=0``, the GPU's place, on a CPU: two interleaved streams, each its slot's row."""
    turns = [user_frames(3, seed=40), user_frames(3, seed=41)]
    local = MoshiPlugin(processes=0, slots=2, record=True)
    described = two_streams_are_their_slots_rows(local, models, turns, 3)
    assert (local.name, described["device"], described["processes"], described["threads"]) == ("moshi-tiny", "cpu", 0, None)
    assert (described["slots_per_process"], described["frames"]["ticks"]) == ([2], 10)  # 3 fed and 2 of silence each


def test_every_stage_runs_through_its_replay_engine(plugin):
    """The batch on the one pipeline: every tick ran each stage's rewritten
    graph through its replay engine; eagerly, with no CUDA here, and the depformer's sampling draws
    from the host's generator, which no graph may freeze."""
    stream = plugin.open_stream()
    feed(stream, user_frames(2, seed=31))
    reply(stream)
    stream.close()
    described = plugin.describe()
    ticks = described["batched_ticks_per_process"][0]
    assert ticks > 0
    assert {name: (op["calls"], op["fallbacks"]) for name, op in described["transform"]["replays"].items()} == {
        "mimi_encode": (ticks, {"no_cuda": ticks}),
        "mimi_decode": (ticks, {"no_cuda": ticks}),
        "lm_step": (ticks, {"no_cuda": ticks}),
        "depformer_step": (ticks, {"host_rng": ticks}),
    }


def test_admission_is_a_free_slot_and_a_session_beyond_them_is_refused_by_name():
    local = MoshiPlugin(processes=0, slots=1)
    try:
        with pytest.raises(ValueError) as refused:
            local.reserve(2)
        assert str(refused.value) == (
            "moshi-tiny holds 1 slots (1 place x 1), not 2 sessions at once: give it slots=2 or admit at most 1 sessions"
        )
        local.reserve(1)
        first = local.open_stream()
        with pytest.raises(SlotsFull) as full:
            local.open_stream()
        assert str(full.value) == "moshi-tiny: all 1 slots (1 place x 1) are taken; a session needs a free slot"
        first.close()
        second = local.open_stream()
        assert (first.slot, second.slot) == (0, 0)
        second.close()
    finally:
        local.close()


def test_without_the_option_reserve_sizes_each_batch_for_the_servers_sessions(capfd):
    local = MoshiPlugin(processes=0)
    try:
        local.reserve(3)
        assert local.describe()["slots_per_process"] == [3]
        assert re.findall(r"moshi-tiny: (\d) slots ready in place 0", capfd.readouterr().err) == ["3"]
        with pytest.raises(ValueError, match="moshi-tiny holds 3 slots"):
            local.reserve(4)  # the batch is built: its size stays
    finally:
        local.close()


def test_a_worker_builds_its_batch_before_its_first_tick_even_when_the_build_request_waits():
    """``start`` reaches a worker through its side thread, a tick straight from the scheduler's
    thread: with the side thread busy, the first tick must still wait for the batch."""
    plugin = MoshiPlugin(slots=1)
    try:
        busy = plugin._places[0]._thread.submit(threading.Event().wait, 1.0)  # the side thread, held for 1 s
        stream = plugin.open_stream()  # no reserve: the batch is built now, behind the held thread
        feed(stream, user_frames(2, seed=23))
        out = reply(stream)
        stream.close()
        assert busy.done() and len(out) == 2 and stream.ticks == 3
    finally:
        plugin.close()


def test_feed_returns_before_its_ticks_and_a_failed_tick_raises_from_the_streams_next_call():
    local = MoshiPlugin(processes=0, slots=1)
    try:
        stream = local.open_stream()
        place = local._places[0]
        held, entered = threading.Event(), threading.Event()
        run = place.scheduler._run

        def failing(frames, joins):
            entered.set()
            held.wait(10)
            raise RuntimeError("device lost")

        place.scheduler._run = failing
        stream.feed_frames(user_frames(2, seed=42))  # returns while its first tick is held
        assert entered.wait(10) and stream.turn_frames == 2
        held.set()
        with pytest.raises(RuntimeError, match="device lost"):  # from the first call that takes its outputs
            stream.begin_response()
            stream.step()
        place.scheduler._run = run
        stream.close()  # nothing of it is left in flight: its slot comes back
        assert local.free_slots() == 1
        again = local.open_stream()  # and serves the next session
        feed(again, user_frames(2, seed=43))
        assert len(reply(again)) == 2
        again.close()
    finally:
        local.close()
