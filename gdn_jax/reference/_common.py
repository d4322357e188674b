"""Pieces shared by the recurrent and chunked references: L2 norm, packed-sequence indexing, and
the chunk layout that maps tokens to fixed-size chunks that never straddle sequences."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

f32 = jnp.float32

L2NORM_EPS = 1e-6
_HI = jax.lax.Precision.HIGHEST


def cast_round_trip(x: jax.Array, dtype) -> jax.Array:
    """``x`` cast to ``dtype`` and back, with the rounding kept.

    XLA's GPU compiler folds ``convert(convert(x, narrow), wide)`` into ``x`` under its default
    ``--xla_allow_excess_precision=true``, which silently removed the rounding of the references
    and of QAT's fake quantisation on the H200. The optimization barrier on the narrow value
    keeps the pair (the values are what the two casts give on every backend).
    """
    return jax.lax.optimization_barrier(x.astype(dtype)).astype(x.dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def round_through(x: jax.Array, dtype) -> jax.Array:
    """Rounds f32 ``x`` to ``dtype`` and back; the derivative is the identity (straight through),
    so cotangents are not rounded on the way back."""
    return cast_round_trip(x, dtype)


@round_through.defjvp
def _round_through_jvp(dtype, primals, tangents):
    return round_through(primals[0], dtype), tangents[0]


def mm(spec: str, a: jax.Array, b: jax.Array, dtype=None, *, exact_grad: bool = False) -> jax.Array:
    """einsum with f32 accumulation; operands are first rounded to ``dtype`` (default: unchanged).

    Args:
      exact_grad: round the operands straight-through (cotangents stay f32). Otherwise the
        cotangents of the rounded operands are rounded too, as in a computation run entirely in
        the io dtype.

    XLA:CPU has no bf16 x bf16 -> f32 dot for every shape, so there (and with ``exact_grad``) the
    rounded operands are multiplied in f32: the products are exact in f32 and the sums are f32.
    """
    if dtype is not None and jnp.dtype(dtype) != f32:
        if exact_grad:
            a, b = (
                round_through(a.astype(f32), jnp.dtype(dtype).name),
                round_through(b.astype(f32), jnp.dtype(dtype).name),
            )
        else:
            a, b = a.astype(dtype), b.astype(dtype)
    if jax.default_backend() == "cpu":
        a, b = a.astype(f32), b.astype(f32)
    return jnp.einsum(spec, a, b, preferred_element_type=f32, precision=_HI)


def l2norm(x: jax.Array, dtype=None) -> jax.Array:
    """``x / sqrt(sum(x**2) + 1e-6)`` over the last axis in f32, returned in ``dtype`` (default
    x.dtype)."""
    x32 = x.astype(f32)
    y = x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + L2NORM_EPS)
    return y.astype(x.dtype if dtype is None else dtype)


def sequence_ids(cu_seqlens: jax.Array, T: int) -> jax.Array:
    """[T] int32: the packed sequence each token belongs to (empty sequences own no token)."""
    t = jnp.arange(T, dtype=jnp.int32)
    return (jnp.searchsorted(cu_seqlens, t, side="right") - 1).astype(jnp.int32)


def sequence_starts(cu_seqlens: jax.Array, T: int) -> jax.Array:
    """Index of the first token of the packed sequence each position belongs to.

    Args:
      cu_seqlens: [N + 1] int32 sequence boundaries (0, ..., T).
      T: packed length.
    Returns:
      [T] int32.
    """
    t = jnp.arange(T, dtype=jnp.int32)
    # Empty sequences share a boundary with their neighbour; side="right" skips them.
    seq = jnp.searchsorted(cu_seqlens[1:], t, side="right")
    return cu_seqlens[seq].astype(jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ChunkLayout:
    """Where every token sits once the sequence axis is cut into chunks of C rows.

    The chunked tensors are ``[L, NC, C, ...]``: L lanes run their chunks one after another and
    lanes run in parallel. Without ``cu_seqlens`` a lane is a batch row (L = B, NC = ceil(T / C)).
    With ``cu_seqlens`` there is one lane (L = 1) that holds every sequence's chunks back to back,
    NC = ceil(T / C) + N so that each sequence may end in a partial chunk; slots past the last
    chunk are padding. Padded rows read as zeros (k = v = q = 0, g = 0, b = w = 0), which makes
    them inert: a zero gate keeps the cumulative gate at the last valid row's value.

    Attributes:
      token: [L, NC, C] int32 flat token index (b * T + t) of each row, or -1 for padding.
      seq: [L, NC] int32 sequence (state row) of each chunk; N for padding chunks.
      first: [L, NC] bool, the chunk starts its sequence (the state resets to initial_state).
      last: [L, NC] bool, the chunk ends its sequence (its end state is the final state).
      slot: [B * T] int32 flat chunk-row index (into L * NC * C) of each token.
      empty: [N] bool, sequences with no token (final state = initial state).
    """

    token: jax.Array
    seq: jax.Array
    first: jax.Array
    last: jax.Array
    slot: jax.Array
    empty: jax.Array
    packed: bool = dataclasses.field(metadata=dict(static=True), default=False)

    def is_dense(self, B: int, T: int) -> bool:
        """True when chunks are just the batch rows cut every C tokens (no cu_seqlens)."""
        return not self.packed


def chunk_layout(
    B: int, T: int, C: int, cu_seqlens: jax.Array | None, chunk_multiple: int = 1
) -> ChunkLayout:
    """The :class:`ChunkLayout` of ``B`` rows of ``T`` tokens (``B == 1`` with cu_seqlens).

    With ``cu_seqlens`` the lane's chunk count NC = ceil(T / C) + N is rounded up to a multiple
    of ``chunk_multiple`` (more padding chunks; e.g. segments of equal length)."""
    if cu_seqlens is None:
        NC = -(-T // C)
        pos = jnp.arange(NC * C, dtype=jnp.int32).reshape(1, NC, C)
        row0 = T * jnp.arange(B, dtype=jnp.int32).reshape(B, 1, 1)
        token = jnp.where(pos < T, row0 + pos, -1)
        seq = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, NC))
        c = jnp.arange(NC)
        first = jnp.broadcast_to(c == 0, (B, NC))
        last = jnp.broadcast_to(c == NC - 1, (B, NC))
        t = jnp.arange(B * T, dtype=jnp.int32)
        slot = (t // T) * (NC * C) + t % T
        return ChunkLayout(token, seq, first, last, slot, jnp.zeros((B,), bool))

    N = cu_seqlens.shape[0] - 1
    NC = -(-(-(-T // C) + N) // chunk_multiple) * chunk_multiple
    cu = cu_seqlens.astype(jnp.int32)
    lengths = cu[1:] - cu[:-1]
    n_chunks = (lengths + C - 1) // C  # [N]
    chunk_end = jnp.cumsum(n_chunks)  # [N], exclusive end slot of each sequence
    chunk_start = chunk_end - n_chunks
    c = jnp.arange(NC, dtype=jnp.int32)
    seq = jnp.searchsorted(chunk_end, c, side="right").astype(jnp.int32)  # N past the end
    seq_c = jnp.minimum(seq, N - 1)
    in_range = seq < N
    k_in_seq = c - chunk_start[seq_c]
    start_tok = cu[seq_c] + k_in_seq * C
    n_valid = jnp.where(in_range, jnp.clip(cu[seq_c + 1] - start_tok, 0, C), 0)
    row = jnp.arange(C, dtype=jnp.int32)
    token = jnp.where(row[None] < n_valid[:, None], start_tok[:, None] + row[None], -1)
    first = in_range & (k_in_seq == 0)
    last = in_range & (k_in_seq == n_chunks[seq_c] - 1)
    tok_seq = sequence_ids(cu, T)
    off = jnp.arange(T, dtype=jnp.int32) - cu[tok_seq]
    slot = (chunk_start[tok_seq] + off // C) * C + off % C
    return ChunkLayout(token[None], seq[None], first[None], last[None], slot, lengths == 0, True)


def _take_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
    """Rows ``x[idx]`` of ``x`` [R, ...] for ``idx`` [M] int32; rows where ``idx < 0`` are zero."""
    y = jnp.take(x, idx, axis=0, mode="clip")  # (-1 clipped to row 0, then zeroed)
    keep = (idx >= 0).reshape(idx.shape + (1,) * (x.ndim - 1))
    return jnp.where(keep, y, jnp.zeros((), x.dtype))


@jax.custom_vjp
def permute_rows(x: jax.Array, idx: jax.Array, inv: jax.Array) -> jax.Array:
    """Rows ``x[idx]`` ([M, ...]; zero where ``idx < 0``) of ``x`` [R, ...], a gather whose
    derivative is a gather too.

    ``idx`` [M] must take every row of x at most once, and ``inv`` [R] is its inverse: for every
    row j of x the position i with ``idx[i] == j``, or -1 where no position takes j. The
    cotangent of x is then ``permute_rows(dy, inv, idx)``, a gather, where JAX's transpose of
    ``take`` is a scatter-add (atomics on the GPU) into a zeroed buffer.
    """
    return _take_rows(x, idx)


def _permute_rows_fwd(x, idx, inv):
    return _take_rows(x, idx), (idx, inv)


def _permute_rows_bwd(res, dy):
    idx, inv = res
    return permute_rows(dy, inv, idx), None, None


permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


def to_chunks(x: jax.Array, layout: ChunkLayout) -> jax.Array:
    """[B, T, ...] -> [L, NC, C, ...]; padding rows are zero."""
    B, T = x.shape[:2]
    NC, C = layout.token.shape[1:]
    if layout.is_dense(B, T):
        pad = [(0, 0), (0, NC * C - T)] + [(0, 0)] * (x.ndim - 2)
        return jnp.pad(x, pad).reshape((B, NC, C) + x.shape[2:])
    # Packed: every token has one slot (layout.slot inverts layout.token)
    rows = permute_rows(x.reshape((B * T,) + x.shape[2:]), layout.token.reshape(-1), layout.slot)
    return rows.reshape(layout.token.shape + x.shape[2:])


def from_chunks(y: jax.Array, layout: ChunkLayout, B: int, T: int) -> jax.Array:
    """[L, NC, C, ...] -> [B, T, ...] (drops padding rows)."""
    if layout.is_dense(B, T):
        return y.reshape((B, -1) + y.shape[3:])[:, :T]
    flat = y.reshape((-1,) + y.shape[3:])
    rows = permute_rows(flat, layout.slot, layout.token.reshape(-1))
    return rows.reshape((B, T) + y.shape[3:])
