"""The state rule and the carry on the real MiniCPM-o Token2Wav flow (reduced depth, CPU)."""

from dataclasses import dataclass, field

import pytest
import torch
from pagekit import Page

from cadence_fx import AuditMismatch, transform
from cadence_fx.diff import diff_graphs, render_text
from cadence_fx.diff_page import render_html
from cadence_fx.models.token2wav import token2wav_contract
from cadence_fx.models.token2wav_carry import ENVELOPES, WARM_UP_CHUNKS, WARM_UP_TURNS, CarryStream, reference_flow
from cadence_fx.models.token2wav_stream import StockStream, build_hift, random_chunks, random_prompt

pytestmark = pytest.mark.slow

BLOCKS, CHUNKS = 3, 4


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
def carried(reference):
    """The audited transform the module's streams run on (a transform takes half a minute on a CPU)."""
    flow, contract, _ = reference
    return transform(flow, contract, audit=True)


@pytest.fixture(scope="module")
def streamed(reference, carried):
    flow, contract, prompt = reference
    transformed, report = carried
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
            run.cache_equal.append({k: torch.equal(live(stock.stream_cache[k], v), v) for k, v in carried.stream_cache.items()})
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
    # Every chunk retains three sites (the two attention caches, the CFM's conv cache), the warm-up
    # turns at construction included; the attention caches evict from each turn's third chunk on
    # (102 + 50, 102 + 100 <= 202), the conv cache never (its 2 frames are kept whole).
    chunks = BLOCKS * CHUNKS + WARM_UP_TURNS * WARM_UP_CHUNKS
    evicting = BLOCKS * (CHUNKS - 2) + WARM_UP_TURNS * (WARM_UP_CHUNKS - 2)
    assert report.auditor.counters() == {
        "retentions": 3 * chunks,
        "applications": 2 * evicting,
        "mismatches": 0,
        "distinct_carry_addresses": {
            "estimator_att_cache:att_cache": 1,
            "estimator_cnn_cache:cnn_cache": 1,
            "conformer_att_cache:att_cache": 1,
        },
    }


def test_the_auditor_catches_a_carry_that_keeps_the_wrong_units(reference, monkeypatch):
    """A carry that keeps the newest 102 frames and the first 100 (the prompt-plus-history policy
    read the wrong way round) instead of the vendor's [:P] + [-100:]: caught at chunk 3, the first
    chunk that evicts."""
    flow, contract, prompt = reference
    transformed, report = transform(flow, contract, audit=True)
    carry = transformed.bound.operators["cfm_loop"].carries["att_cache"]
    keep = carry.keep
    monkeypatch.setattr(
        carry, "keep", lambda full, segments: keep(full, ((0, 100), (-102, None)) if len(segments) == 2 else segments)
    )
    stream = CarryStream(transformed, prompt)
    stream.setup()
    chunks = random_chunks(7, 3)
    stream.flow_chunk(chunks[0])
    stream.flow_chunk(chunks[1])
    with pytest.raises(AuditMismatch) as caught:
        stream.flow_chunk(chunks[2])
    assert (caught.value.site, caught.value.chunk) == ("estimator_att_cache:att_cache", 3)
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
    # The conformer's cache has no envelope: the stock code pins its 202 + 50 frames between calls.
    stock["conformer_att_cache"] = 2 * 1 * 8 * 252 * 128 * 4
    carried = {r.region: r.demand_bytes for r in report.resizes}
    # 10 solver steps, 2 DiT blocks, 102 prompt + 100 retained + 56 frames of the final chunk.
    assert carried == {
        "estimator_att_cache": 10 * 2 * 2 * 8 * 258 * 128 * 4,
        "estimator_cnn_cache": 10 * 2 * 2 * 1024 * 2 * 4,
        "dit_block_att_cache": 2 * 2 * 8 * 258 * 128 * 4,
        "dit_block_cnn_cache": 2 * 2 * 1024 * 2 * 4,
        "conformer_att_cache": 2 * 1 * 8 * 202 * 128 * 4,
    }
    assert report.managed_bytes() == {region: (stock[region], carried[region]) for region in stock}


def test_the_input_model_is_left_untouched(reference, streamed):
    flow, _, _ = reference
    assert flow.decoder.att_cache_buffer.shape == (16, 16, 2, 8, 1000, 128)
    assert "forward_chunk" not in vars(flow.decoder) and "forward_chunk" not in vars(flow.encoder)


