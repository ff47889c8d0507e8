"""A vendor's streaming loop that trims what its steps return (Token2Wav's shape, on a hand-made
model): `decode(x, att_cache)` writes [new | cached] into a scratch buffer of its own and returns a
view of it; `encode(x, att_cache, last)` concatenates its cache internally, and its last call
brings more units; the caller keeps ``cat([c[:, :P], c[:, -H:]])`` of each. Both methods take an
argument called `att_cache` holding different regions, so the binding names each region's
operator (`RegionBinding.operators`); `caller_trims` has the bound calls return the retention
themselves, copied into a carry at one address; `OperatorBinding.flush` tells the last call apart."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from cadence_fx import (
    Admission,
    Binding,
    BindingError,
    Clock,
    ClockKind,
    Contract,
    Interactivity,
    Lifetime,
    Operator,
    OperatorBinding,
    PromptPlusHistory,
    Rate,
    Region,
    RegionBinding,
    transform,
)
from cadence_fx.pipeline.export import EXPORTS

DIM, PROMPT, HISTORY, STEP, LAST = 4, 6, 4, 2, 3
CHUNKS = 7  # the caller's trim evicts from the third chunk on: at least 3 windows of history


class Vendor(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.dec, self.enc = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.register_buffer("scratch", torch.zeros(1, 32, DIM), persistent=False)

    def decode(self, x: torch.Tensor, att_cache: torch.Tensor | None = None):
        new = self.dec(x)
        full = new if att_cache is None else torch.cat([new, att_cache], dim=1)  # prepends, like the DiT
        n = full.shape[1]
        self.scratch[:, :n] = full
        weights = torch.softmax(x @ self.scratch[:, :n].transpose(1, 2), dim=-1)
        return weights @ self.scratch[:, :n], self.scratch[:, :n]

    def encode(self, x: torch.Tensor, att_cache: torch.Tensor | None = None, last: bool = False):
        new = self.enc(x) if not last else torch.cat([self.enc(x), self.enc(x[:, -1:])], dim=1)
        full = new if att_cache is None else torch.cat([att_cache, new.flip(1)], dim=1)
        return full.cumsum(1)[:, -new.shape[1] :], full


def trim(cache: torch.Tensor) -> torch.Tensor:
    """The caller's own trim, as Token2Wav's loop writes it."""
    if cache.shape[1] <= PROMPT + HISTORY:
        return cache
    return torch.cat([cache[:, :PROMPT], cache[:, -HISTORY:]], dim=1)


def contract() -> Contract:
    def region(name: str) -> Region:
        return Region(
            name,
            dims=(1, "frame", "dim"),
            axis=1,
            clock="frame",
            stride=STEP,
            dtype="float32",
            lifetime=Lifetime.PER_TURN,
            retention=PromptPlusHistory(prompt=PROMPT, history=HISTORY),
        )

    return Contract(
        family="caller_trims",
        clocks=(Clock("frame", ClockKind.FRAMES), Clock("call", ClockKind.CALLS)),
        rates=(Rate("frame", "call", STEP, name="frames_per_call"),),
        quantities={"dim": DIM},
        regions=(region("decoder_cache"), region("encoder_cache")),
        operators=(
            Operator("decode", "decoder_cache", steady=STEP),
            Operator("encode", "encoder_cache", steady=STEP, flush=(LAST,)),
        ),
        admission=Admission("frame", max_per_call=LAST),
        interactivity=Interactivity(stages=("encoder", "decoder")),
    )


BINDING = Binding(
    regions=(
        RegionBinding("decoder_cache", at=("att_cache",), out=("return.1",), caller_trims=True, operators=("decode",)),
        RegionBinding("encoder_cache", at=("att_cache",), out=("return.1",), caller_trims=True, operators=("encode",)),
    ),
    operators=(
        OperatorBinding("decode", method="decode", units=("x", 1)),
        OperatorBinding("encode", method="encode", units=STEP, flush="last"),
    ),
)


def stream(model, frames: torch.Tensor, prompt: torch.Tensor):
    """The vendor's loop: a prompt call (no cache, outside the catalog), then CHUNKS chunks, the
    last one flushing; each returned cache trimmed by the caller."""
    outputs, addresses = [], {"decode": set(), "encode": set()}
    with torch.no_grad():
        _, dec_cache = model.decode(prompt)
        _, enc_cache = model.encode(prompt)
        dec_cache, enc_cache = trim(dec_cache).clone(), trim(enc_cache).clone()  # the setup's copy, as Token2Wav keeps it
        for i in range(CHUNKS):
            last = i == CHUNKS - 1
            x = frames[:, i * STEP : (i + 1) * STEP]
            h, enc_cache = model.encode(x, enc_cache, last)
            y, dec_cache = model.decode(h, dec_cache) if not last else model.decode(h[:, :STEP], dec_cache)
            enc_cache, dec_cache = trim(enc_cache), trim(dec_cache)
            outputs += [h.clone(), y.clone(), enc_cache.clone(), dec_cache.clone()]
            addresses["encode"].add(enc_cache.data_ptr())
            addresses["decode"].add(dec_cache.data_ptr())
    return outputs, addresses


@pytest.fixture(scope="module")
def data():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(1, CHUNKS * STEP, DIM, generator=generator), torch.randn(1, PROMPT, DIM, generator=generator)


def test_the_callers_trim_runs_on_carries_bit_identical_to_the_stock_loop(data):
    model = Vendor().eval()
    expected, _ = stream(model, *data)
    bound, report = transform(model, contract(), BINDING)
    for _ in range(2):
        actual, addresses = stream(bound, *data)
        assert all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))
        # the first chunk's cache is the setup's (adopted into the carry): every later one is the carry's view
        assert addresses == {
            "encode": {report.carries["encoder_cache"].address},
            "decode": {report.carries["decoder_cache"].address},
        }
    for name in ("encode", "decode"):
        op = report.operators[name]
        assert op.counters.stock_by_reason == {"not_in_catalog": 2}  # each stream's prompt call
        assert all(cls.refused is None for cls in op.classes.values())
    # The flush flag picks the encoder's flush class (3 units); its trim keeps the first 6 and last 4.
    assert sorted(report.operators["encode"].classes[k].name for k in report.operators["encode"].classes) == [
        "encode[n=2,L=10]",
        "encode[n=2,L=6]",
        "encode[n=2,L=8]",
        "encode[n=3,L=10](flush)",
    ]
    # decode's cache comes out of its scratch buffer, which the window pass does not follow: its kept
    # units are copied into the carry; encode's is a concat of its cache the pass rewrites in place.
    assert sorted({(s.graph, s.kind, s.rewritten) for s in report.sites}) == [
        ("decode[n=2,L=10]", "keep", True),
        ("decode[n=2,L=6]", "keep", True),
        ("decode[n=2,L=8]", "keep", True),
        ("encode[n=2,L=10]", "append", True),
        ("encode[n=2,L=6]", "append", True),
        ("encode[n=2,L=8]", "append", True),
        ("encode[n=3,L=10](flush)", "append", True),
    ]
    # the carries are named by region and path: both paths are `att_cache`
    assert sorted(bound.carries) == ["decoder_cache:att_cache", "encoder_cache:att_cache"]


def test_a_model_of_the_same_structure_reuses_the_exports_on_its_own_tensors_and_another_setting_does_not(data):
    """A serving lane's copy of a model (made around the same weights, the buffers its own) and a
    model of the same structure with weights of its own both take the first transform's exports
    rebound to their own tensors (torch.export traced the weights as fake tensors: the graphs hold
    no value of them), and stream their own stock stream bit for bit; a model that differs in
    any other attribute, even a tuple no code reads, exports again."""
    first = Vendor().eval()
    lane = copy.deepcopy(first, {id(p): p for p in first.parameters()})
    other = Vendor().eval()
    with torch.no_grad():
        other.dec.weight.mul_(2)
    tuned = Vendor().eval()
    tuned.dec.setting = (1, 2)
    stream(transform(first, contract(), BINDING)[0], *data)
    for model, reused in ((lane, 7), (other, 7), (tuned, 0)):  # encode's 3 steady classes and its flush, decode's 3
        expected, _ = stream(model, *data)
        bound, report = transform(model, contract(), BINDING)
        actual, _ = stream(bound, *data)
        assert all(torch.equal(a, e) for a, e in zip(actual, expected, strict=True))
        assert sum("of a model of the same structure reused" in s for s in report.stamps) == reused
        graph = next(iter(report.operators["decode"].classes.values())).graph
        assert graph.get_buffer("model.scratch").data_ptr() == model.scratch.data_ptr()
        assert graph.get_parameter("model.dec.weight") is model.dec.weight
    # kept with their model's tensors stripped to meta
    assert all(t.device.type == "meta" for gm in EXPORTS.values() for t in (*gm.parameters(), *gm.buffers()))


def test_an_array_that_differs_only_where_its_repr_elides_is_another_structure(data):
    """A NumPy attribute is keyed by its bytes, not its repr (which elides a long array's middle)."""
    first, second = Vendor().eval(), Vendor().eval()
    first.dec.table, second.dec.table = np.zeros(2000), np.zeros(2000)
    second.dec.table[1000] = 1.0
    assert repr(first.dec.table) == repr(second.dec.table)
    stream(transform(first, contract(), BINDING)[0], *data)
    _, report = transform(second, contract(), BINDING)
    assert sum("of a model of the same structure reused" in s for s in report.stamps) == 0


@pytest.mark.parametrize(
    "binding, field, message",
    [
        (
            Binding(
                regions=(RegionBinding("decoder_cache", at=("att_cache",), caller_trims=True, operators=("decode",)),),
                operators=(OperatorBinding("decode", method="decode", units=("x", 1)),),
            ),
            "regions[0].caller_trims",
            "a caller trims a state the call returns (`out`)",
        ),
        (
            Binding(
                regions=(RegionBinding("decoder_cache", at=("att_cache",), out=("return.1",), operators=("encode",)),),
                operators=(OperatorBinding("decode", method="decode", units=("x", 1)),),
            ),
            "regions[0].operators[0]",
            "'encode' is not a bound operator; bound: ['decode']",
        ),
        (
            Binding(
                regions=(
                    RegionBinding("decoder_cache", at=("att_cache",), out=("return.1",), operators=("decode",)),
                    RegionBinding("encoder_cache", at=("att_cache",), out=("return.1",), operators=("decode",)),
                ),
                operators=(
                    OperatorBinding("decode", method="decode", units=("x", 1)),
                    OperatorBinding("encode", method="encode", units=STEP),
                ),
            ),
            "regions[1].operators",
            "'encoder_cache' is operator 'encode''s own region",
        ),
        (
            Binding(
                regions=(RegionBinding("encoder_cache", at=("att_cache",), out=("return.1",)),),
                operators=(OperatorBinding("encode", method="encode", units=("x", 1), flush="last"),),
            ),
            "operators[0].flush",
            "a flush flag gives an int `units` the contract's one flush size",
        ),
    ],
)
def test_a_binding_misusing_the_new_fields_is_refused_naming_the_field(binding, field, message):
    with pytest.raises(BindingError) as error:
        transform(Vendor().eval(), contract(), binding)
    assert error.value.field == field and message in str(error.value)
