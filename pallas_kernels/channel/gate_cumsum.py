"""Chunk-local cumulative sum of the per-channel log-decay (KDA / GDN2), and its transpose.

    G[c·64 + i, col] = Σ_{j ≤ i} g[c·64 + j, col]          (forward, inclusive)
    D[c·64 + i, col] = Σ_{j ≥ i} d[c·64 + j, col]          (``reverse=True``: the transpose)

per chunk of 64 rows and per column, in f32, adding the rows one after the other in order (so the
result is bitwise that of a sequential f32 cumsum, e.g. ``np.cumsum`` on f32). The job is
memory-bound (one read and one write of the tensor), so the kernel only has to keep the copy
engines busy:

- the [N, Tp, HV, K] tensor is viewed as a [N·Tp, HV·K] matrix (a free reshape: the sum runs over
  rows, independently per column), cut into tiles of 64 rows (one chunk) × 128 columns (32 KiB
  of f32);
- one CTA (one warpgroup) walks a run of consecutive tiles (along a chunk row of tiles, then the
  next chunk row) through a TMA load pipeline of :data:`SLOTS` tiles; each thread owns one column
  of the tile and adds its 64 rows in order from shared memory, overwriting each row with the
  running sum, and a TMA store sends the tile back from the same slot while the next tile loads
  (the pipeline refills a slot one step later, ``delay_release=1``, once its store has read it).
  96 KiB of shared memory per CTA: two CTAs per SM.
- with ``floor`` (the raw log-decay, clamped as it is read), each thread also keeps the first row
  of the tile where its column holds NaN or +inf (the op's bad gate values, which the clamp
  hides), and the tile's 128 of them go out through a double-buffered SMEM row: the flags of
  :mod:`gdn_jax.ops._sanitize` without a read of their own.

128-column tiles mean ``HV·K % 128 == 0`` (every K = 128, K = 64 with an even HV);
:func:`chunk_cumsum` refuses other shapes with NotImplementedError.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _compat as cp
from pallas_kernels._compat import pl, plgpu
from pallas_kernels._tiles import CHUNK

__all__ = ["COLS", "chunk_cumsum", "check", "tiles_per_cta"]

COLS = 128  # columns per tile: one per thread of the warpgroup
MAX_TILES = 16  # tiles per CTA at most
MIN_CTAS = 2 * 132  # at least two CTAs per SM of an H200, where the shape allows
# tiles in shared memory per CTA (3 × 32 KiB: two CTAs fit on an SM): while a tile is summed, the
# next one is loading and the previous one is being stored
SLOTS = 3
f32 = jnp.float32
ROW = plgpu.Layout.WG_STRIDED((COLS,), vec_size=1)  # a tile row: each thread one column


def check(g) -> None:
    """ValueError for a g that is no [N, Tp, HV, K] f32 tensor with Tp % 64 == 0;
    NotImplementedError for the shapes the kernel does not serve (HV·K % 128 != 0)."""
    if g.ndim != 4 or g.dtype != f32:
        raise ValueError(f"{g.shape=} {g.dtype=}: g must be [N, Tp, HV, K] float32")
    N, Tp, HV, K = g.shape
    if Tp % CHUNK:
        raise ValueError(f"{g.shape=}: g's row axis Tp = {Tp} must be a multiple of {CHUNK}")
    if (HV * K) % COLS:
        raise NotImplementedError(
            f"{g.shape=}: the kernel needs HV * K % {COLS} == 0 (K = 128, or K = 64 with even HV)"
        )


def tiles_per_cta(tiles: int, max_tiles: int = MAX_TILES) -> int:
    """Tiles per CTA: the most (≤ ``max_tiles``, halving) that divides ``tiles`` and leaves at
    least :data:`MIN_CTAS` CTAs; 1 where none does."""
    per = max_tiles
    while per > 1 and (tiles % per or tiles // per < MIN_CTAS):
        per //= 2
    return per


def chunk_cumsum(
    g: jax.Array,
    *,
    reverse: bool = False,
    floor: float | None = None,
    per_cta: int | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Inclusive cumulative sum of g over the rows of each 64-row chunk, per column.

    Args:
      g: [N, Tp, HV, K] f32, Tp % 64 == 0, HV · K % 128 == 0.
      reverse: sum from the chunk's last row up (the suffix sum), the transpose of the forward.
      floor: if given (< 0), each value is clamped to [floor, 0] as it is read, NaN and −inf to
        ``floor``, +inf to 0 (the channel glue's clamp of the raw log-decay).
      per_cta: tiles (64 × 128) per CTA; None: :func:`tiles_per_cta`. Must divide the number of
        tiles, N · Tp / 64 · HV · K / 128.
    Returns:
      [N, Tp, HV, K] f32; with ``floor`` the pair (that, first_bad): first_bad [N, Tp/64, HV, K]
      f32, per chunk and column the first row (0 … 63) whose raw value is NaN or +inf, 64 where
      none is (−inf is a valid log-decay: a full reset).
    Raises:
      ValueError: g is not a 4-D f32 tensor with Tp % 64 == 0, or per_cta does not divide the
        tiles.
      NotImplementedError: HV · K % 128 != 0.
    """
    return _chunk_cumsum(g, reverse=reverse, floor=floor, per=per_cta)


