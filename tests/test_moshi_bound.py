"""Moshi transformed from its two bindings on the one pipeline (`models/moshi_bound.py`), reduced
size on a CPU, against the vendor's own loop."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cadence_fx import transform
from cadence_fx.models.moshi import contract_for, moshi_contract
from cadence_fx.models.moshi_bound import WARM_UP_FRAMES
from cadence_fx.models.moshi_stream import SMALL, build_models, random_pcm, stream_reference

FRAMES, SEEDS = 20, (7, 8, 9)
GREEDY_SEED = 3
SAMPLING = "self.temp=0.8, self.top_k=250, self.cfg_coef=1.0"


@pytest.fixture(scope="module")
def models():
    return build_models(SMALL)


@pytest.fixture(scope="module")
def streams(models):
    """Three sampled streams and one greedy stream, each from both models, interleaved."""
    transformed, report = transform(models, contract_for(SMALL))
    adopted = {name: c["adopted"] for name, c in transformed.counters().items()}  # after the construction's warm-up
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
            offsets.append(transformed.models.lm.transformer.layers[0].self_attn._streaming_state.offset_cpu)
        runs.append((sampling, reference, torch.cat(tokens, dim=-1), torch.cat(audio, dim=-1)))
    counters = transformed.counters()
    return transformed, report, runs, addresses, offsets, counters, adopted


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


def test_counters_show_every_call_through_its_graph(streams):
    *_, counters, _ = streams
    warm = 2 * WARM_UP_FRAMES  # silence at construction, in each decoding mode
    sampled, greedy = len(SEEDS) * FRAMES + WARM_UP_FRAMES, FRAMES + WARM_UP_FRAMES
    frames = sampled + greedy
    decoded = frames - (len(SEEDS) + 1 + 2)  # no tokens on each session's first frame (the two warm-up ones too)
    assert frames == warm + (len(SEEDS) + 1) * FRAMES

    def bound(calls, verified):
        return {"calls": calls, "graph_calls": calls, "verified": verified, "stock": 0}

    def eager(calls, **fallbacks):
        return {"calls": calls, "captures": 0, "replays": 0, "eager": calls, "invalidations": 0, "fallbacks": fallbacks}

    # Every call runs its class's graph; the first two of each class ran beside the stock call
    # (verified), the others went through the replay engine, which without CUDA runs the graph
    # eagerly (no_cuda). The sampling depformer reads the CPU generator, a host RNG, so the engine
    # refuses to capture it (host_rng) and runs its graph eagerly too.
    got = {name: {k: v for k, v in c.items() if k not in ("adopted", "stock_by_reason")} for name, c in counters.items()}
    assert got == {
        "mimi_encode": {**bound(frames, 2), "replay": eager(frames - 2, no_cuda=frames - 2)},
        "mimi_decode": {**bound(decoded, 2), "replay": eager(decoded - 2, no_cuda=decoded - 2)},
        "lm_step": {**bound(frames, 2), "replay": eager(frames - 2, no_cuda=frames - 2)},
        "depformer_step": {**bound(frames, 4), "replay": eager(frames - 4, host_rng=sampled - 2, no_cuda=greedy - 2)},
    }
    # The LM step took each ring and device-side offset at one address at its first call (two
    # layers: a ring, an offset and a ring end each; the transformer's offsets), never again.
    assert counters["lm_step"]["adopted"] == 7


def test_each_operator_has_one_class_per_decoding_mode_from_the_catalog(streams):
    transformed, report, *_ = streams
    assert {op.name: op.width for op in report.catalog.operators} == {
        "mimi_encode": 1,
        "lm_step": 1,
        "depformer_step": 1,
        "mimi_decode": 1,
    }
    assert [
        cls.name for model in transformed.bound.values() for op in model.operators.values() for cls in op.classes.values()
    ] == [
        "mimi_encode[n=2,L=250]",
        "mimi_decode[n=2,L=250]",
        "lm_step[n=1,L=3000]",
        f"depformer_step[n=1,L=8]{{self.use_sampling=True, {SAMPLING}}}",
        f"depformer_step[n=1,L=8]{{self.use_sampling=False, {SAMPLING}}}",
    ]
    assert all(
        not cls.refused for model in transformed.bound.values() for op in model.operators.values() for cls in op.classes.values()
    )


def test_the_streaming_state_keeps_one_address_per_tensor_across_sessions(streams):
    """Every tensor the graphs read as state is one of the streaming state's own, and no call after
    the construction's warm-up had to take a tensor into its address again (`adopted`): what the
    vendor rebinds (Mimi's padded convs' `first` flags) is written into the one tensor it keeps."""
    transformed, _, _, addresses, _, counters, adopted = streams
    owned = {id(slot.tensor) for slot in transformed.state.tensors}
    held = [t for model in transformed.bound.values() for op in model.operators.values() for t in op.held.values()]
    assert held and all(id(t) in owned for t in held)
    assert {name: c["adopted"] for name, c in counters.items()} == adopted
    originals = [slot.tensor.data_ptr() for slot in transformed.state.tensors]
    assert addresses == [originals] * len(addresses)


def test_the_probationary_call_leaves_host_counters_as_eager_does(streams):
    *_, offsets, _, _ = streams
    assert offsets == [FRAMES] * (len(SEEDS) + 1)


def test_the_vendors_glue_calls_the_bound_lm_steps(streams):
    transformed, *_ = streams
    gen_state = transformed.lm_gen._streaming_state
    assert gen_state.graphed_main is transformed.bound["lm"].operators["lm_step"]
    assert gen_state.graphed_depth is transformed.bound["lm"].operators["depformer_step"]


def test_every_ring_is_the_vendors_own_written_in_place(streams):
    _, report, *_ = streams
    written = {(s.graph.split("[")[0], s.region) for s in report.sites if "written in place" in s.reason}
    assert written == {("mimi_encode", "mimi_encoder_kv"), ("mimi_decode", "mimi_decoder_kv"), ("lm_step", "lm_kv")}
    assert report.carries == {} and not any(s.rewritten for s in report.sites)


def test_the_input_models_never_stream_for_it(streams, models):
    transformed, *_ = streams
    assert not any(m.is_streaming for m in (models.mimi, models.lm))
    assert transformed.models.mimi is not models.mimi and transformed.models.lm.text_linear.weight is models.lm.text_linear.weight
    with transformed.session(sampling=False, seed=0), pytest.raises(RuntimeError, match="a session is already open"):
        with transformed.session(sampling=False, seed=0):
            pass


def test_replay_off_streams_the_same_through_the_graphs(models):
    transformed, report = transform(models, contract_for(SMALL), replay=False)
    pcm = random_pcm(10, seed=5)
    got = transformed.stream(pcm, sampling=True, seed=1)
    want = stream_reference(models, pcm, sampling=True, seed=1)
    assert report.replays == {} and transformed.replays == {}
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.pcm, want.pcm)


def test_a_contract_for_another_model_is_refused(models):
    with pytest.raises(ValueError, match=r"region 'lm_kv' declares bfloat16, the LM runs in torch.float32"):
        transform(models, moshi_contract())
    with pytest.raises(
        ValueError,
        match=r"region 'lm_kv': the binding's paths .* reach 2 tensors .* the contract's "
        r"leading dims \(32,\) ask for 32",
    ):
        transform(
            models,
            moshi_contract(
                lm_dtype="float32",
                mimi_layers=2,
                mimi_heads=2,
                mimi_dim=128,
                depformer_layers=2,
                depformer_heads=4,
                depformer_dim=64,
            ),
        )
    with pytest.raises(ValueError, match=r"contract quantity depformer_layers=7 but the model has 2: declare depformer_layers=2"):
        transform(
            models,
            moshi_contract(
                lm_dtype="float32",
                mimi_layers=2,
                mimi_heads=2,
                mimi_dim=128,
                lm_layers=2,
                lm_heads=4,
                lm_dim=128,
                depformer_layers=7,
                depformer_heads=4,
                depformer_dim=64,
            ),
        )


@pytest.mark.slow
def test_the_benchmark_smoke_mode_runs_every_arm_bit_exact_on_a_cpu(tmp_path):
    script = Path(__file__).resolve().parents[1] / "bench" / "moshi.py"
    out = tmp_path / "moshi.json"
    command = [
        sys.executable,
        str(script),
        "--small",
        "--frames",
        "10",
        "--streams",
        "1",
        "--warmup-frames",
        "3",
        "--repeat-frames",
        "3",
        "--out",
        str(out),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(out.read_text())
    assert list(record["arms"]) == ["eager", "vendor", "cadence"]
    assert record["eager_repeats_itself"] is True
    one = {"tokens": 1, "pcm": 1, "of": 1}
    assert all(arm["streams_equal_to_eager"] == {"sampling": one, "greedy": one} for arm in record["arms"].values())
    # the transform's own warm-up, then the benchmark's warm-up and measured frames, both modes
    assert record["arms"]["cadence"]["replay"]["lm_step"]["calls"] == 2 * (WARM_UP_FRAMES + 3 + 10)
    assert record["summary"]["target_bit_exact_all_streams"] is True
    assert record["png"] in ("skipped: matplotlib is not installed", str(out.with_suffix(".png")))
    assert {"commit", "command", "device", "torch", "determinism"} <= set(record)


def test_two_streams_taking_turns_on_one_streaming_state_each_equal_the_vendor_alone():
    """The one transformed interface: inside one session, two sampled streams swap their state in
    and out frame by frame (`swap_in` / `swap_out`), and each equals the vendor's loop run alone."""
    models = build_models(SMALL)  # its own models: the module fixture's are shared with the tests above
    transformed, _ = transform(models, contract_for(SMALL))
    seeds, frames = (21, 22), 12
    pcms = [random_pcm(frames, seed=200 + i) for i in range(2)]
    outputs = [([], []), ([], [])]
    with transformed.session(sampling=True, seed=0) as step:
        states = [transformed.session_state(seed) for seed in seeds]  # both from the fresh streaming state
        for t in range(frames):
            for i, state in enumerate(states):
                transformed.swap_in(state)
                codes, out = step(pcms[i][..., t * models.mimi.frame_size : (t + 1) * models.mimi.frame_size])
                transformed.swap_out(state)
                if codes is not None:
                    outputs[i][0].append(codes)
                    outputs[i][1].append(out)
    for i, seed in enumerate(seeds):
        reference = stream_reference(models, pcms[i], sampling=True, seed=seed)
        assert torch.equal(torch.cat(outputs[i][0], dim=-1), reference.tokens)
        assert torch.equal(torch.cat(outputs[i][1], dim=-1), reference.pcm)
