"""Stages 3+4 of chunked GDN: the inter-chunk state recurrence fused with the output.

One CTA (one warpgroup) per (batch row, value head, 64-wide V block) runs over the chunks in order.
The state S [K, BV] stays in f32 registers as the ``emit_pipeline`` carry; each chunk it is cast to
the io dtype once, into one SMEM tile that is the B operand of both ``w @ S`` and ``q @ S``:

    v_new = u − w S
    o     = scale · [ (q S) ⊙ e^{G} + (q kᵀ ⊙ e^{G_i − G_j} ⊙ [i ≥ j]) v_new ]
    S     ← e^{G_last} S + kᵀ (v_new ⊙ e^{G_last − G})

so the forward writes no per-chunk state h at all. The same kernel, with ``store_h``, writes the
state entering each chunk (h) and v_new instead of o: that is the backward's recomputation.
Padded rows (zero k, q, u and a repeated cumulative gate) leave S unchanged, and G_last is the
cumulative gate of the last row, i.e. of the last valid row.
"""

from __future__ import annotations

import dataclasses

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
    store_final_state,
    v_block_coords,
)
from pallas_kernels.gdn.fake_quant import STATE_QUANT, fake_quant_e4m3, stage_columns

f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class ChunkFwdConfig(LoopConfig):
    """Static configuration of :func:`chunk_fwd`: :class:`~pallas_kernels._tiles.LoopConfig`
    (scale, block_v; 64 keeps the state carry at ~140 registers, no spills) plus

    Attributes:
      store_h: backward recomputation mode: write h and v_new instead of o and the final state.
      state_quant: QAT fake quantisation (FP8-E4M3, dynamic scale) of the state entering each
        chunk, which both the chunk's products and its update then use: ``None`` (off),
        ``"column"`` (one scale per V column, amax over K) or ``"matrix"`` (one per K×V state;
        needs the whole state in one CTA, i.e. ``block_v == V``).
    """

    store_h: bool = False
    state_quant: str | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.state_quant is not None and self.state_quant not in STATE_QUANT:
            raise ValueError(f"{self.state_quant=} must be None or one of {tuple(STATE_QUANT)}")


