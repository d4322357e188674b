"""``implementation="pallas"`` of :func:`gdn_jax.gdn2` and :func:`gdn_jax.kda` (decay per key
channel): glue around the Mosaic GPU kernels of :mod:`pallas_kernels.channel`.

Layout work happens outside the ``custom_vjp`` in plain jnp (JAX differentiates it), as in
:mod:`gdn_jax.ops._gdn_pallas`: the optional L2 norm of q and k, padding T to a multiple of 64
(one lane per batch row; with ``cu_seqlens``: all sequences back to back on one lane, each
starting at a chunk boundary, T + 64 N rows at most; the state is reset at every sequence's first
chunk by a state-wiping gate when all initial states are zero and no final state is asked for,
else by the chunk loops from a per-chunk table of sequence ids, :func:`packed_meta`), and the
chunk-local gate cumsum.
Padded rows are inert: q = k = v = 0, b = w = β = 0 and a zero gate increment, so the cumulative
gate of a padded row is that of the last valid row. Per-token log-decays are clamped at
:data:`MIN_LOG_DECAY` (-10) first, which bounds every factor of the kernels' sub-chunk decay
factoring by e^{80} (finite in f32/bf16) and changes results by at most e^{-10} relative.

f16 io (K, V ∈ {64, 128}, K ≠ V included): the kernels stage those decay-factored operands with
f32's range (f16 could hold neither their size nor their spread): the intra kernel as tf32 (one
product), the backward as bf16 hi/lo pairs (~16-bit precision); and the f32 state and its gradient
as f16 with one scale per row or column (as the GDN kernels do). H200 tests, K = V and K ≠ V:
forward and every gradient within 2x of the f16 recurrence's error, log-decay −5 per token included.

QAT (``qat``, a :class:`gdn_jax.qat.QATConfig`): fused as in the GDN kernels. The intra kernel
fake-quantises w before storing it and the state loop the state entering each chunk, in the
forward and in the backward's recomputation of h (the same plan), so every backward kernel reads
the quantised w and h the forward used; the fake quant's gradient is the identity, so the
backward kernels themselves are unchanged (as the xla path's backward). Combinations the kernels
do not fuse raise NotImplementedError (:func:`pallas_kernels.channel.plan.check_supported`).

Non-finite inputs (:mod:`gdn_jax.ops._sanitize`): the kernels read the raw inputs and replace
bad values by 0 as they load them; the gate cumsum also flags g's bad rows.
:func:`gdn_jax.ops._pallas_common.loop_poison` turns those, with the op's flags of q, k, v and
the gates (XLA reductions, :class:`~gdn_jax.ops._pallas_common.LaneFlags`), into the chunk
loop's poison inputs (per-chunk first rows, a prefix min along each sequence) and the final
state's NaN. The intra kernels flag nothing: code that found bad rows inside them slowed the
whole f16 kernels, wy 1.7× and qk 1.37× (KDA B4 T4096 H16, cycles per CTA,
``benchmarks/kernel_regions.py``; bf16 qk 1.06×), and with the L2 norm XLA reads q and k
anyway.

Which form of each kernel stage runs (split intra, K-split backward kernels, ...) is decided by
one plan per call, :func:`pallas_kernels.channel.plan.channel_plan` (its docstring gives the
table and the reasons); whether the kernels serve a call at all by
:func:`pallas_kernels.channel.plan.check_supported`.

Core (:func:`_core`, a ``custom_vjp`` with a frozen :class:`ChannelConfig`) on padded lanes,
``N`` lanes of ``Tp`` rows (Tp % 64 == 0); with ``meta`` (packed sequences with states) N == 1
and the states have one row per sequence, ``S`` of them:

    q, k : [N, Tp, H, K]   io dtype (bf16 or f16), l2-normalised already if asked
    v    : [N, Tp, HV, V]  io dtype
    G    : [N, Tp, HV, K]  f32, chunk-local inclusive cumsum of the per-channel log-decay
    b    : GDN2: [N, Tp, HV, K] f32 erase gate;  KDA (cfg.scalar_beta): β [N, Tp, HV] f32
    w    : GDN2: [N, Tp, HV, V] f32 write gate;  KDA: None
    h0   : [N, HV, K, V]   f32 initial state ([S, HV, K, V] with meta)
    meta : None, or [Tp/64, META_COLS] int32, the chunk loops' table (column 0: the sequence
           whose first chunk this is, column 1: whose last chunk, else -1); not differentiated
    lanes: None, or the op's poison inputs besides the kernels' flags
           (:class:`~gdn_jax.ops._pallas_common.LaneFlags`); not differentiated
  → (o [N, Tp, HV, V] io dtype, final state [N, HV, K, V] f32 ([S, HV, K, V] with meta; rows
    of empty sequences are not written, the glue puts h0 there))

**Residuals** (the tuple ``res`` handed to :func:`_backward`): the core's inputs
``(q, k, v, G, b, w, h0, meta)`` followed by the intra kernel's products ``(qg, kg, wk, u, Aqk, A)``
(each [N, Tp, HV, K|V|64] io dtype; the forward's :func:`pallas_kernels.channel.intra.channel_intra`
stores A for them). G is named :data:`gdn_jax.remat.GDN_GATE_CUMSUM`, A
:data:`~gdn_jax.remat.GDN_A` and the other five :data:`~gdn_jax.remat.GDN_INTRA`, so remat
policies can save, offload or recompute them. Saving the products spares the backward the intra
kernel (1.5 ms of KDA's fwd+bwd at B4 T4096 HV16 on the H200) for about as many residual bytes
again as the inputs; under ``jax.checkpoint`` with a policy that does not save them, JAX reruns
the forward kernels in the backward instead. :func:`_backward` recomputes h and v_new with
:func:`pallas_kernels.recurrence.chunk_fwd.channel_chunk_fwd` (``store_h=True``; decay_last from
:func:`decay_last`) and returns the cotangents of the inputs:
``(dq, dk, dv, dG, db, dw, dh0, None)`` with dG w.r.t. the cumsum G (the reverse cumsum to dg
happens outside, by autodiff of the glue), db [N, Tp, HV] for KDA and dw None for KDA.

The backward runs the Mosaic GPU backward kernels (:mod:`gdn_jax.ops._channel_pallas_bwd`).
:func:`_xla_core` computes the same core with the xla chunked path: the tests differentiate it as
the backward's reference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from gdn_jax import remat
from gdn_jax.ops import _xla
from gdn_jax.ops._gate_cumsum import clamped_log_decay, lane_gate_cumsum
from gdn_jax.ops._pallas_common import (
    CoreConfig,
    LaneFlags,
    chunk_first_rows,
    from_one_lane,
    from_padded_lanes,
    lane_poison,
    loop_poison,
    one_lane,
    packed_meta,
    padded_lanes,
    poison_state,
    wipe_first_tokens,
)
from gdn_jax.ops._sanitize import Poison, finite
from gdn_jax.ops._segments import (
    lane_segment_count,
    last_segment_state,
    pad_chunks,
    pad_meta,
    segment_entries,
)
from gdn_jax.qat import QATConfig
from gdn_jax.reference._common import chunk_layout, l2norm
from pallas_kernels import _compat as pk
from pallas_kernels._tiles import CHUNK, LoopConfig
from pallas_kernels.channel.intra import channel_intra
from pallas_kernels.channel.plan import ChannelPlan, channel_plan, check_supported
from pallas_kernels.gdn.segment_state import segment_maps
from pallas_kernels.recurrence.chunk_fwd import channel_chunk_fwd

__all__ = ["CHANNEL_PALLAS", "ChannelConfig", "channel_pallas", "decay_last", "lane_gate_cumsum"]

f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class ChannelConfig(CoreConfig):
    """Configuration of the GDN2/KDA core: :class:`CoreConfig` (scale, execution mode, QAT) plus

    Attributes:
      scalar_beta: KDA form (b = w = β per token, b given as [N, Tp, HV], w None).
      segments: the forward's state loop cuts every lane into this many segments that run in
        parallel (:mod:`gdn_jax.ops._segments`; the lane length a multiple of 64 · segments);
        1: the unsplit loop. The backward's loops run unsplit.
    """

    scalar_beta: bool = False
    segments: int = 1

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.scalar_beta, bool):
            raise TypeError(f"{self.scalar_beta=} must be a bool")
        if not isinstance(self.segments, int) or self.segments < 1:
            raise ValueError(f"{self.segments=} must be an int >= 1")
        if self.segments > 1 and self.state_quant is not None:
            raise NotImplementedError("segments > 1 with the QAT state quant (not an affine map)")


def decay_last(G: jax.Array) -> jax.Array:
    """e^{G_last} per chunk and key channel: [N, Tp, HV, K] f32 -> [N, HV, Tp/64, K] f32."""
    N, Tp, HV, K = G.shape
    return jnp.exp(G.reshape(N, Tp // CHUNK, CHUNK, HV, K)[:, :, -1]).transpose(0, 2, 1, 3)


def kernel_beta(b: jax.Array) -> jax.Array:
    """KDA's β as the intra kernel reads it: [N, Tp, HV] -> [N, HV, Tp] (TMA needs unit stride)."""
    return b.transpose(0, 2, 1)


