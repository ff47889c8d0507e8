"""``token2wav`` (MiniCPM-o 4.5's Token2Wav, reduced depth, CPU) as a reply voice: a stream's
reply is the stock vendor stream of its stand-in tokens from its seed, bit for bit, turn after
turn and whatever other streams run between its chunks or beside them on other replay lanes;
reply lengths follow the contract; admission is a lane with room."""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest
import torch
from servekit import drain

from cadence_fx.models.token2wav_carry import reference_flow, warm_up_chunks
from cadence_fx.models.token2wav_stream import StockStream, build_hift, random_chunks
from cadence_fx.serve.plugins import load_plugin
from cadence_fx.serve.plugins.token2wav import (
    CHUNK_SAMPLES,
    FRAME_SAMPLES,
    INPUT_RATE,
    MIN_REPLY_CHUNKS,
    WARM_UP_CHUNKS,
    SlotsFull,
    Token2WavPlugin,
    reply_chunks,
    rng_seed,
    token_seed,
)


@pytest.fixture(scope="module")
def plugin():
    return Token2WavPlugin("reduced", seed=5, max_reply_chunks=4)


def turn(stream, seconds: float) -> None:
    frame = np.zeros(FRAME_SAMPLES, dtype=np.float32)
    for _ in range(round(seconds * INPUT_RATE / FRAME_SAMPLES)):
        stream.feed(frame)


@pytest.fixture(scope="module")
def stock_models():
    """An untransformed flow and HiFT of the plugin's weights (one stock stream at a time)."""
    flow, _, _ = reference_flow("reduced")
    return flow, build_hift()


class Stock:
    """The vendor's streaming loop of one plugin stream: same weights, prompt, tokens and seed."""

    def __init__(self, plugin: Token2WavPlugin, models, stream: int) -> None:
        self.loop = StockStream(*models, plugin.prompt)
        self.stream, self.turn = stream, 0
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(rng_seed(plugin.seed, stream))
            self.rng = torch.get_rng_state()

    def reply(self, chunks: int, *, heard: int | None = None) -> list[np.ndarray]:
        """One turn's reply; `heard` chunks of it only, as after a cancel."""
        tokens = random_chunks(token_seed(self.stream, self.turn), chunks)
        self.turn += 1
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.set_rng_state(self.rng)
            self.loop.setup()
            out = [self.loop.step(t, last_chunk=i == chunks - 1).speech.reshape(-1).numpy() for i, t in enumerate(tokens[:heard])]
            self.rng = torch.get_rng_state()
        return out


def test_reply_lengths_follow_the_turn_within_the_contracts_bounds():
    assert [reply_chunks(s * INPUT_RATE, 8) for s in (0, 1, 3, 5, 12)] == [MIN_REPLY_CHUNKS, 3, 3, 5, 8]


def test_two_interleaved_streams_each_give_the_stock_stream_of_their_tokens_turn_after_turn(plugin, stock_models):
    a, b = plugin.open_stream(), plugin.open_stream()
    turn(a, 4.2)
    turn(b, 1.0)
    a.begin_response()
    b.begin_response()
    first_a, first_b = [a.step()], [b.step()]
    first_a += drain(a)  # a's reply ends while b's is still going
    first_b += drain(b)
    turn(a, 0.5)
    a.begin_response()
    second_a = drain(a)
    stock_a, stock_b = Stock(plugin, stock_models, a.index), Stock(plugin, stock_models, b.index)
    expected_a = [stock_a.reply(4), stock_a.reply(3)]
    expected_b = stock_b.reply(3)
    assert [len(c) for c in first_a] == [CHUNK_SAMPLES] * 3 + [len(expected_a[0][-1])]
    for got, want in ((first_a, expected_a[0]), (second_a, expected_a[1]), (first_b, expected_b)):
        assert len(got) == len(want) and all(np.array_equal(g, w) for g, w in zip(got, want))
    a.close()
    b.close()


def test_cancel_drops_the_rest_of_the_reply_and_the_next_starts_from_the_prompt_state(plugin, stock_models):
    stream = plugin.open_stream()
    turn(stream, 3.0)
    stream.begin_response()
    stream.step()
    stream.cancel()
    assert stream.step() is None
    turn(stream, 9.0)
    stream.clear_input()
    stream.begin_response()
    got = drain(stream)
    stock = Stock(plugin, stock_models, stream.index)
    stock.reply(3, heard=1)  # the cancelled reply: its first chunk ran, and drew its noise
    expected = stock.reply(3)  # the cleared input does not count: the minimum reply
    assert len(got) == 3 and all(np.array_equal(g, w) for g, w in zip(got, expected))
    stream.close()


def test_bad_frames_and_settings_are_refused_with_what_was_expected(plugin):
    stream = plugin.open_stream()
    with pytest.raises(ValueError, match=r"a frame is float32 of shape \(1920,\), got float64 of shape \(1920,\)"):
        stream.feed(np.zeros(FRAME_SAMPLES))
    stream.close()
    with pytest.raises(ValueError, match=r"depth must be one of \['full', 'reduced'\], got 'tiny'"):
        Token2WavPlugin("tiny")
    with pytest.raises(ValueError, match="max_reply_chunks must be at least 3"):
        Token2WavPlugin("reduced", max_reply_chunks=2)
    with pytest.raises(
        ValueError, match=r"lanes must be a positive integer \(replay lanes, each its own copy of the flow\), got 0"
    ):
        Token2WavPlugin("reduced", lanes=0)


