"""Sequence parallelism inside one device: segment counts, segment tables, the state combine.

When ``B · HV · (V / block_v)`` CTAs cannot fill the GPU, the chunk loops cut every lane of T/64
chunks into S equal segments that run in parallel:

1. segment pass: each of the first S − 1 segments gives its affine state map
   ``S_end = M_j S_in + c_j`` (:func:`pallas_kernels.gdn.segment_state.segment_maps`);
2. :func:`segment_starts`: the prefix combine of the maps (f32, S small) gives every segment's
   true initial state;
3. the chunk loop with ``segments = S``, each segment from its own initial state.

GDN's backward mirrors it for the state cotangent (KDA's and GDN2's backward loops run
unsplit; their forward splits as above): the reverse loop's map over a segment is the
transpose of the forward map, so ``dE_{j−1} = M_jᵀ dE_j + d_j`` (:func:`segment_end_cotangents`),
with d_j the start cotangent of segment j from a zero end cotangent (the reverse loop's
``state_only`` pass). Packed sequences on one lane keep their per-chunk table: segments do not
care where sequences start or end (a sequence start inside a segment zeroes its map), and
:func:`segment_meta` adds, for every segment boundary that is not a sequence boundary, a table row
N + j that carries segment j's initial state (forward) or end cotangent (backward).
This is the cross-device context-parallel state passing of :mod:`gdn_jax.sharding`
(``_segment_map``, ``_state_passing_local``) with the segments inside one device and the maps
from a dedicated pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gdn_jax.sharding.context import combine_segment_states
from pallas_kernels._tiles import CHUNK

__all__ = [
    "SM_COUNT",
    "MIN_SEGMENT_CHUNKS",
    "MAX_SEGMENTS",
    "segment_count",
    "lane_segment_count",
    "sm_count",
    "pad_chunks",
    "segment_meta",
    "segment_starts",
    "segment_end_cotangents",
    "segment_tables",
    "segment_entries",
    "last_segment_state",
    "pad_meta",
]

SM_COUNT = 132  # H200 (and H100 SXM)
MIN_SEGMENT_CHUNKS = 16  # shorter segments do not repay the segment pass and the combine
MAX_SEGMENTS = 16  # the combine is sequential over segments

_HI = jax.lax.Precision.HIGHEST


def segment_count(B: int, HV: int, T: int, v_blocks: int, sms: int = SM_COUNT) -> int:
    """How many segments the chunk loops split each lane into.

    One CTA per (batch row, value head, value block) runs a lane's chunks in order. Below half a
    wave (``2 · B · HV · v_blocks ≤ sms``) every lane is cut into ``sms // (B · HV · v_blocks)``
    segments (one loop CTA per SM: a loop step is bound by its latency, and a second CTA on the
    SM slows both more than the longer segments cost; GDN at B1, ``bench_gdn.py --segments``, the
    "Segment counts" tables of benchmarks/RESULTS.md: on the H100 T32768 HV16 fastest at S = 4,
    T8192 HV16 at S = 4, T16384 HV8 at S = 8; on the H200 T32768 HV16 at S = 4 against 8), at
    most :data:`MAX_SEGMENTS` and with at least :data:`MIN_SEGMENT_CHUNKS` chunks of 64 each.

    Args:
      B: lanes (batch rows; 1 for packed sequences on one lane).
      HV: value heads.
      T: tokens (rows) per lane.
      v_blocks: value-column blocks per head (V / block_v).
      sms: streaming multiprocessors of the device.
    Returns:
      The segment count, ≥ 1 (1: the unsplit loops).
    """
    for name, x in (("B", B), ("HV", HV), ("T", T), ("v_blocks", v_blocks), ("sms", sms)):
        if not isinstance(x, int) or x < (0 if name == "T" else 1):
            raise ValueError(f"{name}={x!r} must be a positive int")
    ctas = B * HV * v_blocks
    if 2 * ctas > sms:
        return 1
    nt = -(-T // CHUNK)
    s = min(sms // ctas, nt // MIN_SEGMENT_CHUNKS, MAX_SEGMENTS)
    return s if s >= 2 else 1


def lane_segment_count(B: int, T: int, HV: int, v_blocks: int, cu_seqlens) -> int:
    """:func:`segment_count` for the lanes the kernels will run on these inputs: B lanes of T
    rows, or with ``cu_seqlens`` ([N + 1]) one lane of about T + 64 N rows; the device's SM
    count."""
    lanes, rows = (B, T) if cu_seqlens is None else (1, T + CHUNK * (cu_seqlens.shape[0] - 1))
    return segment_count(lanes, HV, rows, v_blocks, sm_count())


def sm_count() -> int:
    """SM count of the default device (:data:`SM_COUNT` where it does not say, e.g. on CPU)."""
    try:
        n = getattr(jax.devices()[0], "core_count", None)
    except RuntimeError:
        n = None
    return int(n) if isinstance(n, int) and n > 0 else SM_COUNT


def pad_chunks(xs, axes, segments: int) -> list[jax.Array]:
    """Zero-pads each array along its token axis (``axes[i]`` of ``xs[i]``, a multiple of 64 rows)
    to a multiple of ``64 · segments`` rows. Zero rows are inert in the chunk loops (zero k, q,
    values and β; zero gate increments keep the state)."""
    out = []
    for x, ax in zip(xs, axes, strict=True):
        rows = x.shape[ax]
        n = -(-rows // (CHUNK * segments)) * CHUNK * segments
        pad = [(0, 0)] * x.ndim
        pad[ax] = (0, n - rows)
        out.append(jnp.pad(x, pad) if n > rows else x)
    return out


def segment_meta(meta: jax.Array, segments: int, N: int) -> tuple[jax.Array, jax.Array]:
    """The per-chunk table of packed sequences extended for segments.

    Args:
      meta: [nt, META_COLS] int32 (column 0: the sequence whose first chunk this is, column 1:
        whose last chunk, else -1); nt a multiple of ``segments``.
      segments: S.
      N: sequences (rows of the initial/final-state tables).
    Returns:
      (meta_ext, starts_seq): meta_ext names row N + j in column 0 at segment j's first chunk and
      in column 1 at its last chunk where the table names no sequence there (tables then have
      N + S rows: rows N + j carry segment j's initial state / end cotangent); starts_seq [S]
      bool: segment j starts with a sequence (its entering state is irrelevant).
    """
    nt = meta.shape[0]
    L = nt // segments
    c = jnp.arange(nt, dtype=jnp.int32)
    j = N + c // L
    first, last = c % L == 0, c % L == L - 1
    col0 = jnp.where(first & (meta[:, 0] < 0), j, meta[:, 0])
    col1 = jnp.where(last & (meta[:, 1] < 0), j, meta[:, 1])
    meta_ext = meta.at[:, 0].set(col0).at[:, 1].set(col1)
    return meta_ext, meta[::L, 0] >= 0


def segment_starts(maps_ends: jax.Array, h0: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Prefix combine of segment maps: the state entering every segment.

    Args:
      maps_ends: [B, R, HV, K, V + K] f32, ``[c_j | M_j]`` of segments 0 … R − 1 (the segment
        pass's output reshaped), R = S − 1 or S.
      h0: [B, HV, K, V] f32 state entering segment 0, or None (zero).
    Returns:
      (starts [B, S, HV, K, V] f32 with S = R + 1 or R, maps [B, R, HV, K, K] f32):
      S_in_0 = h0, S_in_{j+1} = M_j S_in_j + c_j (HIGHEST-precision f32 products), for the
      given ``segments`` S.
    """
    K = maps_ends.shape[-2]
    V = maps_ends.shape[-1] - K
    M, c = maps_ends[..., V:], maps_ends[..., :V]
    # The combine context parallelism uses across devices, on segments of one lane.
    starts, final = combine_segment_states(jnp.moveaxis(M, 1, 0), jnp.moveaxis(c, 1, 0), h0)
    return jnp.moveaxis(jnp.concatenate([starts, final[None]]), 0, 1), M


def segment_end_cotangents(maps: jax.Array, d: jax.Array, dht: jax.Array | None) -> jax.Array:
    """Reverse combine: the cotangent of every segment's end state.

    Args:
      maps: [B, S, HV, K, K] f32, the map M_j of every segment (``segment_starts`` of an
        ``all_segments`` segment pass; M_0 unused).
      d: [B, S, HV, K, V] f32, d_j the cotangent of segment j's initial state from its own
        chunks with a zero end cotangent (d_0 unused).
      dht: [B, HV, K, V] f32 cotangent of the end of the last segment, or None (zero).
    Returns:
      dE [B, S, HV, K, V] f32: dE_{S−1} = dht, dE_{j−1} = M_jᵀ dE_j + d_j (the state entering
      segment j is the one leaving segment j − 1).
    """
    S = d.shape[1]
    E = jnp.zeros(d.shape[:1] + d.shape[2:], jnp.float32) if dht is None else dht
    ends = [E]
    for j in range(S - 1, 0, -1):
        E = jnp.einsum("bhji,bhjv->bhiv", maps[:, j], E, precision=_HI) + d[:, j]
        ends.append(E)
    return jnp.stack(ends[::-1], axis=1)


def segment_tables(starts: jax.Array, h0: jax.Array, meta: jax.Array | None):
    """The chunk loops' initial-state table and per-chunk table for S segments.

    Args:
      starts: [B, S, HV, K, V] f32, the state entering every segment (:func:`segment_starts`).
      h0: [N, HV, K, V] f32 initial states (packed: of the sequences).
      meta: the per-chunk table of packed sequences on one lane, or None (dense).
    Returns:
      (h0s, meta_ext, starts_seq): dense: the segment starts [B·S, HV, K, V], None, None;
      packed: ``[h0; starts]`` (N + S rows) and :func:`segment_meta`'s table and flags.
    """
    B, S = starts.shape[:2]
    if meta is None:
        return starts.reshape((B * S,) + starts.shape[2:]), None, None
    mx, first_seq = segment_meta(meta, S, h0.shape[0])
    return jnp.concatenate([h0, starts[0]]), mx, first_seq


def segment_entries(ends: jax.Array, B: int, S: int, h0: jax.Array, meta: jax.Array | None):
    """From the segment pass to the chunk loop: the combine and the loop's tables.

    Args:
      ends: [B·R, HV, K, V + K] f32, the segment pass's ``[c_j | M_j]`` (R = S − 1 or S).
      B: lanes; S: segments; h0, meta: as for :func:`segment_tables`.
    Returns:
      (h0s, meta_ext, starts [B, S, HV, K, V], maps [B, R, HV, K, K]).
    """
    ends = ends.reshape((B, -1) + ends.shape[1:])
    V = ends.shape[-1] - ends.shape[-2]
    starts, _ = segment_starts(ends[:, : S - 1], None if meta is not None else h0)
    h0s, mx, _ = segment_tables(starts, h0, meta)
    return h0s, mx, starts, ends[..., V:]


def last_segment_state(ht: jax.Array, B: int, S: int, h0: jax.Array, meta) -> jax.Array:
    """The final states from a segmented loop's: dense, each lane's last segment's end state
    ([B·S, ...] -> [B, ...]); packed, the sequences' rows (the first N of N + S)."""
    return ht.reshape((B, S) + ht.shape[1:])[:, -1] if meta is None else ht[: h0.shape[0]]


def pad_meta(meta: jax.Array | None, pad: int) -> jax.Array | None:
    """The per-chunk table with ``pad`` more chunks of inert padding (:func:`pad_chunks`): -1
    rows; None stays None."""
    if meta is None:
        return None
    return jnp.concatenate([meta, jnp.full((pad, meta.shape[1]), -1, meta.dtype)])