# ---------------------------------------------------------------------------------------------
# custom_vjp core on padded lanes (shapes in the module docstring)


# Kernel launches jitted with the config static: one trace and lowering per distinct layer shape
# (as in gdn_jax.ops._gdn_pallas).


def core_plan(cfg: ChannelConfig, q: jax.Array, v: jax.Array, *, store_a: bool) -> ChannelPlan:
    """The kernels' forms for the core's q [N, Tp, H, K] and v [N, Tp, HV, V]
    (:func:`pallas_kernels.channel.plan.channel_plan`); ``store_a``: a differentiated forward,
    whose plan the backward runs too."""
    K, V = q.shape[-1], v.shape[-1]
    return channel_plan(
        q.dtype,
        K,
        V,
        scalar_beta=cfg.scalar_beta,
        store_a=store_a,
        state_quant=cfg.state_quant,
        w_quant=cfg.w_quant,
    )


@functools.partial(jax.jit, static_argnums=(0, 1))
def _forward(cfg: ChannelConfig, with_products: bool, q, k, v, G, b, w, h0, meta=None, lanes=None):
    """(o, final state, products): products are the intra kernel's ``(qg, kg, wk, u, Aqk, A)``
    (the backward's inputs, A stored by the kernel) when ``with_products``, else None. o gets
    the op's NaN (``lanes``, a :class:`LaneFlags`: the op's flags and the gate cumsum's) as the
    chunk loop stores it, the final state in the heads and columns the gate cumsum's flags
    poison (the op adds its own)."""
    plan = core_plan(cfg, q, v, store_a=with_products)
    V = v.shape[-1]
    with cfg.kernels():
        bk = kernel_beta(b) if cfg.scalar_beta else b
        products = channel_intra(q, k, v, G, bk, w, plan.intra_config())
        # the kernels read non-finite q, k, v as 0; where they were, the op's flags say
        nan_from, end = loop_poison(None, None, lanes, meta, V)
        poison = None
        if nan_from is not None:
            nan_rows = None if lanes is None else lanes.nan_rows
            if nan_rows is None:  # (no bad q flagged: the loop still takes the row vector)
                nan_rows = jnp.zeros((v.shape[0], v.shape[2], v.shape[1]), f32)
            poison = (nan_rows, nan_from)
        qg, kg, wk, u, aqk = products[:5]
        dl, fcfg = decay_last(G), plan.fwd_config(cfg.scale)
        S = cfg.segments
        if S > 1:  # the segment pass, the combine, the loop from every segment's entering state
            B = q.shape[0]
            lcfg = LoopConfig(cfg.scale, segments=S)
            ends = segment_maps(kg, wk, u, dl, h0, lcfg, meta, channel=True)
            h0s, mx, _, _ = segment_entries(ends, B, S, h0, meta)
            fcfg = dataclasses.replace(fcfg, segments=S)
            o, ht = channel_chunk_fwd(qg, kg, wk, u, aqk, dl, h0s, fcfg, mx, poison)
            ht = last_segment_state(ht, B, S, h0, meta)
        else:
            o, ht = channel_chunk_fwd(qg, kg, wk, u, aqk, dl, h0, fcfg, meta, poison)
    ht = poison_state(ht, end)
    return o, ht, (products if with_products else None)


