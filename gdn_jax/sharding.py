"""Sharding: the GDN ops per shard through ``shard_map``, context parallelism, model rules, meshes.

Pallas kernels are opaque to XLA's partitioner, so the ops run per shard inside
:func:`jax.shard_map`. Every (sequence, value head) pair is independent, so batch and
head sharding need no communication at all. A sequence split over a mesh axis (context
parallelism) needs the recurrent state to cross shard boundaries; two ways are offered:

- ``"all_to_all"`` (Ulysses): one all-to-all turns the sequence-sharded inputs into
  head-sharded ones (each device sees the whole sequence for a slice of the heads), the op runs
  unsharded in time, and one all-to-all brings the output back to sequence sharding. Needs the
  head counts to divide by (head shards × context shards).
- ``"state_passing"`` (LASP-2 style): the state at a segment's end is affine in the state at its
  start, ``S_end = M S_start + c`` with ``M`` [K, K] per head. Each shard gets ``c`` from the op
  started at zero and ``M`` from the op started at ``I_K`` with zero values (K value channels),
  all-gathers ``(M, c)`` over the context axis, composes the maps of the shards before it (a
  prefix over the few context shards) to get its true initial state, and reruns the op from it
  (or, with ``rerun=False``, corrects the zero-start output linearly). Communication is one
  all-gather of ``K·(K+V)`` floats per head and shard, independent of T; any head count works.

Both are plain JAX programs around the public op, so the backward pass is JAX autodiff of the
``shard_map`` (the transposes of ``all_gather``/``all_to_all`` are ``psum_scatter``/``all_to_all``).

Example::

    mesh = make_mesh("data=2,tensor=2,context=2")
    cfg = ShardingConfig(mesh, batch="data", heads="tensor", context="context")
    op = shard_op(gdn_jax.gated_delta_rule, cfg)
    o, final = op(q, k, v, g, beta, initial_state=h0, output_final_state=True)

For the model, :func:`logical_axis_rules` maps the parameters' logical axis names to mesh axes for
data parallel (``data``), fully sharded data parallel (``fsdp``) and tensor parallel (``tensor``)
training; :func:`shard_model` places a model's variables accordingly.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "ShardingConfig",
    "shard_op",
    "shard_step",
    "parse_mesh",
    "make_mesh",
    "logical_axis_rules",
    "model_core_sharding",
    "check_model_divisibility",
    "model_shardings",
    "shard_model",
    "batch_sharding",
    "input_layout",
    "implicit_config",
    "pallas_layout_error",
    "explicit_mesh",
    "explicit_axes_of",
    "projection_dot_general",
    "in_auto_axes",
    "laid_out_like",
    "check_sequence_unsplit",
]

AxisNames = str | Sequence[str] | None
ContextMode = Literal["all_to_all", "state_passing"]
CONTEXT_MODES = ("all_to_all", "state_passing")

# Default mesh axis names (what ``examples/train.py --mesh`` and the rules use).
DATA, FSDP, TENSOR, CONTEXT = "data", "fsdp", "tensor", "context"


def _as_tuple(axes: AxisNames) -> tuple[str, ...]:
    if axes is None:
        return ()
    if isinstance(axes, str):
        return (axes,)
    return tuple(axes)


def _entry(axes: tuple[str, ...]) -> str | tuple[str, ...] | None:
    """One PartitionSpec entry for a dimension split over ``axes`` (major to minor)."""
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


# --------------------------------------------------------------------------------------------
# Ops
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    """How an op's tensors are laid out on a mesh.

    Attributes:
      mesh: the device mesh.
      batch: mesh axes that split the batch dimension B (major to minor), e.g. ``("data", "fsdp")``.
      heads: mesh axes that split the head dimensions: q/k heads H and value heads HV by the same
        factor, so a GVA group (value heads ``r·j … r·j + r − 1`` reading q/k head ``j``) stays on
        one shard.
      context: a mesh axis that splits the sequence dimension T, or None.
      context_mode: ``"state_passing"`` (default; any head count) or ``"all_to_all"`` (needs H and
        HV divisible by the head shards times the context shards).
      rerun: state passing only. True (default): rerun the op from each shard's true initial
        state (three op calls per shard: the zero-start one, the K-channel one that gives the
        state map, the rerun). False: add the initial state's contribution to the zero-start
        output as a linear correction instead (two calls; the correction's operand is the op's
        output in the io dtype, so bf16/f16 inputs are rounded once more).
    """

    mesh: Mesh
    batch: AxisNames = None
    heads: AxisNames = None
    context: str | None = None
    context_mode: ContextMode = "state_passing"
    rerun: bool = True

    def __post_init__(self):
        object.__setattr__(self, "batch", _as_tuple(self.batch))
        object.__setattr__(self, "heads", _as_tuple(self.heads))
        used = list(self.batch) + list(self.heads) + ([self.context] if self.context else [])
        for a in used:
            if a not in self.mesh.axis_names:
                raise ValueError(
                    f"mesh axis {a!r} is not in the mesh (axes {self.mesh.axis_names}, "
                    f"shape {dict(self.mesh.shape)})"
                )
        if len(set(used)) != len(used):
            raise ValueError(f"a mesh axis is used twice: batch={self.batch}, "
                             f"heads={self.heads}, context={self.context!r}")  # fmt: skip
        if self.context_mode not in CONTEXT_MODES:
            raise ValueError(f"context_mode={self.context_mode!r}: expected one of {CONTEXT_MODES}")

    def size(self, axes: AxisNames) -> int:
        """Number of shards along ``axes`` (1 for none)."""
        return math.prod(self.mesh.shape[a] for a in _as_tuple(axes))

    @property
    def context_size(self) -> int:
        return self.size(self.context)

    def _cp(self) -> bool:
        # A context axis of size 1 is no context parallelism; skip the collectives.
        return self.context is not None and self.context_size > 1

    def token_spec(self, rank: int) -> P:
        """Spec of a ``[B, T, heads, ...]`` tensor of the given rank (inputs and output)."""
        ctx = self.context if self._cp() else None
        return P(_entry(self.batch), ctx, _entry(self.heads), *([None] * (rank - 3)))

    def state_spec(self) -> P:
        """Spec of an ``[N, HV, K, V]`` state (as passed in and returned)."""
        heads = self.heads
        if self._cp() and self.context_mode == "all_to_all":
            # Each context shard ends up owning a slice of its head shard's heads.
            heads = heads + (self.context,)
        return P(_entry(self.batch), _entry(heads), None, None)


def _describe(cfg: ShardingConfig, axes: tuple[str, ...]) -> str:
    """``mesh axis 'tensor' of size 4`` / ``mesh axes ('data', 'fsdp') of size 4``."""
    what = f"mesh axis {axes[0]!r}" if len(axes) == 1 else f"mesh axes {axes}"
    return f"{what} of size {cfg.size(axes)}"


def _check(cfg: ShardingConfig, B, T, H, HV, cu_seqlens) -> None:
    """Divisibility checks with errors that name the mesh axis, its size and the counts."""
    nb, nh, nc = cfg.size(cfg.batch), cfg.size(cfg.heads), cfg.context_size
    if B % nb:
        packed = cu_seqlens is not None
        raise ValueError(
            f"batch {_describe(cfg, cfg.batch)} must divide the batch B={B}"
            + ("; packed sequences (cu_seqlens) have B == 1 and cannot be batch-sharded" * packed)
        )
    for name, n in (("H", H), ("HV", HV)):
        if n % nh:
            raise ValueError(
                f"heads {_describe(cfg, cfg.heads)} must divide the head counts evenly "
                f"(H={H} q/k heads, HV={HV} value heads; both are split by the same factor so GVA "
                f"groups stay together); {name}={n} is not a multiple of {nh}"
            )
    if not cfg._cp():
        return
    if cu_seqlens is not None:
        raise ValueError(
            f"context axis {cfg.context!r} of size {nc}: packed sequences (cu_seqlens) cannot be "
            "context-sharded; shard the packed row over heads only"
        )
    if T % nc:
        raise ValueError(f"context mesh axis {cfg.context!r} of size {nc} must divide T={T}")
    if cfg.context_mode == "all_to_all":
        for name, n in (("H", H), ("HV", HV)):
            if n % (nh * nc):
                raise ValueError(
                    f"context_mode='all_to_all' splits heads over the heads axes {cfg.heads} "
                    f"(size {nh}) and the context axis {cfg.context!r} (size {nc}); {name}={n} "
                    f"(H={H}, HV={HV}) is not a multiple of {nh * nc}; use "
                    "context_mode='state_passing'"
                )


# --------------------------------------------------------------------------------------------
# Layouts read off the inputs (plain jax.jit on sharded arrays)
# --------------------------------------------------------------------------------------------


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


def _unsharded(tree):
    """Shape/dtype structs without shardings: the op's checks on the global shapes then trace
    the unsharded op (a sharded type would make the public op shard itself again)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


