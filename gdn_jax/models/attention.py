"""Gated softmax attention (the full-attention layer of Qwen3-Next / Qwen3.5 hybrids).

``y = (softmax(q kᵀ / sqrt(d) + causal) v * sigmoid(x W_gate)) W_o`` with grouped-query attention,
per-head RMSNorm on q and k, and rotary embeddings on the first ``partial_rotary_factor`` of each
head's dims.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from flax.typing import Dtype
from jax.sharding import PartitionSpec as P

from gdn_jax import remat
from gdn_jax.nn.layers import EMBED, HEADS, KV_HEADS, RMSNorm, dense
from gdn_jax.sharding import (
    _entry,
    explicit_axes_of,
    explicit_mesh,
    in_auto_axes,
    laid_out_like,
)

__all__ = ["GatedAttention", "KVCache", "apply_rotary", "attention_implementation"]


class KVCache(NamedTuple):
    """Keys and values of the cached positions, [B, max_len, num_kv_heads, head_dim] each."""

    k: jax.Array
    v: jax.Array


def apply_rotary(x: jax.Array, positions: jax.Array, *, rotary_dim: int, theta: float) -> jax.Array:
    """Rotate the first ``rotary_dim`` dims of each head (half-split / GPT-NeoX pairing).

    Args:
      x: [B, T, N, Dh].
      positions: [B, T] int positions.
      rotary_dim: even number of rotated dims (<= Dh); the rest pass through.
      theta: RoPE base.
    Returns:
      [B, T, N, Dh] in x.dtype.
    """
    if rotary_dim == 0:
        return x
    half = rotary_dim // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, half]
    cos, sin = jnp.cos(angle)[:, :, None], jnp.sin(angle)[:, :, None]
    xr, xp = x[..., :rotary_dim].astype(jnp.float32), x[..., rotary_dim:]
    x1, x2 = xr[..., :half], xr[..., half:]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return jnp.concatenate([rotated.astype(x.dtype), xp], axis=-1)


def _write(cache: jax.Array, x: jax.Array, start) -> jax.Array:
    """``x`` written into ``cache`` at ``start``; on Explicit mesh axes in the cache's layout."""
    x = laid_out_like(x.astype(cache.dtype), cache)
    return jax.lax.dynamic_update_slice(laid_out_like(cache, cache, x), x, start)


def attention_implementation(q: jax.Array, k: jax.Array, mask: jax.Array | None) -> str | None:
    """``"cudnn"`` where cuDNN's flash attention serves ``q`` [B, T, N, Dh] and ``k``, else None
    (XLA's attention).

    cuDNN serves: a CUDA GPU backend, bf16/f16 inputs, a head dim that is a multiple of 8 and at
    most 128 (256 from Hopper on, as ``jax.nn.dot_product_attention`` requires), no explicit
    mask (causal or full attention), and no Explicit mesh axes on the inputs.
    """
    if mask is not None or q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype:
        return None
    if jax.default_backend() != "gpu" or explicit_mesh(q, k) is not None:
        return None
    capability = getattr(jax.devices()[0], "compute_capability", None)
    if capability is None:  # not a CUDA device
        return None
    head_max = 256 if tuple(int(x) for x in str(capability).split(".")) >= (9, 0) else 128
    Dh = q.shape[-1]
    return "cudnn" if Dh % 8 == 0 and Dh <= head_max else None


def _attend(q, k, v, *, mask, is_causal: bool = False):
    """``jax.nn.dot_product_attention``: cuDNN's flash attention where it serves the inputs
    (:func:`attention_implementation`), XLA's otherwise; on Explicit mesh axes XLA's partitioner
    lays out its grouped-head products and the output is laid out like q."""
    impl = attention_implementation(q, k, mask)
    if impl == "cudnn":
        try:
            return jax.nn.dot_product_attention(q, k, v, is_causal=is_causal, implementation=impl)
        except NotImplementedError:  # a shape cuDNN turns down (its own checks, at trace time)
            pass
    out = P(*(_entry(a) for a in explicit_axes_of(q)))
    fn = lambda q, k, v, mask: jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=is_causal)
    return in_auto_axes(fn, out, q, k, v, mask)


