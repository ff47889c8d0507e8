"""The carry and the retention sites the window pass rewrites: a prompt-head plus recent-tail trim
keeps exactly the stock trim's units at one address; trims and operand concats are found on FX
graphs with their ordering."""

from __future__ import annotations

import pytest
import torch

from cadence_fx.passes.carry import Carry, CarryError, find_retention_sites, stock_trim

AXIS, HEAD, TAIL = 1, 3, 2  # keep the first 3 units (the prompt) and the last 2 along axis 1
SPANS = ((0, HEAD), (-TAIL, None))  # the trim's segments, as the window pass reads them


def units(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(2, n, 4, generator=torch.Generator().manual_seed(seed))


def carry(capacity: int = 9) -> Carry:
    return Carry("r", torch.zeros(2, capacity, 4), axis=AXIS)


class Trim(torch.nn.Module):
    def forward(self, cache: torch.Tensor) -> torch.Tensor:
        return stock_trim(cache, AXIS, HEAD, TAIL)


def test_a_trim_is_found_as_a_trim_of_its_region():
    gm = torch.fx.symbolic_trace(Trim())
    (site,) = find_retention_sites(gm, {"cache": "r"}, graph="trim")
    assert (site.graph, site.region, site.axis, site.kind, site.rewritten) == ("trim", "r", AXIS, "trim", False)


def test_a_trim_of_the_carrys_own_view_is_compacted_in_place_to_the_stock_units():
    c = carry()
    full = units(9, 1)
    c.adopt(full)  # the stock code wrote 9 units into the carry itself
    kept = c.keep(c.view(), SPANS)
    assert torch.equal(kept, stock_trim(full, AXIS, HEAD, TAIL))
    assert (kept.data_ptr(), c.extent, tuple(kept.shape)) == (c.address, HEAD + TAIL, (2, 5, 4))


def test_a_trim_of_a_tensor_outside_the_carry_is_copied_in():
    c = carry()
    full = units(7, 2)
    kept = c.keep(full, SPANS)
    assert torch.equal(kept, stock_trim(full, AXIS, HEAD, TAIL)) and kept.data_ptr() == c.address


def test_a_stream_of_prepend_then_trim_keeps_one_address_and_the_stock_state():
    c = carry(capacity=HEAD + TAIL + 2)
    stock = kept = units(HEAD + TAIL, 3)
    c.adopt(kept)
    for call in range(5):
        new = units(2, 10 + call)
        stock = stock_trim(torch.cat([new, stock], dim=AXIS), AXIS, HEAD, TAIL)
        kept = c.keep(torch.cat([new, c.view()], dim=AXIS), SPANS)
        assert torch.equal(kept, stock) and kept.data_ptr() == c.address


class Operands(torch.nn.Module):
    """An attention that prepends its new keys and a convolution that appends its input."""

    def forward(self, k: torch.Tensor, k_cache: torch.Tensor, x: torch.Tensor, context: torch.Tensor):
        return torch.cat([k, k_cache], dim=1), torch.cat([context, x], dim=1)


def test_operand_concats_are_found_with_their_ordering_and_left_in_place():
    gm = torch.fx.symbolic_trace(Operands())
    inputs = {"k_cache": "keys", "context": "conv"}
    sites = find_retention_sites(gm, inputs, graph="g")
    assert [(s.node, s.region, s.kind, s.rewritten) for s in sites] == [
        ("cat", "keys", "prepend", False),
        ("cat_1", "conv", "append", False),
    ]
    assert sites[0].reason == "left in place: builds the attention operand [new | cache]; the stock buffer write carries it"


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