# --------------------------------------------------------------------------------------------
# Model pieces on Explicit mesh axes (sharding in types)
# --------------------------------------------------------------------------------------------


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


def _reshard(cfg: ShardingConfig, x, spec: P):
    # shard_map asserts (does not convert) the layout of Explicit-axis inputs; Auto axes are
    # resharded by the partitioner on its own.
    if any(t == AxisType.Explicit for t in cfg.mesh.axis_types):
        return jax.sharding.reshard(x, NamedSharding(cfg.mesh, spec))
    return x


def _all_to_all_local(op, cfg: ShardingConfig, arrays, h0, *, output_final_state, kwargs):
    """Per shard: sequence → heads all-to-all, the op on whole sequences, heads → sequence."""
    ax = cfg.context
    # [B, T/n, h, ...] -> [B, T, h/n, ...]: chunk j of the local heads goes to context shard j, so
    # shard j holds heads j·h/n … (j+1)·h/n − 1, the order ``state_spec`` declares.
    arrays = [jax.lax.all_to_all(x, ax, split_axis=2, concat_axis=1, tiled=True) for x in arrays]
    o, final = op(*arrays, initial_state=h0, output_final_state=output_final_state, **kwargs)
    o = jax.lax.all_to_all(o, ax, split_axis=1, concat_axis=2, tiled=True)
    return (o, final) if output_final_state else o


