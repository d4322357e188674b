"""Stage 2 of chunked GDN2 / KDA: the intra-chunk WY representation with a decay per key channel.

Two kernels, each one CTA (one warpgroup) per (chunk, value head, batch row): ``chan_intra_wy``
(:func:`_wy_body`) forms L → A → w, u (and A), ``chan_intra_qk`` (:func:`_qk_body`) Aqk, qg, kg.
The two share nothing but G and k; as separate kernels each gets its own register allocation and
shared-memory footprint instead of the larger of the two. Shared memory would let four qk and
three wy CTAs share an SM with bf16 io (f16: three qk, three (KDA) or two (GDN2) wy), but
registers hold both kernels to two: ptxas gives GDN2's wy 202 (bf16) / 229 (f16) registers a
thread at K = V = 128 (``benchmarks/kernel_resources.py``; qk more), and three CTAs of one
warpgroup need at most 168. Per chunk of
C = 64 rows, with G the chunk-local cumulative log-decay per key channel ([C, K], natural log,
f32), b the erase gate and w_gate the write gate (KDA: b = w_gate = β per token), they compute
the stages of :func:`gdn_jax.reference.chunked.intra_chunk` and the output's intra-chunk matrix:

    L_ij   = Σ_d b_id k_id k_jd e^{G_id − G_jd}   (i > j)          [C, C] f32
    A      = (I + L)⁻¹                     block-doubling inverse
    w      = A (b ⊙ e^{G} ⊙ k)                                     [C, K]
    u      = A (w_gate ⊙ v)                                        [C, V]
    Aqk_ij = Σ_d q_id k_jd e^{G_id − G_jd}   (i ≥ j)               [C, C]
    qg     = q ⊙ e^{G},   kg = k ⊙ e^{G_last − G}                  [C, K]

The decay sits inside the K contraction, so it is factored onto the operands around a reference
row per 16-column block J of L and Aqk: r_J = G at row 16 J + 8 (the block's middle row). Columns
j of J get ``k_j e^{r_J − G_j}`` ([16, K]), rows i ≥ 16 J get ``x_i e^{G_i − r_J}`` ([64, K],
x = b ⊙ k or q; rows above 16 J are zero: their exponent is masked to 0 *before* ``exp`` and the
value selected away), and one 64 × 16 × K wgmma gives L[:, J] (and one Aqk[:, J]): the four
blocks together cost one 64 × 64 × K product each for L and Aqk. G is non-increasing
(log-decays ≤ 0), so rows after block J get factors ≤ 1, and inside the diagonal 16 × 16 block
every factor is within e^{±8·|g|max}: finite for per-token log-decays down to −10 (e^{80} <
f32/bf16 max; the op clamps log-decays at −10, which covers the required −5 per token with
margin). Products above the diagonal may overflow to inf (or NaN) in the accumulator; they are
dropped with ``where``, never multiplied by a mask. The column operand of all four blocks is one
[C, 64] tile (each row against its own block's reference), block J reading its rows 16 J …
16 J + 15.

Both kernels contract over K in 64-column passes (K/64 of them; w leaves in K/64 and u in V/64
column blocks), so only [64, 64] f32 register tiles are live and a CTA needs at most a third of
an SM's shared memory (GDN2's f16 wy kernel: under half). K, V ∈ {64, 128}.

QAT (``w_quant``): w is fake-quantised to FP8-E4M3 in registers before it is stored
(:func:`pallas_kernels.gdn.fake_quant.fake_quant_e4m3_tiles` over its K/64 column blocks: one
scale per row or per [C, K] tile), so every later kernel reads the quantised w, as the GDN intra
kernel does.

Precision: K-contractions, A and every accumulation in f32; wgmma operands (the factored k, q,
A, the gated v) are 16-bit. Outputs are stored in the io dtype.

f16 io (q, k, v and the outputs f16): the factored operands of L and Aqk,
``x_i e^{G_i − r_J}`` and ``k_j e^{r_J − G_j}``, reach e^{8·|g|} (e^{40} at log-decay −5 per
token), beyond f16's 65504, and span more than its dynamic range within a block, so they are
staged in f32 tiles rounded to tf32 (f32's range, f16's 11-bit significand;
:func:`pallas_kernels._tiles.round_tf32`) and multiplied by one tf32 wgmma: half bf16's rate,
where bf16 hi/lo pairs (hi·hi + hi·lo + lo·hi) would take three bf16 products
(``bench_gdn.py --stages --dtype float16`` times both kernels). Both operands of a tf32
wgmma must be K-major, which these are (rows [C, 64] and the column block's [16, 64] rows, both
with the key channels contiguous). Everything else stays f16: A (|A| bounded
by the inverse's size), the gated k and v operands of w and u (factors ≤ 1), qg, kg (factors
≤ 1), Aqk (≤ |q||k|). Values below f16's smallest normal (6.1e-5, e.g. qg and w rows under
strong decay) are stored subnormal, like any f16 rounding of them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _compat as cp
from pallas_kernels import _tiles
from pallas_kernels._compat import pl, plgpu
from pallas_kernels._tiles import (
    CHUNK,
    Bars,
    accumulate_passes,
    chunk_coords,
    ex2_exp,
    finite,
    per_chunk_kernel,
)
from pallas_kernels.channel.bwd_decay import (
    HALF,
    NSUB,
    SUB,
    Decay,
    decay_copies,
    decay_smem,
)
from pallas_kernels.gdn.fake_quant import W_QUANT, fake_quant_e4m3_tiles

MID = SUB // 2  # reference row inside each sub-chunk
f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class ChannelIntraConfig:
    """Static configuration of :func:`channel_intra`.

    Attributes:
      scalar_beta: KDA: the erase and write gates are one β per (token, value head), given as
        [B, HV, T]; otherwise (GDN2) b [B, T, HV, K] and w_gate [B, T, HV, V].
      store_a: also write A (16-bit) for the backward.
      w_quant: QAT fake quantisation (FP8-E4M3, dynamic scale) of w: ``None`` (off), ``"row"``
        (one scale per token row, amax over K) or ``"tile"`` (one per chunk and value head).
    """

    scalar_beta: bool = False
    store_a: bool = False
    w_quant: str | None = None

    def __post_init__(self):
        for name in ("scalar_beta", "store_a"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ChannelIntraConfig.{name}={getattr(self, name)!r} must be a bool")
        if self.w_quant is not None and self.w_quant not in W_QUANT:
            raise ValueError(f"{self.w_quant=} must be None or one of {tuple(W_QUANT)}")


def _wy_matrix(L, x_s, oy_s, a_dst, be_s, dt) -> jax.Array:
    """A = (I + L)⁻¹ of the strictly lower [C, C] f32 tile ``L`` (scratch ``x_s``, ``oy_s``),
    written in ``dt`` to the GMEM view ``a_dst`` unless it is None. Returns the left operand of
    w and u, [C, C] f32: A, or for KDA (``be_s``: β [C] in SMEM) A with its columns scaled by β,
    which stands for the β on the right operands' rows."""
    X = _tiles.unit_lower_inverse(L, x_s, oy_s, dt)
    if a_dst is not None:
        x_s[...] = X.astype(dt)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(x_s, a_dst)
    if be_s is not None:
        C = X.shape[0]
        X = X * cp.bcast_cols(cp.col_vec(be_s, C), (C, C))
    return X


