"""examples/finetune_hf.py and examples/generate.py run end to end on a random checkpoint."""

import importlib.util
import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from gdn_jax.convert import load_hf_model

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _main(name):
    sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(f"{name}_example", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_finetune_then_generate(tmp_path):
    # Two layers (GDN + attention), FP8 projections, QAT and offloaded GDN residuals at once.
    out = tmp_path / "ft"
    small = ["--random-layers=2", "--seq-len=16", "--batch-size=2", "--no-progress"]
    flags = ["--fp8=native", "--qat", "--offload", "--steps=2", "--log-every=1"]
    result = _main("finetune_hf")(small + flags + [f"--out={out}"])
    assert len(result["history"]) == 2 and np.isfinite(result["history"][-1]["loss"])
    assert (out / "finetune.png").stat().st_size > 0
    assert (out / "qat_policy.json").is_file() and any((out / "checkpoints").iterdir())
    # The HF output holds the trained parameters, bitwise, and differs from the start.
    tuned = load_hf_model(result["hf_dir"])
    start = load_hf_model(out / "random-checkpoint")
    got = jax.tree.leaves(nnx.state(tuned, nnx.Param))
    want = jax.tree.leaves(result["params"])
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    assert not all(
        np.array_equal(a, b)
        for a, b in zip(got, jax.tree.leaves(nnx.state(start, nnx.Param)), strict=True)
    )
    gen = _main("generate")([f"--model={result['hf_dir']}", "--prompt=ab", "--max-new-tokens=3"])
    assert gen["prompt_ids"] == [97, 98] and 1 <= len(gen["new_ids"]) <= 3
