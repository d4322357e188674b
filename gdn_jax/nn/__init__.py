"""Flax NNX layers around the GDN core ops."""

from gdn_jax.nn.gated_deltanet import GatedDeltaNet, GDNCache, Variant
from gdn_jax.nn.layers import GatedRMSNorm, RMSNorm, ShortConv, dense, partitioned
from gdn_jax.nn.linen import gated_deltanet_linen
from gdn_jax.nn.qat_policy import apply_qat_policy

__all__ = [
    "GatedDeltaNet",
    "GDNCache",
    "GatedRMSNorm",
    "RMSNorm",
    "ShortConv",
    "Variant",
    "apply_qat_policy",
    "dense",
    "gated_deltanet_linen",
    "partitioned",
]
