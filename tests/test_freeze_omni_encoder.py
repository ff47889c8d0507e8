import re

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from cadence_fx.models.freeze_omni_encoder import (
    FreezeOmniEncoderConfig,
    InferStep,
    build_encoder,
    stream_utterance,
)

SMALL = FreezeOmniEncoderConfig.small()
NUM_CHUNKS = 5


class _SoftmaxWidths(TorchFunctionMode):
    """Records the last-axis width of every softmax: the key length an attention layer saw."""

    def __init__(self) -> None:
        super().__init__()
        self.widths: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.softmax, torch.Tensor.softmax, torch.nn.functional.softmax):
            self.widths.append(args[0].shape[-1])
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def encoder():
    return build_encoder(SMALL)


@pytest.fixture(scope="module")
def feats():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(1, NUM_CHUNKS * SMALL.chunk_frames, SMALL.input_dim, generator=generator)


def _steps(encoder, feats, count):
    """(chunk, buffer, pe_index) as each of the first `count` infer calls receives them."""
    c = encoder.config
    window = feats.new_zeros(1, c.chunk_frames + c.chunk_overlap, c.input_dim)
    buffer, pe_index = encoder.init_buffers(), encoder.init_pe_index()
    steps = []
    for new_frames in feats.split(c.chunk_frames, dim=1)[:count]:
        window = torch.cat([window[:, -c.chunk_overlap :], new_frames], dim=1)
        steps.append((window, buffer, pe_index))
        _, buffer, pe_index = encoder.infer(window, buffer, pe_index)
    return steps


def test_one_chunk_of_sixteen_plus_three_frames_is_four_encoder_frames():
    assert SMALL.chunk_size == 4
    assert FreezeOmniEncoderConfig().chunk_size == 4


def test_each_chunk_yields_chunk_size_frames_of_attention_dim(encoder, feats):
    outputs = stream_utterance(encoder, feats)
    assert [tuple(y.shape) for y in outputs] == [(1, 4, SMALL.attention_dim)] * NUM_CHUNKS


def test_attended_extent_is_chunk_size_then_twice_chunk_size(encoder, feats):
    widths = []
    for chunk, buffer, pe_index in _steps(encoder, feats, NUM_CHUNKS):
        with _SoftmaxWidths() as mode:
            encoder.infer(chunk, buffer, pe_index)
        widths.append(mode.widths)
    per_layer = SMALL.num_blocks
    assert widths == [[4] * per_layer] + [[8] * per_layer] * (NUM_CHUNKS - 1)


def test_retention_has_constant_shape_after_the_first_chunk(encoder, feats):
    c = SMALL
    d_k = c.attention_dim // c.attention_heads
    steps = _steps(encoder, feats, 3)
    _, last_buffer, last_pe_index = encoder.infer(*steps[-1])
    for _, buffer, _ in steps[1:] + [(None, last_buffer, None)]:
        kv, cnn = buffer[0::2], buffer[1::2]
        kv_shapes = [tuple(t.shape) for pair in kv for t in pair]
        assert kv_shapes == [(1, c.attention_heads, 4, d_k)] * 2 * c.num_blocks
        assert [tuple(t.shape) for t in cnn] == [(1, c.attention_dim, c.lorder)] * c.num_blocks
    assert [int(pe_index) for _, _, pe_index in steps] + [int(last_pe_index)] == [0, 4, 8, 12]


def test_first_chunk_has_no_keys_and_zero_conv_context(encoder):
    buffer = encoder.init_buffers()
    assert buffer[0::2] == [None] * SMALL.num_blocks
    zero_context = torch.zeros(1, SMALL.attention_dim, SMALL.lorder)
    assert all(torch.equal(t, zero_context) for t in buffer[1::2])


def test_infer_leaves_the_callers_buffer_list_unchanged(encoder, feats):
    chunk, buffer, pe_index = _steps(encoder, feats, 2)[1]
    before = list(buffer)
    encoder.infer(chunk, buffer, pe_index)
    assert all(a is b for a, b in zip(buffer, before)) and len(buffer) == len(before)


def test_streaming_is_deterministic(feats):
    first = stream_utterance(build_encoder(SMALL), feats)
    second = stream_utterance(build_encoder(SMALL), feats)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_same_seed_same_weights_other_seed_other_weights():
    a, b = build_encoder(SMALL), build_encoder(SMALL)
    c = build_encoder(FreezeOmniEncoderConfig.small(seed=1))
    pairs = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    assert all(torch.equal(x, y) for x, y in pairs)
    key = "enc.1.after_norm.bias"
    assert not torch.equal(a.state_dict()[key], c.state_dict()[key])


def test_build_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    build_encoder(SMALL)
    assert torch.equal(torch.get_rng_state(), state)


def test_no_parameter_or_buffer_is_all_zero(encoder):
    tensors = dict(encoder.named_parameters()) | dict(encoder.named_buffers())
    assert [name for name, t in tensors.items() if not torch.any(t)] == []


