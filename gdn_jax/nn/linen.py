"""Linen adapter: the NNX layers as ``flax.linen`` modules, through ``nnx.bridge``."""

from __future__ import annotations

from typing import Any

from flax import linen, nnx

from gdn_jax.nn.gated_deltanet import GatedDeltaNet

__all__ = ["gated_deltanet_linen"]


def gated_deltanet_linen(
    hidden_size: int, *, name: str | None = None, **kwargs: Any
) -> linen.Module:
    """A ``linen.Module`` running :class:`GatedDeltaNet` (same arguments, without ``rngs``).

    Parameters live in the Linen ``params`` collection under the NNX attribute names
    (``q_proj/kernel``, ``A_log``, ...), boxed as ``nnx.bridge.NNXMeta`` whose metadata keeps the
    logical axis names (``out_sharding``), and are drawn from the Linen ``params`` RNG at ``init``.

    Example:
      >>> layer = gated_deltanet_linen(64, num_heads=2, head_dim=16)
      >>> variables = layer.init(jax.random.key(0), x)            # x: [B, T, 64]
      >>> y = layer.apply(variables, x)                           # or (x, cu_seqlens=...)
    """
    return nnx.bridge.to_linen(GatedDeltaNet, hidden_size, name=name, **kwargs)
