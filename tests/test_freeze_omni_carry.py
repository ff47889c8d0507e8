"""Freeze-Omni on the one binding pipeline (small config, CPU): `transform(encoder, contract)` takes
the family's binding (data: `freeze_omni_binding`), and the window pass gives carries, audit and
graph diff. Sites are named by their path in `infer`'s buffer list: with the conv feed-forward,
layer l's keys are `buffer.{2l}.0`, its values `buffer.{2l}.1`, its conv context `buffer.{2l+1}`."""

import re
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from cadence_fx import AuditMismatch, derive, transform
from cadence_fx.diff import diff_graphs, render_text
from cadence_fx.models.freeze_omni import encoder_contract, freeze_omni_contract
from cadence_fx.models.freeze_omni_encoder import FreezeOmniEncoderConfig, build_encoder, stream_utterance
from cadence_fx.passes.carry import Carry
from cadence_fx.passes.window import Window, WindowError, rewrite_windows

SMALL = FreezeOmniEncoderConfig.small()
CHUNKS = (3, 4, 5)  # chunks per utterance: each crosses both classes
SITES = 3 * SMALL.num_blocks  # keys, values and conv context per layer


def class_name(extent: int, chunk: int = 4) -> str:
    return f"encoder_chunk[n={chunk},L={extent}]"


def site(region: str, layer: int, part: str = "") -> str:
    """A site's path in the conv feed-forward's buffer list `[kv_0, cnn_0, kv_1, cnn_1, ...]`."""
    if region == "attention_kv":
        return f"buffer.{2 * layer}.{0 if part == 'keys' else 1}"
    return f"buffer.{2 * layer + 1}"


def contract_for(config):
    return freeze_omni_contract(blocks=config.num_blocks, d_model=config.attention_dim, heads=config.attention_heads)


@dataclass
class Run:
    equal: list = field(default_factory=list)
    retained_equal: list = field(default_factory=list)
    addresses: dict = field(default_factory=dict)
    audit: dict = field(default_factory=dict)  # the auditor's counters after these utterances
    calls: dict = field(default_factory=dict)


def _leaves(buffer):
    return [t for entry in buffer for t in (entry if isinstance(entry, list) else [entry])]


@pytest.fixture(scope="module")
def encoder():
    return build_encoder(SMALL)


@pytest.fixture(scope="module")
def streamed(encoder):
    transformed, report = transform(encoder, contract_for(SMALL), audit=True)
    names = [
        site(region, layer, part)
        for layer in range(SMALL.num_blocks)
        for region, part in (("attention_kv", "keys"), ("attention_kv", "values"), ("conv_left_context", ""))
    ]
    run = Run()
    generator = torch.Generator().manual_seed(1)
    c = SMALL
    for chunks in CHUNKS:
        feats = torch.randn(1, chunks * c.chunk_frames, c.input_dim, generator=generator)
        window = feats.new_zeros(1, c.chunk_frames + c.chunk_overlap, c.input_dim)
        stock = (encoder.init_buffers(), encoder.init_pe_index())
        carried = (transformed.init_buffers(), transformed.init_pe_index())
        for new_frames in feats.split(c.chunk_frames, dim=1):
            window = torch.cat([window[:, -c.chunk_overlap :], new_frames], dim=1)
            ys, *stock = encoder.infer(window, *stock)
            got, *carried = transformed.infer(window, *carried)
            run.equal.append(torch.equal(ys, got) and torch.equal(stock[1], carried[1]))
            run.retained_equal.append(all(torch.equal(a, b) for a, b in zip(_leaves(stock[0]), _leaves(carried[0]), strict=True)))
            for name, t in zip(names, _leaves(carried[0]), strict=True):
                run.addresses.setdefault(name, set()).add(t.data_ptr())
    run.audit, run.calls = report.auditor.counters(), dict(transformed.calls)
    return transformed, report, run


def test_output_is_bit_identical_to_eager_over_utterances_crossing_both_classes(streamed):
    _, _, run = streamed
    assert len(run.equal) == sum(CHUNKS)
    assert all(run.equal)
    assert run.calls == {class_name(0): len(CHUNKS), class_name(4): sum(CHUNKS) - len(CHUNKS)}