def _core_fwd(cfg, q, k, v, G, b, w, h0, meta, lanes):
    o, ht, products = _forward(cfg, True, q, k, v, G, b, w, h0, meta, lanes)
    G = remat.name(G, remat.GDN_GATE_CUMSUM)
    *products, A = products
    products = (*remat.name(tuple(products), remat.GDN_INTRA), remat.name(A, remat.GDN_A))
    return (o, ht), (q, k, v, G, b, w, h0, meta, *products)


def _xla_core(cfg: ChannelConfig, q, k, v, G, b, w, h0):
    """The same core computed by the xla chunked path (o in f32); a reference for the backward."""
    N, Tp, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    nt = Tp // CHUNK
    ch = lambda x: x.reshape((N, nt, CHUNK) + x.shape[2:])
    Gc = ch(G)
    # per-token increments back from the chunk-local cumsum (linear, so dG follows by autodiff)
    gc = Gc - jnp.pad(Gc[:, :, :-1], [(0, 0), (0, 0), (1, 0), (0, 0), (0, 0)])
    rep = HV // H
    qc, kc = ch(jnp.repeat(q, rep, axis=2)), ch(jnp.repeat(k, rep, axis=2))
    if cfg.scalar_beta:
        bc = wc = ch(b[..., None])
    else:
        bc, wc = ch(b), ch(w)
    layout = chunk_layout(N, Tp, CHUNK, None)
    xcfg = _xla.ChunkConfig(scale=cfg.scale, dtype=jnp.dtype(v.dtype).name, qat=cfg.qat)
    o, ht = _xla.chunked_core(xcfg, qc, kc, ch(v), gc, bc, wc, h0, layout)
    return o.reshape(N, Tp, HV, V), ht


