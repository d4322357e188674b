"""Backward of the channel-decay (GDN2 / KDA) Pallas core: the Mosaic GPU kernel sequence.

Called by :func:`gdn_jax.ops._channel_pallas._backward` with the core's residuals (its inputs on
padded lanes and the forward intra kernel's products qg, kg, w, u, Aqk, A, see that module's
docstring) and cotangents. Four launches plus small XLA glue:

1. recompute h (state entering each chunk, QAT-quantised as in the forward) and v_new
                                            :func:`pallas_kernels.recurrence.chunk_fwd.channel_chunk_fwd`
2. reverse state-gradient loop: dh per chunk, dv2 = dL/dv_new, dh0
                                            :func:`pallas_kernels.recurrence.bwd_dh.channel_bwd_dh`
3. dq, dk (output/state parts), dw (WY), dG pieces, per chunk
                                            :func:`pallas_kernels.channel.bwd_dqkw.channel_bwd_dqkw`
4. through the WY representation and A: dk, dv, dG, db, dw_gate (KDA: dβ), per chunk
                                            :func:`pallas_kernels.channel.bwd_wy.channel_bwd_wy`

The form of each kernel (K-split or not) comes from the call's plan
(:func:`pallas_kernels.channel.plan.channel_plan`, its docstring gives the table and the reasons).

XLA only sums the GVA value heads of a q/k head, the dG pieces, and adds the chunk-last-row term
e^{G_last} ⊙ Σ_v h ⊙ dh (the gradient of the state's decay). The gradient w.r.t. the per-token
gate g is the reverse chunk-local cumsum of dG, done by autodiff of the caller's cumsum.
"""

from __future__ import annotations

import jax.numpy as jnp

from gdn_jax.ops._pallas_common import zero_sequences_without_chunks
from pallas_kernels._tiles import CHUNK, LoopConfig
from pallas_kernels.channel.bwd_dqkw import channel_bwd_dqkw
from pallas_kernels.channel.bwd_wy import channel_bwd_wy
from pallas_kernels.channel.intra import reference_rows
from pallas_kernels.channel.plan import ChannelPlan
from pallas_kernels.recurrence.bwd_dh import channel_bwd_dh
from pallas_kernels.recurrence.chunk_fwd import channel_chunk_fwd

__all__ = ["channel_backward_pallas"]

f32 = jnp.float32


def channel_backward_pallas(
    q,
    k,
    v,
    G,
    b,
    w,
    h0,
    products,
    do,
    dht,
    meta=None,
    *,
    scale: float,
    plan: ChannelPlan,
):
    """Gradients of the channel-decay core on padded lanes (T % 64 == 0).

    Args:
      q, k: [N, T, H, K] io dtype (bf16 or f16); v: [N, T, HV, V] io dtype; K, V in {64, 128}.
      G: [N, T, HV, K] f32 chunk-local cumulative log-decay (padded rows repeat the last value).
      b: GDN2: [N, T, HV, K] f32 erase gate; KDA: β [N, T, HV] f32 (then ``w`` is None).
      w: GDN2: [N, T, HV, V] f32 write gate; KDA: None.
      h0: [N, HV, K, V] f32 initial state ([S, HV, K, V], one per sequence, with ``meta``).
      products: the forward intra kernel's ``(qg, kg, wk, u, Aqk, A)``
        (:func:`pallas_kernels.channel.intra.channel_intra` with ``store_a``; wk fake-quantised
        when the plan quantises w): [N, T, HV, K] ×3, [N, T, HV, V], [N, T, HV, 64] ×2, io dtype.
      do: [N, T, HV, V] cotangent of o; dht: [N, HV, K, V] cotangent of the final state
        ([S, HV, K, V] with ``meta``).
      meta: packed sequences on one lane (N == 1): the chunk loops' [T/64, META_COLS] int32
        table (:func:`gdn_jax.ops._pallas_common.packed_meta`), or None.
      scale: the output scale.
      plan: the forms of the kernels (:func:`pallas_kernels.channel.plan.channel_plan` of the
        differentiated forward, ``store_a=True``).
    Returns:
      (dq, dk [N, T, H, K] in q.dtype, dv [N, T, HV, V] in v.dtype, dG [N, T, HV, K] f32,
      db (b's shape, f32), dw (w's shape, f32; None for KDA), dh0 [N, HV, K, V] f32; with
      ``meta`` [S, HV, K, V], zero for sequences without chunks).
    """
    N, T, H, K = q.shape
    HV = v.shape[2]
    grp = HV // H
    nt = T // CHUNK
    dt = q.dtype
    scalar = w is None
    do = do.astype(dt)
    dht = dht.astype(f32)
    gr, gl = reference_rows(G)
    egl = jnp.exp(gl)
    bk = b.transpose(0, 2, 1) if scalar else b  # KDA: β as [N, HV, T] (TMA unit stride)

    qg, kg, wk, u, aqk, A = products
    # the forward's state loop (block_v, QAT state quant): h is the state the forward used
    h, vn = channel_chunk_fwd(
        None, kg, wk, u, None, egl, h0, plan.fwd_config(scale, store_h=True), meta
    )
    dh, dvh, dvl, dh0 = channel_bwd_dh(qg, kg, wk, do, aqk, egl, dht, LoopConfig(scale=scale), meta)
    if meta is not None:  # rows of sequences without chunks were never written
        dh0 = zero_sequences_without_chunks(dh0, meta)
    dq, dk_a, dwk, dG_a = channel_bwd_dqkw(
        q, k, G, gr, gl, h, dh, vn, do, dvh, dvl, scale=scale, k_split=plan.dqkw_k_split
    )
    outs = channel_bwd_wy(
        k,
        v,
        G,
        gr,
        gl,
        bk,
        w,
        A,
        dwk,
        dvh,
        dvl,
        plan.wy_config(),
    )
    if scalar:
        dk_b, dv, dG_b, dbeta = outs
        db, dw = dbeta.transpose(0, 2, 1), None
    else:
        dk_b, dv, dG_b, db, dw = outs

    def fold(x):  # [N, T, HV, K] -> [N, T, H, K], summing the value heads of a q/k head
        return x.reshape(N, T, H, grp, K).sum(3) if grp > 1 else x

    # the state's decay: S_end = e^{G_last} ⊙ h + …  gives e^{G_last} Σ_v h ⊙ dh on the last row
    hd = jnp.sum(h.astype(f32) * dh.astype(f32), axis=-1) * egl.transpose(0, 2, 1, 3)
    # (added in the sum's elementwise pass: a scatter into the last rows would be a pass of its own)
    at_last = (jnp.arange(CHUNK) == CHUNK - 1)[:, None, None]
    dG = (dG_a + dG_b).reshape(N, nt, CHUNK, HV, K) + jnp.where(at_last, hd[:, :, None], 0.0)
    dG = dG.reshape(N, T, HV, K)
    return (
        fold(dq).astype(q.dtype),
        fold(dk_a + dk_b).astype(k.dtype),
        dv.astype(v.dtype),
        dG,
        db,
        dw,
        dh0,
    )
