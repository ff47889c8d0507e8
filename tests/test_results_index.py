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
