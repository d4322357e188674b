"""The GDN ops per shard of a mesh through ``shard_map``: :func:`shard_op` and :func:`shard_step`.

Pallas kernels are opaque to XLA's partitioner, so the ops run per shard inside
:func:`jax.shard_map`. Every (sequence, value head) pair is independent, so batch and head
sharding need no communication at all; a sequence split over a mesh axis (context parallelism)
runs one of the per-shard bodies of :mod:`gdn_jax.sharding.context`.

Both are plain JAX programs around the public op, so the backward pass is JAX autodiff of the
``shard_map`` (the transposes of ``all_gather``/``all_to_all`` are ``psum_scatter``/``all_to_all``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from gdn_jax.sharding.config import ShardingConfig
from gdn_jax.sharding.context import all_to_all_local, state_passing_local

__all__ = ["shard_op", "shard_step"]


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


def _unsharded(tree):
    """Shape/dtype structs without shardings: the op's checks on the global shapes then trace
    the unsharded op (a sharded type would make the public op shard itself again)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _reshard(cfg: ShardingConfig, x, spec: P):
    # shard_map asserts (does not convert) the layout of Explicit-axis inputs; Auto axes are
    # resharded by the partitioner on its own.
    if any(t == AxisType.Explicit for t in cfg.mesh.axis_types):
        return jax.sharding.reshard(x, NamedSharding(cfg.mesh, spec))
    return x


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
                body = all_to_all_local
            elif cp:
                body = state_passing_local
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
