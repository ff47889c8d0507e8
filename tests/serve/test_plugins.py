"""The model seam, and the ``tone`` test double's exact behaviour."""

from __future__ import annotations

import time

import numpy as np
import pytest

from cadence_fx.serve.plugins import ModelPlugin, ModelStream, ToneModel, load_plugin, plugin_names, register_plugin
from cadence_fx.serve.app import background_server
from cadence_fx.serve.plugins import tone
from cadence_fx.serve.session import Limits


def _feed(stream: ModelStream, frames: int) -> None:
    for _ in range(frames):
        stream.feed(np.zeros(tone.FRAME_SAMPLES, dtype=np.float32))


def _reply(stream: ModelStream) -> np.ndarray:
    stream.begin_response()
    chunks = []
    while (chunk := stream.step()) is not None:
        chunks.append(chunk)
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)


@pytest.mark.parametrize(("frames", "chunks"), [(0, 1), (1, 1), (128, 32), (129, 33), (222, 56), (750, 188)])
def test_tone_reply_is_half_the_turn_in_whole_chunks(frames, chunks):
    stream = ToneModel().open_stream()
    _feed(stream, frames)
    reply = _reply(stream)
    assert tone.reply_chunks(frames * tone.FRAME_SAMPLES) == chunks
    assert np.array_equal(reply, tone.render(chunks))


def test_tone_turns_are_independent():
    stream = ToneModel().open_stream()
    _feed(stream, 300)
    first = _reply(stream)
    _feed(stream, 300)
    assert np.array_equal(_reply(stream), first)


def test_cancel_ends_the_reply_and_keeps_later_input():
    stream = ToneModel().open_stream()
    _feed(stream, 300)
    stream.begin_response()
    assert stream.step() is not None
    stream.cancel()
    assert stream.step() is None
    _feed(stream, 1)
    assert len(_reply(stream)) == tone.CHUNK_SAMPLES


def test_clear_input_forgets_the_turn():
    stream = ToneModel().open_stream()
    _feed(stream, 600)
    stream.clear_input()
    assert len(_reply(stream)) == tone.CHUNK_SAMPLES


def test_a_plugin_must_implement_the_whole_seam():
    class Half(ModelStream):
        def feed(self, frame):
            pass

    with pytest.raises(TypeError):
        Half()
    with pytest.raises(TypeError):
        ModelPlugin()


def test_registry_loads_by_name_and_says_what_it_knows():
    assert isinstance(load_plugin("tone", step_delay_s=0.0), ToneModel)
    register_plugin("tone-alias", ToneModel)
    assert "tone-alias" in plugin_names()
    with pytest.raises(ValueError, match="unknown model plugin 'nope'; known: .*tone"):
        load_plugin("nope")


def test_tone_is_labelled_a_test_double():
    assert "test double" in ToneModel.info.description and "not a model" in ToneModel.info.description


class Clocked(ToneModel):
    """``tone`` whose chunks come due on a clock, recording when each was asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[tuple[float, float | None]] = []  # (when step ran, when it was due)

    def open_stream(self) -> ModelStream:
        stream, asked = super().open_stream(), self.asked
        step, started = stream.step, []

        def begin_response() -> None:
            tone.ToneStream.begin_response(stream)
            started[:] = [time.monotonic()]

        def next_due() -> float | None:
            if stream._reply is None or stream._next >= len(stream._reply):
                return None
            return started[0] + 0.02 * (stream._next // tone.CHUNK_SAMPLES)

        def clocked_step():
            asked.append((time.monotonic(), next_due()))
            return step()

        stream.begin_response, stream.next_due, stream.step = begin_response, next_due, clocked_step
        return stream


def test_the_session_asks_for_no_chunk_before_the_stream_says_it_is_due():
    from servekit import Server, run, silence

    plugin = Clocked()

    async def scenario(server: Server) -> None:
        sock = await server.connect()
        await sock.no_vad()
        await sock.append(silence(400, rate=24_000))
        await sock.send({"type": "input_audio_buffer.commit"})
        await sock.send({"type": "response.create"})
        await sock.recv_until("response.done")
        await sock.close()

    with background_server(lambda: plugin, Limits(max_sessions=1)) as handle:
        run(scenario(Server(handle)))
    chunks = tone.reply_chunks(400 * tone.INPUT_RATE // 1000)
    assert len(plugin.asked) == chunks + 1  # the last step says the reply is over
    assert all(due is None or ran >= due for ran, due in plugin.asked)
    assert sum(due is not None for _, due in plugin.asked) == chunks
