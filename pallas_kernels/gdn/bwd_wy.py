"""Backward stage: through the WY representation, one CTA per (chunk, value head).

Forward (see :mod:`intra`): ``w = A diag(β e^G) k``, ``u = A diag(β) v``, ``A = (I + L)⁻¹`` with
``L_ij = β_i (k_i·k_j) e^{G_i − G_j}`` for i > j. Given dw (from :mod:`bwd_dqkw`) and du = dv2
(from :mod:`pallas_kernels.recurrence.bwd_dh`, f32, split into two 16-bit terms for the tensor
cores):

    dA     = dw (β e^G k)ᵀ + dv2 (β v)ᵀ
    dkbg   = Aᵀ dw,  dvb = Aᵀ dv2
    dv     = β ⊙ dvb
    dL     = −Aᵀ dA Aᵀ  on the strict lower triangle;  Q = dL ⊙ (k kᵀ) ⊙ e^{G_i − G_j}
    dk     = dk_state + (A diag(β e^G))ᵀ dw + D k + Dᵀ k
             with D = diag(β) Q / (k kᵀ) = dL ⊙ β_i e^{G_i − G_j}
    dβ     = e^G Σ_k dkbg⊙k + Σ_v dvb⊙v + Σ_j Q_ij
    dG     = β e^G Σ_k dkbg⊙k + Σ_j β_i Q_ij − Σ_i β_i Q_ij   (row sums; column sums returned apart)

dk_state, the part of dk from the output and the state (:mod:`bwd_dqkw`, f32), is added before dk is
stored, so dk leaves complete and, where the caller needs no f32 (no GVA sum, no l2norm backward),
in the io dtype: no XLA pass adds the parts or casts them. Non-finite v values are read as 0 (the
forward's kernels read them so), so the backward needs no sanitised copy of v.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import _compat as cp
from pallas_kernels._compat import pl, plgpu
from pallas_kernels._tiles import CHUNK, chunk_coords, finite, load_tiles, per_chunk_kernel

f32 = jnp.float32


def _wy_body(
    k_g, v_g, a_g, g_g, b_g, dw_g, dv2_g, dks_g,  # inputs
    dk_g, dv_g, db_g, dgr_g, dgc_g,  # outputs
    *, group: int,
):  # fmt: skip
    C = CHUNK
    c, hv, b, hk, rows = chunk_coords(group, C)
    K, V = k_g.shape[-1], v_g.shape[-1]
    dt = k_g.dtype
    dk_io = dk_g.dtype != f32

    def scoped(k_s, v_s, a_s, g_s, be_s, dw_s, dvf_s, dvh_s, dvl_s, kbg_s, vb_s, m_s, d_s, as_s,
               vec_s, bar, *dk_tile):  # fmt: skip
        srcs = (
            (k_g.at[b, rows, hk, :], k_s),
            (v_g.at[b, rows, hv, :], v_s),
            (a_g.at[b, rows, hv, :], a_s),
            (g_g.at[b, hv, rows], g_s),
            (b_g.at[b, hv, rows], be_s),
            (dw_g.at[b, rows, hv, :], dw_s),
            (dv2_g.at[b, rows, hv, :], dvf_s),
        )
        load_tiles(srcs, bar)

        def v_f32():  # the op's raw v: non-finite values read as 0
            return finite(cp.load_tile(v_s).astype(f32))

        row = cp.iota((C, C), 0)
        col = cp.iota((C, C), 1)
        strict = row > col
        g_r = cp.row_vec(g_s)
        g_c = cp.col_vec(g_s, C)
        be_r = cp.row_vec(be_s)
        be_c = cp.col_vec(be_s, C)
        eg_r = jnp.exp(g_r)
        sc_r = be_r * eg_r  # β e^G per row

        x = cp.load_tile(dvf_s)
        hi = x.astype(dt)
        dvh_s[...] = hi
        dvl_s[...] = (x - hi.astype(f32)).astype(dt)
        kbg_s[...] = (cp.load_tile(k_s).astype(f32) * cp.bcast_rows(sc_r, (C, K))).astype(dt)
        vb_s[...] = (v_f32() * cp.bcast_rows(be_r, (C, V))).astype(dt)
        a = cp.load_tile(a_s).astype(f32)
        as_s[...] = (a * cp.bcast_cols(be_c * jnp.exp(g_c), (C, C))).astype(dt)
        plgpu.commit_smem()
        # dk_state lands in dk's f32 staging tile (the dv2 tile when K == V, read above)
        out_s = dk_tile[0] if dk_tile else dvf_s
        plgpu.copy_gmem_to_smem(dks_g.at[b, rows, hv, :], out_s, bar.at[len(srcs)])

        dA = cp.matmul_sum(((dw_s, kbg_s.T), (dvh_s, vb_s.T), (dvl_s, vb_s.T)), (C, C))
        m_s[...] = dA.astype(dt)
        plgpu.commit_smem()

        # dβ, dG from the w path: r = Σ_k (Aᵀ dw) ⊙ k
        dkbg = cp.matmul(a_s.T, dw_s, (C, K))
        r = jnp.sum(dkbg * cp.load_tile(k_s).astype(f32), axis=1)
        db = r * eg_r
        dg_row = r * sc_r

        dvb = cp.matmul_sum(((a_s.T, dvh_s), (a_s.T, dvl_s)), (C, V))
        db = db + jnp.sum(dvb * v_f32(), axis=1)
        vb_s[...] = (dvb * cp.bcast_rows(be_r, (C, V))).astype(dt)  # dv, staged in vb_s
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(vb_s, dv_g.at[b, rows, hv, :])

        # dL = −Aᵀ (dA Aᵀ), strict lower
        t1 = cp.matmul(m_s, a_s.T, (C, C))
        m_s[...] = t1.astype(dt)
        plgpu.commit_smem()
        dL = -cp.matmul(a_s.T, m_s, (C, C))
        gd = cp.bcast_rows(g_r, (C, C)) - cp.bcast_cols(g_c, (C, C))
        E = jnp.where(strict, jnp.exp(jnp.where(strict, gd, 0.0)), 0.0)
        dLE = jnp.where(strict, dL, 0.0) * E
        kk = cp.matmul(k_s, k_s.T, (C, C))
        Q = dLE * kk
        db = db + jnp.sum(Q, axis=1)
        dLL = Q * cp.bcast_rows(be_r, (C, C))
        dg_row = dg_row + jnp.sum(dLL, axis=1)
        dg_col = jnp.sum(dLL, axis=0)
        d_s[...] = (dLE * cp.bcast_rows(be_r, (C, C))).astype(dt)
        plgpu.commit_smem()

        dk = cp.matmul_sum(((as_s.T, dw_s), (d_s, k_s), (d_s.T, k_s)), (C, K))
        plgpu.barrier_wait(bar.at[len(srcs)])
        dk = dk + cp.load_tile(out_s)
        if dk_io:  # staged in kbg_s, free since dA
            out_s = kbg_s
        out_s[...] = dk.astype(dk_g.dtype)
        vec_s.at[0][...] = db
        vec_s.at[1][...] = dg_row
        vec_s.at[2][...] = dg_col
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_s, dk_g.at[b, rows, hv, :])
        plgpu.copy_smem_to_gmem(vec_s.at[0], db_g.at[b, hv, rows])
        plgpu.copy_smem_to_gmem(vec_s.at[1], dgr_g.at[b, hv, rows])
        plgpu.copy_smem_to_gmem(vec_s.at[2], dgc_g.at[b, hv, rows])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(
        scoped,
        cp.smem((C, K), dt),  # k
        cp.smem((C, V), dt),  # v
        cp.smem((C, C), dt),  # A
        cp.smem((C,), f32),  # G
        cp.smem((C,), f32),  # β
        cp.smem((C, K), dt),  # dw
        cp.smem((C, V), f32),  # dv2 (f32), later the dk staging tile
        cp.smem((C, V), dt),  # dv2 hi
        cp.smem((C, V), dt),  # dv2 lo
        cp.smem((C, K), dt),  # β e^G k
        cp.smem((C, V), dt),  # β v, later dv
        cp.smem((C, C), dt),  # dA, then dA Aᵀ
        cp.smem((C, C), dt),  # D
        cp.smem((C, C), dt),  # A diag(β e^G)
        cp.smem((3, C), f32, swizzled=False),  # vector outputs
        plgpu.Barrier(num_barriers=8),
        *([] if K == V else [cp.smem((C, K), f32)]),  # dk staging when K != V
    )


def bwd_wy(k, v, A, g_cum, beta, dw, dv2, dk_state, *, dk_dtype=f32):
    """Gradients through w = A(β e^G k), u = A(β v) and A = (I + L)⁻¹ for every chunk.

    Args:
      k: [B, T, H, K]; v: [B, T, HV, V] (non-finite values read as 0); A: [B, T, HV, 64];
        dw: [B, T, HV, K] (io dtype).
      g_cum, beta: [B, HV, T] f32.  dv2: [B, T, HV, V] f32.  K, V multiples of 64.
      dk_state: [B, T, HV, K] f32, dk's output and state part (:func:`bwd_dqkw`'s dk).
      dk_dtype: dtype of dk: f32 or the io dtype.
    Returns:
      dk [B, T, HV, K] ``dk_dtype`` (per value head, dk_state included), dv [B, T, HV, V] io
      dtype, dbeta [B, HV, T] f32, dg_row, dg_col [B, HV, T] f32 (gate gradient = dg_row − dg_col).
    """
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    if K % CHUNK or V % CHUNK:
        raise NotImplementedError(f"{k.shape=} {v.shape=}: K and V must be multiples of 64")
    if jnp.dtype(dk_dtype) not in (jnp.dtype(f32), k.dtype):
        raise ValueError(f"{dk_dtype=} must be float32 or the io dtype {k.dtype}")
    S = jax.ShapeDtypeStruct
    out_type = (
        S((B, T, HV, K), dk_dtype),
        S((B, T, HV, V), k.dtype),
        S((B, HV, T), f32),
        S((B, HV, T), f32),
        S((B, HV, T), f32),
    )

    def body(*refs):
        _wy_body(*refs, group=HV // H)

    fn = per_chunk_kernel(body, out_type, chunks=T // CHUNK, HV=HV, B=B, name="gdn_bwd_wy")
    return fn(k, v, A, g_cum, beta, dw, dv2, dk_state)
