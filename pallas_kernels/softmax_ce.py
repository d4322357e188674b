"""Softmax cross-entropy of an LM head's logits: the per-row statistics and the logit gradient.

    lse[r] = log Σ_v e^{x[r, v]},   top[r] = argmax_v x[r, v],   d[r, v] = (e^{x[r, v] − lse[r]}
             − [v = target[r]]) · scale[r]

``x`` is one chunk of 16-bit logits [R, V] as the head's product writes them. The statistics
kernel reads it once: each CTA walks 64 rows × a run of 128-column tiles through a TMA pipeline
and keeps, per row, the running maximum m, Σ e^{x − m} (rescaled when m grows) and the first
column holding m. The vocabulary is split over CTAs (R / 64 row tiles alone would not fill the
GPU), so each split writes its own (m, Σ, first column) and :func:`combine` merges the splits.
The gradient kernel reads the logits once more and writes d in the logits' dtype: one 16-bit
read of the logits per kernel (``benchmarks/bench_lm_head.py`` times them against XLA's form).

Column indices travel as f32 (exact below 2^24 columns), targets too. Sums and exponentials are
f32, the exponentials as 2^(x·log2 e) (:func:`pallas_kernels._tiles.ex2_exp`: the ex2
instruction); a NaN logit makes its row's Σ, and so its lse, NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _compat as cp
from pallas_kernels._compat import pl, plgpu
from pallas_kernels._tiles import ex2_exp

__all__ = ["ROWS", "COLS", "check", "splits_for", "ce_stats", "combine", "ce_grad"]

ROWS = 64  # logit rows per CTA
COLS = 128  # columns per tile: 256 bytes of a 16-bit row
MIN_CTAS = 8 * 132  # CTAs to aim for (eight per SM of an H200)
STAGES = 4  # tiles in flight per CTA
MAX_COLUMNS = 1 << 24  # column indices are exact in f32 below this
_LOW = -3.0e38  # the running maximum before any tile: finite, so e^{_LOW − m} is 0, never NaN
f32 = jnp.float32


def check(logits) -> None:
    """NotImplementedError for the logits the kernels do not serve."""
    if logits.ndim != 2 or logits.dtype not in (jnp.bfloat16, jnp.float16):
        raise NotImplementedError(
            f"{logits.shape=} {logits.dtype=}: the kernels take [R, V] bf16/f16 logits"
        )
    R, V = logits.shape
    if R % ROWS or V % COLS or V >= MAX_COLUMNS:
        raise NotImplementedError(
            f"{logits.shape=}: the kernels take R % {ROWS} == 0 and V % {COLS} == 0, V < 2^24"
        )


def splits_for(R: int, V: int) -> tuple[int, int]:
    """``(splits, tiles per split)`` of the V / 128 column tiles: about :data:`MIN_CTAS` CTAs
    over the R / 64 row tiles, every split non-empty (the last may be shorter)."""
    tiles = V // COLS
    want = max(1, min(tiles, pl.cdiv(MIN_CTAS, R // ROWS)))
    per = pl.cdiv(tiles, want)
    return pl.cdiv(tiles, per), per


def _columns(t) -> jax.Array:
    """Column indices of tile ``t`` as an f32 [64, 128] tile (WGMMA layout)."""
    return (cp.iota((ROWS, COLS), 1) + t * COLS).astype(f32)


def _row_layout(value: float) -> jax.Array:
    return plgpu.layout_cast(jnp.full((ROWS,), value, f32), plgpu.Layout.WGMMA.reduce(1))


def ce_stats(logits: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per split of the columns: each row's maximum, Σ e^{x − max}, and first column of it.

    Args:
      logits: [R, V] bf16/f16, R % 64 == 0, V % 128 == 0.
    Returns:
      (m, s, first) each [S, R] f32 (S from :func:`splits_for`); merge with :func:`combine`.
    """
    check(logits)
    R, V = logits.shape
    tiles = V // COLS
    S, per = splits_for(R, V)

    def body(x_g, m_g, s_g, i_g):
        r = lax.axis_index("r")
        first = lax.axis_index("s") * per

        def scoped(out_s):
            def step(idx, x_s, carry):
                m, s, top = carry
                t = first + idx[0]
                v = cp.load_tile(x_s).astype(f32)
                tm = jnp.max(v, axis=1)
                new_m = jnp.maximum(m, tm)
                at_max = v == cp.bcast_rows(tm, v.shape)
                # −(first column of the tile's maximum): a max-reduction of negated columns
                neg_col = jnp.max(jnp.where(at_max, -_columns(t), -jnp.inf), axis=1)
                # tiles past the end (the last split's clamped reads of tile `tiles − 1`) add
                # nothing: their maximum is already m and their sum is weighted by 0
                valid = (t < tiles).astype(f32)
                tile_sum = jnp.sum(ex2_exp(v - cp.bcast_rows(new_m, v.shape)), axis=1)
                s = s * ex2_exp(m - new_m) + valid * tile_sum
                top = jnp.where(tm > m, -neg_col, top)  # ties keep the earlier column
                return new_m, s, top

            spec = cp.block_spec(
                (ROWS, COLS), lambda t: (r, jnp.minimum(first + t, tiles - 1)),
                dtype=logits.dtype, cols=COLS,
            )  # fmt: skip
            init = (_row_layout(_LOW), _row_layout(0.0), _row_layout(0.0))
            pipeline = plgpu.emit_pipeline(
                step, grid=(per,), in_specs=[spec], max_concurrent_steps=STAGES, init_carry=init
            )
            outs = pipeline(x_g)
            rows = pl.ds(r * ROWS, ROWS)
            for j, val in enumerate(outs):
                out_s.at[j][...] = val
            plgpu.commit_smem()
            for j, out_g in enumerate((m_g, s_g, i_g)):
                plgpu.copy_smem_to_gmem(out_s.at[j], out_g.at[lax.axis_index("s"), rows])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scoped, cp.smem((3, ROWS), f32, swizzled=False))

    out = tuple(jax.ShapeDtypeStruct((S, R), f32) for _ in range(3))
    kernel = cp.kernel(body, out_type=out, grid=(R // ROWS, S), grid_names=("r", "s"),
                       name="softmax_ce_stats")  # fmt: skip
    return kernel(logits)


def combine(m: jax.Array, s: jax.Array, first: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(lse [R] f32, argmax [R] int32)`` from the splits' [S, R] statistics (argmax: the first
    column holding the maximum, as ``jnp.argmax``)."""
    M = jnp.max(m, axis=0)
    lse = M + jnp.log(jnp.sum(s * jnp.exp(m - M), axis=0))
    top = jnp.min(jnp.where(m == M, first, jnp.inf), axis=0)
    return lse, top.astype(jnp.int32)


def ce_grad(logits: jax.Array, lse: jax.Array, target: jax.Array, scale: jax.Array) -> jax.Array:
    """d = (softmax − onehot(target)) · scale, row by row.

    Args:
      logits: [R, V] bf16/f16 as for :func:`ce_stats`.
      lse: [R] f32 row log-sum-exp; target: [R] f32 target columns; scale: [R] f32 row weights.
    Returns:
      d [R, V] in logits.dtype.
    """
    check(logits)
    R, V = logits.shape
    tiles = V // COLS
    S, per = splits_for(R, V)
    for name, a in (("lse", lse), ("target", target), ("scale", scale)):
        if a.shape != (R,) or a.dtype != f32:
            raise ValueError(f"{name}: expected [{R}] float32; got {a.shape} {a.dtype}")

    def body(x_g, lse_g, tgt_g, sc_g, d_g):
        r = lax.axis_index("r")
        first = lax.axis_index("s") * per
        rows = pl.ds(r * ROWS, ROWS)

        def scoped(vec_s, out_s, bar):
            for j, g in enumerate((lse_g, tgt_g, sc_g)):
                plgpu.copy_gmem_to_smem(g.at[rows], vec_s.at[j], bar.at[j])
            for j in range(3):
                plgpu.barrier_wait(bar.at[j])
            lse_r, tgt_r, sc_r = (cp.row_vec(vec_s.at[j]) for j in range(3))

            def step(idx, x_s):
                t = jnp.minimum(first + idx[0], tiles - 1)
                v = cp.load_tile(x_s).astype(f32)
                p = ex2_exp(v - cp.bcast_rows(lse_r, v.shape))
                hit = _columns(t) == cp.bcast_rows(tgt_r, v.shape)
                d = (p - jnp.where(hit, 1.0, 0.0)) * cp.bcast_rows(sc_r, v.shape)
                slot = lax.rem(idx[0], 2)
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # tile idx − 2's store read it
                out_s.at[slot][...] = d.astype(out_s.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_s.at[slot], d_g.at[rows, pl.ds(t * COLS, COLS)])

            spec = cp.block_spec(
                (ROWS, COLS), lambda t: (r, jnp.minimum(first + t, tiles - 1)),
                dtype=logits.dtype, cols=COLS,
            )  # fmt: skip
            plgpu.emit_pipeline(step, grid=(per,), in_specs=[spec],
                                max_concurrent_steps=STAGES)(x_g)  # fmt: skip
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(
            scoped,
            cp.smem((3, ROWS), f32, swizzled=False),
            cp.smem((2, ROWS, COLS), logits.dtype),
            plgpu.Barrier(num_barriers=3),
        )

    out = jax.ShapeDtypeStruct((R, V), logits.dtype)
    kernel = cp.kernel(body, out_type=out, grid=(R // ROWS, S), grid_names=("r", "s"),
                       name="softmax_ce_grad")  # fmt: skip
    return kernel(logits, lse, target, scale)
