"""``implementation="pallas"`` of :func:`gdn_jax.gated_delta_rule`: glue around the Mosaic GPU
kernels.

Layout work happens outside the ``custom_vjp`` in plain jnp (JAX differentiates it): padding T to a
multiple of 64 (with ``cu_seqlens``: all sequences on one lane, each starting at a chunk boundary,
so chunks never straddle sequences; the kernels reset the state at each sequence's first chunk, by a
wipe gate when all initial states are zero and no final state is asked for, else from a per-chunk
table of sequence ids), the chunk-local gate cumsum and the transposes of g and β to ``[B, HV, T]``
(TMA needs a unit last stride). Padded rows are inert: k = v = q = 0, β = 0 and a zero gate
increment, so the cumulative gate of a padded row is that of the last valid row.

The ``custom_vjp`` core (:func:`_core`) runs on those padded lanes, L2-normalising q and k first
when asked (the backward kernels' f32 gradient parts then go straight into the norm's backward
kernel). Its residuals are the inputs (and the normalised q, k), the gate cumsum (named
:data:`gdn_jax.remat.GDN_GATE_CUMSUM`) and the initial state; the backward recomputes A, w, u, the
per-chunk states h and v_new with the forward kernels (with QAT: the same fake-quantised w and
states as the forward). io dtypes: bf16 and f16 (f16 stages the f32 state and its gradient through
per-column/row scaled f16 operands; see ``pallas_kernels.gdn.fake_quant``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from gdn_jax import remat
from gdn_jax.ops._pallas_common import (
    CoreConfig,
    LaneFlags,
    from_one_lane,
    from_padded_lanes,
    lane_poison,
    loop_poison,
    one_lane,
    packed_meta,
    padded_lanes,
    poison_state,
    wipe_first_tokens,
    zero_sequences_without_chunks,
)
from gdn_jax.ops._sanitize import Poison, finite
from gdn_jax.ops._segments import (
    lane_segment_count,
    last_segment_state,
    pad_chunks,
    pad_meta,
    segment_end_cotangents,
    segment_entries,
    segment_tables,
)
from gdn_jax.qat import QATConfig
from gdn_jax.reference._common import L2NORM_EPS
from gdn_jax.reference.chunked import gate_cumsum
from pallas_kernels import _compat as pk
from pallas_kernels._tiles import CHUNK, LoopConfig
from pallas_kernels.gdn.bwd_dqkw import bwd_dqkw
from pallas_kernels.gdn.bwd_wy import bwd_wy
from pallas_kernels.gdn.intra import IntraConfig, intra_chunk
from pallas_kernels.gdn.segment_state import segment_maps
from pallas_kernels.l2norm import l2norm_bwd, l2norm_fwd
from pallas_kernels.recurrence.bwd_dh import chunk_bwd_dh
from pallas_kernels.recurrence.chunk_fwd import ChunkFwdConfig, chunk_fwd

__all__ = ["gated_delta_rule_pallas", "PallasConfig"]

f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class PallasConfig(CoreConfig):
    """Configuration of the GDN core: :class:`CoreConfig` plus

    Attributes:
      segments: the chunk loops cut every lane into this many segments that run in parallel
        (:mod:`gdn_jax.ops._segments`); 1: the unsplit loops. The core's lane length must be a
        multiple of 64 · segments.
      qk_l2norm: the core L2-normalises q and k itself (:mod:`pallas_kernels.l2norm`: one pass
        forward; backward from the f32 gradient parts of the backward kernels, GVA heads summed).
    """

    segments: int = 1
    qk_l2norm: bool = False

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.segments, int) or self.segments < 1:
            raise ValueError(f"{self.segments=} must be an int >= 1")
        if self.segments > 1 and self.state_quant is not None:
            raise NotImplementedError("segments > 1 with the QAT state quant (not an affine map)")

    def fwd_config(self, V: int, **kw) -> ChunkFwdConfig:
        """The chunk loop's config; a 'matrix' state scale needs the whole state in one CTA."""
        block_v = V if self.state_quant == "matrix" else 64
        return ChunkFwdConfig(
            scale=self.scale,
            block_v=block_v,
            state_quant=self.state_quant,
            segments=self.segments,
            **kw,
        )

    def loop_config(self) -> LoopConfig:
        """The config of the reverse chunk loop and of the segment pass."""
        return LoopConfig(self.scale, segments=self.segments)