class _Factored:
    """The decay-factored products both kernels form (L in the wy kernel, Aqk in the qk kernel),
    with their scratch tiles, for io dtype ``dt``.

    bf16 io stages the factored operands in bf16; f16 io in f32 tiles rounded to tf32
    (:func:`_tiles.round_tf32`), multiplied by one tf32 wgmma, in their own pass-scoped tiles
    (the f16 staging tiles keep the other roles: outputs, Aqk)."""

    def __init__(self, dt):
        self.dt = dt
        self.wide = dt == jnp.float16

    def tile(self, dtype=None):
        """One [C, 64] scratch tile (16-bit operand by default)."""
        return cp.smem((CHUNK, HALF), self.dt if dtype is None else dtype)

    def operand_tiles(self) -> tuple:
        """The (row, column) operand tiles of :meth:`pass_products`: [C, 64] in the io dtype
        for bf16 io, f32 for f16 io."""
        return (self.tile(f32), self.tile(f32)) if self.wide else (self.tile(), self.tile())

    def stage(self, s, val):
        """Stages the factored operand ``val`` ([C, 64] f32) into the tile ``s``: in bf16 for
        bf16 io, for f16 io rounded to tf32 in an f32 tile (the factors reach e^{8·|g|}, beyond
        f16's 65504; tf32 has f32's range and f16's 11-bit significand)."""
        s[...] = _tiles.round_tf32(val) if self.wide else val.astype(self.dt)

    def col_block(self, col_s, J):
        """The B operand of column block J: rows 16 J … 16 J + 15 of the column operand tile,
        transposed, [64, 16] (K-major, as tf32 wgmma requires)."""
        return col_s.at[pl.ds(SUB * J, SUB)].T

    def issue(self, acc, row_s, col_t):
        """acc += row · col_t (asynchronous, 64 × 16 × 64)."""
        plgpu.wgmma(acc, row_s, col_t)

    def pass_products(self, dec, x, row_s, col_s, k_f32, acc):
        """``acc`` (None: 0) plus this pass's 64 key columns of Σ_d x_id k_jd e^{G_id − G_jd},
        one [C, 16] f32 tile per column block J (rows i ≥ 16 J hold the products, rows above
        0; entries with i < j inside block J are garbage, inf or NaN, dropped by the caller
        with ``where``). ``x``: [C, 64] f32 in registers; ``k_f32()`` loads k. ``row_s``,
        ``col_s``: [C, 64] ``dt`` tiles, for f16 io f32 tiles (:meth:`stage`).

        The decay is factored around r_J (G at row 16 J + 8): the column operand is
        k_j e^{r_J − G_j} for j in J, i.e. one [C, 64] tile with every row against its own
        block's reference, whose rows 16 J … 16 J + 15 are block J's B operand; the row
        operand of block J is x_i e^{G_i − r_J} for i ≥ 16 J (exponent masked to 0 before
        ``exp`` above, value selected to 0). G is non-increasing: factors of rows after block J
        are ≤ 1, and inside the diagonal block every factor is within e^{±8·|g|max}."""
        C = CHUNK
        self.stage(col_s, k_f32() * ex2_exp(dec.own_ref() - dec.G()))

        def products(*accs):
            for J in range(NSUB):
                if J:
                    keep = dec.blk >= J
                    expo = jnp.where(keep, dec.G() - dec.bref(J), 0.0)  # masked before exp
                    val = jnp.where(keep, x * ex2_exp(expo), 0.0)
                else:  # every row is at or after block 0
                    val = x * ex2_exp(dec.G() - dec.bref(0))
                if J:  # block J − 1's products (computed meanwhile) have read the row tile
                    plgpu.wgmma_wait(0)
                self.stage(row_s, val)
                plgpu.commit_smem()
                self.issue(accs[J], row_s, self.col_block(col_s, J))
            return cp.acc_values(*accs)

        out = pl.run_scoped(products, *(plgpu.ACC((C, SUB), f32) for _ in range(NSUB)))
        return out if acc is None else [a + m for a, m in zip(acc, out, strict=True)]


