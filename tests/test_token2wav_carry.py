"""The state rule and the carry on the real MiniCPM-o Token2Wav flow (reduced depth, CPU)."""

from dataclasses import dataclass, field

import pytest
import torch

from cadence_fx import AuditMismatch, transform
from cadence_fx.diff import diff_graphs, render_html, render_text
from cadence_fx.models.token2wav import token2wav_contract
from cadence_fx.models.token2wav_carry import ENVELOPES, CarryStream, reference_flow
from cadence_fx.models.token2wav_stream import StockStream, build_hift, random_chunks, random_prompt
from cadence_fx.passes.carry import rewrite_trims, trace_trim
from pagekit import Page

pytestmark = pytest.mark.slow

BLOCKS, CHUNKS = 8, 6


@dataclass
class Run:
    mel_equal: list = field(default_factory=list)
    cache_equal: list = field(default_factory=list)
    addresses: dict = field(default_factory=dict)


def live(stock: torch.Tensor, carried: torch.Tensor) -> torch.Tensor:
    """The stock envelope's slots that hold the live state (10 of 16 steps, the real depth)."""
    return stock[tuple(slice(0, d) for d in carried.shape)]


@pytest.fixture(scope="module")
def reference():
    flow, contract, prompt_tokens = reference_flow("reduced")
    return flow, contract, random_prompt(0, n_tokens=prompt_tokens)


@pytest.fixture(scope="module")
def streamed(reference):
    flow, contract, prompt = reference
    transformed, report = transform(flow, contract, audit=True)
    stock, carried = StockStream(flow, None, prompt), CarryStream(transformed, prompt)
    run = Run()
    for block in range(BLOCKS):
        for stream in (stock, carried):
            stream.setup() if block == 0 else stream.reset_turn()
        chunks = random_chunks(100 + block, CHUNKS)
        for i, tokens in enumerate(chunks):
            last = i == CHUNKS - 1
            mel_stock, mel_carried = stock.flow_chunk(tokens, last), carried.flow_chunk(tokens, last)
            run.mel_equal.append(torch.equal(mel_stock, mel_carried))
            run.cache_equal.append(
                {k: torch.equal(live(stock.stream_cache[k], v), v) for k, v in carried.stream_cache.items()}
            )
            for key in ("estimator_att_cache", "conformer_att_cache"):
                run.addresses.setdefault(key, set()).add(carried.stream_cache[key].data_ptr())
    return run, report


def test_mel_is_bit_identical_to_the_vendor_stream_across_turns(streamed):
    run, _ = streamed
    assert len(run.mel_equal) == BLOCKS * CHUNKS
    assert all(run.mel_equal)


def test_every_cache_is_bit_identical_after_every_chunk(streamed):
    run, _ = streamed
    assert all(all(chunk.values()) for chunk in run.cache_equal)
    assert set(run.cache_equal[0]) == {"conformer_cnn_cache", "conformer_att_cache", "estimator_cnn_cache", "estimator_att_cache"}


def test_each_carry_keeps_one_address_for_the_whole_stream(streamed):
    run, report = streamed
    assert run.addresses == {
        "estimator_att_cache": {report.carries["estimator_att_cache"].address},
        "conformer_att_cache": {report.carries["conformer_att_cache"].address},
    }


def test_the_auditor_counts_every_retention_and_finds_no_mismatch(streamed):
    _, report = streamed
    # Per turn: chunks 1-2 keep everything (102 + 50, 102 + 100 <= 202); chunks 3-6 evict.
    assert report.auditor.counters() == {
        "retentions": 2 * BLOCKS * CHUNKS,
        "applications": 2 * BLOCKS * (CHUNKS - 2),
        "mismatches": 0,
        "distinct_carry_addresses": {"conformer_att_cache": 1, "estimator_att_cache": 1},
    }


def test_the_auditor_catches_a_carry_that_keeps_the_prompt_whole(reference):
    """A carry that evicts by the prompt-plus-history policy (newest history, whole prompt, as
    an ordering-aware carry would) instead of the vendor's [:P] + [-100:] trim on the prepend-
    ordered DiT cache: caught at chunk 3, the first chunk whose eviction reaches the prompt."""
    flow, contract, prompt = reference
    transformed, report = transform(flow, contract, audit=True, capture=False)
    planted, _, _ = rewrite_trims(
        trace_trim(4, head=100, tail=102), {"cache": "estimator_att_cache"}, report.carries, graph="planted"
    )
    transformed.trims["estimator_att_cache"] = planted
    stream = CarryStream(transformed, prompt)
    stream.setup()
    chunks = random_chunks(7, 3)
    stream.flow_chunk(chunks[0])
    stream.flow_chunk(chunks[1])
    with pytest.raises(AuditMismatch) as caught:
        stream.flow_chunk(chunks[2])
    assert (caught.value.site, caught.value.chunk) == ("estimator_att_cache", 3)
    assert caught.value.index is not None
    assert report.auditor.mismatches == 1


