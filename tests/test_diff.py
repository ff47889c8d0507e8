"""The transform report page (cadence_fx.diff_page.render_html) on the Freeze-Omni encoder after a short
stream: self-contained, the derivation's regions and classes exactly, every rewritten node drawn,
marked and linked to its retention site; what the transform saves (host launches per class, bytes
per region); and the same page for a user's own model and binding (tests/byom_example.py)."""

from types import SimpleNamespace

import pytest
import torch
from byom_example import TOKENS_PER_CALL, diff_example
from pagekit import Page

from cadence_fx import transform
from cadence_fx.diff import Launches, eager_dispatches, launches, render_savings
from cadence_fx.diff_page import render_html
from cadence_fx.models.freeze_omni import freeze_omni_contract
from cadence_fx.models.freeze_omni_encoder import FreezeOmniEncoderConfig, build_encoder, stream_utterance
from cadence_fx.replay import Certificate, CutRecord, Signature
from cadence_fx.transform import TransformReport

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
        "window_append",
        "window_append_1",
        "window_append_2",
        "window_append_3",
        "window_evict",
        "window_evict_1",
        "window_evict_2",
        "window_evict_3",
        "window_keep",
        "window_keep_1",
    }
    assert page.marked(after, "carry") == CARRIES
    assert page.marked(after, "site") == set()


def test_each_carry_and_its_writes_link_to_the_retention_site_they_implement(page):
    page, _ = page
    site = f"#site-{STEADY}-"
    assert page.links(f"svg-{STEADY}-after") == {
        "carry_buffer_0_0": site + "slice_3",
        "window_append": site + "slice_3",
        "window_evict": site + "slice_3",
        "carry_buffer_0_1": site + "slice_4",
        "window_append_1": site + "slice_4",
        "window_evict_1": site + "slice_4",
        "carry_buffer_1": site + "slice_5",
        "window_keep": site + "slice_5",
        "carry_buffer_2_0": site + "slice_6",
        "window_append_2": site + "slice_6",
        "window_evict_2": site + "slice_6",
        "carry_buffer_2_1": site + "slice_7",
        "window_append_3": site + "slice_7",
        "window_evict_3": site + "slice_7",
        "carry_buffer_3": site + "slice_8",
        "window_keep_1": site + "slice_8",
    }
    assert set(page.values("id")) >= {f"site-{STEADY}-slice_{i}" for i in range(3, 9)}


def test_the_first_graph_keeps_the_new_keys_whole_through_window_adopt(page):
    page, _ = page
    before, after = f"svg-{FIRST}-before", f"svg-{FIRST}-after"
    kept = {"transpose_2", "transpose_3", "transpose_14", "transpose_15"}
    assert page.marked(before, "removed") == {"slice_3", "slice_4"}
    assert page.marked(before, "site") == kept | {"slice_3", "slice_4"}
    assert page.marked(after, "added") == CARRIES | {
        "window_adopt",
        "window_adopt_1",
        "window_adopt_2",
        "window_adopt_3",
        "window_keep",
        "window_keep_1",
    }
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


def test_each_class_shows_the_operators_an_eager_call_dispatches_and_that_without_cuda_none_are_saved(page):
    page, report = page
    steady, first = report.graphs[class_name(4)][1], report.graphs[class_name(0)][1]
    assert (eager_dispatches(first), eager_dispatches(steady)) == (120, 124)
    # no CUDA: each class was certified and ran eagerly, so it launches no graph and saves nothing
    # in the order the engine met them (the steady class first: see data-replay-class)
    assert page.values("data-launches") == [f"{class_name(4)}:124:-:-", f"{class_name(0)}:120:-:-"]
    assert page.text.count("admitted; no CUDA device: runs eager") == 2 + 2  # certificate and launch table


def test_each_region_shows_the_stock_state_against_its_carry(page):
    page, report = page
    # the stock retention pins each call's whole concat; the carry holds the window at its bound
    assert page.values("data-memory") == ["attention_kv:8192:8192:0", "conv_left_context:3072:1024:2048"]
    assert [r.stock_bytes for r in report.resizes] == [8192, 3072]
    assert {name: c.buffer.numel() * c.buffer.element_size() for name, c in report.carries.items()} == {
        "attention_kv": 8192,
        "conv_left_context": 1024,
    }
    assert "is in its certificate, on a GPU" in page.text


def _traced(fn) -> torch.fx.GraphModule:
    return torch.fx.symbolic_trace(fn)


def test_eager_dispatches_count_call_nodes_but_no_tuple_index():
    def step(x):
        a, b = x.split(2)  # one split and two getitems
        return torch.relu(a) + b

    graph = _traced(step)
    assert [n.op for n in graph.graph.nodes].count("call_function") == 4
    assert eager_dispatches(graph) == 3  # split, relu, add


