"""Channel-decay backward: dq, dk, dw (WY) and the gate gradient of one chunk, one CTA per
(chunk, value head).

With h = state entering the chunk, dh = gradient of the state at its end (both [K, V]), v_new and
dv2 = dL/dv_new (from :mod:`bwd_dh`), and D_ij = e^{G_id − G_jd} per key channel (j ≤ i):

    dP   = scale (do v_newᵀ) ⊙ [j ≤ i]                               [C, C]
    dq   = scale e^{G} ⊙ (do hᵀ) + Σ_j dP_ij (k_j ⊙ D_ij)            (decayed "rows" product)
    dk   = e^{G_last − G} ⊙ (v_new dhᵀ) + Σ_i dP_ij (q_i ⊙ D_ij)     (decayed "cols" product)
    dw   = −dv2 hᵀ
    dG   = dq ⊙ q − dk ⊙ k                                           (per element, [C, K])
    dG_last += Σ_i (e^{G_last − G} ⊙ (v_new dhᵀ) ⊙ k)_i             (added to the last row here)

The remaining last-row term e^{G_last} ⊙ Σ_v h ⊙ dh is added by the caller. The decayed products
use the sub-chunk reference rows of :mod:`bwd_decay`. h and dh share one SMEM tile (dh is loaded
once h's products are done) to stay inside the shared-memory budget at K = V = 128.

K-split form (``k_split=True``, K = V = 128): every output is separable over the key dimension
(column block kh of dq, dk, dw, dG reads only q, k, G, the reference rows and G_last in those
columns and the rows kh of h and dh, plus the full-V tiles v_new, do, dv2), so two CTAs share a
(chunk, value head), each computing one 64-column half of K with [64, 64] register tiles (dP is
one cheap wgmma: each CTA forms it again). Halving the tiles removes the register spills of the
[64, 128] form, and the scratch is cut from 221 KiB to 100 KiB per CTA (108 KiB sliced; two
scoped phases share the space, see :func:`_dqkw_ksplit_body`), so two CTAs fit on an SM (228 KiB)
and hide each other's latency.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import _compat as cp
from pallas_kernels._compat import pl, plgpu
from pallas_kernels._tiles import (
    chunk_coords,
    emit_tile,
    load_tiles,
    pair_chunk_coords,
    per_chunk_kernel,
)
from pallas_kernels.channel.bwd_decay import (
    CHUNK,
    HALF,
    Decay,
    decay_copies,
    decay_smem,
    slice_smem,
)

f32 = jnp.float32


def _dqkw_body(
    q_g, k_g, g_g, gr_g, gl_g, h_g, dh_g, vn_g, do_g, dvh_g, dvl_g,  # inputs
    dq_g, dk_g, dw_g, dg_g,  # outputs
    *, scale: float, group: int, sliced: bool,
):  # fmt: skip
    C = CHUNK
    c, hv, b, hk, rows = chunk_coords(group, C)
    K, V = q_g.shape[-1], vn_g.shape[-1]
    dt = q_g.dtype

    def scoped(q_s, k_s, g_s, gr_s, gl_s, h_s, vn_s, do_s, dvh_s, dvl_s, dp_s, x_s, out_s, bar):
        srcs = (
            (q_g.at[b, rows, hk, :], q_s),
            (k_g.at[b, rows, hk, :], k_s),
            *decay_copies(g_g, gr_g, gl_g, (g_s, gr_s, gl_s), b=b, hv=hv, c=c, rows=rows),
            (h_g.at[b, c, hv], h_s),
            (vn_g.at[b, rows, hv, :], vn_s),
            (do_g.at[b, rows, hv, :], do_s),
            (dvh_g.at[b, rows, hv, :], dvh_s),
            (dvl_g.at[b, rows, hv, :], dvl_s),
        )
        load_tiles(srcs, bar)

        dec = Decay(g_s, gr_s, gl_s, dt)
        row = cp.iota((C, C), 0)
        col = cp.iota((C, C), 1)

        def put_dp(transposed: bool):  # dP (or dPᵀ) = scale (do v_newᵀ) ⊙ [j ≤ i]
            if transposed:
                m = jnp.where(row <= col, cp.matmul(vn_s, do_s.T, (C, C)), 0.0)
            else:
                m = jnp.where(row >= col, cp.matmul(do_s, vn_s.T, (C, C)), 0.0)
            dp_s[...] = (m * scale).astype(dt)
            plgpu.commit_smem()

        put_dp(sliced)  # the sliced "rows" product reads dPᵀ

        # the h products: output part of dq, and dw = −dv2 hᵀ (dv2 = hi + lo)
        dq = cp.matmul(do_s, h_s.T, (C, K)) * (jnp.exp(dec.G()) * scale)

        dw = -cp.matmul_sum(((dvh_s, h_s.T), (dvl_s, h_s.T)), (C, K))
        x_s[...] = dw.astype(dt)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(x_s, dw_g.at[b, rows, hv, :])
        # h is done: bring dh into the same tile
        plgpu.copy_gmem_to_smem(dh_g.at[b, c, hv], h_s, bar.at[len(srcs)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # x_s is reused below

        q = cp.load_tile(q_s).astype(f32)
        k = cp.load_tile(k_s).astype(f32)
        if sliced:
            dq = dq + dec.rows(None, k, x_s, dt_s=dp_s)
            put_dp(False)
        else:
            dq = dq + dec.rows(dp_s, k, x_s)
        r1 = dq * q
        if group == 1:  # no value heads to sum: dq leaves in the io dtype (via the free x_s)
            x_s[...] = dq.astype(dt)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(x_s, dq_g.at[b, rows, hv, :])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        else:
            emit_tile(dq, out_s, dq_g.at[b, rows, hv, :])
        dk = dec.cols(dp_s, q, x_s, sliced=sliced)
        plgpu.barrier_wait(bar.at[len(srcs)])
        dks = cp.matmul(vn_s, h_s.T, (C, K)) * dec.e_last()  # the state part of dk
        last = jnp.sum(dks * k, axis=0)
        dk = dk + dks
        emit_tile(dk, out_s, dk_g.at[b, rows, hv, :])
        dG = r1 - dk * k
        dG = dG + jnp.where(dec.row == C - 1, cp.bcast_cols(last, (C, K)), 0.0)
        emit_tile(dG, out_s, dg_g.at[b, rows, hv, :])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(
        scoped,
        cp.smem((C, K), dt),  # q
        cp.smem((C, K), dt),  # k
        *decay_smem(C, K),  # G, reference rows, G_last
        cp.smem((K, V), dt),  # h, then dh
        cp.smem((C, V), dt),  # v_new
        cp.smem((C, V), dt),  # do
        cp.smem((C, V), dt),  # dv2 hi
        cp.smem((C, V), dt),  # dv2 lo
        slice_smem((C, C), dt, sliced),  # dP
        slice_smem((C, K), dt, sliced),  # operand scratch (and the dw staging)
        cp.smem((C, K), f32),  # f32 output staging
        plgpu.Barrier(num_barriers=11),
    )


def _dqkw_ksplit_body(
    q_g, k_g, g_g, gr_g, gl_g, h_g, dh_g, vn_g, do_g, dvh_g, dvl_g,  # inputs
    dq_g, dk_g, dw_g, dg_g,  # outputs
    *, scale: float, group: int, sliced: bool,
):  # fmt: skip
    """One 64-column half kh of K for one (chunk, value head): grid ("c", "h", "b") with
    h = 2 hv + kh (the two halves of a head are neighbouring CTAs: they share v_new/do/dv2 in L2).

    Same maths as :func:`_dqkw_body` on [C, 64] tiles. The scratch lives in three scopes so that
    the dv2/do tiles (needed only for dP and the h products) and the q/k/G/output tiles (needed
    only afterwards) take turns in the same space. Bytes at K = V = 128, bf16 io (KiB = 1024 B):

        always:  h then dh [64, V] 16 KiB, v_new [C, V] 16 KiB, dP 8 KiB (+ dPᵀ 8 KiB if
                 sliced), operand/dw scratch [C, 64] 8 KiB, 11 barriers 88 B
                                                          = 48 KiB + 88 B (56 KiB + 88 B sliced)
        phase 1: do, dv2 hi, dv2 lo [C, V] 16 KiB each    = 48 KiB
        phase 2: q, k [C, 64] 8 KiB each, G [C, 64] f32 16 KiB, reference rows [4, 64] f32 1 KiB,
                 G_last 256 B, f32 output staging [C, 64] 16 KiB
                                                          = 49.25 KiB
        peak:    always + phase 2 = 97.25 KiB (105.25 KiB sliced) + alignment padding

    Mosaic's count when lowering (bf16, with its alignment): 102488 B (110680 B sliced), against
    226392 B for :func:`_dqkw_body`; tests/pallas/test_channel_ksplit_dqkw.py checks that it stays
    within half an SM.
    """
    C, KH = CHUNK, HALF
    c, hv, kh, b, hk, rows = pair_chunk_coords(group, C)
    kc = pl.ds(kh * KH, KH)
    V = vn_g.shape[-1]
    dt = q_g.dtype
    row = cp.iota((C, C), 0)
    col = cp.iota((C, C), 1)

    def scoped(h_s, vn_s, dp_s, dpt_s, x_s, bar1, bar2):
        def phase1(do_s, dvh_s, dvl_s):
            """dP (and dPᵀ) to SMEM, dw out; returns the h part of dq without its e^{G}."""
            srcs = (
                (do_g.at[b, rows, hv, :], do_s),
                (vn_g.at[b, rows, hv, :], vn_s),
                (h_g.at[b, c, hv, kc, :], h_s),
                (dvh_g.at[b, rows, hv, :], dvh_s),
                (dvl_g.at[b, rows, hv, :], dvl_s),
            )
            load_tiles(srcs, bar1, late=(3, 4))  # dv2 lands while dP and do hᵀ run
            # dP = scale (do v_newᵀ) ⊙ [j ≤ i]. do is gone after this phase, so the sliced form
            # (rows read dPᵀ, cols dP) forms both now instead of rewriting one tile later.
            m = jnp.where(row >= col, cp.matmul(do_s, vn_s.T, (C, C)), 0.0)
            dp_s[...] = (m * scale).astype(dt)
            if sliced:
                m = jnp.where(row <= col, cp.matmul(vn_s, do_s.T, (C, C)), 0.0)
                dpt_s[...] = (m * scale).astype(dt)
            plgpu.commit_smem()
            dqh = cp.matmul(do_s, h_s.T, (C, KH)) * scale
            plgpu.barrier_wait(bar1.at[3])
            plgpu.barrier_wait(bar1.at[4])

            dw = -cp.matmul_sum(((dvh_s, h_s.T), (dvl_s, h_s.T)), (C, KH))  # dv2 = hi + lo
            # commit_smem is also a warpgroup barrier: past it no warp still reads h_s or the
            # phase's tiles, so dh and phase 2's loads may overwrite them
            x_s[...] = dw.astype(dt)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(x_s, dw_g.at[b, rows, hv, kc])
            return dqh

        dqh = pl.run_scoped(
            phase1,
            cp.smem((C, V), dt),  # do
            cp.smem((C, V), dt),  # dv2 hi
            cp.smem((C, V), dt),  # dv2 lo
        )

        def phase2(q_s, k_s, g_s, gr_s, gl_s, out_s):
            srcs = (
                *decay_copies(
                    g_g, gr_g, gl_g, (g_s, gr_s, gl_s), b=b, hv=hv, c=c, rows=rows, cols=kc
                ),
                (k_g.at[b, rows, hk, kc], k_s),
                (q_g.at[b, rows, hk, kc], q_s),
                (dh_g.at[b, c, hv, kc, :], h_s),  # h is done: dh takes its tile
            )
            load_tiles(srcs, bar2, late=(5,))
            dec = Decay(g_s, gr_s, gl_s, dt)
            dq = dqh * jnp.exp(dec.G())
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # x_s (dw) is reused below
            q = cp.load_tile(q_s).astype(f32)
            k = cp.load_tile(k_s).astype(f32)
            if sliced:
                dq = dq + dec.rows(None, k, x_s, dt_s=dpt_s)
            else:
                dq = dq + dec.rows(dp_s, k, x_s)
            r1 = dq * q
            if group == 1:  # no value heads to sum: dq leaves in the io dtype (via the free x_s)
                emit_tile(dq.astype(dt), x_s, dq_g.at[b, rows, hv, kc])
            else:
                emit_tile(dq, out_s, dq_g.at[b, rows, hv, kc])
            dk = dec.cols(dp_s, q, x_s, sliced=sliced)
            plgpu.barrier_wait(bar2.at[5])
            dks = cp.matmul(vn_s, h_s.T, (C, KH)) * dec.e_last()  # the state part of dk
            last = jnp.sum(dks * k, axis=0)
            dk = dk + dks
            emit_tile(dk, out_s, dk_g.at[b, rows, hv, kc])
            dG = r1 - dk * k
            dG = dG + jnp.where(dec.row == C - 1, cp.bcast_cols(last, (C, KH)), 0.0)
            emit_tile(dG, out_s, dg_g.at[b, rows, hv, kc])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(
            phase2,
            cp.smem((C, KH), dt),  # q
            cp.smem((C, KH), dt),  # k
            *decay_smem(C, KH),  # G, reference rows, G_last
            cp.smem((C, KH), f32),  # f32 output staging
        )

    pl.run_scoped(
        scoped,
        cp.smem((KH, V), dt),  # h, then dh (rows kh of the state)
        cp.smem((C, V), dt),  # v_new
        slice_smem((C, C), dt, sliced),  # dP
        slice_smem((C, C), dt, sliced) if sliced else None,  # dPᵀ (sliced rows product)
        slice_smem((C, KH), dt, sliced),  # operand scratch (and the dw / bf16 dq staging)
        plgpu.Barrier(num_barriers=5),  # phase 1 loads
        plgpu.Barrier(num_barriers=6),  # phase 2 loads
    )


def channel_bwd_dqkw(
    q,
    k,
    g_cum,
    gr,
    gl,
    h,
    dh,
    v_new,
    do,
    dv2_hi,
    dv2_lo,
    *,
    scale: float,
    sliced: bool = False,
    k_split: bool = False,
):
    """dq, dk (output/state parts), dw and the gate gradient pieces for every chunk.

    Args:
      q, k: [B, T, H, K] io dtype; T % 64 == 0.
      g_cum: [B, T, HV, K] f32 chunk-local cumulative log-decay.
      gr, gl: [B, HV, T/16, K], [B, HV, T/64, K] f32 reference rows and G_last
        (:func:`pallas_kernels.channel.intra.reference_rows`).
      h, dh: [B, T/64, HV, K, V] io dtype (state entering / state gradient leaving each chunk).
      v_new, do, dv2_hi, dv2_lo: [B, T, HV, V] io dtype.
      scale: output scale.
      sliced: form the decayed products with 16-deep contractions over sub-chunk slices.
      k_split: two CTAs per (chunk, value head), each computing one 64-column half of K
        (K = 128; same outputs, half the registers and SMEM per CTA). At K = 64 it is ignored:
        the one-CTA form already works on [64, 64] tiles. Other K raise NotImplementedError.
    Returns:
      dq [B, T, HV, K] (per value head; io dtype without GVA, else f32 to be summed),
      dk [B, T, HV, K] f32 (per value head), dw [B, T, HV, K] io dtype,
      dG [B, T, HV, K] f32 (gradient w.r.t. G of the output/state parts, without the last-row
      term e^{G_last} Σ_v h ⊙ dh).
    """
    B, T, H, K = q.shape
    HV, V = v_new.shape[2], v_new.shape[3]
    if T % CHUNK:
        raise ValueError(f"{q.shape=}: T must be a multiple of {CHUNK}")
    nt = T // CHUNK
    S = jax.ShapeDtypeStruct
    out_type = (
        S((B, T, HV, K), q.dtype if HV == H else f32),
        S((B, T, HV, K), f32),
        S((B, T, HV, K), q.dtype),
        S((B, T, HV, K), f32),
    )

    if k_split and K not in (HALF, 2 * HALF):
        raise NotImplementedError(f"{q.shape=}: channel_bwd_dqkw(k_split=True) needs K = 64 or 128")
    pair = k_split and K == 2 * HALF
    if pair and V != K:
        raise NotImplementedError(
            f"{q.shape=} {v_new.shape=}: channel_bwd_dqkw(k_split=True) needs K == V at K = 128"
        )
    if pair:

        def body(*refs):
            _dqkw_ksplit_body(*refs, scale=scale, group=HV // H, sliced=sliced)

    else:

        def body(*refs):
            _dqkw_body(*refs, scale=scale, group=HV // H, sliced=sliced)

    fn = per_chunk_kernel(body, out_type, chunks=nt, HV=HV, B=B, name="chan_bwd_dqkw", pair=pair)
    return fn(q, k, g_cum, gr, gl, h, dh, v_new, do, dv2_hi, dv2_lo)
