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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _compat as cp
from pallas_kernels._compat import pl, plgpu
from pallas_kernels._tiles import (
    CHUNK,
    LoopConfig,
    per_v_block_kernel,
    store_f32_tile,
    v_block_coords,
)
from pallas_kernels.gdn.fake_quant import stage_columns

f32 = jnp.float32


def _dh_body(qg_g, kg_g, w_g, do_g, aqk_g, egl_g, dht_g, dh_g, dvh_g, dvl_g, dh0_g, *, cfg, nt):
    C, BV = CHUNK, cfg.block_v
    iv, hv, b, cols = v_block_coords(BV)
    K = kg_g.shape[-1]
    dt = kg_g.dtype
    # f16 io: dH is staged with one scale per column and dh is written in f32 (docs/design.md)
    scaled = dt == jnp.float16

    def load_dht(st_s, bar):
        plgpu.copy_gmem_to_smem(dht_g.at[b, hv, :, cols], st_s, bar)
        plgpu.barrier_wait(bar)
        return cp.to_wgmma(st_s[...])

    dH0 = pl.run_scoped(load_dht, cp.smem((K, BV), f32), plgpu.Barrier())

    def scoped(dh_s, ndv_s, hi_s, lo_s, *dhf_s):
        def step(idx, qg_s, kg_s, w_s, do_s, aqk_s, egl_s, dH):
            (i,) = idx
            c = nt - 1 - i
            slot = lax.rem(i, 2)
            at_slot = (lambda r: r) if scaled else (lambda r: r.at[slot])
            rows = pl.ds(c * C, C)
            if scaled:
                # single-buffered stores: those of step i-1 must have left SMEM
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                dh_ref = dh_s
                unstage = stage_columns(dH, dh_ref, scaled)
                dhf_s[0][...] = dH
                dh_src = dhf_s[0]
            else:
                plgpu.wait_smem_to_gmem(3, wait_read_only=True)  # the stores of step i-2 left SMEM
                dh_ref = dh_src = dh_s.at[slot]
                unstage = stage_columns(dH, dh_ref, scaled)
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
            return dH * decay + cfg.scale * cp.matmul(qg_s.T, do_s, (K, BV)) + upd

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
        dH = plgpu.emit_pipeline(
            step, grid=(nt,), in_specs=specs, max_concurrent_steps=2, init_carry=dH0
        )(qg_g, kg_g, w_g, do_g, aqk_g, egl_g)
        plgpu.wait_smem_to_gmem(0)
        return dH

    dH = pl.run_scoped(
        scoped,
        cp.smem((K, BV) if scaled else (2, K, BV), dt),  # dH as the wgmma operand (+ dh store)
        cp.smem((C, BV), dt),
        cp.smem((C, BV) if scaled else (2, C, BV), dt),  # dv2 hi
        cp.smem((C, BV) if scaled else (2, C, BV), dt),  # dv2 lo
        *((cp.smem((K, BV), f32),) if scaled else ()),  # f16 io: dH in f32, the dh store
    )

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
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Reverse chunk loop of the channel-decay backward.

    Args:
      qg, kg, w: [B, T, HV, K] io dtype (from the intra stage); T % 64 == 0.
      do: [B, T, HV, V] io dtype.
      aqk: [B, T, HV, 64] io dtype, the decayed causal intra-chunk product (unscaled).
      decay_last: [B, HV, T/64, K] f32, e^{G_last} per chunk and key channel.
      dht: [B, HV, K, V] f32 cotangent of the final state.
      config: :class:`LoopConfig`.
    Returns:
      dh [B, T/64, HV, K, V] (io dtype, f32 for f16 io; gradient of the state at each chunk's
      end), dv2_hi, dv2_lo [B, T, HV, V] io dtype (dL/dv_new = hi + lo), dh0 [B, HV, K, V] f32.
    Raises:
      NotImplementedError: f16 io at K = block_v = 128 (shared memory; block_v = 64 fits).
    """
    B, T, HV, K = kg.shape
    V = do.shape[3]
    if T % CHUNK or V % config.block_v:
        raise ValueError(f"{kg.shape=} {do.shape=}: T % 64 and V % block_v must be 0")
    nt = T // CHUNK
    if config.segments != 1:
        raise NotImplementedError(f"{config.segments=}: the channel loops run unsplit")
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
        jax.ShapeDtypeStruct((B, HV, K, V), f32),
    )

    def body(*refs):
        _dh_body(*refs, cfg=config, nt=nt)

    fn = per_v_block_kernel(
        body, out_type, v_blocks=V // config.block_v, HV=HV, B=B, name="chan_bwd_dh"
    )
    return fn(qg, kg, w, do, aqk, decay_last, dht)
