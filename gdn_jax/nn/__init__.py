"""Flax NNX layers around the GDN core ops (DESIGN §5)."""

from gdn_jax.nn.gated_deltanet import GatedDeltaNet, GDNCache, Variant
from gdn_jax.nn.layers import GatedRMSNorm, RMSNorm, ShortConv, dense, partitioned
from gdn_jax.nn.linen import gated_deltanet_linen

__all__ = [
    "GatedDeltaNet",
    "GDNCache",
    "GatedRMSNorm",
    "RMSNorm",
    "ShortConv",
    "Variant",
    "dense",
    "gated_deltanet_linen",
    "partitioned",
]