# ---------------------------------------------------------------------------------------------
# custom_vjp core on padded lanes: q, k [B, T, H, K]; v [B, T, HV, V]; G, beta [B, HV, T] f32;
# h0 [B, HV, K, V] f32.  T % 64 == 0.  With ``meta`` ([T/64, META_COLS] int32, packed sequences
# on one lane, B == 1) h0 and the final state are [N, HV, K, V], set/written per sequence in-kernel.


# The kernel launches of the forward and the backward are jitted with the config static, so the
# GDN layers of a model share one trace and one lowering of each kernel (and, the modules being
# identical, one Mosaic GPU compile: see pallas_kernels._compat._install_stable_kernel_modules).


@functools.partial(jax.jit, static_argnums=0)
def _normalized(cfg, q, k):
    """q and k as the kernels read them: L2-normalised per head row when ``cfg.qk_l2norm`` (k's
    non-finite values read as 0; q's rows with one come out NaN, as the raw q's reach the chunk
    loop, which finds them from q kᵀ)."""
    if not cfg.qk_l2norm:
        return q, k
    with cfg.kernels():
        return tuple(
            l2norm_fwd(x.reshape(-1, x.shape[-1]), eps=L2NORM_EPS, nan_rows=i == 0).reshape(x.shape)
            for i, x in enumerate((q, k))
        )


def _intra(cfg, k, v, G, beta, meta, lanes):
    """w, u, the chunk loop's poison inputs (:func:`gdn_jax.ops._pallas_common.loop_poison`: the
    intra kernel's flags of k and v with ``lanes``) and the final state's NaN."""
    (w, u), (k_bad, v_first) = intra_chunk(k, v, G, beta, IntraConfig(w_quant=cfg.w_quant))
    nan_from, end = loop_poison(k_bad, v_first, lanes, meta, v.shape[-1])
    return w, u, (None, nan_from), end


@functools.partial(jax.jit, static_argnums=0)
def _forward(cfg, q, k, v, G, beta, h0, meta, lanes):
    with cfg.kernels():
        w, u, poison, end = _intra(cfg, k, v, G, beta, meta, lanes)
        if cfg.segments > 1:
            o, ht, _ = _segmented_loop(cfg, q, k, w, u, G, h0, meta, poison, all_segments=False)
        else:
            o, ht = chunk_fwd(q, k, w, u, G, h0, cfg.fwd_config(v.shape[-1]), meta, poison)
    return o, poison_state(ht, end)


@functools.partial(jax.jit, static_argnums=0)
def _segmented_forward(cfg, q, k, v, G, beta, h0, meta, lanes):
    with cfg.kernels():
        w, u, poison, end = _intra(cfg, k, v, G, beta, meta, lanes)
        o, ht, seg = _segmented_loop(cfg, q, k, w, u, G, h0, meta, poison, all_segments=True)
    return o, poison_state(ht, end), seg


def _segmented_loop(cfg, q, k, w, u, G, h0, meta, poison, *, all_segments):
    """Segment pass, combine and the chunk loop from every segment's true initial state.

    Returns:
      (o, final state (as :func:`chunk_fwd`'s without segments), (starts [B, S, HV, K, V],
      maps [B, R, HV, K, K] with R = S with ``all_segments`` else S − 1)).
    """
    B, V = u.shape[0], u.shape[-1]
    ends = segment_maps(k, w, u, G, h0, cfg.loop_config(), meta, all_segments=all_segments)
    h0s, mx, starts, maps = segment_entries(ends, B, cfg.segments, h0, meta)
    o, ht = chunk_fwd(q, k, w, u, G, h0s, cfg.fwd_config(V), mx, poison)
    return o, last_segment_state(ht, B, cfg.segments, h0, meta), (starts, maps)