def test_the_full_size_plugin_needs_cuda_and_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without CUDA, everywhere
    with pytest.raises(RuntimeError, match=r"token2wav-full runs MiniCPM-o 4.5's Token2Wav at full size on a CUDA device"):
        load_plugin("token2wav-full")


def test_describe_counts_every_chunk_and_each_binding_says_why_it_ran_eager_on_a_cpu(plugin):
    described = plugin.describe()
    assert (described["model"], described["device"], described["streams_open"]) == ("token2wav", "cpu", 0)
    chunks = described["chunks"] + WARM_UP_CHUNKS
    # The flow's bound operators reach their engines once a class is verified (its first two visits,
    # 4 classes) and not for the prompt setup's call (outside the catalog: the stock code): the
    # transform's own warm-up turns, then every chunk. HiFT draws its noise from the CPU generator
    # here, which a graph would freeze: refused.
    flow = chunks + warm_up_chunks("cpu") - 2 * 4
    assert {name: counters["fallbacks"] for name, counters in described["replays"].items()} == {
        "cfm_loop": {"no_cuda": flow},
        "conformer_encoder": {"no_cuda": flow},
        "hift": {"host_rng": chunks},
    }


def test_a_session_over_uvicorn_hears_the_stock_vendor_stream(plugin, stock_models):
    from servekit import Server, deltas_of, run, silence

    from cadence_fx.serve.app import background_server
    from cadence_fx.serve.protocol import PCM24K
    from cadence_fx.serve.protocol import audio as wire_audio
    from cadence_fx.serve.session import Limits

    async def scenario(server: Server) -> list[dict]:
        sock = await server.connect()
        events = await sock.reply_to(silence(1000), timeout=60)
        await sock.close()
        return events

    index = plugin.streams  # the session's stream is the plugin's next one
    with background_server(lambda: plugin, Limits(max_sessions=1)) as handle:
        events = run(scenario(Server(handle)))
    expected = np.concatenate(Stock(plugin, stock_models, index).reply(MIN_REPLY_CHUNKS))
    assert deltas_of(events) == wire_audio.encode_samples(expected, PCM24K)


def test_streams_on_two_lanes_at_once_each_give_their_stream_run_alone(stock_models, capsys):
    """Three sessions over two replay lanes (two on lane 0, taking turns over its flow; one on lane
    1), their replies computed at the same time from three threads, as the server's model threads
    call them: each session's PCM is its stock stream run alone, bit for bit."""
    plugin = Token2WavPlugin("reduced", seed=5, max_reply_chunks=4, lanes=2)
    progress = capsys.readouterr().err.splitlines()
    for k in (1, 2):
        line = next(line for line in progress if line.startswith(f"token2wav: lane {k}/2 warm"))
        assert re.fullmatch(
            rf"token2wav: lane {k}/2 warm: 0 classes captured \(a CPU captures none: every class "
            r"runs eager\) in \d+\.\d s",
            line,
        )
    assert plugin.free_slots() is None  # not bounded before the server's reserve
    plugin.reserve(3)
    assert plugin.free_slots() == 4  # room for ceil(3 / 2) = 2 on each lane
    streams = [plugin.open_stream() for _ in range(3)]
    assert [s.lane.index for s in streams] == [0, 1, 0] and plugin.free_slots() == 1
    turns = {0: [4.2, 0.5], 1: [3.0], 2: [1.0]}  # seconds of each turn: replies of 4, 3; 3; 3 chunks
    heard: dict[int, list[list[np.ndarray]]] = {}
    start = threading.Barrier(3, timeout=60)

    def session(k: int) -> None:
        start.wait()
        heard[k] = []
        for seconds in turns[k]:
            turn(streams[k], seconds)
            streams[k].begin_response()
            heard[k].append(drain(streams[k]))

    threads = [threading.Thread(target=session, args=(k,), name=f"model-{k}") for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads) and sorted(heard) == [0, 1, 2]
    for k, stream in enumerate(streams):
        stock = Stock(plugin, stock_models, stream.index)
        expected = [
            stock.reply(reply_chunks(round(seconds * INPUT_RATE / FRAME_SAMPLES) * FRAME_SAMPLES, 4)) for seconds in turns[k]
        ]
        assert [len(reply) for reply in heard[k]] == [len(reply) for reply in expected]
        assert all(np.array_equal(g, w) for got, want in zip(heard[k], expected) for g, w in zip(got, want))
    described = plugin.describe()
    assert [(lane["streams_open"], lane["room"], lane["chunks"]) for lane in described["lanes"]] == [(2, 2, 10), (1, 2, 3)]
    assert described["lanes_used"] == 2 and described["chunks"] == 13
    assert described["rng_section_calls"] == 2 * WARM_UP_CHUNKS + 13  # every HiFT call, the warm-ups' too

    fourth = plugin.open_stream()  # lane 1 has room for one more
    assert fourth.lane.index == 1 and plugin.free_slots() == 0
    with pytest.raises(
        SlotsFull, match=r"token2wav: every lane holds its 2 streams \(2 lanes\); a session needs a lane with room"
    ):
        plugin.open_stream()
    with pytest.raises(ValueError, match=r"token2wav: lanes \[0, 1\] already hold more than 1 streams"):
        plugin.reserve(2)
    fourth.close()
    assert plugin.free_slots() == 1 and plugin.describe()["streams_open"] == 3
    for stream in streams:
        stream.close()
    plugin.close()