def _segment_map(op, arrays, *, kwargs):
    """The affine map ``S ↦ M S + c`` of this shard's segment, and the outputs that go with it.

    Two calls of ``op`` with the shard's q, k and gates: from a zero state with the real values
    (end state ``c``, output ``o_0``), and from ``I_K`` with zero values over K value channels
    (end state ``M``, output ``o_M[t] = scale · M_tᵀ q_t`` with ``M_t`` the map up to token t).
    The second call has value head dim K, so kernels that serve K serve it (one call on
    ``[v | 0_K]`` from ``[0 | I_K]`` would need head dim V + K). GDN2's write gate (the sixth
    array) only multiplies values, so ones serve for the zero values.

    Returns:
      M [B, HV, K, K] f32, c [B, HV, K, V] f32, o_0 [B, T, HV, V], o_M [B, T, HV, K] (io dtype).
    """
    q, k, v, *gates = arrays
    B, T, HV, _ = v.shape
    K = q.shape[-1]
    o_0, c = op(*arrays, initial_state=None, output_final_state=True, **kwargs)
    if len(gates) == 3:
        gates = [gates[0], gates[1], jnp.ones((B, T, HV, K), gates[2].dtype)]
    eye = jnp.broadcast_to(jnp.eye(K, dtype=jnp.float32), (B, HV, K, K))
    zeros = jnp.zeros((B, T, HV, K), v.dtype)
    o_M, M = op(q, k, zeros, *gates, initial_state=eye, output_final_state=True, **kwargs)
    return M, c, o_0, o_M


