"""The carry pass on hand-made graphs: a prompt-head plus recent-tail trim becomes one in-place
`carry_keep` that keeps exactly the stock trim's units at one address; operand concats are found
with their ordering and left in place."""

from __future__ import annotations

import pytest
import torch

from cadence_fx.passes.carry import (
    Carry,
    CarryError,
    RetentionSite,
    carry_keep,
    find_retention_sites,
    rewrite_trims,
    stock_trim,
    trace_trim,
)

AXIS, HEAD, TAIL = 1, 3, 2  # keep the first 3 units (the prompt) and the last 2 along axis 1


def units(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(2, n, 4, generator=torch.Generator().manual_seed(seed))


def carry(capacity: int = 9) -> Carry:
    return Carry("r", torch.zeros(2, capacity, 4), axis=AXIS)


def targets(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def rewritten(c: Carry):
    return rewrite_trims(trace_trim(AXIS, HEAD, TAIL), {"cache": "r"}, {"r": c}, graph="trim")


def test_a_trim_becomes_one_carry_keep_and_its_concat_and_slices_are_gone():
    after, (site,), stamp = rewritten(carry())
    assert targets(after) == [carry_keep]
    assert site == RetentionSite("trim", "cat", "r", AXIS, "trim", True,
                                 "rewritten: in-place writes of ((0, 3), (-2, None)) into the carry")
    assert stamp.startswith("carry pass on trim: 1 of 1 sites rewritten, took ")


def test_a_trim_of_the_carrys_own_view_is_compacted_in_place_to_the_stock_units():
    c = carry()
    after, _, _ = rewritten(c)
    full = units(9, 1)
    c.adopt(full)  # the stock code wrote 9 units into the carry itself
    kept = after(c.view())
    assert torch.equal(kept, stock_trim(full, AXIS, HEAD, TAIL))
    assert (kept.data_ptr(), c.extent, tuple(kept.shape)) == (c.address, HEAD + TAIL, (2, 5, 4))


def test_a_trim_of_a_tensor_outside_the_carry_is_copied_in():
    c = carry()
    after, _, _ = rewritten(c)
    full = units(7, 2)
    kept = after(full)
    assert torch.equal(kept, stock_trim(full, AXIS, HEAD, TAIL)) and kept.data_ptr() == c.address


def test_a_stream_of_prepend_then_trim_keeps_one_address_and_the_stock_state():
    c = carry(capacity=HEAD + TAIL + 2)
    after, _, _ = rewritten(c)
    stock = kept = units(HEAD + TAIL, 3)
    c.adopt(kept)
    for call in range(5):
        new = units(2, 10 + call)
        stock = stock_trim(torch.cat([new, stock], dim=AXIS), AXIS, HEAD, TAIL)
        kept = after(torch.cat([new, c.view()], dim=AXIS))
        assert torch.equal(kept, stock) and kept.data_ptr() == c.address


def test_a_trim_of_a_region_without_a_carry_is_found_and_left_in_place():
    gm = trace_trim(AXIS, HEAD, TAIL)
    after, (site,), _ = rewrite_trims(gm, {"cache": "r"}, {}, graph="trim")
    assert (site.kind, site.rewritten, site.reason) == ("trim", False, "left in place: region 'r' has no carry")
    assert torch.cat in targets(after)


class Operands(torch.nn.Module):
    """An attention that prepends its new keys and a convolution that appends its input."""

    def forward(self, k: torch.Tensor, k_cache: torch.Tensor, x: torch.Tensor, context: torch.Tensor):
        return torch.cat([k, k_cache], dim=1), torch.cat([context, x], dim=1)


def test_operand_concats_are_found_with_their_ordering_and_left_in_place():
    gm = torch.fx.symbolic_trace(Operands())
    inputs = {"k_cache": "keys", "context": "conv"}
    sites = find_retention_sites(gm, inputs, graph="g")
    assert [(s.node, s.region, s.kind, s.rewritten) for s in sites] == [
        ("cat", "keys", "prepend", False), ("cat_1", "conv", "append", False)]
    after, reported, _ = rewrite_trims(gm, inputs, {"keys": carry(), "conv": carry()}, graph="g")
    assert reported == sites and targets(after).count(torch.cat) == 2
    assert sites[0].reason == "left in place: builds the attention operand [new | cache]; the stock buffer write carries it"


def test_the_input_graph_is_left_as_it_was():
    gm = trace_trim(AXIS, HEAD, TAIL)
    code = gm.code
    rewrite_trims(gm, {"cache": "r"}, {"r": carry()}, graph="trim")
    assert gm.code == code and not hasattr(gm, "carry_r")


@pytest.mark.parametrize(
    ("full", "segments", "message"),
    [
        (lambda c: units(12), ((0, 12),), "r: 12 units exceed the carry's bound 9"),
        (lambda c: c.buffer.narrow(AXIS, 1, 4), ((0, 4),), "r: the input aliases the carry at another offset or stride"),
        (lambda c: units(6), ((3, 5), (0, 2)), "r: segments [(3, 5), (0, 2)] are not ordered and disjoint"),
    ],
    ids=["overflow", "foreign_alias", "unordered"],
)
def test_a_write_the_carry_cannot_take_without_changing_results_is_refused(full, segments, message):
    c = carry()
    with pytest.raises(CarryError) as error:
        c.keep(full(c), segments)
    assert str(error.value) == message


def test_compacting_overlapping_spans_leftwards_keeps_every_unit():
    c = carry(capacity=12)
    full = units(12, 4)
    c.adopt(full)
    kept = c.keep(c.view(), ((0, 2), (3, 12)))  # the second span moves one unit left onto itself
    assert torch.equal(kept, torch.cat([full[:, :2], full[:, 3:]], dim=AXIS))


def test_holds_remembers_the_view_but_not_past_a_change_to_it_or_to_the_extent():
    carry = Carry("r", torch.zeros(2, 8), axis=1)
    view = carry.adopt(torch.ones(2, 3))
    assert carry.holds(view) and carry.holds(view)  # the second answer comes from the memo
    carry.extent = 2
    assert not carry.holds(view)  # the carry moved on: the same tensor is no longer its view
    carry.extent = 3
    assert carry.holds(view)
    view.as_strided_((2, 3), (1, 2))  # the same tensor object, now another layout of the buffer
    assert not carry.holds(view)
    other = carry.buffer.narrow(1, 0, 3)
    assert carry.holds(other) and not carry.holds(torch.ones(2, 3))


def test_holds_does_not_remember_past_a_change_to_the_buffer_or_the_views_dtype():
    carry = Carry("r", torch.zeros(2, 8), axis=1)
    view = carry.adopt(torch.ones(2, 3))
    assert carry.holds(view)
    carry.buffer.as_strided_((2, 8), (1, 2))  # the buffer itself re-laid in place: the view no longer matches it
    assert not carry.holds(view)
    carry = Carry("r", torch.zeros(2, 8), axis=1)
    view = carry.adopt(torch.ones(2, 3))
    assert carry.holds(view)
    view.data = view.view(torch.int32)  # same address, shape and strides, another dtype
    assert not carry.holds(view)
