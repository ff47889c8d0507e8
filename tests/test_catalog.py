"""Catalog derivation: the reference numbers of the families' configurations, derived, and its invariants."""

import math

import pytest
import sympy
from hypothesis import given, settings
from hypothesis import strategies as st

from cadence_fx import (
    Admission,
    CatalogClass,
    Clock,
    ClockKind,
    Contract,
    Interactivity,
    Lifetime,
    Operator,
    PromptPlusHistory,
    Rate,
    Region,
    RingCache,
    SlidingWindow,
    derive,
)
from cadence_fx.catalog import T
from cadence_fx.contract import DTYPES
from cadence_fx.models.freeze_omni import freeze_omni_contract
from cadence_fx.models.llm_backbone import llm_backbone_contract
from cadence_fx.models.moshi import moshi_contract
from cadence_fx.models.token2wav import token2wav_contract


def test_token2wav_decoder_attends_three_extents():
    op = derive(token2wav_contract()).operator("dit_estimator")
    assert op.grid == (302, 352, 402)
    assert op.width == 3
    assert op.in_scope


def test_token2wav_final_flush_is_one_extra_class_within_the_stride_bound():
    catalog = derive(token2wav_contract())
    op = catalog.operator("cfm_loop")
    assert op.flush_classes == (CatalogClass(56, 402, flush=True),)
    assert len(op.flush_classes) <= catalog.region("estimator_att_cache").stride
    assert op.classes == (
        CatalogClass(50, 302),
        CatalogClass(50, 352),
        CatalogClass(50, 402),
        CatalogClass(56, 402, flush=True),
    )


def test_token2wav_declared_early_flush_adds_one_class_per_extent():
    from dataclasses import replace

    base = token2wav_contract()
    contract = replace(base, operators=(replace(base.operators[0], early_flush=True),))
    op = derive(contract).operator("cfm_loop")
    assert [(c.call, c.extent) for c in op.flush_classes] == [(56, 302), (56, 352), (56, 402)]


def test_token2wav_envelope_collapses_to_demand():
    region = derive(token2wav_contract()).region("estimator_att_cache")
    assert region.stock_shape == (16, 16, 2, 8, 1000, 128)
    assert region.shape == (10, 16, 2, 8, 458, 128)
    assert region.stock_bytes == 2_097_152_000  # the 1.95 GiB envelope
    assert region.bytes == 600_309_760
    assert region.rho == sympy.Rational(16 * 1000, 10 * 458)
    assert (region.lower, region.bound, region.window) == (302, 458, 100)


def test_token2wav_hift_sees_its_vendor_mel_lengths():
    op = derive(token2wav_contract()).operator("hift")
    assert [c.call + c.extent for c in op.classes] == [50, 58, 64]


def test_token2wav_operating_point_is_a_parameter_not_a_result():
    op = derive(token2wav_contract(f_prompt=200, f_retained=150)).operator("dit_estimator")
    assert op.grid == (200, 250, 300, 350)
    assert op.width == 4


def test_moshi_ring_caches_have_width_one():
    catalog = derive(moshi_contract())
    assert {op.name: op.width for op in catalog.operators} == {
        "mimi_encode": 1,
        "lm_step": 1,
        "depformer_step": 1,
        "mimi_decode": 1,
    }
    assert catalog.operator("lm_step").grid == (3000,)
    assert catalog.region("lm_kv").bound == 3000


def test_freeze_omni_chunk_policy_has_width_two():
    catalog = derive(freeze_omni_contract())
    op = catalog.operator("encoder_chunk")
    assert op.width == 2
    assert [c.call + c.extent for c in op.classes] == [4, 8]  # one chunk, then two
    assert catalog.region("conv_left_context").bound == 2


def test_llm_backbone_is_outside_lossless_scope():
    op = derive(llm_backbone_contract()).operator("decode_step")
    assert op.width == 2001
    assert not op.in_scope
    assert op.classes == ()
    assert "outside lossless scope" in op.verdict


def test_the_budget_is_configurable():
    assert derive(llm_backbone_contract(), budget=2001).operator("decode_step").in_scope
    assert not derive(token2wav_contract(), budget=2).operator("dit_estimator").in_scope


def test_a_non_positive_budget_is_rejected():
    with pytest.raises(ValueError, match="budget"):
        derive(token2wav_contract(), budget=0)


def test_derivation_is_pure():
    assert derive(token2wav_contract()) == derive(token2wav_contract())


retentions = st.one_of(
    st.builds(SlidingWindow, window=st.integers(1, 400), initial=st.just(0)),
    st.builds(RingCache, capacity=st.integers(1, 400)),
    st.builds(PromptPlusHistory, prompt=st.integers(0, 400), history=st.integers(1, 400)),
)


@st.composite
def contracts(draw):
    retention = draw(retentions)
    bound = {SlidingWindow: "window", RingCache: "capacity", PromptPlusHistory: "history"}[type(retention)]
    stride = draw(st.integers(1, getattr(retention, bound)))
    flush = draw(st.lists(st.integers(1, 3 * stride), max_size=min(3, stride), unique=True))
    width = draw(st.integers(1, 64))
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    return Contract(
        family="random",
        clocks=(Clock("frame", ClockKind.FRAMES), Clock("call", ClockKind.CALLS)),
        rates=(Rate("frame", "call", stride),),
        quantities={"width": width},
        regions=(
            Region(
                "cache",
                ("width", "frame"),
                axis=1,
                clock="frame",
                stride=stride,
                dtype=dtype,
                lifetime=Lifetime.PER_STREAM,
                retention=retention,
            ),
        ),
        operators=(Operator("op", "cache", steady=stride, flush=tuple(flush)),),
        admission=Admission("frame", max_per_call=max([stride, *flush])),
        interactivity=Interactivity(stages=("op",)),
    )


@settings(max_examples=200, deadline=None)
@given(contracts())
def test_extents_never_exceed_their_bound(contract):
    region = derive(contract).region("cache")
    assert region.bound is not None
    for t in range(0, 2 * (region.window // region.stride) + 4):
        assert region.retained.subs(T, t) <= region.bound - (region.live - region.retained)
        assert region.live.subs(T, t) <= region.bound
    assert region.live.subs(T, 10**9) == region.bound


@settings(max_examples=200, deadline=None)
@given(contracts())
def test_width_is_finite_and_matches_the_grid(contract):
    catalog = derive(contract, budget=10**6)
    region, op = catalog.region("cache"), catalog.operator("op")
    assert op.width == math.ceil(region.window / region.stride) + 1
    assert len(op.grid) == op.width
    assert op.grid[0] == region.lower and op.grid[-1] == region.lower + region.window


@settings(max_examples=200, deadline=None)
@given(contracts())
def test_bytes_are_itemsize_times_the_extents(contract):
    region = derive(contract).region("cache")
    beta = DTYPES[contract.regions[0].dtype].itemsize
    assert region.shape == (contract.quantities["width"], region.bound)
    assert region.bytes == beta * math.prod(region.shape)
