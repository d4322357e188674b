"""Times the short convolution of GDN layers (``gdn_jax.ops.short_conv``, SiLU, 4 taps): pallas vs
xla, forward and forward+backward, in one run.

    PYTHONPATH=. python3 benchmarks/bench_short_conv.py [--json PATH|auto|none]

Shapes: the q/k conv of ``qwen3_5_0_8b`` (2048 channels) at B4 T4096 and, packed as two
sequences, B1 T32768. Timing as in ``bench_gdn.py`` (:func:`benchmarks.bench_gdn.time_jax`: batches
of back-to-back calls, median); fwd+bwd is ``vjp`` of the conv with a fixed cotangent, giving the
gradients of x and of the taps. Floor: the bytes each pass must move (x read, y written; fwd+bwd
adds x and dy read, dx written) at 4.07 TB/s.

Results: rows ``variant="short_conv", shape, mode, dtype, pallas_ms, xla_ms, floor_ms`` of the
``ops`` file of :mod:`benchmarks.results` (``benchmarks/results/ops_<device>.json`` on a GPU).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
import gdn_jax  # noqa: E402
from benchmarks.bench_gdn import COPY_BW, pallas_vs_xla_main, time_jax  # noqa: E402

# name -> (B, T, C, packed)
SHAPES = {
    "B4_T4096_C2048": (4, 4096, 2048, False),
    "B1_T32768_C2048_P": (1, 32768, 2048, True),
}


def _fns(impl: str, cu_seqlens):
    conv = lambda x, w: gdn_jax.ops.short_conv(x, w, cu_seqlens=cu_seqlens, implementation=impl)

    def fwdbwd(x, w, dy):
        y, vjp = jax.vjp(conv, x, w)
        return y, *vjp(dy)

    return jax.jit(conv), jax.jit(fwdbwd)


def bench(name: str, iters: int) -> list[dict]:
    B, T, C, packed = SHAPES[name]
    kx, kw, ky = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (B, T, C), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.uniform(kw, (4, C), jnp.float32, -0.5, 0.5)
    dy = jax.random.normal(ky, (B, T, C), jnp.float32).astype(jnp.bfloat16)
    cu = jnp.asarray([0, T // 2 + 17, T], jnp.int32) if packed else None
    times = {}
    for impl in ("pallas", "xla"):
        fwd, fwdbwd = _fns(impl, cu)
        times[impl, "fwd"] = time_jax(fwd, (x, w), iters=iters)
        times[impl, "fwdbwd"] = time_jax(fwdbwd, (x, w, dy), iters=iters)
    nbytes = x.size * x.dtype.itemsize
    floors = {"fwd": 2 * nbytes, "fwdbwd": 5 * nbytes}
    return [
        dict(
            variant="short_conv",
            shape=name,
            mode=mode,
            dtype="bfloat16",
            pallas_ms=times["pallas", mode],
            xla_ms=times["xla", mode],
            fla_ms=None,
            floor_ms=1e3 * floors[mode] / COPY_BW,
        )
        for mode in ("fwd", "fwdbwd")
    ]


def main(argv=None) -> int:
    return pallas_vs_xla_main(__doc__, SHAPES, bench, argv, iters=20)


if __name__ == "__main__":
    sys.exit(main())