def _region(name: str):
    """Decorates a pass function ``fn(p, ...)`` to run inside ``jax.named_scope(f"{name} {p}")``:
    a region of the kernel's profile (:func:`pallas_kernels._compat.profile_regions`)."""

    def wrap(fn):
        @functools.wraps(fn)
        def scoped(p, *args):
            with jax.named_scope(f"{name} {p}"):
                return fn(p, *args)

        return scoped

    return wrap


def _cols(p):
    """The p-th 64-column block of K or V."""
    return pl.ds(p * HALF, HALF)


def _wy_body(*refs, cfg: ChannelIntraConfig, group: int):
    """One CTA per (chunk, value head, batch row): L → A = (I + L)⁻¹ → w, u (and A when
    ``store_a``).

    Refs: KDA (k, v, G, gr, β | w, u[, A]); GDN2 (k, bk, vw, G, gr | w, u[, A]) with
    the gated operands bk = b ⊙ k and vw = w_gate ⊙ v formed by :func:`channel_intra` (io dtype,
    per value head), so GDN2's CTA loads 16-bit tiles where it would load the f32 gates, and its u
    is a plain product.

    L is contracted over K in K/64 passes of 64 columns (each pass adds its partial products to
    four [C, 16] f32 register tiles, one per column block, :meth:`_Factored.pass_products`); w
    leaves in K/64 and u in V/64 blocks of 64 columns (K and V need not match). So every
    register tile is at most [C, 64] f32 (32 registers a thread) and a pass's SMEM is released
    before the next one loads.

    SMEM at K = V = 128, 16-bit io (a buffer one variant lacks is not allocated there: Mosaic
    GPU rounds every allocation up to 1 KiB):

      always:    w's right operand b ⊙ e^G ⊙ k 2 × [C, 64]; bf16 io: L's row / column operands,
                 then the output staging, 2 × [C, 64]; β (KDA); the barriers
      L pass:    k [C, 64], G [C, 64] f32, reference rows [4, 64] f32, bk [C, 64] (GDN2)
      tail:      v (GDN2: vw) 2 × [C, 64], loaded after the L passes (it overlaps the inverse
                 and w); the inverse scratch x, oy [C, C]; f16 io: the output staging
                 2 × [C, 64]

    Mosaic's count when lowering, bf16: 66 632 B (KDA) / 66 640 B (GDN2), within a third of an
    SM (tests/pallas/test_channel_pallas.py::test_lowers_for_cuda checks each kernel's count
    against its plan's budget); registers allow two CTAs per SM (GDN2: 202 a thread;
    ``benchmarks/kernel_resources.py``).

    KDA reads v raw: its non-finite values become 0 in place once v has landed (each thread
    rewrites the elements it reads). Where v's bad values are, the op's XLA flags say
    (:func:`gdn_jax.ops._sanitize.poison`, as for GDN2's v): finding them here (a 0/1 tile
    and a 64 × 64 × 64 product per V-half) cost the f16 kernel 1.7× its time on an H100
    (``benchmarks/kernel_regions.py``: every region of the kernel slowed, not only the flags').

    f16 io: the L operands are tf32, two [C, 64] f32 tiles in each pass's scope (the f16 staging
    tiles cannot hold them), so the output staging moves to the tail's scope: 75 848 B (KDA),
    a third of an SM; 83 024 B (GDN2, whose pass also holds bk), under half. Registers (GDN2:
    229 a thread) allow two CTAs per SM either way.
    """
    scalar = cfg.scalar_beta
    if scalar:
        k_g, v_g, G_g, gr_g, be_g, *outs = refs
        bk_g = None
    else:
        k_g, bk_g, v_g, G_g, gr_g, *outs = refs
        be_g = None
    w_g, u_g = outs[:2]
    a_g = outs[2] if cfg.store_a else None
    C = CHUNK
    c, hv, b, hk, rows = chunk_coords(group, C)
    kpass, vpass = k_g.shape[-1] // HALF, v_g.shape[-1] // HALF  # 64-column passes over K and V
    dt = k_g.dtype
    fp = _Factored(dt)
    wide = fp.wide

    def outer(wop_s, st_o, be_s, bar):
        """st_o (operand / output staging): None for f16 io, where the tail allocates it (see
        :func:`late_tiles`)."""
        bars = Bars(bar)
        if scalar:
            bars.load([(be_g.at[b, hv, rows], be_s)])

        @_region("L pass")
        def l_pass(p, L, k_s, g_s, gr_s, *rest):
            bk_s, ops = (None, rest) if scalar else (rest[0], rest[1:])
            srcs = [
                (k_g.at[b, rows, hk, _cols(p)], k_s),
                (G_g.at[b, rows, hv, _cols(p)], g_s),
                (gr_g.at[b, hv, pl.ds(c * NSUB, NSUB), _cols(p)], gr_s),
            ]
            if not scalar:
                srcs.append((bk_g.at[b, rows, hv, _cols(p)], bk_s))
            bars.load(srcs)
            dec = Decay(g_s, gr_s, None, dt)

            def k_f32():
                return finite(cp.load_tile(k_s).astype(f32))

            def bk():  # the erase-gated key (KDA: β is applied to L's rows instead)
                return k_f32() if scalar else cp.load_tile(bk_s).astype(f32)

            row_s, col_s = ops if wide else st_o
            L = fp.pass_products(dec, bk(), row_s, col_s, k_f32, L)
            # w's right operand b ⊙ e^G ⊙ k for these columns; the commit is also the
            # warpgroup barrier past which the next pass's loads may overwrite this scope
            wop_s[p][...] = (bk() * ex2_exp(dec.G())).astype(dt)
            plgpu.commit_smem()
            return L

        L = accumulate_passes(
            l_pass,
            kpass,
            fp.tile(),  # k
            fp.tile(f32),  # G
            cp.smem((NSUB, HALF), f32, swizzled=False),  # reference rows
            *(() if scalar else (fp.tile(),)),  # bk (GDN2)
            *(fp.operand_tiles() if wide else ()),  # f16 io: the f32 operands
        )
        row = cp.iota((C, C), 0)
        col = cp.iota((C, C), 1)
        # inf / NaN above the diagonal of the diagonal blocks: select, never multiply
        L = jnp.where(row > col, jnp.concatenate(L, axis=1), 0.0)
        if scalar:
            L = L * cp.bcast_rows(cp.row_vec(be_s), (C, C))

        def tail(v_s, x_s, oy_s, *own):
            st_s = own[0] if wide else st_o
            # v is needed only for u at the end: its load overlaps the inverse and w
            v_ids = bars.load(
                [(v_g.at[b, rows, hv, _cols(p)], v_s[p]) for p in range(vpass)], wait=False
            )
            a_dst = a_g.at[b, rows, hv, :] if cfg.store_a else None
            with jax.named_scope("inverse"):
                oy_s[...] = _wy_matrix(L, x_s, oy_s, a_dst, be_s, dt).astype(dt)
                plgpu.commit_smem()

            n_out = [0]

            def put(val, dst):
                """Stores an output tile through the two staging tiles in turn."""
                if n_out[0] >= 2:  # the store two back used this tile: let it finish reading
                    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                s = st_s[n_out[0] % 2]
                n_out[0] += 1
                s[...] = val.astype(dt)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(s, dst)

            w_op = lambda p: cp.matmul(oy_s, wop_s[p], (C, HALF))  # noqa: E731
            with jax.named_scope("w"):
                if cfg.w_quant is None:
                    for p in range(kpass):  # w = A (b ⊙ e^G ⊙ k), one K-half at a time
                        put(w_op(p), w_g.at[b, rows, hv, _cols(p)])
                else:  # QAT: a row's (the tile's) amax spans every K-half: form all, quantise
                    ws = fake_quant_e4m3_tiles(
                        tuple(w_op(p) for p in range(kpass)), W_QUANT[cfg.w_quant]
                    )
                    for p in range(kpass):
                        put(ws[p], w_g.at[b, rows, hv, _cols(p)])
            with jax.named_scope("v wait"):
                bars.wait(v_ids)
            if scalar:  # KDA reads v raw: non-finite values as 0, in place
                with jax.named_scope("v finite"):
                    for p in range(vpass):
                        v_s[p][...] = finite(cp.load_tile(v_s[p]).astype(f32)).astype(dt)
                    plgpu.commit_smem()
            with jax.named_scope("u"):
                for p in range(vpass):  # u = A (w_gate ⊙ v), one V-half at a time
                    put(cp.matmul(oy_s, v_s[p], (C, HALF)), u_g.at[b, rows, hv, _cols(p)])
            with jax.named_scope("drain"):
                plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(tail, *late_tiles())

    def late_tiles():
        """The tiles used only after the L passes: v (GDN2: vw) per V-half, the inverse scratch
        (then the A staging, and A (KDA: A diag(β)) for w and u), and for f16 io the output
        staging (bf16 io stages its outputs through the L passes' operand tiles)."""
        v_tiles = tuple(fp.tile() for _ in range(vpass))
        tiles = (v_tiles, cp.smem((C, C), dt), cp.smem((C, C), dt))
        return tiles + (((fp.tile(), fp.tile()),) if wide else ())

    wop_spec = tuple(fp.tile() for _ in range(kpass))  # w's right operand, per K-half
    st_spec = (fp.tile(), fp.tile())  # bf16 io: L's row / column operands; then output staging
    be_spec = cp.smem((C,), f32) if scalar else None  # β (KDA)
    # one barrier per load: v per V-half, β (KDA), and per K-half pass k, G, the reference rows
    # (and bk)
    n_bar = vpass + 1 + 3 * kpass if scalar else vpass + 4 * kpass
    bar_spec = plgpu.Barrier(num_barriers=n_bar)
    if wide:
        # f16 io: the output staging lives in the tail's scope too, the alternative to the
        # passes' f32 operand tiles
        pl.run_scoped(
            lambda wop_s, be_s, bar: outer(wop_s, None, be_s, bar), wop_spec, be_spec, bar_spec
        )
    else:
        pl.run_scoped(outer, wop_spec, st_spec, be_spec, bar_spec)