def test_demand_sizing_measured_on_the_buffers(reference, streamed):
    flow, _, _ = reference
    _, report = streamed
    stock = {e.region: flow.get_buffer(e.path).nbytes for e in ENVELOPES}
    assert stock == {
        "estimator_att_cache": 16 * 16 * 2 * 8 * 1000 * 128 * 4,
        "estimator_cnn_cache": 16 * 16 * 2 * 1024 * 2 * 4,
        "dit_block_att_cache": 16 * 2 * 8 * 1000 * 128 * 4,
        "dit_block_cnn_cache": 16 * 2 * 1024 * 2 * 4,
    }
    carried = {r.region: r.demand_bytes for r in report.resizes}
    # 10 solver steps, 2 DiT blocks, 102 prompt + 100 retained + 56 frames of the final chunk.
    assert carried == {
        "estimator_att_cache": 10 * 2 * 2 * 8 * 258 * 128 * 4,
        "estimator_cnn_cache": 10 * 2 * 2 * 1024 * 2 * 4,
        "dit_block_att_cache": 2 * 2 * 8 * 258 * 128 * 4,
        "dit_block_cnn_cache": 2 * 2 * 1024 * 2 * 4,
    }
    assert report.managed_bytes() == {region: (stock[region], carried[region]) for region in stock}


def test_the_input_model_is_left_untouched(reference, streamed):
    flow, _, _ = reference
    assert flow.decoder.att_cache_buffer.shape == (16, 16, 2, 8, 1000, 128)


def test_report_names_every_site_with_its_ordering(streamed):
    _, report = streamed
    kinds = sorted({(s.graph, s.kind, s.rewritten) for s in report.sites})
    assert kinds == [
        ("conformer", "append", False),
        ("conformer_att_cache_trim", "trim", True),
        ("dit_estimator", "prepend", False),
        ("estimator_att_cache_trim", "trim", True),
    ]
    # Two concats (keys and values) per attention block: 2 DiT blocks, 2 conformer blocks.
    assert sum(s.kind == "prepend" for s in report.sites) == 4
    assert sum(s.kind == "append" for s in report.sites) == 4


def test_the_diff_report_shows_every_rewritten_site(streamed, tmp_path):
    _, report = streamed
    diffs = {name: diff_graphs(name, before, after) for name, (before, after) in report.graphs.items()}
    for name in ("estimator_att_cache_trim", "conformer_att_cache_trim"):
        assert dict(diffs[name].removed) == {"cat": 1, "getitem": 2}
        assert dict(diffs[name].added) == {"attr carry_" + name.removesuffix("_trim"): 1, "carry_keep": 1}
    text = render_text(list(diffs.values()))
    assert text.count("+carry_keep = carry_keep(") == 2
    assert "-cat = cat([getitem, getitem_1], dim=4)" in text
    assert "-cat = cat([getitem, getitem_1], dim=3)" in text


def test_the_report_page_draws_each_trim_rewrite_and_links_its_carry_to_the_site(streamed):
    _, report = streamed
    page = Page(render_html(report, report.catalog, stream="the streams of this module"))
    assert page.errors == [] and page.external() == [] and "://" not in page.text
    for name in ("estimator_att_cache_trim", "conformer_att_cache_trim"):
        carry = "carry_" + name.removesuffix("_trim")
        before, after = f"svg-{name}-before", f"svg-{name}-after"
        assert set(page.svgs[before]) == {"cache", "getitem", "getitem_1", "cat", "output"}
        assert page.marked(before, "removed") == {"getitem", "getitem_1", "cat"}
        assert page.marked(before, "site") == {"cat"}
        assert page.marked(after, "added") == {carry, "carry_keep"}
        assert page.marked(after, "carry") == {carry}
        assert page.marked(before, "changed") == page.marked(after, "changed") == {"output"}
        assert page.links(after) == {carry: f"#site-{name}-cat", "carry_keep": f"#site-{name}-cat"}
    # The DiT's buffers shrank to demand; its prepend concats are sites left in place.
    assert page.marked("svg-dit_estimator-before", "changed") == {
        "estimator_att_cache_buffer", "estimator_cnn_cache_buffer", "select_4", "select_8", "slice_7"}
    assert page.marked("svg-dit_estimator-after", "site") == {"cat_4", "cat_5", "cat_10", "cat_11"}
    assert page.marked("svg-dit_estimator-after", "added") == set()