def _fwd_body(*refs, cfg: ChunkFwdConfig, group: int, nt: int, packed: bool):
    C, BV = CHUNK, cfg.block_v
    refs = list(refs)
    q_g = None if cfg.store_h else refs.pop(0)
    k_g, w_g, u_g, g_g, h0_g = refs[:5]
    m_g = refs[5] if packed else None  # [NT, META_COLS] int32 per-chunk (reset, final) ids
    if cfg.store_h:
        h_g, vn_g = refs[-2:]
    else:
        o_g, ht_g = refs[-2:]
    iv, hv, _, cols = v_block_coords(BV)
    # segments: this CTA runs chunks c0 … c0 + nt − 1 of batch row b; bs is its state-table row
    b, bs, c0 = segment_coords(cfg.segments, nt)
    at = lambda c: chunk_offset(c0, c)  # noqa: E731
    hk = hv // group
    K = k_g.shape[-1]
    dt = k_g.dtype
    store_h = cfg.store_h
    n_groups = 2 if store_h else 1  # TMA store groups issued per step
    # f16 io: the state is staged as f16 with one scale per column (its range is kept), and the
    # backward's h is written in f32 (docs/design.md: never stage the state through plain f16)
    scaled = dt == jnp.float16

    def load_h0(h0_s, bar):
        plgpu.copy_gmem_to_smem(h0_g.at[bs, hv, :, cols], h0_s, bar)
        plgpu.barrier_wait(bar)
        return cp.to_wgmma(h0_s[...])

    if packed:  # every state is set by its sequence's first chunk
        S0 = cp.to_wgmma(jnp.zeros((K, BV), f32))
    else:
        S0 = pl.run_scoped(load_h0, cp.smem((K, BV), f32), plgpu.Barrier())

    def scoped(s_s, vn_s, *bufs):
        # store_h: vd_s (+ the f32 h tiles with f16 io); forward: p_s, o_s, and v_dec reuses the
        # v_new tile once o is done with it (SMEM: block_v = 128 must fit in 227 KiB)
        bufs = list(bufs)
        st_s, st_bar = (bufs.pop(), bufs.pop())[::-1] if packed else (None, None)
        vd_s, p_s, o_s = (bufs[0], None, None) if store_h else (vn_s, *bufs[:2])
        hf_s = bufs[1] if store_h and scaled else None

        def step(idx, *args):
            args = list(args)
            m_s = args.pop(-2) if packed else None
            if store_h:
                k_s, w_s, u_s, g_s, S = args
            else:
                q_s, k_s, w_s, u_s, g_s, S = args
            (c,) = idx
            slot = lax.rem(c, 2)
            if packed:  # packed sequences on one lane: a sequence's first chunk loads its h0
                reset, fin = m_s[0], m_s[1]
                S = load_state_row(reset, h0_g, hv, cols, st_s, st_bar, S)
            if cfg.state_quant is not None:
                # QAT: the carry becomes the quantised state; the products below and the decayed
                # update both use it (as the xla path does)
                S = fake_quant_e4m3(S, STATE_QUANT[cfg.state_quant])
            # the stores issued two steps ago (same slot) must have finished reading SMEM
            plgpu.wait_smem_to_gmem(n_groups, wait_read_only=True)
            s_ref = s_s.at[slot] if store_h and not scaled else s_s
            vn_ref = vn_s.at[slot] if store_h else vn_s
            unstage = stage_columns(S, s_ref, scaled)
            if store_h and scaled:
                hf_s.at[slot][...] = S
            plgpu.commit_smem()
            if store_h:
                h_src = hf_s.at[slot] if scaled else s_ref
                plgpu.copy_smem_to_gmem(h_src, h_g.at[b, at(c), hv, :, cols])
            v_new = u_s[...].astype(f32) - unstage(cp.matmul(w_s, s_ref, (C, BV)))
            g_r = cp.row_vec(g_s)
            g_last = g_s[C - 1]
            vn_ref[...] = v_new.astype(dt)
            if not store_h:
                row = cp.iota((C, C), 0)
                col = cp.iota((C, C), 1)
                causal = row >= col
                g_c = cp.col_vec(g_s, C)
                gd = cp.bcast_rows(g_r, (C, C)) - cp.bcast_cols(g_c, (C, C))
                qk = cp.matmul(q_s, k_s.T, (C, C))
                p = jnp.where(causal, qk * jnp.exp(jnp.where(causal, gd, 0.0)), 0.0)
                p_s[...] = p.astype(dt)
                o_inter = unstage(cp.matmul(q_s, s_ref, (C, BV)))
                o_inter = o_inter * cp.bcast_rows(jnp.exp(g_r), (C, BV))
            plgpu.commit_smem()
            if store_h:
                plgpu.copy_smem_to_gmem(vn_ref, vn_g.at[b, pl.ds(at(c) * C, C), hv, cols])
            else:
                o = (o_inter + cp.matmul(p_s, vn_ref, (C, BV))) * cfg.scale
                o_s.at[slot][...] = o.astype(o_g.dtype)
                plgpu.commit_smem()
                dst = o_g.at[b, pl.ds(at(c) * C, C), hv, cols]
                plgpu.copy_smem_to_gmem(o_s.at[slot], dst)
            vd = v_new * cp.bcast_rows(jnp.exp(g_last - g_r), (C, BV))
            vd_s[...] = vd.astype(dt)
            plgpu.commit_smem()
            S = S * jnp.exp(g_last) + cp.matmul(k_s.T, vd_s, (K, BV))
            if packed and not store_h:  # a sequence's last chunk writes its final state
                store_final_state(fin, S, st_s, ht_g, hv, cols)

            return S

        tile = lambda cols_: dict(dtype=dt, cols=cols_)
        specs = []
        if not store_h:
            specs.append(cp.block_spec((None, C, None, K), lambda c: (b, at(c), hk, 0), **tile(K)))
        specs += [
            cp.block_spec((None, C, None, K), lambda c: (b, at(c), hk, 0), **tile(K)),  # k
            cp.block_spec((None, C, None, K), lambda c: (b, at(c), hv, 0), **tile(K)),  # w
            cp.block_spec((None, C, None, BV), lambda c: (b, at(c), hv, iv), **tile(BV)),  # u
            cp.block_spec((None, None, C), lambda c: (b, hv, at(c))),  # G [B, HV, T]
        ]
        ins = (k_g, w_g, u_g, g_g) if store_h else (q_g, k_g, w_g, u_g, g_g)
        if packed:
            specs.append(cp.block_spec((None, META_COLS), lambda c: (at(c), 0)))  # (reset, final)
            ins += (m_g,)
        S = plgpu.emit_pipeline(
            step, grid=(nt,), in_specs=specs, max_concurrent_steps=2, init_carry=S0
        )(*ins)
        plgpu.wait_smem_to_gmem(0)
        return S

    nbuf = 2 if store_h else 1
    s_shape = (nbuf, K, BV) if store_h and not scaled else (K, BV)
    vn_shape = (nbuf, C, BV) if store_h else (C, BV)
    if store_h:
        bufs = (cp.smem((C, BV), dt),) + ((cp.smem((2, K, BV), f32),) if scaled else ())
    else:
        bufs = (cp.smem((C, C), dt), cp.smem((2, C, BV), dt))
    if packed:
        bufs += (cp.smem((K, BV), f32), plgpu.Barrier())  # h0 / final state staging
    S = pl.run_scoped(scoped, cp.smem(s_shape, dt), cp.smem(vn_shape, dt), *bufs)
    if not store_h and not packed:
        store_f32_tile(S, ht_g.at[bs, hv, :, cols])