class GatedAttention(nnx.Module):
    """Causal grouped-query softmax attention with an output gate, ``[B, T, D] -> [B, T, D]``.

    Args:
      hidden_size: D.
      num_heads: query heads.
      num_kv_heads: key/value heads (divides ``num_heads``).
      head_dim: per-head dim.
      partial_rotary_factor: fraction of ``head_dim`` that gets rotary embeddings.
      rope_theta: RoPE base.
      norm_eps: epsilon of the q/k RMSNorms.
      zero_centered_norm: the q/k RMSNorms scale by ``1 + weight`` (Qwen3.5; see
        :class:`gdn_jax.nn.RMSNorm`).
      dtype: compute dtype; param_dtype: parameter dtype; rngs: init randomness.
      fp8, fp8_recipe: FP8 backend of the projections (gdn_jax.fp8).
    """

    def __init__(
        self,
        hidden_size: int,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        partial_rotary_factor: float = 0.25,
        rope_theta: float = 10_000_000.0,
        norm_eps: float = 1e-6,
        zero_centered_norm: bool = False,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        fp8: str | None = None,
        fp8_recipe: str = "current",
        rngs: nnx.Rngs,
    ):
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads=} must be a multiple of {num_kv_heads=}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        # Round down to an even count: dims rotate in pairs.
        self.rotary_dim = int(head_dim * partial_rotary_factor) // 2 * 2
        self.rope_theta = rope_theta
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        D, N, NKV, Dh = hidden_size, num_heads, num_kv_heads, head_dim
        pkw = dict(kw, fp8=fp8, fp8_recipe=fp8_recipe)  # projections may run in FP8
        self.q_proj = dense(D, N * Dh, (EMBED, HEADS), **pkw)
        self.gate_proj = dense(D, N * Dh, (EMBED, HEADS), **pkw)
        self.k_proj = dense(D, NKV * Dh, (EMBED, KV_HEADS), **pkw)
        self.v_proj = dense(D, NKV * Dh, (EMBED, KV_HEADS), **pkw)
        self.o_proj = dense(N * Dh, D, (HEADS, EMBED), **pkw)
        self.q_norm = RMSNorm(Dh, eps=norm_eps, zero_centered=zero_centered_norm, **kw)
        self.k_norm = RMSNorm(Dh, eps=norm_eps, zero_centered=zero_centered_norm, **kw)

    def __call__(
        self, x: jax.Array, *, positions: jax.Array, mask: jax.Array | None = None
    ) -> jax.Array:
        """Attend.

        Args:
          x: [B, T, D].
          positions: [B, T] rotary positions.
          mask: optional bool [B or 1, 1, T, T], True where query t may see key s; plain causal
            attention when omitted.
        Returns:
          [B, T, D].
        """
        q, k, v = self._qkv(x, positions)
        o = _attend(q, k, v.astype(q.dtype), mask=mask, is_causal=mask is None)
        return self._output(o, x)

    def _qkv(self, x, positions):
        B, T, _ = x.shape
        N, NKV, Dh = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_norm(self.q_proj(x).reshape(B, T, N, Dh))
        k = self.k_norm(self.k_proj(x).reshape(B, T, NKV, Dh))
        v = self.v_proj(x).reshape(B, T, NKV, Dh)
        rope = dict(rotary_dim=self.rotary_dim, theta=self.rope_theta)
        return apply_rotary(q, positions, **rope), apply_rotary(k, positions, **rope), v

    def _output(self, o, x):
        B, T, _ = x.shape
        gate = jax.nn.sigmoid(self.gate_proj(x).astype(jnp.float32))
        o = (o.reshape(B, T, -1).astype(jnp.float32) * gate).astype(o.dtype)
        return remat.name(self.o_proj(o), remat.MIXER_OUT)

    def init_cache(self, batch_size: int, max_len: int, dtype: Dtype = jnp.float32) -> KVCache:
        """An empty key/value cache for up to ``max_len`` positions."""
        shape = (batch_size, max_len, self.num_kv_heads, self.head_dim)
        return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

    def extend(self, x: jax.Array, cache: KVCache, pos: jax.Array) -> tuple[jax.Array, KVCache]:
        """Append T tokens at positions ``pos .. pos + T - 1`` (prefill or decode).

        Args:
          x: [B, T, D].
          cache: from :meth:`init_cache`; positions ``< pos`` hold the prefix.
          pos: int32 scalar, the number of tokens already cached (``pos + T <= max_len``).
        Returns:
          y [B, T, D] and the updated cache.
        """
        B, T, _ = x.shape
        t = pos + jnp.arange(T, dtype=jnp.int32)
        q, k, v = self._qkv(x, jnp.broadcast_to(t, (B, T)))
        start = (0, pos, 0, 0)
        cache = KVCache(
            k=_write(cache.k, k, start),
            v=_write(cache.v, v, start),
        )
        # Query at position t sees cached keys at positions <= t (later slots are empty).
        mask = (jnp.arange(cache.k.shape[1])[None, :] <= t[:, None])[None, None]
        o = _attend(q, cache.k.astype(q.dtype), cache.v.astype(q.dtype), mask=mask)
        return self._output(o, x), cache