def _state_passing_local(op, cfg: ShardingConfig, arrays, h0, *, output_final_state, kwargs):
    """Per shard: segment map, all-gather + prefix combine, then the output from the true start."""
    ax = cfg.context
    M, c, o_0, o_M = _segment_map(op, arrays, kwargs=kwargs)
    Ms = jax.lax.all_gather(M, ax)  # [n, B, HV, K, K]
    cs = jax.lax.all_gather(c, ax)  # [n, B, HV, K, V]
    S = jnp.zeros_like(c) if h0 is None else h0.astype(jnp.float32)
    # The state entering shard j is the composition of the maps of shards 0 … j−1 applied to h0.
    # The context axis is short, so an unrolled sequential prefix (n small K×K·K×V products,
    # redundantly on every shard) is cheaper than a parallel scan's extra work.
    starts = []
    for j in range(Ms.shape[0]):
        starts.append(S)
        S = jnp.einsum("bhij,bhjv->bhiv", Ms[j], S, precision=jax.lax.Precision.HIGHEST) + cs[j]
    S_in = jnp.stack(starts)[jax.lax.axis_index(ax)]
    if cfg.rerun:
        o, _ = op(*arrays, initial_state=S_in, output_final_state=False, **kwargs)
    else:
        # S_t = M_t S_in + C_t, so o_t = o_0[t] + S_inᵀ (scale · M_tᵀ q_t) = o_0[t] + S_inᵀ o_M[t].
        corr = jnp.einsum(
            "bthk,bhkv->bthv", o_M.astype(jnp.float32), S_in, precision=jax.lax.Precision.HIGHEST
        )
        o = (o_0.astype(jnp.float32) + corr).astype(o_0.dtype)
    return (o, S) if output_final_state else o


def shard_op(op: Callable, config: ShardingConfig) -> Callable:
    """Run a GDN op per shard of ``config.mesh``.

    Works with :func:`gdn_jax.gated_delta_rule`, :func:`gdn_jax.kda`, :func:`gdn_jax.gdn2` and the
    ``gdn_jax.reference`` functions of the same signature (positional arrays ``q, k, v`` and the
    gates, then keywords). The wrapped op has the same signature and returns the same global
    arrays as the unsharded op; its inputs may be laid out anyhow (they are moved to the layout
    below) and its outputs come back as:

    - o ``[B, T, HV, V]``: ``P(batch, context, heads, None)``;
    - final state ``[N, HV, K, V]``: ``P(batch, heads, None, None)`` (with ``"all_to_all"`` the
      context axis joins the heads axes: ``P(batch, heads + (context,), None, None)``).

    Args:
      op: the op to shard.
      config: mesh and the axes for B, heads and T.

    Returns:
      A function ``(q, k, v, *gates, initial_state=None, output_final_state=False,
      cu_seqlens=None, **op_keywords) -> (o, final_state | None)``.

    Raises (when called):
      ValueError: the op's own argument checks (on the global shapes), or a mesh axis that does not
        divide B, T or the head counts (the message names the axis, its size and the counts), or
        ``cu_seqlens`` with batch or context sharding.
    """

    @functools.wraps(op)
    def sharded(*arrays, initial_state=None, output_final_state=False, cu_seqlens=None, **kw):
        # The op's own validation on the global shapes (no computation), so caller mistakes get
        # the op's messages rather than ones about per-shard shapes.
        jax.eval_shape(
            lambda a, h, cu: op(*a, initial_state=h, output_final_state=output_final_state,
                                cu_seqlens=cu, **kw),
            *_unsharded((arrays, initial_state, cu_seqlens)),
        )  # fmt: skip
        q, v = arrays[0], arrays[2]
        B, T, H = q.shape[:3]
        HV = v.shape[2]
        _check(config, B, T, H, HV, cu_seqlens)

        cp = config._cp()
        arr_specs = [config.token_spec(x.ndim) for x in arrays]
        o_spec, s_spec = config.token_spec(4), config.state_spec()
        # With state passing the caller's initial state is the state of the whole sequence:
        # every context shard needs it (to combine), so it is replicated over the context axis.
        args = list(arrays)
        in_specs = list(arr_specs)
        has_h0, has_cu = initial_state is not None, cu_seqlens is not None
        if has_h0:
            args.append(initial_state)
            in_specs.append(s_spec)
        if has_cu:
            args.append(cu_seqlens)
            in_specs.append(P())
        args = [_reshard(config, x, s) for x, s in zip(args, in_specs, strict=True)]
        n = len(arrays)

        def local(*xs):
            a = list(xs[:n])
            h0 = xs[n] if has_h0 else None
            extra = dict(kw)
            if has_cu:
                extra["cu_seqlens"] = xs[-1]
            if cp and config.context_mode == "all_to_all":
                body = _all_to_all_local
            elif cp:
                body = _state_passing_local
            else:
                o, final = op(*a, initial_state=h0, output_final_state=output_final_state, **extra)
                return (o, final) if output_final_state else o
            return body(op, config, a, h0, output_final_state=output_final_state, kwargs=extra)

        out_specs = (o_spec, s_spec) if output_final_state else o_spec
        # check_vma=False: the ops' scans start their carries from invariant zeros, which the
        # varying-manual-axes check rejects. Without the check, shard_map's transpose divides
        # the cotangents of outputs replicated over an axis by its size and psums the input
        # cotangents over unmentioned axes, which is exact for our programs (every replicated
        # output is computed identically on every shard); the tests check the gradients.
        out = jax.shard_map(
            local, mesh=config.mesh, in_specs=tuple(in_specs), out_specs=out_specs,
            check_vma=False,
        )(*args)  # fmt: skip
        return out if output_final_state else (out, None)

    return sharded


