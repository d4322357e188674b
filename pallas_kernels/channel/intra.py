"""Stage 2 of chunked GDN2 / KDA: the intra-chunk WY representation with a decay per key channel.

One CTA (one warpgroup) per (chunk, value head, batch row). Per chunk of C = 64 rows, with G the
chunk-local cumulative log-decay per key channel ([C, K], natural log, f32), b the erase gate and
w_gate the write gate (KDA: b = w_gate = β per token), it computes the stages of
:func:`gdn_jax.reference.chunked.intra_chunk` and the output's intra-chunk matrix:

    L_ij   = Σ_d b_id k_id k_jd e^{G_id − G_jd}   (i > j)          [C, C] f32
    A      = (I + L)⁻¹                     block-doubling inverse
    w      = A (b ⊙ e^{G} ⊙ k)                                     [C, K]
    u      = A (w_gate ⊙ v)                                        [C, V]
    Aqk_ij = Σ_d q_id k_jd e^{G_id − G_jd}   (i ≥ j)               [C, C]
    qg     = q ⊙ e^{G},   kg = k ⊙ e^{G_last − G}                  [C, K]

The decay sits inside the K contraction, so it is factored onto the operands around a reference row
per 16-row sub-chunk I: rows i of I get ``x_i e^{G_i − r_I}`` and columns j ≤ end(I) get
``k_j e^{r_I − G_j}``; one wgmma per sub-chunk accumulates ``L`` (and ``Aqk``), whose row operand
is zero outside I. For columns in earlier sub-chunks the column factor is ≤ 1 (G is non-increasing).
The reference row is the sub-chunk's middle row (row 8), so inside the diagonal 16×16 block every
factor is bounded by e^{8·|g|max}: finite and accurate for per-token log-decays down to −10
(e^{80} < f32/bf16 max); the op clamps log-decays at −10, which covers the required −5 per token
with margin. Products above the diagonal may overflow to inf in the accumulator; they are dropped
with ``where`` (never multiplied by a mask). Exponents of rows or columns a sub-chunk does not use
are masked to 0 *before* ``exp``.

Precision: K-contractions, A and every accumulation in f32; wgmma operands (the factored k, q,
A, the gated v) are 16-bit. Outputs are stored in the io dtype.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _compat as cp
from pallas_kernels import _tiles
from pallas_kernels._compat import pl, plgpu
from pallas_kernels._tiles import chunk_coords, per_chunk_kernel

CHUNK = 64
SUB = 16  # rows per sub-chunk of the decay factoring
NSUB = CHUNK // SUB
MID = SUB // 2  # reference row inside each sub-chunk
f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class ChannelIntraConfig:
    """Static configuration of :func:`channel_intra`.

    Attributes:
      scalar_beta: KDA: the erase and write gates are one β per (token, value head), given as
        [B, HV, T]; otherwise (GDN2) b [B, T, HV, K] and w_gate [B, T, HV, V].
      store_a: also write A (16-bit) for the backward.
    """

    scalar_beta: bool = False
    store_a: bool = False

    def __post_init__(self):
        for name in ("scalar_beta", "store_a"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ChannelIntraConfig.{name}={getattr(self, name)!r} must be a bool")


def _intra_body(*refs, cfg: ChannelIntraConfig, group: int):
    if cfg.scalar_beta:
        q_g, k_g, v_g, G_g, gr_g, gl_g, be_g = refs[:7]
        b_g = wg_g = None
        outs = refs[7:]
    else:
        q_g, k_g, v_g, G_g, gr_g, gl_g, b_g, wg_g = refs[:8]
        be_g = None
        outs = refs[8:]
    qg_g, kg_g, w_g, u_g, aqk_g = outs[:5]
    a_g = outs[5] if cfg.store_a else None
    C = CHUNK
    # GVA: value head hv reads q/k head hk = hv // (HV // H)
    c, hv, b, hk, rows = chunk_coords(group, C)
    K, V = k_g.shape[-1], v_g.shape[-1]
    dt = k_g.dtype
    scalar = cfg.scalar_beta

    def scoped(q_s, k_s, v_s, G_s, gr_s, gl_s, gate_s, a_s, a2_s, c_s, x_s, oy_s, aqk_s, bar):
        b_s, wg_s, be_s = (None, None, gate_s) if scalar else (gate_s[0], gate_s[1], None)
        copies = [
            (q_g.at[b, rows, hk, :], q_s),
            (k_g.at[b, rows, hk, :], k_s),
            (v_g.at[b, rows, hv, :], v_s),
            (G_g.at[b, rows, hv, :], G_s),
            (gr_g.at[b, hv, pl.ds(c * NSUB, NSUB), :], gr_s),
            (gl_g.at[b, hv, c, :], gl_s),
        ]
        if scalar:
            copies.append((be_g.at[b, hv, rows], be_s))
        else:
            copies += [(b_g.at[b, rows, hv, :], b_s), (wg_g.at[b, rows, hv, :], wg_s)]
        # v (index 2) and the write gate (last, GDN2) are needed only for u at the end: their
        # loads overlap L, Aqk and the inverse
        late = (2,) if scalar else (2, len(copies) - 1)
        _tiles.load_tiles(copies, bar, late=late)

        blk = lax.shift_right_logical(cp.iota((C, K), 0), 4)  # sub-chunk of each row

        # Tiles are re-read from SMEM where used rather than kept live in registers: four live
        # [64, 128] f32 tiles would already exhaust the register file.
        def k_f32():
            return cp.load_tile(k_s).astype(f32)

        def bk_f32():  # the erase-gated key (KDA: β is applied to L's rows instead)
            return k_f32() if scalar else cp.load_tile(b_s) * k_f32()

        def by_block(vals):
            """[C, K] tile whose rows in sub-chunk J hold vals[J] (a [K] vector or a scalar),
            zero in sub-chunks past the end of ``vals``."""
            t = 0.0
            for J in reversed(range(len(vals))):
                v = vals[J]
                v = cp.bcast_cols(v, (C, K)) if hasattr(v, "shape") else v
                t = jnp.where(blk == J, v, t)
            return t

        # Row factors e^{G_i − r_J(i)} around the reference row of the row's own sub-chunk J
        # (|exponent| ≤ 8 steps), computed once; sub-chunk I's column factors e^{r_I − G_j}
        # (j ≤ end(I)): one exponent each, never split into a tiny and a huge factor.
        d = cp.load_tile(G_s) - by_block([_tiles.col_vec_row(gr_s, J) for J in range(NSUB)])
        e_row = jnp.exp(d)
        a_s[...] = (bk_f32() * e_row).astype(dt)
        a2_s[...] = (cp.load_tile(q_s).astype(f32) * e_row).astype(dt)

        # L and Aqk: one product per sub-chunk I, keeping rows of I (columns up to I's end)
        rblk = lax.shift_right_logical(cp.iota((C, C), 0), 4)
        L = P = None
        for I in range(NSUB):
            upto = blk <= I
            r_i = cp.bcast_cols(_tiles.col_vec_row(gr_s, I), (C, K))
            expo = jnp.where(upto, r_i - cp.load_tile(G_s), 0.0)  # masked before exp
            c_s[...] = jnp.where(upto, k_f32() * jnp.exp(expo), 0.0).astype(dt)
            plgpu.commit_smem()
            li = cp.matmul(a_s, c_s.T, (C, C))
            pi = cp.matmul(a2_s, c_s.T, (C, C))
            # other rows may hold inf (unbounded factor pairs): select, never multiply by a mask
            L = jnp.where(rblk == I, li, 0.0 if L is None else L)
            P = jnp.where(rblk == I, pi, 0.0 if P is None else P)

        row = cp.iota((C, C), 0)
        col = cp.iota((C, C), 1)
        aqk_s[...] = jnp.where(row >= col, P, 0.0).astype(dt)
        L = jnp.where(row > col, L, 0.0)
        if scalar:
            L = L * cp.bcast_rows(cp.row_vec(be_s), (C, C))
        # qg = q e^{G}, kg = k e^{G_last − G} (factors ≤ 1) and w's right operand b ⊙ e^{G} ⊙ k
        Gt = cp.load_tile(G_s)
        eG = jnp.exp(Gt)
        a2_s[...] = (cp.load_tile(q_s).astype(f32) * eG).astype(dt)
        gl = cp.bcast_cols(cp.col_vec(gl_s, K), (C, K))
        c_s[...] = (k_f32() * jnp.exp(gl - Gt)).astype(dt)
        a_s[...] = (bk_f32() * eG).astype(dt)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(aqk_s, aqk_g.at[b, rows, hv, :])
        plgpu.copy_smem_to_gmem(a2_s, qg_g.at[b, rows, hv, :])
        plgpu.copy_smem_to_gmem(c_s, kg_g.at[b, rows, hv, :])

        X = _tiles.unit_lower_inverse(L, x_s, oy_s, dt)

        if cfg.store_a:
            x_s[...] = X.astype(dt)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(x_s, a_g.at[b, rows, hv, :])
        # w = A (b ⊙ e^G ⊙ k); KDA scales A's columns by β instead of the operand's rows
        if scalar:
            be_c = cp.col_vec(be_s, C)
            oy_s[...] = (X * cp.bcast_cols(be_c, (C, C))).astype(dt)
        else:
            oy_s[...] = X.astype(dt)
        plgpu.commit_smem()
        q_s[...] = cp.matmul(oy_s, a_s, (C, K)).astype(dt)  # q_s is free now
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_s, w_g.at[b, rows, hv, :])
        # u = A (w_gate ⊙ v)
        for i in late:
            plgpu.barrier_wait(bar.at[i])
        if scalar:
            rhs = v_s
        else:
            a_s[...] = (cp.load_tile(wg_s) * cp.load_tile(v_s).astype(f32)).astype(dt)
            plgpu.commit_smem()
            rhs = a_s
        u = cp.matmul(oy_s, rhs, (C, V))
        k_s[...] = u.astype(dt)  # k_s is free now
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(k_s, u_g.at[b, rows, hv, :])
        plgpu.wait_smem_to_gmem(0)

    gate = cp.smem((C,), f32) if scalar else (cp.smem((C, K), f32), cp.smem((C, V), f32))
    n_bar = 7 if scalar else 8
    pl.run_scoped(
        scoped,
        cp.smem((C, K), dt),  # q, later w
        cp.smem((C, K), dt),  # k, later u
        cp.smem((C, V), dt),  # v
        cp.smem((C, K), f32),  # G
        cp.smem((NSUB, K), f32, swizzled=False),  # reference rows
        cp.smem((K,), f32),  # G_last
        gate,
        cp.smem((C, K), dt),  # row operand (L), later the w and u right operands
        cp.smem((C, K), dt),  # row operand (Aqk), later qg
        cp.smem((C, K), dt),  # column operand, later kg
        cp.smem((C, C), dt),
        cp.smem((C, C), dt),
        cp.smem((C, C), dt),  # Aqk
        plgpu.Barrier(num_barriers=n_bar),
    )


def reference_rows(G: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The per-sub-chunk reference rows and the chunk's last row of the gate cumsum.

    Args:
      G: [B, T, HV, K] f32 chunk-local cumulative log-decay, T a multiple of 64.
    Returns:
      gr: [B, HV, T/16, K] f32, G at row 8 of every 16-row sub-chunk;
      gl: [B, HV, T/64, K] f32, G at the last row of every chunk (G_last).
    """
    B, T, HV, K = G.shape
    gr = G.reshape(B, T // SUB, SUB, HV, K)[:, :, MID].transpose(0, 2, 1, 3)
    gl = G.reshape(B, T // CHUNK, CHUNK, HV, K)[:, :, -1].transpose(0, 2, 1, 3)
    return gr, gl


def channel_intra(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    G: jax.Array,
    b: jax.Array,
    w_gate: jax.Array | None,
    config: ChannelIntraConfig = ChannelIntraConfig(),
) -> tuple[jax.Array, ...]:
    """Computes qg, kg, w, u, Aqk (and optionally A) for every chunk.

    Args:
      q, k: [B, T, H, K] bf16/f16, T a multiple of 64; padded rows must be zero.
      v: [B, T, HV, V], same dtype; HV % H == 0; V == K.
      G: [B, T, HV, K] f32 chunk-local cumulative log-decay (padded rows repeat the last value).
      b: GDN2: [B, T, HV, K] f32 erase gate; KDA (``config.scalar_beta``): β [B, HV, T] f32.
        Padded rows zero.
      w_gate: GDN2: [B, T, HV, V] f32 write gate (padded rows zero); KDA: None.
      config: :class:`ChannelIntraConfig`.
    Returns:
      qg [B, T, HV, K] = q e^{G}; kg [B, T, HV, K] = k e^{G_last − G}; w [B, T, HV, K];
      u [B, T, HV, V]; Aqk [B, T, HV, 64] (row t of chunk c holds Aqk[t − 64c, :]); all in
      k.dtype; if ``config.store_a`` also A [B, T, HV, 64] (same row layout).
    """
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    if T % CHUNK:
        raise ValueError(f"{k.shape=}: T must be a multiple of {CHUNK}")
    if V != K:
        raise ValueError(f"{k.shape=} {v.shape=}: the kernel needs V == K")
    if config.scalar_beta != (w_gate is None):
        raise ValueError("w_gate must be None exactly when config.scalar_beta")
    gr, gl = reference_rows(G)
    dt = k.dtype
    out_type = [
        jax.ShapeDtypeStruct((B, T, HV, K), dt),
        jax.ShapeDtypeStruct((B, T, HV, K), dt),
        jax.ShapeDtypeStruct((B, T, HV, K), dt),
        jax.ShapeDtypeStruct((B, T, HV, V), dt),
        jax.ShapeDtypeStruct((B, T, HV, CHUNK), dt),
    ]
    if config.store_a:
        out_type.append(jax.ShapeDtypeStruct((B, T, HV, CHUNK), dt))

    def body(*refs):
        _intra_body(*refs, cfg=config, group=HV // H)

    fn = per_chunk_kernel(body, tuple(out_type), chunks=T // CHUNK, HV=HV, B=B, name="chan_intra")
    ins = (q, k, v, G, gr, gl, b) if config.scalar_beta else (q, k, v, G, gr, gl, b, w_gate)
    return tuple(fn(*ins))
