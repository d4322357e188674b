"""Channel-decay backward: dq, dk, dw (WY) and the gate gradient of one chunk, one CTA per
(chunk, value head).

With h = state entering the chunk, dh = gradient of the state at its end (both [K, V]), v_new and
dv2 = dL/dv_new (from :mod:`pallas_kernels.recurrence.bwd_dh`), and D_ij = e^{G_id − G_jd} per
key channel (j ≤ i):

    dP   = scale (do v_newᵀ) ⊙ [j ≤ i]                               [C, C]
    dq   = scale e^{G} ⊙ (do hᵀ) + Σ_j dP_ij (k_j ⊙ D_ij)            (decayed "rows" product)
    dk   = e^{G_last − G} ⊙ (v_new dhᵀ) + Σ_i dP_ij (q_i ⊙ D_ij)     (decayed "cols" product)
    dw   = −dv2 hᵀ
    dG   = dq ⊙ q − dk ⊙ k                                           (per element, [C, K])
    dG_last += Σ_i (e^{G_last − G} ⊙ (v_new dhᵀ) ⊙ k)_i             (added to the last row here)

The remaining last-row term e^{G_last} ⊙ Σ_v h ⊙ dh is added by the caller. The decayed products
factor the decay around one reference row per 16-row block of the contracted index
(:mod:`bwd_decay`): per product, the factored operand is staged once, as a 16-bit hi/lo pair in two
tiles, and each of the four blocks accumulates its 64 × K × 16 wgmmas of both parts in one
accumulator (one exponential and one wait per block), so the two parts together cost two
64 × 64 × K products (f16: three, with dP's lo part). dP and the factored operand live in tiles
with a 32-byte swizzle (:func:`bwd_decay.product_smem`); the operand's lo tile is a view of k's
tile (a :class:`plgpu.RefUnion`: k is read into registers before the first product), so it costs
no shared memory. h and dh share one SMEM tile (dh is loaded once h's products are done) to stay
inside the shared-memory budget at K = V = 128.

K-split form (``k_split=True``, K = 128, V ∈ {64, 128}): every output is separable over the key
dimension
(column block kh of dq, dk, dw, dG reads only q, k, G, the reference rows and G_last in those
columns and the rows kh of h and dh, plus the full-V tiles v_new, do, dv2, so V is never split),
so two CTAs share a (chunk, value head), each computing one 64-column half of K with [64, 64]
register tiles (dP is one cheap wgmma: each CTA forms it again). Halving the tiles removes the
register spills of the [64, 128] form, and the scratch is cut from 221 KiB to 100 KiB per CTA at
V = 128 (two scoped phases share the space, see :func:`_dqkw_ksplit_body`), so two CTAs fit on an
SM (228 KiB) and hide each other's latency.

f16 io (docs/design.md): h and dh arrive in **f32** (the state kernels store them f32 for f16 io;
an f16 h/dh is accepted too) and are staged as f16 with one scale per row of the state
(scaled f16 staging, :func:`pallas_kernels.gdn.fake_quant.f16_stage_scales`); the products with h or
dh (do hᵀ, dv2 hᵀ, v_new dhᵀ) have the state's rows as their columns and are multiplied back by
the scales in f32 (:func:`_unstage`). The decayed products take D = dP and the factored operand
as bf16 hi/lo pairs (bf16 hi/lo staging, :mod:`bwd_decay`): dP's tile and the operand scratch are
bf16 (the operand's lo tile, k's space, too), with one more bf16 tile for dP's lo part. Forms
serving f16:

- K-split (K = 128, V ∈ {64, 128}): h and dh pass through a [64, V] f32 tile in scopes of their
  own, in the space the phases share (dh's staging also emits dw). Mosaic's count: ≈ 111 720 B
  per CTA at V = 128, 95 336 B at V = 64 (bf16, V = 128: 102 488 B), within half an SM.
- K = 64 with ``k_split``: the K-split form's phased body on one CTA per (chunk, value head)
  (all 64 columns): 95 336 B (V = 64) / 111 720 B (V = 128), two CTAs per SM.
- one CTA (K = 64, V ∈ {64, 128}, ``k_split=False``): an [K, V] f32 staging tile, dP lo and a
  bf16 operand (hi) tile on top: 144 472 B (V = 64) / 201 816 B (V = 128), one CTA per SM (bf16:
  110 680 B at V = 64). At K = 128 it would exceed an SM: NotImplementedError (use k_split).

dq (without GVA) and dw still leave in the io dtype (f16), dq (GVA), dk and dG in f32.
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
    operand_dtype,
    product_smem,
)
from pallas_kernels.gdn.fake_quant import f16_stage_scales

f32 = jnp.float32


def _dqkw_body(
    q_g, k_g, g_g, gr_g, gl_g, h_g, dh_g, vn_g, do_g, dvh_g, dvl_g,  # inputs
    dq_g, dk_g, dw_g, dg_g,  # outputs
    *, scale: float, group: int,
):  # fmt: skip
    C = CHUNK
    c, hv, b, hk, rows = chunk_coords(group, C)
    K, V = q_g.shape[-1], vn_g.shape[-1]
    dt = q_g.dtype
    scaled = dt == jnp.float16  # f16 io: see channel_bwd_dqkw

    def scoped(q_s, k_u, g_s, gr_s, gl_s, h_s, vn_s, do_s, dvh_s, dvl_s, dp_s, x_s, out_s, bar,
               *f16):  # fmt: skip
        # f16: dP lo, the bf16 factored-operand scratch (hi), the f32 state staging tile and the
        # row scales of the staged h (row 0) and dh (row 1)
        dpl_s, ys_s, st_s, sc_s = f16 if scaled else (None, x_s, None, None)
        k_s, yl_s = k_u  # k's tile, then the factored operand's lo (k is read into registers)
        srcs = (
            (q_g.at[b, rows, hk, :], q_s),
            (k_g.at[b, rows, hk, :], k_s),
            *decay_copies(g_g, gr_g, gl_g, (g_s, gr_s, gl_s), b=b, hv=hv, c=c, rows=rows),
            *(() if scaled else ((h_g.at[b, c, hv], h_s),)),
            (vn_g.at[b, rows, hv, :], vn_s),
            (do_g.at[b, rows, hv, :], do_s),
            (dvh_g.at[b, rows, hv, :], dvh_s),
            (dvl_g.at[b, rows, hv, :], dvl_s),
        )
        load_tiles(srcs, bar)
        if scaled:  # h (f32) -> f16 h_s; then dh's load into the staging tile overlaps h's use
            plgpu.copy_gmem_to_smem(h_g.at[b, c, hv], st_s, bar.at[len(srcs)])
            _stage_state(st_s, bar.at[len(srcs)], h_s, sc_s.at[0])
            plgpu.copy_gmem_to_smem(dh_g.at[b, c, hv], st_s, bar.at[len(srcs) + 1])

        dec = Decay(g_s, gr_s, gl_s, dt)
        row = cp.iota((C, C), 0)
        col = cp.iota((C, C), 1)

        # dP = scale (do v_newᵀ) ⊙ [j < i]; its diagonal goes to dq and dk in f32
        m = cp.matmul(do_s, vn_s.T, (C, C))
        Decay.stage_pair(dp_s, dpl_s, jnp.where(row > col, m, 0.0) * scale)
        plgpu.commit_smem()
        diag = jnp.sum(jnp.where(row == col, m, 0.0), axis=1) * scale

        # the h products: output part of dq, and dw = −dv2 hᵀ (dv2 = hi + lo)
        dq = _unstage(cp.matmul(do_s, h_s.T, (C, K)), sc_s, 0) * (jnp.exp(dec.G()) * scale)

        dw = -_unstage(cp.matmul_sum(((dvh_s, h_s.T), (dvl_s, h_s.T)), (C, K)), sc_s, 0)
        x_s[...] = dw.astype(dt)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(x_s, dw_g.at[b, rows, hv, :])
        if not scaled:  # h is done: bring dh into the same tile
            plgpu.copy_gmem_to_smem(dh_g.at[b, c, hv], h_s, bar.at[len(srcs)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # x_s is reused below

        q = cp.load_tile(q_s).astype(f32)
        k = cp.load_tile(k_s).astype(f32)
        plgpu.commit_smem()  # also a warpgroup barrier: every thread has read k_s (yl_s's space)
        dq = dq + dec.rows(dp_s, k, (ys_s, yl_s), lo_s=dpl_s)
        r1 = dq * q  # without the diagonal (see channel_bwd_dqkw)
        dq = dq + cp.bcast_rows(diag, (C, K)) * k
        if group == 1:  # no value heads to sum: dq leaves in the io dtype (via the free x_s)
            x_s[...] = dq.astype(dt)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(x_s, dq_g.at[b, rows, hv, :])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        else:
            emit_tile(dq, out_s, dq_g.at[b, rows, hv, :])
        dk = dec.cols(dp_s, q, (ys_s, yl_s), lo_s=dpl_s)
        if scaled:  # h's products are done (wgmma waited): dh takes its tile
            _stage_state(st_s, bar.at[len(srcs) + 1], h_s, sc_s.at[1])
        else:
            plgpu.barrier_wait(bar.at[len(srcs)])
        dks = _unstage(cp.matmul(vn_s, h_s.T, (C, K)), sc_s, 1) * dec.e_last()  # state part of dk
        last = jnp.sum(dks * k, axis=0)
        dk = dk + dks
        dG = r1 - dk * k
        dG = dG + jnp.where(dec.row == C - 1, cp.bcast_cols(last, (C, K)), 0.0)
        emit_tile(dk + cp.bcast_rows(diag, (C, K)) * q, out_s, dk_g.at[b, rows, hv, :])
        emit_tile(dG, out_s, dg_g.at[b, rows, hv, :])
        plgpu.wait_smem_to_gmem(0)

    odt = operand_dtype(dt)  # bf16 (hi/lo pairs) for f16 io
    f16 = ()
    if scaled:
        f16 = (
            product_smem((C, C), odt),  # dP lo
            product_smem((C, K), odt),  # factored operand (hi)
            cp.smem((K, V), h_g.dtype),  # h, then dh, as stored (f32)
            cp.smem((2, K), f32, swizzled=False),  # row scales of the staged h, dh
        )
    pl.run_scoped(
        scoped,
        cp.smem((C, K), dt),  # q
        plgpu.RefUnion(cp.smem((C, K), dt), product_smem((C, K), odt)),  # k, then operand lo
        *decay_smem(C, K),  # G, reference rows, G_last
        cp.smem((K, V), dt),  # h, then dh
        cp.smem((C, V), dt),  # v_new
        cp.smem((C, V), dt),  # do
        cp.smem((C, V), dt),  # dv2 hi
        cp.smem((C, V), dt),  # dv2 lo
        product_smem((C, C), odt),  # dP (hi)
        product_smem((C, K), dt),  # bf16: factored operand (hi); dw, dq staging
        cp.smem((C, K), f32),  # f32 output staging
        plgpu.Barrier(num_barriers=11),
        *f16,
    )


def _stage_state(st_s, bar, h_s, sc_s) -> None:
    """f16 io: waits for the state tile ``st_s`` ([R, V], f32 as stored) on ``bar`` and stages
    it into the f16 tile ``h_s`` with one scale per row (docs/design.md: a state is never cast to
    f16 unscaled); the scales go to the f32 SMEM vector ``sc_s`` [R]. Ends with a commit, so every
    thread has read ``st_s`` (it may take the next load) and ``h_s`` is visible to wgmma."""
    plgpu.barrier_wait(bar)
    x = cp.load_tile(st_s).astype(f32)
    inv, sc = f16_stage_scales(x, axis=1)
    h_s[...] = (x * cp.bcast_rows(inv, x.shape)).astype(h_s.dtype)
    sc_s[...] = sc
    plgpu.commit_smem()


def _unstage(x, sc_s, t: int):
    """A product whose columns are rows of a staged state (h: t = 0, dh: t = 1) multiplied back
    by their scales; the identity without scales (bf16 io)."""
    if sc_s is None:
        return x
    n = x.shape[1]
    return x * cp.bcast_cols(cp.col_vec(sc_s.at[t, pl.ds(0, n)], n), x.shape)


def _dqkw_ksplit_body(
    q_g, k_g, g_g, gr_g, gl_g, h_g, dh_g, vn_g, do_g, dvh_g, dvl_g,  # inputs
    dq_g, dk_g, dw_g, dg_g,  # outputs
    *, scale: float, group: int, pair: bool = True,
):  # fmt: skip
    """One 64-column half kh of K for one (chunk, value head): grid ("c", "h", "b") with
    h = 2 hv + kh (the two halves of a head are neighbouring CTAs: they share v_new/do/dv2 in L2).

    Same maths as :func:`_dqkw_body` on [C, 64] tiles. The scratch lives in three scopes so that
    the dv2/do tiles (needed only for dP and the h products) and the q/k/G/output tiles (needed
    only afterwards) take turns in the same space. Bytes at K = V = 128, bf16 io (KiB = 1024 B):

        always:  h then dh [64, V] 16 KiB, v_new [C, V] 16 KiB, dP 8 KiB,
                 operand hi / dw scratch [C, 64] 8 KiB, 11 barriers 88 B
                                                          = 48 KiB + 88 B
        phase 1: do, dv2 hi, dv2 lo [C, V] 16 KiB each    = 48 KiB
        phase 2: q, k (then the operand's lo) [C, 64] 8 KiB each, G [C, 64] f32 16 KiB,
                 reference rows [4, 64] f32 1 KiB, G_last 256 B, f32 output staging [C, 64] 16 KiB
                                                          = 49.25 KiB
        peak:    always + phase 2 = 97.25 KiB + alignment padding

    Mosaic's count when lowering (bf16, with its alignment): 102488 B, against
    226392 B for :func:`_dqkw_body`; tests/pallas/test_channel_pallas.py::test_lowers_for_cuda
    checks that it stays within half an SM.

    f16 io: the operand tiles and dP are bf16, plus dP lo 8 KiB and the state row scales
    [2, 64] f32 (always: 56.5 KiB); h is staged before phase 1 and dh between phases 1 and 2,
    each through a [64, V] f32 tile (32 KiB, + dw's 8 KiB f16 staging for dh) in its own scope;
    dq (no GVA) leaves through the free q tile. Peak: always + phase 2 = 105.75 KiB; Mosaic's
    count ≈ 111 720 B.
    """
    C, KH = CHUNK, HALF
    if pair:
        c, hv, kh, b, hk, rows = pair_chunk_coords(group, C)
    else:  # f16 at K = 64: one CTA per (chunk, value head) runs the phases on all of K
        (c, hv, b, hk, rows), kh = chunk_coords(group, C), 0
    kc = pl.ds(kh * KH, KH)
    V = vn_g.shape[-1]
    dt = q_g.dtype
    scaled = dt == jnp.float16  # f16 io: see channel_bwd_dqkw
    odt = operand_dtype(dt)  # bf16 (hi/lo pairs) for f16 io
    row = cp.iota((C, C), 0)
    col = cp.iota((C, C), 1)

    def scoped(h_s, vn_s, dp_s, x_s, bar1, bar2, *f16):
        # f16: x_s is the bf16 factored-operand scratch; dP lo, the row scales of the staged h
        # (row 0) and dh (row 1), the state loads' barriers
        dpl_s, sc_s, bar0 = f16 if scaled else (None, None, None)

        def stage_state(src_g, t, dw=None):
            """f16: rows kc of the f32 state ``src_g`` -> h_s (f16, per-row scales in sc_s[t]),
            through a [64, V] f32 tile in its own scope (in the space phases 1 and 2 use); with
            ``dw`` it also emits dw, through an f16 tile of the same scope."""

            def body(st_s, dw_s):
                plgpu.copy_gmem_to_smem(src_g.at[b, c, hv, kc, :], st_s, bar0.at[t])
                if dw is not None:
                    emit_tile(dw.astype(dt), dw_s, dw_g.at[b, rows, hv, kc])
                _stage_state(st_s, bar0.at[t], h_s, sc_s.at[t])

            pl.run_scoped(
                body,
                cp.smem((KH, V), h_g.dtype),  # the state rows, as stored (f32)
                cp.smem((C, KH) if dw is not None else (8,), dt),  # dw staging
            )

        if scaled:
            with jax.named_scope("stage h"):
                stage_state(h_g, 0)

        def phase1(do_s, dvh_s, dvl_s):
            """dP to SMEM, dw out; returns the h part of dq without its e^{G} (f16:
            and dw, emitted with dh's staging)."""
            srcs = [(do_g.at[b, rows, hv, :], do_s), (vn_g.at[b, rows, hv, :], vn_s)]
            if not scaled:  # f16: already staged
                srcs.append((h_g.at[b, c, hv, kc, :], h_s))
            srcs += [(dvh_g.at[b, rows, hv, :], dvh_s), (dvl_g.at[b, rows, hv, :], dvl_s)]
            late = (len(srcs) - 2, len(srcs) - 1)
            load_tiles(srcs, bar1, late=late)  # dv2 lands while dP and do hᵀ run
            # dP = scale (do v_newᵀ) ⊙ [j ≤ i] (f16: as bf16 hi + lo). The tile holds only
            # j < i: the diagonal goes to dq and dk in f32 (see channel_bwd_dqkw).
            m = cp.matmul(do_s, vn_s.T, (C, C))
            diag = jnp.sum(jnp.where(row == col, m, 0.0), axis=1) * scale
            Decay.stage_pair(dp_s, dpl_s, jnp.where(row > col, m, 0.0) * scale)
            plgpu.commit_smem()
            dqh = _unstage(cp.matmul(do_s, h_s.T, (C, KH)), sc_s, 0) * scale
            plgpu.barrier_wait(bar1.at[late[0]])
            plgpu.barrier_wait(bar1.at[late[1]])

            dw = -_unstage(cp.matmul_sum(((dvh_s, h_s.T), (dvl_s, h_s.T)), (C, KH)), sc_s, 0)
            if scaled:  # the barrier lets dh's load overwrite the phase's tiles (see below)
                plgpu.commit_smem()
                return dqh, diag, dw
            # commit_smem is also a warpgroup barrier: past it no warp still reads h_s or the
            # phase's tiles, so dh and phase 2's loads may overwrite them
            x_s[...] = dw.astype(dt)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(x_s, dw_g.at[b, rows, hv, kc])
            return dqh, diag

        with jax.named_scope("phase 1"):
            dqh = pl.run_scoped(
                phase1,
                cp.smem((C, V), dt),  # do
                cp.smem((C, V), dt),  # dv2 hi
                cp.smem((C, V), dt),  # dv2 lo
            )
        if scaled:  # h's products are done (wgmma waited): dh takes h's tile
            dqh, diag, dw = dqh
            with jax.named_scope("stage dh"):
                stage_state(dh_g, 1, dw)
        else:
            dqh, diag = dqh

        def phase2(q_s, k_u, g_s, gr_s, gl_s, out_s):
            k_s, xl_s = k_u  # k's tile, then the factored operand's lo (k is read into registers)
            srcs = (
                *decay_copies(
                    g_g, gr_g, gl_g, (g_s, gr_s, gl_s), b=b, hv=hv, c=c, rows=rows, cols=kc
                ),
                (k_g.at[b, rows, hk, kc], k_s),
                (q_g.at[b, rows, hk, kc], q_s),
                # h is done: dh takes its tile (f16: staged already)
                *(() if scaled else ((dh_g.at[b, c, hv, kc, :], h_s),)),
            )
            load_tiles(srcs, bar2, late=() if scaled else (5,))
            dec = Decay(g_s, gr_s, gl_s, dt)
            dq = dqh * jnp.exp(dec.G())
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # x_s (dw) is reused below
            q = cp.load_tile(q_s).astype(f32)
            k = cp.load_tile(k_s).astype(f32)
            plgpu.commit_smem()  # also a warpgroup barrier: every thread has read k_s (xl_s)
            with jax.named_scope("dq intra"):
                dq = dq + dec.rows(dp_s, k, (x_s, xl_s), lo_s=dpl_s)
            r1 = dq * q  # without the diagonal
            dq = dq + cp.bcast_rows(diag, (C, KH)) * k
            if group == 1:  # no value heads to sum: dq leaves in the io dtype (via the free x_s;
                # f16: x_s is bf16, q_s is free: q is in registers and the rows product's commits
                # passed every thread's load)
                emit_tile(dq.astype(dt), q_s if scaled else x_s, dq_g.at[b, rows, hv, kc])
            else:
                emit_tile(dq, out_s, dq_g.at[b, rows, hv, kc])
            with jax.named_scope("dk intra"):
                dk = dec.cols(dp_s, q, (x_s, xl_s), lo_s=dpl_s)
            if not scaled:
                plgpu.barrier_wait(bar2.at[5])
            with jax.named_scope("dk state"):
                dks = _unstage(cp.matmul(vn_s, h_s.T, (C, KH)), sc_s, 1) * dec.e_last()
            last = jnp.sum(dks * k, axis=0)
            dk = dk + dks
            dG = r1 - dk * k
            dG = dG + jnp.where(dec.row == C - 1, cp.bcast_cols(last, (C, KH)), 0.0)
            emit_tile(dk + cp.bcast_rows(diag, (C, KH)) * q, out_s, dk_g.at[b, rows, hv, kc])
            emit_tile(dG, out_s, dg_g.at[b, rows, hv, kc])
            plgpu.wait_smem_to_gmem(0)

        with jax.named_scope("phase 2"):
            pl.run_scoped(
                phase2,
                cp.smem((C, KH), dt),  # q
                # k, then the factored operand's lo
                plgpu.RefUnion(cp.smem((C, KH), dt), product_smem((C, KH), odt)),
                *decay_smem(C, KH),  # G, reference rows, G_last
                cp.smem((C, KH), f32),  # f32 output staging
            )

    f16 = ()
    if scaled:
        f16 = (
            product_smem((C, C), odt),  # dP lo
            cp.smem((2, KH), f32, swizzled=False),  # row scales of the staged h, dh
            plgpu.Barrier(num_barriers=2),  # h, dh loads
        )
    pl.run_scoped(
        scoped,
        cp.smem((KH, V), dt),  # h, then dh (rows kh of the state)
        cp.smem((C, V), dt),  # v_new
        product_smem((C, C), odt),  # dP (hi)
        product_smem((C, KH), odt),  # factored operand hi (and the dw / bf16 dq staging)
        plgpu.Barrier(num_barriers=5),  # phase 1 loads
        plgpu.Barrier(num_barriers=6),  # phase 2 loads
        *f16,
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
    k_split: bool = False,
):
    """dq, dk (output/state parts), dw and the gate gradient pieces for every chunk.

    Args:
      q, k: [B, T, H, K] io dtype; T % 64 == 0.
      g_cum: [B, T, HV, K] f32 chunk-local cumulative log-decay.
      gr, gl: [B, HV, T/16, K], [B, HV, T/64, K] f32 reference rows and G_last
        (:func:`pallas_kernels.channel.intra.reference_rows`).
      h, dh: [B, T/64, HV, K, V] io dtype, f32 for f16 io (state entering / state gradient
        leaving each chunk).
      v_new, do, dv2_hi, dv2_lo: [B, T, HV, V] io dtype.
      scale: output scale.
      k_split: two CTAs per (chunk, value head), each computing one 64-column half of K
        (K = 128; same outputs, half the registers and SMEM per CTA). At K = 64 it is ignored
        for bf16 (the one-CTA form already works on [64, 64] tiles); for f16 it selects the
        phased body of the split form on one CTA (all 64 columns), whose scopes fit two CTAs
        per SM where the one-CTA form's f16 tiles do not. Other K raise NotImplementedError.
        Any V ∈ {64, 128} (every CTA holds all of V). f16 at K = 128 needs it
        (NotImplementedError otherwise).
    Returns:
      dq [B, T, HV, K] (per value head; io dtype without GVA, else f32 to be summed),
      dk [B, T, HV, K] f32 (per value head), dw [B, T, HV, K] io dtype,
      dG [B, T, HV, K] f32 (gradient w.r.t. G of the output/state parts, without the last-row
      term e^{G_last} Σ_v h ⊙ dh).
    """
    B, T, H, K = q.shape
    HV = v_new.shape[2]
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
    if q.dtype == jnp.float16 and not k_split and K != HALF:
        # the one-CTA form holds [K, V] h/dh, their f32 staging tile and the bf16 hi/lo operand
        # tiles: over an SM's shared memory at K = 128 (bf16 already needs 221 KiB there)
        raise NotImplementedError(
            f"{q.shape=}: f16 channel_bwd_dqkw at K = {K} needs k_split=True (the one-CTA form "
            "exceeds the shared memory with the f16 staging tiles)"
        )
    # f16 at K = 64 with k_split: the phased body on one CTA (its scopes fit two CTAs per SM,
    # the one-CTA body's f16 tiles do not)
    phased = pair or (k_split and q.dtype == jnp.float16)
    if phased:

        def body(*refs):
            _dqkw_ksplit_body(*refs, scale=scale, group=HV // H, pair=pair)

    else:

        def body(*refs):
            _dqkw_body(*refs, scale=scale, group=HV // H)

    fn = per_chunk_kernel(body, out_type, chunks=nt, HV=HV, B=B, name="chan_bwd_dqkw", pair=pair)
    return fn(q, k, g_cum, gr, gl, h, dh, v_new, do, dv2_hi, dv2_lo)