def shard_step(op: Callable, config: ShardingConfig) -> Callable:
    """Run a decode op (``gated_delta_rule_step``, ``kda_step``, ``gdn2_step``) per shard.

    Decode is split over batch and heads only (``config.context`` must be None: the tokens of one
    step are few and sequential). Layouts: inputs and o ``P(batch, None, heads, None)``, the
    carried state (the last positional array) and the new state ``P(batch, heads, None, None)``.

    Args:
      op: the decode op.
      config: mesh and the axes for B and heads.

    Returns:
      A function with the op's signature, ``(q, k, v, *gates, state, **keywords) -> (o, state)``.
    """
    if config._cp():
        raise ValueError(
            f"decode steps cannot be context-sharded (context axis {config.context!r} of size "
            f"{config.context_size}); use a config without context for shard_step"
        )

    @functools.wraps(op)
    def sharded(*arrays, **kw):
        jax.eval_shape(lambda a: op(*a, **kw), _unsharded(arrays))  # checks on global shapes
        *tokens, state = arrays
        q, v = tokens[0], tokens[2]
        _check(config, q.shape[0], q.shape[1], q.shape[2], v.shape[2], None)
        specs = [config.token_spec(x.ndim) for x in tokens] + [config.state_spec()]
        args = [_reshard(config, x, sp) for x, sp in zip(arrays, specs, strict=True)]
        return jax.shard_map(
            lambda *a: op(*a, **kw),
            mesh=config.mesh,
            in_specs=tuple(specs),
            out_specs=(config.token_spec(4), config.state_spec()),
            check_vma=False,
        )(*args)

    return sharded


# --------------------------------------------------------------------------------------------
# Meshes
# --------------------------------------------------------------------------------------------


