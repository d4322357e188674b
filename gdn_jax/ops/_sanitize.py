"""Edge values of the chunked ops' inputs, handled before any implementation runs (so that
``"xla"`` and ``"pallas"`` see the same arrays).

Log-decay. ``g`` is clamped to ``[LOG_DECAY_FLOOR, 0]``: ``e^g`` of every ``g <= LOG_DECAY_FLOOR``
is 0 in f32 (below half the smallest subnormal), so the clamp keeps the recurrence's values while
the chunked forms, which take differences of chunk-local cumulative sums, never see ``-inf - -inf``.
``g > 0`` (growth) is outside the supported range; concrete gates are rejected before this runs,
traced ones are clamped to 0. The derivative is 1 inside the range and 0 outside it (the
recurrence's ``e^g (...)`` is 0 at ``-inf``).

Non-finite values (NaN, ±inf in q, k, v, β, b, w; NaN or +inf in g). The chunked forms multiply
later rows by masked zeros (``0 · NaN = NaN``), which would spread a bad token backwards through
its chunk. Each such value is replaced by 0 (derivative: straight through), the op runs on finite
inputs, and NaN is put back where the token recurrence has it: in a sequence, a bad value in
k, g, β or b at token t makes the head's outputs NaN from t on; in v or w the value column's;
in q only token t's outputs. The final state is NaN in the same heads and columns. Earlier
outputs are exactly those of the same inputs with the bad value replaced by any finite one.

Cost: one elementwise pass over the inputs (``isfinite``, the replacement) and over the output,
and min-reductions over T of a [B, T, HV] and a [B, T, HV, V] flag (segment-mins with
``cu_seqlens``). The Pallas paths get the raw q, k, v (and KDA/GDN2 the raw gates): their
kernels make the same replacement as they load them, so only the flags read those, and their
chunk loops add the NaN to o as they store it (no pass over the output). GDN's flags are
:func:`inputs`'; KDA's and GDN2's gate cumsum finds g's as it loads g
(:mod:`gdn_jax.ops._channel_pallas`), and :func:`poison` gives the rest. The decode steps'
Pallas kernel does all of it itself (``pallas_kernels.decode.step``): :func:`inputs` serves
their xla path only.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gdn_jax.reference._common import sequence_ids

__all__ = ["LOG_DECAY_FLOOR", "log_decay", "finite", "Poison", "inputs", "poison"]

f32 = jnp.float32

# e^{-104} < 2^-150: 0 in f32 with or without subnormals. Cumulative sums of 64 such tokens stay
# near 6.7e3, where f32 resolves differences of gates to ~5e-4.
LOG_DECAY_FLOOR = -104.0


def log_decay(g: jax.Array) -> jax.Array:
    """``g`` (f32) clamped to ``[LOG_DECAY_FLOOR, 0]``; NaN gives the floor (its outputs are
    poisoned by :class:`Poison`). Derivative 1 inside the range, 0 outside."""
    g = g.astype(f32)
    inside = (g > LOG_DECAY_FLOOR) & (g <= 0)
    return jnp.where(inside, g, jnp.where(g > 0, 0.0, LOG_DECAY_FLOOR))


@jax.custom_jvp
def finite(x: jax.Array) -> jax.Array:
    """``x`` with NaN and ±inf replaced by 0; the derivative passes straight through."""
    return jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype))


@finite.defjvp
def _finite_jvp(primals, tangents):
    return finite(primals[0]), tangents[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Poison:
    """Where the token recurrence of the original inputs is NaN.

    Attributes:
      first: [N, HV, V] int32, the first token index (in [0, T)) from which a (sequence, head,
        column) is NaN; T or more where it never is.
      now: [B, T, HV] bool, tokens whose own output is NaN (a bad q).
      seq: [T] int32 sequence of each token (packed inputs) or None (a sequence per batch row).
    """

    first: jax.Array
    now: jax.Array
    seq: jax.Array | None

    def output(self, o: jax.Array) -> jax.Array:
        """o [B, T, HV, V] with NaN where the recurrence has it."""
        T = o.shape[1]
        t = jnp.arange(T, dtype=jnp.int32)
        if self.seq is None:
            late = t[None, :, None, None] >= self.first[:, None]
        else:
            late = (t[:, None, None] >= self.first[self.seq])[None]
        bad = late | self.now[..., None]
        return o + jnp.where(bad, jnp.nan, 0.0).astype(o.dtype)

    def state(self, s: jax.Array, T: int) -> jax.Array:
        """Final states [N, HV, K, V] with NaN in the poisoned heads and columns."""
        return s + jnp.where(self.first < T, jnp.nan, 0.0)[:, :, None, :].astype(s.dtype)


def _any_after(flags: jax.Array, keep: int) -> jax.Array:
    """``flags`` reduced by ``any`` over the axes after the first ``keep``, in their own layout.

    The optimization barrier keeps XLA from fusing the reduction with the transposes of the
    gates to ``[B, HV, T]`` that the kernels read: fused, the flags of k came out transposed from
    a reduction over its channels at an eighth of the memory bandwidth (0.27 ms of the GDN
    forward at B1 T32768 HV16 on the H200, ``benchmarks/profile_ops.py``)."""
    if flags.ndim == keep:
        return flags
    return jax.lax.optimization_barrier(jnp.any(flags, axis=tuple(range(keep, flags.ndim))))


def _bad(x: jax.Array, keep: int) -> jax.Array:
    """Non-finite anywhere in the axes after the first ``keep``."""
    return _any_after(~jnp.isfinite(x), keep)


def _first(idx: jax.Array, T: int) -> jax.Array:
    """``min`` over axis 1 (T) of ``idx`` [B, T, ...] int32, as two reductions: over 64-row
    blocks, then over the blocks (the barrier keeps XLA from merging them back). One column
    reduction over all of T, fused with the sanitising selects, took 0.27 ms for GDN2's v and
    w at B4 T4096 HV16 on the H200, four times their bytes (``benchmarks/profile_ops.py``)."""
    blk = 64
    if T <= blk:
        return jnp.min(idx, axis=1)
    pad = -T % blk
    if pad:
        idx = jnp.pad(idx, [(0, 0), (0, pad)] + [(0, 0)] * (idx.ndim - 2), constant_values=T)
    B = idx.shape[0]
    part = jnp.min(idx.reshape((B, (T + pad) // blk, blk) + idx.shape[2:]), axis=2)
    return jnp.min(jax.lax.optimization_barrier(part), axis=1)


def poison(
    shape: tuple[int, int, int, int],
    cu_seqlens: jax.Array | None,
    *,
    rows: tuple = (),
    heads: tuple = (),
    log_decays: tuple = (),
    cols: tuple = (),
) -> Poison:
    """The :class:`Poison` of the original inputs given (the others taken as finite).

    Args:
      shape: (B, T, HV, V) of the op's v.
      cu_seqlens: sanitised [N + 1] int32 offsets or None.
      rows: arrays [B, T, H, ...] whose bad values poison their own token's outputs (q).
      heads: arrays [B, T, H, ...] whose bad values poison the head from their token on (k,
        β, b); H divides HV (value head i reads head i // (HV // H)).
      log_decays: log-decays [B, T, HV] or [B, T, HV, K], bad where NaN or +inf (−inf is a full
        reset), poisoning the head from their token on (g).
      cols: arrays [B, T, HV, V] whose bad values poison the value column from their token on
        (v, w).
    """
    B, T, HV, V = shape

    def per_value_head(flags):  # [B, T, H] -> [B, T, HV]
        return jnp.repeat(flags, HV // flags.shape[2], axis=2)

    now = jnp.zeros((B, T, HV), bool)
    for x in rows:
        now = now | per_value_head(_bad(x, 3))
    head = jnp.zeros((B, T, HV), bool)
    for x in heads:
        head = head | per_value_head(_bad(x, 3))
    for x in log_decays:
        x = x.astype(f32)
        head = head | _any_after(jnp.isnan(x) | (x == jnp.inf), 3)
    col = None
    for x in cols:
        col = ~jnp.isfinite(x) if col is None else col | ~jnp.isfinite(x)
    t = jnp.arange(T, dtype=jnp.int32)[None, :, None]
    # first bad token per head and per value column, reduced apart (head flags are never
    # broadcast over V), then combined
    head_idx = jnp.where(head, t, T)  # [B, T, HV]
    col_idx = None if col is None else jnp.where(col, t[..., None], T)  # [B, T, HV, V]
    if cu_seqlens is None:
        seq = None
        first = _first(head_idx, T)[..., None]
        if col_idx is not None:
            first = jnp.minimum(first, _first(col_idx, T))
    else:
        seq = sequence_ids(cu_seqlens, T)
        n = cu_seqlens.shape[0] - 1
        first = jax.ops.segment_min(head_idx[0], seq, num_segments=n)[..., None]
        if col_idx is not None:
            first = jnp.minimum(first, jax.ops.segment_min(col_idx[0], seq, num_segments=n))
    return Poison(jnp.broadcast_to(first, first.shape[:-1] + (V,)), now, seq)


def inputs(q, k, v, g, heads, cols, cu_seqlens):
    """Sanitised inputs and the :class:`Poison` of the originals.

    Args:
      q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV] or [B, T, HV, K] log-decay.
      heads: gates whose bad values poison whole heads ([B, T, HV] or [B, T, HV, K]: β, b).
      cols: gates whose bad values poison value columns ([B, T, HV, V]: GDN2's w).
      cu_seqlens: sanitised [N + 1] int32 offsets or None.
    Returns:
      (q, k, v, g, heads, cols) with finite values and g in [LOG_DECAY_FLOOR, 0], and the Poison.
    """
    clean = (
        finite(q),
        finite(k),
        finite(v),
        log_decay(g),
        tuple(finite(x) for x in heads),
        tuple(finite(x) for x in cols),
    )
    found = poison(
        v.shape, cu_seqlens, rows=(q,), heads=(k, *heads), log_decays=(g,), cols=(v, *cols)
    )
    return clean, found
