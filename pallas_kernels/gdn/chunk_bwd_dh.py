"""Backward stage: the reverse state-gradient recurrence, fused with the local dv.

One CTA (one warpgroup) per (batch row, value head, 64-wide V block) runs over the chunks in
reverse. dH [K, BV] (the gradient of the state at the end of the current chunk) stays in f32
registers as the ``emit_pipeline`` carry, initialised with the final-state cotangent:

    dh[c]  = dH                                                   (written, io dtype)
    dv2    = (k dH) ⊙ e^{G_last − G} + scale (k qᵀ ⊙ e^{G_j − G_i} ⊙ [j ≥ i]) do    (= dL/dv_new)
    dH     ← e^{G_last} dH + (scale q ⊙ e^{G})ᵀ do − wᵀ dv2

Both products of the dH update accumulate into one wgmma accumulator: the scale is folded into
the q operand and the sign into the stored −dv2 operand.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _compat as cp
from pallas_kernels._compat import pl, plgpu
from pallas_kernels._tiles import (
    CHUNK,
    META_COLS,
    LoopConfig,
    check_meta,
    chunk_offset,
    load_state_row,
    per_v_block_kernel,
    segment_coords,
    store_f32_tile,
    store_initial_cotangent,
    v_block_coords,
)
from pallas_kernels.gdn.fake_quant import stage_columns

f32 = jnp.float32


def _dh_body(*refs, cfg, group: int, nt: int, packed: bool, state_only: bool):
    q_g, k_g, w_g, do_g, g_g, dht_g = refs[:6]
    m_g = refs[6] if packed else None  # [NT, META_COLS] int32 per-chunk (reset, final) ids
    dh_g, dv2_g, dh0_g = (None, None, refs[-1]) if state_only else refs[-3:]
    C, BV = CHUNK, cfg.block_v
    iv, hv, _, cols = v_block_coords(BV)
    # segments: this CTA runs chunks c0 + nt − 1 … c0 of batch row b; bs is its state-table row
    b, bs, c0 = segment_coords(cfg.segments, nt)
    at = lambda c: chunk_offset(c0, c)  # noqa: E731
    hk = hv // group
    K = k_g.shape[-1]
    dt = k_g.dtype
    # f16 io: dH is staged as f16 with one scale per column and written in f32 (docs/design.md); the
    # extra f32 tile fits in SMEM only with single-buffered stores
    scaled = dt == jnp.float16
    nbuf = 1 if scaled or packed else 2

    def load_dht(st_s, bar):
        plgpu.copy_gmem_to_smem(dht_g.at[bs, hv, :, cols], st_s, bar)
        plgpu.barrier_wait(bar)
        return cp.to_wgmma(st_s[...])

    if packed:  # every sequence's last chunk sets dH to its final-state cotangent
        dH0 = cp.to_wgmma(jnp.zeros((K, BV), f32))
    else:
        dH0 = pl.run_scoped(load_dht, cp.smem((K, BV), f32), plgpu.Barrier())

    def scoped(dh_s, p_s, qg_s, ndv_s, dv_s, *dhf):
        def step(idx, q_s, k_s, w_s, do_s, g_s, g2_s, *rest):
            *m_s, dH = rest
            (i,) = idx
            c = nt - 1 - i
            slot = lax.rem(i, nbuf)
            # the stores of step i - nbuf (same slots) must have left SMEM
            plgpu.wait_smem_to_gmem(2 * (nbuf - 1), wait_read_only=True)
            if packed:  # packed sequences on one lane (reverse): a last chunk loads its dht
                reset, fin = m_s[0][0], m_s[0][1]
                dH = load_state_row(fin, dht_g, hv, cols, dhf[0], dhf[1], dH)
            if scaled:
                dh_ref = dh_s
                unstage = stage_columns(dH, dh_ref, scaled)
                dhf[0][...] = dH
                dh_src = dhf[0]
            else:
                dh_ref = dh_src = dh_s.at[slot] if nbuf == 2 else dh_s
                unstage = stage_columns(dH, dh_ref, scaled)
            plgpu.commit_smem()
            if not state_only:
                plgpu.copy_smem_to_gmem(dh_src, dh_g.at[b, at(c), hv, :, cols])

            row = cp.iota((C, C), 0)
            col = cp.iota((C, C), 1)
            upper = row <= col  # j >= i
            g_r = cp.row_vec(g_s)
            # the column copy comes from a second SMEM buffer: inside the pipeline a second view
            # of g_s gets CSE'd with the row load and no layout fits both (pitfall P5)
            g_c = cp.col_vec(g2_s, C)
            g_last = g_s[C - 1]
            gd = cp.bcast_cols(g_c, (C, C)) - cp.bcast_rows(g_r, (C, C))  # G_j - G_i
            kq = cp.matmul(k_s, q_s.T, (C, C))
            p = jnp.where(upper, kq * jnp.exp(jnp.where(upper, gd, 0.0)), 0.0) * cfg.scale
            p_s[...] = p.astype(dt)
            qg = q_s[...].astype(f32) * cp.bcast_rows(cfg.scale * jnp.exp(g_r), (C, K))
            qg_s[...] = qg.astype(dt)
            plgpu.commit_smem()
            dv2 = unstage(cp.matmul(k_s, dh_ref, (C, BV)))
            dv2 = dv2 * cp.bcast_rows(jnp.exp(g_last - g_r), (C, BV))
            dv2 = dv2 + cp.matmul(p_s, do_s, (C, BV))
            dv_ref = dv_s.at[slot] if nbuf == 2 else dv_s
            dv_ref[...] = dv2
            ndv_s[...] = (-dv2).astype(dt)
            plgpu.commit_smem()
            if not state_only:
                plgpu.copy_smem_to_gmem(dv_ref, dv2_g.at[b, pl.ds(at(c) * C, C), hv, cols])

            def upd(acc):
                plgpu.wgmma(acc, qg_s.T, do_s)
                plgpu.wgmma(acc, w_s.T, ndv_s)
                plgpu.wgmma_wait(0)
                return acc[...]

            dH = dH * jnp.exp(g_last) + pl.run_scoped(upd, plgpu.ACC((K, BV), f32))
            if packed:  # a sequence's first chunk: dH is now the cotangent of its h0
                store_initial_cotangent(reset, dH, dhf[0], dh0_g, hv, cols)

            return dH

        rev = lambda i: at(nt - 1 - i)
        tile = lambda n: dict(dtype=dt, cols=n)
        specs = [
            cp.block_spec((None, C, None, K), lambda i: (b, rev(i), hk, 0), **tile(K)),  # q
            cp.block_spec((None, C, None, K), lambda i: (b, rev(i), hk, 0), **tile(K)),  # k
            cp.block_spec((None, C, None, K), lambda i: (b, rev(i), hv, 0), **tile(K)),  # w
            cp.block_spec((None, C, None, BV), lambda i: (b, rev(i), hv, iv), **tile(BV)),  # do
            cp.block_spec((None, None, C), lambda i: (b, hv, rev(i))),  # G (rows)
            cp.block_spec((None, None, C), lambda i: (b, hv, rev(i))),  # G (columns)
        ]
        ins = (q_g, k_g, w_g, do_g, g_g, g_g)
        if packed:
            specs.append(cp.block_spec((None, META_COLS), lambda i: (rev(i), 0)))  # (reset, final)
            ins += (m_g,)
        dH = plgpu.emit_pipeline(
            step, grid=(nt,), in_specs=specs, max_concurrent_steps=2, init_carry=dH0
        )(*ins)
        plgpu.wait_smem_to_gmem(0)
        return dH

    dh_shape = (K, BV) if nbuf == 1 else (2, K, BV)
    dv_shape = (C, BV) if nbuf == 1 else (2, C, BV)
    dH = pl.run_scoped(
        scoped,
        cp.smem(dh_shape, dt),
        cp.smem((C, C), dt),
        cp.smem((C, K), dt),
        cp.smem((C, BV), dt),
        cp.smem(dv_shape, f32),
        # dH in f32: the dh output with f16 io; the dht / dh0 staging of packed sequences
        *([cp.smem((K, BV), f32)] if scaled or packed else []),
        *([plgpu.Barrier()] if packed else []),
    )
    if packed:
        return

    store_f32_tile(dH, dh0_g.at[bs, hv, :, cols])


def chunk_bwd_dh(
    q: jax.Array,
    k: jax.Array,
    w: jax.Array,
    do: jax.Array,
    g_cum: jax.Array,
    dht: jax.Array,
    config: LoopConfig,
    meta: jax.Array | None = None,
    *,
    state_only: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array] | jax.Array:
    """Reverse chunk loop of the backward.

    Args:
      q, k: [B, T, H, K]; w: [B, T, HV, K]; do: [B, T, HV, V] (all the io dtype); T % 64 == 0.
      g_cum: [B, HV, T] f32 chunk-local cumulative log-decay.
      dht: [B, HV, K, V] f32 cotangent of the final state ([N, HV, K, V] with ``meta``).
      config: :class:`LoopConfig`. With ``segments = S > 1`` (T/64 a multiple of S) dht (without
        ``meta``) and dh0 have one row per (batch row, segment), b·S + j: the cotangent at the
        end of segment j, and the one at its start.
      meta: packed sequences on one lane (B == 1), as for
        :func:`pallas_kernels.gdn.chunk_fwd.chunk_fwd`: [T/64, META_COLS] int32 (reset, final) ids.
        With segments, every segment's last chunk must name a dht row in column 1.
      state_only: compute only dh0 (no dh, no dv2 written): the start cotangents of segments.
    Returns:
      dh [B, T/64, HV, K, V] (io dtype, f32 for f16 io; gradient of the state at each chunk's end),
      dv2 [B, T, HV, V] f32 (gradient of v_new; f32: dβ is sensitive to its rounding),
      dh0 [B, HV, K, V] f32 ([N, HV, K, V] with ``meta``; rows of sequences without chunks
      unwritten). ``state_only``: dh0 alone.
    """
    B, T, H, K = k.shape
    HV, V = do.shape[2], do.shape[3]
    if T % CHUNK or V % config.block_v:
        raise ValueError(f"{k.shape=} {do.shape=}: T % 64 and V % block_v must be 0")
    nt = T // CHUNK
    packed = meta is not None
    check_meta(meta, B, nt)
    segs = config.segments
    if nt % segs:
        raise ValueError(f"{k.shape=}, segments={segs}: T / 64 must be a multiple of segments")
    if not packed and dht.shape[0] != B * segs:
        raise ValueError(f"{dht.shape=}: needs B·segments = {B * segs} rows")
    dh0_type = jax.ShapeDtypeStruct(dht.shape if packed else (B * segs, HV, K, V), f32)
    out_type = (
        jax.ShapeDtypeStruct((B, nt, HV, K, V), f32 if k.dtype == jnp.float16 else k.dtype),
        jax.ShapeDtypeStruct((B, T, HV, V), f32),
        dh0_type,
    )
    if state_only:
        out_type = dh0_type

    def body(*refs):
        _dh_body(
            *refs, cfg=config, group=HV // H, nt=nt // segs, packed=packed, state_only=state_only
        )

    name = "gdn_segment_dh" if state_only else "gdn_chunk_bwd_dh"
    fn = per_v_block_kernel(
        body, out_type, v_blocks=V // config.block_v, HV=HV, B=B * segs, name=name
    )
    return fn(q, k, w, do, g_cum, dht, *(() if meta is None else (meta,)))