def chunk_fwd(
    q: jax.Array | None,
    k: jax.Array,
    w: jax.Array,
    u: jax.Array,
    g_cum: jax.Array,
    h0: jax.Array,
    config: ChunkFwdConfig,
    meta: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Runs the chunk loop.

    Args:
      q, k: [B, T, H, K] (q unused/None with ``store_h``); T a multiple of 64.
      w: [B, T, HV, K]; u: [B, T, HV, V] (from :func:`pallas_kernels.gdn.intra.intra_chunk`).
      g_cum: [B, HV, T] f32 chunk-local cumulative log-decay.
      h0: [B, HV, K, V] f32 initial state ([N, HV, K, V] with ``meta``). With
        ``config.segments = S > 1`` (T/64 a multiple of S): [B·S, HV, K, V], the state entering
        each segment (row b·S + j: segment j of batch row b); with ``meta`` the table rows that
        column 0 names (every segment's first chunk must name one).
      config: :class:`ChunkFwdConfig`.
      meta: packed sequences on one lane (B == 1): [T/64, META_COLS] int32, column 0 the
        sequence whose first chunk this is (its state is set to h0[that]) or -1, column 1 the
        sequence whose last chunk this is (its end state is written to final[that]) or -1.
    Returns:
      Default: (o [B, T, HV, V] in k.dtype, final state [B, HV, K, V] f32; [N, HV, K, V] with
      ``meta``, rows of sequences without chunks unwritten; [B·S, HV, K, V] with S segments and
      no ``meta``: each segment's end state).
      ``store_h``: (h [B, T/64, HV, K, V] in k.dtype (f32 for f16 io), the state entering each
      chunk (after ``config.state_quant``); v_new [B, T, HV, V]).
    """
    B, T, H, K = k.shape
    HV, V = u.shape[2], u.shape[3]
    if T % CHUNK or V % config.block_v:
        raise ValueError(f"{k.shape=} {u.shape=}: T % 64 and V % block_v must be 0")
    if config.store_h and k.dtype == jnp.float16 and config.block_v == 128:
        raise NotImplementedError("f16 with block_v=128: the f32 h tiles do not fit in SMEM")
    if config.state_quant == "matrix" and config.block_v != V:
        raise NotImplementedError(
            f"{u.shape=}, block_v={config.block_v}: QAT state granularity 'matrix' needs the "
            "whole K×V state in one CTA (block_v == V); use 'column' or block_v=V"
        )
    nt = T // CHUNK
    packed = meta is not None
    check_meta(meta, B, nt)
    segs = config.segments
    if nt % segs:
        raise ValueError(f"{k.shape=}, segments={segs}: T / 64 must be a multiple of segments")
    if segs > 1 and config.state_quant is not None:
        raise NotImplementedError("segments > 1 with the QAT state quant (not an affine map)")
    if segs > 1 and not packed and h0.shape[0] != B * segs:
        raise ValueError(f"{h0.shape=}: with segments={segs} h0 needs B·segments = {B * segs} rows")
    if packed and config.block_v == 128:
        raise NotImplementedError("packed states with block_v=128: no SMEM for the state staging")
    if config.store_h:
        h_dtype = f32 if k.dtype == jnp.float16 else k.dtype
        out_type = (
            jax.ShapeDtypeStruct((B, nt, HV, K, V), h_dtype),
            jax.ShapeDtypeStruct((B, T, HV, V), k.dtype),
        )
        ins = (k, w, u, g_cum, h0)
    else:
        out_type = (
            jax.ShapeDtypeStruct((B, T, HV, V), k.dtype),
            jax.ShapeDtypeStruct(h0.shape if packed else (B * segs, HV, K, V), f32),
        )
        ins = (q, k, w, u, g_cum, h0)
    ins += (meta,) if packed else ()

    def body(*refs):
        _fwd_body(*refs, cfg=config, group=HV // H, nt=nt // segs, packed=packed)

    fn = per_v_block_kernel(
        body,
        out_type,
        v_blocks=V // config.block_v,
        HV=HV,
        B=B * segs,
        name="gdn_chunk_h" if config.store_h else "gdn_chunk_fwd",
    )
    return fn(*ins)