def _core_fwd(cfg, q, k, v, G, beta, h0, meta, lanes):
    raw = (q, k) if cfg.qk_l2norm else None  # the l2norm backward recomputes from these
    q, k = _normalized(cfg, q, k)
    if cfg.segments > 1:
        o, ht, seg = _segmented_forward(cfg, q, k, v, G, beta, h0, meta, lanes)
        seg = tuple(remat.name(x, remat.GDN_CHUNK_STATES) for x in seg)
    else:
        (o, ht), seg = _forward(cfg, q, k, v, G, beta, h0, meta, lanes), None
    G = remat.name(G, remat.GDN_GATE_CUMSUM)
    return (o, ht), (q, k, v, G, beta, h0, meta, seg, raw)


@functools.partial(jax.jit, static_argnums=0)
def _core_bwd(cfg, res, cts):
    # five launches: recompute (A, w, u), recompute (h, v_new), reverse dh loop with dv2,
    # dq/dk/dw per chunk, WY backward per chunk; XLA only sums GVA heads and gate pieces. With
    # segments the two loops run per segment (plus the reverse segment pass and the combine).
    q, k, v, G, beta, h0, meta, seg, raw = res
    # the forward's kernels read non-finite k, v as 0 (the normalised k is finite) and q's reach
    # only their own rows of o; the backward's state loops read these copies of q and k (the WY
    # kernels read v's raw values as 0 themselves)
    q = finite(q)
    k = k if raw is not None else finite(k)
    do, dht = cts
    B, T, H, K = q.shape
    HV = v.shape[2]
    grp = HV // H
    nt = T // CHUNK
    dt = q.dtype
    scale = cfg.scale
    # dq and dk leave the kernels in the io dtype unless value heads are summed or the l2norm
    # backward takes them (then f32)
    gdt = dt if grp == 1 and raw is None else f32
    with cfg.kernels():
        # the same kernels and configs as the forward: w and h are the quantised values it used
        w, u, A = intra_chunk(k, v, G, beta, IntraConfig(store_a=True, w_quant=cfg.w_quant))[0]
        if seg is None:
            h, vn = chunk_fwd(None, k, w, u, G, h0, cfg.fwd_config(v.shape[-1], store_h=True), meta)
            dh_k, dv2_k, dh0 = chunk_bwd_dh(q, k, w, do.astype(dt), G, dht, LoopConfig(scale), meta)
        else:
            h, vn, dh_k, dv2_k, dh0 = _segmented_bwd_loops(
                cfg, q, k, w, u, do.astype(dt), G, h0, dht, meta, seg
            )
        dq, dk_s, dw, dg_a, rs, hd = bwd_dqkw(
            q, k, h, dh_k, vn, do.astype(dt), dv2_k, G, scale=scale, dq_dtype=gdt
        )
        dk, dv, dbeta, dg_r, dg_c = bwd_wy(k, v, A, G, beta, dw, dv2_k, dk_s, dk_dtype=gdt)

    def fold(x):  # [B, T, HV, K] -> [B, T, H, K], summing the value heads of a q/k head
        return x.reshape(B, T, H, grp, K).sum(3) if grp > 1 else x

    if raw is None:
        dq = fold(dq).astype(q.dtype)
        dk = fold(dk).astype(k.dtype)
    else:  # through the l2norm: one kernel each, summing the value heads
        rows = lambda x: x.reshape(B * T * H, -1, K)
        with cfg.kernels():
            dq, dk = (
                l2norm_bwd(x.reshape(B * T * H, K), (rows(d),), eps=L2NORM_EPS).reshape(B, T, H, K)
                for x, d in zip(raw, (dq, dk), strict=True)
            )
    # the chunk's last row also gets e^{G_last} <h, dh> + Σ_i Σ_k dk_state ⊙ k
    Gl = G.reshape(B, HV, nt, CHUNK)[..., -1]
    last = rs.reshape(B, HV, nt, CHUNK).sum(-1) + jnp.exp(Gl) * hd.sum(-1)
    # (added in the sum's elementwise pass: a scatter into the last rows would be a pass of its own)
    at_last = jnp.arange(CHUNK) == CHUNK - 1
    dG = (dg_a + dg_r - dg_c).reshape(B, HV, nt, CHUNK) + jnp.where(at_last, last[..., None], 0.0)
    dG = dG.reshape(B, HV, T)
    if meta is not None:  # rows of sequences without chunks were never written
        dh0 = zero_sequences_without_chunks(dh0, meta)
    return dq, dk, dv.astype(v.dtype), dG, dbeta, dh0, None, None


