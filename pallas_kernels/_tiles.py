"""Register-tile building blocks shared by kernel stages (Mosaic GPU, one warpgroup).

Kept apart from :mod:`pallas_kernels._compat` (version-dependent API) and from the stage modules:
these are pieces of algorithms (a triangular inverse, per-row vector loads of a 2-D SMEM tile)
that more than one stage family uses.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _compat as cp
from pallas_kernels._compat import pl, plgpu

# Rows per chunk of every chunked stage: the M of one warpgroup's WGMMA tile, and the size the
# block-doubling inverse (:func:`unit_lower_inverse`) is written for.
CHUNK = 64
LOG2E = 1.4426950408889634


def ex2_exp(x: jax.Array) -> jax.Array:
    """e^x as 2^(x·log2 e): ``exp2`` is the ex2 instruction, where ``exp`` wraps the same
    instruction in libdevice's range reduction. Rounding x·log2 e costs a relative 2^-24 of the
    exponent (≤ 1e-5 in the result for |x| ≤ 80 · log2 e)."""
    return jnp.exp2(x * LOG2E)


def round_tf32(x: jax.Array) -> jax.Array:
    """f32 ``x`` rounded to tf32 (11 significant bits, f32's range), to nearest with ties away from
    zero, still as f32: a tf32 wgmma reads its operands' f32 bits without rounding them (the low
    13 bits are not used), so operands are rounded here first. |x| must be finite and below
    2^128 · (1 − 2^-12) (no carry into the infinity bit pattern)."""
    u = lax.bitcast_convert_type(x, jnp.uint32)
    u = (u + jnp.uint32(1 << 12)) & jnp.uint32(0xFFFFE000)
    return lax.bitcast_convert_type(u, jnp.float32)


__all__ = [
    "CHUNK",
    "ex2_exp",
    "round_tf32",
    "unit_lower_inverse",
    "col_vec_row",
    "chunk_coords",
    "pair_chunk_coords",
    "LoopConfig",
    "META_COLS",
    "check_meta",
    "load_state_row",
    "store_final_state",
    "store_initial_cotangent",
    "v_block_coords",
    "segment_coords",
    "chunk_offset",
    "finite",
    "nonfinite",
    "per_chunk_kernel",
    "per_v_block_kernel",
    "store_f32_tile",
    "load_tiles",
    "emit_tile",
    "accumulate_passes",
    "Bars",
]


def unit_lower_inverse(L: jax.Array, x_s, oy_s, dtype) -> jax.Array:
    """``(I + L)⁻¹`` of a strictly lower triangular [C, C] f32 register tile (C = 64).

    Block doubling ``X ← X − X (O_s X)`` for s = 1, 2, …, 32, where O_s is L restricted to the
    lower-left s×s block of each 2s×2s diagonal block: every intermediate is a block of the true
    inverse, so magnitudes stay bounded (the product form (I−L)(I+L²)… is numerically unusable,
    docs/design.md). Wgmma operands are ``dtype`` (16-bit), everything else f32.

    Args:
      L: [C, C] f32 in the WGMMA layout, zero on and above the diagonal.
      x_s, oy_s: [C, C] ``dtype`` SMEM scratch tiles (swizzled).
      dtype: the 16-bit operand dtype.
    Returns:
      X = (I + L)⁻¹, [C, C] f32 (unit lower triangular).
    """
    C = L.shape[0]
    row = cp.iota((C, C), 0)
    col = cp.iota((C, C), 1)

    def level_mask(lg):
        hi = lax.shift_right_logical(row, lg + 1) == lax.shift_right_logical(col, lg + 1)
        lo = lax.shift_right_logical(row, lg) != lax.shift_right_logical(col, lg)
        return hi & lo

    eye = jnp.where(row == col, 1.0, 0.0)
    X = eye - jnp.where(level_mask(0), L, 0.0)  # level s = 1: X_1 = I, so X_2 = I − O_1
    for lg in range(1, C.bit_length() - 1):
        oy_s[...] = jnp.where(level_mask(lg), L, 0.0).astype(dtype)
        x_s[...] = X.astype(dtype)
        plgpu.commit_smem()
        Y = cp.matmul(oy_s, x_s, (C, C))  # O_s X_s
        oy_s[...] = Y.astype(dtype)
        plgpu.commit_smem()
        X = X - cp.matmul(x_s, oy_s, (C, C))  # X_s (O_s X_s)
    return X


def col_vec_row(ref, i: int) -> jax.Array:
    """Row ``i`` of a 2-D unswizzled f32 SMEM ref as a column-broadcast vector (``v[None, :]``)."""
    return plgpu.load(ref.at[i], layout=plgpu.Layout.WGMMA.reduce(0))


def chunk_coords(group: int, chunk: int = 64):
    """Grid coordinates of a per-chunk kernel on the ``("c", "h", "b")`` grid.

    Returns:
      (c, hv, b, hk, rows): chunk index, value head, batch row, the q/k head of ``hv`` under GVA
      (``group`` value heads per q/k head) and the chunk's token rows as a ``pl.ds``.
    """
    c = lax.axis_index("c")
    hv = lax.axis_index("h")
    b = lax.axis_index("b")
    return c, hv, b, hv // group, pl.ds(c * chunk, chunk)


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """Static configuration of a sequential chunk loop (one CTA per block of value columns, see
    :func:`per_v_block_kernel`); the loops' own configs extend it.

    Attributes:
      scale: the output scale (``K ** -0.5`` by default in the ops).
      block_v: V columns per CTA, 64 or 128.
      segments: the loop runs each sequence as this many equal runs of chunks in parallel (one
        CTA per (segment, value head, value block)), each from its own given state: the loop's
        initial/final-state tables then have one row per (batch row, segment), see
        :func:`segment_coords`. 1: the plain loop over all chunks.
    """

    scale: float = 1.0
    block_v: int = 64
    segments: int = 1

    def __post_init__(self):
        if self.block_v not in (64, 128):
            raise ValueError(f"{self.block_v=} must be 64 or 128")
        if not isinstance(self.segments, int) or self.segments < 1:
            raise ValueError(f"{self.segments=} must be an int >= 1")
        if not isinstance(self.scale, float):
            raise TypeError(f"{self.scale=} must be a Python float")


# Columns of the per-chunk table of packed sequences on one lane that the chunk loops of both
# families read (column 0: the sequence whose first chunk this is, column 1: whose last chunk,
# else -1). The pipeline stages the rows in back-to-back SMEM slots, and every TMA destination
# must be 128-byte aligned: a 16-column (64-byte) row faulted on the H200 with
# CUDA_ERROR_MISALIGNED_ADDRESS, so a row is 32 int32.
META_COLS = 32


def check_meta(meta: jax.Array | None, B: int, nt: int) -> None:
    """Raises ValueError unless ``meta`` is None or a [nt, META_COLS] int32 table with B == 1."""
    if meta is not None and (B != 1 or meta.shape != (nt, META_COLS) or meta.dtype != jnp.int32):
        raise ValueError(
            f"{B=} {meta.shape=} {meta.dtype=}: meta must be [T/64, {META_COLS}] int32 with B == 1"
        )


def load_state_row(seq, src_g, hv: int, cols, st_s, bar, carry):
    """Inside a chunk loop on a packed lane: where the table entry ``seq`` is >= 0, the carry
    [K, BV] f32 becomes row ``seq`` of ``src_g`` [N, HV, K, V] (value head ``hv``, columns
    ``cols``), staged through ``st_s`` [K, BV] f32 with barrier ``bar``; else it is kept."""

    @pl.when(seq >= 0)
    def _():
        plgpu.copy_gmem_to_smem(src_g.at[seq, hv, :, cols], st_s, bar)
        plgpu.barrier_wait(bar)

    # a vector predicate (select does not broadcast a scalar one on the GPU)
    rows = carry.shape[0]
    on = cp.iota(carry.shape, 0) < jnp.where(seq >= 0, rows, 0)
    return jnp.where(on, cp.load_tile(st_s), carry)


def store_final_state(seq, state, st_s, dst_g, hv: int, cols) -> None:
    """Forward chunk loops on a packed lane: where ``seq`` >= 0 (the chunk ends sequence
    ``seq``), ``state`` [K, BV] f32 is written to row ``seq`` of ``dst_g`` [N, HV, K, V] through
    ``st_s``, and the store finishes before the next :func:`load_state_row` reuses the tile."""

    @pl.when(seq >= 0)
    def _():
        st_s[...] = state
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(st_s, dst_g.at[seq, hv, :, cols])
        plgpu.wait_smem_to_gmem(0)


def store_initial_cotangent(seq, dstate, st_s, dst_g, hv: int, cols) -> None:
    """Reverse chunk loops on a packed lane: where ``seq`` >= 0 (the chunk starts sequence
    ``seq``), ``dstate`` [K, BV] f32 is written to row ``seq`` of ``dst_g`` [N, HV, K, V]
    through ``st_s``, once the loop's earlier stores from ``st_s`` have left it."""

    @pl.when(seq >= 0)
    def _():
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        st_s[...] = dstate
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(st_s, dst_g.at[seq, hv, :, cols])


