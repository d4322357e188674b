"""Model pieces on Explicit mesh axes, where the sharding is part of each value's type.

On ``Explicit`` axes (``jax.make_mesh``'s default) JAX asks for the output layout of every op it
cannot infer: these helpers state it for the model's projections, embedding gathers and
attention, and are the identity on unsharded values and on ``Auto`` axes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from gdn_jax.sharding._axes import _as_tuple, _entry

__all__ = [
    "explicit_mesh",
    "explicit_axes_of",
    "projection_out_spec",
    "projection_dot_general",
    "in_auto_axes",
    "laid_out_like",
]


def explicit_mesh(*xs):
    """The (abstract) mesh of the first of ``xs`` whose type has Explicit mesh axes, or None."""
    for x in xs:
        if x is None:
            continue
        m = getattr(jax.typeof(x).sharding, "mesh", None)
        if m is not None and not m.empty and AxisType.Explicit in m.axis_types:
            return m
    return None


def explicit_axes_of(x) -> tuple[tuple[str, ...], ...]:
    """Per dimension of ``x``, the Explicit mesh axes that split it in its type (``()``: none)."""
    spec = tuple(jax.typeof(x).sharding.spec)
    spec = spec + (None,) * (x.ndim - len(spec))
    return tuple(_as_tuple(e) if e is not P.UNCONSTRAINED else () for e in spec[: x.ndim])


def projection_out_spec(lhs, rhs) -> P:
    """The layout of a projection ``lhs [..., in] @ rhs [in, out]`` on Explicit mesh axes:
    lhs's leading axes, then the mesh axes of rhs's ``out`` dimension that lhs does not use."""
    lax_ = explicit_axes_of(lhs)
    used = {a for ax in lax_ for a in ax}
    out_ax = tuple(a for a in explicit_axes_of(rhs)[1] if a not in used)
    return P(*map(_entry, lax_[:-1]), _entry(out_ax))


def projection_dot_general(dot_general: Callable) -> Callable:
    """``dot_general`` for a projection ``x [..., in] @ W [in, out]`` that also runs on Explicit
    mesh axes (plain jit with sharded arrays, JAX's default mesh type).

    There the output sharding must be stated and the operands must agree on the contracted
    dimension. The kernel's ``in`` dimension is moved to the layout of x's last dimension (FSDP's
    all-gather of a weight when x's features are whole; nothing for a row-parallel weight whose
    ``in`` matches head-sharded features), its ``out`` dimension keeps the mesh axes that x does
    not use elsewhere (column parallel: the heads stay sharded), and the output is
    ``P(*x's leading axes, out's axes)`` (a contraction over a sharded dimension is summed over
    its shards). Without Explicit axes it is ``dot_general`` unchanged.
    """

    @functools.wraps(dot_general)
    def dg(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
           out_sharding=None):  # fmt: skip
        mesh = explicit_mesh(lhs, rhs)
        (lc, rc), (lb, rb) = dimension_numbers
        plain = tuple(lc) == (lhs.ndim - 1,) and tuple(rc) == (0,) and not lb and not rb
        if mesh is not None and out_sharding is None and plain and rhs.ndim == 2:
            lax_ = explicit_axes_of(lhs)
            out = projection_out_spec(lhs, rhs)
            want = NamedSharding(mesh, P(_entry(lax_[-1]), out[-1]))
            rhs = jax.sharding.reshard(rhs, want)
            out_sharding = NamedSharding(mesh, out)
        return dot_general(
            lhs, rhs, dimension_numbers, precision=precision,
            preferred_element_type=preferred_element_type, out_sharding=out_sharding,
        )  # fmt: skip

    return dg


def in_auto_axes(fn: Callable, out_specs, *args):
    """``fn(*args)`` with Explicit mesh axes turned into Auto ones (XLA's partitioner decides the
    layout inside), its outputs laid out as ``out_specs`` (a PartitionSpec or a pytree of them
    matching the outputs); plain ``fn(*args)`` without Explicit axes.

    For the few model pieces whose sharding JAX cannot infer on Explicit axes (a gather from a
    sharded embedding table, attention over grouped heads).
    """
    mesh = explicit_mesh(*jax.tree.leaves(args))
    if mesh is None:
        return fn(*args)
    out = jax.tree.map(
        lambda sp: NamedSharding(mesh, sp), out_specs, is_leaf=lambda x: isinstance(x, P)
    )
    return jax.sharding.auto_axes(fn, out_sharding=out)(*args)


def laid_out_like(x, ref, *others):
    """``x`` moved to ``ref``'s layout when ``ref``, ``x`` or ``others`` are on Explicit mesh axes
    (a cache keeps the layout it came in with; a ``ref`` on no mesh means replicated); ``x``
    unchanged otherwise."""
    mesh = explicit_mesh(ref, x, *others)
    if mesh is None:
        return x
    axes = explicit_axes_of(ref) if explicit_mesh(ref) is not None else ((),) * ref.ndim
    return jax.sharding.reshard(x, NamedSharding(mesh, P(*map(_entry, axes))))
