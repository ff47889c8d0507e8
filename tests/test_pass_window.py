"""The window pass on hand-made step graphs: append, evict, keep and adopt, each against the stock
concat-then-slice retention, bit for bit, with one carry address for the whole stream."""

from __future__ import annotations

import pytest
import torch

from cadence_fx.audit import ShadowAuditor
from cadence_fx.passes.carry import CarryError
from cadence_fx.passes.window import (
    Window,
    WindowCarry,
    WindowError,
    rewrite_windows,
    window_adopt,
    window_append,
    window_evict,
    window_keep,
)

KEEP, NEW = 8, 2  # the window retains 8 units; each call brings 2
SHAPE = (1, 2, 3)  # (batch, heads, features); the window's axis is 2, between heads and features


def units(n: int, seed: int) -> torch.Tensor:
    return torch.randn(SHAPE[0], SHAPE[1], n, SHAPE[2], generator=torch.Generator().manual_seed(seed))


class HeldWindow(torch.nn.Module):
    """An attention K/V window: ``cat([kept, new])`` is the operand every reader sees, and its last
    KEEP units (fewer while the window fills) are the next call's state."""

    def forward(self, new: torch.Tensor, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        operand = torch.cat([kept, new], dim=2)
        scores = torch.softmax(operand.sum(-1), dim=-1)
        return (scores.unsqueeze(-1) * operand).sum(2), operand[:, :, -KEEP:]


class ConvContext(torch.nn.Module):
    """A convolution's left context: the concat builds the operand, only its last KEEP units are kept."""

    def forward(self, new: torch.Tensor, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        full = torch.cat([context, new], dim=2)
        return full.cumsum(2)[:, :, -NEW:], full[:, :, -KEEP:]


class FirstCall(torch.nn.Module):
    """The first call of a stream: nothing retained yet, the new units kept whole."""

    def forward(self, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return new.sum(2), new * 2


def export(module: torch.nn.Module, *args: torch.Tensor) -> torch.fx.GraphModule:
    return torch.export.export(module, args, strict=False).module()


def targets(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def held_graphs(carry: WindowCarry) -> dict[int, torch.fx.GraphModule]:
    """One rewritten graph per retained extent the stream visits: 0, 2, ..., KEEP."""
    graphs = {}
    for extent in range(0, KEEP + 1, NEW):
        gm = export(HeldWindow(), units(NEW, 0), units(extent, 1))
        window = Window("kv", "kv", output=1, input="kept", axis=2, keep=KEEP, live=extent + NEW, held=True)
        graphs[extent], _, _ = rewrite_windows(gm, (window,), {"kv": carry}, graph=f"L={extent}")
    return graphs


def stream_held(calls: int, auditor: ShadowAuditor | None):
    """The stock step and the rewritten one over `calls` calls: (outputs equal, retained equal,
    carry addresses, operand extents) per call."""
    carry = WindowCarry("kv", "kv", torch.zeros(*SHAPE[:2], KEEP + NEW, SHAPE[2]), axis=2, auditor=auditor)
    graphs = held_graphs(carry)
    stock_kept, kept = units(0, 0), carry.reset()
    rows = []
    for call in range(calls):
        new = units(NEW, 10 + call)
        expected, stock_kept_next = HeldWindow()(new, stock_kept)
        got, kept = graphs[kept.shape[2]](new, kept)
        rows.append((torch.equal(got, expected), torch.equal(kept, stock_kept_next), kept.data_ptr(), stock_kept.shape[2] + NEW))
        stock_kept = stock_kept_next
    return rows, carry


def test_a_held_window_becomes_append_then_evict_and_the_concat_is_gone():
    carry = WindowCarry("kv", "kv", torch.zeros(*SHAPE[:2], KEEP + NEW, SHAPE[2]), axis=2)
    gm = export(HeldWindow(), units(NEW, 0), units(KEEP, 1))
    window = Window("kv", "kv", output=1, input="kept", axis=2, keep=KEEP, live=KEEP + NEW, held=True)
    after, (site,), stamp = rewrite_windows(gm, (window,), {"kv": carry}, graph="steady")
    assert window_append in targets(after) and window_evict in targets(after)
    assert torch.ops.aten.cat.default not in targets(after) and torch.ops.aten.cat.default in targets(gm)
    assert (site.graph, site.region, site.axis, site.kind, site.rewritten) == ("steady", "kv", 2, "append", True)
    assert site.reason == (
        "rewritten (kv): [retained | new] written in place at offset 8 of the carry is the operand, "
        "its strides are the stock concat's; its last 8 units compacted in place after the last reader"
    )
    assert stamp.startswith("window pass on steady: 1 of 1 declared sites rewritten, took ")


def test_a_held_window_streams_bit_identical_to_the_stock_retention_at_one_address():
    rows, carry = stream_held(7, None)
    assert [(out, kept) for out, kept, _, _ in rows] == [(True, True)] * 7
    assert {address for _, _, address, _ in rows} == {carry.address}
    assert (carry.extent, carry.retentions) == (KEEP, 7)


def test_auditing_a_window_that_is_not_yet_full_checks_it_and_counts_no_eviction():
    auditor = ShadowAuditor()
    rows, _ = stream_held(3, auditor)  # operands of 2, 4 and 6 units: nothing leaves an 8-unit window
    assert [(out, kept) for out, kept, _, _ in rows] == [(True, True)] * 3
    assert (auditor.retentions, auditor.applications, auditor.mismatches) == (3, 0, 0)


def test_auditing_a_window_counts_an_eviction_exactly_when_the_operand_outgrows_it():
    auditor = ShadowAuditor()
    rows, _ = stream_held(7, auditor)
    assert [operand for *_, operand in rows] == [2, 4, 6, 8, 10, 10, 10]
    assert auditor.counters() == {"retentions": 7, "applications": 3, "mismatches": 0, "distinct_carry_addresses": {"kv": 1}}


def assert_streams_like(stock_step: torch.nn.Module, after, carry: WindowCarry, width: int) -> None:
    """Three calls of `width` new units from the same full context: the rewritten graph's outputs
    and retained context equal the stock step's, the context at the carry's one address."""
    stock, context = units(KEEP, 2), carry.reset(units(KEEP, 2))
    for call in range(3):
        new = units(width, 20 + call)
        expected, stock = stock_step(new, stock)
        got, context = after(new, context)
        assert torch.equal(got, expected) and torch.equal(context, stock)
        assert context.data_ptr() == carry.address


def test_a_context_the_window_does_not_hold_keeps_its_concat_and_copies_into_a_compact_carry():
    auditor = ShadowAuditor()
    carry = WindowCarry("ctx", "ctx", torch.zeros(*SHAPE[:2], KEEP, SHAPE[2]), axis=2, auditor=auditor)
    gm = export(ConvContext(), units(NEW, 0), units(KEEP, 1))
    window = Window("ctx", "ctx", output=1, input="context", axis=2, keep=KEEP, live=KEEP + NEW, held=False)
    after, (site,), _ = rewrite_windows(gm, (window,), {"ctx": carry}, graph="steady")
    assert window_keep in targets(after) and torch.ops.aten.cat.default in targets(after)
    assert site.reason == "rewritten (ctx): operand concat kept; its last 8 units copied into the compact carry in place"
    assert_streams_like(ConvContext(), after, carry, NEW)
    assert (auditor.retentions, auditor.applications, auditor.mismatches) == (3, 3, 0)


def test_auditing_a_context_shorter_than_its_window_copies_it_whole_and_counts_no_eviction():
    auditor = ShadowAuditor()
    carry = WindowCarry("ctx", "ctx", torch.zeros(*SHAPE[:2], KEEP, SHAPE[2]), axis=2, auditor=auditor)
    gm = export(ConvContext(), units(NEW, 0), units(NEW, 1))
    window = Window("ctx", "ctx", output=1, input="context", axis=2, keep=KEEP, live=2 * NEW, held=False)
    after, _, _ = rewrite_windows(gm, (window,), {"ctx": carry}, graph="filling")
    new, context = units(NEW, 4), carry.reset(units(NEW, 5))
    (got, kept), (expected, stock) = after(new, context), ConvContext()(new, units(NEW, 5))
    assert torch.equal(got, expected) and torch.equal(kept, stock) and kept.shape[2] == 2 * NEW
    assert (auditor.retentions, auditor.applications, auditor.mismatches) == (1, 0, 0)


class PaddingContext(torch.nn.Module):
    """transformers' Mimi padding cache: the operand is ``cat([context, new])``, but the next call's
    context is taken from the new units alone (``new[..., -KEEP:]``), which fill the window."""

    def forward(self, new: torch.Tensor, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        full = torch.cat([context, new], dim=2)
        return full.cumsum(2)[:, :, -NEW:], new[:, :, -KEEP:]


def test_a_context_kept_from_the_new_units_alone_is_copied_into_its_carry():
    """Bug (fixed in passes/window.py `rewrite_windows`): the retention output is a tail of the new
    units, not of the concat, and the pass refused it (`retention output slice_1 is neither a concat
    of context and new units nor new units kept whole`), so transformers' Mimi encoder ran the stock
    code at every call after its first."""
    carry = WindowCarry("ctx", "ctx", torch.zeros(*SHAPE[:2], KEEP, SHAPE[2]), axis=2)
    wide = KEEP + NEW  # a call brings more units than the window keeps
    gm = export(PaddingContext(), units(wide, 0), units(KEEP, 1))
    window = Window("ctx", "ctx", output=1, input="context", axis=2, keep=KEEP, live=KEEP + wide, held=False)
    after, (site,), _ = rewrite_windows(gm, (window,), {"ctx": carry}, graph="steady")
    assert window_adopt in targets(after)
    assert site.reason == "rewritten (ctx): the last 8 of the new units (they fill the window) copied into the carry in place"
    assert_streams_like(PaddingContext(), after, carry, wide)


def test_new_units_kept_whole_are_adopted_into_the_carry():
    carry = WindowCarry("kv", "kv", torch.zeros(*SHAPE[:2], KEEP + NEW, SHAPE[2]), axis=2, auditor=ShadowAuditor())
    gm = export(FirstCall(), units(NEW, 0))
    window = Window("kv", "kv", output=1, input=None, axis=2, keep=KEEP, live=NEW, held=True)
    after, (site,), _ = rewrite_windows(gm, (window,), {"kv": carry}, graph="first")
    assert window_adopt in targets(after)
    assert (site.kind, site.reason) == ("keep", "rewritten (kv): the new units, kept whole, copied into the carry in place")
    new = units(NEW, 3)
    carry.reset()
    (got, kept), (expected, stock) = after(new), FirstCall()(new)
    assert torch.equal(got, expected) and torch.equal(kept, stock)
    assert (kept.data_ptr(), carry.extent, carry.auditor.applications) == (carry.address, NEW, 0)


def test_the_input_graph_is_left_as_it_was():
    carry = WindowCarry("kv", "kv", torch.zeros(*SHAPE[:2], KEEP + NEW, SHAPE[2]), axis=2)
    gm = export(HeldWindow(), units(NEW, 0), units(KEEP, 1))
    code = gm.code
    rewrite_windows(gm, (Window("kv", "kv", 1, "kept", 2, KEEP, KEEP + NEW, True),), {"kv": carry}, graph="g")
    assert gm.code == code and not hasattr(gm, "carry_kv")


@pytest.mark.parametrize(
    ("window", "message"),
    [
        (
            Window("kv", "kv", 1, "kept", 2, KEEP, KEEP + 1, True),
            "g: kv: operand cat has extent 10 along axis 2, the catalog class declares 9",
        ),
        (
            Window("kv", "kv", 1, "kept", 2, KEEP - 1, KEEP + NEW, True),
            "g: kv: the retention keeps the last 8 units along axis 2, the region retains the last 7 along axis 2",
        ),
        (
            Window("kv", "kv", 1, "kept", 1, KEEP, KEEP + NEW, True),
            "g: kv: cat concatenates kept along axis 2, declared kept along axis 1",
        ),
        (
            Window("kv", "kv", 1, "cache", 2, KEEP, KEEP + NEW, True),
            "g: kv: retention output slice_1 is neither a concat of cache and new units nor new units kept whole",
        ),
        (
            Window("kv", "kv", 0, "kept", 2, KEEP, KEEP + NEW, True),
            "g: kv: retention output sum_2 is neither a concat of kept and new units nor new units kept whole",
        ),
    ],
    ids=["live", "keep", "axis", "input", "output"],
)
def test_a_declaration_the_graph_does_not_have_is_refused_naming_what_differs(window, message):
    carry = WindowCarry("kv", "kv", torch.zeros(*SHAPE[:2], KEEP + NEW, SHAPE[2]), axis=2)
    gm = export(HeldWindow(), units(NEW, 0), units(KEEP, 1))
    with pytest.raises(WindowError) as error:
        rewrite_windows(gm, (window,), {"kv": carry}, graph="g")
    assert str(error.value) == message


def test_retained_state_that_is_not_the_carrys_view_is_refused():
    carry = WindowCarry("kv", "kv", torch.zeros(*SHAPE[:2], KEEP + NEW, SHAPE[2]), axis=2)
    after, _, _ = rewrite_windows(
        export(HeldWindow(), units(NEW, 0), units(KEEP, 1)),
        (Window("kv", "kv", 1, "kept", 2, KEEP, KEEP + NEW, True),),
        {"kv": carry},
        graph="g",
    )
    carry.reset(units(KEEP, 1))
    with pytest.raises(CarryError, match=r"kv: the retained state passed in is not this carry's view"):
        after(units(NEW, 2), units(KEEP, 1))


SINKS = 2  # a prompt (or attention sinks) kept at the front, then the newest KEEP - SINKS units


class SinkWindow(torch.nn.Module):
    """Attention with sinks: the operand's first SINKS units stay, and its newest KEEP - SINKS after them."""

    def forward(self, new: torch.Tensor, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        operand = torch.cat([kept, new], dim=2)
        scores = torch.softmax(operand.sum(-1), dim=-1)
        out = (scores.unsqueeze(-1) * operand).sum(2)
        if operand.shape[2] <= KEEP:
            return out, operand
        return out, torch.cat([operand[:, :, :SINKS], operand[:, :, -(KEEP - SINKS) :]], dim=2)


def test_a_window_with_sinks_keeps_its_head_and_tail_in_place_bit_identically_at_one_address():
    auditor = ShadowAuditor()
    carry = WindowCarry("kv", "kv", torch.zeros(*SHAPE[:2], KEEP + NEW, SHAPE[2]), axis=2, auditor=auditor)
    graphs = {}
    for extent in range(0, KEEP + 1, NEW):
        gm = export(SinkWindow(), units(NEW, 0), units(extent, 1))
        window = Window("kv", "kv", output=1, input="kept", axis=2, keep=KEEP, live=extent + NEW, held=True, head=SINKS)
        graphs[extent], (site,), _ = rewrite_windows(gm, (window,), {"kv": carry}, graph=f"L={extent}")
    assert torch.ops.aten.cat.default not in targets(graphs[KEEP]) and window_evict in targets(graphs[KEEP])
    assert site.reason == (
        "rewritten (kv): [retained | new] written in place at offset 8 of the carry is the operand, "
        "its strides are the stock concat's; its first 2 and last 6 units compacted in place "
        "after the last reader"
    )
    stock_kept, kept = units(0, 0), carry.reset()
    for call in range(7):
        new = units(NEW, 30 + call)
        expected, stock_kept = SinkWindow()(new, stock_kept)
        got, kept = graphs[kept.shape[2]](new, kept)
        assert torch.equal(got, expected) and torch.equal(kept, stock_kept)
        assert kept.data_ptr() == carry.address
    # Operands of 2, 4, 6, 8, then 10 units three times: the last three evict.
    assert auditor.counters() == {"retentions": 7, "applications": 3, "mismatches": 0, "distinct_carry_addresses": {"kv": 1}}


def test_a_window_with_sinks_declared_without_them_is_refused():
    carry = WindowCarry("kv", "kv", torch.zeros(*SHAPE[:2], KEEP + NEW, SHAPE[2]), axis=2)
    gm = export(SinkWindow(), units(NEW, 0), units(KEEP, 1))
    with pytest.raises(WindowError) as error:
        rewrite_windows(gm, (Window("kv", "kv", 1, "kept", 2, KEEP, KEEP + NEW, True),), {"kv": carry}, graph="g")
    assert str(error.value) == (
        "g: kv: the retention keeps the first 2 and last 6 units along axis 2, the region retains the last 8 along axis 2"
    )


def test_a_rewritten_graph_shares_every_tensor_the_model_holds():
    """The window pass rewrites a copy of the graph: the copy shares the weights and the constants
    `torch.export` lifted (a tensor the model holds as a plain attribute), never copies them; it
    holds the carry besides. With no window declared there is nothing to rewrite: the graph itself
    comes back."""

    class Lookup(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(SHAPE[2], SHAPE[2])
            self.table = torch.randn(8, SHAPE[2])  # neither a parameter nor a buffer: exported as a lifted constant

        def forward(self, new, kept):
            operand = torch.cat([kept, new], dim=2)
            return self.proj(operand).sum(2) + self.table[:1], operand[:, :, -KEEP:]

    def held(module_tree):
        return {
            t.data_ptr()
            for module in module_tree.modules()
            for t in [*vars(module).values(), *module.parameters(recurse=False), *module.buffers(recurse=False)]
            if isinstance(t, torch.Tensor)
        }

    model = Lookup()
    gm = export(model, units(NEW, 0), units(KEEP, 1))
    carry = WindowCarry("kv", "kv", torch.zeros(*SHAPE[:2], KEEP + NEW, SHAPE[2]), axis=2)
    window = Window("kv", "kv", output=1, input="kept", axis=2, keep=KEEP, live=KEEP + NEW, held=True)
    after, (site,), _ = rewrite_windows(gm, (window,), {"kv": carry}, graph="lookup")
    assert after is not gm and site.rewritten
    model_tensors = {model.proj.weight.data_ptr(), model.proj.bias.data_ptr(), model.table.data_ptr()}
    assert held(gm) == model_tensors and held(after) - held(carry) == model_tensors
    assert rewrite_windows(gm, (), {}, graph="lookup") == (
        gm,
        [],
        "window pass on lookup: no window site declared, the graph runs as exported",
    )


class ScratchPrepend(torch.nn.Module):
    """Token2Wav's DiT-and-CFM shape: [new | kept] written into a scratch buffer of the step's own,
    a view of it returned, and the caller's prompt-plus-history trim of it (first 2, last 6)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scratch", torch.zeros(*SHAPE[:2], 16, SHAPE[2]))

    def forward(self, new: torch.Tensor, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = new.shape[2] + kept.shape[2]
        self.scratch[:, :, :n] = torch.cat([new * 2, kept], dim=2)
        full = self.scratch[:, :, :n]
        return full.sum(2), torch.cat([full[:, :, :2], full[:, :, -(KEEP - 2) :]], dim=2)


def test_a_returned_state_the_pass_cannot_follow_is_copied_into_the_carry_only_when_declared():
    """`copy`: the kept units of a state built in a buffer of the step's own are copied into the
    carry after the last reader (the trim erased), bit for bit the stock retention, at one address;
    without it the same graph is refused."""
    step = ScratchPrepend()
    gm = export(step, units(NEW, 0), units(KEEP, 1))
    declared = Window("kv", "kv", 1, "kept", 2, KEEP, KEEP + NEW, False, head=2)
    carry = WindowCarry("kv", "kv", torch.zeros(*SHAPE[:2], KEEP + NEW, SHAPE[2]), axis=2, auditor=ShadowAuditor())
    with pytest.raises(WindowError, match="is neither a concat of kept and new units"):
        rewrite_windows(gm, (declared,), {"kv": carry}, graph="g")
    after, sites, _ = rewrite_windows(gm, (Window(**{**vars(declared), "copy": True}),), {"kv": carry}, graph="g")
    assert [(s.kind, s.rewritten) for s in sites] == [("keep", True)]
    assert (
        targets(after).count(window_keep) == 1 and targets(after).count(torch.ops.aten.cat.default) == 1
    )  # the trim's cat erased
    stock_kept = units(KEEP, 1)
    view = carry.reset(stock_kept)
    for call in range(4):
        new = units(NEW, 10 + call)
        expected_out, expected_kept = ScratchPrepend()(new, stock_kept)
        out, kept = after(new, view)
        assert torch.equal(out, expected_out) and torch.equal(kept, expected_kept)
        assert kept.data_ptr() == carry.address
        stock_kept, view = expected_kept, kept
    assert carry.auditor.mismatches == 0 and carry.auditor.retentions == 4