def test_non_streaming_forward_subsamples_the_whole_utterance_by_four(encoder, feats):
    frames = NUM_CHUNKS * SMALL.chunk_frames
    assert tuple(encoder(feats).shape) == (1, ((frames - 1) // 2 - 1) // 2, SMALL.attention_dim)


def _export(encoder, step):
    return torch.export.export(InferStep(encoder), step, strict=False)


def _producer_chain(node):
    """Targets from a retained output back to the first input they read, and that input's op."""
    chain = []
    while node.op == "call_function":
        chain.append(node.target)
        node = node.args[0][0] if node.target == torch.ops.aten.cat.default else node.args[0]
    return chain, node.op


def test_exported_steady_step_keeps_every_retention_as_cat_then_slice(encoder, feats):
    program = _export(encoder, _steps(encoder, feats, 3)[2])
    output = next(n for n in program.graph.nodes if n.op == "output")
    _, buffer_out, _ = pytree.tree_unflatten(list(output.args[0]), program.call_spec.out_spec)
    chains = [_producer_chain(node) for node in pytree.tree_leaves(buffer_out)]
    cat_slice = ([torch.ops.aten.slice.Tensor, torch.ops.aten.cat.default], "placeholder")
    assert chains == [cat_slice] * 3 * SMALL.num_blocks
    starts = [node.args[2] for node in pytree.tree_leaves(buffer_out)]
    assert starts == [-SMALL.kv_frames, -SMALL.kv_frames, -SMALL.lorder] * SMALL.num_blocks


def test_exported_first_step_trims_nothing_and_concatenates_only_conv_context(encoder, feats):
    program = _export(encoder, _steps(encoder, feats, 1)[0])
    cats = [n for n in program.graph.nodes if n.target == torch.ops.aten.cat.default]
    shapes = [tuple(n.meta["val"].shape) for n in cats]
    assert shapes == [(1, SMALL.attention_dim, 4 + SMALL.lorder)] * SMALL.num_blocks


def test_one_exported_steady_step_replays_every_later_call_bit_exactly(encoder, feats):
    steps = _steps(encoder, feats, NUM_CHUNKS)
    replay = _export(encoder, steps[1]).module()
    for step in steps[1:]:
        got, want = replay(*step), encoder.infer(*step)
        pairs = zip(pytree.tree_leaves(got), pytree.tree_leaves(want), strict=True)
        assert all(torch.equal(a, b) for a, b in pairs)


@pytest.mark.slow
def test_real_size_encoder_streams_two_chunks():
    encoder = build_encoder(FreezeOmniEncoderConfig())
    assert sum(p.numel() for p in encoder.parameters()) == 358_048_768
    outputs = stream_utterance(encoder, torch.randn(1, 32, 80))
    assert [tuple(y.shape) for y in outputs] == [(1, 4, 1024)] * 2


def test_the_linear_feed_forward_keeps_upstreams_buffer_list_of_keys_and_values_only(feats):
    config = FreezeOmniEncoderConfig.small(feed_forward="linear", left_chunks=2)
    encoder = build_encoder(config)
    buffer, pe_index = encoder.init_buffers(), encoder.init_pe_index()
    assert buffer == [None] * config.num_blocks
    d_k = config.attention_dim // config.attention_heads
    extents = []
    for chunk in feats.split(config.chunk_frames, dim=1)[:4]:
        window = torch.cat([chunk.new_zeros(1, config.chunk_overlap, config.input_dim), chunk], dim=1)
        _, buffer, pe_index = encoder.infer(window, buffer, pe_index)
        assert len(buffer) == config.num_blocks
        assert {tuple(t.shape) for kv in buffer for t in kv} == {(1, config.attention_heads, buffer[0][0].size(2), d_k)}
        extents.append(buffer[0][0].size(2))
    assert extents == [4, 8, 8, 8]
    assert not any(".w_1.0." in key or ".w_1.1." in key for key in encoder.state_dict())


def test_post_norm_drops_the_final_norm_and_concat_after_adds_its_linear():
    keys = set(build_encoder(FreezeOmniEncoderConfig.small(normalize_before=False, concat_after=True)).state_dict())
    assert not any(key.startswith("enc.1.after_norm.") for key in keys)
    assert {key for key in keys if "concat_linear" in key} == {
        f"enc.1.encoders.{i}.concat_linear.{p}" for i in range(SMALL.num_blocks) for p in ("weight", "bias")
    }


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"feed_forward": "conv1d"}, "feed_forward 'conv1d': expected one of ('linear', 'conv1d-linear')"),
        ({"pos_enc": "abs-enc"}, "pos_enc 'abs-enc': only 'rel-enc' streams"),
        ({"left_chunks": 0}, "left_chunks 0: a streaming encoder attends to at least one left chunk"),
        ({"conv_kernel_size": 1}, "conv_kernel_size 1: the conv feed-forward needs a kernel of 2 or more"),
        ({"attention_heads": 5}, "attention_dim 64 is not a multiple of attention_heads 5"),
    ],
)
def test_a_configuration_the_streaming_path_cannot_run_is_refused(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        FreezeOmniEncoderConfig.small(**overrides)
