"""In-register FP8-E4M3 fake quantisation for the GDN kernels (QAT, fused: no extra HBM pass).

The formula is the one of ``gdn_jax.qat.fake_quant`` (this package imports nothing from
``gdn_jax``; the tests check that both agree bitwise):

    a     = max(max |x| over the group, AMAX_FLOOR)
    inv   = 448 / a
    scale = a * f32(1/448)
    x_q   = f32(e4m3(x * inv)) * scale          (round to nearest even)

The floor keeps ``inv`` finite: a group whose amax is below it (a state decayed to ~1e-36, or
all zeros) is quantised on the floor's scale, so its values round to (near) zero instead of
``x * inf``.

Groups are the rows, the columns or the whole of a 2-D f32 register tile (WGMMA layout). The
whole-tile maximum is a row reduction followed by a column reduction of its broadcast, so only
the 1-axis reductions Mosaic GPU lowers are needed. The gradient of the fake quant is the
identity (straight-through), so the backward kernels need no quantiser: they are fed the
quantised tensors that the forward used.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import _compat as cp

__all__ = [
    "AMAX_FLOOR",
    "E4M3_MAX",
    "GROUPS",
    "fake_quant_e4m3",
    "F16_STAGE_AMAX",
    "f16_stage_scales",
    "stage_columns",
]

E4M3_MAX = 448.0
# Smallest group amax a scale is computed from: 2^14 / 2^-100 and 448 / 2^-100 stay far inside
# f32, whereas f32 amaxes down to ~1e-38 would make ``inv`` overflow to inf.
AMAX_FLOOR = 2.0**-100
GROUPS = ("rows", "cols", "all")
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
    if groups not in GROUPS:
        raise ValueError(f"{groups=} must be one of {GROUPS}")
    shape = x.shape
    a = jnp.abs(x)
    if groups == "rows":
        amax, expand = jnp.max(a, axis=1), cp.bcast_rows
    elif groups == "cols":
        amax, expand = jnp.max(a, axis=0), cp.bcast_cols
    else:
        amax, expand = jnp.max(cp.bcast_rows(jnp.max(a, axis=1), shape), axis=0), cp.bcast_cols
    # per group: one division, then only multiplies (the same operations as gdn_jax.qat)
    amax = jnp.maximum(amax, AMAX_FLOOR)
    inv = E4M3_MAX / amax
    scale = amax * f32(1.0 / E4M3_MAX)
    q = (x * expand(inv, shape)).astype(jnp.float8_e4m3fn).astype(f32)
    return q * expand(scale, shape)


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


def stage_columns(x: jax.Array, dst, scaled: bool):
    """Stages the f32 register tile ``x`` [R, N] (a state or state gradient) as the 16-bit wgmma
    operand ``dst`` (SMEM [R, N]) and returns the function that undoes the staging on the result
    of a product ``a @ dst`` ([M, N]).

    ``scaled`` (f16 io): one scale per column (:func:`f16_stage_scales`, ``axis=0``), multiplied
    back on the product's columns; otherwise a plain cast (bf16 holds the f32 range).
    """
    if not scaled:
        dst[...] = x.astype(dst.dtype)
        return lambda y: y
    inv, sc = f16_stage_scales(x, axis=0)
    dst[...] = (x * cp.bcast_cols(inv, x.shape)).astype(dst.dtype)
    return lambda y: y * cp.bcast_cols(sc, y.shape)
