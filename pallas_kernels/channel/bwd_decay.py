"""In-kernel helpers of the channel-decay backward: products whose decay sits inside a sum.

With a decay per key channel, ``e^{G_i − G_j}`` (G: chunk-local cumulative log-decay, [C, K])
multiplies every element of the backward's intra-chunk products (D lower triangular, [C, C]):

    rows:  Z_i = Σ_j D_ij (Y_j ⊙ e^{G_i − G_j})                   [C, K]
    cols:  Z_j = Σ_i D_ij (X_i ⊙ e^{G_i − G_j})                   [C, K]

The chunk's C = 64 rows are cut into four 16-row blocks; block J has the reference row
``r_J = G[16 J + 8]`` (its middle row, as in the forward's intra kernel). The decay is factored
around the reference of the block of the *contracted* index:

    rows (j in block J):  e^{G_i − G_j} = e^{G_i − r_J} · e^{r_J − G_j}
        Z = Σ_J F_J ⊙ (D[:, J] · Ŷ[J]),    Ŷ_j = Y_j e^{r_{J(j)} − G_j}
        F_J,i = e^{G_i − r_J} for i ≥ 16 J, else 0
    cols (i in block I):  e^{G_i − G_j} = e^{r_I − G_j} · e^{G_i − r_I}
        Z = Σ_I F_I ⊙ (D[I, :]ᵀ · X̂[I]),   X̂_i = X_i e^{G_i − r_{I(i)}}
        F_I,j = e^{r_I − G_j} for j < 16 I + 16, else 0

The factored operand (Ŷ or X̂, each row against its own block's reference) is staged once, as a
16-bit hi/lo pair in two [C, K] tiles (below); block J's product reads rows 16 J … 16 J + 15 of
both and a 16-wide slice of D (columns J for rows, rows I transposed for cols): one
64 × K × 16 wgmma per block and part, all of a block's into one f32 accumulator, so the four
blocks together cost one 64 × 64 × K product per part. The other factor F scales the block's
accumulated product in registers (one exponential, one wgmma wait and one scaling per block)
before it is added to Z. Where F's row lies outside the triangle (rows i < 16 J for
"rows", j ≥ 16 I + 16 for "cols") D's entries in the block are zero, but F would be large or
inf: its exponent is masked to 0 *before* ``exp`` and the value selected away with ``where``.
G is non-increasing (log-decays ≤ 0), so inside the triangle F ≤ 1 except in the diagonal block,
where F and the factored operand are within e^{±8·d} for per-token log-decays ≥ −d (e^{80} at the
op's clamp d = 10, inside the f32 / bf16 range). Exponentials are ``exp2(x · log2 e)``.

wgmma contracts in steps of one swizzle width, so D and the factored operand's hi and lo live in
tiles with a 32-byte swizzle (16 columns of 16 bits, :func:`product_smem`). In the kernels D and
the hi are tiles of their own (otherwise used only to stage TMA stores, or in the unsplit WY
kernel sharing the space of tiles read before); the lo is a view of a tile read before
(:class:`plgpu.RefUnion`: k's tile in the dq/dk/dw kernels, the dA operand scratch in the WY
kernels), so the pair costs the kernels no more shared memory than one tile did.

All register tiles are f32 in the WGMMA layout; only wgmma operands are 16-bit. ``G`` comes from
an f32 SMEM tile, the reference rows and G_last from small f32 SMEM tables (the same ones the
forward's intra kernel reads).

The factored operand is staged as a 16-bit pair hi = rnd(Ŷ), lo = rnd(Ŷ − hi) (≈ f32), both
tiles at once: every block accumulates ``D Ŷ_hi + D Ŷ_lo`` in one f32 accumulator (two
64 × K × 16 wgmmas), scaled once by F into Z. The pair is needed in bf16 too: the row and column
halves of a pairwise product's gate gradient (dG = dq ⊙ q − dk ⊙ k, and the WY kernel's
dbk ⊙ bk − dkL ⊙ k) must cancel over the chunk (the product depends only on G differences), which
single 16-bit roundings of the two differently factored operands break (the op's gate gradient
then misses the 2x rule of docs/design.md in the interpreter tests). D is rounded once and shared
by both halves.

bf16 io: D is a plain bf16 tile, the factored operand a bf16 hi/lo pair.

f16 io (docs/design.md): the factored operand reaches ``e^{8 d}``, beyond f16's range (65504),
and spans more than its dynamic range within a block, so its pair is **bf16** (f32 range,
~16-bit precision). wgmma needs both operands of one instruction in one dtype, so D (computed in
f32 by the kernels) is staged as a bf16 hi/lo pair too (``lo_s`` arguments,
:meth:`Decay.stage_pair`), and each block accumulates ``D_hi Ŷ_hi + D_hi Ŷ_lo + D_lo Ŷ_hi``
(three wgmmas, one accumulator; the ``D_lo Ŷ_lo`` term, ~2^-18 relative, is dropped). The tiles
of the factored operand and of D are bf16 in f16 mode (:func:`operand_dtype`). The forward's
intra kernel multiplies its f16-mode factored operands by one tf32 wgmma instead; tf32 wgmma
takes no transposed operand (both must be K-major), and here the contraction runs over the
tokens: the factored operand's [C, K] tile (and D for :meth:`Decay.cols`) would have to be
staged transposed. Such a form (the operand stored through a transposed view from the WGMMA
register layout, D flipped in place between the two products) is no faster: f16 fwd+bwd at
B4 T4096 H16 4.99 vs 5.02 ms (KDA) and 6.21 vs 6.04 ms (GDN2) against this one
(``bench_gdn.py --dtype float16``, one H100, same machine), so the wgmma count is not what
separates the f16 backward from the bf16 one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _compat as cp
from pallas_kernels import _tiles
from pallas_kernels._compat import pl, plgpu
from pallas_kernels._tiles import CHUNK, ex2_exp

SUB = 16
NSUB = CHUNK // SUB
HALF = 64  # key / value columns per CTA or per pass of the split kernels (K = 128 in two)
SWIZZLE = 32  # bytes: the decayed products' tiles, 16-wide contraction steps for wgmma
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
    "product_smem",
]


def operand_dtype(dt):
    """The SMEM dtype of the decayed products' operands (factored tile and D) for io dtype
    ``dt``: ``dt`` itself for bf16, bf16 (hi/lo pairs, f32 range) for f16."""
    return jnp.bfloat16 if dt == jnp.float16 else dt


def product_smem(shape, dt):
    """An SMEM tile for an operand of the decayed products (D [C, C], the factored operand
    [C, K]): a 32-byte swizzle, so that wgmma can contract over 16 of its rows or columns."""
    return cp.smem(shape, dt, swizzle=SWIZZLE)


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
        """[C, K]: each row's block reference row r_{J(i)}."""
        R = self.bref(NSUB - 1)
        for i in range(NSUB - 2, -1, -1):
            R = jnp.where(self.blk == i, self.bref(i), R)
        return R

    def e_last(self) -> jax.Array:
        """e^{G_last − G} (≤ 1 for non-positive increments)."""
        return jnp.exp(self.bref(NSUB) - self.G())

    # ----------------------------------------------------------------------------------------
    # staging

    @staticmethod
    def stage(s, val, part: int):
        """Writes the ``part`` (0: hi, 1: lo) of the two-term 16-bit split of f32 ``val`` to
        ``s`` (in the tile's dtype) and commits; part 0 alone is the plain 16-bit rounding."""
        dt = s.dtype
        hi = val.astype(dt)
        s[...] = hi if part == 0 else (val - hi.astype(f32)).astype(dt)
        plgpu.commit_smem()

    @staticmethod
    def stage_pair(hi_s, lo_s, val) -> None:
        """Writes f32 ``val`` as hi (``hi_s``) and, with ``lo_s`` (the factored operand; D in
        f16 mode), lo = val − hi, both in the tiles' dtype; without ``lo_s`` it is the single
        rounding of bf16 io's D. The caller commits (:func:`plgpu.commit_smem`)."""
        hi = val.astype(hi_s.dtype)
        hi_s[...] = hi
        if lo_s is not None:
            lo_s[...] = (val - hi.astype(f32)).astype(lo_s.dtype)

    # ----------------------------------------------------------------------------------------
    # products

    def _blocks(self, d_blk, val, op_s, dlo_s, factor) -> jax.Array:
        """Σ_J F_J ⊙ (D_J · val[J]) for the four 16-row blocks J of the staged operand.

        ``val``: the factored operand [C, K] f32, staged once as its hi/lo pair to the two tiles
        ``op_s`` = (hi tile, lo tile). ``d_blk(lo, J)``: block J's [C, 16] A operand from D's
        tile (``lo`` None) or from D's lo tile ``lo``. ``dlo_s`` (f16 mode): D's lo tile,
        multiplied with the operand's hi. ``factor(J)``: (keep mask or None, exponent) of F_J.
        Block J's wgmmas (D·hi, D·lo, f16: D_lo·hi) go into one accumulator; F_J's exponential
        runs while they do, then one wait and one scaling per block.
        """
        hi_s, olo_s = op_s
        Decay.stage_pair(hi_s, olo_s, val)
        plgpu.commit_smem()
        Z = None
        for J in range(NSUB):
            blk = pl.ds(SUB * J, SUB)
            d_j = d_blk(None, J)
            pairs = [(d_j, hi_s.at[blk]), (d_j, olo_s.at[blk])]
            if dlo_s is not None:
                pairs.append((d_blk(dlo_s, J), hi_s.at[blk]))
            keep, expo = factor(J)

            def body(acc, pairs=pairs, keep=keep, expo=expo):
                for a, b in pairs:
                    plgpu.wgmma(acc, a, b)
                if keep is None:
                    f = ex2_exp(expo)
                else:  # masked before exp: outside the triangle F would overflow
                    f = ex2_exp(jnp.where(keep, expo, 0.0))
                t = cp.acc_values(acc) * f
                return t if keep is None else jnp.where(keep, t, 0.0)

            t = pl.run_scoped(body, plgpu.ACC(self.shape, f32))
            Z = t if Z is None else Z + t
        return Z

    def rows(self, d_s, Y, ys_s, *, lo_s=None) -> jax.Array:
        """Z_i = Σ_j D_ij Y_j e^{G_i − G_j} (D strictly lower triangular, 16-bit SMEM [C, C]).

        Y: [C, K] f32 registers. ``ys_s``: the two [C, K] operand tiles (hi, lo), written here
        with no barrier before (every thread must be done with what shares their space: the
        dq/dk/dw kernels commit after reading k's tile). All tiles from :func:`product_smem`.
        ``lo_s`` (f16 mode): the bf16 lo part of D; ``ys_s`` and D are bf16 then. Returns
        [C, K] f32.
        """

        def d_blk(lo, J):  # D[:, J]: the columns of block J
            return (d_s if lo is None else lo).at[:, pl.ds(SUB * J, SUB)]

        def factor(J):  # F_J,i = e^{G_i − r_J} for rows i ≥ 16 J
            return (None if J == 0 else self.blk >= J), self.G() - self.bref(J)

        Yf = Y * ex2_exp(self.own_ref() - self.G())  # Y_j e^{r_{J(j)} − G_j}
        return self._blocks(d_blk, Yf, ys_s, lo_s, factor)

    def cols(self, d_s, X, xs_s, *, lo_s=None) -> jax.Array:
        """Z_j = Σ_i D_ij X_i e^{G_i − G_j} (D strictly lower triangular, 16-bit SMEM [C, C]).

        X: [C, K] f32 registers. ``xs_s``: the two [C, K] operand tiles (hi, lo), as for
        :meth:`rows`. All tiles from :func:`product_smem`. ``lo_s`` (f16 mode): the bf16 lo part
        of D; ``xs_s`` and D are bf16 then. Returns [C, K] f32.
        """

        def d_blk(lo, I):  # D[I, :]ᵀ: the rows of block I, transposed
            return (d_s if lo is None else lo).at[pl.ds(SUB * I, SUB)].T

        def factor(I):  # F_I,j = e^{r_I − G_j} for rows j < 16 I + 16
            return (None if I == NSUB - 1 else self.blk <= I), self.bref(I) - self.G()

        Xf = X * ex2_exp(self.G() - self.own_ref())  # X_i e^{G_i − r_{I(i)}}
        return self._blocks(d_blk, Xf, xs_s, lo_s, factor)