def v_block_coords(block_v: int):
    """Grid coordinates of a sequential chunk loop on the ``("v", "h", "b")`` grid.

    Returns:
      (iv, hv, b, cols): value-column block, value head, batch row, and the block's state
      columns as a ``pl.ds``.
    """
    iv = lax.axis_index("v")
    return iv, lax.axis_index("h"), lax.axis_index("b"), pl.ds(iv * block_v, block_v)


def segment_coords(rows: int, seg_chunks: int):
    """Segment coordinates of a chunk loop whose grid axis ``"b"`` enumerates (batch row, segment)
    pairs, ``rows`` segments per batch row, each of ``seg_chunks`` chunks.

    Returns:
      (b, bs, c0): batch row, the (batch row, segment) index (the row of the loop's per-segment
      state tables) and the segment's first chunk. With ``rows == 1``: (b, b, 0), no extra ops.
    """
    bs = lax.axis_index("b")
    if rows == 1:
        return bs, bs, 0
    return bs // rows, bs, lax.rem(bs, rows) * seg_chunks


def chunk_offset(c0, c):
    """Chunk ``c`` of a segment starting at chunk ``c0`` (``c0`` may be the Python int 0)."""
    return c if isinstance(c0, int) and c0 == 0 else c0 + c


def finite(v: jax.Array) -> jax.Array:
    """v with NaN and ±inf replaced by 0 (``|v| < inf`` is false for both): the kernels that
    read the ops' raw inputs make the sanitation's replacement as they load them."""
    return jnp.where(jnp.abs(v) < jnp.inf, v, 0.0)


