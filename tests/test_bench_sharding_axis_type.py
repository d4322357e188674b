"""benchmarks/bench_sharding.py's ``--axis-type``: the meshes it builds and what each type refuses
(8 fake CPU devices; the tiny hybrid LM with one GDN layer, f32, xla core)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from jax.sharding import AxisType


def _bench_sharding():
    """benchmarks/bench_sharding.py as a module (benchmarks/ is no package)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_sharding.py"
    spec = importlib.util.spec_from_file_location("bench_sharding", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


ARGS = (
    "--preset tiny --layers 1 --seq 16 --batch 2 --devices 2 --iters 0 --train-steps 1 "
    "--dtype float32 --implementation xla --tol 1e-4"
).split()


def test_explicit_axes_match_one_device(monkeypatch):
    """``--axis-type explicit`` runs TP on a mesh whose axes are Explicit and gives the
    one-device loss and gradients; the row says which axis type it was measured on."""
    bench = _bench_sharding()
    meshes = []
    make_mesh = bench.sharding.make_mesh

    def recording(*a, **kw):
        meshes.append(make_mesh(*a, **kw))
        return meshes[-1]

    monkeypatch.setattr(bench.sharding, "make_mesh", recording)
    (row,) = bench.main([*ARGS, "--axis-type", "explicit", "--modes", "tp"])
    assert [m.axis_types for m in meshes] == [(AxisType.Explicit,)]
    assert (row["mode"], row["axis_type"]) == ("tp", "explicit")
    assert row["loss_rel_diff"] < 1e-5 and row["grad_rel_rms"] < 1e-4, row


def test_default_modes_and_refusals(monkeypatch):
    """The meshes each ``--axis-type`` builds for its default modes (steps not run): Auto axes for
    dp, fsdp, tp, cp by default, Explicit ones for dp, fsdp, tp; ``explicit`` with cp is refused
    before any step runs, and an unknown type is an argparse error."""
    bench = _bench_sharding()
    runs = []

    def run(config, args, tokens, mesh):  # records the mesh instead of running the step
        runs.append(None if mesh is None else (tuple(mesh.axis_names), mesh.axis_types))
        return 1.0, [1.0], {"w": np.ones(2)}

    monkeypatch.setattr(bench, "_run", run)
    bench.main(ARGS)
    auto = (AxisType.Auto,)
    assert [r for r in runs if r] == [(("data",), auto), (("fsdp",), auto), (("tensor",), auto),
                                      (("context",), auto)]  # fmt: skip
    runs.clear()
    rows = bench.main([*ARGS, "--axis-type", "explicit"])
    explicit = (AxisType.Explicit,)
    assert [r for r in runs if r] == [(("data",), explicit), (("fsdp",), explicit),
                                      (("tensor",), explicit)]  # fmt: skip
    assert {r["axis_type"] for r in rows} == {"explicit"}
    runs.clear()
    with pytest.raises(ValueError, match=r"--axis-type explicit.*\(cp\) runs on Auto"):
        bench.main([*ARGS, "--axis-type", "explicit", "--modes", "dp,cp"])
    assert runs == []
    with pytest.raises(SystemExit):
        bench.main([*ARGS, "--axis-type", "manual"])
