"""examples/train.py: a short run learns, checkpoints restore bitwise, the text task runs."""

import importlib.util
import json
from pathlib import Path

import jax
import numpy as np
import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train.py"

# A 2-layer model (one GDN, one attention layer), small MQAR batches: compiles in seconds.
TINY = [
    "--layers=2",
    "--attention-interval=2",
    "--hidden=32",
    "--batch-size=8",
    "--num-pairs=4",
    "--num-keys=16",
    "--num-values=16",
    "--eval-batches=1",
    "--no-progress",
]


@pytest.fixture(scope="module")
def train(shared_compiles):
    """examples/train.py's main; runs of one configuration compile its step once."""
    spec = importlib.util.spec_from_file_location("train_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_short_run_loss_decreases(train, tmp_path):
    result = train(TINY + ["--steps=40", "--log-every=5", "--lr=1e-2", f"--out={tmp_path}"])
    losses = [h["loss"] for h in result["history"]]
    assert len(losses) == 8
    assert np.mean(losses[-2:]) < 0.8 * np.mean(losses[:2]), losses
    assert (tmp_path / "train.png").stat().st_size > 0
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert {"loss", "accuracy", "tokens_per_s", "step"} <= set(json.loads(lines[-1]))


@pytest.mark.slow
def test_checkpoint_restore_continues_bitwise(train, tmp_path):
    common = TINY + ["--log-every=2"]
    straight = train(common + ["--steps=6", f"--out={tmp_path / 'straight'}"])
    # Interrupted after 3 steps, then resumed from the checkpoint.
    train(common + ["--steps=6", "--stop-at=3", f"--out={tmp_path / 'split'}"])
    resumed = train(common + ["--steps=6", "--resume", f"--out={tmp_path / 'split'}"])
    a, b = jax.tree.leaves(straight["params"]), jax.tree.leaves(resumed["params"])
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_text_file_task(train, tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    result = train(
        TINY + ["--steps=4", "--log-every=2", "--seq-len=32", f"--text={text}", f"--out={tmp_path}"]
    )
    assert np.isfinite(result["eval"]["loss"])


@pytest.mark.slow
def test_mesh_flag_matches_the_unsharded_run(train, tmp_path):
    """--mesh data=2,fsdp=2,tensor=2 (8 fake CPU devices) trains like one device."""
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (fake CPU) devices")
    common = TINY + ["--steps=4", "--log-every=1", "--attention-interval=4", "--warmup=1"]
    one = train(common + [f"--out={tmp_path / 'one'}"])
    mesh = train(common + ["--mesh=data=2,fsdp=2,tensor=2", f"--out={tmp_path / 'mesh'}"])
    a = [h["loss"] for h in one["history"]]
    b = [h["loss"] for h in mesh["history"]]
    np.testing.assert_allclose(b, a, rtol=1e-5)


@pytest.mark.slow
def test_remat_offload_fp8_flags(train, tmp_path):
    """--remat save --offload all (every named tensor to pinned host; the step compiled with
    gdn_jax.remat.compiler_options) trains bit for bit like --remat save, with native FP8
    projections too (the CPU drops the host copies, the policies and options still apply)."""
    common = TINY + ["--steps=3", "--log-every=1", "--fp8=native", "--remat=save"]
    saved = train(common + [f"--out={tmp_path / 'save'}"])
    offloaded = train(
        common + ["--offload=all", "--offload-fraction=0.5", f"--out={tmp_path / 'offload'}"]
    )
    a = [h["loss"] for h in saved["history"]]
    b = [h["loss"] for h in offloaded["history"]]
    assert len(a) == 3 and a == b, (a, b)
