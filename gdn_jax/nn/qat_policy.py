"""Setting a :class:`gdn_jax.qat.QATPolicy` on the GDN layers of a model.

Lives beside the layers it walks, so that :mod:`gdn_jax.qat` (used by the ops) imports nothing
from :mod:`gdn_jax.nn`.
"""

from __future__ import annotations

from flax import nnx

from gdn_jax.nn.gated_deltanet import GatedDeltaNet
from gdn_jax.qat import QATConfig, QATPolicy

__all__ = ["apply_qat_policy", "module_path"]


def module_path(path: tuple) -> str:
    """Dotted name of an NNX module path, e.g. ``("layers", 0, "mixer") -> "layers.0.mixer"``."""
    return ".".join(str(p) for p in path)


def apply_qat_policy(model: nnx.Module, policy: QATPolicy) -> dict[str, QATConfig | None]:
    """Sets ``qat`` on every GDN layer of an NNX model from ``policy`` (last match wins).

    Args:
      model: an ``nnx.Module`` holding :class:`gdn_jax.nn.GatedDeltaNet` layers.
      policy: the rules; modules no rule matches get None (QAT off).
    Returns:
      The resolved ``{module path: config}`` of every GDN layer.
    """
    resolved = {}
    for path, module in nnx.iter_modules(model):
        if isinstance(module, GatedDeltaNet):
            name = module_path(path)
            module.qat = resolved[name] = policy.resolve(name)
    return resolved
