"""Moshi transformed (owned state, replay bindings), reduced size on a CPU, against the vendor."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cadence_fx import transform
from cadence_fx.models.moshi import moshi_contract
from cadence_fx.models.moshi_replay import Stage, contract_for
from cadence_fx.models.moshi_stream import SMALL, build_models, random_pcm, stream_reference

FRAMES, SEEDS = 50, (7, 8, 9)
GREEDY_SEED = 3


@pytest.fixture(scope="module")
def models():
    return build_models(SMALL)


@pytest.fixture(scope="module")
def streams(models):
    """Three sampled streams and one greedy stream, each from both models, interleaved."""
    transformed, report = transform(models, contract_for(SMALL))
    runs, addresses, offsets = [], [], []
    for i, (sampling, seed) in enumerate([(True, s) for s in SEEDS] + [(False, GREEDY_SEED)]):
        pcm = random_pcm(FRAMES, seed=100 + i)
        reference = stream_reference(models, pcm, sampling=sampling, seed=seed)
        tokens, audio = [], []
        with transformed.session(sampling=sampling, seed=seed) as step:
            for frame in pcm.split(models.mimi.frame_size, dim=-1):
                codes, out = step(frame)
                if codes is not None:
                    tokens.append(codes)
                    audio.append(out)
            addresses.append(transformed.state.addresses())
            offsets.append(models.lm.transformer.layers[0].self_attn._streaming_state.offset_cpu)
        runs.append((sampling, reference, torch.cat(tokens, dim=-1), torch.cat(audio, dim=-1)))
    counters = transformed.counters()
    return transformed, report, runs, addresses, offsets, counters


def test_three_sampled_streams_give_the_vendors_tokens_and_pcm_bit_for_bit(streams):
    _, _, runs, *_ = streams
    sampled = [(ref, tokens, pcm) for sampling, ref, tokens, pcm in runs if sampling]
    assert len(sampled) == 3
    for ref, tokens, pcm in sampled:
        assert tokens.shape == (1, 9, FRAMES - 1) and pcm.shape == (1, 1, 1920 * (FRAMES - 1))
        assert torch.equal(tokens, ref.tokens)
        assert torch.equal(pcm, ref.pcm)


def test_a_greedy_stream_gives_the_vendors_tokens_and_pcm_bit_for_bit(streams):
    _, _, runs, *_ = streams
    ((_, ref, tokens, pcm),) = [run for run in runs if not run[0]]
    assert torch.equal(tokens, ref.tokens)
    assert torch.equal(pcm, ref.pcm)


def test_the_streams_differ_from_each_other(streams):
    _, _, runs, *_ = streams
    assert len({tuple(tokens.flatten().tolist()) for _, _, tokens, _ in runs}) == len(runs)


def test_counters_show_every_admission(streams):
    *_, counters = streams
    sampled, greedy = len(SEEDS) * FRAMES, FRAMES
    frames, decoded = sampled + greedy, (len(SEEDS) + 1) * (FRAMES - 1)

    def eager(calls, reason):
        return {"calls": calls, "captures": 0, "replays": 0, "eager": calls, "invalidations": 0, "fallbacks": {reason: calls}}

    # Without CUDA every admitted call runs eagerly (no_cuda); the sampling depformer reads the
    # CPU generator, a host RNG, so its class is refused for good (host_rng).
    assert counters == {
        "mimi_encode": eager(frames, "no_cuda"),
        "lm_step": eager(frames, "no_cuda"),
        "mimi_decode": eager(decoded, "no_cuda"),
        "depformer_step[sampling]": eager(sampled, "host_rng"),
        "depformer_step[greedy]": eager(greedy, "no_cuda"),
    }


def test_each_binding_has_one_certified_class_from_the_catalog(streams):
    transformed, report, *_ = streams
    assert {op.name: op.width for op in report.catalog.operators} == {
        "mimi_encode": 1, "lm_step": 1, "depformer_step": 1, "mimi_decode": 1,
    }
    verdicts = {name: [(c.shape_class, c.admitted) for c in engine.certificates.values()]
                for name, engine in transformed.replays.items()}
    assert verdicts == {
        "mimi_encode": [("mimi_encode ring=250", True)],
        "lm_step": [("lm_step ring=3000", True)],
        "mimi_decode": [("mimi_decode ring=250", True)],
        "depformer_step[sampling]": [("depformer_step ring=8", False)],
        "depformer_step[greedy]": [("depformer_step ring=8", True)],
    }
    sampling = next(iter(transformed.replays["depformer_step[sampling]"].certificates.values()))
    assert sampling.host_rng == ("torch.get_rng_state",)


def test_the_owned_state_keeps_one_address_per_tensor_across_sessions(streams):
    transformed, _, _, addresses, *_ = streams
    originals = [slot.tensor.data_ptr() for slot in transformed.state.tensors]
    assert addresses == [originals] * len(addresses)


def test_the_probationary_call_leaves_host_counters_as_eager_does(streams):
    *_, offsets, _ = streams
    assert offsets == [FRAMES] * (len(SEEDS) + 1)


def test_each_stage_on_the_owned_state_gives_its_binding_the_host_counters(streams):
    transformed, *_ = streams
    for name in ("mimi_encode", "lm_step", "mimi_decode"):
        stage = transformed.stages[name]
        assert stage.engine.host_counters is stage.state
    # What a replay does to them: every counter written at once, each one a vendor attribute.
    lm = transformed.stages["lm_step"].state
    with transformed.session(sampling=False, seed=0):
        attention = transformed.models.lm.transformer.layers[0].self_attn._streaming_state
        index = next(i for i, (owner, attr, _) in enumerate(lm.counters) if owner is attention and attr == "offset_cpu")
        values = lm.read()
        assert values[index] == attention.offset_cpu == 0
        lm.write([v + 1 for v in values])
        assert attention.offset_cpu == 1
        lm.write(values)
        assert lm.read() == values


def test_the_vendors_state_rebinding_becomes_an_in_place_write(streams, models):
    transformed, *_ = streams
    encode = transformed.stages["mimi_encode"]
    # The replicate-padded downsampling conv rebinds `state.first` on every encode call, the probe
    # included; each time the value lands in the original tensor, which stays bound.
    assert encode.state.rebinds == encode.engine.counters.calls + 1
    assert all(getattr(slot.owner, slot.attr) is slot.tensor for slot in encode.state.tensors)


def test_vendor_graph_wrappers_are_gone_from_the_owned_state(streams, models):
    transformed, *_ = streams
    mimi_state = transformed.state.states["mimi"][""]
    gen_state = transformed.state.states["lm_gen"][""]
    assert mimi_state.graphed_encoder is models.mimi.encoder
    assert mimi_state.graphed_decoder is models.mimi.decoder
    assert mimi_state.graphed_tr_enc is models.mimi.encoder_transformer
    assert mimi_state.graphed_tr_dec is models.mimi.decoder_transformer
    assert isinstance(gen_state.graphed_main, Stage) and isinstance(gen_state.graphed_depth, Stage)


def test_rings_are_the_carries_and_sit_at_the_derived_bounds(streams):
    _, report, *_ = streams
    assert {r.region: (r.stock_shape, r.demand_shape) for r in report.resizes} == {
        "mimi_encoder_kv": ((2, 2, 1, 2, 250, 64),) * 2,
        "mimi_decoder_kv": ((2, 2, 1, 2, 250, 64),) * 2,
        "lm_kv": ((2, 2, 1, 4, 3000, 32),) * 2,
        "depformer_kv": ((2, 2, 1, 4, 8, 16),) * 2,
    }


def test_the_input_models_are_free_between_sessions(streams, models):
    transformed, *_ = streams
    assert not any(m.is_streaming for m in (models.mimi, models.lm, transformed.lm_gen))
    busy = pytest.raises(RuntimeError, match="mimi is already streaming")
    with models.mimi.streaming(1), busy, transformed.session(sampling=False, seed=0):
        pass


def test_replay_off_streams_the_same_on_the_owned_state(models):
    transformed, report = transform(models, contract_for(SMALL), replay=False)
    pcm = random_pcm(10, seed=5)
    got = transformed.stream(pcm, sampling=True, seed=1)
    want = stream_reference(models, pcm, sampling=True, seed=1)
    assert report.replays == {}
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.pcm, want.pcm)


def test_a_contract_for_another_model_is_refused(models):
    with pytest.raises(ValueError, match=r"region 'lm_kv' declares bfloat16, the LM runs in torch.float32"):
        transform(models, moshi_contract())
    with pytest.raises(ValueError, match=r"lm.transformer: the vendor's rings stack to \(2, 2, 1, 4, 3000, 32\)"):
        transform(models, moshi_contract(lm_dtype="float32", mimi_layers=2, mimi_heads=2, mimi_dim=128))


@pytest.mark.slow
def test_the_benchmark_smoke_mode_runs_every_arm_bit_exact_on_a_cpu(tmp_path):
    script = Path(__file__).resolve().parents[1] / "bench" / "moshi.py"
    out = tmp_path / "moshi.json"
    command = [sys.executable, str(script), "--small", "--frames", "10", "--streams", "1", "--warmup-frames", "3",
               "--repeat-frames", "3", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(out.read_text())
    assert list(record["arms"]) == ["eager", "vendor", "cadence"]
    assert record["eager_repeats_itself"] is True
    one = {"tokens": 1, "pcm": 1, "of": 1}
    assert all(arm["streams_equal_to_eager"] == {"sampling": one, "greedy": one} for arm in record["arms"].values())
    assert record["arms"]["cadence"]["replay"]["lm_step"]["calls"] == 2 * (3 + 10)  # warm-up and measured, both modes
    assert record["summary"]["target_bit_exact_all_streams"] is True
    assert record["png"] in ("skipped: matplotlib is not installed", str(out.with_suffix(".png")))
    assert {"commit", "command", "device", "torch", "determinism"} <= set(record)


def test_two_streams_taking_turns_on_one_owned_state_each_equal_the_vendor_alone():
    """The one transformed interface: inside one session, two sampled streams swap their state in
    and out frame by frame (`swap_in` / `swap_out`), and each equals the vendor's loop run alone."""
    models = build_models(SMALL)  # its own models: the module fixture's are shared with the tests above
    transformed, _ = transform(models, contract_for(SMALL))
    seeds, frames = (21, 22), 12
    pcms = [random_pcm(frames, seed=200 + i) for i in range(2)]
    outputs = [([], []), ([], [])]
    with transformed.session(sampling=True, seed=0) as step:
        states = [transformed.session_state(seed) for seed in seeds]  # both from the fresh owned state
        for t in range(frames):
            for i, state in enumerate(states):
                transformed.swap_in(state)
                codes, out = step(pcms[i][..., t * models.mimi.frame_size:(t + 1) * models.mimi.frame_size])
                transformed.swap_out(state)
                if codes is not None:
                    outputs[i][0].append(codes)
                    outputs[i][1].append(out)
    for i, seed in enumerate(seeds):
        reference = stream_reference(models, pcms[i], sampling=True, seed=seed)
        assert torch.equal(torch.cat(outputs[i][0], dim=-1), reference.tokens)
        assert torch.equal(torch.cat(outputs[i][1], dim=-1), reference.pcm)
