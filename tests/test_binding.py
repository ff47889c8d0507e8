"""`transform(model, contract, binding)` on a model cadence-fx has no code for: a transformers
Mistral decoder with a sliding-window DynamicCache (tests/byom_example.py, public API only)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from byom_example import TOKENS_PER_CALL, WINDOW, binding, build_model, contract, stream
from test_byom_probe import collector_paused

from cadence_fx import Binding, BindingError, OperatorBinding, RegionBinding, derive, transform

CALLS = 8  # 16 tokens: the 4-token window is refilled four times over


@pytest.fixture(scope="module")
def model_and_tokens():
    model, config = build_model()
    tokens = torch.randint(0, config.vocab_size, (1, CALLS * TOKENS_PER_CALL), generator=torch.Generator().manual_seed(1))
    return model, config, tokens


@pytest.fixture(scope="module")
def transformed(model_and_tokens):
    model, config, tokens = model_and_tokens
    return transform(model, contract(), binding())


def test_the_catalog_is_every_retained_extent_of_the_window():
    op = derive(contract()).operator("decoder_step")
    assert (op.width, op.grid) == (3, (0, 2, 4))
    assert derive(contract()).region("kv").shape == (2, 2, 1, 2, WINDOW - 1 + TOKENS_PER_CALL, 8)


def test_two_streams_equal_the_stock_model_bit_for_bit(model_and_tokens, transformed):
    model, config, tokens = model_and_tokens
    bound, report = transformed
    expected, _ = stream(model, config, tokens)
    with collector_paused():  # the first stream's cache is alive at the second's first call
        for _ in range(2):  # the second stream starts from a new DynamicCache, on the same carries
            actual, addresses = stream(bound, config, tokens)
            assert len(actual) == CALLS
            assert all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))
            # each site keeps one address for the whole stream, from its first call on
            assert len(set(addresses)) == 1
    # The first call's export takes another mask path than the stock call (refused, runs stock);
    # the steady class reads the cache's length (transformers derives its cache positions from
    # it), so each length is a program of its own: four are captured, then the stream runs the
    # stock code, counted by the value that differs.
    counters = report.operators["decoder_step"].counters.as_dict()
    # The second stream's first call copies the first stream's 4 sites out of the carries into its
    # cache (still alive: a cache holds cycles until the collector runs), so the carries are the
    # second stream's alone.
    assert counters == {
        "calls": 2 * CALLS,
        "graph_calls": 11,
        "verified": 10,
        "stock": 6,
        "adopted": 24,
        "evicted": 4,
        "stock_by_reason": {"verification": 1, "refused": 1, "guard:cache.layers.0.cumulative_length": 4},
    }
    classes = [cls.name for cls in report.operators["decoder_step"].classes.values()]
    assert classes == [
        "decoder_step[n=2,L=0]",
        "decoder_step[n=2,L=2]",
        "decoder_step[n=2,L=4]",
        "decoder_step[n=2,L=4]#2",
        "decoder_step[n=2,L=4]#3",
        "decoder_step[n=2,L=4]#4",
    ]
    refused = [cls.name for cls in report.operators["decoder_step"].classes.values() if cls.refused]
    assert refused == ["decoder_step[n=2,L=0]"]  # in both streams
    assert {s.kind for s in report.sites} == {"keep", "append"} and all(s.rewritten for s in report.sites)
    assert len(report.sites) == 6 * 4  # every class, every layer's keys and values


def test_a_call_outside_the_catalog_runs_the_stock_model_and_says_why(model_and_tokens):
    model, config, tokens = model_and_tokens
    bound, report = transform(model, contract(), binding())
    from transformers import DynamicCache

    stock_cache, cache = DynamicCache(config=config), DynamicCache(config=config)
    with torch.no_grad():
        three = dict(input_ids=tokens[:, :3], position_ids=torch.arange(3)[None], use_cache=True)
        expected = model(**three, cache=stock_cache).logits
        actual = bound(**three, cache=cache).logits
    assert torch.equal(actual, expected)
    assert report.operators["decoder_step"].counters.stock_by_reason == {"not_in_catalog": 1}


def test_a_graph_that_bakes_a_host_value_is_never_replayed_at_another_value_in_any_order_of_arrival(model_and_tokens):
    """Without position_ids the model computes its positions from the cache's length, a host int
    that a graph would freeze. Each length is guarded: two short streams first, then a long one,
    and no call ever runs a graph captured at another length; past four lengths, the stock code."""
    model, config, tokens = model_and_tokens
    bound, report = transform(model, contract(), binding())
    for length in (3 * TOKENS_PER_CALL, 3 * TOKENS_PER_CALL, CALLS * TOKENS_PER_CALL):
        expected, _ = stream(model, config, tokens[:, :length], positions=False)
        actual, _ = stream(bound, config, tokens[:, :length], positions=False)
        assert all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))
    op = report.operators["decoder_step"]
    lengths = [cls.hosts["cache.layers.0.cumulative_length"] for cls in op.classes.values() if cls.call.extent == 4]
    assert lengths == [4, 6, 8, 10]
    assert op.counters.stock_by_reason == {"verification": 1, "refused": 2, "guard:cache.layers.0.cumulative_length": 2}


def test_a_binding_that_does_not_fit_is_refused_naming_the_field(model_and_tokens):
    model, _, _ = model_and_tokens
    with pytest.raises(BindingError, match=r"binding.regions\[0\].region: the contract declares no region 'cache'"):
        transform(
            model, contract(), Binding(regions=(RegionBinding("cache", ("cache.layers.*.keys",)),), operators=binding().operators)
        )
    with pytest.raises(BindingError, match=r"binding.operators\[0\].method: MistralForCausalLM has no 'step'"):
        transform(model, contract(), dataclasses.replace(binding(), operators=(OperatorBinding("decoder_step", "step"),)))
    with pytest.raises(
        BindingError,
        match=r"binding.regions\[0\].at: 'past.layers.\*.keys' starts at 'past', which is "
        r"not an argument of forward",
    ):
        transform(model, contract(), dataclasses.replace(binding(), regions=(RegionBinding("kv", ("past.layers.*.keys",)),)))
    with pytest.raises(BindingError, match=r"binding.operators\[0\].operator: the contract declares no operator 'decode'"):
        transform(model, contract(), dataclasses.replace(binding(), operators=(OperatorBinding("decode"),)))
    with pytest.raises(
        BindingError,
        match=r"binding.regions\[0\].per_call: region 'kv' retains by SlidingWindow: only "
        r"a region retained by InPlace or RingCache \(a fixed extent\) can be allocated afresh each call",
    ):
        transform(model, contract(), dataclasses.replace(binding(), regions=(RegionBinding("kv", per_call=True),)))


def test_a_budget_refusal_names_the_flag_that_lifts_it(model_and_tokens):
    model, _, _ = model_and_tokens
    with pytest.raises(
        ValueError,
        match=r"K = 3 exceeds the budget of 2 classes; raise the budget \(transform\(\.\.\., "
        r"budget=N\), `--budget N` on the CLI\)",
    ):
        transform(model, contract(), binding(), budget=2)


def test_audit_compares_every_retention_with_the_stock_concat(model_and_tokens):
    model, config, tokens = model_and_tokens
    bound, report = transform(model, contract(), binding(), audit=True)
    expected, _ = stream(model, config, tokens)
    actual, _ = stream(bound, config, tokens)
    assert all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))
    audit = report.auditor.counters()
    # 4 sites, every call that ran a graph: all but the last two (past the four lengths of the
    # steady class that are captured); the first call's graph ran once, beside the stock call
    # that refused it
    assert (audit["mismatches"], audit["retentions"]) == (0, 4 * (CALLS - 2))


def test_every_class_graph_shares_the_model_weights_instead_of_copying_them(model_and_tokens, transformed):
    model, _, _ = model_and_tokens
    _, report = transformed
    weights = {p.data_ptr() for p in model.parameters()}
    for name, (_, after) in report.graphs.items():
        assert {p.data_ptr() for p in after.parameters()} == weights, name
        constants = [t for t in vars(after).values() if isinstance(t, torch.Tensor)]
        assert sum(t.numel() for t in constants) == 0, name


def test_two_interleaved_streams_share_the_graphs_through_their_session_states(model_and_tokens):
    model, config, tokens = model_and_tokens
    from transformers import DynamicCache

    other = torch.randint(0, config.vocab_size, tokens.shape, generator=torch.Generator().manual_seed(2))
    bound, report = transform(model, contract(), binding())
    expected = {0: stream(model, config, tokens)[0], 1: stream(model, config, other)[0]}
    caches = {0: DynamicCache(config=config), 1: DynamicCache(config=config)}
    states, actual = {}, {0: [], 1: []}
    with torch.no_grad():
        for t in range(0, tokens.shape[1], TOKENS_PER_CALL):
            for i, source in ((0, tokens), (1, other)):
                if i in states:
                    bound.swap_in(states[i])
                else:
                    bound.reset()
                out = bound(
                    input_ids=source[:, t : t + TOKENS_PER_CALL],
                    position_ids=torch.arange(t, t + TOKENS_PER_CALL)[None],
                    cache=caches[i],
                    use_cache=True,
                )
                actual[i].append(out.logits)
                states.setdefault(i, bound.session_state(seed=i))
                bound.swap_out(states[i])
    for i in (0, 1):
        assert all(torch.equal(a, e) for a, e in zip(actual[i], expected[i], strict=True))
    # the first call (another program) and, for each stream, the two lengths past the four captured
    assert report.operators["decoder_step"].counters.stock_by_reason == {
        "verification": 1,
        "refused": 1,
        "guard:cache.layers.0.cumulative_length": 4,
    }


def test_session_states_wait_for_the_first_call(model_and_tokens):
    model, _, _ = model_and_tokens
    bound, _ = transform(model, contract(), binding())
    with pytest.raises(RuntimeError, match="call the model once before taking or swapping session states"):
        bound.session_state(seed=0)


def test_the_report_page_shows_a_bound_model_s_classes_and_sites(model_and_tokens):
    from cadence_fx.diff_page import render_html

    model, config, tokens = model_and_tokens
    bound, report = transform(model, contract(), binding())
    stream(bound, config, tokens[:, :6])  # three calls: one of each class
    page = render_html(report, derive(contract()))
    for name in ("decoder_step[n=2,L=0]", "decoder_step[n=2,L=2]", "decoder_step[n=2,L=4]", "cache.layers.1.values"):
        assert name in page
    assert "http://" not in page and "https://" not in page


def test_places_write_every_element_of_nested_tuples():
    """A legacy cache of tuples: each write replaces the tuples above it. Places found before any
    write (as a call finds its sites' places) still write every element, none undone by another."""
    from cadence_fx.binding import Places

    old = [torch.zeros(1) + i for i in range(4)]
    new = [torch.ones(1) * (10 + i) for i in range(4)]
    roots = {"past_key_values": ((old[0], old[1]), (old[2], old[3]))}
    paths = ["past_key_values.0.0", "past_key_values.0.1", "past_key_values.1.0", "past_key_values.1.1"]
    places = Places(paths).at(roots)
    for place, value in zip(places, new):
        place.set(value)
    assert roots["past_key_values"] == ((new[0], new[1]), (new[2], new[3]))
    assert [place.get() for place in places] == new


def test_places_are_found_afresh_on_each_calls_roots():
    """Places share their paths' common prefixes, walked once a call; an object replaced on a path
    between two calls (a new cache object, a new layer list) is the one the next call's places hold."""
    from types import SimpleNamespace

    from cadence_fx.binding import Places, get_path

    def state(base):
        layers = [SimpleNamespace(k=torch.zeros(1) + base + i, v=torch.zeros(1) - base - i) for i in range(3)]
        return SimpleNamespace(cache=SimpleNamespace(layers=layers, length=base))

    paths = ["self.cache.layers.0.k", "self.cache.layers.0.v", "self.cache.layers.2.k", "self.cache.length", "self"]
    places = Places(paths)
    roots = {"self": state(0)}
    assert [p.get() for p in places.at(roots)] == [get_path(roots, path) for path in paths]
    roots["self"].cache = state(5).cache  # replaced between calls
    found = places.at(roots)
    assert [p.get() for p in found] == [get_path(roots, path) for path in paths]
    assert found[2].get() is roots["self"].cache.layers[2].k and found[3].get() == 5
    found[1].set(torch.ones(1))
    assert torch.equal(roots["self"].cache.layers[0].v, torch.ones(1))