def test_the_stock_driver_runs_the_transformed_encoder_unchanged(encoder, streamed):
    transformed, _, _ = streamed
    feats = torch.randn(1, 4 * SMALL.chunk_frames, SMALL.input_dim, generator=torch.Generator().manual_seed(5))
    pairs = zip(stream_utterance(encoder, feats), stream_utterance(transformed, feats), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def test_retained_state_equals_the_stock_retention_after_every_chunk(streamed):
    _, _, run = streamed
    assert all(run.retained_equal)


def test_each_site_keeps_one_carry_address_for_every_chunk_and_utterance(streamed):
    transformed, report, run = streamed
    assert run.addresses == {name: {carry.address} for name, carry in transformed.carries.items()}
    kv, conv = report.carries["attention_kv"], report.carries["conv_left_context"]
    assert transformed.carries[site("attention_kv", 1, "values")].address == kv.buffer[1, 1].data_ptr()
    assert transformed.carries[site("conv_left_context", 1)].address == conv.buffer[1].data_ptr()


def test_carries_are_allocated_at_the_derived_bounds(streamed):
    _, report, _ = streamed
    d_k = SMALL.attention_dim // SMALL.attention_heads
    assert {name: tuple(c.buffer.shape) for name, c in report.carries.items()} == {
        "attention_kv": (SMALL.num_blocks, 2, 1, SMALL.attention_heads, 8, d_k),
        "conv_left_context": (SMALL.num_blocks, 1, SMALL.attention_dim, SMALL.lorder),
    }
    # The stock retained slices pin their whole concat: 4 + 4 key frames, 2 + 4 conv frames.
    assert report.managed_bytes() == {
        "attention_kv": (SMALL.num_blocks * 2 * SMALL.attention_heads * 8 * d_k * 4,) * 2,
        "conv_left_context": (SMALL.num_blocks * SMALL.attention_dim * 6 * 4, SMALL.num_blocks * SMALL.attention_dim * 2 * 4),
    }


def test_the_auditor_counts_every_retention_and_finds_no_mismatch(streamed):
    _, _, run = streamed
    chunks, first = sum(CHUNKS), len(CHUNKS)
    blocks = SMALL.num_blocks
    assert run.audit == {
        "retentions": SITES * chunks,
        # the conv context evicts on every chunk; keys and values from each utterance's second chunk on
        "applications": blocks * chunks + 2 * blocks * (chunks - first),
        "mismatches": 0,
        "distinct_carry_addresses": {
            site(region, layer, part): 1
            for layer in range(blocks)
            for region, part in (("attention_kv", "keys"), ("attention_kv", "values"), ("conv_left_context", ""))
        },
    }


def test_report_names_every_rewritten_site_per_class(streamed):
    _, report, _ = streamed
    kinds = sorted((s.graph, s.region, s.kind, s.rewritten) for s in report.sites)
    blocks = SMALL.num_blocks
    assert kinds == sorted(
        [(class_name(0), "attention_kv", "keep", True)] * 2 * blocks
        + [(class_name(0), "conv_left_context", "append", True)] * blocks
        + [(class_name(4), "attention_kv", "append", True)] * 2 * blocks
        + [(class_name(4), "conv_left_context", "append", True)] * blocks
    )
    assert all(s.axis == 2 for s in report.sites)


def _removed(before, after):
    """Targets of the nodes the rewrite removed, by aten name."""
    kept = {n.name for n in after.graph.nodes}
    return Counter(n.target.__name__.split(".")[0] for n in before.graph.nodes if n.name not in kept)


def test_the_diff_report_shows_the_rewritten_sites(streamed):
    _, report, _ = streamed
    blocks = SMALL.num_blocks
    diffs = {name: diff_graphs(name, before, after) for name, (before, after) in report.graphs.items()}
    steady, first = diffs[class_name(4)], diffs[class_name(0)]
    # Steady: the K/V concats and every retention slice are gone; the conv concat builds its operand.
    assert _removed(*report.graphs[class_name(4)]) == {"cat": 2 * blocks, "slice": 3 * blocks}
    assert {op: n for op, n in steady.added.items() if not op.startswith("attr")} == {
        "window_append": 2 * blocks,
        "window_evict": 2 * blocks,
        "window_keep": blocks,
    }
    assert _removed(*report.graphs[class_name(0)]) == {"slice": blocks}
    assert {op: n for op, n in first.added.items() if not op.startswith("attr")} == {
        "window_adopt": 2 * blocks,
        "window_keep": blocks,
    }
    assert sum(n for op, n in steady.added.items() if op.startswith("attr carry_")) == SITES
    text = render_text(list(diffs.values()))
    assert text.count("\n-cat") == 2 * blocks
    assert "+window_append = window_append(carry_buffer_0_0, state_0, transpose_2)" in text
    assert "+window_evict = window_evict(carry_buffer_0_0, window_append, 4, 0)" in text
    assert "+window_keep = window_keep(carry_buffer_1, state_4, cat_2, 2, 0)" in text


def test_positional_table_writes_are_not_retention_and_stay(streamed):
    _, report, _ = streamed
    for before, after in report.graphs.values():
        copies = [
            [n.args[0].args[1:] for n in gm.graph.nodes if n.target is torch.ops.aten.copy_.default] for gm in (before, after)
        ]
        assert copies[0] == copies[1] == [(1, 0, 9223372036854775807, 2), (1, 1, 9223372036854775807, 2)]


def test_the_input_encoder_is_left_untouched(encoder, streamed):
    again = build_encoder(SMALL)
    pairs = zip(encoder.state_dict().values(), again.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def test_the_auditor_catches_a_carry_that_keeps_the_wrong_frames(encoder, monkeypatch):
    transformed, report = transform(encoder, contract_for(SMALL), audit=True)
    carry = transformed.carries[site("attention_kv", 1, "keys")] if transformed.carries else None
    if carry is None:  # the carries are allocated at the first call
        stream_utterance(transformed, torch.randn(1, SMALL.chunk_frames, SMALL.input_dim))
        transformed.reset()
        carry = transformed.carries[site("attention_kv", 1, "keys")]
    monkeypatch.setattr(carry, "keep", lambda full, segments: Carry.keep(carry, full, ((0, 4),)))
    feats = torch.randn(1, 3 * SMALL.chunk_frames, SMALL.input_dim, generator=torch.Generator().manual_seed(2))
    with pytest.raises(AuditMismatch) as caught:
        stream_utterance(transformed, feats)
    assert (caught.value.site, caught.value.chunk) == (site("attention_kv", 1, "keys"), 2)
    assert report.auditor.mismatches == 1


def test_a_buffer_from_elsewhere_is_adopted_into_its_carry_and_counted(encoder, streamed):
    transformed, report, _ = streamed
    op = report.operators["encoder_chunk"]
    adopted = op.counters.adopted
    buffer = transformed.init_buffers()
    buffer[1] = buffer[1].clone() + 1  # a conv context that is not the carry's view
    chunk = torch.randn(1, SMALL.chunk_frames + SMALL.chunk_overlap, SMALL.input_dim)
    stock = encoder.infer(chunk, [b.clone() if isinstance(b, torch.Tensor) else b for b in buffer], encoder.init_pe_index())
    got = transformed.infer(chunk, buffer, transformed.init_pe_index())
    assert torch.equal(got[0], stock[0])
    assert op.counters.adopted == adopted + SMALL.num_blocks  # both layers' conv contexts came from elsewhere
    assert got[1][1].data_ptr() == transformed.carries[site("conv_left_context", 0)].address


def test_a_declaration_the_graph_does_not_have_is_refused(streamed):
    transformed, report, _ = streamed
    before, _ = report.graphs[class_name(4)]
    wrong = Window(site("attention_kv", 0, "keys"), "attention_kv", output=1, input="state_0", axis=2, keep=3, live=8, held=True)
    with pytest.raises(WindowError, match=r"keeps the last 4 units along axis 2, the region retains the last 3"):
        rewrite_windows(before, (wrong,), transformed.carries, graph="planted")


def test_a_contract_for_another_size_is_refused(encoder):
    with pytest.raises(ValueError, match="contract quantity blocks=24 but the encoder has 2"):
        transform(encoder, freeze_omni_contract())


def test_at_the_operating_point_every_held_operand_has_the_stock_concats_strides(streamed):
    _, report, _ = streamed
    held = [s for s in report.sites if s.region == "attention_kv" and s.kind == "append"]
    assert len(held) == 2 * SMALL.num_blocks
    assert all("its strides are the stock concat's" in s.reason for s in held)


def test_two_left_chunks_give_three_classes_all_bit_identical():
    config = FreezeOmniEncoderConfig.small(left_chunks=2)
    encoder = build_encoder(config)
    contract = freeze_omni_contract(
        blocks=config.num_blocks, d_model=config.attention_dim, heads=config.attention_heads, left_chunks=2
    )
    transformed, report = transform(encoder, contract, audit=True)
    feats = torch.randn(1, 5 * config.chunk_frames, config.input_dim, generator=torch.Generator().manual_seed(3))
    pairs = zip(stream_utterance(encoder, feats), stream_utterance(transformed, feats), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    assert transformed.calls == {class_name(0): 1, class_name(4): 1, class_name(8): 3}
    assert report.auditor.mismatches == 0
    # The middle class keeps its concat whole: its operand is a prefix of the 12-frame carry.
    middle = [s.reason for s in report.sites if s.graph == class_name(4) and s.region == "attention_kv"]
    assert all("a strided view of the 8-unit prefix" in r and r.endswith("kept whole") for r in middle)


def test_without_audit_each_class_is_verified_twice_then_runs_its_graph(encoder):
    transformed, report = transform(encoder, contract_for(SMALL))
    generator = torch.Generator().manual_seed(4)
    for chunks in CHUNKS:
        feats = torch.randn(1, chunks * SMALL.chunk_frames, SMALL.input_dim, generator=generator)
        pairs = zip(stream_utterance(encoder, feats), stream_utterance(transformed, feats), strict=True)
        assert all(torch.equal(a, b) for a, b in pairs)
        assert {carry.extent for carry in transformed.carries.values()} == {SMALL.kv_frames, SMALL.lorder}
    op = report.operators["encoder_chunk"]
    # Each utterance starts from init_buffers: fresh conv contexts, adopted into their carries.
    assert op.counters.as_dict() == {
        "calls": sum(CHUNKS),
        "graph_calls": sum(CHUNKS),
        "verified": 4,
        "stock": 0,
        "adopted": len(CHUNKS) * SMALL.num_blocks,
        "stock_by_reason": {},
    }
    assert all(cls.refused is None and cls.verify_left == 0 for cls in op.classes.values())
    # The verified calls of each class never reach the engine; without CUDA it runs the others eager.
    engine = op.replay
    assert report.replays == {"encoder_chunk": engine}
    assert sorted(engine.certificates) == [class_name(0), class_name(4)]
    assert all(c.admitted for c in engine.certificates.values())
    assert engine.counters.as_dict() == {
        "calls": sum(CHUNKS) - 4,
        "captures": 0,
        "replays": 0,
        "eager": sum(CHUNKS) - 4,
        "invalidations": 0,
        "fallbacks": {"no_cuda": sum(CHUNKS) - 4},
    }


@pytest.mark.parametrize(
    ("left_chunks", "grid"),
    [
        (1, (0, 4)),
        (2, (0, 4, 8)),
        (4, (0, 4, 8, 12, 16)),
        (16, tuple(range(0, 68, 4))),
    ],
)
def test_the_catalog_of_the_released_encoder_has_one_class_per_left_chunk_and_one_more(left_chunks, grid):
    catalog = derive(encoder_contract(FreezeOmniEncoderConfig.released(left_chunks=left_chunks)))
    op = catalog.operator("encoder_chunk")
    assert (op.width, op.grid) == (left_chunks + 1, grid)
    assert [(c.call, c.extent, c.flush) for c in op.classes] == [(4, extent, False) for extent in grid]
    # The linear feed-forward retains nothing: keys and values are the only region.
    assert [(r.name, r.shape) for r in catalog.regions] == [("attention_kv", (24, 2, 1, 16, 4 * (left_chunks + 1), 64))]


def test_the_conv_feed_forward_adds_its_left_context_whatever_the_left_chunks():
    catalog = derive(encoder_contract(FreezeOmniEncoderConfig(left_chunks=3)))
    assert catalog.operator("encoder_chunk").grid == (0, 4, 8, 12)
    assert [(r.name, r.shape) for r in catalog.regions] == [
        ("attention_kv", (24, 2, 1, 16, 16, 64)),
        ("conv_left_context", (24, 1, 1024, 2)),
    ]


def test_a_contract_with_a_conv_region_is_refused_for_a_linear_feed_forward():
    config = FreezeOmniEncoderConfig.small(feed_forward="linear")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "the contract declares regions ('attention_kv', 'conv_left_context') but the encoder (linear feed-forward) "
            "keeps ('attention_kv',): derive the contract with encoder_contract(encoder.config)"
        ),
    ):
        transform(build_encoder(config), contract_for(config))


def test_the_linear_feed_forward_with_three_left_chunks_carries_keys_and_values_only_bit_identically():
    config = FreezeOmniEncoderConfig.small(feed_forward="linear", left_chunks=3)
    encoder = build_encoder(config)
    transformed, report = transform(encoder, encoder_contract(config), audit=True)
    x = torch.randn(1, 6 * config.chunk_frames, config.input_dim, generator=torch.Generator().manual_seed(6))
    pairs = zip(stream_utterance(encoder, x), stream_utterance(transformed, x), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    assert transformed.calls == {class_name(0): 1, class_name(4): 1, class_name(8): 1, class_name(12): 3}
    blocks = config.num_blocks
    assert sorted((s.graph, s.kind) for s in report.sites) == sorted(
        [(class_name(0), "keep")] * 2 * blocks
        + [(class_name(extent), "append") for extent in (4, 8, 12) for _ in range(2 * blocks)]
    )
    # Until the window is full the concat is kept whole; the last class evicts a chunk a call.
    kept_whole = [s for s in report.sites if s.graph in (class_name(4), class_name(8))]
    assert all(s.reason.endswith("kept whole") for s in kept_whole)
    assert all("compacted in place" in s.reason for s in report.sites if s.graph == class_name(12))
    assert report.auditor.counters()["mismatches"] == 0
    assert report.auditor.counters()["retentions"] == 2 * blocks * 6
