"""Channel-decay backward: through the WY representation, one CTA per (chunk, value head).

Forward (:mod:`pallas_kernels.channel.intra`): with bk = b ⊙ k (KDA: β_i k_i),
``w = A (bk ⊙ e^G)``, ``u = A (w_gate ⊙ v)`` (KDA: β_i v_i), ``A = (I + L)⁻¹`` and
``L_ij = Σ_d bk_id k_jd e^{G_id − G_jd}`` (i > j). Given dw (from :mod:`bwd_dqkw`) and
du = dv2 (from :mod:`bwd_dh`, as two 16-bit terms hi + lo):

    dA    = dw (bk ⊙ e^G)ᵀ + du (w_gate ⊙ v)ᵀ
    dkbg  = Aᵀ dw,   dwv = Aᵀ du
    dv    = w_gate ⊙ dwv,   dw_gate = v ⊙ dwv
    dL    = −Aᵀ dA Aᵀ on the strict lower triangle
    dbk   = e^G ⊙ dkbg + Σ_j dL_ij (k_j ⊙ D_ij)          (decayed "rows" product, :mod:`bwd_decay`)
    dkL   = Σ_i dL_ij (bk_i ⊙ D_ij)                       (decayed "cols" product)
    dk    = b ⊙ dbk + dkL,   db = k ⊙ dbk
    dG    = dbk ⊙ bk − dkL ⊙ k

with D_ij = e^{G_id − G_jd}. GDN2 writes db [C, K] and dw_gate [C, V] per element; KDA writes
dβ = Σ_d db + Σ_v dw_gate per row.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import _compat as cp
from pallas_kernels._compat import pl, plgpu
from pallas_kernels._tiles import chunk_coords, emit_tile, load_tiles, per_chunk_kernel
from pallas_kernels.channel.bwd_decay import CHUNK, NSUB, Decay, slice_smem

f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class ChannelBwdWyConfig:
    """Static configuration of :func:`channel_bwd_wy`.

    Attributes:
      scalar_beta: KDA (one β per token and value head, [B, HV, T]); else GDN2 gates.
      sliced: form the decayed "cols" product with 16-deep contractions over sub-chunk slices.
    """

    scalar_beta: bool = False
    sliced: bool = False

    def __post_init__(self):
        for name in ("scalar_beta", "sliced"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ChannelBwdWyConfig.{name}={getattr(self, name)!r} must be a bool")


def _wy_body(*refs, scalar: bool, group: int, sliced: bool):
    if scalar:
        k_g, v_g, g_g, gr_g, gl_g, be_g, a_g, dw_g, duh_g, dul_g = refs[:10]
        dk_g, dv_g, dg_g, dbe_g = refs[10:]
        b_g = wg_g = None
    else:
        k_g, v_g, g_g, gr_g, gl_g, b_g, wg_g, a_g, dw_g, duh_g, dul_g = refs[:11]
        dk_g, dv_g, dg_g, db_g, dwg_g = refs[11:]
        be_g = None
    C = CHUNK
    c, hv, b, hk, rows = chunk_coords(group, C)
    K, V = k_g.shape[-1], v_g.shape[-1]
    dt = k_g.dtype

    def scoped(k_s, v_s, g_s, gr_s, gl_s, gate_s, a_s, dw_s, duh_s, dul_s, x_s, m_s, st_s,
               vec_s, bar):  # fmt: skip
        if scalar:
            be_s, b_s, wg_s = gate_s, None, None
        else:
            be_s, (b_s, wg_s) = None, gate_s
        srcs = [
            (k_g.at[b, rows, hk, :], k_s),
            (v_g.at[b, rows, hv, :], v_s),
            (g_g.at[b, rows, hv, :], g_s),
            (gr_g.at[b, hv, pl.ds(c * NSUB, NSUB), :], gr_s),
            (gl_g.at[b, hv, c, :], gl_s),
            (a_g.at[b, rows, hv, :], a_s),
            (dw_g.at[b, rows, hv, :], dw_s),
            (duh_g.at[b, rows, hv, :], duh_s),
            (dul_g.at[b, rows, hv, :], dul_s),
        ]
        if scalar:
            srcs.append((be_g.at[b, hv, rows], be_s))
        else:
            srcs += [(b_g.at[b, rows, hv, :], b_s), (wg_g.at[b, rows, hv, :], wg_s)]
        load_tiles(srcs, bar)

        out_s = st_s if scalar else wg_s  # f32 staging (GDN2: the write-gate tile once used)

        dec = Decay(g_s, gr_s, gl_s, dt)
        k = cp.load_tile(k_s).astype(f32)
        if scalar:
            bk = k * cp.bcast_rows(cp.row_vec(be_s), (C, K))
        else:
            bk = cp.load_tile(b_s) * k
        eG = jnp.exp(dec.G())

        # dA = dw (bk e^G)ᵀ + du (w_gate v)ᵀ, the two products staged through one tile
        x_s[...] = (bk * eG).astype(dt)
        plgpu.commit_smem()
        dA = cp.matmul(dw_s, x_s.T, (C, C))
        vt = cp.load_tile(v_s).astype(f32)
        if scalar:
            wgt = cp.bcast_rows(cp.row_vec(be_s), (C, V))
        else:
            wgt = cp.load_tile(wg_s)
        x_s[...] = (wgt * vt).astype(dt)
        plgpu.commit_smem()

        def du_mm(acc):
            plgpu.wgmma(acc, duh_s, x_s.T)
            plgpu.wgmma(acc, dul_s, x_s.T)
            plgpu.wgmma_wait(0)
            return acc[...]

        dA = dA + pl.run_scoped(du_mm, plgpu.ACC((C, C), f32))

        def dwv_mm(acc):
            plgpu.wgmma(acc, a_s.T, duh_s)
            plgpu.wgmma(acc, a_s.T, dul_s)
            plgpu.wgmma_wait(0)
            return acc[...]

        dwv = pl.run_scoped(dwv_mm, plgpu.ACC((C, V), f32))
        dv = dwv * wgt
        dwg = dwv * vt
        if scalar:
            dbe = jnp.sum(dwg, axis=1)
        else:
            emit_tile(dwg, out_s, dwg_g.at[b, rows, hv, :])
        x_s[...] = dv.astype(dt)  # dv leaves in the io dtype, staged in the (free) operand tile
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(x_s, dv_g.at[b, rows, hv, :])

        # dL = −Aᵀ (dA Aᵀ), strict lower: dA and dA Aᵀ go through the tensor cores as hi + lo
        # (≈ f32), so dL is rounded to 16 bits once (the rounding its two uses share)
        t1 = None
        for part in (0, 1):
            dec.stage(m_s, dA, part)
            t = cp.matmul(m_s, a_s.T, (C, C))
            t1 = t if t1 is None else t1 + t
        dL = None
        for part in (0, 1):
            dec.stage(m_s, t1, part)
            t = cp.matmul(a_s.T, m_s, (C, C))
            dL = -t if dL is None else dL - t
        row = cp.iota((C, C), 0)
        col = cp.iota((C, C), 1)
        m_s[...] = jnp.where(row > col, dL, 0.0).astype(dt)
        plgpu.commit_smem()

        dkbg = cp.matmul(a_s.T, dw_s, (C, K))
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the dv store has read x_s
        dbk_l = dec.rows(m_s, k, x_s)
        dbk = dkbg * eG + dbk_l
        dG = (dkbg * eG + dbk_l) * bk  # = dkbg ⊙ bk e^G + dbk_L ⊙ bk
        dkl = dec.cols(m_s, bk, x_s, sliced=sliced)
        dG = dG - dkl * k
        emit_tile(dG, out_s, dg_g.at[b, rows, hv, :])
        dbk_k = dbk * k
        if scalar:
            dbe = dbe + jnp.sum(dbk_k, axis=1)
            dk = dbk * cp.bcast_rows(cp.row_vec(be_s), (C, K)) + dkl
        else:
            emit_tile(dbk_k, out_s, db_g.at[b, rows, hv, :])
            dk = dbk * cp.load_tile(b_s) + dkl
        emit_tile(dk, out_s, dk_g.at[b, rows, hv, :])
        if scalar:
            vec_s[...] = dbe
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(vec_s, dbe_g.at[b, hv, rows])
        plgpu.wait_smem_to_gmem(0)

    if scalar:
        gate = cp.smem((C,), f32)
        n_bar = 10
    else:
        gate = (cp.smem((C, K), f32), cp.smem((C, V), f32))
        n_bar = 11
    pl.run_scoped(
        scoped,
        cp.smem((C, K), dt),  # k
        cp.smem((C, V), dt),  # v
        cp.smem((C, K), f32),  # G
        cp.smem((NSUB, K), f32, swizzled=False),  # reference rows
        cp.smem((K,), f32),  # G_last
        gate,  # β, or (b, w_gate)
        # the wgmma operands share one swizzle (32 bytes when sliced: 16-row slices of the
        # operand scratch and of dL feed 16-deep contractions)
        slice_smem((C, C), dt, sliced),  # A
        slice_smem((C, K), dt, sliced),  # dw
        slice_smem((C, V), dt, sliced),  # du hi
        slice_smem((C, V), dt, sliced),  # du lo
        slice_smem((C, K), dt, sliced),  # operand scratch
        slice_smem((C, C), dt, sliced),  # dA, dA Aᵀ (hi, lo), then dL
        cp.smem((C, K), f32) if scalar else cp.smem((8,), f32),  # f32 staging (KDA)
        cp.smem((C,), f32),  # dβ (KDA)
        plgpu.Barrier(num_barriers=n_bar),
    )


def channel_bwd_wy(k, v, g_cum, gr, gl, b, w_gate, A, dw, du_hi, du_lo, config):
    """Gradients through the WY representation and A = (I + L)⁻¹ for every chunk.

    Args:
      k: [B, T, H, K]; v: [B, T, HV, V]; A: [B, T, HV, 64]; dw: [B, T, HV, K];
        du_hi, du_lo: [B, T, HV, V] (all io dtype). K == V, T % 64 == 0.
      g_cum: [B, T, HV, K] f32; gr, gl: reference rows / G_last (see :mod:`bwd_dqkw`).
      b: GDN2: [B, T, HV, K] f32 erase gate; KDA (``config.scalar_beta``): β [B, HV, T] f32.
      w_gate: GDN2: [B, T, HV, V] f32; KDA: None.
      config: :class:`ChannelBwdWyConfig`.
    Returns:
      GDN2: dk [B, T, HV, K] f32 (per value head), dv [B, T, HV, V] io dtype, dG [B, T, HV, K] f32,
      db [B, T, HV, K] f32, dw_gate [B, T, HV, V] f32.
      KDA: dk, dv, dG as above and dβ [B, HV, T] f32.
    """
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    if K != V:
        raise NotImplementedError(f"{k.shape=} {v.shape=}: channel_bwd_wy needs K == V")
    if config.scalar_beta != (w_gate is None):
        raise ValueError("w_gate must be None exactly when config.scalar_beta")
    S = jax.ShapeDtypeStruct
    out_type = [S((B, T, HV, K), f32), S((B, T, HV, V), k.dtype), S((B, T, HV, K), f32)]
    if config.scalar_beta:
        out_type.append(S((B, HV, T), f32))
        ins = (k, v, g_cum, gr, gl, b, A, dw, du_hi, du_lo)
    else:
        out_type += [S((B, T, HV, K), f32), S((B, T, HV, V), f32)]
        ins = (k, v, g_cum, gr, gl, b, w_gate, A, dw, du_hi, du_lo)

    def body(*refs):
        _wy_body(*refs, scalar=config.scalar_beta, group=HV // H, sliced=config.sliced)

    fn = per_chunk_kernel(body, tuple(out_type), chunks=T // CHUNK, HV=HV, B=B, name="chan_bwd_wy")
    return tuple(fn(*ins))
