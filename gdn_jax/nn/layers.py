"""Building blocks of the GDN layer: projections, the short causal conv, RMS norms.

Every parameter carries logical axis names through ``nnx.with_partitioning`` (the names are the
constants below); ``nnx.logical_axis_rules`` maps them to mesh axes. Head-major flattened
feature dimensions (``H * K``, ``HV * V``, ``HV``) all use :data:`HEADS`, so a mesh axis that
divides the head count splits them on head boundaries.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from flax.typing import Dtype, Initializer

from gdn_jax import fp8 as fp8_lib
from gdn_jax import ops
from gdn_jax.reference._common import sequence_starts
from gdn_jax.sharding.model_rules import CONV_TAPS, EMBED, HEADS, KV_HEADS, MLP, NORM, VOCAB

__all__ = [
    "EMBED",
    "HEADS",
    "KV_HEADS",
    "MLP",
    "VOCAB",
    "NORM",
    "CONV_TAPS",
    "partitioned",
    "dense",
    "ShortConv",
    "RMSNorm",
    "GatedRMSNorm",
    "sequence_starts",
]

# The logical axis names of the parameters (EMBED, HEADS, ...) are defined beside the rules that
# map them to mesh axes (gdn_jax.sharding.model_rules) and re-exported here.


def partitioned(init: Initializer, axes: Sequence[str | None]) -> Initializer:
    """``nnx.with_partitioning`` that builds without a mesh.

    Flax 0.12 shards annotated variables eagerly and then demands a mesh; we keep eager sharding
    when a mesh is active (``jax.set_mesh`` + ``nnx.logical_axis_rules``) and only record the names
    otherwise, so layers can be built and tested on one device.
    """
    eager = nnx.using_eager_sharding() and not jax.sharding.get_abstract_mesh().empty
    return nnx.with_partitioning(init, tuple(axes), eager_sharding=eager)


def dense(
    in_features: int,
    out_features: int,
    axes: tuple[str | None, str | None],
    *,
    dtype: Dtype | None,
    param_dtype: Dtype,
    rngs: nnx.Rngs,
    kernel_init: Initializer | None = None,
    fp8: fp8_lib.Backend = None,
    fp8_recipe: str = "current",
) -> nnx.Module:
    """A bias-free projection ``[..., in] -> [..., out]`` with kernel axes ``axes``.

    ``kernel_init`` defaults to LeCun normal (std ``in_features**-0.5``). ``fp8``: ``None``
    (compute dtype), ``"native"`` (JAX FP8 ``dot_general``) or ``"te"`` (TransformerEngine
    ``TEDense`` with ``fp8_recipe``); see :mod:`gdn_jax.fp8`.
    """
    kernel_init = kernel_init or nnx.initializers.lecun_normal()
    if fp8 == "te":
        return fp8_lib.TEDense(
            in_features, out_features, axes, recipe=fp8_recipe, dtype=dtype,
            param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs,
        )  # fmt: skip
    return nnx.Linear(
        in_features,
        out_features,
        use_bias=False,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=partitioned(kernel_init, axes),
        # The plain dot_general is made Explicit-axis aware here; the native FP8 one lays itself
        # out (gdn_jax.fp8.native); TE dot_generals are not covered on Explicit axes.
        dot_general=_projection(jax.lax.dot_general) if fp8 is None else fp8_lib.dot_general(fp8),
        rngs=rngs,
    )


@functools.cache
def _projection(dot_general):
    # One wrapped function per dot_general, so identical layers keep identical graphdefs.
    from gdn_jax.sharding import projection_dot_general

    laid_out = projection_dot_general(dot_general)

    @functools.wraps(laid_out)
    def dg(lhs, rhs, dimension_numbers, *args, **kwargs):
        (contract, _), (batch, _) = dimension_numbers
        if (
            lhs.ndim < 2
            or batch
            or math.prod(lhs.shape[:-1]) != 1
            or tuple(contract) != (lhs.ndim - 1,)
        ):
            return laid_out(lhs, rhs, dimension_numbers, *args, **kwargs)
        # XLA's GPU pipeline turns a one-row product (a decode step at batch 1) into a multiply
        # and a column reduction, several times slower than the B8 step (decode rows of
        # benchmarks/bench_hf.py). Two rows keep it a matrix product; the barrier stops XLA from
        # seeing through the zero row.
        two = jax.lax.optimization_barrier(jnp.concatenate([lhs, jnp.zeros_like(lhs)], axis=0))
        return laid_out(two, rhs, dimension_numbers, *args, **kwargs)[:1]

    return dg


def _like(x, ref):
    from gdn_jax.sharding import laid_out_like

    return laid_out_like(x, ref)


def project(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """``x [..., in] @ kernel [in, out]`` as the projections compute it (also on Explicit axes)."""
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    return _projection(jax.lax.dot_general)(x, kernel, dims)


def _uniform_fan_in(fan_in: int) -> Initializer:
    # PyTorch's Conv1d default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
    bound = fan_in**-0.5

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


class ShortConv(nnx.Module):
    """Depthwise causal 1-D convolution over time followed by an activation (SiLU by default).

    ``y[t, c] = act(sum_j weight[j, c] * x[t - (kernel_size - 1) + j, c])``: the last tap multiplies
    the current token (the orientation of a PyTorch ``Conv1d(padding=kernel_size - 1)`` truncated to
    the first T outputs). Packed sequences (``cu_seqlens``) never see each other's tokens.
    ``implementation`` picks :func:`gdn_jax.ops.short_conv`'s (None: the Pallas kernels on a
    Hopper GPU where they serve the call, else xla).
    """

    def __init__(
        self,
        channels: int,
        *,
        kernel_size: int = 4,
        activation: Callable[[jax.Array], jax.Array] | None = jax.nn.silu,
        axis_name: str | None = HEADS,
        implementation: str | Sequence[str] | None = None,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        if kernel_size < 1:
            raise ValueError(f"{kernel_size=} must be >= 1")
        self.channels = channels
        self.kernel_size = kernel_size
        self.activation = activation
        self.implementation = implementation
        self.dtype = dtype
        init = partitioned(_uniform_fan_in(kernel_size), (CONV_TAPS, axis_name))
        self.weight = nnx.Param(init(rngs.params(), (kernel_size, channels), param_dtype))

    def __call__(
        self,
        x: jax.Array,
        *,
        cu_seqlens: jax.Array | None = None,
        tail: jax.Array | None = None,
    ) -> jax.Array:
        """Convolve a sequence.

        Args:
          x: [B, T, C].
          cu_seqlens: optional [N + 1] int32 boundaries of packed sequences (B == 1).
          tail: optional [B, kernel_size - 1, C], the inputs preceding ``x`` (decode cache);
            zeros when omitted.
        Returns:
          [B, T, C] in ``dtype`` (or x.dtype).
        """
        if x.ndim != 3 or x.shape[-1] != self.channels:
            raise ValueError(f"{x.shape=}: expected [B, T, channels={self.channels}]")
        return ops.short_conv(
            x,
            self.weight[...],
            activation=self.activation,
            cu_seqlens=cu_seqlens,
            tail=tail,
            dtype=self.dtype or x.dtype,
            implementation=self.implementation,
        )

    def next_tail(self, x: jax.Array, tail: jax.Array) -> jax.Array:
        """The last ``kernel_size - 1`` inputs after appending ``x`` [B, T, C] to ``tail``."""
        xp = jnp.concatenate([_like(tail, x), x.astype(tail.dtype)], axis=1)
        return xp[:, xp.shape[1] - (self.kernel_size - 1) :]


def _rms(x: jax.Array, eps: float) -> jax.Array:
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last axis, in f32; weight starts at 1.

    With ``zero_centered=True`` the scale is ``1 + weight`` and the weight starts at 0 (Qwen3.5's
    decoder, final and q/k norms; the stored weight is the checkpoint's). Both forms compute the
    same function at init.
    """

    def __init__(
        self,
        dim: int,
        *,
        eps: float = 1e-6,
        zero_centered: bool = False,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        del rngs  # deterministic init; kept for the uniform constructor signature
        self.eps = eps
        self.zero_centered = zero_centered
        self.dtype = dtype
        init = nnx.initializers.zeros if zero_centered else nnx.initializers.ones
        self.weight = nnx.Param(partitioned(init, (NORM,))(None, (dim,), param_dtype))

    def _scale(self) -> jax.Array:
        w = self.weight[...].astype(jnp.float32)
        return 1.0 + w if self.zero_centered else w

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., dim] -> [..., dim] in ``dtype`` (or x.dtype)."""
        y = _rms(x, self.eps) * self._scale()
        return y.astype(self.dtype or x.dtype)


class GatedRMSNorm(RMSNorm):
    """The GDN output norm: ``RMSNorm(o) * silu(z)`` over the last (value head) axis, in f32.

    The weight starts at 1 and multiplies directly (not ``1 + w``), as in Qwen3-Next/Qwen3.5.
    """

    def __call__(self, x: jax.Array, z: jax.Array) -> jax.Array:  # type: ignore[override]
        """x, z: [..., dim] -> [..., dim] in ``dtype`` (or x.dtype)."""
        y = _rms(x, self.eps) * self._scale()
        y = y * jax.nn.silu(z.astype(jnp.float32))
        return y.astype(self.dtype or x.dtype)
