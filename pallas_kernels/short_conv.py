"""Depthwise causal short convolution over time (+ SiLU), forward and backward. A CTA owns 64
channels of one batch row and walks ``blocks`` consecutive 64-token blocks.

    pre[t, c] = Σ_j w[j, c] · m_j(t) · x[t − (W − 1) + j, c]          y = act(pre)

``m_j(t)`` drops taps that reach before the token's sequence start. Packed sequences pass
``reach`` [T, 64] int8: row t holds min(distance of t from its sequence's first token, W − 1) in
all 64 columns, and m_j(t) = reach[t] ≥ W − 1 − j. Taps that reach before t = 0 read zeros.

Layout. Each block's rows of x, plus the W − 1 rows before them (and, backward, W − 1 rows after
them), arrive with one TMA into a plain row-major SMEM tile; the first block of a row, which has
no rows before it, lands W − 1 rows down a tile whose top rows were zeroed. The taps are
row-shifted views of that tile, read as 16-row register tiles (``WG_STRIDED``: every thread holds
8 consecutive channels of one row, so the shifted loads are conflict-free vector loads; TMA into
swizzled tiles would need 8-row-aligned starts). Per-channel and per-row factors come from SMEM
tiles of the same shape: the taps arrive broadcast over 16 rows (``wb`` [W, 16, C]) and the packed
offsets over 64 columns. The next block's load is in flight while a block is computed and its
output stored. Rows past T arrive as zeros (TMA's out-of-bounds fill) and stores past T are
clipped, so T need not be a multiple of 64. Products and sums are f32; only stored outputs are
16-bit.

Backward, for the rows t of a block (k = 0 … W − 1 reads the rows k further on):

    dpre[t + k] = dy[t + k] · act'(pre[t + k])                        (pre recomputed from x)
    dx[t]  = Σ_k w[W − 1 − k] · m_{W−1−k}(t + k) · dpre[t + k]
    dw[j] += Σ_t m_j(t) · dpre[t] · x[t − (W − 1) + j]         (a [W, 64] partial per CTA)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _compat as cp
from pallas_kernels._compat import pl, plgpu
from pallas_kernels._tiles import ex2_exp

__all__ = [
    "ROWS",
    "COLS",
    "SUB",
    "MAX_TAPS",
    "ACTIVATIONS",
    "blocks_per_cta",
    "check",
    "short_conv_fwd",
    "short_conv_bwd",
]

ROWS = 64  # tokens per block
COLS = 64  # channels per CTA: 128 bytes of a 16-bit row (so every row offset is TMA-aligned)
SUB = 16  # rows per register tile: 16 × 64 values = 8 per thread of the warpgroup
MAX_TAPS = ROWS // SUB  # the dw partials of all taps are reduced as one [64, 64] tile
MAX_BLOCKS = 8  # blocks per CTA at most
MIN_CTAS = 2 * 132  # two CTAs per SM of an H200 at least, where the shape allows
ACTIVATIONS = ("silu", None)
f32 = jnp.float32
_STRIDED = plgpu.Layout.WG_STRIDED((SUB, COLS), vec_size=8)


def blocks_per_cta(B: int, T: int, C: int) -> int:
    """Consecutive 64-token blocks per CTA: the most (up to 8; halving) that keeps at least
    :data:`MIN_CTAS` CTAs in the grid; 1 where even one block per CTA gives fewer."""
    n = pl.cdiv(T, ROWS)
    blocks = MAX_BLOCKS
    while blocks > 1 and (C // COLS) * B * pl.cdiv(n, blocks) < MIN_CTAS:
        blocks //= 2
    return blocks


def _sigmoid(x: jax.Array) -> jax.Array:
    """1 / (1 + e^{−x}) with the ex2 instruction (0 at x → −∞, where e^{−x} is inf)."""
    return 1.0 / (1.0 + ex2_exp(-x))


def _rows(ref, start) -> jax.Array:
    """Rows ``start … start + 15`` of a plain SMEM tile as a [16, 64] f32 register tile."""
    return plgpu.load(ref.at[pl.ds(start, SUB)], layout=_STRIDED).astype(f32)


def _masks(reach_s, start: int, W: int):
    """m_j of rows ``start …`` as [16, 64] bool tiles, j = 0 … W − 2 (m_{W−1} = 1)."""
    reach = plgpu.load(reach_s.at[pl.ds(start, SUB)], layout=_STRIDED).astype(jnp.int32)
    return [reach >= W - 1 - j for j in range(W - 1)]


def _masked(x, masks, j: int):
    """x where tap j is kept, else 0: a select, so a non-finite value from another packed
    sequence never reaches this one (a multiply by 0 would keep a NaN)."""
    return x if masks is None or j == len(masks) else jnp.where(masks[j], x, 0.0)


def _pre(x_s, start: int, w, masks):
    """Σ_j w_j · m_j · x[start + j …] over the taps (f32 [16, 64])."""
    acc = None
    for j, wj in enumerate(w):
        tap = _masked(_rows(x_s, start + j) * wj, masks, j)
        acc = tap if acc is None else acc + tap
    return acc


def _loop(body, out_type, B: int, T: int, C: int, blocks: int, name: str):
    """``body(*refs, n=, block0=, cols=, b=)`` on the (channel block, block group, batch row) grid:
    the CTA's blocks are ``block0 … block0 + n − 1`` (n ≤ ``blocks``; fewer in the last group),
    its channels ``cols`` and its batch row ``b``."""
    n_blocks = pl.cdiv(T, ROWS)

    def kernel_body(*refs):
        g = lax.axis_index("g")
        block0 = g * blocks
        n = jnp.minimum(blocks, n_blocks - block0)
        body(*refs, n=n, block0=block0, cols=pl.ds(lax.axis_index("c") * COLS, COLS),
             b=lax.axis_index("b"))  # fmt: skip

    return cp.kernel(
        kernel_body,
        out_type=out_type,
        grid=(C // COLS, pl.cdiv(n_blocks, blocks), B),
        grid_names=("c", "g", "b"),
        name=name,
    )


def _load_x(x_g, x_s, bar, b, t0, cols, rows: int, W: int) -> None:
    """x rows ``t0 − (W − 1) … t0 − (W − 1) + rows − 1`` into ``x_s`` [rows, 64] on ``bar``; at
    t0 = 0 the W − 1 rows before the sequence are zeros."""
    if W == 1:
        plgpu.copy_gmem_to_smem(x_g.at[b, pl.ds(t0, rows), cols], x_s, bar)
        return

    @pl.when(t0 == 0)
    def _():
        x_s.at[pl.ds(0, SUB)][...] = jnp.zeros((SUB, COLS), x_s.dtype)
        plgpu.commit_smem()  # the zeros are written before the copy overwrites rows ≥ W − 1
        plgpu.copy_gmem_to_smem(
            x_g.at[b, pl.ds(0, rows - (W - 1)), cols], x_s.at[pl.ds(W - 1, rows - (W - 1))], bar
        )

    @pl.when(t0 > 0)
    def _():
        plgpu.copy_gmem_to_smem(x_g.at[b, pl.ds(t0 - (W - 1), rows), cols], x_s, bar)


def _pipelined(n, load, compute, carry):
    """``carry = compute(i, slot, carry)`` for blocks i = 0 … n − 1, block i's loads
    (``load(i, slot)``, waited on inside ``compute``) issued one block ahead into the other of
    two SMEM slots. Returns the last carry."""
    load(0, 0)

    def step(i, carry):
        slot = lax.rem(i, 2)

        @pl.when(i + 1 < n)
        def _():
            load(i + 1, 1 - slot)

        return compute(i, slot, carry)

    return lax.fori_loop(0, n, step, carry)


def check(x, wb, reach, activation, T: int) -> None:
    """NotImplementedError for what the kernels do not serve, ValueError for malformed inputs."""
    B, Tx, C = x.shape
    W = wb.shape[0]
    if x.dtype not in (jnp.bfloat16, jnp.float16):
        raise NotImplementedError(f"{x.dtype=}: the short-conv kernels take bf16 or f16")
    if C % COLS:
        raise NotImplementedError(f"{x.shape=}: channels must be a multiple of {COLS}")
    if not 1 <= W <= MAX_TAPS:
        raise NotImplementedError(f"{W} taps: the kernels take 1 to {MAX_TAPS}")
    if activation not in ACTIVATIONS:
        raise NotImplementedError(f"{activation=}: the kernels apply one of {ACTIVATIONS}")
    if wb.shape != (W, SUB, C) or wb.dtype != f32:
        raise ValueError(f"{wb.shape=} {wb.dtype=}: expected ({W}, {SUB}, {C}) float32")
    if Tx != T:
        raise ValueError(f"{x.shape=}: expected T = {T} rows")
    if reach is not None and (reach.shape != (T, COLS) or reach.dtype != jnp.int8 or B != 1):
        raise ValueError(f"{reach.shape=} {reach.dtype=} with {x.shape=}: expected [T, 64] int8")


def short_conv_fwd(x, wb, reach, *, activation, out_dtype, blocks: int | None = None) -> jax.Array:
    """y = act(conv(x)).

    Args:
      x: [B, T, C] bf16/f16, C a multiple of 64.
      wb: [W, 16, C] f32, the taps broadcast over 16 rows (tap W − 1 multiplies token t); W ≤ 4.
      reach: [T, 64] int8 (packed sequences, B == 1; see the module docstring) or None.
      activation: ``"silu"`` or None; out_dtype: dtype of y.
      blocks: 64-token blocks per CTA (default :func:`blocks_per_cta`).
    Returns:
      y [B, T, C] in ``out_dtype``.
    """
    B, T, C = x.shape
    check(x, wb, reach, activation, T)
    blocks = blocks or blocks_per_cta(B, T, C)
    W = wb.shape[0]
    packed = reach is not None
    R = ROWS + W - 1  # x rows per block

    def body(x_g, wb_g, *refs, n, block0, cols, b):
        reach_g, y_g = refs if packed else (None, refs[0])

        def scoped(x_s, w_s, y_s, bar, wbar, reach_s=None):
            plgpu.copy_gmem_to_smem(wb_g.at[:, :, cols], w_s, wbar)

            def load(i, slot):
                t0 = (block0 + i) * ROWS
                _load_x(x_g, x_s.at[slot], bar.at[slot], b, t0, cols, R, W)
                if packed:
                    plgpu.copy_gmem_to_smem(reach_g.at[pl.ds(t0, ROWS)], reach_s.at[slot],
                                            bar.at[2 + slot])  # fmt: skip

            def compute(i, slot, carry):
                plgpu.barrier_wait(bar.at[slot])
                if packed:
                    plgpu.barrier_wait(bar.at[2 + slot])
                w = [plgpu.load(w_s.at[j], layout=_STRIDED) for j in range(W)]
                # the store that last read this slot's output tile (block i − 2) is done
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                for r in range(0, ROWS, SUB):
                    masks = _masks(reach_s.at[slot], r, W) if packed else None
                    pre = _pre(x_s.at[slot], r, w, masks)
                    y = pre * _sigmoid(pre) if activation == "silu" else pre
                    y_s.at[slot, pl.ds(r, SUB)][...] = y.astype(out_dtype)
                plgpu.commit_smem()
                t0 = (block0 + i) * ROWS
                plgpu.copy_smem_to_gmem(y_s.at[slot], y_g.at[b, pl.ds(t0, ROWS), cols])
                return carry

            plgpu.barrier_wait(wbar)
            _pipelined(n, load, compute, 0)
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(
            scoped,
            cp.smem((2, R, COLS), x.dtype, swizzled=False),
            cp.smem((W, SUB, COLS), f32, swizzled=False),
            cp.smem((2, ROWS, COLS), out_dtype, swizzled=False),
            plgpu.Barrier(num_barriers=4),
            plgpu.Barrier(num_barriers=1),
            *([cp.smem((2, ROWS, COLS), jnp.int8, swizzled=False)] if packed else []),
        )

    out = jax.ShapeDtypeStruct((B, T, C), out_dtype)
    args = (x, wb) + ((reach,) if packed else ())
    return _loop(body, out, B, T, C, blocks, "short_conv_fwd")(*args)


def short_conv_bwd(
    x, wb, reach, dy, *, activation, blocks: int | None = None
) -> tuple[jax.Array, jax.Array]:
    """Gradients of :func:`short_conv_fwd` (the pre-activation is recomputed from ``x``).

    Args:
      x, wb, reach, activation, blocks: as for :func:`short_conv_fwd`.
      dy: [B, T, C] 16-bit cotangent of y.
    Returns:
      dx [B, T, C] in x.dtype, and dw [W, C] f32.
    """
    B, T, C = dy.shape
    check(x, wb, reach, activation, T)
    if dy.dtype not in (jnp.bfloat16, jnp.float16):
        raise NotImplementedError(f"{dy.dtype=}: the short-conv kernels take bf16 or f16")
    W = wb.shape[0]
    packed = reach is not None
    blocks = blocks or blocks_per_cta(B, T, C)
    groups = pl.cdiv(pl.cdiv(T, ROWS), blocks)
    # dpre is formed once per row, for the block's rows and the W − 1 after them: DR rows in
    # 16-row tiles (rows past ROWS + W − 2 are computed from unloaded SMEM and never read)
    DR = ROWS + SUB
    RX, RY = ROWS + 2 * W - 2, ROWS + W - 1  # x and dy rows loaded per block

    def body(x_g, wb_g, dy_g, *refs, n, block0, cols, b):
        reach_g, dx_g, dw_g = refs if packed else (None, *refs)

        def loop(w_s, bar, x_s, dy_s, dx_s, dpre_s, reach_s=None):
            def load(i, slot):
                t0 = (block0 + i) * ROWS
                _load_x(x_g, x_s.at[slot, pl.ds(0, RX)], bar.at[slot], b, t0, cols, RX, W)
                plgpu.copy_gmem_to_smem(dy_g.at[b, pl.ds(t0, RY), cols],
                                        dy_s.at[slot, pl.ds(0, RY)], bar.at[2 + slot])  # fmt: skip
                if packed:
                    dst = reach_s.at[slot, pl.ds(0, RY)]
                    plgpu.copy_gmem_to_smem(reach_g.at[pl.ds(t0, RY)], dst, bar.at[4 + slot])

            def compute(i, slot, dw):
                for k in range(2 + packed):
                    plgpu.barrier_wait(bar.at[2 * k + slot])
                xs, ys = x_s.at[slot], dy_s.at[slot]
                rs = reach_s.at[slot] if packed else None
                w = [plgpu.load(w_s.at[j], layout=_STRIDED) for j in range(W)]
                dw = list(dw)
                for r in range(0, DR, SUB):
                    masks = _masks(rs, r, W) if packed else None
                    xr = [_rows(xs, r + j) for j in range(W)]
                    dpre = _rows(ys, r)
                    if activation == "silu":
                        pre = None
                        for j in range(W):
                            tap = _masked(xr[j] * w[j], masks, j)
                            pre = tap if pre is None else pre + tap
                        s = _sigmoid(pre)
                        dpre = dpre * (s + pre * s * (1.0 - s))
                    dpre_s.at[pl.ds(r, SUB)][...] = dpre
                    if r < ROWS:
                        for j in range(W):
                            dw[j] = dw[j] + _masked(dpre * xr[j], masks, j)
                # dpre_s is complete, and the store that last read this slot's dx tile is done
                plgpu.commit_smem()
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                for r in range(0, ROWS, SUB):
                    dx = None
                    for k in range(W):
                        j = W - 1 - k
                        term = _rows(dpre_s, r + k) * w[j]
                        if packed:
                            term = _masked(term, _masks(rs, r + k, W), j)
                        dx = term if dx is None else dx + term
                    dx_s.at[slot, pl.ds(r, SUB)][...] = dx.astype(x.dtype)
                plgpu.commit_smem()
                t0 = (block0 + i) * ROWS
                plgpu.copy_smem_to_gmem(dx_s.at[slot], dx_g.at[b, pl.ds(t0, ROWS), cols])
                return tuple(dw)

            zero = plgpu.layout_cast(jnp.zeros((SUB, COLS), f32), _STRIDED)
            dw = _pipelined(n, load, compute, (zero,) * W)
            plgpu.wait_smem_to_gmem(0)
            return dw

        def reduce(dw, acc_s, dw_s):
            # each tap's [16, 64] partial sums, stacked, reduced over rows as one [64, 64] tile
            for j in range(MAX_TAPS):
                acc_s.at[pl.ds(j * SUB, SUB)][...] = dw[j] if j < W else jnp.zeros_like(dw[0])
            plgpu.commit_smem()
            tot = plgpu.load(acc_s, layout=plgpu.Layout.WGMMA, optimized=False)
            tap = lax.shift_right_logical(cp.iota((ROWS, COLS), 0), SUB.bit_length() - 1)
            for j in range(W):
                dw_s.at[j][...] = jnp.sum(jnp.where(tap == j, tot, 0.0), axis=0)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dw_s, dw_g.at[b, lax.axis_index("g"), :, cols])
            plgpu.wait_smem_to_gmem(0)

        def scoped(w_s, bar, wbar):
            plgpu.copy_gmem_to_smem(wb_g.at[:, :, cols], w_s, wbar)
            plgpu.barrier_wait(wbar)
            dw = pl.run_scoped(
                functools.partial(loop, w_s, bar),
                cp.smem((2, DR + W - 1, COLS), x.dtype, swizzled=False),
                cp.smem((2, DR, COLS), dy.dtype, swizzled=False),
                cp.smem((2, ROWS, COLS), x.dtype, swizzled=False),
                cp.smem((DR, COLS), f32, swizzled=False),
                *([cp.smem((2, DR, COLS), jnp.int8, swizzled=False)] if packed else []),
            )
            pl.run_scoped(
                functools.partial(reduce, dw),
                cp.smem((ROWS, COLS), f32, swizzled=False),
                cp.smem((W, COLS), f32, swizzled=False),
            )

        pl.run_scoped(
            scoped,
            cp.smem((W, SUB, COLS), f32, swizzled=False),
            plgpu.Barrier(num_barriers=6),
            plgpu.Barrier(num_barriers=1),
        )

    out = (jax.ShapeDtypeStruct((B, T, C), x.dtype), jax.ShapeDtypeStruct((B, groups, W, C), f32))
    args = (x, wb, dy) + ((reach,) if packed else ())
    dx, dw = _loop(body, out, B, T, C, blocks, "short_conv_bwd")(*args)
    return dx, jnp.sum(dw, axis=(0, 1))
