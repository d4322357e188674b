"""Stage 2 of chunked GDN: the intra-chunk WY representation, one CTA per (chunk, value head).

Per chunk of C = 64 rows (G = chunk-local cumulative log-decay, natural log):

    L = strict_tril(β_i (k_i · k_j) e^{G_i − G_j})      [C, C], f32
    A = (I + L)⁻¹         block-doubling inverse (never the product form)
    w = A diag(β e^G) k                                  [C, K]
    u = A diag(β) v                                      [C, V]

The inverse uses the doubling rule ``X ← X − X (O_s X)`` for s = 1, 2, …, 32, where O_s is L
restricted to the lower-left s×s block of each 2s×2s diagonal block: every intermediate is a block
of the true inverse, so magnitudes stay bounded (the product form (I−L)(I+L²)… is unstable).
K Kᵀ, L and X are f32 in registers; only wgmma operands are 16-bit. w and u are staged for their
stores in k's and v's own tiles (their products are the last reads of k and v), so a CTA holds
k, v, two [C, C] tiles and the gates: about 49 KB at K = V = 128 (16-bit io), four CTAs per SM.

The kernel reads the op's raw k and v: it replaces their non-finite values by 0 as it loads them
and flags them (the op's poison, :mod:`gdn_jax.ops._sanitize`): k's rows holding one (a row
reduction in registers) and v's first such row per value column (a product that counts each
column's bad rows, :func:`pallas_kernels._tiles.first_bad_rows`), in the inverse's
scratch tiles and u's staging tile before they take their own values.
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
    chunk_coords,
    finite,
    first_bad_rows,
    nonfinite,
    per_chunk_kernel,
)
from pallas_kernels.gdn.fake_quant import W_QUANT, fake_quant_e4m3


@dataclasses.dataclass(frozen=True)
class IntraConfig:
    """Static configuration of :func:`intra_chunk`.

    Attributes:
      store_a: also write A (16-bit) for the backward.
      w_quant: QAT fake quantisation (FP8-E4M3, dynamic scale) of w before it is stored:
        ``None`` (off), ``"row"`` (one scale per token row, amax over K) or ``"tile"`` (one per
        chunk and head, amax over the [64, K] tile).
    """

    store_a: bool = False
    w_quant: str | None = None

    def __post_init__(self):
        if not isinstance(self.store_a, bool):
            raise TypeError(f"{self.store_a=} must be a bool")
        if self.w_quant is not None and self.w_quant not in W_QUANT:
            raise ValueError(f"{self.w_quant=} must be None or one of {tuple(W_QUANT)}")


def _intra_body(k_g, v_g, g_g, b_g, *outs, group: int, store_a: bool, w_quant: str | None):
    w_g, u_g = outs[0], outs[1]
    a_g = outs[2] if store_a else None
    kbad_g, vfirst_g = outs[-2:]
    C = CHUNK
    # GVA: value head hv reads q/k head hk = hv // (HV // H)
    c, hv, b, hk, rows = chunk_coords(group, C)
    K, V = k_g.shape[-1], v_g.shape[-1]
    dt = k_g.dtype

    def scoped(k_s, v_s, g_s, be_s, x_s, oy_s, kf_s, vf_s, bar):
        plgpu.copy_gmem_to_smem(k_g.at[b, rows, hk, :], k_s, bar.at[0])
        plgpu.copy_gmem_to_smem(v_g.at[b, rows, hv, :], v_s, bar.at[1])
        plgpu.copy_gmem_to_smem(g_g.at[b, hv, rows], g_s, bar.at[2])
        plgpu.copy_gmem_to_smem(b_g.at[b, hv, rows], be_s, bar.at[3])
        for i in range(4):
            plgpu.barrier_wait(bar.at[i])
        # the op's raw k and v: non-finite values read as 0 (the sanitation's replacement) and
        # flagged: k's bad rows, v's first bad row per column (its 0/1 tile in v's own tile
        # while the raw values wait in registers, U[r, s] = (r <= s) in the inverse's scratch)
        k_raw = cp.load_tile(k_s).astype(jnp.float32)
        kf_s[...] = jnp.max(nonfinite(k_raw), axis=1)
        k_s[...] = finite(k_raw).astype(dt)
        v_raw = cp.load_tile(v_s).astype(jnp.float32)
        v_s[...] = nonfinite(v_raw).astype(dt)
        upper = cp.iota((C, C), 0) <= cp.iota((C, C), 1)
        oy_s[...] = jnp.where(upper, 1.0, 0.0).astype(dt)
        plgpu.commit_smem()
        vf_s[...] = first_bad_rows(v_s, oy_s)
        v_s[...] = finite(v_raw).astype(dt)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(kf_s, kbad_g.at[b, hv, rows])
        plgpu.copy_smem_to_gmem(vf_s, vfirst_g.at[b, hv, c, :])

        row = cp.iota((C, C), 0)
        col = cp.iota((C, C), 1)
        lower = row > col
        g_r = cp.row_vec(g_s)
        g_c = cp.col_vec(g_s, C)
        be_r = cp.row_vec(be_s)
        be_c = cp.col_vec(be_s, C)

        kk = cp.matmul(k_s, k_s.T, (C, C))
        # mask the exponent first: above the diagonal G_i − G_j > 0 could overflow
        gd = cp.bcast_rows(g_r, (C, C)) - cp.bcast_cols(g_c, (C, C))
        L = jnp.where(
            lower, kk * cp.bcast_rows(be_r, (C, C)) * jnp.exp(jnp.where(lower, gd, 0.0)), 0.0
        )

        def level_mask(lg):
            hi = lax.shift_right_logical(row, lg + 1) == lax.shift_right_logical(col, lg + 1)
            lo = lax.shift_right_logical(row, lg) != lax.shift_right_logical(col, lg)
            return hi & lo

        eye = jnp.where(row == col, 1.0, 0.0)
        # level s = 1: X_1 = I, so X_2 = I − O_1
        X = eye - jnp.where(level_mask(0), L, 0.0)
        for lg in range(1, 6):
            oy_s[...] = jnp.where(level_mask(lg), L, 0.0).astype(dt)
            x_s[...] = X.astype(dt)
            plgpu.commit_smem()
            Y = cp.matmul(oy_s, x_s, (C, C))  # O_s X_s
            oy_s[...] = Y.astype(dt)
            plgpu.commit_smem()
            X = X - cp.matmul(x_s, oy_s, (C, C))  # X_s (O_s X_s)

        if store_a:
            x_s[...] = X.astype(dt)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(x_s, a_g.at[b, rows, hv, :])
        # w = (A diag(β e^G)) k and u = (A diag(β)) v: scale A's columns, not k's and v's rows
        oy_s[...] = (X * cp.bcast_cols(be_c * jnp.exp(g_c), (C, C))).astype(dt)
        plgpu.commit_smem()
        w = cp.matmul(oy_s, k_s, (C, K))
        if w_quant is not None:  # QAT: quantised in f32 registers, then rounded like unquantised w
            w = fake_quant_e4m3(w, W_QUANT[w_quant])
        k_s[...] = w.astype(dt)  # (k's last use was w's product: its tile stages w)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(k_s, w_g.at[b, rows, hv, :])
        if store_a:
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the A store has read x_s
        x_s[...] = (X * cp.bcast_cols(be_c, (C, C))).astype(dt)
        plgpu.commit_smem()
        v_s[...] = cp.matmul(x_s, v_s, (C, V)).astype(dt)  # (and v's stages u)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(v_s, u_g.at[b, rows, hv, :])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(
        scoped,
        cp.smem((C, K), dt),
        cp.smem((C, V), dt),
        cp.smem((C,), jnp.float32),
        cp.smem((C,), jnp.float32),
        cp.smem((C, C), dt),
        cp.smem((C, C), dt),
        cp.smem((C,), jnp.float32, swizzled=False),  # k's bad rows
        cp.smem((V,), jnp.float32, swizzled=False),  # v's first bad row per column
        plgpu.Barrier(num_barriers=4),
    )


def intra_chunk(
    k: jax.Array,
    v: jax.Array,
    g_cum: jax.Array,
    beta: jax.Array,
    config: IntraConfig = IntraConfig(),
) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, jax.Array]]:
    """Computes w, u (and optionally A) for every chunk, and the bad values of the raw k, v.

    Args:
      k: [B, T, H, K] bf16/f16, T a multiple of 64; padded rows must be zero; non-finite
        values are read as 0.
      v: [B, T, HV, V], same dtype as k; HV % H == 0; non-finite values are read as 0.
      g_cum: [B, HV, T] f32 chunk-local cumulative log-decay (padded rows repeat the last value).
      beta: [B, HV, T] f32 (padded rows zero).
      config: :class:`IntraConfig`.
    Returns:
      ((w [B, T, HV, K] (fake-quantised with ``config.w_quant``), u [B, T, HV, V] in k.dtype,
      and if ``config.store_a`` A [B, T, HV, 64]), (k_bad [B, HV, T] f32: 1.0 on the rows of k
      (of each value head's k head) holding NaN or ±inf, else 0; v_first [B, HV, T/64, V] f32:
      per chunk and value column the first row of v holding one, 64 where none does)).
    """
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    if T % CHUNK:
        raise ValueError(f"{k.shape=}: T must be a multiple of {CHUNK}")
    out_type = [
        jax.ShapeDtypeStruct((B, T, HV, K), k.dtype),
        jax.ShapeDtypeStruct((B, T, HV, V), k.dtype),
    ]
    if config.store_a:
        out_type.append(jax.ShapeDtypeStruct((B, T, HV, CHUNK), k.dtype))
    out_type.append(jax.ShapeDtypeStruct((B, HV, T), jnp.float32))
    out_type.append(jax.ShapeDtypeStruct((B, HV, T // CHUNK, V), jnp.float32))

    def body(*refs):
        _intra_body(*refs, group=HV // H, store_a=config.store_a, w_quant=config.w_quant)

    fn = per_chunk_kernel(body, tuple(out_type), chunks=T // CHUNK, HV=HV, B=B, name="gdn_intra")
    *products, k_bad, v_first = fn(k, v, g_cum, beta)
    return tuple(products), (k_bad, v_first)
