"""Chunk-local cumsum of the per-channel log-decay (GDN2 / KDA pallas glue), on a Mosaic GPU kernel.

:func:`lane_gate_cumsum` runs :func:`pallas_kernels.channel.gate_cumsum.chunk_cumsum` inside a
``custom_vjp`` whose backward is the same kernel with ``reverse=True``: the cumsum is linear, so
its VJP is its transpose, the suffix sum within each chunk. Both read and write the tensor once,
where XLA's form (:func:`gdn_jax.reference.chunked.gate_cumsum`, an f32 product with a triangular
ones matrix) and its autodiff cost several times the bytes' time.

Where the kernel does not serve the call (no Hopper GPU and no kernel execution mode asked for,
``HV·K % 128 != 0``, another rank or dtype), XLA's form runs instead, so the channel kernels keep
serving every head size they take.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gdn_jax.ops._pallas_common import chunk_first_rows
from gdn_jax.ops._sanitize import log_decay
from gdn_jax.reference.chunked import gate_cumsum
from pallas_kernels import _compat as pk
from pallas_kernels._tiles import CHUNK
from pallas_kernels.channel import gate_cumsum as kernel

__all__ = ["clamped_log_decay", "lane_gate_cumsum", "kernel_serves"]


def kernel_serves(g: jax.Array) -> bool:
    """Whether :func:`lane_gate_cumsum` runs the Mosaic GPU kernel for ``g`` (shape, dtype and
    platform; see :func:`pallas_kernels.channel.gate_cumsum.check`)."""
    if pk.execution_mode() == "auto" and not pk.is_hopper():
        return False
    try:
        kernel.check(g)
    except (ValueError, NotImplementedError):
        return False
    return True


def clamped_log_decay(g: jax.Array, floor: float) -> jax.Array:
    """The raw log-decay g sanitised (:func:`gdn_jax.ops._sanitize.log_decay`: NaN and −inf to
    its floor, +inf and growth to 0) and clamped at ``floor``: values in [floor, 0], f32. Its
    derivative is the composition's (1 inside, 0 outside, ½ at ``floor`` itself, as
    ``jnp.maximum``'s)."""
    return jnp.maximum(log_decay(g), floor)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _kernel_cumsum(g: jax.Array, floor: float | None):
    return kernel.chunk_cumsum(g, floor=floor)


def _kernel_cumsum_fwd(g, floor):
    return kernel.chunk_cumsum(g, floor=floor), (None if floor is None else g)


def _kernel_cumsum_bwd(floor, g, cts):
    dG = cts if floor is None else cts[0]  # (the bad-value rows are not differentiated)
    dg = kernel.chunk_cumsum(dG.astype(jnp.float32), reverse=True)
    if floor is not None:  # the clamp's VJP, one elementwise XLA pass
        dg = jax.vjp(lambda x: clamped_log_decay(x, floor), g)[1](dg)[0]
    return (dg,)


_kernel_cumsum.defvjp(_kernel_cumsum_fwd, _kernel_cumsum_bwd)


def lane_gate_cumsum(g: jax.Array, floor: float | None = None):
    """Chunk-local inclusive cumsum over the row axis of padded lanes, differentiable.

    Args:
      g: [N, Tp, HV, K] f32 per-token log-decay, Tp % 64 == 0 (other [N, Tp, ...] f32 shapes
        take XLA's form).
      floor: if given, g is the op's raw log-decay: the cumsum is that of
        :func:`clamped_log_decay` (g, floor), the kernel clamping each value as it reads it (so
        the raw g needs no clamped copy), and the rows holding NaN or +inf come with it.
    Returns:
      G: g's shape, f32; ``G[:, 64 c + i] = Σ_{j ≤ i} g[:, 64 c + j]`` for each chunk c. With
      ``floor`` the pair (G, first_bad): first_bad [N, HV, Tp/64] f32, per chunk the first row
      (0 … 63) where some channel of the head's raw g is NaN or +inf, 64 where none is (the
      op's poison, :mod:`gdn_jax.ops._sanitize`).
    """
    if kernel_serves(g):
        out = _kernel_cumsum(g, floor)
        if floor is None:
            return out
        G, first = out
        return G, jnp.min(first, axis=-1).transpose(0, 2, 1)
    if floor is None:
        bad = None
    else:
        bad = jnp.any(~(g < jnp.inf), axis=tuple(range(3, g.ndim)))  # NaN, +inf: [N, Tp, HV]
        g = clamped_log_decay(g, floor)
    N, Tp = g.shape[:2]
    G = gate_cumsum(g.reshape((N, Tp // CHUNK, CHUNK) + g.shape[2:])).reshape(g.shape)
    return G if bad is None else (G, chunk_first_rows(bad, 1).transpose(0, 2, 1))
