"""Context parallelism: the sequence split over a mesh axis, the recurrent state passed across.

Two ways, chosen by :attr:`ShardingConfig.context_mode`:

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

The segment maths is device-agnostic and reusable on one device (segments of one sequence laid
side by side): :func:`segment_map` gives a segment's affine map and outputs,
:func:`combine_segment_states` the state entering every segment, :func:`output_from_start` a
zero-start output corrected for a start state. The ``*_local`` functions are the per-shard
bodies that :func:`gdn_jax.sharding.shard_op` runs inside ``shard_map``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from gdn_jax.sharding.config import ShardingConfig

__all__ = ["segment_map", "combine_segment_states", "output_from_start"]

# Up to this many segments the prefix of combine_segment_states is unrolled (straight-line
# code, what a context axis of a few shards needs); more segments run as a lax.scan.
_UNROLL_MAX = 16

_HI = jax.lax.Precision.HIGHEST


def segment_map(op: Callable, arrays: Sequence, *, kwargs: Mapping | None = None):
    """The affine map ``S ↦ M S + c`` of one segment, and the outputs that go with it.

    Two calls of ``op`` with the segment's q, k and gates: from a zero state with the real values
    (end state ``c``, output ``o_0``), and from ``I_K`` with zero values over K value channels
    (end state ``M``, output ``o_M[t] = scale · M_tᵀ q_t`` with ``M_t`` the map up to token t).
    The second call has value head dim K, so kernels that serve K serve it (one call on
    ``[v | 0_K]`` from ``[0 | I_K]`` would need head dim V + K). GDN2's write gate (the sixth
    array) only multiplies values, so ones serve for the zero values.

    Args:
      op: a GDN op (``gated_delta_rule``, ``kda``, ``gdn2`` or a reference of the same
        signature).
      arrays: the op's positional arrays ``q [B, T, H, K], k, v [B, T, HV, V], *gates`` of the
        segment.
      kwargs: further keywords for both calls (e.g. ``scale``, ``implementation``); not
        ``initial_state`` or ``output_final_state``.

    Returns:
      M [B, HV, K, K] f32, c [B, HV, K, V] f32, o_0 [B, T, HV, V], o_M [B, T, HV, K] (io dtype).
    """
    kwargs = {} if kwargs is None else kwargs
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


def _apply(M, c, S):
    return jnp.einsum("bhij,bhjv->bhiv", M, S, precision=_HI) + c


def combine_segment_states(Ms, cs, h0=None):
    """The state entering each of n consecutive segments, from their affine maps.

    ``S_0 = h0`` and ``S_{j+1} = M_j S_j + c_j``: a sequential prefix over the segments (n small
    ``[K, K] · [K, V]`` products per head), unrolled up to 16 segments, a ``lax.scan`` beyond.

    Args:
      Ms: [n, B, HV, K, K] segment maps (``M`` of :func:`segment_map`), in sequence order.
      cs: [n, B, HV, K, V] zero-start end states (``c`` of :func:`segment_map`).
      h0: [B, HV, K, V] state before the first segment, or None for zeros.

    Returns:
      (starts [n, B, HV, K, V] f32: ``starts[j]`` is the state entering segment j,
      final [B, HV, K, V] f32: the state after the last segment).

    Raises:
      ValueError: shapes that do not match as above.
    """
    if Ms.ndim != 5 or cs.ndim != 5 or Ms.shape[:4] != cs.shape[:4] or Ms.shape[3] != Ms.shape[4]:
        raise ValueError(
            f"combine_segment_states: Ms {tuple(Ms.shape)} and cs {tuple(cs.shape)}: expected "
            "Ms [n, B, HV, K, K] and cs [n, B, HV, K, V]"
        )
    if h0 is not None and tuple(h0.shape) != tuple(cs.shape[1:]):
        raise ValueError(
            f"combine_segment_states: h0 {tuple(h0.shape)}: expected [B, HV, K, V] = "
            f"{tuple(cs.shape[1:])}"
        )
    S = jnp.zeros(cs.shape[1:], jnp.float32) if h0 is None else h0.astype(jnp.float32)
    Ms, cs = Ms.astype(jnp.float32), cs.astype(jnp.float32)
    n = Ms.shape[0]
    if n > _UNROLL_MAX:

        def body(S, Mc):
            return _apply(*Mc, S), S

        final, starts = jax.lax.scan(body, S, (Ms, cs))
        return starts, final
    starts = []
    for j in range(n):
        starts.append(S)
        S = _apply(Ms[j], cs[j], S)
    return jnp.stack(starts), S


def output_from_start(o_0, o_M, start):
    """A segment's output from the start state ``start``, given its zero-start outputs.

    ``S_t = M_t S_in + C_t``, so
    ``o_t = o_0[t] + S_inᵀ (scale · M_tᵀ q_t) = o_0[t] + S_inᵀ o_M[t]``.
    Exact up to rounding: the correction's operand ``o_M`` is the op's output in the io dtype,
    so bf16/f16 inputs are rounded once more than in a rerun of the op from ``start``.

    Args:
      o_0: [B, T, HV, V] output from a zero start (:func:`segment_map`).
      o_M: [B, T, HV, K] output of the map call (:func:`segment_map`).
      start: [B, HV, K, V] the segment's true start state.

    Returns:
      o [B, T, HV, V] in o_0's dtype.
    """
    corr = jnp.einsum("bthk,bhkv->bthv", o_M.astype(jnp.float32), start, precision=_HI)
    return (o_0.astype(jnp.float32) + corr).astype(o_0.dtype)


def all_to_all_local(op, cfg: ShardingConfig, arrays, h0, *, output_final_state, kwargs):
    """Per shard: sequence → heads all-to-all, the op on whole sequences, heads → sequence."""
    ax = cfg.context
    # [B, T/n, h, ...] -> [B, T, h/n, ...]: chunk j of the local heads goes to context shard j, so
    # shard j holds heads j·h/n … (j+1)·h/n − 1, the order ``state_spec`` declares.
    arrays = [jax.lax.all_to_all(x, ax, split_axis=2, concat_axis=1, tiled=True) for x in arrays]
    o, final = op(*arrays, initial_state=h0, output_final_state=output_final_state, **kwargs)
    o = jax.lax.all_to_all(o, ax, split_axis=1, concat_axis=2, tiled=True)
    return (o, final) if output_final_state else o


def state_passing_local(op, cfg: ShardingConfig, arrays, h0, *, output_final_state, kwargs):
    """Per shard: segment map, all-gather + prefix combine, then the output from the true start."""
    ax = cfg.context
    M, c, o_0, o_M = segment_map(op, arrays, kwargs=kwargs)
    Ms = jax.lax.all_gather(M, ax)  # [n, B, HV, K, K]
    cs = jax.lax.all_gather(c, ax)  # [n, B, HV, K, V]
    # The state entering shard j is the composition of the maps of shards 0 … j−1 applied to h0,
    # computed redundantly on every shard (the context axis is short).
    starts, final = combine_segment_states(Ms, cs, h0)
    S_in = starts[jax.lax.axis_index(ax)]
    if cfg.rerun:
        o, _ = op(*arrays, initial_state=S_in, output_final_state=False, **kwargs)
    else:
        o = output_from_start(o_0, o_M, S_in)
    return (o, final) if output_final_state else o
