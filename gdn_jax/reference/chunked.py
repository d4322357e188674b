"""Chunked (WY) form of GDN, KDA and GDN2 in pure JAX, one function per kernel stage.

The stages (docs/design.md) work on chunked tensors ``[L, NC, C, HV, D]``
(see :class:`gdn_jax.reference._common.ChunkLayout`):

1. :func:`gate_cumsum`       G = chunk-local cumulative log-decay (f32).
2. :func:`intra_chunk`       A = (I + strict_tril(b k kᵀ ⊙ decay))⁻¹,
                             w = A(b ⊙ e^G ⊙ k), u = A(w_gate ⊙ v).
3. :func:`state_recurrence`  sequential over chunks: v_new = u − w S,
                             S ← e^{G_last} S + (k e^{G_last−G})ᵀ v_new.
4. :func:`chunk_output`      o = scale [(q e^G) S + (q kᵀ ⊙ decay ⊙ causal) v_new].

Gates carry a trailing axis: ``Kg = 1`` for a scalar decay per head (GDN), ``Kg = K`` for a decay
per key channel (KDA, GDN2); the erase gate ``b`` is [.., 1] or [.., K] and the write gate ``w``
is [.., 1] or [.., V]. With a scalar decay ``exp(G_i − G_j)`` is formed directly (≤ 1 for j ≤ i).
With a channel decay it sits inside the K contraction, so it is factored around the first row of
each 16-row sub-chunk, giving factors that are all ≤ 1; pairs inside one sub-chunk are formed
explicitly. Exponents are masked before ``exp`` so nothing overflows.

Precision: gate cumsums, K Kᵀ products, the triangular solve, the state and every accumulation are
f32. The operands of the products with the state and with ``v_new`` are rounded to the io dtype
(as tensor-core operands are); with f32 inputs everything is f32 at HIGHEST precision.

``qat`` (a :class:`gdn_jax.qat.QATConfig`) fake-quantises w and the state entering each chunk;
this is the definition the xla and Pallas QAT paths are checked against.

The public ``chunk_*`` functions here are differentiated by plain autodiff (they keep every
intermediate); the trainable, memory-frugal path is ``implementation="xla"`` in ``gdn_jax.ops``,
which reuses these stages under a ``custom_vjp``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from gdn_jax.reference._common import (
    ChunkLayout,
    chunk_layout,
    from_chunks,
    l2norm,
    to_chunks,
)
from gdn_jax.reference._common import mm as _mm_io

__all__ = [
    "chunk_gated_delta_rule",
    "chunk_kda",
    "chunk_gdn2",
    "gate_cumsum",
    "intra_chunk",
    "state_recurrence",
    "chunk_output",
    "chunk_forward",
    "pairwise_decay",
]

f32 = jnp.float32
SUB_CHUNK = 16


def mm(spec: str, a: jax.Array, b: jax.Array, dtype=None) -> jax.Array:
    """The chunked path's products: operands rounded to ``dtype`` straight-through, f32 sums."""
    return _mm_io(spec, a, b, dtype, exact_grad=True)


def gate_cumsum(g: jax.Array) -> jax.Array:
    """Chunk-local inclusive cumulative sum of the log-decay.

    A product with the lower-triangular ones matrix of each chunk, in f32 (HIGHEST precision):
    XLA lowers ``cumsum`` on the GPU to reduce-windows over a transposed copy (0.16 ms forward,
    0.36 ms backward at B4 T4096 HV16 K128 on the H200 in a ``jax.profiler`` trace of
    ``bench_gdn.py --variant kda``); the product reads and writes each tensor once, its transpose
    likewise.

    Args:
      g: [L, NC, C, ...] per-token log-decay (e.g. [L, NC, C, HV, Kg]; padding rows are 0).
    Returns:
      G: g's shape, f32.
    """
    L, NC, C = g.shape[:3]
    tril = jnp.broadcast_to(jnp.tril(jnp.ones((C, C), f32)), (L, NC, C, C))
    flat = g.astype(f32).reshape(L, NC, C, math.prod(g.shape[3:]))
    dims = (((3,), (2,)), ((0, 1), (0, 1)))  # contract the row within the chunk; batch L, NC
    G = jax.lax.dot_general(tril, flat, dims, precision=jax.lax.Precision.HIGHEST)
    return G.reshape(g.shape)


