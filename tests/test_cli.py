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


@pytest.mark.slow
def test_diff_prints_every_rewritten_site_and_writes_a_page(capsys, tmp_path):
    page = tmp_path / "diff.html"
    assert main(["diff", "token2wav", "--device", "cpu", "--html", str(page)]) == 0
    out = capsys.readouterr().out
    assert out.count("its first 102 and last 100 units copied into the carry in place after the last reader") == 8
    assert "=== cfm_loop[n=50,L=202] ===" in out and "=== conformer_encoder[n=50,L=202] ===" in out
    assert out.count("removed nodes: cat x1, slice x2") == 4  # the caller's trim, once a turn evicts (L=202)
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>") and "://" not in text
    assert 'data-graph="cfm_loop[n=50,L=202]"' in text and 'data-graph="conformer_encoder[n=50,L=202]"' in text
    # The construction's two warm-up turns verify every class on its first two visits; only the steady
    # class at the full extent (L=202, twice a turn) is visited more, through each operator's engine.
    assert text.count('<dl class="certificate admitted">') == 2


@pytest.mark.slow
def test_demo_streams_bit_identical_chunks(capsys):
    assert main(["demo", "--blocks", "2", "--chunks", "3"]) == 0
    out = capsys.readouterr().out
    assert out.count("bit-identical=True") == 6
    assert "all 6 chunks bit-identical to the vendor stream: True" in out


def test_diff_of_freeze_omni_shows_its_window_rewrites_and_certifies_both_classes(capsys, tmp_path):
    page = tmp_path / "report.html"
    assert main(["diff", "freeze_omni", "--chunks", "2", "--device", "cpu", "--html", str(page)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("on cpu\n")
    assert "=== encoder_chunk[n=4,L=0] ===" in out and "=== encoder_chunk[n=4,L=4] ===" in out
    assert "retention sites" in out
    assert "ExactShapeReplay encoder_chunk: 2 calls, 0 captures, 0 replays, 2 eager, 0 invalidations" in out
    text = page.read_text()
    assert "after a short stream: 3 utterances of 2 chunks of random fbank features." in text
    assert text.count('<dl class="certificate admitted">') == 2
    assert 'data-device="cpu"' in text


def test_diff_refuses_a_negative_chunk_count(capsys):
    with pytest.raises(SystemExit):
        main(["diff", "freeze_omni", "--chunks", "-1"])
    assert "expected a non-negative integer, got -1" in capsys.readouterr().err


def test_diff_of_a_family_without_a_reference_model_says_so(capsys):
    assert main(["diff", "moshi"]) == 2
    assert "the diff builds reference models for ['freeze_omni', 'token2wav'] only, got 'moshi'" in capsys.readouterr().err


def test_diff_of_your_own_model_takes_a_factory_and_shows_what_it_saves(capsys, tmp_path):
    page = tmp_path / "own.html"
    assert main(["diff", "--binding", "byom_example:diff_example", "--chunks", "4", "--device", "cpu", "--html", str(page)]) == 0
    out = capsys.readouterr().out
    assert "=== decoder_step[n=2,L=0] ===" in out and "=== decoder_step[n=2,L=4] ===" in out
    # the first call's program differs from the stock call's (refused, its stock result kept)
    assert "decoder_step: {'calls': 4, 'graph_calls': 4, 'verified': 3, 'stock': 1" in out
    assert "host launches per call" in out and "memory per region" in out
    text = page.read_text()
    assert "<title>cadence-fx diff: byom_example:diff_example</title>" in text
    assert text.count('data-launches="decoder_step[n=2,') == 4  # the steady class's two programs among them


def test_diff_defaults_to_the_cpu_without_cuda_and_refuses_cuda_there(capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert main(["diff", "freeze_omni"]) == 0
    assert capsys.readouterr().out.startswith("on cpu\n")
    assert main(["diff", "freeze_omni", "--device", "cuda"]) == 2
    assert "--device cuda: no CUDA device here (torch.cuda.is_available() is False); use --device cpu" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, error",
    [
        ([], "give a FAMILY or --binding MODULE:FACTORY (one of them)"),
        (["freeze_omni", "--binding", "byom_example:diff_example"], "give a FAMILY or --binding MODULE:FACTORY (one of them)"),
        (["--binding", "byom_example", "--chunks", "1"], "--binding: expected MODULE:FACTORY, got 'byom_example'"),
        (
            ["--binding", "byom_example:nothing", "--chunks", "1"],
            "--binding byom_example:nothing: module 'byom_example' has no attribute 'nothing'",
        ),
        (
            ["--binding", "byom_example:diff_example", "--depth", "full"],
            "--depth sizes a family's reference model; a --binding factory builds its own",
        ),
        (
            ["--binding", "byom_example:diff_example"],
            "--binding: a bound model exports each class at its first call, so without a stream there is no graph to "
            "show; give --chunks N (N calls)",
        ),
        (
            ["--binding", "byom_example:build_model", "--chunks", "1"],
            "--binding byom_example:build_model: the factory returned a tuple of 2, expected a tuple (model, contract, "
            "binding, stream)",
        ),
    ],
)
def test_diff_says_what_was_wrong_with_its_model(capsys, argv, error):
    assert main(["diff", "--device", "cpu", *argv]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"cadence-fx diff: error: {error}"
