"""Stages 3+4 of chunked GDN2 / KDA: the inter-chunk state recurrence fused with the output.

One CTA (one warpgroup) per (batch row, value head, 64-wide V block) runs over the chunks in order,
with the state S [K, BV] in f32 registers as the ``emit_pipeline`` carry. Per chunk, from the
intra stage's outputs (:func:`pallas_kernels.channel.intra.channel_intra`):

    v_new = u − w S
    o     = scale · [ qg S + Aqk v_new ]                    qg = q e^{G}, Aqk causal and decayed
    S     ← Diag(e^{G_last}) S + kgᵀ v_new                  kg = k e^{G_last − G}

The per-key-channel decay of the state is a row scaling of the state tile (WGMMA layout, vector
loaded with ``WGMMA.reduce(1)``; mosaic notes §3). The state is cast to the io dtype once per
chunk into one SMEM tile, the B operand of both ``w S`` and ``qg S``. With ``store_h`` the same loop
writes the state entering each chunk (h) and v_new instead of o: the backward's recomputation.
Padded rows (zero qg, kg, w, u and Aqk rows/columns) leave S unchanged; e^{G_last} must be the
decay at the chunk's last valid row (padded rows repeat it).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _compat as cp
from pallas_kernels._compat import pl, plgpu
from pallas_kernels._tiles import LoopConfig, per_v_block_kernel, store_f32_tile, v_block_coords

CHUNK = 64
f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class ChannelFwdConfig(LoopConfig):
    """Static configuration of :func:`channel_chunk_fwd`: :class:`~pallas_kernels._tiles.LoopConfig`
    (scale, block_v) plus

    Attributes:
      store_h: backward recomputation mode: write h and v_new instead of o and the final state.
    """

    store_h: bool = False

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.store_h, bool):
            raise TypeError(f"{self.store_h=} must be a bool")


def _fwd_body(*refs, cfg: ChannelFwdConfig, nt: int):
    C, BV = CHUNK, cfg.block_v
    store_h = cfg.store_h
    if store_h:
        kg_g, w_g, u_g, dl_g, h0_g, h_g, vn_g = refs
    else:
        qg_g, kg_g, w_g, u_g, aqk_g, dl_g, h0_g, o_g, ht_g = refs
    iv, hv, b, cols = v_block_coords(BV)
    K = kg_g.shape[-1]
    dt = kg_g.dtype
    n_groups = 2 if store_h else 1  # TMA store groups issued per step

    def load_h0(h0_s, bar):
        plgpu.copy_gmem_to_smem(h0_g.at[b, hv, :, cols], h0_s, bar)
        plgpu.barrier_wait(bar)
        return cp.to_wgmma(h0_s[...])

    S0 = pl.run_scoped(load_h0, cp.smem((K, BV), f32), plgpu.Barrier())

    def scoped(s_s, vn_s, o_s):
        def step(idx, *args):
            if store_h:
                kg_s, w_s, u_s, dl_s, S = args
            else:
                qg_s, kg_s, w_s, u_s, aqk_s, dl_s, S = args
            (c,) = idx
            slot = lax.rem(c, 2)
            # the stores issued two steps ago (same slot) must have finished reading SMEM
            plgpu.wait_smem_to_gmem(n_groups, wait_read_only=True)
            s_ref = s_s.at[slot] if store_h else s_s
            vn_ref = vn_s.at[slot] if store_h else vn_s
            s_ref[...] = S.astype(dt)
            plgpu.commit_smem()
            if store_h:
                plgpu.copy_smem_to_gmem(s_ref, h_g.at[b, c, hv, :, cols])
            v_new = u_s[...].astype(f32) - cp.matmul(w_s, s_ref, (C, BV))
            vn_ref[...] = v_new.astype(dt)
            if not store_h:
                o_inter = cp.matmul(qg_s, s_ref, (C, BV))
            plgpu.commit_smem()
            if store_h:
                plgpu.copy_smem_to_gmem(vn_ref, vn_g.at[b, pl.ds(c * C, C), hv, cols])
            else:
                o = (o_inter + cp.matmul(aqk_s, vn_ref, (C, BV))) * cfg.scale
                o_s.at[slot][...] = o.astype(o_g.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_s.at[slot], o_g.at[b, pl.ds(c * C, C), hv, cols])
            decay = cp.bcast_rows(cp.row_vec(dl_s), (K, BV))
            return S * decay + cp.matmul(kg_s.T, vn_ref, (K, BV))

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
        S = plgpu.emit_pipeline(
            step, grid=(nt,), in_specs=specs, max_concurrent_steps=2, init_carry=S0
        )(*ins)
        plgpu.wait_smem_to_gmem(0)
        return S

    nbuf = 2 if store_h else 1
    s_shape = (nbuf, K, BV) if store_h else (K, BV)
    vn_shape = (nbuf, C, BV) if store_h else (C, BV)
    S = pl.run_scoped(
        scoped,
        cp.smem(s_shape, dt),
        cp.smem(vn_shape, dt),
        cp.smem((2, C, BV), dt),
    )
    if not store_h:
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
) -> tuple[jax.Array, jax.Array]:
    """Runs the chunk loop.

    Args:
      qg, kg, w: [B, T, HV, K] (from :func:`pallas_kernels.channel.intra.channel_intra`);
        qg unused/None with ``store_h``. T a multiple of 64.
      u: [B, T, HV, V]; aqk: [B, T, HV, 64] (None with ``store_h``).
      decay_last: [B, HV, T/64, K] f32, e^{G_last} per chunk and key channel.
      h0: [B, HV, K, V] f32 initial state.
      config: :class:`ChannelFwdConfig`.
    Returns:
      Default: (o [B, T, HV, V] in kg.dtype, final state [B, HV, K, V] f32).
      ``store_h``: (h [B, T/64, HV, K, V] in kg.dtype, the state entering each chunk;
      v_new [B, T, HV, V] in kg.dtype).
    """
    B, T, HV, K = kg.shape
    V = u.shape[3]
    if T % CHUNK or V % config.block_v:
        raise ValueError(f"{kg.shape=} {u.shape=}: T % 64 and V % block_v must be 0")
    nt = T // CHUNK
    if config.store_h:
        out_type = (
            jax.ShapeDtypeStruct((B, nt, HV, K, V), kg.dtype),
            jax.ShapeDtypeStruct((B, T, HV, V), kg.dtype),
        )
        ins = (kg, w, u, decay_last, h0)
    else:
        out_type = (
            jax.ShapeDtypeStruct((B, T, HV, V), kg.dtype),
            jax.ShapeDtypeStruct((B, HV, K, V), f32),
        )
        ins = (qg, kg, w, u, aqk, decay_last, h0)

    def body(*refs):
        _fwd_body(*refs, cfg=config, nt=nt)

    fn = per_v_block_kernel(
        body,
        out_type,
        v_blocks=V // config.block_v,
        HV=HV,
        B=B,
        name="chan_chunk_h" if config.store_h else "chan_chunk_fwd",
    )
    return fn(*ins)
