"""The training examples on JAX's multi-controller runtime: 2 CPU processes × 4 devices on
localhost.

examples/train.py: the 2-process run (DP × TP on a data=4 × tensor=2 mesh, each process feeding
its own rows of the global batch, gloo collectives) gives the losses of one process with 8
devices, and the Orbax checkpoint it writes restores into a one-process run, which then
continues exactly like an uninterrupted one-process run. examples/finetune_hf.py: 2 processes
fine-tune a random HF checkpoint with the losses of one process with 8 devices.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train.py"
FINETUNE = ROOT / "examples" / "finetune_hf.py"
# One GDN layer, tiny MQAR batches, no held-out eval: the runs are dominated by compiling one step.
ARGS = [
    "--layers=1", "--attention-interval=0", "--hidden=32", "--batch-size=8", "--num-pairs=4",
    "--num-keys=16", "--num-values=16", "--eval-batches=0", "--no-progress", "--log-every=1",
    "--warmup=1", "--steps=4", "--mesh=data=4,tensor=2",
]  # fmt: skip
pytestmark = [
    pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake CPU) devices"),
    pytest.mark.slow,
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _main(path: Path, name: str):
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.fixture(scope="module")
def train(shared_compiles):
    """examples/train.py's main; the resumed run reuses the straight run's compiled step."""
    return _main(EXAMPLE, "train_example_mh")


def _spawn(script: Path, args: list[str], process_id: int | None = None, port: int = 0):
    """Start ``script args`` on 4 CPU devices as process ``process_id`` of 2 on localhost, or
    (``process_id=None``) alone on 8 CPU devices."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    # Each process splits its CPU with --cpu-devices; the 8 fake devices of this test process
    # (XLA_FLAGS from conftest) must not leak into them. Compile fast: the programs are tiny.
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    if process_id is None:
        runtime = ["--cpu-devices=8"]
    else:
        runtime = ["--cpu-devices=4", f"--coordinator=localhost:{port}", "--num-processes=2",
                   f"--process-id={process_id}"]  # fmt: skip
    return subprocess.Popen(
        [sys.executable, str(script), *args, *runtime], env=env, cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def _wait(procs) -> list[str]:
    """The logs of ``procs`` once all exited (each must succeed)."""
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    return logs


def _two_processes(script: Path, args: list[str]) -> list[str]:
    """Run ``script args`` as 2 processes × 4 CPU devices on localhost; their logs."""
    port = _free_port()
    return _wait([_spawn(script, args, i, port) for i in range(2)])


def test_two_processes_match_one_and_checkpoint_restores(train, tmp_path):
    two = tmp_path / "two"
    logs = _two_processes(EXAMPLE, [*ARGS, "--stop-at=2", f"--out={two}"])
    assert "process 0 of 2" in logs[0] and "done: 2 steps" in logs[0]
    assert "done:" not in logs[1]  # only process 0 logs, writes metrics and plots
    assert (two / "train.png").exists()

    # One process with 8 devices, the same mesh, straight through 4 steps.
    one = train(ARGS + [f"--out={tmp_path / 'one'}"])
    want = [h["loss"] for h in one["history"]]
    np.testing.assert_allclose(_losses(two), want[:2], rtol=1e-5)

    # The 2-process checkpoint (step 2) restores into one process, which continues like `one`.
    resumed = tmp_path / "resumed"
    shutil.copytree(two, resumed)
    result = train(ARGS + ["--resume", f"--out={resumed}"])
    np.testing.assert_allclose([h["loss"] for h in result["history"]], want, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(result["params"]), jax.tree.leaves(one["params"]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_finetune_two_processes_match_one(tmp_path):
    # A 2-layer random checkpoint (GDN + attention; the same from the same seed), 2 steps of
    # DP × TP; the one-process run with 8 devices runs alongside.
    args = [
        "--random-layers=2", "--seq-len=16", "--batch-size=8", "--steps=2", "--log-every=1",
        "--warmup=1", "--lr=1e-3", "--no-progress", "--mesh=data=4,tensor=2",
    ]  # fmt: skip
    two, one = tmp_path / "two", tmp_path / "one"
    port = _free_port()
    procs = [_spawn(FINETUNE, [*args, f"--out={two}"], i, port) for i in range(2)]
    procs.append(_spawn(FINETUNE, [*args, f"--out={one}"]))
    logs = _wait(procs)
    assert "process 0 of 2" in logs[0] and "done:" in logs[0] and "done:" not in logs[1]
    assert (two / "hf" / "model.safetensors").is_file() and any((two / "checkpoints").iterdir())
    want = _losses(one)
    assert len(want) == 2 and want[0] != want[1]
    np.testing.assert_allclose(_losses(two), want, rtol=1e-5)
