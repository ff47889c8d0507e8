"""The model seam, and the ``tone`` test double's exact behaviour."""

from __future__ import annotations

import numpy as np
import pytest

from cadence_fx.serve.plugins import (
    ModelPlugin,
    ModelStream,
    PluginSpec,
    ToneModel,
    load_plugin,
    plugin_names,
    register_plugin,
    tone,
)


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


def test_registry_loads_by_name_and_says_what_it_knows(monkeypatch):
    from cadence_fx.serve import plugins

    # The registry is the process's: the alias must not outlive this test (the CLI's choices and
    # the generated CLI reference read it).
    monkeypatch.setattr(plugins, "_REGISTRY", dict(plugins._REGISTRY))
    assert isinstance(load_plugin("tone", step_delay_s=0.0), ToneModel)
    register_plugin(PluginSpec("tone-alias", ToneModel, has_lanes=True))
    assert "tone-alias" in plugin_names() and plugins.has_lanes("tone-alias")
    assert isinstance(load_plugin("tone-alias", step_delay_s=0.0), ToneModel)
    with pytest.raises(ValueError, match="unknown model plugin 'nope'; known: .*tone"):
        load_plugin("nope")
    with pytest.raises(ValueError, match="unknown model plugin 'nope'; known: .*tone"):
        plugins.has_slots("nope")


def test_one_record_per_served_model_says_what_it_takes():
    from cadence_fx.serve import plugins

    takes = {
        spec.name: [flag for flag in ("loads_weights", "takes_prompt", "has_slots", "has_lanes") if getattr(spec, flag)]
        for spec in plugins.SPECS
    }
    assert takes == {
        "tone": [],
        "moshi-tiny": ["loads_weights", "has_slots"],
        "moshi-small": ["loads_weights", "has_slots"],
        "moshi-full": ["loads_weights", "has_slots"],
        "personaplex-tiny": ["loads_weights", "has_slots"],
        "personaplex-full": ["loads_weights", "has_slots"],
        "token2wav": ["loads_weights", "takes_prompt", "has_slots", "has_lanes"],
        "token2wav-full": ["loads_weights", "takes_prompt", "has_slots", "has_lanes"],
    }
    assert plugin_names() == sorted(takes)


@pytest.mark.parametrize(
    ("name", "options", "error"),
    [
        (
            "moshi-tiny",
            {"runtime": "stages"},
            "MoshiPlugin takes no option 'runtime'; its options: device, seed, sampling, "
            "max_reply_frames, processes, threads, pin, weights, slots, record",
        ),
        (
            "token2wav",
            {"size": "full", "lane": 2},
            "Token2WavPlugin takes no option 'lane', 'size'; its options: seed, max_reply_chunks, weights, prompt, lanes",
        ),
    ],
)
def test_an_option_a_model_plugin_does_not_take_is_refused_by_name_before_anything_is_built(name, options, error):
    with pytest.raises(ValueError) as refused:
        load_plugin(name, **options)
    assert str(refused.value) == error


def test_tone_is_labelled_a_test_double():
    assert "test double" in ToneModel.info.description and "not a model" in ToneModel.info.description