CLASSES = [
    f"{op}[n={n},L={extent}]{flush}"
    for op in ("cfm_loop", "conformer_encoder")
    for n, extent, flush in ((50, 102, ""), (50, 152, ""), (50, 202, ""), (56, 202, "(flush)"))
]


def test_report_names_every_rewritten_site_of_every_class(streamed):
    _, report = streamed
    assert sorted({s.graph for s in report.sites}) == sorted(CLASSES)
    assert sorted((s.graph, s.region, s.kind, s.rewritten) for s in report.sites) == sorted(
        [(name, "estimator_att_cache", "keep", True) for name in CLASSES[:4]]
        + [(name, "estimator_cnn_cache", "keep", True) for name in CLASSES[:4]]
        + [(name, "conformer_att_cache", "keep", True) for name in CLASSES[4:]]
    )


def test_the_diff_report_shows_every_rewritten_site(streamed):
    _, report = streamed
    diffs = {name: diff_graphs(name, before, after) for name, (before, after) in report.graphs.items()}
    assert sorted(diffs) == sorted(CLASSES)
    for name in CLASSES:
        # The caller's trim is in the step's graph once a turn evicts (L=202): it becomes the carry write.
        evicts = "L=202" in name
        assert dict(diffs[name].removed) == ({"cat": 1, "slice": 2} if evicts else {})
        assert dict(diffs[name].added) == (
            {"attr carry_att_cache": 1, "attr carry_cnn_cache": 1, "window_keep": 2}
            if name.startswith("cfm_loop")
            else {"attr carry_att_cache": 1, "window_keep": 1}
        )
    text = render_text(list(diffs.values()))
    assert "+window_keep = window_keep(carry_att_cache, state_0, cat_10, 202, 102)" in text


def test_the_report_page_draws_each_trim_rewrite_and_links_its_carry_to_the_site(streamed):
    _, report = streamed
    page = Page(render_html(report, report.catalog, stream="the streams of this module"))
    assert page.errors == [] and page.external() == [] and "://" not in page.text
    name = "conformer_encoder.5bn.3d50.2cL.3d202.5d"  # conformer_encoder[n=50,L=202], as an HTML id
    before, after = f"svg-{name}-before", f"svg-{name}-after"
    assert page.marked(before, "removed") == {"slice_17", "slice_18", "cat_12"}
    assert page.marked(before, "site") == {"cat_12"}
    assert page.marked(after, "added") == {"carry_att_cache", "window_keep"}
    assert page.marked(after, "carry") == {"carry_att_cache"}
    assert page.marked(before, "changed") == page.marked(after, "changed") == {"output"}
    assert page.links(after) == {"carry_att_cache": f"#site-{name}-cat_12", "window_keep": f"#site-{name}-cat_12"}


def test_the_report_page_lists_exactly_the_derivation_and_certifies_every_streamed_class(streamed):
    _, report = streamed
    catalog = report.catalog
    page = Page(render_html(report, catalog))
    assert page.values("data-region") == [r.name for r in catalog.regions]
    assert page.values("data-carry") == ["conformer_att_cache", "estimator_att_cache", "estimator_cnn_cache"]
    assert page.values("data-operator") == ["cfm_loop", "dit_estimator", "conformer_encoder", "hift"]
    assert page.values("data-class") == [
        f"{op}:{call}@{extent}{flush}"
        for op in ("cfm_loop", "dit_estimator", "conformer_encoder")
        for call, extent, flush in ((50, 102, ""), (50, 152, ""), (50, 202, ""), (56, 202, ":flush"))
    ] + ["hift:50@0", "hift:50@8", "hift:56@8:flush"]
    # Under the auditor the classes run their rewritten graphs eagerly: no replay engine, no certificate.
    assert page.values("data-replay-class") == []
    assert page.text.count("No replay engine for this operator in this transform.") == 4
    assert f"{report.auditor.retentions} retentions checked" in page.text and "<b>0 mismatches</b>" in page.text


def test_a_contract_for_another_depth_is_refused(reference):
    flow, _, _ = reference
    with pytest.raises(ValueError, match="contract quantity depth=16 but the flow has 2"):
        transform(flow, token2wav_contract(f_prompt=102))


def test_a_prompt_the_contract_does_not_declare_is_refused(carried):
    transformed, _ = carried
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
    transformed, _ = transform((flow, hift), contract)
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
    assert states[0].nbytes == sum(c.buffer.numel() * c.buffer.element_size() for c in transformed.carries.values())
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
