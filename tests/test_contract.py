"""Static checks: every rejection names its field path and the rule it breaks."""

from dataclasses import replace
from fractions import Fraction

import pytest

from cadence_fx import ContractError, Interactivity, PromptPlusHistory, Rate, RingCache, SlidingWindow
from cadence_fx.models.freeze_omni import freeze_omni_contract
from cadence_fx.models.llm_backbone import llm_backbone_contract
from cadence_fx.models.moshi import moshi_contract
from cadence_fx.models.token2wav import token2wav_contract


def with_region(contract, index, **changes):
    regions = list(contract.regions)
    regions[index] = replace(regions[index], **changes)
    return replace(contract, regions=tuple(regions))


def rejected(build) -> ContractError:
    with pytest.raises(ContractError) as info:
        build()
    return info.value


@pytest.mark.parametrize("factory", [token2wav_contract, moshi_contract, freeze_omni_contract, llm_backbone_contract])
def test_the_family_contracts_pass_the_static_checks(factory):
    assert factory().family


def test_c1_rejects_a_single_clock():
    base = llm_backbone_contract()
    error = rejected(lambda: replace(base, clocks=base.clocks[:1], rates=()))
    assert (error.field, error.rule) == ("clocks", "C1")


def test_c1_rejects_clocks_no_rate_links():
    error = rejected(lambda: replace(llm_backbone_contract(), rates=()))
    assert (error.field, error.rule) == ("rates", "C1")


def test_c1_rejects_a_zero_rate():
    base = token2wav_contract()
    rates = (replace(base.rates[0], value=0), *base.rates[1:])
    error = rejected(lambda: replace(base, rates=rates))
    assert (error.field, error.rule) == ("rates[0].value", "C1")


def test_c1_rejects_a_negative_rate():
    base = token2wav_contract()
    rates = (*base.rates[:2], replace(base.rates[2], value=-50), *base.rates[3:])
    error = rejected(lambda: replace(base, rates=rates))
    assert (error.field, error.rule) == ("rates[2].value", "C1")


def test_c1_rejects_a_rate_that_is_not_fixed_by_configuration():
    base = llm_backbone_contract()
    error = rejected(lambda: replace(base, rates=(Rate("token", "step", 0.5),)))
    assert (error.field, error.rule) == ("rates[0].value", "C1")


def test_c1_accepts_a_fractional_rate():
    base = llm_backbone_contract()
    assert replace(base, rates=(Rate("token", "step", Fraction(1, 2)),)).rates[0].value == Fraction(1, 2)


def test_c1_rejects_a_rate_on_an_undeclared_clock():
    base = llm_backbone_contract()
    error = rejected(lambda: replace(base, rates=(Rate("token", "second", 1),)))
    assert (error.field, error.rule) == ("rates[0].per", "C1")


def test_c1_rejects_a_region_on_an_undeclared_clock():
    base = token2wav_contract()
    error = rejected(lambda: with_region(base, 0, dims=("n_steps", "depth", "cfg_batch", "heads", "mel_frame", "codec_frame")))
    assert (error.field, error.rule) == ("regions[0].dims[5]", "C1")
    assert "codec_frame" in str(error)


def test_c1_rejects_a_region_whose_clock_is_undeclared():
    error = rejected(lambda: with_region(token2wav_contract(), 2, clock="codec_frame"))
    assert (error.field, error.rule) == ("regions[2].clock", "C1")


def test_c2_rejects_a_contract_without_a_bounded_region():
    base = llm_backbone_contract()
    error = rejected(lambda: with_region(base, 0, retention=None))
    assert (error.field, error.rule) == ("regions", "C2")


def test_c2_rejects_a_non_integer_stride():
    error = rejected(lambda: with_region(token2wav_contract(), 0, stride=50.0))
    assert (error.field, error.rule) == ("regions[0].stride", "C2")


def test_c2_rejects_a_zero_stride():
    error = rejected(lambda: with_region(token2wav_contract(), 0, stride=0))
    assert (error.field, error.rule) == ("regions[0].stride", "C2")


def test_c2_rejects_a_history_below_the_chunk():
    base = token2wav_contract()
    error = rejected(lambda: with_region(base, 0, retention=PromptPlusHistory(prompt=302, history=40)))
    assert (error.field, error.rule) == ("regions[0].retention.history", "C2")


def test_c2_rejects_a_ring_below_the_chunk():
    base = moshi_contract()
    error = rejected(lambda: with_region(base, 0, retention=RingCache(1)))
    assert (error.field, error.rule) == ("regions[0].retention.capacity", "C2")


def test_c2_rejects_a_negative_window():
    base = llm_backbone_contract()
    error = rejected(lambda: with_region(base, 0, retention=SlidingWindow(window=-1)))
    assert (error.field, error.rule) == ("regions[0].retention.window", "C2")


def test_c3_rejects_intra_session_batching():
    base = token2wav_contract()
    error = rejected(lambda: replace(base, interactivity=Interactivity(stages=("flow",), batch_per_session=4)))
    assert (error.field, error.rule) == ("interactivity.batch_per_session", "C3")


def test_c3_rejects_a_multi_session_declaration():
    base = token2wav_contract()
    error = rejected(lambda: replace(base, interactivity=Interactivity(stages=("flow",), single_session=False)))
    assert (error.field, error.rule) == ("interactivity.single_session", "C3")


def test_c3_rejects_undeclared_stages():
    error = rejected(lambda: replace(token2wav_contract(), interactivity=Interactivity(stages=())))
    assert (error.field, error.rule) == ("interactivity.stages", "C3")


def test_rejects_an_unknown_dtype():
    error = rejected(lambda: with_region(token2wav_contract(), 0, dtype="float8"))
    assert (error.field, error.rule) == ("regions[0].dtype", "declaration")


def test_rejects_a_flush_outside_the_admission_predicate():
    base = token2wav_contract()
    operators = (replace(base.operators[0], flush=(60,)), *base.operators[1:])
    error = rejected(lambda: replace(base, operators=operators))
    assert (error.field, error.rule) == ("operators[0].flush[0]", "declaration")
    assert "0 < n <= 56" in str(error)


def test_admission_converts_units_along_the_declared_rates():
    # Mimi appends 2 steps of its 25 Hz transformer per 12.5 Hz frame: one frame per call.
    contract = moshi_contract()
    assert contract.admission.admits(1) and not contract.admission.admits(2)
    operators = (replace(contract.operators[0], steady=4), *contract.operators[1:])
    error = rejected(lambda: replace(contract, operators=operators))
    assert error.field == "operators[0].steady"