def _segmented_bwd_loops(cfg, q, k, w, u, do, G, h0, dht, meta, seg):
    """The backward's two chunk loops on segments: the state recomputation from the saved segment
    starts, the reverse loop's segment pass (start cotangents from zero end cotangents), the
    reverse combine with the transposed maps, and the reverse loop from every segment's true end
    cotangent. Returns (h, v_new, dh, dv2, dh0) as the unsplit loops do."""
    starts, maps = seg
    B, S, HV, K, V = starts.shape
    h0s, mx, first_seq = segment_tables(starts, h0, meta)
    h, vn = chunk_fwd(None, k, w, u, G, h0s, cfg.fwd_config(V, store_h=True), mx)
    lcfg = cfg.loop_config()
    zeros = jnp.zeros((S,) + dht.shape[1:] if meta is not None else (B * S,) + dht.shape[1:], f32)
    if meta is None:
        d = chunk_bwd_dh(q, k, w, do, G, zeros, lcfg, None, state_only=True)
        d = d.reshape((B, S) + d.shape[1:])
        dE = segment_end_cotangents(maps, d, dht)
        dht_s = dE.reshape((B * S,) + dE.shape[2:])
    else:
        N = dht.shape[0]
        d = chunk_bwd_dh(q, k, w, do, G, jnp.concatenate([dht, zeros]), lcfg, mx, state_only=True)
        # rows N + j are written only where segment j does not start with a sequence (else its
        # entering state is irrelevant: d_j = 0, and M_j = 0)
        d = jnp.where(first_seq[:, None, None, None], 0.0, d[N:])[None]
        dE = segment_end_cotangents(maps, d, None)
        dht_s = jnp.concatenate([dht, dE[0]])
    dh_k, dv2_k, dh0 = chunk_bwd_dh(q, k, w, do, G, dht_s, lcfg, mx)
    dh0 = dh0.reshape((B, S) + dh0.shape[1:])[:, 0] if meta is None else dh0[: h0.shape[0]]
    return h, vn, dh_k, dv2_k, dh0


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(cfg: PallasConfig, q, k, v, G, beta, h0, meta=None, lanes=None):
    return _core_fwd(cfg, q, k, v, G, beta, h0, meta, lanes)[0]


# No optimize_remat: it would hide the residuals' checkpoint names from remat/offload policies
# (and the interpreter's ordered host callbacks reject it).
_core.defvjp(_core_fwd, _core_bwd)


# ---------------------------------------------------------------------------------------------
# public glue


def _unsupported(q, v, chunk_size, qat=None) -> str | None:
    if qat is not None and qat.fmt != "e4m3":
        return f"{qat.fmt=}: the Pallas kernels fuse only the e4m3 fake quant"
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"{q.dtype=}: the Pallas kernels take bf16 and f16 (f32 runs on 'xla')"
    if q.dtype == jnp.float16 and qat is not None and qat.state_granularity == "matrix":
        # one CTA per whole state (block_v = V = 128) has no SMEM left for f16's f32 h tiles
        if "state" in qat.sites and v.shape[-1] > 64:
            return "f16 with the QAT state granularity 'matrix' and V = 128 (use 'column')"
    if q.shape[-1] not in (64, 128) or v.shape[-1] not in (64, 128):
        return f"{q.shape=} {v.shape=}: the Pallas kernels need K and V in {{64, 128}}"
    if chunk_size != CHUNK:
        return f"{chunk_size=}: the Pallas kernels use chunks of {CHUNK}"
    mode = pk.execution_mode()
    if mode == "auto" and not pk.is_hopper():
        return "no Hopper GPU (and the Mosaic GPU interpreter was not requested)"
    return None


