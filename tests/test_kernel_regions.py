"""benchmarks/kernel_regions.py and ``_compat.profile_regions``: trace parsing, and the profiler
built into the kernels with the regions they name."""

import json
import sys
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import kernel_regions as kreg  # noqa: E402
from benchmarks import profile_ops  # noqa: E402
from pallas_kernels import _compat as pk  # noqa: E402


def ev(name, ph, cycles, tid=1):
    """A Perfetto event as Mosaic GPU's dump writes it: ``ts`` = cycles / 1000 (plus an offset)."""
    return {"name": name, "ph": ph, "ts": 5.0 + cycles / 1e3, "pid": 1, "tid": tid}


def test_region_cycles_averages_over_warpgroups_and_nests():
    events = [
        ev("pass 0", "B", 0), ev("pass 0", "E", 400),
        ev("tail", "B", 400), ev("w", "B", 500), ev("w", "E", 700), ev("tail", "E", 1000),
        ev("pass 0", "B", 0, tid=2), ev("pass 0", "E", 200, tid=2),
        ev("tail", "B", 200, tid=2), ev("tail", "E", 600, tid=2),
    ]  # fmt: skip
    got = kreg.region_cycles(events)
    assert got["warpgroups"] == 2
    assert got["span"] == pytest.approx(800)
    assert got["regions"]["pass 0"] == pytest.approx(300)
    assert got["regions"]["tail"] == pytest.approx(500)
    assert got["regions"]["w"] == pytest.approx(100)  # one warpgroup's 200 over two
    assert got["entries"] == {"pass 0": 1.0, "tail": 1.0, "w": 0.5}
    table = kreg.table({"k": got})
    assert "pass 0" in table and "37.5%" in table  # 300 of 800


def test_region_cycles_counts_a_loop_regions_entries():
    steps = [(("B", 100 * i), ("E", 100 * i + 40)) for i in range(3)]
    events = [ev("step", ph, t) for step in steps for ph, t in step]
    got = kreg.region_cycles(events)
    assert got["regions"]["step"] == pytest.approx(120) and got["entries"]["step"] == 3


def test_region_cycles_refuses_unbalanced_traces():
    with pytest.raises(ValueError, match="without its entry"):
        kreg.region_cycles([ev("a", "E", 10)])
    with pytest.raises(ValueError, match="never left"):
        kreg.region_cycles([ev("a", "B", 0), ev("b", "B", 5), ev("b", "E", 9)])
    with pytest.raises(ValueError, match="without its entry"):
        kreg.region_cycles([ev("a", "B", 0), ev("b", "E", 9)])


def test_read_traces_keeps_the_newest_file_per_kernel(tmp_path):
    old = {"traceEvents": [ev("r", "B", 0), ev("r", "E", 10)]}
    new = {"traceEvents": [ev("r", "B", 0), ev("r", "E", 30)]}
    (tmp_path / "chan_intra_wy-100-trace.json").write_text(json.dumps(old))
    (tmp_path / "chan_intra_wy-200-trace.json").write_text(json.dumps(new))
    (tmp_path / "notes.txt").write_text("ignored")
    got = kreg.read_traces(tmp_path)
    assert list(got) == ["chan_intra_wy"]
    assert got["chan_intra_wy"]["regions"]["r"] == pytest.approx(30)


def test_profile_regions_validates_and_resets():
    with pytest.raises(ValueError, match="events"):
        with pk.profile_regions("/tmp", 0):
            pass
    with pk.profile_regions("/tmp/x", 8):
        assert pk._PROFILE.get() == ("/tmp/x", 8)
    assert pk._PROFILE.get() is None


def interned_regions(monkeypatch, directory, case: str, dtype: str, mode: str) -> set[str]:
    """The region names Mosaic GPU's profiler interns while the ``mode`` pass of ``case``
    (:func:`profile_ops.parse_case`) is lowered for CUDA inside ``profile_regions``. (The
    profiler's trace dump is a host callback, which cannot lower for CUDA on a CPU backend: it
    is stubbed there.)"""
    from jax.experimental.mosaic.gpu import profiler

    names = set()
    intern = profiler.ProfilerSpec.intern_name
    monkeypatch.setattr(
        profiler.ProfilerSpec, "intern_name", lambda self, n: names.add(n) or intern(self, n)
    )
    if jax.default_backend() != "gpu":
        monkeypatch.setattr(jax.debug, "callback", lambda *a, **k: None)
    variant, shape = profile_ops.parse_case(case)
    with pk.profile_regions(str(directory), 64):
        f, args = profile_ops.programs(variant, shape, "pallas", dtype)[mode]
        with pk.cuda_lowering_mesh():
            f.trace(*args).lower(lowering_platforms=("cuda",))
    return names


def test_kernels_lower_with_the_profiler_and_their_regions(monkeypatch, tmp_path):
    """The KDA f16 forward+backward's kernels carry the profiler, which interns the regions the
    intra, backward and chunk loop kernels name."""
    names = interned_regions(monkeypatch, tmp_path, "kda:B1_T256_H2_HV2_D128", "float16", "fwdbwd")
    expected = {"L pass 0", "L pass 1", "inverse", "w", "v finite", "u", "Aqk pass 0", "Aqk pass 1"}
    expected |= {"k pass own", "dL", "dk cols", "dbk rows", "phase 2", "dq intra"}  # backward
    # the chunk loop's per-step regions (its roles run inside a cond in the pipeline's body)
    expected |= {"state: stage S", "state: v_new", "state: update", "output: wait ready"}
    assert expected <= names, sorted(names)


def test_gdn_segment_loops_lower_with_their_regions(monkeypatch, tmp_path):
    """GDN at B1 T8192 (the split loop's segment pass and chunk loop) interns the per-step
    regions of both loops."""
    names = interned_regions(monkeypatch, tmp_path, "gdn:B1_T8192_H2_HV2_D128", "bfloat16", "fwd")
    expected = {"map: stage S", "map: v_new", "map: update", "state: stage S", "state: update"}
    assert expected <= names, sorted(names)
