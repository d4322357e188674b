"""benchmarks/report.py regenerates benchmarks/RESULTS.md from the checked-in results."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _report():
    spec = importlib.util.spec_from_file_location("report", ROOT / "benchmarks" / "report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_report_regenerates_results_md(tmp_path):
    """The page is at most MAX_LINES long, has every topic's table with its runs, and equals the
    checked-in RESULTS.md (which must be regenerated when results change)."""
    report = _report()
    out, readme = tmp_path / "RESULTS.md", tmp_path / "README.md"
    readme.write_text((ROOT / "README.md").read_text())
    assert report.main(["--out", str(out), "--readme", str(readme), "--no-plots"]) == 0
    text = out.read_text()
    assert text.count("\n") <= report.MAX_LINES
    for title in ("Chunked ops vs FLA", "Decode step", "Model train step", "Sharded training"):
        assert f"## {title}" in text
    assert text == (ROOT / "benchmarks" / "RESULTS.md").read_text()
    # README's op rows are the generated ones (regenerated with RESULTS.md)
    assert readme.read_text() == (ROOT / "README.md").read_text()


def test_readme_op_rows_come_from_the_h200_results():
    """README's op rows: one per (variant, shape, mode) of README_OPS with ours, FLA's time of
    the same row and their ratio; a missing row or missing markers raise."""
    report = _report()
    docs = report.load()
    table = report.readme_ops_table(docs)
    assert len(table) == 2 + 2 * len(report.README_OPS)
    (h200,) = [d for d in docs["ops"] if "H200" in d["device"]]
    row = next(r for r in h200["rows"] if (r["variant"], r["shape"], r["mode"], r["dtype"])
               == ("kda", "B4_T4096_H16_HV16_D128", "fwdbwd", "bfloat16"))  # fmt: skip
    want = f"| KDA fwd+bwd | B4 T4096 H16 | {row['pallas_ms']:.3f} ms | {row['fla_ms']:.3f} ms | "
    assert any(line.startswith(want) for line in table), table
    text = f"a\n{report.README_BEGIN}\nstale\n{report.README_END}\nb\n"
    new = report.update_readme(text, docs)
    assert (
        "stale" not in new and new.startswith("a\n") and new.endswith(f"{report.README_END}\nb\n")
    )
    with pytest.raises(ValueError, match="block"):
        report.update_readme("no markers", docs)
    h200["rows"] = [r for r in h200["rows"] if r is not row]
    with pytest.raises(ValueError, match="kda B4_T4096_H16_HV16_D128 fwdbwd"):
        report.readme_ops_table(docs)


def _results():
    import sys

    sys.path.insert(0, str(ROOT))
    from benchmarks import results

    return results


def test_add_run_replaces_rows_by_key_and_appends_the_run():
    """A run's row replaces the row with its key whole (fields it did not measure become null,
    the old per-field sources go); other rows keep their run; the run is appended and the
    top-level fields become its; the same run written again (same date and command) is one."""
    results = _results()
    key = dict(variant="gdn", B=64, H=16, HV=16, K=128, V=128)
    other = key | dict(B=256)

    def run(date, command="c"):
        return dict(date=date, commit="abc", command=command, note=None, versions={"jax": "1"})

    doc = {
        "topic": "decode", "device": "GPU", **run("d0"), "runs": [run("d0")],
        "rows": [key | dict(pallas_ms=2.0, fla_ms=3.0, run=0, runs={"fla_ms": 0}),
                 other | dict(pallas_ms=5.0, run=0)],
    }  # fmt: skip
    new = results.add_run(doc, "decode", "GPU", run("d1"), [key | dict(pallas_ms=1.0, fla_ms=None)])
    assert new["rows"] == [key | dict(pallas_ms=1.0, fla_ms=None, run=1), doc["rows"][1]]
    assert [r["date"] for r in new["runs"]] == ["d0", "d1"] and new["date"] == "d1"
    again = results.add_run(new, "decode", "GPU", run("d1"), [other | dict(pallas_ms=4.0)])
    assert len(again["runs"]) == 2 and again["rows"][1] == other | dict(pallas_ms=4.0, run=1)
    third = results.add_run(again, "decode", "GPU", run("d1", "c2"), [])
    assert len(third["runs"]) == 3 and third["command"] == "c2" and third["rows"] == again["rows"]
    with pytest.raises(ValueError, match="device"):
        results.add_run(doc, "decode", "other GPU", run("d1"), [])
    with pytest.raises(ValueError, match="topic"):
        results.add_run(None, "no such topic", "GPU", run("d1"), [])


def test_report_names_each_fields_run(tmp_path):
    """A row's runs column lists its run and the runs of its per-field sources; the run list
    under the table has exactly those runs."""
    report = _report()

    def run(date):
        return dict(date=date, commit=None, command=f"cmd {date}", note=None, versions={})

    key = dict(variant="gdn", B=64, H=16, HV=16, K=128, V=128, floor_ms=1.0)
    doc = {
        "topic": "decode", "device": "GPU", **run("d2"),
        "runs": [run(d) for d in ("d0", "d1", "d2")],
        "rows": [key | dict(pallas_ms=1.0, fla_ms=3.0, run=2, runs={"fla_ms": 0})],
    }  # fmt: skip
    (tmp_path / "decode_gpu.json").write_text(json.dumps(doc))
    text = report.render(report.load(tmp_path))
    assert "| a, c |" in text and "`cmd d0`" in text and "`cmd d2`" in text
    assert "cmd d1" not in text
    # a second device: its own section after the primary's, its heading naming the device
    other = doc | {"device": "other"}
    (tmp_path / "decode_other.json").write_text(json.dumps(other))
    docs = report.load(tmp_path)
    assert [d["device"] for d in docs["decode"]] == ["GPU", "other"]
    assert report.primary(docs, "decode")["device"] == "GPU"
    text = report.render(docs)
    assert text.index("## Decode step") < text.index("bandwidth floor (other)")
    (tmp_path / "decode_same.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="two files for topic 'decode' on other"):
        report.load(tmp_path)


def test_write_updates_the_file_in_place(tmp_path):
    """results.write adds each run to the file it is given; nothing is written without rows."""
    results = _results()
    path = tmp_path / "decode_cpu.json"
    key = dict(variant="gdn", B=64, H=16, HV=16, K=128, V=128)
    results.write(path, "decode", [], date="d0")
    assert not path.exists()
    results.write(path, "decode", [key | dict(pallas_ms=2.0)], date="d0")
    results.write(path, "decode", [key | dict(pallas_ms=1.0)], date="d1", note="n")
    doc = json.loads(path.read_text())
    assert [r["date"] for r in doc["runs"]] == ["d0", "d1"]
    assert (doc["date"], doc["note"]) == ("d1", "n")
    assert doc["rows"] == [key | dict(pallas_ms=1.0, run=1)]
    assert set(doc) >= {"device", "date", "commit", "command", "versions", "rows", "runs"}


def test_report_renders_vs_torch_rows_and_profiles(tmp_path):
    """A bench_vs_torch row shows tokens/s, MFU and each torch time with ours / theirs; a
    profile file renders one row of model parts (with the step's device time) and one of its
    heaviest ops per profiled step."""
    report = _report()

    def run(date):
        return dict(date=date, commit=None, command=f"cmd {date}", note=None, versions={})

    row = dict(preset="qwen3_5_0_8b", layers=24, batch=4, seq=4096, setting="bf16+none",
               gpu=None, step_ms=100.0, tokens_s=163840.0, mfu=0.4125, peak_gib=30.0,
               torch_eager_ms=250.0, torch_compile_ms=None, run=0)  # fmt: skip
    model = {"topic": "model", "device": "GPU", **run("d0"), "runs": [run("d0")], "rows": [row]}
    case = dict(preset="tiny", layers=4, batch=2, seq=64, setting="bf16+none", run=0)
    prof_rows = [
        case | dict(what="total", rank=0, name="all device time", category=None, ms=9.0,
                    share=1.0, count=40, source=None),
        case | dict(what="op", rank=1, name="fusion.7", category="gemm", ms=6.0,
                    share=2 / 3, count=2, source="transpose(jvp())/dot_general"),
        case | dict(what="category", rank=1, name="gemm", category="gemm", ms=6.0,
                    share=2 / 3, count=2, source=None),
        case | dict(what="scope", rank=1, name="mlp bwd", category=None, ms=6.0,
                    share=2 / 3, count=2, source=None),
        case | dict(what="scope", rank=2, name="other", category=None, ms=3.0,
                    share=1 / 3, count=38, source=None),
    ]  # fmt: skip
    profile = {"topic": "profile", "device": "GPU", **run("d1"), "runs": [run("d1")],
               "rows": prof_rows}  # fmt: skip
    (tmp_path / "model_gpu.json").write_text(json.dumps(model))
    (tmp_path / "profile_gpu.json").write_text(json.dumps(profile))
    text = report.render(report.load(tmp_path))
    line = next(x for x in text.splitlines() if x.startswith("| qwen3_5_0_8b | 24 | B4 T4096"))
    cells = [c.strip() for c in line.split("|")[1:-1]]
    assert cells[5:9] == ["100.00", "163.8 k", "41.2%", "30.00"]
    assert cells[11:13] == ["250.00 (0.40)", "—"]
    assert "## Train step profile" in text
    assert (
        "| tiny B2 T64 bf16+none | model parts | 9.00 | `mlp bwd` 6.00 (67%), `other` 3.00 (33%) |"
        in text
    )
    assert (
        "| tiny B2 T64 bf16+none | top 1 ops |  | `fusion.7` 6.00 (gemm; "
        "transpose(jvp())/dot_general) |" in text
    )


def test_long_context_plot_groups_batch_one_rows(tmp_path):
    """ms vs T: GDN bf16 dense batch-1 rows by (value heads, mode), sorted by T; packed, other
    variants and single-length groups are left out; the plot is written only when a group has
    two lengths, and the ops section links it then."""
    report = _report()

    def row(shape, mode="fwd", variant="gdn", dtype="bfloat16", ms=1.0):
        return {"variant": variant, "shape": shape, "mode": mode, "dtype": dtype,
                "pallas_ms": ms, "fla_ms": 2 * ms, "xla_ms": None, "run": 0}  # fmt: skip

    rows = [row("B1_T16384_H16_HV16_D128", ms=2.0), row("B1_T8192_H16_HV16_D128"),
            row("B1_T8192_H8_HV8_D128"), row("B1_T8192_H16_HV16_D128_P4096+4096"),
            row("B1_T8192_H16_HV16_D128", variant="kda"),
            row("B1_T16384_H16_HV16_D128", dtype="float16"),
            row("B4_T4096_H16_HV16_D128")]  # fmt: skip
    run = {"date": "2026-12-01", "commit": "abc1234", "command": "bench_gdn.py"}
    doc = {"device": "NVIDIA H200", "runs": [run], "rows": rows}
    groups = report.long_context_rows(doc)
    assert list(groups) == [(16, "fwd")]
    assert [(t, r["pallas_ms"]) for t, r in groups[(16, "fwd")]] == [(8192, 1.0), (16384, 2.0)]
    assert report.plot_long_context(doc, tmp_path / "t.png") and (tmp_path / "t.png").stat().st_size
    assert "ops_vs_T.png" in "\n".join(report.ops_section(doc))
    bars = [(r["variant"], r["shape"], r["dtype"]) for r in report.bar_rows(doc)]
    assert bars == [("gdn", "B1_T8192_H16_HV16_D128_P4096+4096", "bfloat16"),
                    ("gdn", "B1_T8192_H8_HV8_D128", "bfloat16"),
                    ("gdn", "B4_T4096_H16_HV16_D128", "bfloat16"),
                    ("kda", "B1_T8192_H16_HV16_D128", "bfloat16")]  # fmt: skip
    one = {**doc, "rows": rows[1:]}
    assert not report.plot_long_context(one, tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()
    assert "ops_vs_T.png" not in "\n".join(report.ops_section(one))


def test_stage_rows_of_both_impls_are_kept_and_rendered():
    """--stages rows of ours and FLA's (keyed with their impl) replace only their own key, and
    render as one row per (shape, impl, pass), heaviest kernels first, FLA's passes summed."""
    results, report = _results(), _report()
    run = dict(date="d0", commit="abc", command="bench_gdn.py --stages", note=None, versions={})
    base = dict(variant="kda", shape="B4_T4096_H16_HV16_D128", dtype="bfloat16")
    stages = [
        base | dict(impl="pallas", kernel="chan_intra", ms=1.4),
        base | dict(impl="pallas", kernel="chan_bwd_wy", ms=2.0),
        base | dict(impl="fla", kernel="fwd: chunk_kda_fwd_kernel_intra", ms=0.3),
        base | dict(impl="fla", kernel="fwd: chunk_gated_delta_rule_fwd_kernel_h", ms=0.5),
        base | dict(impl="fla", kernel="fwdbwd: chunk_kda_bwd_kernel_wy", ms=0.7),
    ]
    doc = results.add_run(None, "ops", "GPU", run, [], stages)
    again = results.add_run(doc, "ops", "GPU", run | dict(date="d1"), [], stages[:1])
    assert len(again["stages"]) == 5 and again["stages"][0]["run"] == 1
    assert {r["run"] for r in again["stages"][1:]} == {0}
    text = "\n".join(report.stages_section(again["stages"], again))
    rows = [ln for ln in text.splitlines() if ln.startswith("| kda")]
    assert len(rows) == 3  # pallas kernels, FLA fwd, FLA fwdbwd
    fla_fwd = next(r for r in rows if "| fla | fwd |" in r)
    assert "| 0.800 |" in fla_fwd  # the pass's sum
    assert fla_fwd.index("fwd_kernel_h") < fla_fwd.index("fwd_kernel_intra")  # heaviest first
    ours = next(r for r in rows if "| pallas | kernels |" in r)
    assert "| — |" in ours and ours.index("chan_bwd_wy") < ours.index("chan_intra")
    assert report.stages_section([], doc) == []


def test_forced_segment_rows_have_their_own_key_and_table():
    """--segments times become rows keyed by their count: they replace only their own key, stay
    out of the op table and the plots, and render in the segment-count table against the
    fastest count of their shape and mode."""
    import sys

    sys.path.insert(0, str(ROOT))
    from benchmarks.bench_gdn import ops_rows

    results, report = _results(), _report()
    run = dict(date="d0", commit="abc", command="bench_gdn.py --segments 4 8", note=None,
               versions={})  # fmt: skip
    measured = {
        "variant": "gdn", "shape": "B1_T32768_H16_HV16_D128", "dtype": "bfloat16",
        "pallas_segments": 8, "pallas": {"fwd_ms": 1.2, "fwdbwd_ms": 4.2},
        "fla": {"fwd_ms": 1.6, "fwdbwd_ms": 5.9},
        "pallas_by_segments": {"4": {"fwd_ms": 1.0, "fwdbwd_ms": 3.9},
                               "8": {"fwd_ms": 1.2, "fwdbwd_ms": 4.3}},
    }  # fmt: skip
    rows = ops_rows(measured)
    assert len(rows) == 6 and sorted(r.get("segments") or 0 for r in rows) == [0, 0, 4, 4, 8, 8]
    doc = results.add_run(None, "ops", "GPU", run, rows)
    again = results.add_run(doc, "ops", "GPU", run | dict(date="d1"), rows[1:2])
    assert len(again["rows"]) == 6 and rows[1]["segments"] == 4
    assert [r["run"] for r in again["rows"] if r.get("segments") == 4] == [1, 0]
    assert [r.get("segments") for r in report.op_rows(again)] == [None, None]
    text = "\n".join(report.ops_section(again))
    seg = [ln for ln in text.split("### Segment counts")[1].splitlines() if ln.startswith("| gdn")]
    assert len(seg) == 2
    assert "| fwd | 4 | S4 1.000 (1.00), S8 1.200 (1.20) | 8 |" in seg[0]
    assert "| fwdbwd | 4 | S4 3.900 (1.00), S8 4.300 (1.10) | 8 |" in seg[1]
    assert text.split("### Segment counts")[0].count("| gdn |") == 2  # the op's own rows
    # a forward-only run gives no fwdbwd rows, so it leaves those of an earlier run in place
    fwd_only = {k: v for k, v in measured.items() if k not in ("pallas", "fla")}
    fwd_only["pallas"] = {"fwd_ms": 1.1}
    fwd_only["pallas_by_segments"] = {"4": {"fwd_ms": 0.9}, "8": {"error": "ValueError: x"}}
    rows = ops_rows(fwd_only)
    assert [(r["mode"], r.get("segments")) for r in rows] == [("fwd", None), ("fwd", 4), ("fwd", 8)]
    later = results.add_run(again, "ops", "GPU", run | dict(date="d2"), rows)
    kept = [r for r in later["rows"] if r["mode"] == "fwdbwd"]
    assert len(kept) == 3 and all(r["pallas_ms"] is not None for r in kept)


def test_kernel_times_keeps_device_kernels_only():
    import sys
    from types import SimpleNamespace as E

    sys.path.insert(0, str(ROOT))
    from benchmarks.bench_gdn import kernel_times

    events = [
        E(key="aten::mm", device_type="DeviceType.CPU", self_device_time_total=40.0),
        E(key="k_a", device_type="DeviceType.CUDA", self_device_time_total=300.0),
        E(key="k_b", device_type="DeviceType.CUDA", self_device_time_total=900.0),
        E(key="k_idle", device_type="DeviceType.CUDA", self_device_time_total=0.0),
    ]
    assert kernel_times(events, iters=3) == {"k_b": 0.3, "k_a": 0.1}
    assert list(kernel_times(events, iters=3)) == ["k_b", "k_a"]


def test_output_path_refuses_another_devices_file_before_timing(tmp_path):
    """--json naming an existing file of another device or topic fails at once; a new path, this
    device's file and "none" pass."""
    import jax

    results = _results()
    kind = jax.devices()[0].device_kind
    other = tmp_path / "ops_h200.json"
    other.write_text(json.dumps({"topic": "ops", "device": "NVIDIA H200", "runs": [], "rows": []}))
    with pytest.raises(ValueError, match="NVIDIA H200"):
        results.output_path(str(other), "ops")
    mine = tmp_path / "ops_here.json"
    mine.write_text(json.dumps({"topic": "ops", "device": kind, "runs": [], "rows": []}))
    assert results.output_path(str(mine), "ops") == mine
    with pytest.raises(ValueError, match="topic 'ops'"):
        results.output_path(str(mine), "decode")
    assert results.output_path(str(tmp_path / "new.json"), "ops") == tmp_path / "new.json"
    assert results.output_path("none", "ops") is None


def test_default_path_names_the_device_model():
    """Each device kind's file is named by its model, so a run with the default path updates the
    checked-in file of its device (``ops_h100.json`` for the H100's long device kind)."""
    results = _results()
    assert results.default_path("ops", "NVIDIA H200").name == "ops_h200.json"
    assert results.default_path("kernels", "NVIDIA H100 80GB HBM3").name == "kernels_h100.json"
    assert results.default_path("ops", "").name == "ops_device.json"
