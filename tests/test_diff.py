"""The transform report page (cadence_fx.diff.render_html) on the Freeze-Omni encoder after a short
stream: self-contained, the derivation's regions and classes exactly, every rewritten node drawn,
marked and linked to its retention site."""

import pytest
import torch

from cadence_fx import transform
from cadence_fx.diff import render_html
from cadence_fx.models.freeze_omni import freeze_omni_contract
from cadence_fx.models.freeze_omni_encoder import FreezeOmniEncoderConfig, build_encoder, stream_utterance
from pagekit import Page

SMALL = FreezeOmniEncoderConfig.small()
CHUNKS = 3
UTTERANCES = 3  # the third is the first to reach the replay engine in both classes (two verified visits each before)
# Carries are named by their site's path in `infer`'s buffer list [kv_0, cnn_0, kv_1, cnn_1]:
# keys buffer.{2l}.0, values buffer.{2l}.1, conv context buffer.{2l+1}.
CARRIES = {f"carry_buffer_{2 * layer}_{part}" for layer in (0, 1) for part in (0, 1)} | {"carry_buffer_1", "carry_buffer_3"}
# The ids render_html gives the two drawings of a class's graph ('[', '=', ',' and ']' spelled out).
FIRST, STEADY = "encoder_chunk.5bn.3d4.2cL.3d0.5d", "encoder_chunk.5bn.3d4.2cL.3d4.5d"


def class_name(extent: int) -> str:
    return f"encoder_chunk[n=4,L={extent}]"


@pytest.fixture(scope="module")
def page():
    contract = freeze_omni_contract(blocks=SMALL.num_blocks, d_model=SMALL.attention_dim, heads=SMALL.attention_heads)
    transformed, report = transform(build_encoder(SMALL), contract)
    generator = torch.Generator().manual_seed(0)
    for _ in range(UTTERANCES):
        stream_utterance(transformed, torch.randn(1, CHUNKS * SMALL.chunk_frames, SMALL.input_dim, generator=generator))
    return Page(render_html(report, report.catalog, stream=f"{UTTERANCES} utterances of {CHUNKS} chunks")), report


def test_the_page_is_well_formed_and_requests_nothing(page):
    page, _ = page
    assert page.errors == []
    assert page.text.startswith("<!DOCTYPE html>")
    assert page.external() == []
    assert not {tag for tag, _ in page.elements} & {"script", "link", "img", "iframe"}
    assert "://" not in page.text


def test_the_page_lists_exactly_the_derived_regions_carries_and_classes(page):
    page, report = page
    assert page.values("data-region") == [r.name for r in report.catalog.regions] == ["attention_kv", "conv_left_context"]
    assert page.values("data-carry") == ["attention_kv", "conv_left_context"]
    assert page.values("data-operator") == ["encoder_chunk"]
    assert page.values("data-class") == ["encoder_chunk:4@0", "encoder_chunk:4@4"]
    # In the order the engine met them: the steady class in the second utterance, the first class in the third.
    assert page.values("data-replay-class") == [class_name(4), class_name(0)]
    assert page.values("data-graph") == [class_name(0), class_name(4)]


def test_the_page_has_one_row_per_retention_site(page):
    page, report = page
    assert page.values("data-site") == [f"{s.graph}:{s.node}" for s in report.sites]
    assert len(report.sites) == 12


def test_the_steady_graph_marks_what_the_window_pass_removed_added_and_rewired(page):
    page, _ = page
    before, after = f"svg-{STEADY}-before", f"svg-{STEADY}-after"
    retained = {f"slice_{i}" for i in range(3, 9)}
    assert page.marked(before, "removed") == {"cat", "cat_1", "cat_3", "cat_4"} | retained
    assert page.marked(before, "site") == retained
    rewired = {"transpose_8", "matmul_2", "transpose_20", "matmul_5", "output"}
    assert page.marked(before, "changed") == page.marked(after, "changed") == rewired
    assert page.marked(after, "added") == CARRIES | {
        "window_append", "window_append_1", "window_append_2", "window_append_3",
        "window_evict", "window_evict_1", "window_evict_2", "window_evict_3", "window_keep", "window_keep_1"}
    assert page.marked(after, "carry") == CARRIES
    assert page.marked(after, "site") == set()


def test_each_carry_and_its_writes_link_to_the_retention_site_they_implement(page):
    page, _ = page
    site = f"#site-{STEADY}-"
    assert page.links(f"svg-{STEADY}-after") == {
        "carry_buffer_0_0": site + "slice_3", "window_append": site + "slice_3", "window_evict": site + "slice_3",
        "carry_buffer_0_1": site + "slice_4", "window_append_1": site + "slice_4",
        "window_evict_1": site + "slice_4",
        "carry_buffer_1": site + "slice_5", "window_keep": site + "slice_5",
        "carry_buffer_2_0": site + "slice_6", "window_append_2": site + "slice_6",
        "window_evict_2": site + "slice_6",
        "carry_buffer_2_1": site + "slice_7", "window_append_3": site + "slice_7",
        "window_evict_3": site + "slice_7",
        "carry_buffer_3": site + "slice_8", "window_keep_1": site + "slice_8",
    }
    assert set(page.values("id")) >= {f"site-{STEADY}-slice_{i}" for i in range(3, 9)}


def test_the_first_graph_keeps_the_new_keys_whole_through_window_adopt(page):
    page, _ = page
    before, after = f"svg-{FIRST}-before", f"svg-{FIRST}-after"
    kept = {"transpose_2", "transpose_3", "transpose_14", "transpose_15"}
    assert page.marked(before, "removed") == {"slice_3", "slice_4"}
    assert page.marked(before, "site") == kept | {"slice_3", "slice_4"}
    assert page.marked(after, "added") == CARRIES | {
        "window_adopt", "window_adopt_1", "window_adopt_2", "window_adopt_3", "window_keep", "window_keep_1"}
    assert page.marked(after, "site") == kept
    site = f"#site-{FIRST}-"
    links = page.links(after)
    assert (links["transpose_2"], links["window_adopt"], links["carry_buffer_0_0"]) == (site + "transpose_2",) * 3
    assert (links["window_keep"], links["carry_buffer_1"]) == (site + "slice_3",) * 2


def test_each_class_shows_its_certificate_and_the_counters_of_the_stream(page):
    page, _ = page
    assert page.text.count('<dl class="certificate admitted">') == 2
    assert "admitted; no CUDA device: runs eager" in page.text
    assert "calls 5, captures 0, replays 0, eager 5 (by reason: no_cuda 5), invalidations 0" in page.text
    assert "Certificates and counters after a short stream: 3 utterances of 3 chunks." in page.text
    assert "No replayed operator has been called yet" not in page.text
