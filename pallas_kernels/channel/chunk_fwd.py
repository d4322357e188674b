"""Stages 3+4 of chunked GDN2 / KDA: the inter-chunk state recurrence fused with the output.

One CTA (one warpgroup) per (batch row, value head, 64-wide V block) runs over the chunks in order,
with the state S [K, BV] in f32 registers as the ``emit_pipeline`` carry. Per chunk, from the
intra stage's outputs (:func:`pallas_kernels.channel.intra.channel_intra`):

    v_new = u − w S
    o     = scale · [ qg S + Aqk v_new ]                    qg = q e^{G}, Aqk causal and decayed
    S     ← Diag(e^{G_last}) S + kgᵀ v_new                  kg = k e^{G_last − G}

The per-key-channel decay of the state is a row scaling of the state tile (WGMMA layout, vector
loaded with ``WGMMA.reduce(1)``). The state is cast to the io dtype once per
chunk into one SMEM tile, the B operand of both ``w S`` and ``qg S``. With ``store_h`` the same loop
writes the state entering each chunk (h) and v_new instead of o: the backward's recomputation.
Padded rows (zero qg, kg, w, u and Aqk rows/columns) leave S unchanged; e^{G_last} must be the
decay at the chunk's last valid row (padded rows repeat it).

QAT (``state_quant``): the state entering each chunk (after a packed sequence's h0 is loaded) is
fake-quantised to FP8-E4M3 in registers (:func:`pallas_kernels.gdn.fake_quant.fake_quant_e4m3`,
one scale per V column or one per K×V state), and that quantised state is the one the chunk's
products, its decayed update and, with ``store_h``, the stored h use (as in the xla path and
:mod:`pallas_kernels.gdn.chunk_fwd`). A per-state scale needs the whole state in one CTA
(``block_v == V``). As with f16, the forward then has a single o tile, so that K = block_v = 128
fits with the reductions' SMEM; ``store_h`` allocates no o tiles in any mode.

Packed sequences on one lane (``meta``, as in :mod:`pallas_kernels.gdn.chunk_fwd`): each sequence
starts at a chunk boundary and a per-chunk table, read from SMEM as scalars, names the sequence
whose first chunk this is (the state is set to its h0 row, TMA-loaded into a staging tile under a
predicate) and the one whose last chunk this is (its end state is written from the same tile).

f16 io (docs/design.md: an f32 state is never staged through plain f16, whose maximum is 65504): the
state tile is staged as f16 with one scale per V column (:func:`pallas_kernels.gdn.fake_quant.
f16_stage_scales`, each column's amax at 2^14), and the columns of ``w S`` and ``qg S`` are
multiplied back by the scales in f32, as in :mod:`pallas_kernels.gdn.chunk_fwd`. With
``store_h``, h is written in f32 from a second, f32 SMEM tile (double-buffered for its TMA
store), so the staged tile is single-buffered and the unused o tiles are not allocated; the f32
h tiles do not fit at K = block_v = 128. The f16 forward has a single o tile (each step waits for
the previous o store) so that K = block_v = 128 fits with the scale reductions' SMEM. v_new and
o stay f16 (the update ``kgᵀ v_new`` has no state operand).
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
    load_state_row,
    per_v_block_kernel,
    store_f32_tile,
    store_final_state,
    v_block_coords,
)
from pallas_kernels.gdn.fake_quant import STATE_QUANT, fake_quant_e4m3, stage_columns

f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class ChannelFwdConfig(LoopConfig):
    """Static configuration of :func:`channel_chunk_fwd`: :class:`~pallas_kernels._tiles.LoopConfig`
    (scale, block_v) plus

    Attributes:
      store_h: backward recomputation mode: write h and v_new instead of o and the final state.
      state_quant: QAT fake quantisation (FP8-E4M3, dynamic scale) of the state entering each
        chunk: ``None`` (off), ``"column"`` (one scale per V column, amax over K) or
        ``"matrix"`` (one per K×V state; needs ``block_v == V``).
    """

    store_h: bool = False
    state_quant: str | None = None

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.store_h, bool):
            raise TypeError(f"{self.store_h=} must be a bool")
        if self.state_quant is not None and self.state_quant not in STATE_QUANT:
            raise ValueError(f"{self.state_quant=} must be None or one of {tuple(STATE_QUANT)}")


def _fwd_body(*refs, cfg: ChannelFwdConfig, nt: int, packed: bool):
    C, BV = CHUNK, cfg.block_v
    store_h = cfg.store_h
    n_in = 5 if store_h else 7
    if store_h:
        kg_g, w_g, u_g, dl_g, h0_g = refs[:n_in]
        h_g, vn_g = refs[-2:]
    else:
        qg_g, kg_g, w_g, u_g, aqk_g, dl_g, h0_g = refs[:n_in]
        o_g, ht_g = refs[-2:]
    m_g = refs[n_in] if packed else None  # [NT, META_COLS] int32 per-chunk (reset, final) ids
    iv, hv, b, cols = v_block_coords(BV)
    K = kg_g.shape[-1]
    dt = kg_g.dtype
    n_groups = 2 if store_h else 1  # TMA store groups issued per step
    # f16 io: the state is staged with one scale per column (its range is kept) and the backward's
    # h is written in f32 (docs/design.md: never stage the state through plain f16)
    scaled = dt == jnp.float16
    # a forward with in-register reductions of the state (f16's staging scales, the QAT amax) has
    # one o tile, so that K = block_v = 128 fits in SMEM with the reductions' scratch
    o_single = not store_h and (scaled or cfg.state_quant is not None)
    has_buf = scaled or not store_h  # bf16 store_h uses neither o tiles nor f32 h tiles

    def load_h0(h0_s, bar):
        plgpu.copy_gmem_to_smem(h0_g.at[b, hv, :, cols], h0_s, bar)
        plgpu.barrier_wait(bar)
        return cp.to_wgmma(h0_s[...])

    if packed:  # every state is set by its sequence's first chunk
        S0 = cp.to_wgmma(jnp.zeros((K, BV), f32))
    else:
        S0 = pl.run_scoped(load_h0, cp.smem((K, BV), f32), plgpu.Barrier())

    def scoped(s_s, vn_s, *rest):
        # buf: the o tiles (two slots; one with o_single), or with f16 store_h the two f32 h
        # tiles (none with bf16 store_h); stage (packed): the h0 / final-state tile [K, BV] f32
        # and its barrier
        buf, stage = (rest[0], rest[1:]) if has_buf else (None, rest)
        hf_s = buf if store_h and scaled else None
        st_s, st_bar = stage if packed else (None, None)

        def step(idx, *args):
            *args, S = args
            m_s = args.pop() if packed else None
            if store_h:
                kg_s, w_s, u_s, dl_s = args
            else:
                qg_s, kg_s, w_s, u_s, aqk_s, dl_s = args
            (c,) = idx
            slot = lax.rem(c, 2)
            if packed:  # packed sequences on one lane: a sequence's first chunk loads its h0
                reset, fin = m_s[0], m_s[1]
                S = load_state_row(reset, h0_g, hv, cols, st_s, st_bar, S)
            if cfg.state_quant is not None:
                # QAT: the carry becomes the quantised state, which the products, the decayed
                # update and the stored h below all use
                S = fake_quant_e4m3(S, STATE_QUANT[cfg.state_quant])
            # the stores issued two steps ago (same slot) must have finished reading SMEM
            # (f16 forward: the single o tile, so step c-1's o store too)
            plgpu.wait_smem_to_gmem(0 if o_single else n_groups, wait_read_only=True)
            # with f16 h is stored from the f32 tile, so the staged one is not a TMA source
            s_ref = s_s.at[slot] if store_h and not scaled else s_s
            vn_ref = vn_s.at[slot] if store_h else vn_s
            unstage = stage_columns(S, s_ref, scaled)
            if store_h and scaled:
                hf_s.at[slot][...] = S
            plgpu.commit_smem()
            if store_h:
                h_src = hf_s.at[slot] if scaled else s_ref
                plgpu.copy_smem_to_gmem(h_src, h_g.at[b, c, hv, :, cols])
            v_new = u_s[...].astype(f32) - unstage(cp.matmul(w_s, s_ref, (C, BV)))
            vn_ref[...] = v_new.astype(dt)
            if not store_h:
                o_inter = unstage(cp.matmul(qg_s, s_ref, (C, BV)))
            plgpu.commit_smem()
            if store_h:
                plgpu.copy_smem_to_gmem(vn_ref, vn_g.at[b, pl.ds(c * C, C), hv, cols])
            else:
                o = (o_inter + cp.matmul(aqk_s, vn_ref, (C, BV))) * cfg.scale
                o_ref = buf if o_single else buf.at[slot]
                o_ref[...] = o.astype(o_g.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_ref, o_g.at[b, pl.ds(c * C, C), hv, cols])
            decay = cp.bcast_rows(cp.row_vec(dl_s), (K, BV))
            S = S * decay + cp.matmul(kg_s.T, vn_ref, (K, BV))
            if packed and not store_h:  # a sequence's last chunk writes its final state
                store_final_state(fin, S, st_s, ht_g, hv, cols)

            return S

        tile = lambda cols_: dict(dtype=dt, cols=cols_)
        specs = []
        if not store_h:
            specs.append(cp.block_spec((None, C, None, K), lambda c: (b, c, hv, 0), **tile(K)))
        specs += [
            cp.block_spec((None, C, None, K), lambda c: (b, c, hv, 0), **tile(K)),  # kg
            cp.block_spec((None, C, None, K), lambda c: (b, c, hv, 0), **tile(K)),  # w
            cp.block_spec((None, C, None, BV), lambda c: (b, c, hv, iv), **tile(BV)),  # u
        ]
        if not store_h:
            specs.append(cp.block_spec((None, C, None, C), lambda c: (b, c, hv, 0), **tile(C)))
        specs.append(cp.block_spec((None, None, None, K), lambda c: (b, hv, c, 0)))  # e^{G_last}
        ins = (kg_g, w_g, u_g, dl_g) if store_h else (qg_g, kg_g, w_g, u_g, aqk_g, dl_g)
        if packed:
            specs.append(cp.block_spec((None, META_COLS), lambda c: (c, 0)))  # (reset, final)
            ins += (m_g,)
        S = plgpu.emit_pipeline(
            step, grid=(nt,), in_specs=specs, max_concurrent_steps=2, init_carry=S0
        )(*ins)
        plgpu.wait_smem_to_gmem(0)
        return S

    nbuf = 2 if store_h else 1
    s_shape = (nbuf, K, BV) if store_h and not scaled else (K, BV)
    vn_shape = (nbuf, C, BV) if store_h else (C, BV)
    if store_h:  # f16: h in f32, one tile per TMA store slot (no o tiles either way)
        buf = (cp.smem((2, K, BV), f32),) if scaled else ()
    else:
        buf = (cp.smem((C, BV) if o_single else (2, C, BV), dt),)
    stage = (cp.smem((K, BV), f32), plgpu.Barrier()) if packed else ()
    S = pl.run_scoped(scoped, cp.smem(s_shape, dt), cp.smem(vn_shape, dt), *buf, *stage)
    if not store_h and not packed:
        store_f32_tile(S, ht_g.at[b, hv, :, cols])


def channel_chunk_fwd(
    qg: jax.Array | None,
    kg: jax.Array,
    w: jax.Array,
    u: jax.Array,
    aqk: jax.Array | None,
    decay_last: jax.Array,
    h0: jax.Array,
    config: ChannelFwdConfig,
    meta: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Runs the chunk loop.

    Args:
      qg, kg, w: [B, T, HV, K] (from :func:`pallas_kernels.channel.intra.channel_intra`);
        qg unused/None with ``store_h``. T a multiple of 64.
      u: [B, T, HV, V]; aqk: [B, T, HV, 64] (None with ``store_h``).
      decay_last: [B, HV, T/64, K] f32, e^{G_last} per chunk and key channel.
      h0: [B, HV, K, V] f32 initial state ([N, HV, K, V] with ``meta``).
      config: :class:`ChannelFwdConfig`.
      meta: packed sequences on one lane (B == 1): [T/64, META_COLS] int32, column 0 the
        sequence whose first chunk this is (its state is set to h0[that]) or -1, column 1 the
        sequence whose last chunk this is (its end state is written to final[that]) or -1
        (:func:`pallas_kernels.gdn.chunk_fwd.chunk_fwd`'s table).
    Returns:
      Default: (o [B, T, HV, V] in kg.dtype, final state [B, HV, K, V] f32; [N, HV, K, V] with
      ``meta``, rows of sequences without chunks unwritten).
      ``store_h``: (h [B, T/64, HV, K, V] in kg.dtype (f32 for f16 io), the state entering each
      chunk; v_new [B, T, HV, V] in kg.dtype).
    Raises:
      NotImplementedError: f16 io with ``store_h`` at K = block_v = 128 (the f32 h tiles do not
        fit in shared memory; block_v = 64 does); ``meta`` with block_v = 128 (no shared memory
        for the state staging tile); ``state_quant="matrix"`` with block_v < V (the state's
        scale needs all of it in one CTA).
    """
    B, T, HV, K = kg.shape
    V = u.shape[3]
    if T % CHUNK or V % config.block_v:
        raise ValueError(f"{kg.shape=} {u.shape=}: T % 64 and V % block_v must be 0")
    f16 = kg.dtype == jnp.float16
    if config.store_h and f16 and K * config.block_v > 128 * 64:
        raise NotImplementedError(
            f"f16 store_h with K={K}, block_v={config.block_v}: the two f32 [K, block_v] h tiles "
            "do not fit in shared memory; use block_v=64"
        )
    if config.state_quant == "matrix" and config.block_v != V:
        raise NotImplementedError(
            f"{u.shape=}, block_v={config.block_v}: QAT state granularity 'matrix' needs the "
            "whole state in one CTA (block_v == V)"
        )
    nt = T // CHUNK
    if config.segments != 1:
        raise NotImplementedError(f"{config.segments=}: the channel loops run unsplit")
    packed = meta is not None
    check_meta(meta, B, nt)
    if packed and config.block_v == 128:
        raise NotImplementedError("packed states with block_v=128: no SMEM for the state staging")
    if config.store_h:
        out_type = (
            jax.ShapeDtypeStruct((B, nt, HV, K, V), f32 if f16 else kg.dtype),
            jax.ShapeDtypeStruct((B, T, HV, V), kg.dtype),
        )
        ins = (kg, w, u, decay_last, h0)
    else:
        out_type = (
            jax.ShapeDtypeStruct((B, T, HV, V), kg.dtype),
            jax.ShapeDtypeStruct(h0.shape if packed else (B, HV, K, V), f32),
        )
        ins = (qg, kg, w, u, aqk, decay_last, h0)
    ins += (meta,) if packed else ()

    def body(*refs):
        _fwd_body(*refs, cfg=config, nt=nt, packed=packed)

    fn = per_v_block_kernel(
        body,
        out_type,
        v_blocks=V // config.block_v,
        HV=HV,
        B=B,
        name="chan_chunk_h" if config.store_h else "chan_chunk_fwd",
    )
    return fn(*ins)