def pairwise_decay(a: jax.Array, b: jax.Array, G: jax.Array, *, strict: bool, dtype) -> jax.Array:
    """``M_ij = Σ_k a_ik b_jk exp(G_ik − G_jk)`` on the lower triangle of each chunk.

    Args:
      a, b: [..., C, HV, K]; G: [..., C, HV, Kg] f32 with Kg in {1, K}.
      strict: keep j < i (else j <= i).
      dtype: operand dtype of the contraction.
    Returns:
      M: [..., HV, C, C] f32, zero above the kept triangle.
    """
    C = a.shape[-3]
    i = jnp.arange(C)[:, None]
    j = jnp.arange(C)[None, :]
    keep = j < i if strict else j <= i
    if G.shape[-1] == 1:
        Gh = jnp.swapaxes(G[..., 0], -1, -2)  # [..., HV, C]
        d = Gh[..., :, None] - Gh[..., None, :]
        return jnp.where(
            keep, mm("...ihk,...jhk->...hij", a, b, dtype) * jnp.exp(jnp.where(keep, d, 0.0)), 0.0
        )

    s = min(SUB_CHUNK, C)
    n = C // s
    lead = a.shape[:-3]
    HV, K = a.shape[-2], a.shape[-1]
    a32, b32 = a.astype(f32), b.astype(f32)
    # Off-diagonal sub-chunk blocks: reference row r_I = first row of sub-chunk I. Then
    # a_i e^{G_i - r_I} <= 1 for rows of I and b_j e^{r_I - G_j} <= 1 for columns before I.
    blk_start = (jnp.arange(C) // s) * s
    r_row = jnp.take(G, blk_start, axis=-3)  # [..., C, HV, K]
    a_f = (a32 * jnp.exp(G - r_row)).reshape(lead + (n, s, HV, K))
    r_blk = jnp.take(G, jnp.arange(n) * s, axis=-3)  # [..., n, HV, K]
    before = jnp.arange(C)[None, :] < (jnp.arange(n) * s)[:, None]  # [n, C]
    before_e = before[:, :, None, None]
    expo = jnp.where(before_e, r_blk[..., :, None, :, :] - G[..., None, :, :, :], 0.0)
    b_f = jnp.where(before_e, b32[..., None, :, :, :] * jnp.exp(expo), 0.0)  # [..., n, C, HV, K]
    off = mm("...nihk,...njhk->...hnij", a_f, b_f, dtype)  # [..., HV, n, s, C]
    # Diagonal blocks: explicit pairwise decay inside each sub-chunk.
    Gb = G.reshape(lead + (n, s, HV, K))
    ii = jnp.arange(s)[:, None]
    jj = jnp.arange(s)[None, :]
    keep_d = (jj < ii if strict else jj <= ii)[:, :, None, None]
    dd = jnp.where(keep_d, Gb[..., :, None, :, :] - Gb[..., None, :, :, :], 0.0)
    ab = a32.reshape(lead + (n, s, 1, HV, K)) * b32.reshape(lead + (n, 1, s, HV, K))
    diag = jnp.sum(jnp.where(keep_d, ab * jnp.exp(dd), 0.0), axis=-1)  # [..., n, s, s, HV]
    diag = jnp.moveaxis(diag, -1, -4)  # [..., HV, n, s, s]
    diag_full = jnp.einsum("...nij,nm->...nimj", diag, jnp.eye(n, dtype=f32)).reshape(
        lead + (HV, n, s, C)
    )
    return (off + diag_full).reshape(lead + (HV, C, C))


def intra_chunk(k, v, b, w, G, *, dtype):
    """Intra-chunk WY stage.

    Args:
      k: [..., C, HV, K]; v: [..., C, HV, V]; b: [..., C, HV, Kb]; w: [..., C, HV, Vw];
      G: [..., C, HV, Kg] f32.
      dtype: operand dtype of K Kᵀ.
    Returns:
      A: [..., HV, C, C] f32 unit lower triangular, (I + strict_tril(b k kᵀ ⊙ decay))⁻¹.
      wk: [..., C, HV, K] f32 = A (b ⊙ e^G ⊙ k).
      u: [..., C, HV, V] f32 = A (w ⊙ v).
    """
    bk = b.astype(f32) * k.astype(f32)
    L = pairwise_decay(bk, k, G, strict=True, dtype=dtype)
    C = k.shape[-3]
    eye = jnp.eye(C, dtype=f32)
    A = jax.scipy.linalg.solve_triangular(
        eye + L, jnp.broadcast_to(eye, L.shape), lower=True, unit_diagonal=True
    )
    wk = mm("...hij,...jhk->...ihk", A, bk * jnp.exp(G))
    u = mm("...hij,...jhv->...ihv", A, w.astype(f32) * v.astype(f32))
    return A, wk, u


def decayed_keys(k, G):
    """k_i e^{G_last − G_i} (≤ 1 factors) and e^{G_last}.

    Args:
      k: [..., C, HV, K]; G: [..., C, HV, Kg] f32.
    Returns:
      kdec [..., C, HV, K] f32, decay_last [..., HV, Kg] f32.
    """
    G_last = G[..., -1, :, :]
    return k.astype(f32) * jnp.exp(G_last[..., None, :, :] - G), jnp.exp(G_last)


def chunk_step(S, wk, u, kdec, decay_last, *, dtype):
    """State update of one chunk for all lanes.

    Args:
      S: [L, HV, K, V] f32, the state entering the chunk.
      wk: [L, C, HV, K]; u: [L, C, HV, V]; kdec: [L, C, HV, K]; decay_last: [L, HV, Kg].
    Returns:
      v_new [L, C, HV, V] f32, S_out [L, HV, K, V] f32.
    """
    v_new = u - mm("lchk,lhkv->lchv", wk, S, dtype)
    S_out = decay_last[..., None] * S + mm("lchk,lchv->lhkv", kdec, v_new, dtype)
    return v_new, S_out


def state_recurrence(wk, u, kdec, decay_last, h0, layout: ChunkLayout, *, dtype, qat=None):
    """Inter-chunk recurrence, sequential over the NC axis.

    Args:
      wk, kdec: [L, NC, C, HV, K]; u: [L, NC, C, HV, V]; decay_last: [L, NC, HV, Kg].
      h0: [N, HV, K, V] f32 initial states.
      qat: optional :class:`gdn_jax.qat.QATConfig`; its state site fake-quantises the state
        entering each chunk (used by the chunk's output and update).
    Returns:
      S_in: [L, NC, HV, K, V] f32 state entering each chunk (as used); v_new: [L, NC, C, HV, V]
      f32; final: [N, HV, K, V] f32.
    """
    h0x = jnp.concatenate([h0, jnp.zeros_like(h0[:1])])  # row N serves padding chunks

    def body(S, x):
        wk_c, u_c, kdec_c, dl_c, first_c, seq_c = x
        S = jnp.where(first_c[:, None, None, None], h0x[seq_c], S)
        if qat is not None:
            S = qat.quantize_state(S)
        v_new, S_out = chunk_step(S, wk_c, u_c, kdec_c, dl_c, dtype=dtype)
        return S_out, (S, v_new, S_out)

    xs = (wk, u, kdec, decay_last, layout.first, layout.seq)
    xs = tuple(jnp.swapaxes(x, 0, 1) for x in xs)
    S0 = jnp.zeros((wk.shape[0],) + h0.shape[1:], f32)
    _, (S_in, v_new, S_out) = jax.lax.scan(body, S0, xs)
    S_in, v_new, S_out = (jnp.swapaxes(x, 0, 1) for x in (S_in, v_new, S_out))
    final = final_states(S_out, h0, layout)
    return S_in, v_new, final


def final_states(S_out, h0, layout: ChunkLayout):
    """Scatter each sequence's last chunk end state into [N, HV, K, V]; empty ones keep h0."""
    N = h0.shape[0]
    idx = jnp.where(layout.last, layout.seq, N).reshape(-1)
    out = jnp.zeros((N + 1,) + h0.shape[1:], f32).at[idx].set(S_out.reshape((-1,) + h0.shape[1:]))
    return jnp.where(layout.empty[:, None, None, None], h0, out[:N])


def chunk_output(q, k, G, S_in, v_new, *, scale, dtype):
    """Output stage.

    Args:
      q, k: [..., C, HV, K]; G: [..., C, HV, Kg] f32; S_in: [..., HV, K, V] f32;
      v_new: [..., C, HV, V] f32.
    Returns:
      o: [..., C, HV, V] f32.
    """
    qg = q.astype(f32) * jnp.exp(G)
    inter = mm("...chk,...hkv->...chv", qg, S_in, dtype)
    P = pairwise_decay(q, k, G, strict=False, dtype=dtype)
    intra = mm("...hij,...jhv->...ihv", P, v_new, dtype)
    return scale * (inter + intra)


def chunk_forward(q, k, v, g, b, w, h0, layout: ChunkLayout, *, scale, dtype, qat=None):
    """All four stages on chunked inputs (see module docstring for shapes); ``qat`` optionally
    fake-quantises w and the chunk-entering states (:mod:`gdn_jax.qat`).

    Returns:
      o [L, NC, C, HV, V] f32, final [N, HV, K, V] f32, and the stage intermediates
      (G, A, S_in) that a backward pass keeps.
    """
    G = gate_cumsum(g)
    A, wk, u = intra_chunk(k, v, b, w, G, dtype=dtype)
    if qat is not None:
        wk = qat.quantize_w(wk)
    kdec, decay_last = decayed_keys(k, G)
    S_in, v_new, final = state_recurrence(wk, u, kdec, decay_last, h0, layout, dtype=dtype, qat=qat)
    o = chunk_output(q, k, G, S_in, v_new, scale=scale, dtype=dtype)
    return o, final, (G, A, S_in)


def prepare(q, k, v, g, b, w, initial_state, use_qk_l2norm, cu_seqlens, chunk_size):
    """Public layouts -> chunked layouts (GVA q/k repeated to HV heads, gates given trailing axes).

    Returns:
      (qc, kc, vc, gc, bc, wc) chunked, h0 [N, HV, K, V] f32, layout.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if use_qk_l2norm:
        # Kept in f32: the products round them to the io dtype on the way in, and the norm's
        # backward (a projection that cancels most of dk) then sees f32 cotangents.
        q, k = l2norm(q, f32), l2norm(k, f32)
    rep = HV // H
    q = jnp.repeat(q, rep, axis=2)
    k = jnp.repeat(k, rep, axis=2)
    layout = chunk_layout(B, T, chunk_size, cu_seqlens)
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    h0 = jnp.zeros((N, HV, K, V), f32) if initial_state is None else initial_state.astype(f32)
    chunks = tuple(
        to_chunks(x, layout) for x in (q, k, v, g.astype(f32), b.astype(f32), w.astype(f32))
    )
    return chunks, h0, layout


def _chunk(
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
    chunk_size,
    qat,
):
    B, T = q.shape[:2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    (qc, kc, vc, gc, bc, wc), h0, layout = prepare(
        q, k, v, g, b, w, initial_state, use_qk_l2norm, cu_seqlens, chunk_size
    )
    o, final, _ = chunk_forward(
        qc, kc, vc, gc, bc, wc, h0, layout, scale=scale, dtype=v.dtype, qat=qat
    )
    o = from_chunks(o, layout, B, T).astype(v.dtype)
    return o, (final if output_final_state else None)


def chunk_gated_delta_rule(
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
    """GDN in chunked form (scalar decay g [B, T, HV]). Shapes as ``gdn_jax.gated_delta_rule``."""
    beta = beta[..., None]
    return _chunk(
        q, k, v, g[..., None], beta, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm,
        cu_seqlens=cu_seqlens, chunk_size=chunk_size, qat=qat,
    )  # fmt: skip


def chunk_kda(
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
    """KDA in chunked form (channel decay g [B, T, HV, K]). Shapes as ``gdn_jax.kda``."""
    beta = beta[..., None]
    return _chunk(
        q, k, v, g, beta, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm,
        cu_seqlens=cu_seqlens, chunk_size=chunk_size, qat=qat,
    )  # fmt: skip


def chunk_gdn2(
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
    """GDN2 in chunked form (g, b [B, T, HV, K]; w [B, T, HV, V]). Shapes as ``gdn_jax.gdn2``."""
    return _chunk(
        q, k, v, g, b, w, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm,
        cu_seqlens=cu_seqlens, chunk_size=chunk_size, qat=qat,
    )  # fmt: skip
