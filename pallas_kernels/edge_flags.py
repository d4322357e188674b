"""Where the chunked ops' inputs hold non-finite values: the flags of :mod:`gdn_jax.ops._sanitize`
in one read of each input.

Two kernels over a tensor viewed as a matrix ``[R, C]`` (``[B, T, heads, D]`` with its rows
``B·T`` and columns ``heads·D``, a free reshape), cut into tiles of 64 rows × D columns (one head
of one 64-token block):

- :func:`row_flags`: per row and head, whether any of its D values is bad (a row reduction of the
  tile in registers). The op's per-token flags of q, k and the per-channel gates.
- :func:`col_first`: per 64-row block and column, the first row of the block holding a bad value
  (64 where none does). The op's first bad token per value column (v, GDN2's w). The column
  reduction is a product: with ``bad`` the tile's [64, D] 0/1 flags and ``U[r, s] = (r ≤ s)``,
  ``E = badᵀ U`` counts each column's bad rows up to row s, and the first bad row is the number
  of s where that count is 0, a row reduction of E ([D, 64], f32: counts ≤ 64 are exact, as are
  the 0/1 operands in bf16).

"Bad" is NaN or ±inf; with ``neg_inf_ok`` only NaN and +inf (the log-decay, whose −inf is a valid
full reset). XLA's reductions of the same flags (:func:`gdn_jax.ops._sanitize.inputs` without
these kernels) come out in the transposed layout their consumers read and run at a fraction of
the memory bandwidth: 0.125 ms of KDA's 0.959 ms forward at B4 T4096 HV16 on the H200
(``benchmarks/profile_ops.py``).

A CTA walks a run of consecutive tiles (along the heads of a block, then the next block) through
a TMA load pipeline and writes each tile's vector through a double-buffered SMEM row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _compat as cp
from pallas_kernels._compat import pl, plgpu
from pallas_kernels._tiles import CHUNK

__all__ = ["row_flags", "col_first", "check", "tiles_per_cta"]

MAX_TILES = 8  # tiles per CTA at most
MIN_CTAS = 2 * 132  # at least two CTAs per SM of an H200, where the shape allows
STAGES = 2
DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
f32 = jnp.float32


def check(x, D: int) -> None:
    """NotImplementedError for what the kernels do not serve: x must be [R, C] bf16/f16/f32 with
    R % 64 == 0, D ∈ {64, 128} and C % D == 0."""
    if x.ndim != 2 or x.dtype not in DTYPES:
        raise NotImplementedError(f"{x.shape=} {x.dtype=}: the kernels take [R, C] bf16/f16/f32")
    R, C = x.shape
    if R % CHUNK or D not in (64, 128) or C % D:
        raise NotImplementedError(
            f"{x.shape=} {D=}: the kernels take R % 64 == 0, D in {{64, 128}}, C % D == 0"
        )


def tiles_per_cta(tiles: int) -> int:
    """Tiles per CTA: the most (≤ :data:`MAX_TILES`, halving) that divides ``tiles`` and leaves
    at least :data:`MIN_CTAS` CTAs; 1 where none does."""
    per = MAX_TILES
    while per > 1 and (tiles % per or tiles // per < MIN_CTAS):
        per //= 2
    return per


def _bad(x: jax.Array, neg_inf_ok: bool) -> jax.Array:
    """1.0 where x (f32) is NaN or ±inf (NaN or +inf with ``neg_inf_ok``), else 0.0."""
    ok = (x < jnp.inf) if neg_inf_ok else (jnp.abs(x) < jnp.inf)  # NaN compares false
    return jnp.where(ok, 0.0, 1.0)


def _run(x, D: int, out_len: int, out_type, name: str, step_out, scratch=(), init=None):
    """The shared tile walk: ``step_out(x_s, out_g, rb, h, *scratch)`` gives the vector of the
    tile in ``x_s`` (block rb, head h; [out_len] f32) and the slice of ``out_g`` it goes to;
    ``init(*scratch)`` runs once per CTA before the walk."""
    R, C = x.shape
    heads = C // D
    tiles = R // CHUNK * heads
    per = tiles_per_cta(tiles)

    def at(tile):
        return tile // heads, lax.rem(tile, heads)

    def body(x_g, out_g):
        first = lax.axis_index("i") * per

        def scoped(vec_s, *scratch):
            if init is not None:
                init(*scratch)

            def step(idx, x_s):
                t = first + idx[0]
                vec, dst = step_out(x_s, out_g, *at(t), *scratch)
                slot = lax.rem(idx[0], 2)
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the store from this slot
                vec_s.at[slot][...] = vec
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(vec_s.at[slot], dst)

            spec = cp.block_spec((CHUNK, D), lambda t: at(first + t), dtype=x.dtype, cols=D)
            plgpu.emit_pipeline(step, grid=(per,), in_specs=[spec], max_concurrent_steps=STAGES)(
                x_g
            )
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scoped, cp.smem((2, out_len), f32, swizzled=False), *scratch)

    return cp.kernel(body, out_type=out_type, grid=(tiles // per,), grid_names=("i",), name=name)(x)


def row_flags(x: jax.Array, D: int, *, neg_inf_ok: bool = False) -> jax.Array:
    """Per row and head, whether any of the head's D values is bad.

    Args:
      x: [R, C] bf16/f16/f32 (``[B·T, heads·D]``), R % 64 == 0, D ∈ {64, 128}, C % D == 0.
      D: the head dim (columns per head).
      neg_inf_ok: −inf is not bad (the log-decay); NaN and +inf are.
    Returns:
      [C / D, R] f32: 1.0 where row r of head h holds a bad value, else 0.0.
    Raises:
      NotImplementedError: see :func:`check`.
    """
    check(x, D)
    R, C = x.shape

    def step_out(x_s, out_g, rb, h):
        bad = _bad(cp.load_tile(x_s).astype(f32), neg_inf_ok)
        return jnp.max(bad, axis=1), out_g.at[h, pl.ds(rb * CHUNK, CHUNK)]

    out = jax.ShapeDtypeStruct((C // D, R), f32)
    return _run(x, D, CHUNK, out, "edge_row_flags", step_out)


def col_first(x: jax.Array, D: int) -> jax.Array:
    """Per 64-row block and column, the first row of the block holding a bad value (NaN, ±inf).

    Args:
      x: [R, C] bf16/f16/f32, R % 64 == 0, D ∈ {64, 128}, C % D == 0.
      D: the head dim (columns per tile).
    Returns:
      [R / 64, C] f32: the row in [0, 64) of the block's first bad value in that column, 64
      where the column has none in the block.
    Raises:
      NotImplementedError: see :func:`check`.
    """
    check(x, D)
    R, C = x.shape

    def init(bad_s, u_s):  # U[r, s] = (r <= s)
        upper = cp.iota((CHUNK, CHUNK), 0) <= cp.iota((CHUNK, CHUNK), 1)
        u_s[...] = jnp.where(upper, 1.0, 0.0).astype(jnp.bfloat16)

    def step_out(x_s, out_g, rb, h, bad_s, u_s):
        bad_s[...] = _bad(cp.load_tile(x_s).astype(f32), False).astype(jnp.bfloat16)
        plgpu.commit_smem()
        counts = cp.matmul(bad_s.T, u_s, (D, CHUNK))  # [D, 64]: bad rows up to row s
        first = jnp.sum(jnp.where(counts == 0.0, 1.0, 0.0), axis=1)
        return first, out_g.at[rb, pl.ds(h * D, D)]

    out = jax.ShapeDtypeStruct((R // CHUNK, C), f32)
    scratch = (cp.smem((CHUNK, D), jnp.bfloat16), cp.smem((CHUNK, CHUNK), jnp.bfloat16))
    return _run(x, D, D, out, "edge_col_first", step_out, scratch, init)
