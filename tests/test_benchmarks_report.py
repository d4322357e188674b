"""benchmarks/report.py regenerates benchmarks/RESULTS.md from the checked-in results."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _report():
    spec = importlib.util.spec_from_file_location("report", ROOT / "benchmarks" / "report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_report_regenerates_results_md(tmp_path):
    """The page is at most 200 lines, has every topic's table with its runs, and equals the
    checked-in RESULTS.md (which must be regenerated when results change)."""
    report = _report()
    out = tmp_path / "RESULTS.md"
    assert report.main(["--out", str(out), "--no-plots"]) == 0
    text = out.read_text()
    assert text.count("\n") <= 200
    for title in ("Chunked ops vs FLA", "Decode step", "Model train step", "Sharded training"):
        assert f"## {title}" in text
    assert text == (ROOT / "benchmarks" / "RESULTS.md").read_text()


def test_merge_takes_each_field_from_the_newest_run(tmp_path):
    """Rows with the same key merge; a field missing (null) in the newer run keeps the older
    value, and the row names both runs."""
    report = _report()

    def run(name, date, rows):
        doc = dict(topic="decode", device="GPU", date=date, commit=None, command="c", rows=rows)
        (tmp_path / name).write_text(json.dumps(doc))

    key = dict(variant="gdn", B=64, H=16, HV=16, K=128, V=128)
    run("new.json", "2026-02-01", [key | dict(pallas_ms=1.0, fla_ms=None)])
    run("old.json", "2026-01-01", [key | dict(pallas_ms=2.0, fla_ms=3.0)])
    (row,) = report.merge("decode", report.load(tmp_path)["decode"])
    assert (row["pallas_ms"], row["fla_ms"], row["runs"]) == (1.0, 3.0, ["a", "b"])
