"""The TransformerEngine-JAX backend: TE's ``DenseGeneral`` bridged into NNX.

:class:`TEDense` runs under TE's autocast with ``DelayedScaling`` or ``Float8CurrentScaling``.
With ``DelayedScaling`` the amax histories and scales live in NNX state as :class:`FP8Meta`
variables; TE hands their new values back as their "gradient", and the train step writes them
back (:func:`split_fp8_meta_grads`). TE is imported lazily, only when this backend is used;
recipes the local GPU cannot run are rejected by :func:`check_recipe`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from gdn_jax.fp8.guard import _te_autocast_fn, _te_restore, _te_snapshot, fp8_enabled

__all__ = [
    "FP8Meta",
    "TEDense",
    "TEUnavailableError",
    "UnsupportedRecipeError",
    "check_recipe",
    "import_te",
    "make_recipe",
    "split_fp8_meta_grads",
    "te_autocast",
    "te_available",
]


class TEUnavailableError(RuntimeError):
    """fp8='te' was requested but TransformerEngine-JAX cannot be imported here."""


class UnsupportedRecipeError(ValueError):
    """The FP8 recipe cannot run on this GPU (or is not a TE-JAX recipe)."""


class FP8Meta(nnx.Variable):
    """TE's delayed-scaling metadata (amax history, scale) in NNX state.

    Not trained: the train step takes the "gradient" of these variables (TE returns their updated
    values there) and writes it back instead of handing it to the optimizer.
    """


_TE_COLLECTION = "fp8_metas"  # TE-JAX's NVTE_FP8_COLLECTION_NAME
nnx.register_variable_name(_TE_COLLECTION, FP8Meta, overwrite=True)


def import_te():
    """Import TransformerEngine-JAX, or raise :class:`TEUnavailableError` saying why.

    TE raises more than ImportError when the GPU stack is missing (OSError for libcuda, a
    RuntimeError for an old driver), hence ``except Exception``. Import TE (this function, or
    ``import transformer_engine.jax``) before JAX initialises the GPU: on the H200 image, TE
    imported after JAX's CUDA plugin has loaded its own cuDNN fails with ``OSError: ...
    libcudnn_heuristic.so.9: undefined symbol`` (two cuDNN builds in one process).

    Returns:
      (``transformer_engine.jax``, ``transformer_engine.jax.flax``,
      ``transformer_engine.common.recipe``).
    """
    try:
        import transformer_engine.jax as te
        import transformer_engine.jax.flax as te_flax
        from transformer_engine.common import recipe
    except Exception as e:
        raise TEUnavailableError(
            "fp8='te' needs TransformerEngine-JAX 2.20 on an NVIDIA GPU "
            "(pip install 'gdn-jax[te]'); importing it failed with "
            f"{type(e).__name__}: {e}"
        ) from e
    return te, te_flax, recipe


def te_available() -> tuple[bool, str]:
    """(True, "") when TE-JAX imports, else (False, the reason)."""
    try:
        import_te()
    except TEUnavailableError as e:
        return False, str(e)
    return True, ""


# recipe name -> (TE class name, minimum compute capability, what that is).
_RECIPES: dict[str, tuple[str, float, str]] = {
    "delayed": ("DelayedScaling", 8.9, "Ada/Hopper"),
    "current": ("Float8CurrentScaling", 8.9, "Ada/Hopper"),
    "mxfp8": ("MXFP8BlockScaling", 10.0, "Blackwell"),
    "nvfp4": ("NVFP4BlockScaling", 10.0, "Blackwell"),
}
_BY_CLASS = {cls: (name, cc, arch) for name, (cls, cc, arch) in _RECIPES.items()}


def _gpu_capability() -> tuple[float | None, str]:
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        return None, jax.devices()[0].device_kind
    d = gpus[0]
    return float(getattr(d, "compute_capability", "0") or 0), d.device_kind


def check_recipe(
    recipe: Any,
    *,
    compute_capability: float | str | None = None,
    device_kind: str | None = None,
) -> str:
    """Reject recipes this GPU cannot run, with the recipe and the GPU in the message.

    Args:
      recipe: a TE recipe object or class, or a name from ``make_recipe``.
      compute_capability: e.g. ``"9.0"``; default: the first local GPU's.
      device_kind: e.g. ``"NVIDIA H200"``; default: the first local GPU's.
    Returns:
      the recipe's TE class name.
    Raises:
      UnsupportedRecipeError: unknown recipe, no GPU, or a GPU too old for it (MXFP8 and NVFP4
        on Hopper).
    """
    if isinstance(recipe, str):
        if recipe not in _RECIPES:
            raise UnsupportedRecipeError(f"{recipe=}: expected one of {sorted(_RECIPES)}")
        cls_name = _RECIPES[recipe][0]
    else:
        cls_name = recipe.__name__ if isinstance(recipe, type) else type(recipe).__name__
    if cls_name not in _BY_CLASS:
        raise UnsupportedRecipeError(
            f"FP8 recipe {cls_name} is not supported by gdn_jax's TE backend; use one of "
            f"{sorted(_BY_CLASS)}"
        )
    _, need, arch = _BY_CLASS[cls_name]
    if compute_capability is None:
        found, kind = _gpu_capability()
        device_kind = device_kind or kind
    else:
        found = float(compute_capability)
    device_kind = device_kind or "this device"
    if found is None:
        raise UnsupportedRecipeError(
            f"FP8 recipe {cls_name} needs an NVIDIA GPU (compute capability >= {need}); "
            f"found {device_kind}"
        )
    if found < need:
        hint = " Use DelayedScaling or Float8CurrentScaling on Hopper." if found >= 8.9 else ""
        raise UnsupportedRecipeError(
            f"FP8 recipe {cls_name} needs compute capability >= {need} ({arch}); "
            f"{device_kind} has {found:.1f}.{hint}"
        )
    return cls_name


def make_recipe(name: str = "current", **kwargs):
    """A TE recipe by name (``"delayed"``, ``"current"``, ``"mxfp8"``, ``"nvfp4"``), checked
    against the local GPU. ``kwargs`` go to the recipe (e.g. ``amax_history_len=16``); the FP8
    format defaults to HYBRID (e4m3 forward, e5m2 backward)."""
    check_recipe(name)
    _, _, recipe_mod = import_te()
    cls = getattr(recipe_mod, _RECIPES[name][0])
    if name in ("delayed", "current"):
        kwargs.setdefault("fp8_format", recipe_mod.Format.HYBRID)
    return cls(**kwargs)


@contextlib.contextmanager
def te_autocast(recipe) -> Iterator[None]:
    """TE's autocast with ``recipe`` (checked against the GPU), restoring the enclosing state."""
    te, _, _ = import_te()
    check_recipe(recipe)
    snap = _te_snapshot()
    try:
        with _te_autocast_fn(te)(True, recipe):
            yield
    finally:
        _te_restore(snap)