def _qk_body(q_g, k_g, G_g, gr_g, gl_g, qg_g, kg_g, aqk_g, *, group: int):
    """One CTA per (chunk, value head, batch row): Aqk, qg, kg from the raw q and k, whose
    non-finite values read as 0 (where they are, the op's XLA flags say:
    :func:`gdn_jax.ops._sanitize.poison`; finding q's and k's bad rows here, a row reduction
    of each loaded tile, cost the f16 kernel 1.37× its cycles per CTA and the bf16 one 1.06×
    at KDA B4 T4096 H16 on the H200, ``benchmarks/kernel_regions.py``).

    Aqk is contracted over K in K/64 passes of 64 columns, as L in :func:`_wy_body`. Once a
    pass's products have read q and k, qg = q e^{G} and kg = k e^{G_last − G} overwrite them in
    their own tiles (each thread rewrites the elements it loaded, all in the WGMMA layout) and
    leave from there; the pass ends when those stores have read the tiles. Aqk is staged in the
    passes' memory after the last one.

    SMEM bytes at K = 128 (Mosaic GPU rounds every allocation up to 1 KiB; barriers 8 B each):

      always:    10 barriers
      pass:      q, k [C, 64] 8192 each, G 16384, reference rows 1024, G_last 1024; the
                 factored row / column operands 2 × [C, 64]: bf16 io 16384, f16 io f32 (tf32)
                 32768
      then:      Aqk staging [C, C] 8192

    Mosaic's count is 51 280 B with bf16 io (a quarter of an SM) and 67 664 B with f16 io (a
    third); registers allow two CTAs per SM (module docstring).
    """
    C = CHUNK
    c, hv, b, hk, rows = chunk_coords(group, C)
    kpass = k_g.shape[-1] // HALF
    dt = k_g.dtype
    fp = _Factored(dt)

    def outer(bar):
        bars = Bars(bar)

        @_region("Aqk pass")
        def p_pass(p, P, q_s, k_s, g_s, gr_s, gl_s, row_s, col_s):
            bars.load(
                [
                    *decay_copies(
                        G_g,
                        gr_g,
                        gl_g,
                        (g_s, gr_s, gl_s),
                        b=b,
                        hv=hv,
                        c=c,
                        rows=rows,
                        cols=_cols(p),
                    ),
                    (q_g.at[b, rows, hk, _cols(p)], q_s),
                    (k_g.at[b, rows, hk, _cols(p)], k_s),
                ]
            )
            dec = Decay(g_s, gr_s, gl_s, dt)

            def q_f32():  # as read from the op's raw inputs: non-finite values as 0
                return finite(cp.load_tile(q_s).astype(f32))

            def k_f32():
                return finite(cp.load_tile(k_s).astype(f32))

            P = fp.pass_products(dec, q_f32(), row_s, col_s, k_f32, P)
            # qg = q e^{G}, kg = k e^{G_last − G} (factors ≤ 1), in place
            q_s[...] = (q_f32() * ex2_exp(dec.G())).astype(dt)
            k_s[...] = (k_f32() * ex2_exp(dec.bref(NSUB) - dec.G())).astype(dt)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_s, qg_g.at[b, rows, hv, _cols(p)])
            plgpu.copy_smem_to_gmem(k_s, kg_g.at[b, rows, hv, _cols(p)])
            # the next pass's loads, or Aqk's staging, take this memory
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            return P

        P = accumulate_passes(
            p_pass,
            kpass,
            fp.tile(),  # q, then qg
            fp.tile(),  # k, then kg
            *decay_smem(C, HALF),  # G, reference rows, G_last
            *fp.operand_tiles(),  # the factored row / column operands
        )
        row = cp.iota((C, C), 0)
        col = cp.iota((C, C), 1)
        P = jnp.where(row >= col, jnp.concatenate(P, axis=1), 0.0)

        def store_aqk(st_s):
            st_s[...] = P.astype(dt)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(st_s, aqk_g.at[b, rows, hv, :])
            plgpu.wait_smem_to_gmem(0)

        with jax.named_scope("store Aqk"):
            pl.run_scoped(store_aqk, cp.smem((C, C), dt))

    pl.run_scoped(outer, plgpu.Barrier(num_barriers=5 * kpass))


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


