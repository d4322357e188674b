"""Token-by-token recurrences: the semantic oracle for GDN, KDA and GDN2.

All three are one recurrence with a per-key-channel decay ``g``, an erase gate ``b`` over K and a
write gate ``w`` over V (docs/design.md)::

    S <- Diag(exp(g_t)) S
    v' = w_t * v_t - S^T (b_t * k_t)
    S <- S + k_t v'^T
    o_t = scale * S^T q_t

GDN is ``g`` scalar per head and ``b = w = beta``; KDA is ``g`` per key channel and
``b = w = beta``.

Precision: the state is f32. The products with the state (``S^T k``, ``S^T q``) take their operands
in the io dtype of ``v`` (the state is rounded to it, as a tensor-core operand would be) and
accumulate in f32. With f32 inputs everything is f32: that is the oracle. With bf16/f16 inputs this
is "the reference run in that dtype" of the 2x tolerance rule (docs/design.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gdn_jax.reference._common import l2norm, mm, sequence_ids

__all__ = [
    "recurrent_gated_delta_rule",
    "recurrent_kda",
    "recurrent_gdn2",
    "recurrent_step",
]

f32 = jnp.float32


def _step(S, q, k, v, g, b, w, scale, io_dtype):
    """One token for all sequences and heads.

    Args:
      S: [N, HV, K, V] f32 state.
      q, k: [N, HV, K] f32; v: [N, HV, V] f32.
      g: [N, HV, Kg] f32 (Kg 1 or K); b: [N, HV, Kb]; w: [N, HV, Vw] (broadcast over K / V).
    Returns:
      (new state, o [N, HV, V] f32).
    """
    S = S * jnp.exp(g)[..., :, None]
    erase = mm("nhk,nhkv->nhv", b * k, S, io_dtype)
    v_delta = w * v - erase
    S = S + k[..., :, None] * v_delta[..., None, :]
    o = mm("nhk,nhkv->nhv", q, S, io_dtype)
    return S, o * scale


def _recurrent(
    q,
    k,
    v,
    g,
    b,
    w,
    *,
    scale,
    initial_state,
    output_final_state,
    use_qk_l2norm,
    cu_seqlens,
    qat=None,
    chunk_size=64,
):
    """Shared recurrence. Shapes are the public ones with gates already given a trailing axis.

    Args:
      q, k: [B, T, H, K]; v: [B, T, HV, V].
      g: [B, T, HV, Kg]; b: [B, T, HV, Kb]; w: [B, T, HV, Vw] with Kg, Kb in {1, K}, Vw in {1, V}.
      initial_state: [N, HV, K, V] f32 or None.
      cu_seqlens: [N + 1] int32 or None (then N = B).
    Returns:
      o [B, T, HV, V] in v.dtype, final state [N, HV, K, V] f32 or None.

    QAT: with ``qat`` (a :class:`gdn_jax.qat.QATConfig` whose only site is the state) the state
    is fake-quantised before every ``chunk_size``-th token of each sequence, i.e. exactly the
    state entering each chunk of the chunked form. The w site has no token-level meaning.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    io_dtype = v.dtype
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    rep = HV // H
    q = jnp.repeat(q.astype(f32), rep, axis=2)
    k = jnp.repeat(k.astype(f32), rep, axis=2)
    v, g, b, w = (x.astype(f32) for x in (v, g, b, w))
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    h0 = jnp.zeros((N, HV, K, V), f32) if initial_state is None else initial_state.astype(f32)

    if qat is not None and "w" in qat.sites:
        raise NotImplementedError("the token recurrence has no w; check the w site in chunk form")

    def quantize_at_chunk_start(S, pos):
        if qat is None:
            return S
        return jnp.where(pos % chunk_size == 0, qat.quantize_state(S), S)

    # time-major: [T, B, ...]
    xs = tuple(jnp.swapaxes(x, 0, 1) for x in (q, k, v, g, b, w))
    t = jnp.arange(T, dtype=jnp.int32)
    if cu_seqlens is None:

        def body(S, x):
            pos, xt = x
            S, o = _step(quantize_at_chunk_start(S, pos), *xt, scale, io_dtype)
            return S, o

        final, o = jax.lax.scan(body, h0, (t, xs))
    else:
        seq = sequence_ids(cu_seqlens, T)  # [T]
        starts = cu_seqlens[seq] == jnp.arange(T)

        def body(carry, x):
            S, finals = carry
            t_seq, t_start, pos, xt = x
            S = jnp.where(t_start, h0[t_seq][None], S)
            S, o = _step(quantize_at_chunk_start(S, pos), *xt, scale, io_dtype)
            finals = finals.at[t_seq].set(S[0])
            return (S, finals), o

        pos = t - cu_seqlens[seq]
        (_, final), o = jax.lax.scan(body, (h0[:1], h0), (seq, starts, pos, xs))
    o = jnp.swapaxes(o, 0, 1).astype(io_dtype)
    return o, (final if output_final_state else None)


def _default_scale(q, scale):
    return q.shape[-1] ** -0.5 if scale is None else scale


def recurrent_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm=False,
    cu_seqlens=None,
    chunk_size=64,
    qat=None,
):
    """GDN by its token recurrence (scalar decay per head). Shapes as ``gdn_jax.gated_delta_rule``.

    ``chunk_size`` only matters with ``qat`` (the state is quantised every chunk_size tokens).
    """
    beta = beta[..., None]
    return _recurrent(
        q,
        k,
        v,
        g[..., None],
        beta,
        beta,
        scale=_default_scale(q, scale),
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm=use_qk_l2norm,
        cu_seqlens=cu_seqlens,
        qat=qat,
        chunk_size=chunk_size,
    )


def recurrent_kda(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm=False,
    cu_seqlens=None,
    chunk_size=64,
    qat=None,
):
    """KDA by its token recurrence (channel decay g [B, T, HV, K]). Shapes as ``gdn_jax.kda``."""
    beta = beta[..., None]
    return _recurrent(
        q,
        k,
        v,
        g,
        beta,
        beta,
        scale=_default_scale(q, scale),
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm=use_qk_l2norm,
        cu_seqlens=cu_seqlens,
        qat=qat,
        chunk_size=chunk_size,
    )


def recurrent_gdn2(
    q,
    k,
    v,
    g,
    b,
    w,
    *,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm=False,
    cu_seqlens=None,
    chunk_size=64,
    qat=None,
):
    """GDN2 by its token recurrence (g, b [B, T, HV, K]; w [B, T, HV, V]). Shapes as gdn2's."""
    return _recurrent(
        q,
        k,
        v,
        g,
        b,
        w,
        scale=_default_scale(q, scale),
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm=use_qk_l2norm,
        cu_seqlens=cu_seqlens,
        qat=qat,
        chunk_size=chunk_size,
    )


def recurrent_step(q, k, v, g, b, w, state, *, scale, use_qk_l2norm):
    """Decode: append T >= 1 tokens to a carried state, one state row per batch row.

    Args:
      q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, Kg]; b: [B, T, HV, Kb]; w: [B, T, HV, Vw].
      state: [B, HV, K, V] f32.
    Returns:
      o [B, T, HV, V] in v.dtype, new state [B, HV, K, V] f32.
    """
    return _recurrent(
        q,
        k,
        v,
        g,
        b,
        w,
        scale=scale,
        initial_state=state,
        output_final_state=True,
        use_qk_l2norm=use_qk_l2norm,
        cu_seqlens=None,
    )
