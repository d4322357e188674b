"""Layouts read off the inputs: what a plain ``jax.jit`` on sharded arrays asks the ops to do.

The public ops call :func:`implicit_config` when no ``sharding=`` is given and run per shard of
the layout it finds; :func:`pallas_layout_error` says when the Pallas kernels cannot run because
the layout is not known at trace time; the ``check_sequence_*`` functions refuse a sequence axis
split without context parallelism having been asked for.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gdn_jax.sharding._axes import _as_tuple
from gdn_jax.sharding.config import ShardingConfig
from gdn_jax.sharding.explicit import explicit_axes_of, explicit_mesh

__all__ = [
    "input_layout",
    "implicit_config",
    "pallas_layout_error",
    "check_sequence_unsplit",
    "check_sequence_layout",
]


def input_layout(x) -> tuple[Mesh | AbstractMesh | None, tuple]:
    """The mesh and per-dimension mesh axes by which ``x``'s layout is known, or ``(None, ())``.

    Known: a traced value's type on ``Explicit`` mesh axes (``jax.typeof(x).sharding``; ``Auto``
    axes never appear in types), or a concrete array's :class:`NamedSharding` (any axis type).
    Inside ``shard_map`` the axes are ``Manual`` and nothing is known: the value is one shard.

    Returns:
      (mesh, axes) with ``axes[d]`` the tuple of mesh axes splitting dimension ``d`` (``()``
      when replicated); ``(None, ())`` when no dimension is known to be split.
    """
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        s = x.sharding
        if not isinstance(s, NamedSharding):
            return None, ()
        mesh, spec = s.mesh, s.spec
    else:
        try:
            s = jax.typeof(x).sharding
        except (TypeError, AttributeError):
            return None, ()
        mesh, spec = getattr(s, "mesh", None), getattr(s, "spec", None)
        if mesh is None or mesh.empty or spec is None:
            return None, ()
    ndim = getattr(x, "ndim", 0)
    axes = [_as_tuple(e) if e is not P.UNCONSTRAINED else () for e in tuple(spec)[:ndim]]
    axes += [()] * (ndim - len(axes))
    # Axes of size 1 split nothing.
    axes = tuple(tuple(a for a in ax if mesh.shape[a] > 1) for ax in axes)
    if not any(axes):
        return None, ()
    return mesh, axes


def _sequence_split_error(op_name, name, x, ax, *, decode: bool):
    what = f"mesh axis {ax[0]!r}" if len(ax) == 1 else f"mesh axes {ax}"
    if decode:
        fix = "decode steps cannot be context-sharded; lay T out replicated"
    else:
        fix = (
            "the op does not gather T on its own. For context parallelism pass "
            f"sharding=gdn_jax.sharding.ShardingConfig(mesh, batch=..., heads=..., "
            f"context={ax[0]!r}) (or wrap the op with gdn_jax.sharding.shard_op; for a model: "
            "sharding=gdn_jax.sharding.model_core_sharding(mesh)); otherwise lay T out replicated"
        )
    raise ValueError(
        f"{op_name}: the sequence axis T (dim 1) of {name} {tuple(x.shape)} is split over "
        f"{what}; {fix}"
    )


def check_sequence_unsplit(op_name: str, name: str, x, *, decode: bool = False) -> None:
    """ValueError when the sequence axis (dim 1) of ``x [B, T, ...]`` is split over Explicit mesh
    axes (context parallelism is asked for with a :class:`ShardingConfig`, never inferred)."""
    if explicit_mesh(x) is None:
        return
    ax = explicit_axes_of(x)[1]
    if ax:
        _sequence_split_error(op_name, name, x, ax, decode=decode)


def check_sequence_layout(where: str, name: str, x, *, context: bool) -> None:
    """Check the sequence axis (dim 1) of a layer's or model's input ``x [B, T, ...]`` on
    Explicit mesh axes: T split without context parallelism is a ValueError (as in
    :func:`check_sequence_unsplit`); T split with it (``ShardingConfig.context`` set) is a
    NotImplementedError: the layers' short convs and softmax attention cannot split T on
    Explicit axes, model context parallelism runs on Auto axes.

    Args:
      where: the layer or model, for the message.
      name: the argument's name.
      x: [B, T, ...].
      context: whether the layer or model was built for context parallelism.
    """
    if explicit_mesh(x) is None:
        return
    ax = explicit_axes_of(x)[1]
    if not ax:
        return
    if not context:
        _sequence_split_error(where, name, x, ax, decode=False)
    what = f"mesh axis {ax[0]!r}" if len(ax) == 1 else f"mesh axes {ax}"
    raise NotImplementedError(
        f"{where}: context parallelism on Explicit mesh axes is not supported: the sequence "
        f"axis T (dim 1) of {name} {tuple(x.shape)} is split over Explicit {what}. For model "
        "context parallelism build the mesh with Auto axes: jax.make_mesh(shape, names, "
        "axis_types=(jax.sharding.AxisType.Auto,) * len(names)) or "
        "gdn_jax.sharding.make_mesh(spec) (Auto by default)"
    )


def _same_mesh(a, b) -> bool:
    am = a.abstract_mesh if isinstance(a, Mesh) else a
    bm = b.abstract_mesh if isinstance(b, Mesh) else b
    return am == bm


def implicit_config(
    op_name: str,
    tokens: Sequence[tuple[str, object]],
    state: tuple[str, object] | None = None,
    *,
    decode: bool = False,
) -> ShardingConfig | None:
    """The :class:`ShardingConfig` that the inputs' own layouts ask for (None: unsharded).

    Called by the public ops when no ``sharding=`` is given. The op then runs per shard through
    :func:`shard_op` / :func:`shard_step` (so the Pallas kernels, opaque to XLA's partitioner, see
    their shard only, and the xla implementation needs no sharding annotations inside). The batch
    axes and the head axes are those of the first input that splits them, in the order ``tokens``
    (the ops pass v, q, k, the gates), then ``state``; every input is moved to that layout, and
    dimensions other than B and the heads (K, V) are gathered.

    Args:
      op_name: the public op's name, for the errors.
      tokens: ``(name, array)`` pairs of ``[B, T, heads, ...]`` inputs.
      state: ``(name, array)`` of an ``[N, HV, K, V]`` state, or None.
      decode: the op is a decode step (no context parallelism at all).

    Returns:
      A config on the inputs' mesh, or None when no input is known to be split.

    Raises:
      ValueError: the sequence axis T of an input is split over a mesh axis (context
        parallelism must be asked for), or the inputs sit on different meshes.
    """
    entries = [(n, x, 0, 2, 1) for n, x in tokens if getattr(x, "ndim", 0) >= 3]
    if state is not None and getattr(state[1], "ndim", 0) == 4:
        entries.append((state[0], state[1], 0, 1, None))
    mesh, batch, heads, mesh_of = None, None, None, None
    for name, x, b_dim, h_dim, t_dim in entries:
        m, axes = input_layout(x)
        if m is None:
            continue
        if mesh is None:
            mesh, mesh_of = m, name
        elif not _same_mesh(mesh, m):
            raise ValueError(
                f"{op_name}: {name} is sharded on mesh {dict(m.shape)} and {mesh_of} on mesh "
                f"{dict(mesh.shape)}; put every input on one mesh"
            )
        if t_dim is not None and axes[t_dim]:
            _sequence_split_error(op_name, name, x, axes[t_dim], decode=decode)
        if batch is None and axes[b_dim]:
            batch = axes[b_dim]
        if heads is None and axes[h_dim]:
            heads = axes[h_dim]
    if mesh is None or (not batch and not heads):
        return None
    batch, heads = batch or (), heads or ()
    if set(batch) & set(heads):
        raise ValueError(
            f"{op_name}: the inputs split the batch over {batch} and the heads over {heads}; a "
            "mesh axis cannot split both"
        )
    return ShardingConfig(mesh, batch=batch, heads=heads)


def pallas_layout_error(arrays: Sequence) -> str | None:
    """Why the Pallas kernels cannot run on ``arrays`` as they are, or None.

    Pallas kernels are opaque to XLA's partitioner. Under ``Auto`` mesh axes (a traced value's
    type, or the mesh of ``jax.set_mesh``) the layout is not known at trace time, so the op cannot
    run the kernels per shard; the public ops then fall back to the next implementation (xla,
    which the partitioner splits).
    """
    meshes = [jax.sharding.get_abstract_mesh()]
    for x in arrays:
        if isinstance(x, jax.core.Tracer):
            meshes.append(getattr(jax.typeof(x).sharding, "mesh", None))
    for m in meshes:
        if m is None or m.empty:
            continue
        auto = [a for a, t in zip(m.axis_names, m.axis_types, strict=True)
                if t == AxisType.Auto and m.shape[a] > 1]  # fmt: skip
        if auto:
            return (
                f"the Pallas kernels are opaque to XLA's partitioner and the inputs' layout on the "
                f"Auto mesh axes {tuple(auto)} is not known at trace time; use Explicit axes "
                "(jax.make_mesh's default) or pass sharding=gdn_jax.sharding.ShardingConfig(...) "
                "to run the kernels per shard"
            )
    return None
