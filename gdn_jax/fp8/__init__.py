"""FP8 projections: a native JAX backend, a TransformerEngine-JAX backend, and the core guard.

Backends, chosen per projection:

* ``None``: the projection runs in its compute dtype (bf16/f32); :func:`dot_general` returns
  ``jax.lax.dot_general``.
* ``"native"``: :func:`native_fp8_dot_general` (:mod:`gdn_jax.fp8.native`), e4m3 operands with
  per-tensor current scaling forward, e5m2 cotangents backward; runs anywhere, cuBLASLt FP8 GEMMs
  on Hopper.
* ``"te"``: :class:`TEDense` (:mod:`gdn_jax.fp8.te_bridge`), TransformerEngine-JAX's
  ``DenseGeneral`` in NNX under TE's autocast.

The GDN core never sees FP8: wrap the core call with :func:`no_fp8` / :func:`fp8_free`
(:mod:`gdn_jax.fp8.guard`). :func:`convert_projections` (:mod:`gdn_jax.fp8.projections`) switches
every ``nnx.Linear`` of a built model to a backend.
"""

from gdn_jax.fp8.guard import fp8_enabled, fp8_free, no_fp8
from gdn_jax.fp8.native import E4M3, E5M2, native_fp8_dot_general, quantize
from gdn_jax.fp8.projections import BACKENDS, Backend, convert_projections, dot_general
from gdn_jax.fp8.te_bridge import (
    FP8Meta,
    TEDense,
    TEUnavailableError,
    UnsupportedRecipeError,
    check_recipe,
    import_te,
    make_recipe,
    split_fp8_meta_grads,
    te_autocast,
    te_available,
)

__all__ = [
    "Backend",
    "BACKENDS",
    "E4M3",
    "E5M2",
    "FP8Meta",
    "TEDense",
    "TEUnavailableError",
    "UnsupportedRecipeError",
    "check_recipe",
    "convert_projections",
    "dot_general",
    "fp8_enabled",
    "fp8_free",
    "import_te",
    "make_recipe",
    "native_fp8_dot_general",
    "no_fp8",
    "quantize",
    "split_fp8_meta_grads",
    "te_available",
    "te_autocast",
]
