"""What the two Pallas glue modules (:mod:`gdn_jax.ops._gdn_pallas` for GDN,
:mod:`gdn_jax.ops._channel_pallas` for KDA / GDN2) share: the static config of their cores and
the lane layouts the kernels run on.

Lanes: the kernels run over ``[N, Tp, ...]`` arrays whose rows are 64-token chunks. Dense inputs
get one zero-padded lane per batch row (:func:`padded_lanes`); packed sequences (``cu_seqlens``)
go back to back on one lane, each starting at a chunk boundary (:func:`one_lane`, T + 64 N rows
at most), with the state reset at each sequence's first chunk either by a wiping gate
(:func:`wipe_first_tokens`, when all initial states are zero and no final state is asked for) or
by the chunk loops from a per-chunk table of sequence ids (:func:`packed_meta`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from gdn_jax.ops._sanitize import Poison
from gdn_jax.qat import QATConfig
from gdn_jax.reference._common import (
    ChunkLayout,
    chunk_layout,
    from_chunks,
    permute_rows,
    sequence_ids,
    to_chunks,
)
from pallas_kernels import _compat as pk
from pallas_kernels._tiles import CHUNK, META_COLS

__all__ = [
    "CoreConfig",
    "LaneFlags",
    "chunk_first_rows",
    "WIPE_LOG_DECAY",
    "from_one_lane",
    "from_padded_lanes",
    "lane_poison",
    "loop_poison",
    "one_lane",
    "packed_meta",
    "padded_lanes",
    "poison_state",
    "wipe_first_tokens",
    "zero_sequences_without_chunks",
]

f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class CoreConfig:
    """Static (non-differentiable) configuration shared by the Pallas cores.

    Attributes:
      scale: query scale.
      mode: kernel execution mode captured at call time (``"auto"``, ``"gpu"``, ``"interpret"``).
      qat: optional QAT fake quantisation, fused into the kernels: w in the intra kernel, the
        chunk-entering state in the chunk loop (forward and the backward's recomputation, so the
        backward sees exactly the quantised values of the forward; gradients pass straight
        through, as in the xla path).
    """

    scale: float
    mode: str = "auto"
    qat: QATConfig | None = None

    def __post_init__(self):
        if not isinstance(self.scale, float):
            raise TypeError(f"{self.scale=} must be a Python float")
        if self.mode not in ("auto", "gpu", "interpret"):
            raise ValueError(f"{self.mode=} must be 'auto', 'gpu' or 'interpret'")
        if self.qat is not None and not isinstance(self.qat, QATConfig):
            raise TypeError(f"{self.qat=} must be a gdn_jax.qat.QATConfig or None")

    def kernels(self):
        """Context that makes the kernels traced inside it use the configured execution mode."""
        return pk.use_mode(self.mode)

    @property
    def w_quant(self) -> str | None:
        """Granularity of the w fake quant in the intra kernel (None: off)."""
        q = self.qat
        return q.w_granularity if q is not None and "w" in q.sites else None

    @property
    def state_quant(self) -> str | None:
        """Granularity of the state fake quant in the chunk loop (None: off)."""
        q = self.qat
        return q.state_granularity if q is not None and "state" in q.sites else None


def padded_lanes(xs, cu_seqlens, T: int, Tp: int) -> list[jax.Array]:
    """One zero-padded lane per batch row (dense) or per packed sequence: [N, Tp, ...] each.

    Args:
      xs: arrays [B, T, ...] (B == 1 with ``cu_seqlens``).
      cu_seqlens: [N + 1] int32 or None.
      T, Tp: tokens and the padded lane length (a multiple of 64, ≥ the longest sequence).
    """
    if cu_seqlens is None:
        return [jnp.pad(x, [(0, 0), (0, Tp - T)] + [(0, 0)] * (x.ndim - 2)) for x in xs]
    idx, inv = _lane_rows(cu_seqlens, T, Tp)
    N = cu_seqlens.shape[0] - 1
    return [permute_rows(x[0], idx, inv).reshape((N, Tp) + x.shape[2:]) for x in xs]


def from_padded_lanes(o: jax.Array, cu_seqlens: jax.Array | None, T: int) -> jax.Array:
    """Inverse of :func:`padded_lanes` for an output [N, Tp, ...]: [B, T, ...] (B == 1 packed)."""
    if cu_seqlens is None:
        return o[:, :T]
    idx, inv = _lane_rows(cu_seqlens, T, o.shape[1])
    return permute_rows(o.reshape((-1,) + o.shape[2:]), inv, idx)[None]


def _lane_rows(cu_seqlens: jax.Array, T: int, Tp: int) -> tuple[jax.Array, jax.Array]:
    """For one lane of Tp rows per packed sequence: the token of every lane row ([N Tp], -1 past
    its sequence's end) and the lane row of every token ([T])."""
    cu = cu_seqlens.astype(jnp.int32)
    tok = cu[:-1, None] + jnp.arange(Tp, dtype=jnp.int32)[None, :]  # [N, Tp]
    tok = jnp.where(tok < cu[1:, None], tok, -1).reshape(-1)
    seq = sequence_ids(cu, T)
    return tok, seq * Tp + jnp.arange(T, dtype=jnp.int32) - cu[seq]


# log-decay given to the first token of every packed sequence on one lane: e^{-200} underflows to
# 0 in f32, so the carried state is wiped, while differences G_i - G_j inside the chunk (all the
# kernels use besides e^{G}) keep ~1e-5 accuracy
WIPE_LOG_DECAY = -200.0


def one_lane(
    xs, cu_seqlens: jax.Array, T: int, segments: int = 1
) -> tuple[list[jax.Array], ChunkLayout]:
    """Packed sequences back to back on one lane, each starting at a chunk boundary.

    Args:
      xs: arrays [1, T, ...].
      cu_seqlens: [N + 1] int32.
      T: tokens.
      segments: the lane's chunk count is a multiple of this (the chunk loops' segments, so that
        the lane needs no second padding copy).
    Returns:
      ([1, rows, ...] per array, rows = 64 × chunks, chunks = ceil(T / 64) + N rounded up to a
      multiple of ``segments``; padding rows zero), and the layout (:func:`from_one_lane`
      inverts it; ``layout.first`` marks each sequence's first chunk).
    """
    layout = chunk_layout(1, T, CHUNK, cu_seqlens, segments)
    rows = layout.token.shape[1] * CHUNK
    return [to_chunks(x, layout).reshape((1, rows) + x.shape[2:]) for x in xs], layout


def wipe_first_tokens(g: jax.Array, layout: ChunkLayout) -> jax.Array:
    """Per-token log-decay on one lane [1, rows, ...] f32, plus :data:`WIPE_LOG_DECAY` on the
    first token of every sequence (so the state carried in from the previous one is zero)."""
    nc = layout.token.shape[1]
    wipe = jnp.zeros((nc, CHUNK), f32).at[:, 0].set(jnp.where(layout.first[0], WIPE_LOG_DECAY, 0.0))
    return g.astype(f32) + wipe.reshape((1, nc * CHUNK) + (1,) * (g.ndim - 2))


def from_one_lane(o: jax.Array, layout: ChunkLayout, T: int) -> jax.Array:
    """Inverse of :func:`one_lane` for an output [1, rows, ...]: [1, T, ...]."""
    return from_chunks(o.reshape((1, -1, CHUNK) + o.shape[2:]), layout, 1, T)


def packed_meta(layout: ChunkLayout) -> jax.Array:
    """The kernels' per-chunk table of packed sequences on one lane: [chunks, META_COLS] int32,
    column 0 the sequence whose first chunk this is, column 1 whose last chunk, else -1."""
    nc = layout.token.shape[1]
    meta = jnp.full((nc, META_COLS), -1, jnp.int32)
    meta = meta.at[:, 0].set(jnp.where(layout.first[0], layout.seq[0], -1))
    return meta.at[:, 1].set(jnp.where(layout.last[0], layout.seq[0], -1))


def zero_sequences_without_chunks(x: jax.Array, meta: jax.Array) -> jax.Array:
    """Rows of ``x`` [N, ...] whose sequence has no chunk in ``meta`` (empty sequences: the
    kernels never write their rows) set to 0."""
    N = x.shape[0]
    seen = jnp.zeros((N + 1,), bool).at[jnp.where(meta[:, 0] >= 0, meta[:, 0], N)].set(True)
    return jnp.where(seen[:N].reshape((N,) + (1,) * (x.ndim - 1)), x, 0.0)


def lane_poison(
    poison: Poison | None,
    cu_seqlens: jax.Array | None,
    T: int,
    Tp: int,
    layout: ChunkLayout | None = None,
    *,
    q_rows: bool,
) -> tuple[jax.Array | None, jax.Array] | None:
    """The op's :class:`~gdn_jax.ops._sanitize.Poison` in lane coordinates, as the chunk loops
    add it to o (:func:`pallas_kernels.recurrence.chunk_fwd.chunk_fwd`'s ``poison``).

    Args:
      poison: the Poison of the op's inputs (token coordinates), or None (then None).
      cu_seqlens: [N + 1] int32 or None (dense).
      T: tokens; Tp: the lane length of :func:`padded_lanes` (dense, or a lane per sequence).
      layout: :func:`one_lane`'s layout when the sequences share one lane (then Tp is unused).
      q_rows: lay out the rows of a bad q too (the channel glue's, where the L2 norm reads q in
        XLA; else GDN's loop and the channel intra kernel find them).
    Returns:
      (nan_rows [L, HV, rows] f32 (None unless ``q_rows``): NaN on the rows whose whole output
      is NaN (a bad q), else 0;
      nan_from [L, HV, rows/64, V] f32: per chunk, the row from which each value column is NaN,
      64 where it is not), for the lanes (L, rows) of that layout.
    """
    if poison is None:
        return None
    rows_nan = jnp.where(poison.now, jnp.nan, 0.0).astype(f32) if q_rows else None  # [B, T, HV]
    first = poison.first  # [N, HV, V], token index (absolute with cu_seqlens)
    if layout is not None:  # one lane: each chunk's sequence and first token
        nc = layout.token.shape[1]
        lane_rows = to_chunks(rows_nan, layout).reshape(1, nc * CHUNK, -1) if q_rows else None
        seq = layout.seq[0]
        pad = seq >= first.shape[0]
        tok0 = jnp.where(pad, 0, layout.token[0, :, 0])
        frm = jnp.take(first, jnp.where(pad, 0, seq), axis=0) - tok0[:, None, None]
        frm = jnp.where(pad[:, None, None], CHUNK, frm)[None]
    else:
        nc = Tp // CHUNK
        lane_rows = padded_lanes([rows_nan], cu_seqlens, T, Tp)[0] if q_rows else None
        c0 = CHUNK * jnp.arange(nc, dtype=jnp.int32)
        tok0 = c0 if cu_seqlens is None else cu_seqlens[:-1, None].astype(jnp.int32) + c0
        frm = first[:, None] - jnp.broadcast_to(tok0, (first.shape[0], nc))[..., None, None]
    nan_from = jnp.clip(frm, 0, CHUNK).astype(f32).transpose(0, 2, 1, 3)
    return (lane_rows.transpose(0, 2, 1) if q_rows else None), nan_from


class LaneFlags(NamedTuple):
    """A core's poison inputs (:mod:`gdn_jax.ops._sanitize`) besides those its kernels find
    as they load the raw inputs (GDN: k's bad rows, v's first bad row per column), on the lanes
    (L lanes of nc chunks).

    Attributes:
      nan_rows: [L, HV, Tp] f32 or None: NaN on the rows of a bad q (the channel cores'; GDN's
        chunk loop finds them itself), else 0.
      nan_from: [L, HV, nc, V] f32 or None: per chunk, the row from which each value column is
        NaN for the inputs the kernels do not flag (GDN: the gates, k under the L2 norm; the
        channel cores: q, k, v and the gates; :func:`lane_poison`), 64 where it is not.
      g_first: [L, HV, nc] f32 or None: per chunk, the first row where the raw log-decay is NaN
        or +inf (the channel gate cumsum's, :func:`gdn_jax.ops._gate_cumsum.lane_gate_cumsum`),
        64 where none is; None: in ``nan_from`` (GDN's g, flagged in XLA).
      chunk_seq: None (a sequence per lane), or [nc] int32, the sequence of each chunk of the
        one lane of packed sequences (non-decreasing; padding chunks past the last).
    """

    nan_rows: jax.Array | None
    nan_from: jax.Array | None
    g_first: jax.Array | None
    chunk_seq: jax.Array | None

    def pad(self, chunks: int) -> LaneFlags:
        """For ``chunks`` more chunks of inert padding at the lanes' ends (the segmented loops'
        :func:`gdn_jax.ops._segments.pad_chunks`): no NaN there (padding chunks join the last
        sequence, whose flags they do not change)."""

        def pad(x, per_chunk, value):  # along axis 2 (axis 0 for chunk_seq), per_chunk entries
            if x is None:
                return None
            axis = 0 if x.ndim == 1 else 2
            widths = [(0, 0)] * x.ndim
            widths[axis] = (0, chunks * per_chunk)
            if value == "edge":
                return jnp.pad(x, widths, mode="edge")
            return jnp.pad(x, widths, constant_values=value)

        return LaneFlags(
            pad(self.nan_rows, CHUNK, 0.0),
            pad(self.nan_from, 1, CHUNK),
            pad(self.g_first, 1, CHUNK),
            pad(self.chunk_seq, 1, "edge"),
        )


def chunk_first_rows(flags: jax.Array, axis: int) -> jax.Array:
    """Per 64-row chunk of ``axis`` (a multiple of 64 long), the first row where ``flags`` (bool
    or numbers) is non-zero: f32 in [0, 64], 64 where none is; that axis becomes the chunks'."""
    n = flags.shape[axis]
    shape = flags.shape[:axis] + (n // CHUNK, CHUNK) + flags.shape[axis + 1 :]
    r = jnp.arange(CHUNK, dtype=f32).reshape((CHUNK,) + (1,) * (flags.ndim - axis - 1))
    return jnp.min(jnp.where(flags.reshape(shape) != 0, r, CHUNK), axis=axis + 1)


def loop_poison(k_bad, v_first, lanes: LaneFlags | None, meta, V: int):
    """The chunk loop's ``nan_from`` and the final state's NaN, from the intra kernel's flags
    and the rest (``lanes``; None: a lane per sequence and nothing bad but what the kernels find).

    Args:
      k_bad: [L, HV, Tp] f32, non-zero on the rows of k holding a bad value, or None (k's flags
        are in ``lanes``).
      v_first: [L, HV, nc, V] f32 per chunk and column the first bad row of v (64: none), or
        None (v's flags are in ``lanes``).
      meta: the packed lane's per-chunk table (column 1: the sequence whose last chunk this
        is, else -1), or None.
    Returns:
      (nan_from [L, HV, nc, V] f32, end [L or nc, HV, 1 or V] bool: the final states poisoned,
      the lanes' or, with ``meta``, the sequences' (the first N of nc rows)); (None, None) when
      nothing is flagged (no kernel flags, no ``lanes`` flags).
    """
    firsts = [] if k_bad is None else [chunk_first_rows(k_bad, 2)[..., None]]
    if lanes is not None and lanes.g_first is not None:
        firsts.append(lanes.g_first[..., None])
    if v_first is not None:
        firsts.append(v_first)
    if not firsts:  # only the op's own flags, or none
        if lanes is None or lanes.nan_from is None:
            return None, None
        return lanes.nan_from, None
    first = functools.reduce(jnp.minimum, firsts)  # [L, HV, nc, 1 or V]
    nc = first.shape[2]
    c0 = (CHUNK * jnp.arange(nc, dtype=f32))[:, None]
    at = jnp.where(first < CHUNK, c0 + first, jnp.inf)  # lane row of the chunk's first bad value
    # per chunk, the first bad row of its sequence up to the chunk's end: a prefix min along the
    # lane, restarted where a new sequence starts
    if lanes is None or lanes.chunk_seq is None:
        upto = jax.lax.cummin(at, axis=2)
    else:
        seq = jnp.broadcast_to(lanes.chunk_seq[:, None], at.shape)

        def combine(a, b):
            return b[0], jnp.where(a[0] == b[0], jnp.minimum(a[1], b[1]), b[1])

        upto = jax.lax.associative_scan(combine, (seq, at), axis=2)[1]
    nan_from = jnp.clip(upto - c0, 0, CHUNK)
    if lanes is not None and lanes.nan_from is not None:
        nan_from = jnp.minimum(nan_from, lanes.nan_from)
    nan_from = jnp.broadcast_to(nan_from, nan_from.shape[:3] + (V,))
    bad = upto < jnp.inf
    if meta is None:
        end = bad[:, :, -1]
    else:  # a sequence's last chunk holds its flags (empty sequences have none); nc >= N rows
        last = meta[:, 1]
        end = bad[0].transpose(1, 0, 2)  # [nc, HV, 1 or V]
        end = jnp.zeros_like(end).at[jnp.where(last >= 0, last, nc)].max(end, mode="drop")
    return nan_from, end


def poison_state(ht: jax.Array, end: jax.Array | None) -> jax.Array:
    """Final states [S, HV, K, V] with NaN where ``end`` (:func:`loop_poison`; None: nowhere)
    says."""
    if end is None:
        return ht
    return ht + jnp.where(end[: ht.shape[0], :, None, :], jnp.nan, 0.0)
