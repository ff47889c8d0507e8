"""The cadence-fx command line: exact output and clear errors."""

import json

import pytest

from cadence_fx.cli import main


def test_catalog_json_is_the_derivation(capsys):
    assert main(["catalog", "token2wav", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    op = next(o for o in data["operators"] if o["name"] == "dit_estimator")
    assert (op["K"], op["grid"]) == (3, [302, 352, 402])
    region = next(r for r in data["regions"] if r["name"] == "estimator_att_cache")
    assert region["shape"] == [10, 16, 2, 8, 458, 128]
    assert region["stock_shape"] == [16, 16, 2, 8, 1000, 128]


def test_catalog_table_names_the_scope_verdict(capsys):
    assert main(["catalog", "llm_backbone"]) == 0
    out = capsys.readouterr().out
    assert "decode_step" in out
    assert "outside lossless scope: K = 2001 exceeds the budget of 64 classes" in out


def test_catalog_rejects_an_unknown_family(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["catalog", "whisper"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'whisper'" in capsys.readouterr().err


def test_catalog_rejects_a_bad_budget(capsys):
    with pytest.raises(SystemExit):
        main(["catalog", "moshi", "--budget", "zero"])
    assert "expected a positive integer, got 'zero'" in capsys.readouterr().err
