"""docs/results.md is what bench/results_index.py writes from the records in bench/results/, and the
script refuses a record that does not say where it came from (commit, command, device)."""

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _index():
    spec = importlib.util.spec_from_file_location("results_index", ROOT / "bench" / "results_index.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_index_is_what_the_script_writes():
    index = _index()
    assert (ROOT / "docs" / "results.md").read_text() == index.render(), (
        "docs/results.md is stale: run `python bench/results_index.py`"
    )


def test_every_current_record_is_indexed_and_linked():
    text = (ROOT / "docs" / "results.md").read_text()
    for record in (ROOT / "bench" / "results").glob("*.json"):
        assert f"](../bench/results/{record.name})" in text, record.name
    assert "history/" not in text.replace("bench/results/history/](../bench/results/history/)", "")


def _head() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.parametrize("missing", ["commit", "command", "device"])
def test_a_record_without_its_provenance_is_refused_by_name(tmp_path, missing):
    index = _index()
    record = {
        "benchmark": "binding_wide",
        "commit": _head(),
        "command": "python bench/binding_wide.py",
        "device": "cpu",
        "catalog_width": 2,
        "classes_met": 2,
        "calls_per_stream": 3,
        "stock_stream_seconds": 0.1,
        "streams": [{"stream": 0, "seconds": 0.2, "bit_identical": True}],
    }
    (tmp_path / "fine.json").write_text(json.dumps(record))
    assert "fine.json" in index.render(tmp_path)
    del record[missing]
    (tmp_path / "lacking.json").write_text(json.dumps(record))
    with pytest.raises(index.RecordError, match=rf"bench/results/lacking\.json lacks '{missing}'"):
        index.render(tmp_path)


def test_a_record_of_an_unknown_benchmark_or_commit_is_refused_by_name(tmp_path):
    index = _index()
    shutil.copy(ROOT / "bench" / "results" / "binding_wide_cpu.json", tmp_path / "wide.json")
    record = json.loads((tmp_path / "wide.json").read_text())
    del record["date"]  # a record without its own date is dated by its commit, from git
    (tmp_path / "wide.json").write_text(json.dumps({**record, "commit": "0" * 40}))
    with pytest.raises(index.RecordError, match=r"wide\.json: commit 0{40} is not in this repository's history"):
        index.render(tmp_path)
    (tmp_path / "wide.json").write_text(json.dumps({**record, "benchmark": "nothing_known"}))
    with pytest.raises(index.RecordError, match=r"wide\.json: no headline reader for benchmark 'nothing_known'"):
        index.render(tmp_path)


def test_the_check_mode_says_whether_the_page_is_current(capsys):
    assert _index().main(["--check"]) == 0
    assert "docs/results.md is up to date" in capsys.readouterr().out


def _serve_load(**overrides) -> dict:
    """A serve_load record with what its headline and its key read."""
    record = json.loads((ROOT / "bench" / "results" / "serve_load_token2wav_2.json").read_text())
    return {**record, "date": "2026-12-05", **overrides}


def test_a_current_record_named_with_a_commit_is_refused_by_name(tmp_path):
    index = _index()
    (tmp_path / "serve_load_token2wav_2_17ae789.json").write_text(json.dumps(_serve_load()))
    with pytest.raises(
        index.RecordError, match=r"bench/results/serve_load_token2wav_2_17ae789\.json: its name carries the commit 17ae789"
    ):
        index.render(tmp_path)
    (tmp_path / "serve_load_token2wav_2_17ae789.json").rename(tmp_path / "serve_load_token2wav_2.json")
    (tmp_path / "plot-058f034b.png").write_bytes(b"")
    with pytest.raises(index.RecordError, match=r"bench/results/plot-058f034b\.png: its name carries the commit 058f034b"):
        index.render(tmp_path)
    (tmp_path / "plot-058f034b.png").unlink()
    assert "### serve_load_token2wav_2.json" in index.render(tmp_path)


def test_two_current_records_of_one_key_are_refused_naming_both(tmp_path):
    index = _index()
    (tmp_path / "serve_load_token2wav_2.json").write_text(json.dumps(_serve_load()))
    # another load point, lane count or arrival shape is another key: both are current
    (tmp_path / "serve_load_token2wav_3.json").write_text(json.dumps(_serve_load(sessions=3)))
    (tmp_path / "serve_load_token2wav_2_lanes2.json").write_text(json.dumps(_serve_load(lanes={"lanes": 2})))
    (tmp_path / "serve_load_token2wav_2_staggered.json").write_text(json.dumps(_serve_load(staggered={"seed": 0})))
    assert index.render(tmp_path).count("\n### serve_load_token2wav_") == 4
    # a run option (here --runs 2) is not: that record is a variant of the first
    (tmp_path / "serve_load_token2wav_2_runs2.json").write_text(json.dumps(_serve_load(runs=[{}, {}])))
    with pytest.raises(
        index.RecordError,
        match=(
            r"bench/results/serve_load_token2wav_2\.json and bench/results/serve_load_token2wav_2_runs2\.json are both "
            r"the current record of benchmark serve_load; on a GPU no; plugin token2wav; sessions 2; lanes 1; "
            r"replicas 1; staggered no; keep the newer one"
        ),
    ):
        index.render(tmp_path)


def test_a_current_record_with_the_name_of_a_history_record_is_refused(tmp_path):
    index = _index()
    (tmp_path / "history").mkdir()
    (tmp_path / "history" / "serve_load_token2wav_2.json").write_text(json.dumps(_serve_load()))
    (tmp_path / "serve_load_token2wav_2.json").write_text(json.dumps(_serve_load()))
    with pytest.raises(
        index.RecordError,
        match=r"bench/results/serve_load_token2wav_2\.json has the name of bench/results/history/serve_load_token2wav_2\.json",
    ):
        index.render(tmp_path)


def test_the_key_of_a_record_is_read_from_its_contents():
    index = _index()
    token2wav = {"benchmark": "token2wav", "device": "NVIDIA H200", "depth": "full", "arms": {"eager": {}, "SRc": {}}}
    assert index.key({**token2wav, "capacity": {"lanes": 8, "rounds": [{"sessions": 24}, {"sessions": 32}]}}) == (
        ("benchmark", "token2wav"),
        ("on a GPU", True),
        ("depth", "full"),
        ("arms", "eager, SRc"),
        ("capacity", "24,32 streams on 8 lane(s)"),
    )
    assert index.key({**token2wav, "arms": {}, "capacity": {"rounds": [{"sessions": 16}]}})[3:] == (
        ("arms", "none"),
        ("capacity", "16 streams on 1 lane(s)"),
    )
    fuzz = {"benchmark": "fuzz", "seeds": 16}
    assert index.key({**fuzz, "device": "cpu (x86_64), torch 2.13.0+cpu"}) == (("benchmark", "fuzz"), ("on a GPU", False))
    assert index.key({**fuzz, "device": "NVIDIA H200, torch 2.11.0+cu130"}) == (("benchmark", "fuzz"), ("on a GPU", True))
    slots = {"benchmark": "moshi_slots", "device": "NVIDIA H200", "config": "full"}
    arms = {"arms": {"eager": {}, "cadence": {}}}
    assert index.key({**slots, "slots": {"80": arms, "82": arms}})[2:] == (
        ("config", "full"),
        ("slots", "80,82"),
        ("arms", "eager, cadence"),
    )
