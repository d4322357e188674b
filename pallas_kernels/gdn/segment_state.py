"""Segment pass of the sequence-parallel chunk loop: each segment's affine state map.

A sequence of T/64 chunks is cut into S equal segments. Over segment j the state recurrence of
:mod:`pallas_kernels.recurrence.chunk_fwd` is affine in the state entering the segment,
``S_end = M_j S_in + c_j`` with M_j [K, K] (it depends on k, w and the gates only) and c_j
[K, V]. This kernel runs the recurrence over the segment's chunks on the augmented state
``[c | M]`` [K, V + K], starting from ``[0 | I_K]``, with values ``[u | 0]``:

    v_new = [u | 0] − w S
    S     ← e^{G_last} S + kᵀ (v_new ⊙ e^{G_last − G})

and writes only the end state: no h, no v_new, no output. The decay per key channel (KDA / GDN2,
``channel``) runs its loop's update instead, on the intra kernel's decayed kg [B, T, HV, K] and
e^{G_last} [B, HV, T/64, K]: ``S ← Diag(e^{G_last}) S + kgᵀ v_new``. One CTA per (segment,
value head, 64-wide block of the V + K columns); blocks past V are the map's and read no
values (their u tile is fetched and masked to zero). The augmentation is virtual: no [u | 0] or
[0 | I] tensor exists. With packed sequences (``meta``), a sequence's first chunk sets the value
columns to its initial state and the map columns to zero (the state no longer depends on the
segment's input). The forward alone needs the first S − 1 segments only; the backward also
needs the last segment's map (``all_segments``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import _compat as cp
from pallas_kernels._compat import pl, plgpu
from pallas_kernels._tiles import (
    CHUNK,
    META_COLS,
    LoopConfig,
    check_meta,
    chunk_offset,
    finite,
    per_v_block_kernel,
    segment_coords,
    store_f32_tile,
    v_block_coords,
)
from pallas_kernels.gdn.fake_quant import stage_columns

f32 = jnp.float32


def _map_body(
    *refs,
    cfg: LoopConfig,
    group: int,
    seg_chunks: int,
    rows: int,
    nv: int,
    packed: bool,
    channel: bool,
):
    k_g, w_g, u_g, g_g, h0_g = refs[:5]
    m_g = refs[5] if packed else None
    out_g = refs[-1]
    C, BV = CHUNK, cfg.block_v
    iv, hv, _, cols = v_block_coords(BV)  # cols: this block's columns of [c | M]
    b, bs, c0 = segment_coords(rows, seg_chunks)
    at = lambda c: chunk_offset(c0, c)  # noqa: E731
    hk = hv // group
    K = k_g.shape[-1]
    dt = k_g.dtype
    scaled = dt == jnp.float16
    iu = jnp.minimum(iv, nv - 1)  # the u block a map block fetches (and masks)
    ucols = pl.ds(iu * BV, BV)
    # vector predicates (a select does not broadcast a scalar predicate on the GPU)
    row, col = cp.iota((K, BV), 0), cp.iota((K, BV), 1)
    is_val = row < jnp.where(iv < nv, K, 0)  # all-true in value blocks, all-false in map blocks
    keep_u = cp.iota((C, BV), 0) < jnp.where(iv < nv, C, 0)
    # map block m holds columns m·BV … of I_K: entry (r, j) is 1 where r − j == m·BV; value
    # blocks start at zero (r − j < K always)
    diag = jnp.where(iv < nv, K, (iv - nv) * BV)
    S0 = cp.to_wgmma(jnp.where(row - col == diag, 1.0, 0.0))

    def scoped(s_s, vd_s, *bufs):
        st_s, st_bar = bufs if packed else (None, None)

        def step(idx, k_s, w_s, u_s, g_s, *rest):
            *m_s, S = rest
            if packed:  # a sequence's first chunk: [h0 | 0]
                reset = m_s[0][0]

                @pl.when(reset >= 0)
                def _():
                    plgpu.copy_gmem_to_smem(h0_g.at[reset, hv, :, ucols], st_s, st_bar)
                    plgpu.barrier_wait(st_bar)

                on = row < jnp.where(reset >= 0, K, 0)
                S = jnp.where(on, jnp.where(is_val, cp.load_tile(st_s), 0.0), S)
            if not channel:  # (the channel loop's kg comes finite from the intra kernel)
                # the op's raw k: non-finite values read as 0 (a NaN state would survive a
                # packed lane's wipe gate, 0 · NaN, into the next sequence)
                k_s[...] = finite(cp.load_tile(k_s).astype(f32)).astype(dt)
            with jax.named_scope("map: stage S"):
                unstage = stage_columns(S, s_s, scaled)
                plgpu.commit_smem()
            with jax.named_scope("map: v_new"):
                ws = unstage(cp.matmul(w_s, s_s, (C, BV)))
                v_new = jnp.where(keep_u, u_s[...].astype(f32), 0.0) - ws
            with jax.named_scope("map: update"):
                if channel:  # kg is decayed to the chunk's end already; the state decays per row
                    vd_s[...] = v_new.astype(dt)
                    plgpu.commit_smem()
                    decay = cp.bcast_rows(cp.row_vec(g_s), (K, BV))
                    return S * decay + cp.matmul(k_s.T, vd_s, (K, BV))
                g_r = cp.row_vec(g_s)
                g_last = g_s[C - 1]
                vd = v_new * cp.bcast_rows(jnp.exp(g_last - g_r), (C, BV))
                vd_s[...] = vd.astype(dt)
                plgpu.commit_smem()
                return S * jnp.exp(g_last) + cp.matmul(k_s.T, vd_s, (K, BV))

        tile = lambda n: dict(dtype=dt, cols=n)  # noqa: E731
        specs = [
            cp.block_spec((None, C, None, K), lambda c: (b, at(c), hk, 0), **tile(K)),  # k
            cp.block_spec((None, C, None, K), lambda c: (b, at(c), hv, 0), **tile(K)),  # w
            cp.block_spec((None, C, None, BV), lambda c: (b, at(c), hv, iu), **tile(BV)),  # u
        ]
        if channel:  # e^{G_last} [B, HV, T/64, K]
            specs.append(cp.block_spec((None, None, None, K), lambda c: (b, hv, at(c), 0)))
        else:  # G [B, HV, T]
            specs.append(cp.block_spec((None, None, C), lambda c: (b, hv, at(c))))
        ins = (k_g, w_g, u_g, g_g)
        if packed:
            specs.append(cp.block_spec((None, META_COLS), lambda c: (at(c), 0)))
            ins += (m_g,)
        return plgpu.emit_pipeline(
            step, grid=(seg_chunks,), in_specs=specs, max_concurrent_steps=2, init_carry=S0
        )(*ins)

    bufs = (cp.smem((K, BV), f32), plgpu.Barrier()) if packed else ()
    S = pl.run_scoped(scoped, cp.smem((K, BV), dt), cp.smem((C, BV), dt), *bufs)
    store_f32_tile(S, out_g.at[bs, hv, :, cols])


def segment_maps(
    k: jax.Array,
    w: jax.Array,
    u: jax.Array,
    g_cum: jax.Array,
    h0: jax.Array,
    config: LoopConfig,
    meta: jax.Array | None = None,
    *,
    all_segments: bool = False,
    channel: bool = False,
) -> jax.Array:
    """The affine state map of each of the first S − 1 segments (S = ``config.segments``), or of
    all S with ``all_segments``.

    Args:
      k: [B, T, H, K] (non-finite values read as 0); w: [B, T, HV, K]; u: [B, T, HV, V] (io
        dtype); T/64 a multiple of S.
      g_cum: [B, HV, T] f32 chunk-local cumulative log-decay; with ``channel``, e^{G_last}
        [B, HV, T/64, K] f32 and k is the intra kernel's kg [B, T, HV, K] (the channel loop's
        inputs, :func:`pallas_kernels.recurrence.chunk_fwd.channel_chunk_fwd`).
      h0: [N, HV, K, V] f32 initial states of the packed sequences (read only with ``meta``).
      config: :class:`~pallas_kernels._tiles.LoopConfig` (block_v 64, segments ≥ 2; scale unused).
      meta: packed sequences on one lane (B == 1): [T/64, META_COLS] int32, column 0 the
        sequence whose first chunk this is, else -1 (as for
        :func:`pallas_kernels.recurrence.chunk_fwd.chunk_fwd`; column 1 unused).
      all_segments: run every segment (R = S rows per batch row) instead of the first S − 1.
      channel: the decay per key channel (KDA / GDN2) instead of the scalar gate (GDN).
    Returns:
      [B·R, HV, K, V + K] f32 (R = S − 1, or S with ``all_segments``): row b·R + j holds
      ``[c_j | M_j]`` of segment j of batch row b, the end state of the segment from a zero state
      and its map: ``S_end = M_j S_in + c_j``.
    """
    B, T, H, K = k.shape
    HV, V = u.shape[2], u.shape[3]
    S = config.segments
    nt = T // CHUNK
    if T % CHUNK or S < 2 or nt % S:
        raise ValueError(f"{k.shape=}, segments={S}: need T % 64 == 0, segments >= 2 dividing T/64")
    if config.block_v != 64:
        raise NotImplementedError(f"{config.block_v=}: the segment pass uses 64-column blocks")
    packed = meta is not None
    check_meta(meta, B, nt)
    bv = config.block_v
    R = S if all_segments else S - 1
    out_type = jax.ShapeDtypeStruct((B * R, HV, K, V + K), f32)

    def body(*refs):
        _map_body(
            *refs, cfg=config, group=HV // H, seg_chunks=nt // S, rows=R, nv=V // bv,
            packed=packed, channel=channel,
        )  # fmt: skip

    name = "chan_segment_map" if channel else "gdn_segment_map"
    fn = per_v_block_kernel(body, out_type, v_blocks=(V + K) // bv, HV=HV, B=B * R, name=name)
    return fn(k, w, u, g_cum, h0, *(() if meta is None else (meta,)))


__all__ = ["segment_maps"]
