"""Channel-decay backward: the reverse state-gradient recurrence, fused with the local dv.

One CTA (one warpgroup) per (batch row, value head, 64-wide V block) runs over the chunks in
reverse. dH [K, BV] (the gradient of the state at the end of the current chunk) stays in f32
registers as the ``emit_pipeline`` carry, initialised with the final-state cotangent. From the
forward's intra stage (:func:`pallas_kernels.channel.intra.channel_intra`, recomputed) it reads
qg = q e^{G}, kg = k e^{G_last − G}, w and the decayed causal Aqk, so no exponential of a [C, K]
tile is formed here:

    dh[c]  = dH                                       (written, io dtype; f32 for f16 io)
    dv2    = kg dH + scale Aqkᵀ do                                   (= dL/dv_new)
    dH     ← Diag(e^{G_last}) dH + scale qgᵀ do − wᵀ dv2

The per-key-channel decay of dH is a row scaling of the tile. dv2 is written as two 16-bit terms
(hi + lo ≈ f32) so the later stages can use it as a tensor-core operand without losing precision.

f16 io (docs/design.md: an f32 state gradient is never staged through plain f16, whose maximum is
65504): dH, the B operand of ``kg dH``, is staged as f16 with one scale per V column
(:func:`pallas_kernels.gdn.fake_quant.f16_stage_scales`) and the product's columns are multiplied
back by the scales in f32, as in :mod:`pallas_kernels.gdn.chunk_bwd_dh`; dh is written in f32
from an f32 copy of dH. For shared memory every stored tile (dh in f32, dv2 hi, lo) is
single-buffered, as in the GDN kernel: each step waits for the previous step's stores, issued a
whole dH update earlier. dv2's hi/lo pair and the −dv2 operand of ``wᵀ dv2`` are f16 (the io
dtype of the residuals).

Packed sequences on one lane (``meta``, the table of
:func:`pallas_kernels.channel.chunk_fwd.channel_chunk_fwd`) mirror the forward: at a sequence's
last chunk dH is set to its dht row (TMA-loaded into an f32 staging tile under a predicate), and
after its first chunk dH is written to its dh0 row from the same tile; for that tile's SMEM the
stores are single-buffered as with f16 io.
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
    load_state_row,
    per_v_block_kernel,
    store_f32_tile,
    store_initial_cotangent,
    v_block_coords,
)
from pallas_kernels.gdn.fake_quant import stage_columns

f32 = jnp.float32


def _dh_body(*refs, cfg, nt: int, packed: bool):
    qg_g, kg_g, w_g, do_g, aqk_g, egl_g, dht_g = refs[:7]
    m_g = refs[7] if packed else None  # [NT, META_COLS] int32 per-chunk (reset, final) ids
    dh_g, dvh_g, dvl_g, dh0_g = refs[-4:]
    C, BV = CHUNK, cfg.block_v
    iv, hv, b, cols = v_block_coords(BV)
    K = kg_g.shape[-1]
    dt = kg_g.dtype
    # f16 io: dH is staged with one scale per column and dh is written in f32 (docs/design.md)
    scaled = dt == jnp.float16
    # the f32 [K, BV] tile (f16: the dh store; packed: the dht / dh0 staging) fits in SMEM only
    # with single-buffered stores
    single = scaled or packed

    def load_dht(st_s, bar):
        plgpu.copy_gmem_to_smem(dht_g.at[b, hv, :, cols], st_s, bar)
        plgpu.barrier_wait(bar)
        return cp.to_wgmma(st_s[...])

    if packed:  # every sequence's last chunk sets dH to its final-state cotangent
        dH0 = cp.to_wgmma(jnp.zeros((K, BV), f32))
    else:
        dH0 = pl.run_scoped(load_dht, cp.smem((K, BV), f32), plgpu.Barrier())

    def scoped(dh_s, ndv_s, hi_s, lo_s, *dhf_s):
        def step(idx, qg_s, kg_s, w_s, do_s, aqk_s, egl_s, *rest):
            *m_s, dH = rest
            (i,) = idx
            c = nt - 1 - i
            slot = lax.rem(i, 2)
            at_slot = (lambda r: r) if single else (lambda r: r.at[slot])
            rows = pl.ds(c * C, C)
            if single:  # single-buffered stores: those of step i-1 must have left SMEM
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            else:
                plgpu.wait_smem_to_gmem(3, wait_read_only=True)  # the stores of step i-2 left SMEM
            if packed:  # packed sequences on one lane (reverse): a last chunk loads its dht
                reset, fin = m_s[0][0], m_s[0][1]
                dH = load_state_row(fin, dht_g, hv, cols, dhf_s[0], dhf_s[1], dH)
            dh_ref = at_slot(dh_s)
            unstage = stage_columns(dH, dh_ref, scaled)
            if scaled:
                dhf_s[0][...] = dH
                dh_src = dhf_s[0]
            else:
                dh_src = dh_ref
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dh_src, dh_g.at[b, c, hv, :, cols])

            dv2 = unstage(cp.matmul(kg_s, dh_ref, (C, BV)))
            dv2 = dv2 + cfg.scale * cp.matmul(aqk_s.T, do_s, (C, BV))
            hi = dv2.astype(dt)
            at_slot(hi_s)[...] = hi
            at_slot(lo_s)[...] = (dv2 - hi.astype(f32)).astype(dt)
            ndv_s[...] = (-dv2).astype(dt)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(at_slot(hi_s), dvh_g.at[b, rows, hv, cols])
            plgpu.copy_smem_to_gmem(at_slot(lo_s), dvl_g.at[b, rows, hv, cols])

            decay = cp.bcast_rows(cp.row_vec(egl_s), (K, BV))
            upd = cp.matmul(w_s.T, ndv_s, (K, BV))
            dH = dH * decay + cfg.scale * cp.matmul(qg_s.T, do_s, (K, BV)) + upd
            if packed:  # a sequence's first chunk: dH is now the cotangent of its h0
                store_initial_cotangent(reset, dH, dhf_s[0], dh0_g, hv, cols)

            return dH

        rev = lambda i: nt - 1 - i
        tile = lambda n: dict(dtype=dt, cols=n)
        specs = [
            cp.block_spec((None, C, None, K), lambda i: (b, rev(i), hv, 0), **tile(K)),  # qg
            cp.block_spec((None, C, None, K), lambda i: (b, rev(i), hv, 0), **tile(K)),  # kg
            cp.block_spec((None, C, None, K), lambda i: (b, rev(i), hv, 0), **tile(K)),  # w
            cp.block_spec((None, C, None, BV), lambda i: (b, rev(i), hv, iv), **tile(BV)),  # do
            cp.block_spec((None, C, None, C), lambda i: (b, rev(i), hv, 0), **tile(C)),  # Aqk
            cp.block_spec((None, None, None, K), lambda i: (b, hv, rev(i), 0)),  # e^{G_last}
        ]
        ins = (qg_g, kg_g, w_g, do_g, aqk_g, egl_g)
        if packed:
            specs.append(cp.block_spec((None, META_COLS), lambda i: (rev(i), 0)))  # (reset, final)
            ins += (m_g,)
        dH = plgpu.emit_pipeline(
            step, grid=(nt,), in_specs=specs, max_concurrent_steps=2, init_carry=dH0
        )(*ins)
        plgpu.wait_smem_to_gmem(0)
        return dH

    dH = pl.run_scoped(
        scoped,
        cp.smem((K, BV) if single else (2, K, BV), dt),  # dH as the wgmma operand (+ dh store)
        cp.smem((C, BV), dt),
        cp.smem((C, BV) if single else (2, C, BV), dt),  # dv2 hi
        cp.smem((C, BV) if single else (2, C, BV), dt),  # dv2 lo
        # dH in f32: the dh store with f16 io; the dht / dh0 staging of packed sequences
        *((cp.smem((K, BV), f32),) if single else ()),
        *((plgpu.Barrier(),) if packed else ()),
    )
    if not packed:
        store_f32_tile(dH, dh0_g.at[b, hv, :, cols])


def channel_bwd_dh(
    qg: jax.Array,
    kg: jax.Array,
    w: jax.Array,
    do: jax.Array,
    aqk: jax.Array,
    decay_last: jax.Array,
    dht: jax.Array,
    config: LoopConfig,
    meta: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Reverse chunk loop of the channel-decay backward.

    Args:
      qg, kg, w: [B, T, HV, K] io dtype (from the intra stage); T % 64 == 0.
      do: [B, T, HV, V] io dtype.
      aqk: [B, T, HV, 64] io dtype, the decayed causal intra-chunk product (unscaled).
      decay_last: [B, HV, T/64, K] f32, e^{G_last} per chunk and key channel.
      dht: [B, HV, K, V] f32 cotangent of the final state ([N, HV, K, V] with ``meta``).
      config: :class:`LoopConfig`.
      meta: packed sequences on one lane (B == 1), as for
        :func:`pallas_kernels.channel.chunk_fwd.channel_chunk_fwd`: [T/64, META_COLS] int32
        (reset, final) ids; dH is set to dht[n] at sequence n's last chunk and written to dh0[n]
        after its first.
    Returns:
      dh [B, T/64, HV, K, V] (io dtype, f32 for f16 io; gradient of the state at each chunk's
      end), dv2_hi, dv2_lo [B, T, HV, V] io dtype (dL/dv_new = hi + lo), dh0 [B, HV, K, V] f32
      ([N, HV, K, V] with ``meta``, rows of sequences without chunks unwritten).
    Raises:
      NotImplementedError: f16 io, or ``meta``, at K = block_v = 128 (shared memory; block_v =
        64 fits).
    """
    B, T, HV, K = kg.shape
    V = do.shape[3]
    if T % CHUNK or V % config.block_v:
        raise ValueError(f"{kg.shape=} {do.shape=}: T % 64 and V % block_v must be 0")
    nt = T // CHUNK
    if config.segments != 1:
        raise NotImplementedError(f"{config.segments=}: the channel loops run unsplit")
    packed = meta is not None
    check_meta(meta, B, nt)
    if packed and K * config.block_v > 128 * 64:
        raise NotImplementedError(
            f"packed states with K={K}, block_v={config.block_v}: the f32 dht / dh0 staging tile "
            "does not fit in shared memory; use block_v=64"
        )
    dt = kg.dtype
    if dt == jnp.float16 and K * config.block_v > 128 * 64:
        raise NotImplementedError(
            f"f16 with K={K}, block_v={config.block_v}: the f32 dh tile does not fit in shared "
            "memory; use block_v=64"
        )
    out_type = (
        jax.ShapeDtypeStruct((B, nt, HV, K, V), f32 if dt == jnp.float16 else dt),
        jax.ShapeDtypeStruct((B, T, HV, V), dt),
        jax.ShapeDtypeStruct((B, T, HV, V), dt),
        jax.ShapeDtypeStruct(dht.shape if packed else (B, HV, K, V), f32),
    )

    def body(*refs):
        _dh_body(*refs, cfg=config, nt=nt, packed=packed)

    fn = per_v_block_kernel(
        body, out_type, v_blocks=V // config.block_v, HV=HV, B=B, name="chan_bwd_dh"
    )
    return fn(qg, kg, w, do, aqk, decay_last, dht, *(() if meta is None else (meta,)))