def gated_operands(k, v, b, w_gate) -> tuple[jax.Array, jax.Array]:
    """GDN2's gated operands of the wy kernel, in the io dtype, non-finite inputs read as 0.

    Args:
      k: [B, T, H, K]; v: [B, T, HV, V] (16-bit); b: [B, T, HV, K] f32 erase gate;
      w_gate: [B, T, HV, V] f32 write gate.
    Returns:
      (bk [B, T, HV, K] = b ⊙ k (k repeated over the value heads of its group),
      vw [B, T, HV, V] = w_gate ⊙ v), both in k.dtype: vw is u's right operand as is; bk is
      rounded to 16 bits before the kernel multiplies it by the decay factors of L and w.
    """
    dt = k.dtype
    group = v.shape[2] // k.shape[2]
    kr = finite(jnp.repeat(k, group, axis=2).astype(f32))
    bk = (finite(b) * kr).astype(dt)
    vw = (finite(w_gate) * finite(v.astype(f32))).astype(dt)
    return bk, vw


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
      v: [B, T, HV, V], same dtype; HV % H == 0; K, V ∈ {64, 128} (else NotImplementedError).
        Non-finite values of q, k, v read as 0 (where they are, the op's XLA flags say).
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

    if K not in (HALF, 2 * HALF) or V not in (HALF, 2 * HALF):
        raise NotImplementedError(f"{k.shape=} {v.shape=}: channel_intra needs K, V ∈ {{64, 128}}")

    chunks = T // CHUNK
    group = HV // H
    wy_out = tuple(out_type[2:4]) + tuple(out_type[5:])
    wy = per_chunk_kernel(
        functools.partial(_wy_body, cfg=config, group=group),
        wy_out,
        chunks=chunks,
        HV=HV,
        B=B,
        name="chan_intra_wy",
    )
    qk = per_chunk_kernel(
        functools.partial(_qk_body, group=group),
        (out_type[0], out_type[1], out_type[4]),
        chunks=chunks,
        HV=HV,
        B=B,
        name="chan_intra_qk",
    )
    if config.scalar_beta:
        w, u, *a = wy(k, v, G, gr, b)
    else:
        w, u, *a = wy(k, *gated_operands(k, v, b, w_gate), G, gr)
    qg, kg, aqk = qk(q, k, G, gr, gl)
    return (qg, kg, w, u, aqk, *a)
