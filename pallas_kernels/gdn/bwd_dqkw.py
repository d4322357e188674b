"""Backward stage: dq, dk, dw and the gate-gradient pieces of one chunk, one CTA per (chunk, head).

With h = state entering the chunk, dh = gradient of the state at its end (both [K, V]), v_new and
dv2 = dL/dv_new from :mod:`pallas_kernels.recurrence.bwd_dh`, and Γ_ij = e^{G_i − G_j} [i ≥ j]:

    ds  = scale (do v_newᵀ) ⊙ Γ                                   [C, C]
    dq  = scale e^{G} ⊙ (do hᵀ) + ds k
    dk  = e^{G_last − G} ⊙ (v_new dhᵀ) + dsᵀ q                    (the first term is dk_state)
    dw  = −dv2 hᵀ
    dG  = Σ_k dq⊙q − Σ_k dk⊙k          (per row; the WY part is added by :mod:`bwd_wy`)
    dG_last += e^{G_last} ⟨h, dh⟩ + Σ_i Σ_k dk_state⊙k

The per-chunk scalar of the last line is returned as two pieces for the caller to add: the rows
of Σ_k dk_state⊙k, and diag(h dhᵀ) (its trace is ⟨h, dh⟩; a diagonal of a wgmma product avoids
loading the two [K, V] tiles into registers).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import _compat as cp
from pallas_kernels._compat import pl, plgpu
from pallas_kernels._tiles import CHUNK, chunk_coords, emit_tile, load_tiles, per_chunk_kernel
from pallas_kernels.gdn.fake_quant import f16_stage_scales

f32 = jnp.float32


def _split_hi_lo(x_s, hi_s, lo_s, dt):
    """x_s (f32 SMEM) -> hi + lo in 16-bit SMEM tiles (two-term split keeps ~f32 accuracy)."""
    x = cp.load_tile(x_s)
    hi = x.astype(dt)
    hi_s[...] = hi
    lo_s[...] = (x - hi.astype(f32)).astype(dt)


def _dqkw_body(
    q_g, k_g, h_g, dh_g, vn_g, do_g, dv2_g, g_g,  # inputs
    dq_g, dk_g, dw_g, dg_g, rs_g, hd_g,  # outputs
    *, scale: float, group: int,
):  # fmt: skip
    C = CHUNK
    c, hv, b, hk, rows = chunk_coords(group, C)
    K, V = q_g.shape[-1], vn_g.shape[-1]
    dt = q_g.dtype
    # f16 io: h and dh arrive in f32 and are staged as f16 with one scale per row (docs/design.md)
    scaled = dt == jnp.float16
    nkb = K // C

    def scoped(q_s, k_s, h_s, dh_s, vn_s, do_s, dvh_s, dvl_s, ds_s, g_s, out_s, vec_s, bar, *opt):
        opt = list(opt)
        sc_s = opt.pop(0) if scaled else None  # [2, K] row scales of the staged h, dh
        # f32 dv2 lands in the output staging tile when the shapes agree (SMEM at K = V = 128)
        dv2_s = opt.pop(0) if opt else out_s
        srcs = [
            (q_g.at[b, rows, hk, :], q_s),
            (k_g.at[b, rows, hk, :], k_s),
            (vn_g.at[b, rows, hv, :], vn_s),
            (do_g.at[b, rows, hv, :], do_s),
            (dv2_g.at[b, rows, hv, :], dv2_s),
            (g_g.at[b, hv, rows], g_s),
        ]
        if not scaled:
            srcs += [(h_g.at[b, c, hv], h_s), (dh_g.at[b, c, hv], dh_s)]
        load_tiles(srcs, bar)

        row = cp.iota((C, C), 0)
        col = cp.iota((C, C), 1)
        causal = row >= col
        g_r = cp.row_vec(g_s)
        g_c = cp.col_vec(g_s, C)
        g_last = g_s[C - 1]
        gd = cp.bcast_rows(g_r, (C, C)) - cp.bcast_cols(g_c, (C, C))

        dov = cp.matmul(do_s, vn_s.T, (C, C))
        ds = jnp.where(causal, dov * jnp.exp(jnp.where(causal, gd, 0.0)), 0.0) * scale
        ds_s[...] = ds.astype(dt)
        _split_hi_lo(dv2_s, dvh_s, dvl_s, dt)
        plgpu.commit_smem()
        if scaled:  # 64-row blocks of the f32 h, dh pass through the (now free) dv2 tile
            for t, (src_g, dst_s) in enumerate(((h_g, h_s), (dh_g, dh_s))):
                for j in range(nkb):
                    blk = pl.ds(j * C, C)
                    n = 8 + t * nkb + j
                    plgpu.copy_gmem_to_smem(src_g.at[b, c, hv, blk, :], dv2_s, bar.at[n])
                    plgpu.barrier_wait(bar.at[n])
                    x = cp.load_tile(dv2_s)
                    inv, sc = f16_stage_scales(x, axis=1)
                    dst_s.at[blk][...] = (x * cp.bcast_rows(inv, (C, V))).astype(dt)
                    sc_s.at[t, blk][...] = sc
                    plgpu.commit_smem()  # also: every thread has read dv2_s before the next TMA

        def unstage(x, t, n=K):  # results whose columns are rows of h (t=0) or dh (t=1)
            if not scaled:
                return x
            return x * cp.bcast_cols(cp.col_vec(sc_s.at[t, pl.ds(0, n)], n), x.shape)

        # dk = dk_state + dsᵀ q
        dks = unstage(cp.matmul(vn_s, dh_s.T, (C, K)), 1)
        dks = dks * cp.bcast_rows(jnp.exp(g_last - g_r), (C, K))
        kf = cp.load_tile(k_s).astype(f32)
        r3 = jnp.sum(dks * kf, axis=1)
        dk = dks + cp.matmul(ds_s.T, q_s, (C, K))
        r2 = jnp.sum(dk * kf, axis=1)
        emit_tile(dk, out_s, dk_g.at[b, rows, hv, :])
        # dq, after dk: an io-dtype dq is staged in q_s, which dk's product has read
        dq = unstage(cp.matmul(do_s, h_s.T, (C, K)), 0)
        dq = dq * cp.bcast_rows(scale * jnp.exp(g_r), (C, K))
        dq = dq + cp.matmul(ds_s, k_s, (C, K))
        r1 = jnp.sum(dq * cp.load_tile(q_s).astype(f32), axis=1)
        if dq_g.dtype == dt:
            plgpu.commit_smem()  # (a barrier: every thread has read q_s before dq overwrites it)
            emit_tile(dq.astype(dt), q_s, dq_g.at[b, rows, hv, :])
        else:
            emit_tile(dq, out_s, dq_g.at[b, rows, hv, :])

        # dw = −dv2 hᵀ with dv2 = hi + lo (both 16-bit)
        dw = -unstage(cp.matmul_sum(((dvh_s, h_s.T), (dvl_s, h_s.T)), (C, K)), 0)
        # reuse q_s (q no longer needed; an io-dtype dq's store has read it) as dw's staging tile
        q_s[...] = dw.astype(dt)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_s, dw_g.at[b, rows, hv, :])

        vec_s.at[0][...] = r1 - r2
        vec_s.at[1][...] = r3
        # diag(h dhᵀ) in 64-row blocks: trace = <h, dh>
        for j in range(K // C):
            blk = pl.ds(j * C, C)
            m = cp.matmul(h_s.at[blk], dh_s.at[blk].T, (C, C))
            if scaled:  # on the diagonal, row k = column k: both scales as column scales
                sh = cp.col_vec(sc_s.at[0, blk], C)
                sdh = cp.col_vec(sc_s.at[1, blk], C)
                m = m * cp.bcast_cols(sh * sdh, (C, C))
            vec_s.at[2 + j][...] = jnp.sum(jnp.where(row == col, m, 0.0), axis=1)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(vec_s.at[0], dg_g.at[b, hv, rows])
        plgpu.copy_smem_to_gmem(vec_s.at[1], rs_g.at[b, hv, rows])
        for j in range(K // C):
            plgpu.copy_smem_to_gmem(vec_s.at[2 + j], hd_g.at[b, hv, c, pl.ds(j * C, C)])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(
        scoped,
        cp.smem((C, K), dt),  # q (later dw)
        cp.smem((C, K), dt),  # k
        cp.smem((K, V), dt),  # h
        cp.smem((K, V), dt),  # dh
        cp.smem((C, V), dt),  # v_new
        cp.smem((C, V), dt),  # do
        cp.smem((C, V), dt),  # dv2 hi
        cp.smem((C, V), dt),  # dv2 lo
        cp.smem((C, C), dt),  # ds
        cp.smem((C,), f32),  # G
        cp.smem((C, K), f32),  # the f32 output staging (first dv2 if K == V)
        cp.smem((2 + K // C, C), f32, swizzled=False),  # vector outputs
        plgpu.Barrier(num_barriers=8 + (2 * (K // C) if dt == jnp.float16 else 0)),
        *([cp.smem((2, K), f32, swizzled=False)] if dt == jnp.float16 else []),  # row scales
        *([] if K == V else [cp.smem((C, V), f32)]),  # dv2 (f32) when K != V
    )


def bwd_dqkw(q, k, h, dh, v_new, do, dv2, g_cum, *, scale: float, dq_dtype=f32):
    """dq, dk (output/state parts), dw and gate-gradient pieces for every chunk.

    Args:
      q, k: [B, T, H, K] io dtype; T % 64 == 0.
      h, dh: [B, T/64, HV, K, V] io dtype, f32 for f16 io (state entering / state gradient
        leaving each chunk).
      v_new, do: [B, T, HV, V] io dtype; dv2: [B, T, HV, V] f32.
      g_cum: [B, HV, T] f32.
      scale: output scale.
      dq_dtype: dtype of dq: f32 or the io dtype (where the caller sums no value heads and runs no
        l2norm backward on it, the cast needs no XLA pass).
    Returns:
      dq [B, T, HV, K] ``dq_dtype``, dk [B, T, HV, K] f32 (per value head; :func:`bwd_wy` adds
      its part), dw [B, T, HV, K] io dtype,
      dg [B, HV, T] f32 (Σ dq⊙q − Σ dk⊙k), rs [B, HV, T] f32 (Σ_k dk_state⊙k),
      hd [B, HV, T/64, K] f32 (diag(h dhᵀ); sum over K = ⟨h, dh⟩).
    """
    B, T, H, K = q.shape
    HV = v_new.shape[2]
    if K % CHUNK or v_new.shape[3] % CHUNK:
        raise NotImplementedError(f"{q.shape=} {v_new.shape=}: K and V must be multiples of 64")
    nt = T // CHUNK
    if jnp.dtype(dq_dtype) not in (jnp.dtype(f32), q.dtype):
        raise ValueError(f"{dq_dtype=} must be float32 or the io dtype {q.dtype}")
    S = jax.ShapeDtypeStruct
    out_type = (
        S((B, T, HV, K), dq_dtype),
        S((B, T, HV, K), f32),
        S((B, T, HV, K), q.dtype),
        S((B, HV, T), f32),
        S((B, HV, T), f32),
        S((B, HV, nt, K), f32),
    )

    def body(*refs):
        _dqkw_body(*refs, scale=scale, group=HV // H)

    fn = per_chunk_kernel(body, out_type, chunks=nt, HV=HV, B=B, name="gdn_bwd_dqkw")
    return fn(q, k, h, dh, v_new, do, dv2, g_cum)