@functools.partial(jax.jit, static_argnums=0)
def _backward(cfg: ChannelConfig, res: tuple, cts: tuple) -> tuple:
    """Gradients of the core: ``(dq, dk, dv, dG, db, dw, dh0, None, None)`` (its inputs; none for
    the table ``meta`` and the flags ``lanes``).

    The Mosaic GPU backward (:func:`gdn_jax.ops._channel_pallas_bwd.channel_backward_pallas`):
    recompute h, v_new with the forward's state kernel, then the reverse state-gradient loop,
    dq/dk/dw per chunk and the WY backward per chunk.

    Args:
      cfg: the core's :class:`ChannelConfig`.
      res: ``(q, k, v, G, b, w, h0, meta, qg, kg, wk, u, Aqk, A)`` as described in the module
        docstring.
      cts: ``(do [N, Tp, HV, V] io dtype, dht [N, HV, K, V] f32)``.
    """
    from gdn_jax.ops._channel_pallas_bwd import channel_backward_pallas

    plan = core_plan(cfg, res[0], res[2], store_a=True)  # the forward's that made res
    do, dht = cts
    q, k, v, G, b, w, h0, meta = res[:8]
    # the forward's kernels read non-finite inputs as 0; the backward's read these copies
    # (sanitising q, k, v, b, w in the dq/dk/dw and WY kernels' register loads instead is slower:
    # GDN2 bf16 B4 T4096 H16 fwd+bwd 5.41 vs 4.85 ms, bench_gdn.py on one H100, same machine)
    q, k, v = (finite(x) for x in (q, k, v))
    if not cfg.scalar_beta:  # (KDA's β is sanitised by the glue)
        b, w = finite(b), finite(w)
    with cfg.kernels():
        grads = channel_backward_pallas(
            q, k, v, G, b, w, h0, res[8:], do, dht, meta, scale=cfg.scale, plan=plan
        )
    return (*grads, None, None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(cfg: ChannelConfig, q, k, v, G, b, w, h0, meta=None, lanes=None):
    return _forward(cfg, False, q, k, v, G, b, w, h0, meta, lanes)[:2]


# No optimize_remat: it would hide the residuals' checkpoint names from remat/offload policies
# (and the interpreter's ordered host callbacks reject it).
_core.defvjp(_core_fwd, _backward)


# ---------------------------------------------------------------------------------------------
# public glue


# smallest per-token log-decay the kernels see (see channel_pallas)
MIN_LOG_DECAY = -10.0


def channel_pallas(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    b: jax.Array,
    w: jax.Array,
    *,
    scale: float,
    initial_state: jax.Array | None,
    output_final_state: bool,
    use_qk_l2norm: bool,
    cu_seqlens: jax.Array | None,
    chunk_size: int,
    qat: QATConfig | None = None,
    poison: Poison | None = None,
    segments: int | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """GDN2 / KDA on the Mosaic GPU kernels; inputs already validated by the public op.

    The inputs may hold NaN and ±inf (the public op passes them raw and poisons the results
    itself, :mod:`gdn_jax.ops._sanitize`): the kernels read non-finite q, k, v, b, w values as 0
    and g is clamped here, the replacements of the op's sanitation, with the same straight-through
    derivatives.

    Args:
      q, k: [B, T, H, K] bf16 or f16; v: [B, T, HV, V] in q's dtype.
      g: [B, T, HV, K] per-channel log-decay (f32 or 16-bit).
      b: [B, T, HV, K] erase gate, or [B, T, HV, 1] (KDA's β, broadcast).
      w: [B, T, HV, V] write gate, or [B, T, HV, 1] (KDA's β).
      scale, initial_state ([N, HV, K, V] f32 or None), output_final_state, use_qk_l2norm,
      cu_seqlens ([N + 1] int32, B == 1), chunk_size (64): as the public ops.
      qat: optional FP8 fake quantisation of w and the chunk-entering states (fused).
      poison: the op's :class:`~gdn_jax.ops._sanitize.Poison` of q, k, v and the gates (the
        kernels read their non-finite values as 0), or None. The chunk loop puts it into o,
        with the bad values the gate cumsum finds in g, as it stores o; the final
        state gets the kernels' part (the op adds its own).
      segments: how many segments the forward's state loop cuts each lane into (run in
        parallel); None: :func:`gdn_jax.ops._segments.segment_count` of the lanes and the
        device's SM count (1 with the QAT state quant, whose loop is not affine in the state).
    Returns:
      (o [B, T, HV, V] in v.dtype, final state [N, HV, K, V] f32 or None).
    Raises:
      NotImplementedError: dtype/head size/chunk size/QAT/platform not served by these kernels.
    """
    if qat is not None and qat.fmt != "e4m3":
        raise NotImplementedError(f"{qat.fmt=}: the Pallas kernels fuse only the e4m3 fake quant")
    cfg = ChannelConfig(scale=float(scale), mode=pk.execution_mode(), qat=qat)
    packed_states = cu_seqlens is not None and (initial_state is not None or output_final_state)
    check_supported(
        q.dtype,
        q.shape[-1],
        v.shape[-1],
        chunk_size,
        state_quant=cfg.state_quant,
        packed_states=packed_states,
    )
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scalar = b.shape[-1] == 1 and w.shape[-1] == 1
    if scalar:  # KDA: b and w are the same β; read it once (sanitised here: it is small)
        b, w = finite(b[..., 0].astype(f32)), None
    else:
        b = jnp.broadcast_to(b, (B, T, HV, K)).astype(f32)
        w = jnp.broadcast_to(w, (B, T, HV, V)).astype(f32)
    # decays below e^{-10} per token are clamped: the kernels factor the channel decay around a
    # reference row 8 tokens away at most, so |exponent| <= 80 < log(f32 max) always holds; the
    # clamp changes the state by at most e^{-10} ≈ 4.5e-5 of its size, below bf16 resolution.
    # The gate cumsum kernel clamps the raw g as it reads it (clamped_log_decay), except where
    # the packed lane's state wipe must be added to the clamped values first.
    g = jnp.broadcast_to(g, (B, T, HV, K)).astype(f32)
    cfg = dataclasses.replace(cfg, scalar_beta=scalar)
    if use_qk_l2norm:  # the replacement fuses into the l2norm's pass
        q, k = l2norm(finite(q)), l2norm(finite(k))
    xs = [q, k, v, g, b] + ([] if scalar else [w])

    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    h0 = jnp.zeros((N, HV, K, V), f32) if initial_state is None else initial_state.astype(f32)
    meta = chunk_seq = g_first = None
    floor = MIN_LOG_DECAY  # (None where g is clamped already)
    if segments is None:
        segments = _segments_for(cfg, B, T, HV, K, V, q.dtype, cu_seqlens)
    if not isinstance(segments, int) or segments < 1:
        raise ValueError(f"{segments=} must be None or an int >= 1")
    if cu_seqlens is None:  # one zero-padded lane per batch row
        Tp = -(-T // CHUNK) * CHUNK
        xp = padded_lanes(xs, None, T, Tp)
        lp = lane_poison(poison, None, T, Tp, q_rows=True)
        nan_rows, nan_from = lp or (None, None)
    else:  # all sequences back to back on one lane, each starting at a chunk boundary
        xp, layout = one_lane(xs, cu_seqlens, T, segments)
        lp = lane_poison(poison, cu_seqlens, T, 0, layout, q_rows=True)
        nan_rows, nan_from = lp or (None, None)
        chunk_seq = layout.seq[0]
        if initial_state is None and not output_final_state:  # the state wiped at each start
            # (the raw g's bad rows first: the clamp hides them from the cumsum kernel)
            g_first = chunk_first_rows(jnp.any(~(xp[3] < jnp.inf), axis=-1), 1).transpose(0, 2, 1)
            xp[3] = wipe_first_tokens(clamped_log_decay(xp[3], MIN_LOG_DECAY), layout)
            floor = None
            h0 = jnp.zeros((1, HV, K, V), f32)
        else:  # states set / written per sequence by the kernels, from a per-chunk table
            meta = packed_meta(layout)
    rows = xp[0].shape[1]
    cfg = dataclasses.replace(cfg, segments=segments)
    lanes = LaneFlags(nan_rows, nan_from, g_first, chunk_seq)
    if rows % (CHUNK * segments):  # lanes of a multiple of 64 · segments rows (inert zero rows)
        xp = pad_chunks(xp, (1,) * len(xp), segments)
        pad = xp[0].shape[1] // CHUNK - rows // CHUNK
        meta = pad_meta(meta, pad)
        lanes = lanes.pad(pad)
    qp, kp, vp, gp, bp = xp[:5]
    wp = None if scalar else xp[5]
    if floor is None:
        G = lane_gate_cumsum(gp)
    else:  # the raw g: the cumsum clamps it and finds its bad rows
        G, g_first = lane_gate_cumsum(gp, floor)
        lanes = lanes._replace(g_first=g_first)
    o, ht = _core(cfg, qp, kp, vp, G, bp, wp, h0, meta, lanes)
    o = o[:, :rows]

    if cu_seqlens is None:
        return from_padded_lanes(o, None, T).astype(v.dtype), (ht if output_final_state else None)
    if meta is not None:
        ht = jnp.where(layout.empty[:, None, None, None], h0, ht)  # empty: final = initial
    return from_one_lane(o, layout, T).astype(v.dtype), (ht if output_final_state else None)


def _segments_for(cfg: ChannelConfig, B: int, T: int, HV: int, K: int, V: int, dtype, cu_seqlens):
    """The default segment count of the forward's state loop: from the lanes the kernels will
    run (one lane of about T + 64 N rows with ``cu_seqlens``, else B lanes of T) and the device's
    SM count (1 with the QAT state quant, whose loop is not affine in the state)."""
    if cfg.state_quant is not None:
        return 1
    plan = channel_plan(dtype, K, V, scalar_beta=cfg.scalar_beta, store_a=False)
    return lane_segment_count(B, T, HV, V // plan.block_v, cu_seqlens)


CHANNEL_PALLAS = {"kda": channel_pallas, "gdn2": channel_pallas}