def test_the_report_page_lists_exactly_the_derivation_and_certifies_every_streamed_class(streamed):
    _, report = streamed
    catalog = report.catalog
    page = Page(render_html(report, catalog))
    assert page.values("data-region") == [r.name for r in catalog.regions]
    assert page.values("data-carry") == ["estimator_att_cache", "conformer_att_cache"]
    assert page.values("data-operator") == ["cfm_loop", "dit_estimator", "conformer_encoder", "hift"]
    assert page.values("data-class") == [
        f"{op}:{call}@{extent}{flush}" for op in ("cfm_loop", "dit_estimator", "conformer_encoder")
        for call, extent, flush in ((50, 102, ""), (50, 152, ""), (50, 202, ""), (56, 202, ":flush"))
    ] + ["hift:50@0", "hift:50@8", "hift:56@8:flush"]
    assert page.values("data-replay-class") == [
        "steady f=50 L=102", "steady f=50 L=152", "steady f=50 L=202", "flush f=56 L=202",
        "steady L=102", "steady L=152", "steady L=202", "flush L=202",
    ]
    # Every class was called in the module's streams: each has its certificate, none refused.
    assert page.text.count('<dl class="certificate admitted">') == 8
    assert 'class="certificate refused"' not in page.text
    assert page.text.count("No replay engine for this operator in this transform.") == 2
    assert f"{report.auditor.retentions} retentions checked" in page.text and "<b>0 mismatches</b>" in page.text


def test_a_contract_for_another_depth_is_refused(reference):
    flow, _, _ = reference
    with pytest.raises(ValueError, match="contract quantity depth=16 but the flow has 2"):
        transform(flow, token2wav_contract(f_prompt=102), capture=False)


def test_a_prompt_the_contract_does_not_declare_is_refused(reference):
    flow, contract, _ = reference
    transformed, _ = transform(flow, contract, capture=False)
    stream = CarryStream(transformed, random_prompt(0, n_tokens=60))
    with pytest.raises(ValueError, match="the prompt has 120 mel frames, the contract declares f_prompt=102"):
        stream.setup()


def test_transform_rejects_what_is_not_a_contract(reference):
    flow, _, _ = reference
    with pytest.raises(TypeError, match="contract must be a cadence_fx.Contract, got dict"):
        transform(flow, {"family": "token2wav"})


def test_streams_time_multiplexed_over_one_transformed_flow_equal_each_stream_alone():
    """Two streams interleaved chunk by chunk over one set of bindings (each with its own carries'
    contents, extents and RNG state, swapped in and out around its chunks) produce exactly what
    each produces alone."""
    flow, contract, prompt_tokens = reference_flow("reduced")
    hift = build_hift()
    prompt = random_prompt(0, n_tokens=prompt_tokens)
    transformed, _ = transform((flow, hift), contract, capture=False)
    tokens = [random_chunks(50 + i, 4) for i in range(2)]

    def alone(i):
        stream = CarryStream(transformed, prompt)
        stream.setup()
        transformed.swap_in(transformed.session_state(seed=i))
        return [stream.step(t) for t in tokens[i]]

    expected = [alone(0), alone(1)]
    streams = [CarryStream(transformed, prompt) for _ in range(2)]
    streams[0].setup()
    states = [transformed.session_state(seed=0)]
    streams[1].reset_turn()
    states.append(transformed.session_state(seed=1))
    assert states[0].nbytes == sum(c.buffer.numel() * c.buffer.element_size() for c in transformed.carries.values()) \
        + transformed.flow.decoder.cnn_cache_buffer.numel() * 4
    got = [[], []]
    for c in range(4):
        for i in (1, 0):
            transformed.swap_in(states[i])
            got[i].append(streams[i].step(tokens[i][c]))
            transformed.swap_out(states[i])
    for i in range(2):
        for a, b in zip(got[i], expected[i]):
            assert torch.equal(a.mel, b.mel) and torch.equal(a.speech, b.speech)
    assert not torch.equal(got[0][-1].speech, got[1][-1].speech)
