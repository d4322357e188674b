"""Choosing a projection's FP8 backend and switching a built model's projections.

Backends: ``None`` (the projection runs in its compute dtype), ``"native"``
(:func:`gdn_jax.fp8.native.native_fp8_dot_general`) and ``"te"``
(:class:`gdn_jax.fp8.te_bridge.TEDense`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
from flax import nnx

from gdn_jax.fp8.native import native_fp8_dot_general
from gdn_jax.fp8.te_bridge import TEDense

__all__ = ["BACKENDS", "Backend", "convert_projections", "dot_general"]

Backend = Literal["native", "te"] | None
BACKENDS: tuple[Backend, ...] = (None, "native", "te")


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
