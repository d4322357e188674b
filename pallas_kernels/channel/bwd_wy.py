"""Channel-decay backward: through the WY representation, one CTA per (chunk, value head).

Forward (:mod:`pallas_kernels.channel.intra`): with bk = b ⊙ k (KDA: β_i k_i),
``w = A (bk ⊙ e^G)``, ``u = A (w_gate ⊙ v)`` (KDA: β_i v_i), ``A = (I + L)⁻¹`` and
``L_ij = Σ_d bk_id k_jd e^{G_id − G_jd}`` (i > j). Given dw (from :mod:`bwd_dqkw`) and
du = dv2 (from :mod:`pallas_kernels.recurrence.bwd_dh`, as two 16-bit terms hi + lo):

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

The decayed products factor the decay around one reference row per 16-row block of the
contracted index (:mod:`bwd_decay`): per product, the factored operand is staged once, as a
16-bit hi/lo pair in two tiles, and each of the four blocks accumulates its 64 × K × 16 wgmmas of
both parts in one accumulator (one exponential and one wait per block; two 64 × 64 × K products'
worth, f16: three, with dL's lo part). dL and the operand live in tiles with a 32-byte swizzle
(:func:`bwd_decay.product_smem`): dL and the operand's hi in tiles of their own, which in the
unsplit form share their space with v and du (a :class:`plgpu.RefUnion`; v and du are read before
dL is staged) and in the K-split form take turns with dA's staging tile in the own K-half pass;
the operand's lo is a view of the dA operand scratch (a RefUnion; dA's products and dv's store
are done with it), so it costs no shared memory.

f16 io (docs/design.md): the decayed "rows"/"cols" products take dL and the factored operand as
bf16 hi/lo pairs (:mod:`bwd_decay`), in four bf16 tiles (dL hi, dL lo, the operand's hi and lo,
the last in the dA operand scratch's space); every other product keeps f16 operands (bk ⊙ e^G
and w_gate ⊙ v are bounded by |bk|, |v| as G ≤ 0); the f32 gradients dA and dA Aᵀ go through
their f16 tile as hi + lo with the f16 A, as for bf16, but scaled per row / column into f16's
range (:func:`_neg_inverse_product`, scaled f16 staging).

Mosaic's SMEM count per CTA when lowering (KDA / GDN2):

- K-split (K = 128): f16 97 408 / 110 744 B at V = 128, 97 384 / 110 712 B at V = 64; bf16
  89 216 / 102 552 B at V = 128, 89 192 / 102 520 B at V = 64: two CTAs per SM;
- unsplit (one CTA per SM), f16 at K = 64: 104 528 / 120 920 B at V = 64, 145 488 / 194 648 B
  at V = 128; at K = 128 it would exceed an SM: NotImplementedError (use k_split). bf16:
  104 528 / 118 872 B at K = V = 64, 145 488 / 192 600 B at K = 64, V = 128, 171 088 / 218 200 B
  at K = 128, V = 64, 187 472 / 218 200 B at K = V = 128.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import _compat as cp
from pallas_kernels._compat import pl, plgpu
from pallas_kernels._tiles import (
    Bars,
    chunk_coords,
    emit_tile,
    load_tiles,
    pair_chunk_coords,
    per_chunk_kernel,
)
from pallas_kernels.channel.bwd_decay import (
    CHUNK,
    HALF,
    NSUB,
    Decay,
    decay_copies,
    decay_smem,
    operand_dtype,
    product_smem,
)
from pallas_kernels.gdn.fake_quant import f16_stage_scales

f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class ChannelBwdWyConfig:
    """Static configuration of :func:`channel_bwd_wy`.

    Attributes:
      scalar_beta: KDA (one β per token and value head, [B, HV, T]); else GDN2 gates.
      k_split: two CTAs per (chunk, value head), each producing one 64-column half of the key-
        side outputs and (V = 128) of the value-side ones (K = 128, V ∈ {64, 128} only): [C, 64]
        register tiles and ≤ 102 552 B of SMEM per CTA (bf16), so two CTAs share an SM (see
        :func:`_split_body`).
    """

    scalar_beta: bool = False
    k_split: bool = False

    def __post_init__(self):
        for name in ("scalar_beta", "k_split"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ChannelBwdWyConfig.{name}={getattr(self, name)!r} must be a bool")


def _neg_inverse_product(dec, m_s, a_s, dA) -> jax.Array:
    """dL = −Aᵀ (dA Aᵀ) [C, C] f32 (the caller keeps its strict lower triangle). dA and dA Aᵀ go
    through the tensor cores as hi + lo (≈ f32) via the 16-bit SMEM tile ``m_s``, so dL is
    rounded to 16 bits once, by the caller (the rounding its two uses share).

    f16 io (``m_s`` f16): dA and dA Aᵀ are f32 gradients, so they are staged with one scale per
    row of dA and per column of dA Aᵀ (the rows / columns its product keeps; docs/design.md), and
    the products are multiplied back in f32."""
    C = dA.shape[0]
    scaled = m_s.dtype == jnp.float16
    if scaled:
        inv, sc = f16_stage_scales(dA, axis=1)
        dA = dA * cp.bcast_rows(inv, (C, C))
    t1 = None
    for part in (0, 1):
        dec.stage(m_s, dA, part)
        t = cp.matmul(m_s, a_s.T, (C, C))
        t1 = t if t1 is None else t1 + t
    if scaled:  # (dA Aᵀ)_jl: dA's row scales, then one scale per column l for −Aᵀ (dA Aᵀ)
        t1 = t1 * cp.bcast_rows(sc, (C, C))
        inv, sc = f16_stage_scales(t1, axis=0)
        t1 = t1 * cp.bcast_cols(inv, (C, C))
    dL = None
    for part in (0, 1):
        dec.stage(m_s, t1, part)
        t = cp.matmul(a_s.T, m_s, (C, C))
        dL = -t if dL is None else dL - t
    if scaled:
        dL = dL * cp.bcast_cols(sc, (C, C))
    return dL


def _wy_refs(refs, scalar: bool) -> tuple:
    """The kernel's GMEM refs by name, None where the variant has none: (k, v, G, gr, gl, β,
    b, w_gate, A, dw, du_hi, du_lo | dk, dv, dG, dβ, db, dw_gate) — KDA has β and dβ, GDN2 b,
    w_gate, db and dw_gate (the order :func:`channel_bwd_wy` passes them in)."""
    if scalar:
        k, v, g, gr, gl, be, a, dw, duh, dul, dk, dv, dg, dbe = refs
        return k, v, g, gr, gl, be, None, None, a, dw, duh, dul, dk, dv, dg, dbe, None, None
    k, v, g, gr, gl, b, wg, a, dw, duh, dul, dk, dv, dg, db, dwg = refs
    return k, v, g, gr, gl, None, b, wg, a, dw, duh, dul, dk, dv, dg, None, db, dwg


def _wy_body(*refs, scalar: bool, group: int):
    (k_g, v_g, g_g, gr_g, gl_g, be_g, b_g, wg_g, a_g, dw_g, duh_g, dul_g,
     dk_g, dv_g, dg_g, dbe_g, db_g, dwg_g) = _wy_refs(refs, scalar)  # fmt: skip
    C = CHUNK
    c, hv, b, hk, rows = chunk_coords(group, C)
    K, V = k_g.shape[-1], v_g.shape[-1]
    dt = k_g.dtype
    scaled = dt == jnp.float16  # f16 io: the decayed products in bf16 hi/lo (bwd_decay)

    def scoped(k_s, g_s, gr_s, gl_s, gate_s, a_s, dw_s, union, x_u, m_s, st_s, vec_s, bar,
               *extra):  # fmt: skip
        # v, du hi, du lo share their space with the tiles of the decayed products (dL, f16:
        # dL lo, and the factored operand's hi), written only once v and du are read
        (v_s, duh_s, dul_s), prod = union
        dl_s, dll_s, ys_s = prod if scaled else (prod[0], None, prod[1])
        # dA's operand scratch, then the factored operand's lo (once dA and dv are done with it)
        x_s, yl_s = x_u
        # [C, V] operand scratch: the [C, K] one when V == K, else its own tile (``extra``)
        xv_s = x_s if V == K else extra[0]
        if scalar:
            be_s, b_s, wg_s = gate_s, None, None
        else:
            be_s, (b_s, wg_s) = None, gate_s
        srcs = [
            (k_g.at[b, rows, hk, :], k_s),
            (v_g.at[b, rows, hv, :], v_s),
            *decay_copies(g_g, gr_g, gl_g, (g_s, gr_s, gl_s), b=b, hv=hv, c=c, rows=rows),
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

        # f32 [C, K] staging: KDA's own tile; GDN2 the write-gate tile once used (when V == K)
        out_s = st_s if scalar else (wg_s if V == K else extra[1])

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
        xv_s[...] = (wgt * vt).astype(dt)
        plgpu.commit_smem()

        dA = dA + cp.matmul_sum(((duh_s, xv_s.T), (dul_s, xv_s.T)), (C, C))

        dwv = cp.matmul_sum(((a_s.T, duh_s), (a_s.T, dul_s)), (C, V))
        dv = dwv * wgt
        dwg = dwv * vt
        if scalar:
            dbe = jnp.sum(dwg, axis=1)
        else:
            emit_tile(dwg, wg_s, dwg_g.at[b, rows, hv, :])  # [C, V]: the used write-gate tile
        xv_s[...] = dv.astype(dt)  # dv leaves in the io dtype, staged in the (free) operand tile
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(xv_s, dv_g.at[b, rows, hv, :])

        dL = _neg_inverse_product(dec, m_s, a_s, dA)  # strict lower part kept below
        row = cp.iota((C, C), 0)
        col = cp.iota((C, C), 1)
        Decay.stage_pair(dl_s, dll_s, jnp.where(row > col, dL, 0.0))  # f16: bf16 hi + lo
        plgpu.commit_smem()

        dkbg = cp.matmul(a_s.T, dw_s, (C, K))
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # dv's store has read x_s (yl_s's space)
        dbk_l = dec.rows(dl_s, k, (ys_s, yl_s), lo_s=dll_s)
        dbk = dkbg * eG + dbk_l
        dG = (dkbg * eG + dbk_l) * bk  # = dkbg ⊙ bk e^G + dbk_L ⊙ bk
        dkl = dec.cols(dl_s, bk, (ys_s, yl_s), lo_s=dll_s)
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
    extra = []  # V != K: the [C, V] operand scratch (and GDN2's [C, K] f32 staging)
    if V != K:
        extra.append(cp.smem((C, V), dt))
        if not scalar:
            extra.append(cp.smem((C, K), f32))
    odt = operand_dtype(dt)  # bf16 (hi/lo pairs) for f16 io
    prod = [product_smem((C, C), odt)]  # dL (hi)
    if scaled:
        prod.append(product_smem((C, C), odt))  # dL lo
    prod.append(product_smem((C, K), odt))  # factored operand (hi)
    pl.run_scoped(
        scoped,
        cp.smem((C, K), dt),  # k
        *decay_smem(C, K),  # G, reference rows, G_last
        gate,  # β, or (b, w_gate)
        cp.smem((C, C), dt),  # A
        cp.smem((C, K), dt),  # dw
        plgpu.RefUnion(
            (cp.smem((C, V), dt), cp.smem((C, V), dt), cp.smem((C, V), dt)),  # v, du hi, du lo
            tuple(prod),
        ),
        # operand scratch of dA (and of dv at V == K), then the factored operand's lo
        plgpu.RefUnion(cp.smem((C, K), dt), product_smem((C, K), odt)),
        cp.smem((C, C), dt),  # dA, dA Aᵀ (hi, lo)
        cp.smem((C, K), f32) if scalar else cp.smem((8,), f32),  # f32 staging (KDA)
        cp.smem((C,), f32),  # dβ (KDA)
        plgpu.Barrier(num_barriers=n_bar),
        *extra,
    )


# ------------------------------------------------------------------------------------------------
# K-split form: two CTAs per (chunk, value head, batch row), each owning one 64-column half.


def _split_body(*refs, scalar: bool, group: int):
    """One CTA per (chunk, value head, K-half): grid axis "h" runs over 2·HV, h = 2 hv + kh.

    Each CTA forms the whole [C, C] dA (a contraction over all of K and V, done in 64-column
    passes), hence dL, and then only the K-half ``kh`` of dk, dG, db and the V-half ``kh`` of
    dv, dw_gate (KDA: a partial dβ over both halves, summed by the launcher). The passes run in
    four nested SMEM scopes, so the SMEM of a pass is reused by the next one:

        1. other V-half:  dA += du (w_gate ⊙ v)ᵀ
        2. own V-half:    dA += du (w_gate ⊙ v)ᵀ;  dwv = Aᵀ du → dv, dw_gate (partial dβ)
        3. other K-half:  dA += dw (bk ⊙ e^G)ᵀ
        4. own K-half:    dA += dw (bk ⊙ e^G)ᵀ;  dL;  dk, dG, db (partial dβ)

    At V = 64 there is no V-half to share: passes 1 and 2 become one pass over all of V in both
    CTAs (dA needs it whole), and only the CTA of K-half 0 writes dv, dw_gate (and counts their
    part of dβ); the other forms dwv = Aᵀ du ([C, 64], one wgmma) and drops it, rather than
    branch around the pass's shared code. SMEM: pass 1, 2's scope is the same size, so the peak
    is as at V = 128.

    Every register tile is [C, 64] f32 (32 registers a thread). SMEM bytes per CTA, bf16 io,
    GDN2 / KDA (a KDA-only or GDN2-only buffer is a 32-byte placeholder in the other variant):

        persistent  A 8192, operand scratch (then the factored operand's lo) 8192,
                    dβ 256, β 256 (KDA),
                    barriers 19 / 16 × 8                                 16 824 / 17 024
        pass 1, 2   du hi 8192, du lo 8192, v 8192, w_gate 16384 (GDN2) 40 960 / 24 608
        pass 3      k 8192, G 16384, b 16384 (GDN2), dw 8192, 3 placeholders 96
                                                                         49 248 / 32 896
        pass 4      k, G, b, dw as pass 3, reference rows 1024, G_last 256,
                    f32 staging 16384                                    66 816 / 50 464
          then      dA's staging 8192, then dL 8192 + factored operand hi 8192
                    (32-byte swizzle)                                    16 384

    Peak (persistent + pass 4): 100 024 B (GDN2) / 83 872 B (KDA); Mosaic's count with its
    alignment: 102 552 B / 89 216 B, so two CTAs share an SM (228 KiB).

    f16 io: dA's f16 staging tile (8 KiB) and then dL hi, dL lo and the bf16 operand's hi
    (24 KiB) take turns in pass 4 (Mosaic's count 110 744 B GDN2, 97 408 B KDA).
    """
    (k_g, v_g, g_g, gr_g, gl_g, be_g, b_g, wg_g, a_g, dw_g, duh_g, dul_g,
     dk_g, dv_g, dg_g, dbe_g, db_g, dwg_g) = _wy_refs(refs, scalar)  # fmt: skip
    C, H2 = CHUNK, HALF
    c, hv, kh, b, hk, rows = pair_chunk_coords(group, C)
    own = pl.ds(kh * H2, H2)  # this CTA's K-half (and V-half at V = 128) of the columns
    other = pl.ds((1 - kh) * H2, H2)
    V = v_g.shape[-1]
    dt = k_g.dtype
    scaled = dt == jnp.float16  # f16 io: the decayed products in bf16 hi/lo (bwd_decay)
    odt = operand_dtype(dt)

    def outer(a_s, x_u, vec_s, be_s, bar):
        # the operand scratch of the dA products and dv, then (own K-half's tail) the factored
        # operand's lo: every earlier use has waited for its readers (wgmma, the dv store)
        x_s, yl_s = x_u
        bars = Bars(bar)
        # A is first needed in pass 2: its load overlaps pass 1
        (a_id,) = bars.load([(a_g.at[b, rows, hv, :], a_s)], wait=False)
        if scalar:
            bars.load([(be_g.at[b, hv, rows], be_s)])

        def beta_tile():
            return cp.bcast_rows(cp.row_vec(be_s), (C, H2))

        def half_copies(cols, *loads):
            """TMA copies of the [C, 64] tiles ``cols`` of this chunk: ``loads`` are (GMEM ref,
            head, SMEM tile); refs the variant lacks (None: KDA's b, w_gate) are skipped."""
            return [(g.at[b, rows, h, cols], s_) for g, h, s_ in loads if g is not None]

        def v_pass(cols, is_own: bool, dA, lead=None):
            """dA + du[:, cols] (w_gate ⊙ v)[:, cols]ᵀ; own half: also dv, dw_gate (dβ part),
            written (and counted in dβ) only where ``lead`` holds (V = 64: both CTAs form the
            whole V range, the first K-half's writes it; None: always)."""

            def scoped(duh_s, dul_s, v_s, wg_s):
                bars.load(
                    half_copies(cols, (duh_g, hv, duh_s), (dul_g, hv, dul_s), (v_g, hv, v_s),
                                (wg_g, hv, wg_s))
                )  # fmt: skip
                vt = cp.load_tile(v_s).astype(f32)
                wgt = beta_tile() if scalar else cp.load_tile(wg_s)
                x_s[...] = (wgt * vt).astype(dt)
                plgpu.commit_smem()

                part = cp.matmul_sum(((duh_s, x_s.T), (dul_s, x_s.T)), (C, C))
                dA_out = part if dA is None else dA + part
                if not is_own:
                    return dA_out, None
                bars.wait([a_id])

                dwv = cp.matmul_sum(((a_s.T, duh_s), (a_s.T, dul_s)), (C, H2))
                dwg = dwv * vt
                dbe = None
                if scalar:
                    dbe = jnp.sum(dwg, axis=1)
                    if lead is not None:  # (a scalar factor: no implicit broadcast in where)
                        dbe = dbe * jnp.where(lead, 1.0, 0.0)

                def emit():
                    if not scalar:  # the write-gate tile is in registers: it stages dw_gate
                        emit_tile(dwg, wg_s, dwg_g.at[b, rows, hv, cols])
                    # dv leaves in the io dtype through the operand scratch (du_mm has read it)
                    emit_tile((dwv * wgt).astype(dt), x_s, dv_g.at[b, rows, hv, cols])

                if lead is None:
                    emit()
                else:
                    pl.when(lead)(emit)
                return dA_out, dbe

            return pl.run_scoped(
                scoped,
                cp.smem((C, H2), dt),  # du hi
                cp.smem((C, H2), dt),  # du lo
                cp.smem((C, H2), dt),  # v
                cp.smem((8,), f32) if scalar else cp.smem((C, H2), f32),  # w_gate (GDN2)
            )

        def k_pass(cols, is_own: bool, dA, dbe):
            """dA + dw[:, cols] (bk ⊙ e^G)[:, cols]ᵀ; own half: then dL, dk, dG, db (dβ)."""

            def scoped(k_s, g_s, b_s, dw_s, gr_s, gl_s, st_s):
                srcs = half_copies(
                    cols, (k_g, hk, k_s), (g_g, hv, g_s), (dw_g, hv, dw_s), (b_g, hv, b_s)
                )
                if is_own:
                    srcs += [
                        (gr_g.at[b, hv, pl.ds(c * NSUB, NSUB), cols], gr_s),
                        (gl_g.at[b, hv, c, cols], gl_s),
                    ]
                bars.load(srcs)
                k = cp.load_tile(k_s).astype(f32)
                gate = beta_tile() if scalar else cp.load_tile(b_s)
                bk = gate * k
                eG = jnp.exp(cp.load_tile(g_s))
                x_s[...] = (bk * eG).astype(dt)
                plgpu.commit_smem()
                dA_out = dA + cp.matmul(dw_s, x_s.T, (C, C))
                if not is_own:
                    return dA_out

                def tail(dl_s, dll_s, ys_s, dL):
                    """dk, dG, db (dβ) of the own half from dL ([C, C] f32 registers), staged
                    to ``dl_s`` (+ ``dll_s``: f16's bf16 lo); ``ys_s``: the factored-operand
                    scratch [C, 64]."""
                    # built here: no live masks before
                    lower = cp.iota((C, C), 0) > cp.iota((C, C), 1)
                    Decay.stage_pair(dl_s, dll_s, jnp.where(lower, dL, 0.0))
                    plgpu.commit_smem()

                    # The tail keeps few [C, 64] tiles live (no spills): dkL is formed first and
                    # parked in the f32 staging tile while dbk is formed; k, the gate and e^G are
                    # reloaded from SMEM where needed instead of being held across the products.
                    def gate_tile():
                        return beta_tile() if scalar else cp.load_tile(b_s)

                    def k_tile():
                        return cp.load_tile(k_s).astype(f32)

                    with jax.named_scope("dk cols"):
                        dkl = dec.cols(dl_s, gate_tile() * k_tile(), (ys_s, yl_s), lo_s=dll_s)
                        st_s[...] = dkl  # read back below by the same threads, same layout
                        plgpu.commit_smem()
                    with jax.named_scope("dbk rows"):
                        dbk = dec.rows(dl_s, k_tile(), (ys_s, yl_s), lo_s=dll_s)
                        dbk = dbk + cp.matmul(a_s.T, dw_s, (C, H2)) * jnp.exp(cp.load_tile(g_s))
                    dkl = cp.load_tile(st_s)
                    k = k_tile()
                    gate = gate_tile()
                    emit_tile(dbk * (gate * k) - dkl * k, st_s, dg_g.at[b, rows, hv, cols])
                    dbk_k = dbk * k
                    if scalar:
                        dbe_out = dbe + jnp.sum(dbk_k, axis=1)
                        vec_s[...] = dbe_out
                        plgpu.commit_smem()
                        # partial dβ of this half: row 2 hv + kh, summed over kh by the wrapper
                        plgpu.copy_smem_to_gmem(vec_s, dbe_g.at[b, 2 * hv + kh, rows])
                    else:
                        emit_tile(dbk_k, st_s, db_g.at[b, rows, hv, cols])
                    emit_tile(dbk * gate + dkl, st_s, dk_g.at[b, rows, hv, cols])
                    plgpu.wait_smem_to_gmem(0)

                # dL = −Aᵀ (dA Aᵀ), strict lower, through the tensor cores as hi + lo (as unsplit)
                dec = Decay(g_s, gr_s, gl_s, dt)  # [C, 64]: the decays of this K-half only
                # dA's staging tile, then the decayed products' tiles (dL, f16: dL lo, and the
                # factored operand) take turns in one space (the SMEM of two CTAs per SM)
                with jax.named_scope("dL"):
                    dL = pl.run_scoped(
                        lambda m_s: _neg_inverse_product(dec, m_s, a_s, dA_out),
                        cp.smem((C, C), dt),
                    )
                pl.run_scoped(
                    lambda dl_s, dll_s, ys_s: tail(dl_s, dll_s, ys_s, dL),
                    product_smem((C, C), odt),  # dL (hi)
                    product_smem((C, C), odt) if scaled else None,  # dL lo (f16)
                    product_smem((C, H2), odt),  # factored operand (hi; lo: yl_s)
                )
                return dA_out

            return pl.run_scoped(
                scoped,
                cp.smem((C, H2), dt),  # k
                cp.smem((C, H2), f32),  # G
                cp.smem((8,), f32) if scalar else cp.smem((C, H2), f32),  # b (GDN2)
                cp.smem((C, H2), dt),  # dw
                cp.smem((NSUB, H2) if is_own else (8,), f32, swizzled=False),  # reference rows
                cp.smem((H2,) if is_own else (8,), f32),  # G_last
                cp.smem((C, H2) if is_own else (8,), f32),  # f32 output staging
            )

        if V == 2 * H2:  # each CTA writes one V-half of dv, dw_gate
            with jax.named_scope("v pass other"):
                dA, _ = v_pass(other, False, None)
            with jax.named_scope("v pass own"):
                dA, dbe = v_pass(own, True, dA)
        else:  # V = 64: one pass over all of V in both CTAs; the first K-half's writes dv, dw_gate
            with jax.named_scope("v pass own"):
                dA, dbe = v_pass(pl.ds(0, H2), True, None, lead=kh == 0)
        with jax.named_scope("k pass other"):
            dA = k_pass(other, False, dA, None)
        with jax.named_scope("k pass own"):
            k_pass(own, True, dA, dbe)

    # one barrier per load: A, β (KDA), per V pass du hi/lo, v (and w_gate), per K pass k, G, dw
    # (and b), and the own K-half's reference rows and G_last
    n_bar = 1 + (1 if scalar else 0) + (V // H2) * (3 if scalar else 4)
    n_bar += (3 if scalar else 4) * 2 + 2
    pl.run_scoped(
        outer,
        cp.smem((C, C), dt),  # A
        # operand scratch (dA operands, dv), then the factored operand's lo
        plgpu.RefUnion(cp.smem((C, H2), dt), product_smem((C, H2), odt)),
        cp.smem((C,), f32),  # dβ (KDA)
        cp.smem((C,) if scalar else (8,), f32),  # β (KDA)
        plgpu.Barrier(num_barriers=n_bar),
    )


def channel_bwd_wy(k, v, g_cum, gr, gl, b, w_gate, A, dw, du_hi, du_lo, config):
    """Gradients through the WY representation and A = (I + L)⁻¹ for every chunk.

    Args:
      k: [B, T, H, K]; v: [B, T, HV, V]; A: [B, T, HV, 64]; dw: [B, T, HV, K];
        du_hi, du_lo: [B, T, HV, V] (all io dtype). K, V ∈ {64, 128}, T % 64 == 0.
      g_cum: [B, T, HV, K] f32; gr, gl: reference rows / G_last (see :mod:`bwd_dqkw`).
      b: GDN2: [B, T, HV, K] f32 erase gate; KDA (``config.scalar_beta``): β [B, HV, T] f32.
      w_gate: GDN2: [B, T, HV, V] f32; KDA: None.
      config: :class:`ChannelBwdWyConfig`; ``k_split`` needs K = 128, V ∈ {64, 128} (else
        NotImplementedError: at K = 64 the unsplit kernel already has [C, 64] tiles).
    Returns:
      GDN2: dk [B, T, HV, K] f32 (per value head), dv [B, T, HV, V] io dtype, dG [B, T, HV, K] f32,
      db [B, T, HV, K] f32, dw_gate [B, T, HV, V] f32.
      KDA: dk, dv, dG as above and dβ [B, HV, T] f32.
    """
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
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

    if config.k_split:
        if K != 2 * HALF or V not in (HALF, 2 * HALF):
            raise NotImplementedError(
                f"{k.shape=} {v.shape=}: the k_split channel_bwd_wy needs K = 128, V ∈ {{64, 128}}"
            )
        if config.scalar_beta:  # a partial dβ per (value head, K-half): row 2 hv + kh
            out_type[3] = S((B, 2 * HV, T), f32)

        def split_body(*refs):
            _split_body(*refs, scalar=config.scalar_beta, group=HV // H)

        fn = per_chunk_kernel(
            split_body, tuple(out_type), chunks=T // CHUNK, HV=HV, B=B, name="chan_bwd_wy",
            pair=True,
        )  # fmt: skip
        outs = tuple(fn(*ins))
        if config.scalar_beta:
            outs = outs[:3] + (outs[3].reshape(B, HV, 2, T).sum(axis=2),)
        return outs

    if k.dtype == jnp.float16 and K != HALF:
        # the unsplit form with the f16 form's bf16 dL hi/lo and operand tiles: over an SM's
        # shared memory at K = 128 (bf16 already needs 211 KiB there)
        raise NotImplementedError(
            f"{k.shape=}: f16 channel_bwd_wy at K = {K} needs k_split=True (the unsplit form "
            "exceeds the shared memory with the f16 staging tiles)"
        )

    def body(*refs):
        _wy_body(*refs, scalar=config.scalar_beta, group=HV // H)

    fn = per_chunk_kernel(body, tuple(out_type), chunks=T // CHUNK, HV=HV, B=B, name="chan_bwd_wy")
    return tuple(fn(*ins))