def _chunk_cumsum(g, *, reverse, floor=None, per, slots=SLOTS):
    check(g)
    if floor is not None and not floor < 0:
        raise ValueError(f"{floor=} must be negative (or None)")
    if floor is not None and reverse:
        raise ValueError("floor (a raw log-decay) goes with the forward sum only")
    N, Tp, HV, K = g.shape
    R, M = N * Tp, HV * K
    col_blocks = M // COLS
    tiles = R // CHUNK * col_blocks
    per = tiles_per_cta(tiles) if per is None else per
    if not isinstance(per, int) or per < 1 or tiles % per:
        raise ValueError(f"{per=} (per_cta) must be a positive divisor of the {tiles} tiles")
    rows = range(CHUNK - 1, -1, -1) if reverse else range(CHUNK)

    def at(tile):
        """(row block, column block) of tile ``tile``: consecutive tiles run along a chunk row."""
        return tile // col_blocks, lax.rem(tile, col_blocks)

    def body(x_g, y_g, *first_g):
        first = lax.axis_index("i") * per

        def walk(*vec_s):
            def step(idx, x_s):
                # each thread reads and overwrites its own column: the sums replace the tile
                if floor is not None:
                    # NaN and +inf fail the comparison. The column's first such row is the
                    # number of rows before it: a running count of the rows still clean (a
                    # rolled loop, read before the sums overwrite the tile)
                    def count(r, carry):
                        clean, n = carry
                        clean = clean * (plgpu.load(x_s.at[r], layout=ROW) < jnp.inf).astype(f32)
                        return clean, n + clean

                    zero = plgpu.layout_cast(jnp.zeros((COLS,), f32), ROW)
                    bad_row = lax.fori_loop(0, CHUNK, count, (zero + 1.0, zero))[1]
                acc = None
                for r in rows:
                    # (the raw form names the rows' layout: left to Mosaic's layout inference,
                    # the flag loop's ops make its search the bulk of the kernel's lowering)
                    v = x_s[r] if floor is None else plgpu.load(x_s.at[r], layout=ROW)
                    if floor is not None:  # NaN > floor is false: NaN and −inf give the floor
                        v = jnp.where(v > floor, jnp.minimum(v, 0.0), floor)
                    acc = v if acc is None else acc + v
                    x_s[r] = acc
                plgpu.commit_smem()
                rb, cb = at(first + idx[0])
                cols = pl.ds(cb * COLS, COLS)
                plgpu.copy_smem_to_gmem(x_s, y_g.at[pl.ds(rb * CHUNK, CHUNK), cols])
                if floor is not None:
                    row = vec_s[0].at[lax.rem(idx[0], 2)]
                    row[...] = bad_row
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(row, first_g[0].at[rb, cols])
                # the pipeline refills the previous step's slot (delay_release=1) once this step
                # returns: that slot's store (and the flag row's of two steps back) must have
                # read it
                plgpu.wait_smem_to_gmem(2 if floor is not None else 1, wait_read_only=True)

            spec = plgpu.BlockSpec((CHUNK, COLS), lambda t: at(first + t), delay_release=1)
            plgpu.emit_pipeline(step, grid=(per,), in_specs=[spec], max_concurrent_steps=slots)(x_g)
            plgpu.wait_smem_to_gmem(0)

        if floor is None:
            walk()
        else:
            pl.run_scoped(walk, cp.smem((2, COLS), f32, swizzled=False))

    name = "gate_cumsum_rev" if reverse else "gate_cumsum"
    out = jax.ShapeDtypeStruct((R, M), f32)
    if floor is None:
        kernel = cp.kernel(body, out_type=out, grid=(tiles // per,), grid_names=("i",), name=name)
        return kernel(g.reshape(R, M)).reshape(g.shape)
    outs = (out, jax.ShapeDtypeStruct((R // CHUNK, M), f32))
    kernel = cp.kernel(body, out_type=outs, grid=(tiles // per,), grid_names=("i",), name=name)
    G, first_bad = kernel(g.reshape(R, M))
    return G.reshape(g.shape), first_bad.reshape((N, Tp // CHUNK, HV, K))
