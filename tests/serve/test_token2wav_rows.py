"""``token2wav`` with ``slots`` (reduced depth, CPU): the sessions as the rows of one batch under the
batch-invariant envelope. Over the wire, concurrent sessions of different lengths each hear their
stream run alone under the same envelope, bit for bit, with the exact event sequence; admission
is a free slot; bad settings are refused by name."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from servekit import COMMIT, RESPONSE_HEAD, RESPONSE_TAIL, Server, deltas_of, drain, silence, types_of

from cadence_fx.cli import main
from cadence_fx.models.token2wav_envelope import StreamRng, batch_invariant
from cadence_fx.models.token2wav_stream import StockStream, random_chunks
from cadence_fx.serve.app import background_server
from cadence_fx.serve.plugins import SlotsFull, load_plugin
from cadence_fx.serve.plugins.token2wav import FRAME_SAMPLES, INPUT_RATE, rng_seed, token_seed
from cadence_fx.serve.plugins.token2wav_rows import Token2WavRowsPlugin
from cadence_fx.serve.protocol import PCM24K
from cadence_fx.serve.protocol import audio as wire_audio
from cadence_fx.serve.session import Limits

SLOTS = 3


@pytest.fixture(scope="module")
def plugin():
    rows = load_plugin("token2wav", slots=SLOTS, seed=5, max_reply_chunks=4, record=True)
    yield rows
    rows.close()


class StockAlone(StockStream):
    """The vendor's stream, its prompt state computed once for every reference: the flow's
    ``setup_cache`` of one prompt is a function of the prompt alone (it draws no noise), and a
    reference pays for it once instead of at every turn of every session."""

    def __init__(self, plugin: Token2WavRowsPlugin) -> None:
        super().__init__(plugin.batched.flow, plugin.batched.hift, plugin.prompt)
        self.computed: dict[str, torch.Tensor] | None = None

    def setup_cache(self, tokens: torch.Tensor, mels: torch.Tensor, spk: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.computed is None:  # copied: the DiT's caches are views of buffers the next call writes
            self.computed = {k: v.clone() for k, v in super().setup_cache(tokens, mels, spk).items()}
        return {k: v.clone() for k, v in self.computed.items()}


@pytest.fixture(scope="module")
def stock(plugin):
    return StockAlone(plugin)


def alone(
    plugin: Token2WavRowsPlugin, stock: StockAlone, index: int, replies: list[int], heard: list[int] | None = None
) -> list[list[np.ndarray]]:
    """Session ``index``'s replies (of ``replies`` chunks each; ``heard`` of them only, as after a
    cancel) from the vendor's stream alone under the envelope at the plugin's capacity: the
    plugin's flow, HiFT and prompt, the session's tokens and its noise's seed."""
    rng = StreamRng(rng_seed(plugin.seed, index))
    out = []
    with torch.inference_mode():
        for turn, n in enumerate(replies):
            with batch_invariant(SLOTS, [rng]):
                stock.setup()  # a new session's stream, then each turn from the prompt state
            tokens = random_chunks(token_seed(index, turn), n)[: None if heard is None else heard[turn]]
            pcm = []
            for i, chunk in enumerate(tokens):
                with batch_invariant(SLOTS, [rng]):
                    pcm.append(stock.step(chunk, last_chunk=i == n - 1).speech.reshape(-1).numpy())
            out.append(pcm)
    return out


def test_bad_settings_are_refused_by_name(capsys):
    with pytest.raises(ValueError, match=r"slots must be a positive integer \(sessions as the rows of one batch\), got 0"):
        load_plugin("token2wav", slots=0)
    with pytest.raises(ValueError, match=r"token2wav: slots \(the sessions as the rows of one batch\) has no replay lanes"):
        load_plugin("token2wav", slots=2, lanes=2)
    with pytest.raises(SystemExit):
        main(["serve", "--model", "token2wav", "--slots", "0"])
    assert capsys.readouterr().err.endswith("cadence-fx serve: error: argument --slots: expected a positive integer, got 0\n")


