"""Public ops: validate → canonicalize → choose an implementation → run.

Implementations are tried in order; one that cannot serve the arguments raises
``NotImplementedError`` and the next is tried. ``implementation=None`` means ``("pallas", "xla")``
on a Hopper GPU and ``("xla",)`` elsewhere.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from gdn_jax.ops import _sanitize, _xla
from gdn_jax.ops import _validate as val
from gdn_jax.qat import QATConfig
from gdn_jax.reference import recurrent as _rec

if TYPE_CHECKING:
    from gdn_jax.sharding import ShardingConfig

__all__ = [
    "gated_delta_rule",
    "kda",
    "gdn2",
    "gated_delta_rule_step",
    "kda_step",
    "gdn2_step",
    "short_conv",
    "IMPLEMENTATIONS",
    "default_implementations",
]

IMPLEMENTATIONS = ("pallas", "xla")


@functools.cache
def _on_hopper() -> bool:
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return False
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9")


# Variants whose Pallas kernels pass their GPU tests on the H200 and are tried first there: they
# beat the xla path at every measured shape (KDA fwd+bwd at B4 T4096 HV16: 7.06 vs 36.1 ms in
# bench_gdn.py, benchmarks/RESULTS.md).
_PALLAS_BY_DEFAULT = ("gdn", "kda", "gdn2", "step", "short_conv", "lm_head")


def default_implementations(variant: str = "gdn") -> tuple[str, ...]:
    """The order tried for ``implementation=None`` on this platform.

    Args:
      variant: ``"gdn"``, ``"kda"``, ``"gdn2"`` (chunked ops), ``"step"`` (decode steps),
        ``"short_conv"`` or ``"lm_head"`` (the LM head's cross-entropy in ``HybridLM.loss``).
    """
    return ("pallas", "xla") if _on_hopper() and variant in _PALLAS_BY_DEFAULT else ("xla",)


def with_xla_fallback(implementation):
    """``implementation`` (None, a name or a sequence) with ``"xla"`` tried last; None stays
    None (:func:`default_implementations` ends in ``"xla"``). For the parts of a layer whose
    kernels serve fewer shapes than the core's (the short convolutions, the LM head's loss)."""
    if implementation is None:
        return None
    order = (implementation,) if isinstance(implementation, str) else tuple(implementation)
    return order if "xla" in order else (*order, "xla")


def _pallas(variant: str) -> Callable:
    """The Pallas entry point for ``variant`` ("gdn", "kda" or "gdn2").

    A failing import of the kernels' modules propagates: a broken build must not fall back to
    "xla" silently (calls the kernels do not serve raise NotImplementedError from the entry
    point itself).

    Raises:
      ValueError: ``variant`` is none of those.
    """
    if variant == "gdn":
        from gdn_jax.ops._gdn_pallas import gated_delta_rule_pallas

        return gated_delta_rule_pallas
    if variant in ("kda", "gdn2"):
        from gdn_jax.ops._channel_pallas import CHANNEL_PALLAS

        return CHANNEL_PALLAS[variant]
    raise ValueError(f"{variant=}: expected 'gdn', 'kda' or 'gdn2'")


def _run(name: str, implementation, run_xla: Callable, run_pallas: Callable, *, default: str):
    """Tries the implementations in order; ``run_pallas()`` and ``run_xla()`` take no arguments.

    Args:
      name: what runs, for the error (``"gdn"``, ``"kda_step"``, ...).
      implementation: None (``default_implementations(default)``), a name or a sequence.
      default: the key of :func:`default_implementations`.
    """
    expected = f"implementation must be None, one of {IMPLEMENTATIONS} or a non-empty sequence"
    if implementation is None:
        order = default_implementations(default)
    elif isinstance(implementation, str):
        order = (implementation,)
    elif isinstance(implementation, Sequence):
        order = tuple(implementation)
    else:
        raise ValueError(f"{expected} of them; got {implementation!r}")
    if not order:
        raise ValueError(f"{expected} of them; got an empty {type(implementation).__name__}")
    for impl in order:
        if impl not in IMPLEMENTATIONS:
            raise ValueError(f"{expected} of them; got {impl!r}")
    errors = []
    for impl in order:
        try:
            return run_xla() if impl == "xla" else run_pallas()
        except NotImplementedError as e:
            errors.append(e)
    raise ExceptionGroup(
        f"no implementation of {name} could serve these arguments (tried {order})", errors
    )


def _sharded(op, sharding, arrays, **kw):
    """Runs ``op`` per shard of ``sharding.mesh`` (see :func:`gdn_jax.sharding.shard_op`)."""
    from gdn_jax.sharding import shard_op

    return shard_op(op, sharding)(*arrays, **kw)


def _implicit_sharding(name: str, names: str, arrays, state=None, *, decode: bool = False):
    """The ShardingConfig the inputs' layouts ask for (None: run unsharded); see
    :func:`gdn_jax.sharding.implicit_config`. ``names`` are the arrays' names, space-separated;
    v (the third) is looked at first, then q, k and the gates."""
    from gdn_jax.sharding import implicit_config

    named = list(zip(names.split(), arrays, strict=True))
    order = [named[2], named[0], named[1], *named[3:]]
    return implicit_config(name, order, state, decode=decode)


def _pallas_sees_layout(*arrays) -> None:
    """NotImplementedError when the Pallas kernels cannot know the inputs' layout (Auto axes)."""
    from gdn_jax.sharding import pallas_layout_error

    why = pallas_layout_error(arrays)
    if why is not None:
        raise NotImplementedError(why)


def gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    cu_seqlens: jax.Array | None = None,
    chunk_size: int = 64,
    implementation: str | Sequence[str] | None = None,
    qat: QATConfig | None = None,
    sharding: ShardingConfig | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Gated DeltaNet (scalar decay per head), chunked and trainable.

    ``S ← e^{g_t} S;  S ← S + β_t k_t (v_t − Sᵀk_t)ᵀ;  o_t = scale · Sᵀ q_t`` (state S is K×V, f32).

    Args:
      q, k: [B, T, H, K] bf16/f16/f32.
      v: [B, T, HV, V], same dtype; HV % H == 0 (value head i reads q/k head i // (HV // H)).
      g: [B, T, HV] natural-log decay (usually ≤ 0), f32 (bf16/f16 upcast).
      beta: [B, T, HV] write strength, f32 (bf16/f16 upcast).
      scale: query scale, default K**-0.5.
      initial_state: [N, HV, K, V] f32 or None (zeros); N = B, or len(cu_seqlens) - 1.
      output_final_state: also return the final state.
      use_qk_l2norm: L2-normalise q and k over K inside the op (gradient included).
      cu_seqlens: [N + 1] int32 packed-sequence offsets (B must be 1); empty sequences allowed.
      chunk_size: 16, 32 or 64.
      implementation: None (best for the platform), "pallas", "xla", or a sequence tried in order.
      qat: optional :class:`gdn_jax.qat.QATConfig`: FP8 fake quantisation of the chunk-entering
        state and of w (needs chunk_size 64).
      sharding: optional :class:`gdn_jax.sharding.ShardingConfig`: run per shard of a mesh
        (batch, heads, context parallel) through ``shard_map``.

    Returns:
      o [B, T, HV, V] in v.dtype, and the final state [N, HV, K, V] f32 (None unless
      ``output_final_state``).

    Example:
      >>> o, s = gdn_jax.gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    """
    if sharding is None:
        sharding = _implicit_sharding(
            "gated_delta_rule", "q k v g beta", (q, k, v, g, beta), ("initial_state", initial_state)
        )
    if sharding is not None:
        return _sharded(
            gated_delta_rule, sharding, (q, k, v, g, beta),
            scale=scale, initial_state=initial_state, output_final_state=output_final_state,
            use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
            implementation=implementation, qat=qat,
        )  # fmt: skip
    B, T, H, HV, K, V, N = val.check_common(
        q, k, v, initial_state=initial_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size
    )
    val.check_gate("g", g, (B, T, HV))
    val.check_gate("beta", beta, (B, T, HV))
    val.check_qat(qat, chunk_size)
    if T == 0 or B == 0:
        val.check_scale(scale, K)
        return _empty(v, initial_state, N, HV, K, V, output_final_state)
    scale = val.check_scale(scale, K)
    val.check_log_decay("g", g)
    cu_seqlens = val.sanitize_cu_seqlens(cu_seqlens, T)
    beta = beta.astype(jnp.float32)

    def run_xla():
        (qc, kc, vc, gc, (bc,), _), poison = _sanitize.inputs(q, k, v, g, (beta,), (), cu_seqlens)
        b = bc[..., None]
        o, final = _xla.chunked(
            qc, kc, vc, gc[..., None], b, b, scale=scale, initial_state=initial_state,
            use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens, chunk_size=chunk_size, qat=qat,
        )  # fmt: skip
        return poison.output(o), _final(poison, final)

    def run_pallas(fn):  # the GDN kernels fuse QAT (w and state sites) themselves
        _pallas_sees_layout(q, k, v, g, beta, initial_state)
        # The GDN kernels (and the l2norm's) read non-finite q, k, v values as 0, the
        # sanitation's replacement: given the raw q, k, v, XLA writes no sanitised copies. The
        # intra kernel finds k's and v's bad values as it loads them and the chunk loop q's:
        # XLA reduces only the gates' flags (and k's under the L2 norm, whose kernel reads k),
        # and the chunk loop puts the NaN into o as it stores it.
        heads = (k, beta) if use_qk_l2norm else (beta,)
        poison = _sanitize.poison(v.shape, cu_seqlens, heads=heads, log_decays=(g,))
        o, final = fn(
            q, k, v, _sanitize.log_decay(g), _sanitize.finite(beta), scale=scale,
            initial_state=initial_state, output_final_state=output_final_state,
            use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens, chunk_size=chunk_size, qat=qat,
            poison=poison,
        )  # fmt: skip
        return o, _final(poison, final)

    def _final(poison, final):
        return poison.state(final, T) if output_final_state else None

    return _run("gdn", implementation, run_xla, lambda: run_pallas(_pallas("gdn")), default="gdn")


def _empty(v, initial_state, N, HV, K, V, output_final_state):
    """The result without tokens (T = 0) or without sequences (B = 0)."""
    final = jnp.zeros((N, HV, K, V), jnp.float32) if initial_state is None else initial_state
    return jnp.zeros(v.shape, v.dtype), (final if output_final_state else None)


def _channel_op(variant, q, k, v, g, b, w, *, scale, initial_state, output_final_state,
                use_qk_l2norm, cu_seqlens, chunk_size, implementation, qat):  # fmt: skip
    """Shared body of kda and gdn2 once their gates are given GDN2's form (b = w = β [.., 1]
    for kda)."""
    B, T, K = q.shape[0], q.shape[1], q.shape[3]
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if T == 0 or B == 0:
        val.check_scale(scale, K)
        return _empty(v, initial_state, N, HV, K, V, output_final_state)
    kda_gates = b is w
    raw = (q, k, v, g, b, w)
    scale = val.check_scale(scale, K)
    val.check_log_decay("g", g)
    cu_seqlens = val.sanitize_cu_seqlens(cu_seqlens, T)

    def run_xla():
        cols = () if kda_gates else (w,)
        (qc, kc, vc, gc, (bc,), cols), poison = _sanitize.inputs(q, k, v, g, (b,), cols, cu_seqlens)
        o, final = _xla.chunked(
            qc, kc, vc, gc, bc, bc if kda_gates else cols[0], scale=scale,
            initial_state=initial_state, use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens,
            chunk_size=chunk_size, qat=qat,
        )  # fmt: skip
        return poison.output(o), _final(poison, final)

    def run_pallas(fn):
        _pallas_sees_layout(q, k, v, g, b, w, initial_state)
        # The channel kernels read non-finite q, k, v, b, w values as 0 and the glue clamps the
        # raw g (the sanitation's replacements, :func:`gdn_jax.ops._channel_pallas.
        # channel_pallas`); the gate cumsum finds g's bad values as it loads them. XLA writes
        # no sanitised copies and reduces the flags of q, k, v and the gates, and the chunk
        # loop puts the NaN into o as it stores it.
        poison = _sanitize.poison(
            v.shape, cu_seqlens, rows=(q,), heads=(k, b), cols=(v,) if kda_gates else (v, w)
        )
        o, final = fn(
            *raw, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm,
            cu_seqlens=cu_seqlens, chunk_size=chunk_size, qat=qat, poison=poison,
        )  # fmt: skip
        return o, _final(poison, final)

    def _final(poison, final):
        return poison.state(final, T) if output_final_state else None

    return _run(
        variant, implementation, run_xla, lambda: run_pallas(_pallas(variant)), default=variant
    )


def kda(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    cu_seqlens: jax.Array | None = None,
    chunk_size: int = 64,
    implementation: str | Sequence[str] | None = None,
    qat: QATConfig | None = None,
    sharding: ShardingConfig | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Kimi Delta Attention: GDN with a decay per key channel, chunked and trainable.

    ``S ← Diag(e^{g_t}) S;  S ← S + β_t k_t (v_t − Sᵀk_t)ᵀ;  o_t = scale · Sᵀ q_t``.

    Args:
      q, k: [B, T, H, K]; v: [B, T, HV, V] (bf16/f16/f32, HV % H == 0).
      g: [B, T, HV, K] per-channel log-decay, f32 (bf16/f16 upcast).
      beta: [B, T, HV] f32 (bf16/f16 upcast).
      Other keywords as :func:`gated_delta_rule`.

    Returns:
      o [B, T, HV, V] in v.dtype, final state [N, HV, K, V] f32 or None.
    """
    B, T, H, HV, K, V, N = val.check_common(
        q, k, v, initial_state=initial_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size
    )
    if sharding is None:
        sharding = _implicit_sharding(
            "kda", "q k v g beta", (q, k, v, g, beta), ("initial_state", initial_state)
        )
    if sharding is not None:
        return _sharded(
            kda, sharding, (q, k, v, g, beta),
            scale=scale, initial_state=initial_state, output_final_state=output_final_state,
            use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
            implementation=implementation, qat=qat,
        )  # fmt: skip
    val.check_gate("g", g, (B, T, HV, K))
    val.check_gate("beta", beta, (B, T, HV))
    val.check_qat(qat, chunk_size)
    b = beta.astype(jnp.float32)[..., None]
    return _channel_op(
        "kda", q, k, v, g.astype(jnp.float32), b, b, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm,
        cu_seqlens=cu_seqlens, chunk_size=chunk_size, implementation=implementation, qat=qat,
    )  # fmt: skip


