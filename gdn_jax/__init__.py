"""gdn_jax: Gated DeltaNet (GDN, GDN2, KDA) linear attention for JAX.

Chunked, trainable ops with a pure-JAX ``"xla"`` implementation that runs anywhere and Pallas
Mosaic GPU kernels (``"pallas"``) on Hopper GPUs.
"""

from gdn_jax import convert, models, nn, qat, reference
from gdn_jax.nn import GatedDeltaNet
from gdn_jax.ops import (
    gated_delta_rule,
    gated_delta_rule_step,
    gdn2,
    gdn2_step,
    kda,
    kda_step,
)

__all__ = [
    "GatedDeltaNet",
    "convert",
    "gated_delta_rule",
    "gated_delta_rule_step",
    "gdn2",
    "gdn2_step",
    "kda",
    "kda_step",
    "models",
    "nn",
    "qat",
    "reference",
]

__version__ = "0.1.0"
