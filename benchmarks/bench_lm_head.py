"""Times the LM head's chunked cross-entropy (``HybridLM.loss``'s plain-head path): its statistics
and logit gradient on the Pallas kernels vs on XLA, in one run.

    PYTHONPATH=. python3 benchmarks/bench_lm_head.py [--json PATH|auto|none]

Shape: ``qwen3_5_0_8b``'s tied head (hidden 1024, vocabulary 248 320, the [V, D] table) at B4
T4096 in bf16 chunks of 512 positions (2048 rows), as the train step runs it. ``fwd`` is the loss
alone; ``fwdbwd`` is ``grad`` of the loss for the hidden states and the table (the gradients are
formed in the forward pass). Both include the head's products (three [2048, 1024] × [1024, V] per
chunk with gradients). Timing as in ``bench_gdn.py`` (:func:`benchmarks.bench_gdn.time_jax`).
Floor: the bytes the statistics and the gradient must move (the 16-bit logits written by the
product and read once per pass; fwdbwd adds the gradient written) at 4.07 TB/s, plus the products
at 989 TFLOP/s.

Results: rows ``variant="lm_head", shape, mode, dtype, pallas_ms, xla_ms, floor_ms`` of the
``ops`` file of :mod:`benchmarks.results` (``benchmarks/results/ops_<device>.json`` on a GPU).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
from benchmarks.bench_gdn import COPY_BW, pallas_vs_xla_main, time_jax  # noqa: E402
from gdn_jax.models import _lm_head  # noqa: E402

PEAK = 989e12
# name -> (B, T, D, V, chunk)
SHAPES = {"B4_T4096_D1024_V248320": (4, 4096, 1024, 248320, 512)}


def bench(name: str, iters: int) -> list[dict]:
    B, T, D, V, chunk = SHAPES[name]
    kx, kw, kt = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (B, T, D), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (V, D), jnp.float32) / 32).astype(jnp.bfloat16)
    targets = jax.random.randint(kt, (B, T), 0, V)
    mask = jnp.ones((B, T), jnp.float32)
    times = {}
    for impl in ("pallas", "xla"):
        loss = lambda x, w, impl=impl: _lm_head.head_cross_entropy(
            x, w, targets, mask, chunk, True, impl
        )[0]
        times[impl, "fwd"] = time_jax(jax.jit(loss), (x, w), iters=iters)
        times[impl, "fwdbwd"] = time_jax(jax.jit(jax.grad(loss, (0, 1))), (x, w), iters=iters)
    logits = B * T * V * 2
    flops = 2 * B * T * D * V
    floors = {
        "fwd": 2 * logits / COPY_BW + flops / PEAK,
        "fwdbwd": 4 * logits / COPY_BW + 3 * flops / PEAK,
    }
    return [
        dict(
            variant="lm_head",
            shape=name,
            mode=mode,
            dtype="bfloat16",
            pallas_ms=times["pallas", mode],
            xla_ms=times["xla", mode],
            fla_ms=None,
            floor_ms=1e3 * floors[mode],
        )
        for mode in ("fwd", "fwdbwd")
    ]


def main(argv=None) -> int:
    return pallas_vs_xla_main(__doc__, SHAPES, bench, argv, iters=10)


if __name__ == "__main__":
    sys.exit(main())