def parse_mesh(spec: str) -> dict[str, int]:
    """Parse ``"data=2,fsdp=2,tensor=2"`` into ``{"data": 2, "fsdp": 2, "tensor": 2}``.

    One size may be ``-1``: it takes the devices left over (resolved by :func:`make_mesh`).
    """
    out: dict[str, int] = {}
    for part in spec.replace(" ", "").split(","):
        if not part:
            continue
        name, eq, size = part.partition("=")
        if not eq or not name or not size.lstrip("-").isdigit():
            raise ValueError(
                f"mesh spec {spec!r}: expected 'name=size[,name=size...]'; got {part!r}"
            )
        if name in out:
            raise ValueError(f"mesh spec {spec!r}: axis {name!r} given twice")
        n = int(size)
        if n < 1 and n != -1:
            raise ValueError(f"mesh spec {spec!r}: axis {name!r} has size {n}; expected ≥ 1 or -1")
        out[name] = n
    if not out:
        raise ValueError(f"mesh spec {spec!r} names no axes")
    if list(out.values()).count(-1) > 1:
        raise ValueError(f"mesh spec {spec!r}: at most one axis may have size -1")
    return out


def make_mesh(
    spec: str | Mapping[str, int],
    *,
    devices: Sequence[jax.Device] | None = None,
    axis_type: AxisType = AxisType.Auto,
) -> Mesh:
    """A mesh from ``"data=2,fsdp=2,tensor=2"`` (or a name → size mapping).

    Args:
      spec: axis names and sizes, major to minor; one size may be -1 (the rest of the devices).
      devices: devices to use (default ``jax.devices()``); a mesh smaller than the device list
        takes its first devices.
      axis_type: the axis type of every axis. ``Auto`` (default) lets the partitioner propagate
        shardings from annotated parameters and inputs (what the model rules assume); ``Explicit``
        (``jax.make_mesh``'s default) works as well: the ops, layers and model read layouts off
        their inputs (docs/sharding.md).

    Returns:
      A :class:`jax.sharding.Mesh`.
    """
    sizes = parse_mesh(spec) if isinstance(spec, str) else dict(spec)
    devices = list(jax.devices() if devices is None else devices)
    known = math.prod(n for n in sizes.values() if n != -1)
    if -1 in sizes.values():
        if len(devices) % known:
            raise ValueError(f"mesh {sizes}: {len(devices)} devices are not a multiple of {known}")
        sizes = {a: (len(devices) // known if n == -1 else n) for a, n in sizes.items()}
    total = math.prod(sizes.values())
    if total > len(devices):
        raise ValueError(f"mesh {sizes} needs {total} devices; {len(devices)} available")
    return jax.make_mesh(
        tuple(sizes.values()),
        tuple(sizes),
        axis_types=(axis_type,) * len(sizes),
        devices=devices[:total],
    )


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


def logical_axis_rules(
    mesh: Mesh,
    *,
    data: str = DATA,
    fsdp: str = FSDP,
    tensor: str = TENSOR,
    context: str = CONTEXT,
    shard_kv_heads: bool = False,
) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
    """Logical axis name → mesh axes for the hybrid LM (``nnx.logical_axis_rules``).

    - DP: the batch (``"batch"``, for activations and inputs) is split over ``data`` and ``fsdp``.
    - FSDP: every weight's model-width dimension (``embed``) is split over ``fsdp``; XLA gathers
      it before use and reduce-scatters its gradient.
    - TP (Megatron): ``heads`` over ``tensor``, so the GDN and attention input projections (q, k,
      v, z, a, b, w: ``(embed, heads)``) are column-parallel, the output projections
      (``(heads, embed)``) row-parallel, and the short convs, ``A_log`` and ``dt_bias``
      (``heads``) are sharded with their heads; the SwiGLU is column/row parallel over ``mlp`` and
      the vocabulary over ``tensor`` too. Norm weights and conv taps are replicated.
    - ``kv_heads`` (softmax-attention K/V under GQA, usually fewer than the tensor shards) is
      replicated unless ``shard_kv_heads``.
    - CP: the sequence of the input batch (``"length"``) is split over ``context``. No weight
      has a sequence dimension; the GDN cores pass their states across the shards
      (:func:`model_core_sharding`) and XLA's partitioner handles the rest (the short convs' halo,
      the softmax-attention layers' all-gather of K/V).

    Axes missing from ``mesh`` are dropped, so ``make_mesh("data=8")`` gives plain DP.

    Args:
      mesh: the mesh the rules are for.
      data, fsdp, tensor, context: the mesh axis names of the four kinds of parallelism.
      shard_kv_heads: split ``kv_heads`` over ``tensor`` too.

    Returns:
      ``((logical, mesh_axes), ...)`` for every logical name the model uses.
    """
    from gdn_jax.nn.layers import CONV_TAPS, EMBED, HEADS, KV_HEADS, MLP, NORM, VOCAB

    has = set(mesh.axis_names)
    batch = tuple(a for a in (data, fsdp) if a in has)
    fs = fsdp if fsdp in has else None
    tp = tensor if tensor in has else None
    return (
        ("batch", _entry(batch)),
        ("length", context if context in has else None),
        (EMBED, fs),
        (HEADS, tp),
        (KV_HEADS, tp if shard_kv_heads else None),
        (MLP, tp),
        (VOCAB, tp),
        (NORM, None),
        (CONV_TAPS, None),
    )


def model_core_sharding(
    mesh: Mesh,
    *,
    data: str = DATA,
    fsdp: str = FSDP,
    tensor: str = TENSOR,
    context: str = CONTEXT,
    context_mode: ContextMode = "state_passing",
) -> ShardingConfig:
    """The :class:`ShardingConfig` of the GDN core that matches :func:`logical_axis_rules`."""
    has = set(mesh.axis_names)
    return ShardingConfig(
        mesh,
        batch=tuple(a for a in (data, fsdp) if a in has),
        heads=tensor if tensor in has else None,
        context=context if context in has else None,
        context_mode=context_mode,
    )


def check_model_divisibility(config, mesh: Mesh, *, tensor: str = TENSOR) -> None:
    """Raise ValueError when the tensor axis does not split the model's heads evenly.

    Args:
      config: a :class:`gdn_jax.models.HybridConfig`.
      mesh: the mesh.
      tensor: the tensor-parallel mesh axis name.
    """
    if tensor not in mesh.axis_names:
        return
    n = mesh.shape[tensor]
    counts = {
        "linear_num_heads": config.linear_num_heads,
        "linear_num_v_heads": config.linear_num_v_heads,
        "attn_num_heads": config.attn_num_heads,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
    }
    for name, c in counts.items():
        if c % n:
            raise ValueError(
                f"mesh axis {tensor!r} of size {n} must divide {name}={c} "
                f"(linear_num_heads={config.linear_num_heads}, "
                f"linear_num_v_heads={config.linear_num_v_heads}, "
                f"attn_num_heads={config.attn_num_heads})"
            )


def model_shardings(model, mesh: Mesh, rules) -> object:
    """NamedShardings for ``nnx.state(model)`` resolved through ``rules``.

    Args:
      model: an ``nnx.Module`` whose parameters carry logical axis names.
      mesh: the mesh.
      rules: from :func:`logical_axis_rules`.

    Returns:
      A pytree like ``nnx.state(model)`` of :class:`jax.sharding.NamedSharding`.
    """
    from flax import nnx

    with nnx.logical_axis_rules(rules):
        specs = nnx.get_partition_spec(nnx.state(model))
    return jax.tree.map(lambda p: NamedSharding(mesh, p), specs)


def shard_model(model, mesh: Mesh, rules) -> object:
    """Move a model's variables to the layout of ``rules`` in place; returns the shardings."""
    from flax import nnx

    shardings = model_shardings(model, mesh, rules)
    nnx.update(model, jax.device_put(nnx.state(model), shardings))
    return shardings


def batch_sharding(mesh: Mesh, rules, rank: int = 2) -> NamedSharding:
    """Sharding of a ``[B, T, ...]`` input batch (tokens, targets) under ``rules``: B over the
    rules' ``"batch"`` axes, T over their ``"length"`` axis (context parallelism)."""
    rules = dict(rules)
    spec = (rules.get("batch"), rules.get("length"))[:rank]
    return NamedSharding(mesh, P(*spec, *([None] * (rank - len(spec)))))