def nonfinite(v: jax.Array) -> jax.Array:
    """1.0 where v is NaN or ±inf, else 0.0 (f32): the flags of what :func:`finite` replaces."""
    return jnp.where(jnp.abs(v) < jnp.inf, 0.0, 1.0)


def first_bad_rows(bad_s, upper_s) -> jax.Array:
    """Per column of the [C, 64] 0/1 tile ``bad_s`` (bf16), the first row holding a 1: [64] f32
    in [0, C], C where none does. With ``upper_s`` U[r, s] = (r ≤ s), ``E = badᵀ U`` [64, C]
    counts each column's bad rows up to row s (exact: 0/1 operands, f32 counts ≤ 64), and the
    first bad row is the number of s where that count is 0: a row reduction of E."""
    counts = cp.matmul(bad_s.T, upper_s, (bad_s.shape[1], bad_s.shape[0]))
    return jnp.sum(jnp.where(counts == 0.0, 1.0, 0.0), axis=1)


def per_chunk_kernel(
    body, out_type, *, chunks: int, HV: int, B: int, name: str, pair: bool = False
):
    """``cp.kernel`` with one CTA per (chunk, value head, batch row): the ``("c", "h", "b")`` grid
    that :func:`chunk_coords` reads (the chunk-parallel stages). ``pair``: two CTAs per (chunk,
    value head, batch row), CTA ``h = 2 hv + half`` (:func:`pair_chunk_coords`), for kernels that
    split a chunk's work in two so that two CTAs fit on an SM."""
    heads = 2 * HV if pair else HV
    return cp.kernel(
        body, out_type=out_type, grid=(chunks, heads, B), grid_names=("c", "h", "b"), name=name
    )


