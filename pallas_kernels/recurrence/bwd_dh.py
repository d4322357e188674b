"""The reverse state-gradient recurrence of the backward, fused with the local dv, for both gate
shapes.

One CTA (one warpgroup) per (batch row, value head, block_v-wide V block) runs over the chunks in
reverse. dH [K, BV] (the gradient of the state at the end of the current chunk) stays in f32
registers as the ``emit_pipeline`` carry, initialised with the final-state cotangent. Every chunk
writes dh[c] = dH (io dtype; f32 for f16 io), then forms dv2 = dL/dv_new and steps dH back over
the chunk. The gate shape decides dv2 and the dH update:

Scalar gate (GDN, :func:`chunk_bwd_dh`), from q, k, w and the chunk-local cumulative log-decay G
(one per token):

    dv2    = (k dH) ⊙ e^{G_last − G} + scale (k qᵀ ⊙ e^{G_j − G_i} ⊙ [j ≥ i]) do
    dH     ← e^{G_last} dH + (scale q ⊙ e^{G})ᵀ do − wᵀ dv2

  Both products of the dH update accumulate into one wgmma accumulator: the scale is folded into
  the q operand and the sign into the stored −dv2 operand. dv2 is written in f32 (dβ is
  sensitive to its rounding). q and k are read on the value head's q/k head (GVA); the loop can
  run as segments (:class:`LoopConfig`), and ``state_only`` writes only the start cotangents.

Per-key-channel decay (GDN2 / KDA, :func:`channel_bwd_dh`), from the forward's intra stage
(:func:`pallas_kernels.channel.intra.channel_intra`, recomputed): qg = q e^{G},
kg = k e^{G_last − G}, w and the decayed causal Aqk, so no exponential of a [C, K] tile is formed
here:

    dv2    = kg dH + scale Aqkᵀ do
    dH     ← Diag(e^{G_last}) dH + scale qgᵀ do − wᵀ dv2

  The decay of dH is a row scaling of the tile. dv2 is written as two 16-bit terms (hi + lo ≈
  f32) so the later stages can use it as a tensor-core operand without losing precision.

f16 io (docs/design.md: an f32 state gradient is never staged through plain f16, whose maximum is
65504): dH, the B operand of ``k dH``, is staged as f16 with one scale per V column
(:func:`pallas_kernels.gdn.fake_quant.stage_columns`), as the f16 pair hi + lo of the scaled
tile (two wgmmas into one accumulator), and the product's columns are multiplied back by the
scales in f32; dh is written in f32 from an f32 copy of dH. A single f16 rounding of dH puts its
2^-11 error into every dv2 and through dw, dv2 into dβ, whose terms cancel: with a final-state
cotangent dβ then breaks the 2x rule (GDN: ``tests/pallas/test_gdn_pallas.py``, KDA:
``tests/pallas/test_channel_pallas_bwd.py``).

Packed sequences on one lane (``meta``, the per-chunk (reset, final) table of the forward loops)
mirror the forward: at a sequence's last chunk dH is set to its dht row (TMA-loaded into an f32
staging tile under a predicate), and after its first chunk dH is written to its dh0 row from the
same tile.

Shared memory: the stored tiles are double-buffered (each step waits for the stores of two steps
earlier) unless the f32 [K, BV] tile (f16: the dh store; packed: the dht / dh0 staging) is
allocated; then they are single-buffered and each step waits for the previous step's stores,
issued a whole dH update earlier.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

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
    chunk_offset,
    load_state_row,
    per_v_block_kernel,
    segment_coords,
    store_f32_tile,
    store_initial_cotangent,
    v_block_coords,
)
from pallas_kernels.gdn.fake_quant import stage_columns

__all__ = ["chunk_bwd_dh", "channel_bwd_dh"]

f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class _Cta:
    """One CTA's place in the loop and the static facts its gate hooks read.

    Attributes:
      iv, hv, hk: V block, value head, and the head q/k are read on (GVA: ``hv // group``).
      b, bs: batch row, and the row of the per-segment state tables (dht, dh0).
      c0: the CTA's first chunk (the Python int 0 without segments).
      cols: the V block's state columns (``pl.ds``).
      scale, K, BV, dt: output scale, key width, V block width, io dtype.
      nbuf: buffers per stored tile (1 or 2).
      state_only: only dh0 is written (no dh, no dv2).
    """

    iv: jax.Array
    hv: jax.Array
    hk: jax.Array
    b: jax.Array
    bs: jax.Array
    c0: jax.Array | int
    cols: pl.Slice
    scale: float
    K: int
    BV: int
    dt: jnp.dtype
    nbuf: int
    state_only: bool

    def at(self, c):
        """The global index of the CTA's chunk ``c``."""
        return chunk_offset(self.c0, c)

    def buffer(self, ref, slot):
        """The buffer of the stored tile ``ref`` that a step with ``slot`` = i mod nbuf uses."""
        return ref.at[slot] if self.nbuf == 2 else ref

    def buffered_shape(self, shape):
        """The SMEM shape of a stored tile of ``shape``: one per buffer."""
        return shape if self.nbuf == 1 else (2, *shape)


# A gate shape is the part of the loop that :func:`_dh_body` leaves to it: the pipelined inputs,
# the SMEM of its dv2 and dH update, and per chunk dv2, its stores and the dH update. Its
# attributes: ``segmented`` (the loop may run as segments), ``inputs`` (pipelined input arrays),
# ``dv2_outputs`` (arrays dv2 is written to), ``stores_per_step`` (SMEM → GMEM copies a step
# issues; its wait counts them) and ``max_f32_tile`` (the largest K·block_v with the f32 [K, BV]
# tile that the launcher accepts; None: no limit checked there).


@dataclasses.dataclass(frozen=True)
class _ScalarGate:
    """GDN: one log-decay per token. Pipelined inputs q, k [B, T, H, K], w [B, T, HV, K],
    do [B, T, HV, V] and g_cum [B, HV, T] (read twice: as a row and as a column vector); dv2 is
    one f32 output. ``group``: value heads per q/k head."""

    group: int
    segmented = True
    inputs = 5
    dv2_outputs = 1
    stores_per_step = 2  # dh, dv2 (a step waits on this count even with ``state_only``)
    max_f32_tile = None  # the lowering reports a shared-memory overflow itself

    def coords(self, block_v: int, segments: int, nt: int):
        """The CTA's coordinates (the fields of :class:`_Cta` that the grid gives), for a loop
        of ``nt`` chunks per CTA."""
        iv, hv, _, cols = v_block_coords(block_v)
        # segments: this CTA runs chunks c0 + nt − 1 … c0 of batch row b; bs is its state-table row
        b, bs, c0 = segment_coords(segments, nt)
        return dict(iv=iv, hv=hv, hk=hv // self.group, b=b, bs=bs, c0=c0, cols=cols)

    def in_specs(self, ins, cta: _Cta, rev):
        """(block specs, arrays) of the pipeline over the gate's inputs ``ins``; ``rev(i)``:
        the chunk of pipeline step i."""
        q_g, k_g, w_g, do_g, g_g = ins
        C, K, BV = CHUNK, cta.K, cta.BV
        b, hk, hv, iv = cta.b, cta.hk, cta.hv, cta.iv
        tile = lambda n: dict(dtype=cta.dt, cols=n)
        specs = [
            cp.block_spec((None, C, None, K), lambda i: (b, rev(i), hk, 0), **tile(K)),  # q
            cp.block_spec((None, C, None, K), lambda i: (b, rev(i), hk, 0), **tile(K)),  # k
            cp.block_spec((None, C, None, K), lambda i: (b, rev(i), hv, 0), **tile(K)),  # w
            cp.block_spec((None, C, None, BV), lambda i: (b, rev(i), hv, iv), **tile(BV)),  # do
            cp.block_spec((None, None, C), lambda i: (b, hv, rev(i))),  # G (rows)
            cp.block_spec((None, None, C), lambda i: (b, hv, rev(i))),  # G (columns)
        ]
        return specs, (q_g, k_g, w_g, do_g, g_g, g_g)

    def scratch(self, cta: _Cta):
        """The gate's SMEM tiles, allocated after the dH tile."""
        C, K, BV, dt = CHUNK, cta.K, cta.BV, cta.dt
        # p = scale k qᵀ ⊙ decay, qg = scale q e^{G}, −dv2 (wgmma operands); dv2 (f32 store).
        # f16: dv2's tile (single-buffered: free once the step has waited for the last step's
        # stores) first holds the staged dH's remainder, read by dv2's product (SMEM at K = 128)
        dv = cp.smem(cta.buffered_shape((C, BV)), f32)
        if dt == jnp.float16:
            dv = plgpu.RefUnion(dv, cp.smem((K, BV), dt))
        return cp.smem((C, C), dt), cp.smem((C, K), dt), cp.smem((C, BV), dt), dv

    @staticmethod
    def dh_remainder(cta: _Cta, scratch):
        """f16: the tile of the staged dH's remainder (a view of dv2's tile); else None."""
        return scratch[3][1] if cta.dt == jnp.float16 else None

    def chunk(self, cta: _Cta, c, dv2_outs, scratch) -> Callable:
        """Binds loop chunk ``c`` (any index arithmetic of its own is traced here, at the start
        of the step) and returns ``backprop(tiles, dH, dh_ops, unstage, slot)``: from the step's
        input tiles and dH staged in the SMEM tiles ``dh_ops`` (f16: the staged tile and its
        remainder, whose products sum; ``unstage`` undoes the staging on a product),
        writes dv2 of the chunk to ``dv2_outs`` and returns the dH at the chunk's start."""
        (dv2_g,) = dv2_outs
        p_s, qg_s, ndv_s, dv_s = scratch
        C, K, BV, dt = CHUNK, cta.K, cta.BV, cta.dt
        if dt == jnp.float16:  # (the union's first view)
            dv_s = dv_s[0]

        def backprop(tiles, dH, dh_ops, unstage, slot):
            q_s, k_s, w_s, do_s, g_s, g2_s = tiles
            row = cp.iota((C, C), 0)
            col = cp.iota((C, C), 1)
            upper = row <= col  # j >= i
            g_r = cp.row_vec(g_s)
            # the column copy comes from a second SMEM buffer: inside the pipeline a second view
            # of g_s gets CSE'd with the row load and no layout fits both (pitfall P5)
            g_c = cp.col_vec(g2_s, C)
            g_last = g_s[C - 1]
            gd = cp.bcast_cols(g_c, (C, C)) - cp.bcast_rows(g_r, (C, C))  # G_j - G_i
            kq = cp.matmul(k_s, q_s.T, (C, C))
            p = jnp.where(upper, kq * jnp.exp(jnp.where(upper, gd, 0.0)), 0.0) * cta.scale
            p_s[...] = p.astype(dt)
            qg = q_s[...].astype(f32) * cp.bcast_rows(cta.scale * jnp.exp(g_r), (C, K))
            qg_s[...] = qg.astype(dt)
            plgpu.commit_smem()
            dv2 = unstage(cp.matmul_sum(tuple((k_s, d) for d in dh_ops), (C, BV)))
            dv2 = dv2 * cp.bcast_rows(jnp.exp(g_last - g_r), (C, BV))
            dv2 = dv2 + cp.matmul(p_s, do_s, (C, BV))
            dv_ref = cta.buffer(dv_s, slot)
            dv_ref[...] = dv2
            ndv_s[...] = (-dv2).astype(dt)
            plgpu.commit_smem()
            if not cta.state_only:
                plgpu.copy_smem_to_gmem(
                    dv_ref, dv2_g.at[cta.b, pl.ds(cta.at(c) * C, C), cta.hv, cta.cols]
                )

            upd = cp.matmul_sum(((qg_s.T, do_s), (w_s.T, ndv_s)), (K, BV))
            return dH * jnp.exp(g_last) + upd

        return backprop


class _ChannelGate:
    """GDN2 / KDA: one decay per key channel. Pipelined inputs qg, kg, w [B, T, HV, K],
    do [B, T, HV, V], Aqk [B, T, HV, 64] and e^{G_last} [B, HV, T/64, K]; dv2 is two io-dtype
    outputs, hi and lo. The hooks are those of :class:`_ScalarGate`."""

    segmented = False
    inputs = 6
    dv2_outputs = 2
    stores_per_step = 3  # dh, dv2 hi, dv2 lo
    max_f32_tile = 128 * 64  # K·block_v at which the f32 [K, BV] tile still fits in SMEM

    def coords(self, block_v: int, segments: int, nt: int):
        iv, hv, b, cols = v_block_coords(block_v)
        return dict(iv=iv, hv=hv, hk=hv, b=b, bs=b, c0=0, cols=cols)

    def in_specs(self, ins, cta: _Cta, rev):
        C, K, BV = CHUNK, cta.K, cta.BV
        b, hv, iv = cta.b, cta.hv, cta.iv
        tile = lambda n: dict(dtype=cta.dt, cols=n)
        specs = [
            cp.block_spec((None, C, None, K), lambda i: (b, rev(i), hv, 0), **tile(K)),  # qg
            cp.block_spec((None, C, None, K), lambda i: (b, rev(i), hv, 0), **tile(K)),  # kg
            cp.block_spec((None, C, None, K), lambda i: (b, rev(i), hv, 0), **tile(K)),  # w
            cp.block_spec((None, C, None, BV), lambda i: (b, rev(i), hv, iv), **tile(BV)),  # do
            cp.block_spec((None, C, None, C), lambda i: (b, rev(i), hv, 0), **tile(C)),  # Aqk
            cp.block_spec((None, None, None, K), lambda i: (b, hv, rev(i), 0)),  # e^{G_last}
        ]
        return specs, tuple(ins)

    def scratch(self, cta: _Cta):
        C, BV, dt = CHUNK, cta.BV, cta.dt
        # −dv2 (wgmma operand); dv2 hi, lo (stores); f16: the staged dH's remainder
        return (
            cp.smem((C, BV), dt),
            cp.smem(cta.buffered_shape((C, BV)), dt),
            cp.smem(cta.buffered_shape((C, BV)), dt),
            *([cp.smem((cta.K, BV), dt)] if dt == jnp.float16 else []),
        )

    @staticmethod
    def dh_remainder(cta: _Cta, scratch):
        """f16: the tile of the staged dH's remainder; else None."""
        return scratch[3] if cta.dt == jnp.float16 else None

    def chunk(self, cta: _Cta, c, dv2_outs, scratch) -> Callable:
        dvh_g, dvl_g = dv2_outs
        ndv_s, hi_s, lo_s = scratch[:3]
        C, K, BV, dt = CHUNK, cta.K, cta.BV, cta.dt
        rows = pl.ds(c * C, C)

        def backprop(tiles, dH, dh_ops, unstage, slot):
            qg_s, kg_s, w_s, do_s, aqk_s, egl_s = tiles
            dv2 = unstage(cp.matmul_sum(tuple((kg_s, d) for d in dh_ops), (C, BV)))
            dv2 = dv2 + cta.scale * cp.matmul(aqk_s.T, do_s, (C, BV))
            hi = dv2.astype(dt)
            cta.buffer(hi_s, slot)[...] = hi
            cta.buffer(lo_s, slot)[...] = (dv2 - hi.astype(f32)).astype(dt)
            ndv_s[...] = (-dv2).astype(dt)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(cta.buffer(hi_s, slot), dvh_g.at[cta.b, rows, cta.hv, cta.cols])
            plgpu.copy_smem_to_gmem(cta.buffer(lo_s, slot), dvl_g.at[cta.b, rows, cta.hv, cta.cols])

            decay = cp.bcast_rows(cp.row_vec(egl_s), (K, BV))
            upd = cp.matmul(w_s.T, ndv_s, (K, BV))
            return dH * decay + cta.scale * cp.matmul(qg_s.T, do_s, (K, BV)) + upd

        return backprop


def _dh_body(*refs, gate, cfg: LoopConfig, nt: int, packed: bool, state_only: bool):
    n = gate.inputs
    ins, dht_g = refs[:n], refs[n]
    m_g = refs[n + 1] if packed else None  # [NT, META_COLS] int32 per-chunk (reset, final) ids
    outs = refs[n + 1 + packed :]  # dh, the dv2 outputs, dh0; dh0 alone with ``state_only``
    if state_only:
        dh_g, dv2_outs, dh0_g = None, (None,) * gate.dv2_outputs, outs[0]
    else:
        dh_g, dv2_outs, dh0_g = outs[0], outs[1:-1], outs[-1]
    K = ins[1].shape[-1]
    dt = ins[1].dtype
    # f16 io: dH is staged as f16 with one scale per column and dh is written in f32
    scaled = dt == jnp.float16
    # the f32 [K, BV] tile (f16: the dh store; packed: the dht / dh0 staging) fits in SMEM only
    # with single-buffered stores
    nbuf = 1 if scaled or packed else 2
    cta = _Cta(
        **gate.coords(cfg.block_v, cfg.segments, nt),
        scale=cfg.scale,
        K=K,
        BV=cfg.block_v,
        dt=dt,
        nbuf=nbuf,
        state_only=state_only,
    )
    hv, cols = cta.hv, cta.cols

    def load_dht(st_s, bar):
        plgpu.copy_gmem_to_smem(dht_g.at[cta.bs, hv, :, cols], st_s, bar)
        plgpu.barrier_wait(bar)
        return cp.to_wgmma(st_s[...])

    if packed:  # every sequence's last chunk sets dH to its final-state cotangent
        dH0 = cp.to_wgmma(jnp.zeros((K, cta.BV), f32))
    else:
        dH0 = pl.run_scoped(load_dht, cp.smem((K, cta.BV), f32), plgpu.Barrier())
    gate_scratch = gate.scratch(cta)

    def scoped(dh_s, *rest):
        scratch, dhf = rest[: len(gate_scratch)], rest[len(gate_scratch) :]
        dhl_s = gate.dh_remainder(cta, scratch)

        def step(idx, *refs):
            *tiles, dH = refs
            if packed:
                *tiles, m_s = tiles
            (i,) = idx
            c = nt - 1 - i
            slot = lax.rem(i, nbuf)
            backprop = gate.chunk(cta, c, dv2_outs, scratch)
            # the stores of step i - nbuf (same slots) must have left SMEM
            plgpu.wait_smem_to_gmem(gate.stores_per_step * (nbuf - 1), wait_read_only=True)
            if packed:  # packed sequences on one lane (reverse): a last chunk loads its dht
                reset, fin = m_s[0], m_s[1]
                dH = load_state_row(fin, dht_g, hv, cols, dhf[0], dhf[1], dH)
            dh_ref = cta.buffer(dh_s, slot)
            unstage = stage_columns(dH, dh_ref, scaled, dhl_s)
            if scaled:
                dhf[0][...] = dH
                dh_src = dhf[0]
            else:
                dh_src = dh_ref
            plgpu.commit_smem()
            if not state_only:
                plgpu.copy_smem_to_gmem(dh_src, dh_g.at[cta.b, cta.at(c), hv, :, cols])
            dh_ops = (dh_ref,) if dhl_s is None else (dh_ref, dhl_s)
            dH = backprop(tiles, dH, dh_ops, unstage, slot)
            if packed:  # a sequence's first chunk: dH is now the cotangent of its h0
                store_initial_cotangent(reset, dH, dhf[0], dh0_g, hv, cols)
            return dH

        rev = lambda i: cta.at(nt - 1 - i)
        specs, pipelined = gate.in_specs(ins, cta, rev)
        if packed:
            specs.append(cp.block_spec((None, META_COLS), lambda i: (rev(i), 0)))  # (reset, final)
            pipelined += (m_g,)
        dH = plgpu.emit_pipeline(
            step, grid=(nt,), in_specs=specs, max_concurrent_steps=2, init_carry=dH0
        )(*pipelined)
        plgpu.wait_smem_to_gmem(0)
        return dH

    dH = pl.run_scoped(
        scoped,
        cp.smem(cta.buffered_shape((K, cta.BV)), dt),  # dH as the wgmma operand (+ the dh store)
        *gate_scratch,
        # dH in f32: the dh store with f16 io; the dht / dh0 staging of packed sequences
        *([cp.smem((K, cta.BV), f32)] if scaled or packed else []),
        *([plgpu.Barrier()] if packed else []),
    )
    if not packed:
        store_f32_tile(dH, dh0_g.at[cta.bs, hv, :, cols])


def _launch(
    gate,
    ins: tuple[jax.Array, ...],
    dht: jax.Array,
    meta: jax.Array | None,
    config: LoopConfig,
    *,
    keys_name: str,
    dv2_type: jax.ShapeDtypeStruct,
    name: str,
    state_only: bool = False,
):
    """Checks the shapes and the config, then runs the loop of ``gate`` on its pipelined inputs
    ``ins`` (keys ``ins[1]`` [B, T, ·, K], do ``ins[3]`` [B, T, HV, V]); ``gate.dv2_outputs``
    outputs of type ``dv2_type`` come between dh and dh0."""
    keys, do = ins[1], ins[3]
    B, T, _, K = keys.shape
    HV, V = do.shape[2], do.shape[3]
    if T % CHUNK or V % config.block_v:
        raise ValueError(
            f"{keys_name}.shape={keys.shape} {do.shape=}: T % 64 and V % block_v must be 0"
        )
    nt = T // CHUNK
    segs = config.segments
    if not gate.segmented and segs != 1:
        raise NotImplementedError(f"{config.segments=}: the channel loops run unsplit")
    packed = meta is not None
    check_meta(meta, B, nt)
    if nt % segs:
        raise ValueError(
            f"{keys_name}.shape={keys.shape}, segments={segs}: T / 64 must be a multiple of "
            "segments"
        )
    if not packed and dht.shape[0] != B * segs:
        raise ValueError(f"{dht.shape=}: needs B·segments = {B * segs} rows")
    dt = keys.dtype
    if gate.max_f32_tile is not None and K * config.block_v > gate.max_f32_tile:
        if packed:
            raise NotImplementedError(
                f"packed states with K={K}, block_v={config.block_v}: the f32 dht / dh0 staging "
                "tile does not fit in shared memory; use block_v=64"
            )
        if dt == jnp.float16:
            raise NotImplementedError(
                f"f16 with K={K}, block_v={config.block_v}: the f32 dh tile does not fit in "
                "shared memory; use block_v=64"
            )
    dh0_type = jax.ShapeDtypeStruct(dht.shape if packed else (B * segs, HV, K, V), f32)
    out_type = (
        jax.ShapeDtypeStruct((B, nt, HV, K, V), f32 if dt == jnp.float16 else dt),
        *(dv2_type,) * gate.dv2_outputs,
        dh0_type,
    )
    if state_only:
        out_type = dh0_type

    def body(*refs):
        _dh_body(*refs, gate=gate, cfg=config, nt=nt // segs, packed=packed, state_only=state_only)

    fn = per_v_block_kernel(
        body, out_type, v_blocks=V // config.block_v, HV=HV, B=B * segs, name=name
    )
    return fn(*ins, dht, *(() if meta is None else (meta,)))


def chunk_bwd_dh(
    q: jax.Array,
    k: jax.Array,
    w: jax.Array,
    do: jax.Array,
    g_cum: jax.Array,
    dht: jax.Array,
    config: LoopConfig,
    meta: jax.Array | None = None,
    *,
    state_only: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array] | jax.Array:
    """Reverse chunk loop of the GDN backward (scalar gate).

    Args:
      q, k: [B, T, H, K]; w: [B, T, HV, K]; do: [B, T, HV, V] (all the io dtype); T % 64 == 0.
      g_cum: [B, HV, T] f32 chunk-local cumulative log-decay.
      dht: [B, HV, K, V] f32 cotangent of the final state ([N, HV, K, V] with ``meta``).
      config: :class:`LoopConfig`. With ``segments = S > 1`` (T/64 a multiple of S) dht (without
        ``meta``) and dh0 have one row per (batch row, segment), b·S + j: the cotangent at the
        end of segment j, and the one at its start.
      meta: packed sequences on one lane (B == 1), as for
        :func:`pallas_kernels.recurrence.chunk_fwd.chunk_fwd`: [T/64, META_COLS] int32
        (reset, final) ids.
        With segments, every segment's last chunk must name a dht row in column 1.
      state_only: compute only dh0 (no dh, no dv2 written): the start cotangents of segments.
    Returns:
      dh [B, T/64, HV, K, V] (io dtype, f32 for f16 io; gradient of the state at each chunk's end),
      dv2 [B, T, HV, V] f32 (gradient of v_new; f32: dβ is sensitive to its rounding),
      dh0 [B, HV, K, V] f32 ([N, HV, K, V] with ``meta``; rows of sequences without chunks
      unwritten). ``state_only``: dh0 alone.
    """
    gate = _ScalarGate(group=do.shape[2] // k.shape[2])
    return _launch(
        gate,
        (q, k, w, do, g_cum),
        dht,
        meta,
        config,
        keys_name="k",
        dv2_type=jax.ShapeDtypeStruct(do.shape, f32),
        name="gdn_segment_dh" if state_only else "gdn_chunk_bwd_dh",
        state_only=state_only,
    )


def channel_bwd_dh(
    qg: jax.Array,
    kg: jax.Array,
    w: jax.Array,
    do: jax.Array,
    aqk: jax.Array,
    decay_last: jax.Array,
    dht: jax.Array,
    config: LoopConfig,
    meta: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Reverse chunk loop of the channel-decay (GDN2 / KDA) backward.

    Args:
      qg, kg, w: [B, T, HV, K] io dtype (from the intra stage); T % 64 == 0.
      do: [B, T, HV, V] io dtype.
      aqk: [B, T, HV, 64] io dtype, the decayed causal intra-chunk product (unscaled).
      decay_last: [B, HV, T/64, K] f32, e^{G_last} per chunk and key channel.
      dht: [B, HV, K, V] f32 cotangent of the final state ([N, HV, K, V] with ``meta``).
      config: :class:`LoopConfig` (``segments`` 1).
      meta: packed sequences on one lane (B == 1), as for
        :func:`pallas_kernels.recurrence.chunk_fwd.channel_chunk_fwd`: [T/64, META_COLS] int32
        (reset, final) ids; dH is set to dht[n] at sequence n's last chunk and written to dh0[n]
        after its first.
    Returns:
      dh [B, T/64, HV, K, V] (io dtype, f32 for f16 io; gradient of the state at each chunk's
      end), dv2_hi, dv2_lo [B, T, HV, V] io dtype (dL/dv_new = hi + lo), dh0 [B, HV, K, V] f32
      ([N, HV, K, V] with ``meta``, rows of sequences without chunks unwritten).
    Raises:
      NotImplementedError: ``segments`` > 1; f16 io, or ``meta``, at K = block_v = 128 (shared
        memory; block_v = 64 fits).
    """
    return _launch(
        _ChannelGate(),
        (qg, kg, w, do, aqk, decay_last),
        dht,
        meta,
        config,
        keys_name="kg",
        dv2_type=jax.ShapeDtypeStruct(do.shape, kg.dtype),
        name="chan_bwd_dh",
    )