def gdn2(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    b: jax.Array,
    w: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    cu_seqlens: jax.Array | None = None,
    chunk_size: int = 64,
    implementation: str | Sequence[str] | None = None,
    qat: QATConfig | None = None,
    sharding: ShardingConfig | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Gated DeltaNet-2: channel decay, channel erase gate and channel write gate.

    ``S ← Diag(e^{g_t}) S;  v' = w_t ⊙ v_t − Sᵀ(b_t ⊙ k_t);  S ← S + k_t v'ᵀ;``
    ``o_t = scale · Sᵀ q_t``.
    ``b = w = β`` gives :func:`kda`.

    Args:
      q, k: [B, T, H, K]; v: [B, T, HV, V] (bf16/f16/f32, HV % H == 0).
      g: [B, T, HV, K] log-decay; b: [B, T, HV, K] erase gate; w: [B, T, HV, V] write gate
        (f32 or the io dtype; computed in f32).
      Other keywords as :func:`gated_delta_rule`.

    Returns:
      o [B, T, HV, V] in v.dtype, final state [N, HV, K, V] f32 or None.
    """
    B, T, H, HV, K, V, N = val.check_common(
        q, k, v, initial_state=initial_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size
    )
    val.check_gate("g", g, (B, T, HV, K))
    val.check_gate("b", b, (B, T, HV, K))
    if sharding is None:
        sharding = _implicit_sharding(
            "gdn2", "q k v g b w", (q, k, v, g, b, w), ("initial_state", initial_state)
        )
    if sharding is not None:
        return _sharded(
            gdn2, sharding, (q, k, v, g, b, w),
            scale=scale, initial_state=initial_state, output_final_state=output_final_state,
            use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
            implementation=implementation, qat=qat,
        )  # fmt: skip
    val.check_gate("w", w, (B, T, HV, V))
    val.check_qat(qat, chunk_size)
    f = jnp.float32
    return _channel_op(
        "gdn2", q, k, v, g.astype(f), b.astype(f), w.astype(f), scale=scale,
        initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
        implementation=implementation, qat=qat,
    )  # fmt: skip


def _check_step(q, k, v, state):
    B, T, H, HV, K, V = val.check_qkv(q, k, v)
    if T < 1:
        raise ValueError(f"decode steps need T >= 1 tokens; got q.shape={q.shape}")
    val.check_state("state", state, (B, HV, K, V))
    return B, T, H, HV, K, V


def _step_per_shard(op, name: str, names: str, arrays, state, **kw):
    """``op`` per shard through :func:`gdn_jax.sharding.shard_step` when the inputs' layouts ask
    for it; None otherwise (the caller runs unsharded)."""
    cfg = _implicit_sharding(name, names, arrays, ("state", state), decode=True)
    if cfg is None:
        return None
    from gdn_jax.sharding import shard_step

    return shard_step(op, cfg)(*arrays, state, **kw)


def _run_step(variant, implementation, q, k, v, g, b, w, state, *, scale, use_qk_l2norm):
    """Runs a decode step in GDN2 form (g, b scalar [B, T, HV] or channel; w None = scalar b)."""
    if q.shape[0] == 0:  # no sequences
        val.check_scale(scale, q.shape[-1])
        return jnp.zeros(v.shape, v.dtype), state
    scale = val.check_scale(scale, q.shape[-1])
    val.check_log_decay("g", g)

    def run_xla():
        cols = () if w is None else (w,)
        (qc, kc, vc, gc, (bc,), cols), poison = _sanitize.inputs(q, k, v, g, (b,), cols, None)
        wc = cols[0] if cols else None
        ge = gc if gc.ndim == 4 else gc[..., None]
        be = bc if bc.ndim == 4 else bc[..., None]
        o, new_state = _rec.recurrent_step(
            qc, kc, vc, ge, be, be if wc is None else wc, state, scale=scale,
            use_qk_l2norm=use_qk_l2norm,
        )  # fmt: skip
        return poison.output(o), poison.state(new_state, q.shape[1])

    def run_pallas():
        from gdn_jax.ops._step_pallas import step_pallas

        _pallas_sees_layout(q, k, v, g, b, w, state)
        # the raw inputs: the kernel makes the sanitation and puts the NaN into o and the state
        # itself (no XLA pass over the inputs, o or the carried state)
        return step_pallas(q, k, v, g, b, w, state, scale=scale, use_qk_l2norm=use_qk_l2norm)

    return _run(f"{variant}_step", implementation, run_xla, run_pallas, default="step")


def gated_delta_rule_step(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    implementation: str | Sequence[str] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Decode: append T ≥ 1 tokens of each of B sequences to their carried f32 states.

    Args:
      q, k: [B, T, H, K]; v: [B, T, HV, V]; g, beta: [B, T, HV]; state: [B, HV, K, V] f32.
      scale, use_qk_l2norm: as :func:`gated_delta_rule`.
      implementation: None (best for the platform), "pallas" (the Mosaic GPU decode kernel:
        K, V in {64, 128}, T ≤ 64, HV % 4 == 0 for scalar gates), "xla" (the token recurrence),
        or a sequence tried in order.

    Returns:
      o [B, T, HV, V] in v.dtype, new state [B, HV, K, V] f32. Jit with the state donated
      (``donate_argnums``) to update it in place: the Pallas kernel then writes the new state
      into the donated buffer (read and written once, no copy).
    """
    B, T, H, HV, K, V = _check_step(q, k, v, state)
    val.check_gate("g", g, (B, T, HV))
    val.check_gate("beta", beta, (B, T, HV))
    sharded = _step_per_shard(
        gated_delta_rule_step, "gated_delta_rule_step", "q k v g beta", (q, k, v, g, beta),
        state, scale=scale, use_qk_l2norm=use_qk_l2norm, implementation=implementation,
    )  # fmt: skip
    if sharded is not None:
        return sharded
    f = jnp.float32
    return _run_step(
        "gdn", implementation, q, k, v, g.astype(f), beta.astype(f), None, state,
        scale=scale, use_qk_l2norm=use_qk_l2norm,
    )  # fmt: skip


def kda_step(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    implementation: str | Sequence[str] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Decode for :func:`kda`: g [B, T, HV, K], beta [B, T, HV], state [B, HV, K, V] f32.

    Other arguments and the return value as :func:`gated_delta_rule_step`.
    """
    B, T, H, HV, K, V = _check_step(q, k, v, state)
    val.check_gate("g", g, (B, T, HV, K))
    val.check_gate("beta", beta, (B, T, HV))
    sharded = _step_per_shard(
        kda_step, "kda_step", "q k v g beta", (q, k, v, g, beta), state, scale=scale,
        use_qk_l2norm=use_qk_l2norm, implementation=implementation,
    )  # fmt: skip
    if sharded is not None:
        return sharded
    f = jnp.float32
    return _run_step(
        "kda", implementation, q, k, v, g.astype(f), beta.astype(f), None, state,
        scale=scale, use_qk_l2norm=use_qk_l2norm,
    )  # fmt: skip


def gdn2_step(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    b: jax.Array,
    w: jax.Array,
    state: jax.Array,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    implementation: str | Sequence[str] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Decode for :func:`gdn2`: g, b [B, T, HV, K], w [B, T, HV, V], state [B, HV, K, V] f32.

    Other arguments and the return value as :func:`gated_delta_rule_step`.
    """
    B, T, H, HV, K, V = _check_step(q, k, v, state)
    val.check_gate("g", g, (B, T, HV, K))
    val.check_gate("b", b, (B, T, HV, K))
    val.check_gate("w", w, (B, T, HV, V))
    sharded = _step_per_shard(
        gdn2_step, "gdn2_step", "q k v g b w", (q, k, v, g, b, w), state, scale=scale,
        use_qk_l2norm=use_qk_l2norm, implementation=implementation,
    )  # fmt: skip
    if sharded is not None:
        return sharded
    f = jnp.float32
    return _run_step(
        "gdn2", implementation, q, k, v, g.astype(f), b.astype(f), w.astype(f), state,
        scale=scale, use_qk_l2norm=use_qk_l2norm,
    )  # fmt: skip


def short_conv(
    x: jax.Array,
    weight: jax.Array,
    *,
    activation: Callable[[jax.Array], jax.Array] | None = jax.nn.silu,
    cu_seqlens: jax.Array | None = None,
    tail: jax.Array | None = None,
    dtype=None,
    implementation: str | Sequence[str] | None = None,
) -> jax.Array:
    """Depthwise causal convolution over time, then ``activation`` (the q/k/v conv of GDN layers).

    ``y[t, c] = act(Σ_j weight[j, c] · x[t − (W − 1) + j, c])`` with f32 sums: the last tap
    multiplies the current token (PyTorch's ``Conv1d(padding=W − 1)`` cut to the first T outputs);
    taps that reach before t = 0, before ``tail`` or before a packed sequence's first token read 0.

    Args:
      x: [B, T, C].
      weight: [W, C] taps.
      activation: a callable or None; the Pallas kernels serve ``jax.nn.silu`` and None.
      cu_seqlens: optional [N + 1] int32 boundaries of packed sequences (B == 1).
      tail: optional [B, W − 1, C], the inputs preceding x (decode cache); zeros when omitted
        (the Pallas kernels serve only the omitted case).
      dtype: dtype of y (default x.dtype).
      implementation: None (best for the platform), "pallas", "xla", or a sequence tried in order.
        The Pallas kernels take 16-bit x and y, C (per shard) a multiple of 64 and W <= 4; on
        Explicit mesh axes they run per shard of batch and channels (see
        :func:`gdn_jax.ops._short_conv.short_conv_pallas`).
    Returns:
      y [B, T, C] in ``dtype``.
    """
    from gdn_jax.ops import _short_conv

    val.check_array("x", x)
    val.check_array("weight", weight)
    if x.ndim != 3:
        raise ValueError(f"x must be [B, T, C]; got {x.shape=}")
    B, T, C = x.shape
    if weight.ndim != 2 or weight.shape[1] != C or weight.shape[0] < 1:
        raise ValueError(f"weight must be [W, C={C}] with W >= 1; got {weight.shape=}")
    W = weight.shape[0]
    if tail is not None and tail.shape != (B, W - 1, C):
        raise ValueError(f"tail must be [B, W - 1, C] = {(B, W - 1, C)}; got {tail.shape=}")
    cu_seqlens = val.prepare_cu_seqlens(cu_seqlens, B, T)
    kw = dict(activation=activation, cu_seqlens=cu_seqlens, tail=tail,
              dtype=jnp.dtype(dtype or x.dtype))  # fmt: skip
    if x.size == 0:  # no tokens (or no rows): every implementation's answer is the empty one
        return _short_conv.short_conv_xla(x, weight, **kw)
    return _run(
        "short_conv",
        implementation,
        lambda: _short_conv.short_conv_xla(x, weight, **kw),
        lambda: _short_conv.short_conv_pallas(x, weight, **kw),
        default="short_conv",
    )
