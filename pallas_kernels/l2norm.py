"""Row L2 normalisation of q and k (``use_qk_l2norm``), forward and backward, in one pass each.

    y = x · r,   r = (Σ_k x_k² + eps)^(−1/2)                                 (per row, f32)
    dx = r · (g − y (y · g)),   g = Σ of the cotangent parts                (per row, f32)

Rows are [64, K] tiles (K = the head dim) in the WGMMA register layout, so the row sums are
register reductions and each tensor is read once (XLA's two fusions, a reduction and then the
scaling, read it twice). A CTA walks consecutive tiles through a two-stage TMA pipeline.

The backward takes the cotangent as f32 parts as the chunked cores' backward kernels write them
(GDN: dk in two parts, from two kernels), each ``[R, G, K]``: G value heads per q/k head (GVA),
summed here, so neither the parts' sum nor the head fold is its own pass.

Non-finite values of x (NaN, ±inf) are read as 0, forward and backward: the kernels apply
:func:`gdn_jax.ops._sanitize.finite` (whose derivative is straight through) as they load x, so
that the op's sanitation of q and k (``gdn_jax.gated_delta_rule``) is no pass of its own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _compat as cp
from pallas_kernels import _tiles
from pallas_kernels._compat import pl, plgpu

__all__ = ["ROWS", "l2norm_fwd", "l2norm_bwd", "tiles_per_cta"]

ROWS = 64
MAX_TILES = 16  # tiles per CTA at most
MIN_CTAS = 2 * 132  # two CTAs per SM of an H200 at least, where the shape allows
f32 = jnp.float32


def tiles_per_cta(rows: int) -> int:
    """Tiles per CTA: the most (≤ 16, halving) that divides the rows' tiles and leaves at least
    :data:`MIN_CTAS` CTAs; 1 where none does."""
    n = rows // ROWS
    per = MAX_TILES
    while per > 1 and (n % per or n // per < MIN_CTAS):
        per //= 2
    return per


def check(x) -> None:
    """NotImplementedError for the inputs the kernels do not serve."""
    if x.ndim != 2 or x.dtype not in (jnp.bfloat16, jnp.float16):
        raise NotImplementedError(f"{x.shape=} {x.dtype=}: the kernels take [R, K] bf16/f16")
    if x.shape[1] not in (64, 128) or x.shape[0] % ROWS:
        raise NotImplementedError(f"{x.shape=}: the kernels take R % 64 == 0 and K in {{64, 128}}")


def _store(v, out_s, out_g, first, t) -> None:
    """Tile ``t`` of the CTA's run (f32 [64, K]) to rows ``(first + t) · 64 …`` of ``out_g``
    through slot t % 2 of ``out_s`` (free once the store of tile t − 2 has read it)."""
    slot = lax.rem(t, 2)
    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
    out_s.at[slot][...] = v.astype(out_s.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_s.at[slot], out_g.at[pl.ds((first + t) * ROWS, ROWS)])


def l2norm_fwd(x: jax.Array, *, eps: float, nan_rows: bool = False) -> jax.Array:
    """y = x / sqrt(Σ x² + eps) per row, non-finite values of x read as 0.

    Args:
      x: [R, K] bf16/f16, R a multiple of 64, K ∈ {64, 128}.
      eps: added to the sum of squares.
      nan_rows: rows of x with a non-finite value come out all NaN instead (GDN's q: its chunk
        loop finds those rows from q kᵀ and gives them the op's NaN).
    Returns:
      y [R, K] in x.dtype.
    """
    check(x)
    R, K = x.shape
    per = tiles_per_cta(R)

    def body(x_g, y_g):
        first = lax.axis_index("i") * per

        def scoped(y_s):
            def step(idx, x_s):
                raw = cp.load_tile(x_s).astype(f32)
                v = _tiles.finite(raw)
                r = lax.rsqrt(jnp.sum(v * v, axis=1) + eps)
                if nan_rows:
                    bad = jnp.max(_tiles.nonfinite(raw), axis=1)
                    r = r + jnp.where(bad > 0, jnp.nan, 0.0)
                _store(v * cp.bcast_rows(r, v.shape), y_s, y_g, first, idx[0])

            spec = cp.block_spec((ROWS, K), lambda t: (first + t, 0), dtype=x.dtype, cols=K)
            plgpu.emit_pipeline(step, grid=(per,), in_specs=[spec], max_concurrent_steps=2)(x_g)
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scoped, cp.smem((2, ROWS, K), x.dtype))

    out = jax.ShapeDtypeStruct((R, K), x.dtype)
    groups = R // ROWS // per
    return cp.kernel(body, out_type=out, grid=(groups,), grid_names=("i",), name="l2norm_fwd")(x)


def l2norm_bwd(x: jax.Array, parts: tuple[jax.Array, ...], *, eps: float) -> jax.Array:
    """The cotangent of x for :func:`l2norm_fwd` (its y is recomputed in f32 from x; non-finite
    values of x read as 0, the derivative of that replacement taken as 1).

    Args:
      x: [R, K] bf16/f16, the forward's input.
      parts: cotangent parts of y, each [R, G, K] f32 (G ≥ 1 value heads per row, summed).
      eps: as for the forward.
    Returns:
      dx [R, K] in x.dtype.
    """
    check(x)
    R, K = x.shape
    G = parts[0].shape[1]
    if any(p.shape != (R, G, K) or p.dtype != f32 for p in parts):
        got = [(p.shape, p.dtype) for p in parts]
        raise ValueError(f"parts must be [{R}, G, {K}] f32; got {got}")
    per = tiles_per_cta(R)

    def body(x_g, *refs):
        part_gs, dx_g = refs[:-1], refs[-1]
        first = lax.axis_index("i") * per

        def scoped(dx_s):
            def step(idx, x_s, *g_tiles):
                v = _tiles.finite(cp.load_tile(x_s).astype(f32))
                g = None
                for t in g_tiles:
                    gt = cp.load_tile(t)
                    g = gt if g is None else g + gt
                r = cp.bcast_rows(lax.rsqrt(jnp.sum(v * v, axis=1) + eps), v.shape)
                y = v * r
                dot = cp.bcast_rows(jnp.sum(y * g, axis=1), v.shape)
                _store(r * (g - y * dot), dx_s, dx_g, first, idx[0])

            xspec = cp.block_spec((ROWS, K), lambda t: (first + t, 0), dtype=x.dtype, cols=K)
            pspecs = [
                cp.block_spec((ROWS, None, K), lambda t, j=j: (first + t, j, 0), dtype=f32, cols=K)
                for _ in parts
                for j in range(G)
            ]
            ins = [g for g in part_gs for _ in range(G)]
            plgpu.emit_pipeline(step, grid=(per,), in_specs=[xspec, *pspecs],
                                max_concurrent_steps=2)(x_g, *ins)  # fmt: skip
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scoped, cp.smem((2, ROWS, K), x.dtype))

    out = jax.ShapeDtypeStruct((R, K), x.dtype)
    groups = R // ROWS // per
    kernel = cp.kernel(body, out_type=out, grid=(groups,), grid_names=("i",), name="l2norm_bwd")
    return kernel(x, *parts)