def test_admission_is_a_free_slot_and_the_batch_holds_its_slots(plugin):
    with pytest.raises(ValueError, match=r"token2wav holds 3 sessions as the rows of one batch, not 4: give it slots=4"):
        plugin.reserve(4)
    plugin.reserve(SLOTS)
    streams = [plugin.open_stream() for _ in range(SLOTS)]
    assert [s.slot for s in streams] == [0, 1, 2] and plugin.free_slots() == 0
    with pytest.raises(SlotsFull, match=r"token2wav: all 3 slots are taken; a session needs a free slot"):
        plugin.open_stream()
    with pytest.raises(ValueError, match=r"a frame is float32 of shape \(1920,\), got float64 of shape \(1920,\)"):
        streams[0].feed(np.zeros(FRAME_SAMPLES))
    for stream in streams:
        stream.close()  # never began a turn: no row joined
    assert plugin.free_slots() == SLOTS and plugin.batched.rows == {}


def test_a_cancelled_reply_and_the_next_turn_are_the_stream_alone(plugin, stock):
    stream = plugin.open_stream()
    for _ in range(3 * INPUT_RATE // FRAME_SAMPLES):
        stream.feed(np.zeros(FRAME_SAMPLES, dtype=np.float32))
    stream.begin_response()
    first = stream.step()
    stream.cancel()
    assert stream.step() is None
    stream.begin_response()  # no input: the minimum reply, from the prompt state
    second = drain(stream)
    stream.close()
    assert plugin.batched.rows == {}
    want = alone(plugin, stock, stream.index, [3, 3], heard=[1, 3])
    assert [len(want[0]), len(second)] == [1, 3]
    assert np.array_equal(first, want[0][0]) and all(np.array_equal(g, w) for g, w in zip(second, want[1], strict=True))


def test_concurrent_sessions_over_uvicorn_each_hear_their_stream_alone_under_the_envelope(plugin, stock):
    """Three sessions at once over the wire, replies of 3 chunks; 4; and 3 then 3 (a turn reset):
    every session's PCM is its stream alone under the envelope, byte for byte."""
    turns = {0: [3000], 1: [4000], 2: [1000, 1000]}  # ms of each turn: replies of 3; 4; 3 and 3 chunks

    async def scenario(server: Server) -> dict[int, list[list[dict]]]:
        socks = [await server.connect() for _ in turns]  # in order: the plugin's streams first, second, third

        async def session(k: int) -> list[list[dict]]:
            return [await socks[k].reply_to(silence(ms), timeout=600) for ms in turns[k]]

        heard = await asyncio.gather(*(session(k) for k in turns))
        for sock in socks:
            await sock.close()
        return dict(enumerate(heard))

    first = plugin.streams
    before = dict(plugin.describe()["calls_by_rows"])
    with background_server(lambda: plugin, Limits(max_sessions=SLOTS, max_sessions_per_client=SLOTS)) as handle:
        events = asyncio.run(asyncio.wait_for(scenario(Server(handle)), 1200))
    chunks = {k: [min(4, max(3, ms // 1000)) for ms in turns[k]] for k in turns}
    for k, replies in events.items():
        want = alone(plugin, stock, first + k, chunks[k])
        for reply, n, pcm in zip(replies, chunks[k], want, strict=True):
            assert types_of(reply, skip_deltas=False) == (
                COMMIT + RESPONSE_HEAD + ["response.speak"] + ["response.output_audio.delta"] * n + RESPONSE_TAIL
            )
            assert deltas_of(reply) == wire_audio.encode_samples(np.concatenate(pcm), PCM24K)
    described = plugin.describe()
    calls = {rows: described["calls_by_rows"].get(rows, 0) - before.get(rows, 0) for rows in range(1, SLOTS + 1)}
    assert sum(rows * n for rows, n in calls.items()) == 13  # every chunk of every reply ran once
    assert described["streams"] == first + 3 and plugin.batched.rows == {}
