"""gdn_jax: Gated DeltaNet (GDN, GDN2, KDA) linear attention for JAX.

Chunked, trainable ops with a pure-JAX ``"xla"`` implementation that runs anywhere and Pallas
Mosaic GPU kernels (``"pallas"``) on Hopper GPUs.
"""

from gdn_jax import checks, convert, fp8, models, nn, qat, reference, remat
from gdn_jax.checks import checked
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
    "checked",
    "checks",
    "convert",
    "fp8",
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
    "remat",
    "sharding",
]

# Imported on first use: ``gdn_jax.sharding`` pulls in the shard_map machinery.
_LAZY = ("sharding",)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return importlib.import_module(f"gdn_jax.{name}")
    raise AttributeError(f"module 'gdn_jax' has no attribute {name!r}")


__version__ = "0.1.0"
