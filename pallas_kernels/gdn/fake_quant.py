"""In-register FP8-E4M3 fake quantisation for the GDN and the channel-decay (KDA / GDN2) kernels
(QAT, fused: no extra HBM pass).

The formula is the one of ``gdn_jax.qat.fake_quant`` (this package imports nothing from
``gdn_jax``; the tests check that both agree bitwise):

    a     = max(max |x| over the group, AMAX_FLOOR)
    inv   = 448 / a
    scale = a * f32(1/448)
    x_q   = f32(e4m3(x * inv)) * scale          (round to nearest even)

The floor keeps ``inv`` finite: a group whose amax is below it (a state decayed to ~1e-36, or
all zeros) is quantised on the floor's scale, so its values round to (near) zero instead of
``x * inf``.

Groups are the rows, the columns or the whole of a 2-D f32 register tile (WGMMA layout), or of
several such tiles side by side (:func:`fake_quant_e4m3_tiles`: a [R, K] tensor produced in
[R, 64] column blocks, as the channel intra kernel produces w). The whole-tile maximum is a row
reduction followed by a column reduction of its broadcast, so only the 1-axis reductions Mosaic
GPU lowers are needed. :data:`STATE_QUANT` and :data:`W_QUANT` map the granularities of
``gdn_jax.qat.QATConfig`` to these groups, for both kernel families. The gradient of the fake
quant is the identity (straight-through), so the backward kernels need no quantiser: they are fed
the quantised tensors that the forward used.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import _compat as cp

__all__ = [
    "AMAX_FLOOR",
    "E4M3_MAX",
    "GROUPS",
    "STATE_QUANT",
    "W_QUANT",
    "fake_quant_e4m3",
    "fake_quant_e4m3_tiles",
    "F16_STAGE_AMAX",
    "f16_stage_scales",
    "stage_columns",
    "unstage_columns",
]

E4M3_MAX = 448.0
# Smallest group amax a scale is computed from: 2^14 / 2^-100 and 448 / 2^-100 stay far inside
# f32, whereas f32 amaxes down to ~1e-38 would make ``inv`` overflow to inf.
AMAX_FLOOR = 2.0**-100
GROUPS = ("rows", "cols", "all")
# QAT granularity of the chunk-entering state -> groups of its [K, BV] tile ("matrix" needs the
# whole state in one tile: BV = V)
STATE_QUANT = {"column": "cols", "matrix": "all"}
# QAT granularity of w -> groups of its [C, K] rows (tile: the chunk's C x K of one head)
W_QUANT = {"row": "rows", "tile": "all"}
f32 = jnp.float32


def fake_quant_e4m3(x: jax.Array, groups: str) -> jax.Array:
    """Quantise-dequantise a 2-D f32 register tile to FP8-E4M3 with a dynamic scale.

    Args:
      x: [R, N] f32 (WGMMA layout, e.g. a wgmma result or the state carry).
      groups: ``"rows"`` (one scale per row, amax over N), ``"cols"`` (one per column, amax over
        R) or ``"all"`` (one for the tile).
    Returns:
      [R, N] f32, every value ``e4m3 * scale``.
    """
    (q,) = fake_quant_e4m3_tiles((x,), groups)
    return q


def fake_quant_e4m3_tiles(xs: tuple[jax.Array, ...], groups: str) -> tuple[jax.Array, ...]:
    """:func:`fake_quant_e4m3` of the tensor made of the tiles ``xs`` side by side along columns
    (``concatenate(xs, axis=1)``), without concatenating: a row's or the whole tensor's amax is
    the maximum of the tiles' own.

    Args:
      xs: tiles [R, N] f32 (WGMMA layout), the column blocks of one [R, len(xs) * N] tensor.
      groups: ``"rows"`` (one scale per row of the tensor), ``"cols"`` (one per column) or
        ``"all"`` (one for the tensor).
    Returns:
      the quantised tiles, as ``xs``.
    """
    if groups not in GROUPS:
        raise ValueError(f"{groups=} must be one of {GROUPS}")
    shape = xs[0].shape
    if any(x.shape != shape for x in xs):
        raise ValueError(f"tiles of one tensor must share a shape; got {[x.shape for x in xs]}")
    if groups == "cols":  # each column lies in one tile
        amaxes, expand = [jnp.max(jnp.abs(x), axis=0) for x in xs], cp.bcast_cols
    else:
        amax = jnp.max(jnp.abs(xs[0]), axis=1)
        for x in xs[1:]:
            amax = jnp.maximum(amax, jnp.max(jnp.abs(x), axis=1))
        if groups == "rows":
            expand = cp.bcast_rows
        else:
            amax, expand = jnp.max(cp.bcast_rows(amax, shape), axis=0), cp.bcast_cols
        amaxes = [amax]  # one group vector shared by every tile
    scales = []
    for amax in amaxes:
        # per group: one division, then only multiplies (the same operations as gdn_jax.qat)
        amax = jnp.maximum(amax, AMAX_FLOOR)
        scales.append((expand(E4M3_MAX / amax, shape), expand(amax * f32(1.0 / E4M3_MAX), shape)))
    if len(scales) == 1:
        scales *= len(xs)
    out = []
    for x, (inv, scale) in zip(xs, scales, strict=True):
        out.append((x * inv).astype(jnp.float8_e4m3fn).astype(f32) * scale)
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# f16 staging of f32 state tiles (not a quantiser: keeps the state's range, see docs/design.md)

F16_STAGE_AMAX = 2.0**14  # a staged group's amax: f16 (max 65504) with room for rounding


def f16_stage_scales(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """Per-group scales to stage an f32 tile as an f16 wgmma operand without losing its range.

    f16 overflows at 65504 and flushes below ~6e-8, so an f32 state cannot be cast to f16
    directly (docs/design.md). Each group (row or column) is multiplied by ``inv`` so that its amax
    becomes 2^14 before the cast, and the product's result is multiplied back by ``scale``
    (``inv * scale = 1`` to f32 rounding): f16's 11-bit precision relative to each group's amax,
    whatever its magnitude.

    Args:
      x: [R, N] f32 register tile (WGMMA layout).
      axis: 0 (one scale per column) or 1 (one per row).
    Returns:
      (inv, scale), each [N] (axis 0) or [R] (axis 1) f32, laid out for ``bcast_cols`` /
      ``bcast_rows``.
    """
    amax = jnp.maximum(jnp.max(jnp.abs(x), axis=axis), AMAX_FLOOR)
    inv = F16_STAGE_AMAX / amax
    scale = amax * f32(1.0 / F16_STAGE_AMAX)
    return inv, scale


def stage_columns(x: jax.Array, dst, scaled: bool, lo=None, scales=None):
    """Stages the f32 register tile ``x`` [R, N] (a state or state gradient) as the 16-bit wgmma
    operand ``dst`` (SMEM [R, N]) and returns the function that undoes the staging on the result
    of a product ``a @ dst`` ([M, N]).

    ``scaled`` (f16 io): one scale per column (:func:`f16_stage_scales`, ``axis=0``), multiplied
    back on the product's columns; otherwise a plain cast (bf16 holds the f32 range). ``lo``
    (f16, SMEM [R, N]): also the remainder of the scaled tile after its f16 rounding, so that
    ``a @ dst + a @ lo`` carries the staged operand to ~f32 precision (the undo is the same).
    ``scales`` (f16, SMEM [N] f32): also receives the column scales, for another warpgroup's
    products with ``dst`` (:func:`unstage_columns`).
    """
    if not scaled:
        dst[...] = x.astype(dst.dtype)
        return lambda y: y
    inv, sc = f16_stage_scales(x, axis=0)
    y = x * cp.bcast_cols(inv, x.shape)
    hi = y.astype(dst.dtype)
    dst[...] = hi
    if lo is not None:
        lo[...] = (y - hi.astype(f32)).astype(lo.dtype)
    if scales is not None:
        scales[...] = sc
    return lambda y: y * cp.bcast_cols(sc, y.shape)


def unstage_columns(scales, scaled: bool):
    """The undo of :func:`stage_columns` for a warpgroup that did not stage the tile: the column
    scales are read from ``scales`` (SMEM [N] f32, written by ``stage_columns(...,
    scales=scales)``) when ``scaled``; else the identity."""
    if not scaled:
        return lambda y: y
    return lambda y: y * cp.bcast_cols(cp.col_vec(scales, y.shape[1]), y.shape)