def test_a_captured_class_launches_its_segments_cuts_and_copies_instead_of_every_operator():
    def step(x, y):
        return (x * 2 + y).relu().sum(0) - y.mean()

    graph = _traced(step)
    certificate = Certificate(
        "step[L=0]",
        Signature.of(torch.ones(2), torch.ones(2)),
        admitted=True,
        reason="admitted; captured",
        captured=True,
        segments=2,
        cuts=(CutRecord("nonzero", "data-dependent shape", 1),),
        copied=("x", "y"),
        written_back=("y",),
    )
    report = TransformReport(
        "toy",
        catalog=None,
        graphs={"step[L=0]": (graph, graph)},
        replays={"step": SimpleNamespace(certificates={"step[L=0]": certificate})},
    )
    (counted,) = launches(report)
    assert counted == Launches(
        "step[L=0]", eager=6, status="admitted; captured", captured=True, graphs=2, cuts=1, staged=2, written_back=1
    )
    assert (counted.replay, counted.saved) == (6, 0)  # 2 graphs + 1 cut + 2 staged + 1 written back


# ---------------------------------------------------------------------------------------------
# A user's own model and binding: tests/byom_example.py's Mistral decoder with a sliding window

CALLS = 4
# The catalog's three classes; the steady one's second call is another program (the cache's length,
# which transformers derives positions from, is guarded): its graph is its own.
BOUND = [f"decoder_step[n={TOKENS_PER_CALL},L={extent}]" for extent in (0, 2, 4)] + [f"decoder_step[n={TOKENS_PER_CALL},L=4]#2"]


@pytest.fixture(scope="module")
def own():
    model, contract, binding, run = diff_example("cpu")
    transformed, report = transform(model, contract, binding)
    streamed = run(transformed, CALLS)
    return Page(render_html(report, report.catalog, title="own model", stream=streamed, device="cpu")), report


def test_the_page_of_a_bound_model_is_well_formed_and_says_where_it_ran(own):
    page, _ = own
    assert page.errors == [] and page.external() == []
    assert page.values("data-device") == ["cpu"]
    assert "Certificates and counters after a short stream: 4 calls of 2 random tokens into one DynamicCache." in page.text


def test_the_page_of_a_bound_model_lists_its_region_classes_graphs_and_sites(own):
    page, report = own
    assert page.values("data-region") == page.values("data-carry") == ["kv"]
    assert page.values("data-operator") == ["decoder_step"]
    assert page.values("data-class") == ["decoder_step:2@0", "decoder_step:2@2", "decoder_step:2@4"]
    assert page.values("data-graph") == BOUND
    # each class's graph keeps (first call) or appends to (later calls) every layer's keys and values
    assert page.values("data-site") == [f"{graph}:slice_{i}" for graph in BOUND for i in (5, 6, 11, 12)]
    assert [s.kind for s in report.sites] == ["keep"] * 4 + ["append"] * 12


def test_the_page_of_a_bound_model_shows_its_counters_launches_and_memory(own):
    page, _ = own
    assert page.values("data-bound") == ["decoder_step"]
    # The first call's export builds the mask another way than the stock call: refused, its stock
    # result kept (its state then adopted into the carries).
    assert (
        "bound operator: calls 4, rewritten-graph calls 4, verified against the stock call 3, stock calls 1 "
        "(by reason: verification 1), states adopted into a carry 4"
    ) in page.text
    # 4 calls, each the first of its class: all still verifying, none in the engine yet
    assert page.values("data-launches") == [f"{BOUND[0]}:207:-:-"] + [f"{graph}:191:-:-" for graph in BOUND[1:]]
    assert page.text.count("being verified against the stock call: replays after 1 more visit(s)") == 3
    assert page.text.count("verified; not called since") == 0
    # The stock state the transform replaced: each layer's retained slice pins its call's whole
    # concat (4 + 2 tokens), as large as the carry: 2 layers x keys and values x 2 heads x 6 x 8 fp32.
    assert page.values("data-memory") == ["kv:1536:1536:0"]


def test_the_terminal_shows_the_same_figures(own):
    _, report = own
    text = render_savings(report, report.catalog)
    assert f"{BOUND[3]}  191    -       -      being verified against the stock call: replays after 1 more visit(s)" in text
    assert f"{BOUND[0]}    207    -       -      refused: verification: program: the exported step is not the program" in text
    assert "kv      1.50 KiB  the stock state the transform replaced  1.50 KiB  0 B" in text


def test_a_captured_classs_certificate_shows_the_device_memory_its_capture_took():
    from cadence_fx.diff_page import _certificate

    certificate = Certificate(
        "step[L=0]",
        Signature.of(torch.ones(2)),
        admitted=True,
        reason="admitted; captured",
        captured=True,
        segments=1,
        staged_bytes=2048,
        pool_reserved_bytes=2 * 2**20,
        reserved_bytes=3 * 2**20,
    )
    page = Page(f"<!DOCTYPE html><html><body>{_certificate(certificate)}</body></html>")
    assert page.errors == []
    assert (
        "staged inputs 2.00 KiB (the memory model&#x27;s charge); graph pool grew 2.00 MiB; reserved grew 3.00 MiB "
        "over the whole capture phase"
    ) in page.text
