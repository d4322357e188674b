"""The depthwise causal short convolution of GDN layers: its xla form and the Pallas kernels'
``custom_vjp`` (:mod:`pallas_kernels.short_conv`).

``y[t, c] = act(Σ_j w[j, c] · x[t − (W − 1) + j, c])``; tap W − 1 multiplies the current token,
taps that reach before a packed sequence's first token (or before ``tail``) read zeros.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

import pallas_kernels._compat as pk
from gdn_jax.reference._common import sequence_starts
from pallas_kernels import short_conv as kernels

__all__ = ["short_conv_xla", "short_conv_pallas"]

f32 = jnp.float32


def short_conv_xla(x, w, *, activation, cu_seqlens, tail, dtype) -> jax.Array:
    """The convolution in jnp, f32 sums, any activation (:func:`gdn_jax.ops.short_conv`)."""
    B, T, C = x.shape
    W = w.shape[0]
    if tail is None:
        # pad (not concatenate with zeros) keeps x's sharding under explicit meshes
        xp = jnp.pad(x, ((0, 0), (W - 1, 0), (0, 0)))
    else:
        from gdn_jax.sharding import laid_out_like

        xp = jnp.concatenate([laid_out_like(tail.astype(x.dtype), x), x], axis=1)
    w = w.astype(f32)
    xp = xp.astype(f32)
    if cu_seqlens is not None:
        start = sequence_starts(cu_seqlens, T)
        t = jnp.arange(T)
    y = jnp.zeros((B, T, C), f32)
    for j in range(W):
        tap = xp[:, j : j + T] * w[j]
        if cu_seqlens is not None:
            # tap j reads token t − (W − 1 − j): dropped if it precedes the sequence's start
            keep = (t - (W - 1 - j)) >= start
            tap = jnp.where(keep[None, :, None], tap, 0.0)
        y = y + tap
    if activation is not None:
        y = activation(y)
    return y.astype(dtype)


@dataclasses.dataclass(frozen=True)
class _Config:
    """activation: ``"silu"`` or None; dtype: y's dtype; mode: kernel execution mode."""

    activation: str | None
    dtype: jnp.dtype
    mode: str


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _conv(cfg: _Config, x, w, reach):
    return _conv_fwd(cfg, x, w, reach)[0]


# The kernel launches are jitted with the config static, so the convolutions of a model share one
# trace and one lowering of each kernel, and so one Mosaic GPU compile (as the GDN core's do).


@functools.partial(jax.jit, static_argnums=0)
def _launch_fwd(cfg: _Config, x, wb, reach):
    with pk.use_mode(cfg.mode):
        return kernels.short_conv_fwd(x, wb, reach, activation=cfg.activation, out_dtype=cfg.dtype)


@functools.partial(jax.jit, static_argnums=0)
def _launch_bwd(cfg: _Config, x, wb, reach, dy):
    with pk.use_mode(cfg.mode):
        return kernels.short_conv_bwd(x, wb, reach, dy, activation=cfg.activation)


def _conv_fwd(cfg: _Config, x, w, reach):
    W = w.shape[0]
    wb = jnp.broadcast_to(w.astype(f32)[:, None, :], (W, kernels.SUB, w.shape[1]))
    return _launch_fwd(cfg, x, wb, reach), (x, wb, reach, w)


def _conv_bwd(cfg: _Config, res, dy):
    x, wb, reach, w = res
    dx, dw = _launch_bwd(cfg, x, wb, reach, dy)
    return dx, dw.astype(w.dtype), None


_conv.defvjp(_conv_fwd, _conv_bwd)

_ACTIVATION_NAMES = {None: None, jax.nn.silu: "silu"}


def short_conv_pallas(x, w, *, activation: Callable | None, cu_seqlens, tail, dtype) -> jax.Array:
    """The convolution on the Mosaic GPU kernels; see :func:`gdn_jax.ops.short_conv`.

    On Explicit mesh axes the kernels run per shard (``shard_map``) when x is split over batch
    and channels only and the taps follow x's channels; a T split (context parallelism) needs the
    neighbouring shard's last tokens, which the xla form's partitioner exchanges.

    Raises:
      NotImplementedError: a decode tail, an activation other than SiLU or none, x not 16-bit,
        channels (per shard) not a multiple of 64, more than 4 taps, no Hopper GPU (and no
        interpreter), inputs on Auto mesh axes, or an Explicit layout other than the above.
    """
    from jax.sharding import PartitionSpec as P

    from gdn_jax.sharding import pallas_layout_error
    from gdn_jax.sharding._axes import _entry
    from gdn_jax.sharding.explicit import explicit_axes_of, explicit_mesh

    if tail is not None:
        raise NotImplementedError("a decode tail (extend) runs on 'xla'")
    if activation not in _ACTIVATION_NAMES:
        raise NotImplementedError(f"{activation=}: the kernels apply SiLU or nothing")
    if dtype not in (jnp.bfloat16, jnp.float16):
        raise NotImplementedError(f"{dtype=}: the kernels write bf16 or f16")
    mode = pk.execution_mode()
    if mode == "auto" and not pk.is_hopper():
        raise NotImplementedError("no Hopper GPU (and the Mosaic GPU interpreter not requested)")
    why = pallas_layout_error((x, w))
    if why is not None:
        raise NotImplementedError(why)
    B, T, C = x.shape
    W = w.shape[0]
    mesh = explicit_mesh(x, w)
    if mesh is not None:
        b_ax, t_ax, c_ax = explicit_axes_of(x)
        if t_ax or explicit_axes_of(w) != ((), c_ax):
            raise NotImplementedError(
                f"x laid out {(b_ax, t_ax, c_ax)} and the taps {explicit_axes_of(w)} on Explicit "
                "axes: the kernels run per shard of batch and channels, the taps split like x's "
                "channels"
            )
        shards = lambda axes: math.prod(mesh.shape[a] for a in axes)
        B, C = B // shards(b_ax), C // shards(c_ax)  # one shard's block
    reach = None
    if cu_seqlens is not None:
        dist = jnp.arange(T, dtype=jnp.int32) - sequence_starts(cu_seqlens, T)
        reach = jnp.broadcast_to(jnp.minimum(dist, W - 1)[:, None], (T, kernels.COLS))
        reach = reach.astype(jnp.int8)
    wb_shape = jax.ShapeDtypeStruct((W, kernels.SUB, C), f32)
    reach_shape = None if reach is None else jax.ShapeDtypeStruct(reach.shape, jnp.int8)
    block = jax.ShapeDtypeStruct((B, T, C), x.dtype)
    kernels.check(block, wb_shape, reach_shape, _ACTIVATION_NAMES[activation], T)
    cfg = _Config(_ACTIVATION_NAMES[activation], jnp.dtype(dtype), mode)
    if mesh is None:
        return _conv(cfg, x, w, reach)
    xs, ws = P(_entry(b_ax), None, _entry(c_ax)), P(None, _entry(c_ax))
    args, specs = (x, w), (xs, ws)
    if reach is not None:  # B == 1: the tokens' offsets are the same on every shard
        args, specs = (*args, reach), (*specs, P())
    # check_vma=False, as gdn_jax.sharding.shard_op: every shard runs the same program on its block
    return jax.shard_map(
        lambda x, w, *r: _conv(cfg, x, w, r[0] if r else None),
        mesh=mesh, in_specs=specs, out_specs=xs, check_vma=False,
    )(*args)  # fmt: skip
