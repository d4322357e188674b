"""In-kernel helpers of the channel-decay backward: products whose decay sits inside the K sum.

With a decay per key channel, ``e^{G_i − G_j}`` (G: chunk-local cumulative log-decay, [C, K])
sits inside the K contraction of every intra-chunk product, so it is factored onto the operands
around a reference row. The chunk is cut into four 16-row sub-chunks; sub-chunk I uses
``r_I = G[16 I + 8]`` (its middle row). For rows i of sub-chunk I and columns j ≤ last(I):

    e^{G_i − G_j} = e^{G_i − r_I} · e^{r_I − G_j}

and with per-token log-decays ≥ −d every factor is at most ``e^{8 d}`` (``e^{40}`` for d = 5), far
from the f32/bf16 range; rows after sub-chunk I are masked *before* the exponential. The decayed
products of the backward are then sums of four plain tensor-core products:

    rows:  Z_i    = Σ_j D_ij (Y_j ⊙ e^{G_i − G_j})                (D lower triangular)
    cols:  Z_j    = Σ_i D_ij (X_i ⊙ e^{G_i − G_j})

All register tiles are f32 in the WGMMA layout; only wgmma operands are 16-bit (staged in one
scratch SMEM tile each). ``G`` comes from an f32 SMEM tile, the reference rows and G_last from
small f32 SMEM tables (the same ones the forward's intra kernel reads).

bf16 io: the factored operand (Y or X times a decay factor, [C, K]) is staged as bf16 hi + lo
(two wgmma passes through one scratch tile) and D is a plain bf16 tile.

f16 io (docs/design.md): a factored operand reaches ``e^{8 d}`` and spans ``e^{15 d}``
within a sub-chunk, beyond f16's range (65504) and dynamic range even with per-column scales, so
it is staged as a **bf16** hi/lo pair (f32 range, ~16-bit precision). wgmma needs both operands
of one instruction in one dtype, so D (computed in f32 by the kernels) is staged as a bf16 hi/lo
pair too (``lo_s`` arguments, :meth:`Decay.stage_pair`), and each sub-chunk product accumulates
``D_hi Y_hi + D_lo Y_hi`` (one :func:`~pallas_kernels._compat.matmul_sum`) and then ``D_hi Y_lo``
in the same f32 sum (the ``D_lo Y_lo`` term, ~2^-18 relative, is dropped). The scratch tiles of
the factored operand and of D are bf16 in f16 mode (:func:`operand_dtype`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _compat as cp
from pallas_kernels import _tiles
from pallas_kernels._compat import pl, plgpu
from pallas_kernels._tiles import CHUNK

SUB = 16
NSUB = CHUNK // SUB
HALF = 64  # key / value columns per CTA or per pass of the split kernels (K = 128 in two)
f32 = jnp.float32

__all__ = [
    "Decay",
    "CHUNK",
    "SUB",
    "NSUB",
    "HALF",
    "decay_copies",
    "decay_smem",
    "operand_dtype",
]


def operand_dtype(dt):
    """The SMEM dtype of the decayed products' operands (factored tile and D) for io dtype
    ``dt``: ``dt`` itself for bf16, bf16 (hi/lo pairs, f32 range) for f16."""
    return jnp.bfloat16 if dt == jnp.float16 else dt


def decay_smem(C: int, n: int) -> tuple:
    """SMEM of one chunk's decay context over ``n`` key columns, in :class:`Decay`'s order:
    G [C, n] f32, the reference rows [NSUB, n] f32 (unswizzled: read one row at a time) and
    G_last [n] f32 (5.25 KiB at n = 64, 10.5 KiB at n = 128)."""
    return cp.smem((C, n), f32), cp.smem((NSUB, n), f32, swizzled=False), cp.smem((n,), f32)


def decay_copies(g_g, gr_g, gl_g, smem, *, b, hv, c, rows, cols=slice(None)) -> list:
    """TMA copies (GMEM view, SMEM ref) of chunk ``c``'s decay context into ``smem`` (the refs of
    :func:`decay_smem`), for batch row ``b``, value head ``hv``, the chunk's token ``rows`` and
    the key columns ``cols``.

    g_g: [B, T, HV, K] f32 cumulative log-decay; gr_g: [B, HV, T/16, K] reference rows;
    gl_g: [B, HV, T/64, K] G_last (:func:`pallas_kernels.channel.intra.reference_rows`).
    """
    g_s, gr_s, gl_s = smem
    return [
        (g_g.at[b, rows, hv, cols], g_s),
        (gr_g.at[b, hv, pl.ds(c * NSUB, NSUB), cols], gr_s),
        (gl_g.at[b, hv, c, cols], gl_s),
    ]


class Decay:
    """Channel-decay context of one chunk inside a kernel.

    Args:
      g_s: f32 SMEM tile [C, K] of the chunk-local cumulative log-decay.
      gr_s: f32 SMEM [NSUB, K] (unswizzled): the reference rows, from
        :func:`pallas_kernels.channel.intra.reference_rows`.
      gl_s: f32 SMEM [K]: G_last of the chunk.
      dt: the 16-bit operand dtype.
    """

    def __init__(self, g_s, gr_s, gl_s, dt):
        self.g_s = g_s
        self.gr_s = gr_s
        self.gl_s = gl_s
        self.dt = dt
        C, K = g_s.shape
        self.shape = (C, K)
        self.row = cp.iota((C, K), 0)
        self.blk = lax.shift_right_logical(self.row, 4)

    def G(self) -> jax.Array:
        """G [C, K] f32 in registers."""
        return cp.load_tile(self.g_s)

    def ref(self, i: int) -> jax.Array:
        """Reference row r_i [K] (column layout); i == NSUB gives G_last."""
        if i == NSUB:
            return cp.col_vec(self.gl_s, self.shape[1])
        return _tiles.col_vec_row(self.gr_s, i)

    def bref(self, i: int) -> jax.Array:
        return cp.bcast_cols(self.ref(i), self.shape)

    def own_ref(self) -> jax.Array:
        """[C, K]: each row's sub-chunk reference row r_{I(i)}."""
        R = self.bref(NSUB - 1)
        for i in range(NSUB - 2, -1, -1):
            R = jnp.where(self.blk == i, self.bref(i), R)
        return R

    def e_own(self) -> jax.Array:
        """e^{G_i − r_{I(i)}}: each row against its own sub-chunk's reference (|exp.| ≤ 8 d)."""
        return jnp.exp(self.G() - self.own_ref())

    def e_to(self, i: int) -> jax.Array:
        """e^{r_i − G_j} for rows j ≤ last(i), 0 below (masked before exp)."""
        keep = self.row < SUB * (i + 1)
        return jnp.where(keep, jnp.exp(jnp.where(keep, self.bref(i) - self.G(), 0.0)), 0.0)

    def e_last(self) -> jax.Array:
        """e^{G_last − G} (≤ 1 for non-positive increments)."""
        return jnp.exp(self.bref(NSUB) - self.G())

    def in_blk(self, i: int):
        return self.blk == i

    # ----------------------------------------------------------------------------------------
    # products

    def stage(self, s, val, part: int):
        """Writes the ``part`` (0: hi, 1: lo) of the two-term 16-bit split of f32 ``val`` to ``s``.

        The decayed products are staged as hi + lo (≈ f32): the row and column halves of a
        pairwise product's gate gradient must cancel over the chunk (the product depends only on
        G differences), which a single 16-bit rounding of differently scaled operands breaks.
        """
        dt = s.dtype  # the io dtype, or bf16 for a factored operand in f16 mode
        hi = val.astype(dt)
        s[...] = hi if part == 0 else (val - hi.astype(f32)).astype(dt)
        plgpu.commit_smem()

    @staticmethod
    def stage_pair(hi_s, lo_s, val) -> None:
        """Writes f32 ``val`` as hi (``hi_s``) and, with ``lo_s`` (f16 mode), lo = val − hi, both
        in the tiles' dtype; without ``lo_s`` it is the single rounding of bf16 io. The caller
        commits (:func:`plgpu.commit_smem`)."""
        hi = val.astype(hi_s.dtype)
        hi_s[...] = hi
        if lo_s is not None:
            lo_s[...] = (val - hi.astype(f32)).astype(lo_s.dtype)

    @staticmethod
    def _mm(a, a_lo, b, part: int, shape) -> jax.Array:
        """a @ b for staged part ``part`` of b; with a_lo (f16 mode) part 0 adds a_lo @ b in the
        same accumulator (the hi·hi + lo·hi terms; part 1 is hi·lo)."""
        if a_lo is None or part:
            return cp.matmul(a, b, shape)
        return cp.matmul_sum(((a, b), (a_lo, b)), shape)

    def rows(self, d_s, Y, ys_s, *, lo_s=None) -> jax.Array:
        """Z_i = Σ_j D_ij Y_j e^{G_i − G_j} (D lower triangular, 16-bit SMEM [C, C]).

        Y: [C, K] f32 registers. Returns [C, K] f32. ``lo_s`` (f16 mode): the bf16 lo part of D;
        ``ys_s`` and D are bf16 then.
        """
        Z = None
        for i in range(NSUB):
            val = Y * self.e_to(i)
            for part in (0, 1):
                self.stage(ys_s, val, part)
                t = jnp.where(self.in_blk(i), self._mm(d_s, lo_s, ys_s, part, self.shape), 0.0)
                Z = t if Z is None else Z + t
        return Z * self.e_own()

    def cols(self, d_s, X, xs_s, *, lo_s=None) -> jax.Array:
        """Z_j = Σ_i D_ij X_i e^{G_i − G_j} (D lower triangular, 16-bit SMEM [C, C]).

        X: [C, K] f32 registers. Returns [C, K] f32. ``lo_s`` (f16 mode): the bf16 lo part of D;
        ``xs_s`` and D are bf16 then.
        """
        Z = None
        for i in range(NSUB):
            t = None
            val = jnp.where(self.in_blk(i), X * self.e_own(), 0.0)
            for part in (0, 1):
                self.stage(xs_s, val, part)
                m = self._mm(d_s.T, None if lo_s is None else lo_s.T, xs_s, part, self.shape)
                t = m if t is None else t + m
            t = self.e_to(i) * t
            Z = t if Z is None else Z + t
        return Z