class TEDense(nnx.Module):
    """A bias-free TE-JAX FP8 projection ``[..., in] -> [..., out]`` (the ``"te"`` backend).

    TE's Flax ``DenseGeneral`` bridged into NNX: its kernel is an ``nnx.Param`` (``[in, out]``,
    logical axes ``axes``), and with ``DelayedScaling`` its FP8 metadata are :class:`FP8Meta`
    variables. Every call runs under TE's autocast with this module's recipe.

    Args:
      in_features, out_features: sizes.
      axes: logical axis names of the kernel.
      recipe: a TE recipe object or a name for :func:`make_recipe` (default ``"current"``).
      dtype: compute dtype (inputs are cast to it); param_dtype: parameter dtype.
      kernel_init: initializer of the kernel (LeCun normal by default).
      rngs: init randomness.
    Raises:
      TEUnavailableError: TE cannot be imported. UnsupportedRecipeError: see :func:`check_recipe`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        axes: Sequence[str | None] = (None, None),
        *,
        recipe: Any = "current",
        dtype=None,
        param_dtype=jnp.float32,
        kernel_init=None,
        rngs: nnx.Rngs,
    ):
        _, te_flax, _ = import_te()
        self.recipe = make_recipe(recipe) if isinstance(recipe, str) else recipe
        check_recipe(self.recipe)
        self.in_features, self.out_features = in_features, out_features
        self.dtype = dtype
        module = te_flax.DenseGeneral(
            features=out_features,
            use_bias=False,
            kernel_init=kernel_init or nnx.initializers.lecun_normal(),
            kernel_axes=tuple(axes),
            dtype=param_dtype,
        )
        self.inner = nnx.bridge.ToNNX(module, rngs=rngs)
        # TE boxes its kernel with logical axes; NNX would place such a variable on a mesh at
        # creation (eager sharding) and fails outside one. Sharding is applied later by the
        # caller's rules (gdn_jax.sharding.shard_model), as for every other parameter.
        with te_autocast(self.recipe), nnx.use_eager_sharding(False):
            nnx.bridge.lazy_init(self.inner, jnp.zeros((1, in_features), dtype or param_dtype))
        # Applying needs no randomness; dropping the bridge's Rngs keeps the module's state to
        # Param (+ FP8Meta), which is what train steps split.
        self.inner.to_nnx__rngs = None

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., in] -> [..., out] in the compute dtype (TE's autocast is entered here)."""
        if self.dtype is not None:
            x = x.astype(self.dtype)
        if not fp8_enabled():
            kernel = self.inner.kernel[...].astype(x.dtype)
            return jnp.einsum("...i,io->...o", x, kernel)
        with te_autocast(self.recipe):
            return self.inner(x, mutable=[_TE_COLLECTION])


def split_fp8_meta_grads(grads: nnx.State) -> tuple[nnx.State, nnx.State]:
    """Split the gradient of (Param, FP8Meta) state into (param grads, new FP8 metadata).

    TE returns the updated amax history / scale of each delayed-scaling quantiser as the
    "gradient" of its metadata; the train step assigns it (``nnx.update(model, new_meta)``)
    and gives only the param grads to the optimizer.
    """
    meta, params = nnx.split_state(grads, FP8Meta, ...)
    return params, meta
