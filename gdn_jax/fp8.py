"""FP8 projections: a native JAX backend, a TransformerEngine-JAX backend, and the core guard.

Backends (DESIGN §5), chosen per projection:

* ``None``: the projection runs in its compute dtype (bf16/f32); :func:`dot_general` returns
  ``jax.lax.dot_general``.
* ``"native"``: :func:`native_fp8_dot_general`, a ``jax.custom_vjp`` that quantises both operands
  to ``float8_e4m3fn`` with per-tensor *current* scaling (the scale comes from this call's amax),
  multiplies with f32 accumulation and rescales; the backward quantises the output cotangent to
  ``float8_e5m2`` and runs both gradient GEMMs in FP8 (e5m2 x e4m3). It runs on a CPU; on Hopper
  XLA turns the f8 ``dot_general`` into cuBLASLt FP8 GEMMs. Stateless: nothing to carry.
* ``"te"``: :class:`TEDense`, TransformerEngine-JAX's ``DenseGeneral`` bridged into NNX, under
  TE's autocast with ``DelayedScaling`` or ``Float8CurrentScaling``. With ``DelayedScaling`` the
  amax histories and scales live in NNX state as :class:`FP8Meta` variables; TE hands their new
  values back as their "gradient", and the train step writes them back
  (:func:`split_fp8_meta_grads`). TE is imported lazily, only when this backend is used.

The GDN core never sees FP8: wrap the core call with :func:`no_fp8` / :func:`fp8_free`. Inside,
native projections fall back to their compute dtype, TE's autocast is disabled, FP8 inputs are
upcast, and on exit (normal or exceptional) any enclosing TE autocast state is restored.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx

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

Backend = Literal["native", "te"] | None
BACKENDS: tuple[Backend, ...] = (None, "native", "te")

E4M3 = jnp.float8_e4m3fn  # forward operands: 3 mantissa bits, max 448
E5M2 = jnp.float8_e5m2  # gradients: 2 mantissa bits, max 57344 (range over precision)

# True inside no_fp8(): projections traced there stay in their compute dtype.
_FP8_OFF: contextvars.ContextVar[bool] = contextvars.ContextVar("gdn_jax_fp8_off", default=False)


def fp8_enabled() -> bool:
    """Whether FP8 projections traced now may quantise (False inside :func:`no_fp8`)."""
    return not _FP8_OFF.get()


def _is_fp8(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits == 8


# -- native backend -----------------------------------------------------------------------------


def quantize(x: jax.Array, dtype=E4M3) -> tuple[jax.Array, jax.Array]:
    """Per-tensor current scaling: ``x ≈ q * scale`` with ``amax(|x|)`` mapped to the FP8 max.

    Args:
      x: any shape, any float dtype.
      dtype: ``float8_e4m3fn`` or ``float8_e5m2``.
    Returns:
      q (x.shape, ``dtype``) and scale (scalar f32, > 0).
    """
    fmax = float(jnp.finfo(dtype).max)
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
    # An all-zero (or non-finite) tensor keeps scale 1 so that q stays 0 / propagates inf, nan.
    scale = jnp.where((amax > 0) & jnp.isfinite(amax), amax / fmax, 1.0).astype(jnp.float32)
    # Clip before the cast: e4m3fn has no inf, an overflow would turn into nan.
    q = jnp.clip(x.astype(jnp.float32) / scale, -fmax, fmax).astype(dtype)
    return q, scale


def _canonical_dims(dimension_numbers, lhs_ndim: int, rhs_ndim: int):
    """Permutations that bring a batch-free dot_general to ``[M, K] @ [K, N]``."""
    (lc, rc), (lb, rb) = dimension_numbers
    if lb or rb:
        raise NotImplementedError(
            f"native FP8 dot_general supports projections only (no batch dims); got "
            f"{dimension_numbers=}"
        )
    lc, rc = tuple(int(d) % lhs_ndim for d in lc), tuple(int(d) % rhs_ndim for d in rc)
    lfree = tuple(d for d in range(lhs_ndim) if d not in lc)
    rfree = tuple(d for d in range(rhs_ndim) if d not in rc)
    return lc, rc, lfree, rfree


def _to_2d(x, free, contract, contract_last: bool):
    perm = free + contract if contract_last else contract + free
    shape = x.shape
    m = math.prod(shape[d] for d in free)
    k = math.prod(shape[d] for d in contract)
    x = jnp.transpose(x, perm)
    return x.reshape((m, k) if contract_last else (k, m))


def _from_2d(x2, shape, free, contract, contract_last: bool):
    perm = free + contract if contract_last else contract + free
    x = x2.reshape(tuple(shape[d] for d in perm))
    inv = [0] * len(perm)
    for i, d in enumerate(perm):
        inv[d] = i
    return jnp.transpose(x, inv)


def _f8_matmul(a, b, dims):
    # FP8 operands, f32 accumulation and output: one cuBLASLt FP8 GEMM on Hopper.
    return jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _native_fp8(lhs, rhs, dimension_numbers, out_dtype):
    out, _ = _native_fp8_fwd(lhs, rhs, dimension_numbers, out_dtype)
    return out


def _native_fp8_fwd(lhs, rhs, dimension_numbers, out_dtype):
    lc, rc, lfree, rfree = _canonical_dims(dimension_numbers, lhs.ndim, rhs.ndim)
    a = _to_2d(lhs, lfree, lc, contract_last=True)  # [M, K]
    b = _to_2d(rhs, rfree, rc, contract_last=False)  # [K, N]
    qa, sa = quantize(a, E4M3)
    qb, sb = quantize(b, E4M3)
    y = _f8_matmul(qa, qb, ((1,), (0,))) * (sa * sb)
    out_shape = tuple(lhs.shape[d] for d in lfree) + tuple(rhs.shape[d] for d in rfree)
    y = y.reshape(out_shape).astype(out_dtype)
    # FP8 residuals: one byte per element instead of two (what TE saves too).
    res = (qa, sa, qb, sb, lhs.shape, rhs.shape, jnp.dtype(lhs.dtype), jnp.dtype(rhs.dtype))
    return y, _Residuals(*res)


@jax.tree_util.register_pytree_node_class
class _Residuals:
    """FP8 operands, their scales, and the static shapes/dtypes to restore (a pytree)."""

    def __init__(self, qa, sa, qb, sb, lhs_shape, rhs_shape, lhs_dtype, rhs_dtype):
        self.arrays = (qa, sa, qb, sb)
        self.static = (lhs_shape, rhs_shape, lhs_dtype, rhs_dtype)

    def tree_flatten(self):
        return self.arrays, self.static

    @classmethod
    def tree_unflatten(cls, static, arrays):
        return cls(*arrays, *static)


def _native_fp8_bwd(dimension_numbers, out_dtype, res, g):
    qa, sa, qb, sb = res.arrays
    lhs_shape, rhs_shape, lhs_dtype, rhs_dtype = res.static
    lc, rc, lfree, rfree = _canonical_dims(dimension_numbers, len(lhs_shape), len(rhs_shape))
    g2 = g.reshape(qa.shape[0], qb.shape[1])  # [M, N]
    qg, sg = quantize(g2, E5M2)
    # dA = g Bᵀ, dB = Aᵀ g: e5m2 x e4m3 GEMMs (the pair cuBLASLt accepts), f32 accumulation.
    da = _f8_matmul(qg, qb, ((1,), (1,))) * (sg * sb)  # [M, K]
    db = _f8_matmul(qa, qg, ((0,), (0,))) * (sa * sg)  # [K, N]
    dlhs = _from_2d(da, lhs_shape, lfree, lc, contract_last=True).astype(lhs_dtype)
    drhs = _from_2d(db, rhs_shape, rfree, rc, contract_last=False).astype(rhs_dtype)
    return dlhs, drhs


_native_fp8.defvjp(_native_fp8_fwd, _native_fp8_bwd)


def native_fp8_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    out_sharding=None,
) -> jax.Array:
    """Drop-in ``jax.lax.dot_general`` for projections with FP8 operands (native backend).

    Forward: both operands e4m3 with per-tensor current scaling, f32 accumulation, result in
    ``preferred_element_type`` (default: the promoted input dtype). Backward: the cotangent is
    quantised to e5m2 and both gradient GEMMs run in FP8. Inside :func:`no_fp8` it is plain
    ``dot_general``.

    Args:
      lhs: [..., K] (any layout without batch dims, e.g. activations [B, T, D]).
      rhs: [K, N] (e.g. a kernel [D, F]).
      dimension_numbers: ``((lhs_contract, rhs_contract), ((), ()))``; batch dims are rejected.
      precision: ignored (FP8 GEMMs have one precision).
      preferred_element_type: output dtype.
      out_sharding: must be None (sharding follows the operands).
    Returns:
      lhs free dims + rhs free dims, e.g. [B, T, F].
    """
    del precision
    if out_sharding is not None:
        raise NotImplementedError("native FP8 dot_general does not take out_sharding")
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype))
    if not fp8_enabled():
        return jax.lax.dot_general(
            lhs, rhs, dimension_numbers, preferred_element_type=preferred_element_type
        )
    dims = jax.tree.map(int, dimension_numbers)
    dims = tuple(tuple(tuple(d) for d in pair) for pair in dims)
    return _native_fp8(lhs, rhs, dims, out_dtype)


def dot_general(backend: Backend) -> Callable[..., jax.Array]:
    """The ``dot_general`` a projection (``nnx.Linear(dot_general=...)``) uses for ``backend``.

    ``"te"`` is a module, not a dot_general: use :class:`TEDense` (or :func:`convert_projections`).
    """
    table: dict[Backend, Callable[..., jax.Array]] = {
        None: jax.lax.dot_general,
        "native": native_fp8_dot_general,
    }
    if backend not in table:
        if backend == "te":
            raise ValueError("fp8='te' projections are TEDense modules, not a dot_general")
        raise ValueError(f"{backend=}: expected one of {BACKENDS}")
    return table[backend]


# -- TransformerEngine-JAX backend --------------------------------------------------------------


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


def _te_autocast_fn(te):
    # TE 2.x: autocast(enabled, recipe, mesh_resource); older: fp8_autocast(enabled, fp8_recipe).
    if hasattr(te, "autocast"):
        return lambda enabled, recipe=None: te.autocast(enabled=enabled, recipe=recipe)
    return lambda enabled, recipe=None: te.fp8_autocast(enabled=enabled, fp8_recipe=recipe)


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


# Where TE keeps its autocast state differs between releases (class attributes of
# QuantizeConfig, a module-global config object, or a global that autocast swaps). We snapshot
# all three forms from the modules below and put them back verbatim, because some TE releases
# *reset* the config when an inner autocast exits instead of restoring the outer one.
_TE_STATE_MODULES = ("transformer_engine.jax.quantize.helper", "transformer_engine.jax.sharding")


def _te_snapshot() -> list[tuple[Any, str, Any]]:
    snap = []
    for mod_name in _TE_STATE_MODULES:
        mod = sys.modules.get(mod_name)
        if mod is None:
            continue
        for name, val in list(vars(mod).items()):
            if name.startswith("__") or callable(val) and not isinstance(val, type):
                continue
            if isinstance(val, type):
                if "Config" in name or "Resource" in name:
                    snap.extend(
                        (val, k, v)
                        for k, v in vars(val).items()
                        if not k.startswith("__")
                        and not callable(v)
                        and not isinstance(v, (classmethod, staticmethod, property))
                    )
                continue
            snap.append((mod, name, val))
            if "Config" in type(val).__name__ and hasattr(val, "__dict__"):
                snap.extend((val, k, v) for k, v in vars(val).items())
    return snap


def _te_restore(snap) -> None:
    for owner, name, val in snap:
        setattr(owner, name, val)


@contextlib.contextmanager
def no_fp8() -> Iterator[None]:
    """Keep everything traced inside out of FP8 (the GDN core's region).

    Native projections traced here run in their compute dtype; if TE is in use its autocast is
    disabled. On exit, normal or by an exception, the enclosing state (ours and TE's) is
    restored exactly. Quantisation is decided at trace time, so this covers the core's forward
    and its backward (the core's backward holds no projection) and remat, which replays the
    traced forward.
    """
    token = _FP8_OFF.set(True)
    te = sys.modules.get("transformer_engine.jax")  # only if the caller already uses TE
    snap = _te_snapshot() if te is not None else None
    try:
        if te is not None:
            with _te_autocast_fn(te)(False):
                yield
        else:
            yield
    finally:
        if snap is not None:
            _te_restore(snap)
        _FP8_OFF.reset(token)


def fp8_free(fn: Callable[..., Any], *, dtype=jnp.bfloat16) -> Callable[..., Any]:
    """Wrap a core op so that it runs in :func:`no_fp8` and never takes or returns FP8 arrays.

    FP8 array arguments are upcast to ``dtype`` (bf16 by default); the outputs are checked.

    Example:
      >>> core = fp8_free(gdn_jax.gated_delta_rule)
      >>> o, _ = core(q, k, v, g, beta, use_qk_l2norm=True)
    """

    def upcast(x):
        return x.astype(dtype) if hasattr(x, "dtype") and _is_fp8(x.dtype) else x

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        args, kwargs = jax.tree.map(upcast, (args, kwargs))
        with no_fp8():
            out = fn(*args, **kwargs)
        bad = [x.dtype for x in jax.tree.leaves(out) if hasattr(x, "dtype") and _is_fp8(x.dtype)]
        if bad:
            raise TypeError(f"{getattr(fn, '__name__', fn)} returned FP8 arrays {bad}")
        return out

    return wrapped


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


def convert_projections(
    model: nnx.Module,
    backend: Backend,
    *,
    recipe: Any = "current",
    exclude: Sequence[str] = ("lm_head",),
) -> nnx.Module:
    """Switch every ``nnx.Linear`` projection of ``model`` to ``backend``, in place.

    ``None``/``"native"`` set the layer's ``dot_general`` (parameters untouched); ``"te"``
    replaces each Linear by a :class:`TEDense` holding the same kernel. Linears whose path
    contains a name in ``exclude`` are left alone (the LM head stays in bf16 by default, as in
    common FP8 recipes: its logits feed the loss directly).

    Returns:
      ``model``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"{backend=}: expected one of {BACKENDS}")
    found = [
        (path, m)
        for path, m in nnx.iter_graph(model)
        if isinstance(m, nnx.Linear) and not any(str(p) in exclude for p in path)
    ]
    for path, lin in found:
        if backend != "te":
            lin.dot_general = dot_general(backend)
            continue
        if lin.bias is not None:
            raise ValueError(f"{path}: TEDense has no bias")
        te_dense = TEDense(
            lin.in_features,
            lin.out_features,
            recipe=recipe,
            dtype=lin.dtype,
            param_dtype=lin.param_dtype,
            rngs=nnx.Rngs(0),
        )
        te_dense.inner.kernel[...] = lin.kernel[...]
        parent = model
        for p in path[:-1]:
            parent = parent[p] if isinstance(p, int) else getattr(parent, p)
        if isinstance(path[-1], int):
            parent[path[-1]] = te_dense
        else:
            setattr(parent, path[-1], te_dense)
    return model