def pair_chunk_coords(group: int, chunk: int = 64):
    """Grid coordinates of a ``per_chunk_kernel(..., pair=True)`` CTA.

    Returns:
      (c, hv, half, b, hk, rows): as :func:`chunk_coords`, plus ``half`` ∈ {0, 1}, which of the
      value head's two CTAs this is.
    """
    c = lax.axis_index("c")
    h2 = lax.axis_index("h")
    hv = lax.shift_right_logical(h2, 1)
    return c, hv, lax.bitwise_and(h2, 1), lax.axis_index("b"), hv // group, pl.ds(c * chunk, chunk)


def per_v_block_kernel(
    body,
    out_type,
    *,
    v_blocks: int,
    HV: int,
    B: int,
    name: str,
    input_output_aliases=None,
    warpgroups: int = 1,
):
    """``cp.kernel`` with one CTA per (block of value columns, value head, batch row): the
    ``("v", "h", "b")`` grid of the sequential chunk loops, each CTA carrying a [K, block_v]
    slice of the state. ``input_output_aliases`` and ``warpgroups`` as for
    :func:`pallas_kernels._compat.kernel`."""
    return cp.kernel(
        body,
        out_type=out_type,
        grid=(v_blocks, HV, B),
        grid_names=("v", "h", "b"),
        name=name,
        input_output_aliases=input_output_aliases,
        warpgroups=warpgroups,
    )


def store_f32_tile(x: jax.Array, dst) -> None:
    """Write an f32 register tile (a state or its gradient) to the GMEM view ``dst`` through a
    scoped SMEM buffer of the same shape, and wait for the copy."""

    def body(st_s):
        st_s[...] = x
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(st_s, dst)
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(body, cp.smem(x.shape, jnp.float32))


def load_tiles(copies, bar, *, late: tuple[int, ...] = ()) -> None:
    """Issues the GMEM→SMEM copies ``copies`` ((GMEM view, SMEM ref) pairs), copy i arriving on
    ``bar.at[i]``, and waits for all but those indexed by ``late`` (the caller waits for those
    with ``plgpu.barrier_wait(bar.at[i])`` where it first needs them, overlapping their load)."""
    for i, (src, dst) in enumerate(copies):
        plgpu.copy_gmem_to_smem(src, dst, bar.at[i])
    for i in range(len(copies)):
        if i not in late:
            plgpu.barrier_wait(bar.at[i])


def accumulate_passes(pass_fn, passes: int, *scratch):
    """``acc = pass_fn(p, acc, *refs)`` for p = 0 … passes − 1 (``acc`` None at first), each pass
    in its own ``pl.run_scoped`` of the ``scratch`` SMEM, so consecutive passes reuse that memory.
    Returns the last ``acc``."""
    acc = None
    for p in range(passes):
        acc = pl.run_scoped(functools.partial(pass_fn, p, acc), *scratch)
    return acc


def emit_tile(x: jax.Array, stage_s, dst) -> None:
    """Writes the register tile ``x`` to the GMEM view ``dst`` through the SMEM tile ``stage_s``
    and returns once the copy has read ``stage_s`` (so it can take the next tile)."""
    stage_s[...] = x
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(stage_s, dst)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


class Bars:
    """Hands out the barriers of one SMEM array in order: every TMA load of the kernel gets its
    own barrier, waited on once (so no phase bookkeeping across scopes that reuse memory)."""

    def __init__(self, bar):
        self.bar = bar
        self.next = 0

    def load(self, copies, *, wait: bool = True) -> list[int]:
        """Issues the GMEM→SMEM ``copies`` ((GMEM view, SMEM ref) pairs); waits for them unless
        ``not wait`` (then the caller waits on the returned barrier indices)."""
        ids = []
        for src, dst in copies:
            plgpu.copy_gmem_to_smem(src, dst, self.bar.at[self.next])
            ids.append(self.next)
            self.next += 1
        if wait:
            self.wait(ids)
        return ids

    def wait(self, ids) -> None:
        for i in ids:
            plgpu.barrier_wait(self.bar.at[i])
