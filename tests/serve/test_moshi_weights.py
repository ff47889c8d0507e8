"""``serve --weights``: the Moshi plugin serving a checkpoint directory in the published layout
(TINY size here, written by the test from weights of another seed than the plugin's own, so that
random weights could not pass): its replies are its slot's row of the vendor's batched loop on the
same files over the ticks the plugin recorded, in a worker process and through a real uvicorn
session; a checkpoint of another size, a model that loads no
checkpoint, and a hub id offline without a local copy are refused by name."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import httpx
import numpy as np
import pytest
import torch
from moshi_checkpoint_kit import vendor_models, write_checkpoint
from servekit import AUDIO, Server, deltas_of, drain, read_wav, run, same, slot_reference

from cadence_fx.cli import main
from cadence_fx.models.moshi_stream import TINY, build_models, random_pcm
from cadence_fx.serve.app import background_server, free_port
from cadence_fx.serve.plugins import load_plugin
from cadence_fx.serve.plugins.moshi import FRAME_SAMPLES, SILENCE, MoshiPlugin
from cadence_fx.serve.protocol import PCM24K
from cadence_fx.serve.protocol import audio as wire_audio
from cadence_fx.serve.session import Limits

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the reference and the runtime on one thread


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("moshi") / "tiny", build_models(dataclasses.replace(TINY, seed=5)))


@pytest.fixture(scope="module")
def vendor(directory):
    """The files as the vendor loads them, the LM in TINY's dtype (float32), as the plugin loads it."""
    return vendor_models(directory, TINY)


def user_frames(n: int, seed: int) -> list[np.ndarray]:
    return list(random_pcm(n, seed=seed).reshape(n, FRAME_SAMPLES).numpy())


def reply_to(plugin, frames: list[np.ndarray]) -> list[np.ndarray]:
    """One stream: ``frames`` fed, then its reply, as long as the turn."""
    stream = plugin.open_stream()
    for frame in frames:
        stream.feed(frame)
    stream.begin_response()
    reply = drain(stream)
    stream.close()
    return reply


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_on_cuda_the_server_process_serves_the_checkpoint_as_the_vendor_streams_it_every_call_replayed(directory):
    frames = user_frames(4, seed=51)
    plugin = MoshiPlugin(size="tiny", device="cuda", weights=str(directory), record=True)
    try:
        reply = reply_to(plugin, frames)
        described = plugin.describe()
    finally:
        plugin.close()

    # The vendor's side after the plugin's transform: under the same pinned kernels.
    sent, got = slot_reference(vendor_models(directory, TINY, device="cuda"), plugin, place=0, slot=0, session=0)
    assert same(sent, frames + [SILENCE] * 3) and same(reply, got[3:7])  # it opens with the turn's last frame
    assert (plugin.name, described["weights"]) == ("moshi-tiny-cuda", str(directory))
    for name in ("mimi_encode", "lm_step", "mimi_decode", "depformer_step"):
        replays = described["transform"]["replays"][name]
        assert replays["eager"] == 0 and replays["replays"] == replays["calls"], (name, replays)


def test_a_session_over_uvicorn_ticking_in_a_worker_hears_the_vendor_stream_of_the_checkpoint(directory, vendor):
    """As ``serve --weights`` builds it (``load_plugin`` with ``weights``); the worker process loads
    the files the server process located."""
    samples, _ = read_wav(AUDIO / "question_24k.wav")
    question = wire_audio.encode_samples(samples, PCM24K)
    fed, reply_frames = -(-len(samples) // FRAME_SAMPLES), 4

    async def scenario(server: Server):
        sock = await server.connect("/v1/duplex")
        events = await sock.reply_to(question, timeout=50)
        await sock.close()
        return events

    built = []

    def plugin():
        built.append(load_plugin("moshi-tiny", weights=str(directory), processes=1, max_reply_frames=reply_frames, record=True))
        return built[0]

    with background_server(plugin, Limits(max_sessions=1)) as handle:
        events = run(scenario(Server(handle)))
        served = httpx.get(handle.http_url + "/v1/models").json()["data"][0]

    padded = np.concatenate([samples, np.zeros(fed * FRAME_SAMPLES - len(samples), dtype=np.float32)])
    sent, got = slot_reference(vendor, built[0], place=0, slot=0, session=0)
    assert same(sent, list(padded.reshape(fed, FRAME_SAMPLES)) + [SILENCE] * (reply_frames - 1))
    assert deltas_of(events) == wire_audio.encode_samples(np.concatenate(got[fed - 1 :]), PCM24K)  # from the turn's last frame
    assert (served["plugin"]["weights"], served["plugin"]["processes"]) == (str(directory), 1)
    assert f" parameters, weights of {directory}) on CPU, " in served["description"]


def test_a_checkpoint_of_another_size_is_refused_naming_the_size_it_is(directory):
    with pytest.raises(ValueError) as refused:
        MoshiPlugin(size="small", weights=str(directory))
    message = str(refused.value)
    assert message.startswith(
        f"moshi-small serves Moshi at the SMALL size, but checkpoint '{directory}' differs in 16 settings (checkpoint "
        "value, then SMALL's): lm.dim: 32 (128); lm.num_layers: 1 (2); lm.depformer_dim: 32 (64); "
    )
    assert message.endswith("; it is Moshi at the TINY size: serve it with --model moshi-tiny")


def test_the_published_7b_layout_is_refused_by_the_cpu_sizes_as_full(tmp_path):
    for name in ("model.safetensors", "tokenizer-e351c8d8-checkpoint125.safetensors", "tokenizer_spm_32k_3.model"):
        (tmp_path / name).write_bytes(b"")  # no config.json: Moshi 7B; refused before anything is read
    with pytest.raises(ValueError) as refused:
        MoshiPlugin(weights=str(tmp_path))
    message = str(refused.value)
    assert message.startswith(f"moshi-tiny serves Moshi at the TINY size, but checkpoint '{tmp_path}' differs in 19 ")
    assert message.endswith("; it is Moshi at the FULL size: serve it with --model moshi-full")


def test_serve_refuses_weights_for_a_model_that_loads_none(capsys):
    assert main(["serve", "--model", "tone", "--weights", "kyutai/moshiko-pytorch-bf16"]) == 2
    assert capsys.readouterr().err == (
        "cadence-fx serve: error: --weights: tone loads no checkpoint; the models that do: moshi-full, moshi-small, "
        "moshi-tiny, personaplex-full, personaplex-tiny, token2wav, token2wav-full\n"
    )


def test_serve_offline_without_a_local_copy_stops_naming_the_repo_and_its_files(tmp_path):
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    command = ["serve", "--model", "moshi-tiny", "--weights", "kyutai/moshiko-pytorch-bf16", "--port", str(free_port())]
    done = subprocess.run(
        [sys.executable, "-m", "cadence_fx.cli", *command], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 3  # uvicorn's exit status when the app's startup (the plugin's construction) fails
    assert (
        "cadence_fx.models.moshi_checkpoint.CheckpointNotFound: Moshi checkpoint 'kyutai/moshiko-pytorch-bf16' is not "
        f"a directory here, and as a Hugging Face hub repo it has no complete local copy in {tmp_path / 'hub'} and "
        "HF_HUB_OFFLINE is set; looked for config.json (optional), model.safetensors, "
        "tokenizer-e351c8d8-checkpoint125.safetensors, tokenizer_spm_32k_3.model. Download it where the hub is "
        "reachable (hf download kyutai/moshiko-pytorch-bf16) or pass a directory holding those files\n"
    ) in done.stderr
