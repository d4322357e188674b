"""The native FP8 backend: a ``jax.custom_vjp`` dot_general with FP8 operands.

:func:`native_fp8_dot_general` quantises both operands to ``float8_e4m3fn`` with per-tensor
*current* scaling (the scale comes from this call's amax), multiplies with f32 accumulation and
rescales; the backward quantises the output cotangent to ``float8_e5m2`` and runs both gradient
GEMMs in FP8 (e5m2 x e4m3). It runs on a CPU; on Hopper XLA turns the f8 ``dot_general`` into
cuBLASLt FP8 GEMMs. Stateless: nothing to carry between steps.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from gdn_jax import sharding
from gdn_jax.fp8.guard import fp8_enabled

__all__ = ["E4M3", "E5M2", "native_fp8_dot_general", "quantize"]

E4M3 = jnp.float8_e4m3fn  # forward operands: 3 mantissa bits, max 448
E5M2 = jnp.float8_e5m2  # gradients: 2 mantissa bits, max 57344 (range over precision)


def quantize(x: jax.Array, dtype=E4M3) -> tuple[jax.Array, jax.Array]:
    """Per-tensor current scaling: ``x ≈ q * scale`` with ``amax(|x|)`` mapped to the FP8 max.

    Args:
      x: any shape, any float dtype.
      dtype: ``float8_e4m3fn`` or ``float8_e5m2``.
    Returns:
      q (x.shape, ``dtype``) and scale (scalar f32, > 0).
    """
    fmax = float(jnp.finfo(dtype).max)
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
    # An all-zero (or non-finite) tensor keeps scale 1 so that q stays 0 / propagates inf, nan.
    scale = jnp.where((amax > 0) & jnp.isfinite(amax), amax / fmax, 1.0).astype(jnp.float32)
    # Clip before the cast: e4m3fn has no inf, an overflow would turn into nan.
    q = jnp.clip(x.astype(jnp.float32) / scale, -fmax, fmax).astype(dtype)
    return q, scale


def _canonical_dims(dimension_numbers, lhs_ndim: int, rhs_ndim: int):
    """Permutations that bring a batch-free dot_general to ``[M, K] @ [K, N]``."""
    (lc, rc), (lb, rb) = dimension_numbers
    if lb or rb:
        raise NotImplementedError(
            f"native FP8 dot_general supports projections only (no batch dims); got "
            f"{dimension_numbers=}"
        )
    lc, rc = tuple(int(d) % lhs_ndim for d in lc), tuple(int(d) % rhs_ndim for d in rc)
    lfree = tuple(d for d in range(lhs_ndim) if d not in lc)
    rfree = tuple(d for d in range(rhs_ndim) if d not in rc)
    return lc, rc, lfree, rfree


def _to_2d(x, free, contract, contract_last: bool):
    perm = free + contract if contract_last else contract + free
    shape = x.shape
    m = math.prod(shape[d] for d in free)
    k = math.prod(shape[d] for d in contract)
    x = jnp.transpose(x, perm)
    return x.reshape((m, k) if contract_last else (k, m))


def _from_2d(x2, shape, free, contract, contract_last: bool):
    perm = free + contract if contract_last else contract + free
    x = x2.reshape(tuple(shape[d] for d in perm))
    inv = [0] * len(perm)
    for i, d in enumerate(perm):
        inv[d] = i
    return jnp.transpose(x, inv)


def _f8_matmul(a, b, dims):
    # FP8 operands, f32 accumulation and output: one cuBLASLt FP8 GEMM on Hopper.
    return jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _native_fp8(lhs, rhs, dimension_numbers, out_dtype):
    out, _ = _native_fp8_fwd(lhs, rhs, dimension_numbers, out_dtype)
    return out


def _native_fp8_fwd(lhs, rhs, dimension_numbers, out_dtype):
    lc, rc, lfree, rfree = _canonical_dims(dimension_numbers, lhs.ndim, rhs.ndim)
    a = _to_2d(lhs, lfree, lc, contract_last=True)  # [M, K]
    b = _to_2d(rhs, rfree, rc, contract_last=False)  # [K, N]
    qa, sa = quantize(a, E4M3)
    qb, sb = quantize(b, E4M3)
    y = _f8_matmul(qa, qb, ((1,), (0,))) * (sa * sb)
    out_shape = tuple(lhs.shape[d] for d in lfree) + tuple(rhs.shape[d] for d in rfree)
    y = y.reshape(out_shape).astype(out_dtype)
    # FP8 residuals: one byte per element instead of two (what TE saves too).
    res = (qa, sa, qb, sb, lhs.shape, rhs.shape, jnp.dtype(lhs.dtype), jnp.dtype(rhs.dtype))
    return y, _Residuals(*res)


@jax.tree_util.register_pytree_node_class
class _Residuals:
    """FP8 operands, their scales, and the static shapes/dtypes to restore (a pytree)."""

    def __init__(self, qa, sa, qb, sb, lhs_shape, rhs_shape, lhs_dtype, rhs_dtype):
        self.arrays = (qa, sa, qb, sb)
        self.static = (lhs_shape, rhs_shape, lhs_dtype, rhs_dtype)

    def tree_flatten(self):
        return self.arrays, self.static

    @classmethod
    def tree_unflatten(cls, static, arrays):
        return cls(*arrays, *static)


def _native_fp8_bwd(dimension_numbers, out_dtype, res, g):
    qa, sa, qb, sb = res.arrays
    lhs_shape, rhs_shape, lhs_dtype, rhs_dtype = res.static
    lc, rc, lfree, rfree = _canonical_dims(dimension_numbers, len(lhs_shape), len(rhs_shape))
    g2 = g.reshape(qa.shape[0], qb.shape[1])  # [M, N]
    qg, sg = quantize(g2, E5M2)
    # dA = g Bᵀ, dB = Aᵀ g: e5m2 x e4m3 GEMMs (the pair cuBLASLt accepts), f32 accumulation.
    da = _f8_matmul(qg, qb, ((1,), (1,))) * (sg * sb)  # [M, K]
    db = _f8_matmul(qa, qg, ((0,), (0,))) * (sa * sg)  # [K, N]
    dlhs = _from_2d(da, lhs_shape, lfree, lc, contract_last=True).astype(lhs_dtype)
    drhs = _from_2d(db, rhs_shape, rfree, rc, contract_last=False).astype(rhs_dtype)
    return dlhs, drhs


_native_fp8.defvjp(_native_fp8_fwd, _native_fp8_bwd)


def native_fp8_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    out_sharding=None,
) -> jax.Array:
    """Drop-in ``jax.lax.dot_general`` for projections with FP8 operands (native backend).

    Forward: both operands e4m3 with per-tensor current scaling, f32 accumulation, result in
    ``preferred_element_type`` (default: the promoted input dtype). Backward: the cotangent is
    quantised to e5m2 and both gradient GEMMs run in FP8. Inside :func:`no_fp8` it is plain
    ``dot_general``.

    Args:
      lhs: [..., K] (any layout without batch dims, e.g. activations [B, T, D]).
      rhs: [K, N] (e.g. a kernel [D, F]).
      dimension_numbers: ``((lhs_contract, rhs_contract), ((), ()))``; batch dims are rejected.
      precision: ignored (FP8 GEMMs have one precision).
      preferred_element_type: output dtype.
      out_sharding: must be None (sharding follows the operands).
    Returns:
      lhs free dims + rhs free dims, e.g. [B, T, F].
    """
    del precision
    if out_sharding is not None:
        raise NotImplementedError("native FP8 dot_general does not take out_sharding")
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype))
    if not fp8_enabled():
        return jax.lax.dot_general(
            lhs, rhs, dimension_numbers, preferred_element_type=preferred_element_type
        )
    dims = jax.tree.map(int, dimension_numbers)
    dims = tuple(tuple(tuple(d) for d in pair) for pair in dims)
    if sharding.explicit_mesh(lhs, rhs) is not None:
        # Explicit mesh axes: the quantisation and the FP8 GEMMs are laid out by XLA's
        # partitioner; the output like a plain projection's (sharding.projection_out_spec).
        if dims != (((lhs.ndim - 1,), (0,)), ((), ())) or rhs.ndim != 2:
            raise NotImplementedError(
                "native FP8 dot_general on Explicit mesh axes supports projections "
                f"x [..., in] @ W [in, out] only; got {dims=} for {lhs.shape=}, {rhs.shape=}. "
                "Use a mesh with Auto axes (jax.make_mesh(..., axis_types=(AxisType.Auto,) * n))"
            )
        fn = lambda a, b: _native_fp8(a, b, dims, out_dtype)
        return sharding.in_auto_axes(fn, sharding.projection_out_spec(lhs, rhs), lhs, rhs)
    return _native_fp8(lhs, rhs, dims, out_dtype)