def gated_delta_rule_pallas(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float,
    initial_state: jax.Array | None,
    output_final_state: bool,
    use_qk_l2norm: bool,
    cu_seqlens: jax.Array | None,
    chunk_size: int,
    qat: QATConfig | None = None,
    segments: int | None = None,
    poison: Poison | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """GDN on the Mosaic GPU kernels; inputs already validated by :func:`gdn_jax.gated_delta_rule`.

    The op passes q, k and v raw (it poisons the results itself, :mod:`gdn_jax.ops._sanitize`):
    the kernels read their non-finite values as 0 (the sanitation's replacement, with its
    straight-through derivative); g and β come sanitised.

    Args:
      q, k: [B, T, H, K] bf16/f16; v: [B, T, HV, V] same dtype.
      g, beta: [B, T, HV] f32.
      scale: query scale.
      initial_state: [N, HV, K, V] f32 or None.
      output_final_state: return the final state [N, HV, K, V] f32 (else None).
      use_qk_l2norm: L2-normalise q and k over K first (differentiable).
      cu_seqlens: [N + 1] int32 with B == 1, or None.
      chunk_size: must be 64.
      qat: optional FP8 fake quantisation of w and the chunk-entering state (fused).
      segments: how many segments the chunk loops cut each lane into (run in parallel); None:
        :func:`gdn_jax.ops._segments.segment_count` of the lanes and the device's SM count
        (1 with the QAT state quant, whose loop is not affine in the state).
      poison: the op's :class:`~gdn_jax.ops._sanitize.Poison` of what the kernels do not read
        (the gates; k under the L2 norm), or None. The chunk loop puts it into o, with the bad
        values the intra kernel finds in k and v and the loop in q, as it stores o; the final
        state gets the kernels' part (the op adds its own).
    Returns:
      (o [B, T, HV, V] in v.dtype, final state or None).
    Raises:
      NotImplementedError: dtype/head size/chunk size/platform not served by these kernels.
    """
    why = _unsupported(q, v, chunk_size, qat)
    if why is not None:
        raise NotImplementedError(why)
    cfg = PallasConfig(scale=float(scale), mode=pk.execution_mode(), qat=qat)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if segments is None:
        segments = _segments_for(cfg, B, T, HV, V, cu_seqlens)
    if not isinstance(segments, int) or segments < 1:
        raise ValueError(f"{segments=} must be None or an int >= 1")
    cfg = dataclasses.replace(cfg, segments=segments, qk_l2norm=bool(use_qk_l2norm))
    Tp = -(-T // CHUNK) * CHUNK
    if cu_seqlens is not None and initial_state is None and not output_final_state:
        return _packed_one_lane(cfg, q, k, v, g, beta, cu_seqlens, poison), None
    if cu_seqlens is not None and cfg.fwd_config(V).block_v == 64:
        o, ht = _packed_states(cfg, q, k, v, g, beta, cu_seqlens, initial_state, poison)
        return o, (ht if output_final_state else None)

    # one zero-padded lane per batch row, or per sequence (costs N * T tokens of work; only where
    # the single-lane kernels cannot serve: block_v = 128)
    if cu_seqlens is not None and cfg.state_quant is not None:
        # each whole padding chunk after a shorter sequence would quantise its state once more:
        # its final state would be the quantised one (an empty sequence's, the quantised h0)
        raise NotImplementedError(
            "packed sequences with states and the QAT state granularity 'matrix' at V = 128 "
            "(the xla path serves them)"
        )
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    qp, kp, vp, gp, bp = padded_lanes((q, k, v, g, beta), cu_seqlens, T, Tp)

    h0 = jnp.zeros((N, HV, K, V), f32) if initial_state is None else initial_state.astype(f32)
    Gp, bp = _kernel_gates(gp, bp)
    o, ht = _run_core(cfg, qp, kp, vp, Gp, bp, h0, None, _lanes(poison, cu_seqlens, T, Tp))
    o = from_padded_lanes(o, cu_seqlens, T)
    return o.astype(v.dtype), (ht if output_final_state else None)


def _segments_for(cfg: PallasConfig, B: int, T: int, HV: int, V: int, cu_seqlens) -> int:
    """The default segment count: from the lanes the kernels will run (one lane of about
    T + 64 N rows with ``cu_seqlens``, else B lanes of T) and the device's SM count."""
    if cfg.state_quant is not None:
        return 1
    return lane_segment_count(B, T, HV, V // cfg.fwd_config(V).block_v, cu_seqlens)


def _lanes(poison: Poison | None, cu_seqlens, T: int, Tp: int, layout=None) -> LaneFlags:
    """The core's :class:`~gdn_jax.ops._pallas_common.LaneFlags` from the op's Poison of what
    the kernels do not read (the gates; k under the L2 norm): dense lanes (a lane per batch row
    or sequence, ``Tp`` rows) or, with ``layout``, the one lane of packed sequences."""
    nan_from = None
    if poison is not None:
        nan_from = lane_poison(poison, cu_seqlens, T, Tp, layout, q_rows=False)[1]
    return LaneFlags(None, nan_from, None, None if layout is None else layout.seq[0])


def _run_core(cfg: PallasConfig, q, k, v, G, beta, h0, meta, lanes: LaneFlags):
    """:func:`_core` on lanes padded to a multiple of ``64 · cfg.segments`` rows (inert zero rows;
    the per-chunk table gets -1 rows, the flags none); o is cut back to the lanes' rows."""
    rows = q.shape[1]
    if rows % (CHUNK * cfg.segments):  # (packed lanes come sized for the segments)
        q, k, v, G, beta = pad_chunks((q, k, v, G, beta), (1, 1, 1, 2, 2), cfg.segments)
        pad = q.shape[1] // CHUNK - rows // CHUNK
        meta = pad_meta(meta, pad)
        lanes = lanes.pad(pad)
    o, ht = _core(cfg, q, k, v, G, beta, h0, meta, lanes)
    return o[:, :rows], ht


def _kernel_gates(g: jax.Array, beta: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Lane gates [N, rows, HV] (rows % 64 == 0) as the kernels read them: the chunk-local
    cumulative log-decay G and β, both [N, HV, rows] f32."""
    N, rows, HV = g.shape
    G = gate_cumsum(g.reshape(N, rows // CHUNK, CHUNK, HV))
    return G.reshape(N, rows, HV).transpose(0, 2, 1), beta.astype(f32).transpose(0, 2, 1)


def _packed_one_lane(cfg, q, k, v, g, beta, cu_seqlens, poison):
    """Packed sequences with zero initial states and no final states, on a single lane.

    Sequences sit back to back, each starting at a chunk boundary (T + 64 N rows at most, instead
    of N T for one lane per sequence). The state is reset at every sequence start by the wipe gate
    on the sequence's first token: the decayed old state is exactly zero, and since that token's
    true decay multiplies a zero initial state, no output or gradient changes.
    """
    T = q.shape[1]
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    (qp, kp, vp, gp, bp), layout = one_lane((q, k, v, g, beta), cu_seqlens, T, cfg.segments)
    Gp, bp = _kernel_gates(wipe_first_tokens(gp, layout), bp)
    h0 = jnp.zeros((1, HV, K, V), f32)
    o, _ = _run_core(cfg, qp, kp, vp, Gp, bp, h0, None, _lanes(poison, cu_seqlens, T, 0, layout))
    return from_one_lane(o, layout, T).astype(v.dtype)


def _packed_states(cfg, q, k, v, g, beta, cu_seqlens, initial_state, poison):
    """Packed sequences with initial and/or final states, on a single lane.

    Sequences sit back to back, each starting at a chunk boundary (as in
    :func:`_packed_one_lane`); the kernels set the state to ``h0[n]`` at sequence n's first chunk
    and write its final state at its last chunk (the backward mirrors both), driven by a per-chunk
    table of sequence ids. Work is T + 64 N rows instead of N T.
    """
    T = q.shape[1]
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    N = cu_seqlens.shape[0] - 1
    (qp, kp, vp, gp, bp), layout = one_lane((q, k, v, g, beta), cu_seqlens, T, cfg.segments)
    Gp, bp = _kernel_gates(gp, bp)
    h0 = jnp.zeros((N, HV, K, V), f32) if initial_state is None else initial_state.astype(f32)
    lanes = _lanes(poison, cu_seqlens, T, 0, layout)
    o, ht = _run_core(cfg, qp, kp, vp, Gp, bp, h0, packed_meta(layout), lanes)
    ht = jnp.where(layout.empty[:, None, None, None], h0, ht)  # empty: final = initial
    return from_one_lane(o, layout, T).astype(v.dtype), ht
