"""Argument checks of :class:`gdn_jax.models.HybridLM` (token ids, targets, decode caches).

Concrete values raise ``ValueError`` naming the argument. Traced ones (under ``jax.jit``) get a
defined result and, in checked mode, a ``checkify`` check (:mod:`gdn_jax.checks`): token ids and
targets are clipped to ``[0, vocab_size)``; an ``extend`` that does not fit in the cache gives NaN
logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gdn_jax import checks
from gdn_jax.ops._validate import check_array

__all__ = ["token_ids", "cache_size", "decode_cache", "fits_or_nan", "pad_time"]


def token_ids(name: str, ids, vocab_size: int, *, mask=None) -> jax.Array:
    """Checks [B, T] integer ids against ``[0, vocab_size)``; returns the ids to use.

    Args:
      name: argument name for the error ("tokens", "targets").
      ids: [B, T] int array.
      vocab_size: number of ids.
      mask: optional [B, T] weights; positions with weight 0 are not checked (padding).
    Returns:
      ``ids`` clipped to ``[0, vocab_size - 1]`` (unchanged when concrete and unmasked: every id
      was checked); ids at masked positions may be anything.
    """
    check_array(name, ids)
    if ids.ndim != 2:
        raise ValueError(f"{name} must be 2-D [B, T] token ids; got {name}.shape={ids.shape}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"{name} must be integer token ids; got {name}.dtype={ids.dtype}")
    if checks.is_concrete(ids, mask):
        a = np.asarray(ids)
        out = (a < 0) | (a >= vocab_size)
        if mask is not None:
            out &= np.asarray(mask) != 0
        if out.any():
            bad = a[out]
            raise ValueError(
                f"{name} must lie in [0, {vocab_size}) (vocab_size); got {out.sum()} ids outside, "
                f"e.g. {bad.ravel()[:4].tolist()}"
                + (" (give padding positions mask 0)" if name == "targets" else "")
            )
        if mask is None:
            return ids
    else:
        inside = (ids >= 0) & (ids < vocab_size)
        if mask is not None:
            inside = inside | (mask == 0)
        checks.check(jnp.all(inside), f"{name} must lie in [0, {vocab_size}) (vocab_size)")
    return jnp.clip(ids, 0, vocab_size - 1)


def cache_size(batch_size, max_len) -> None:
    """``init_cache`` sizes: non-negative ``batch_size``, positive ``max_len`` (Python ints)."""
    for name, n, low in (("batch_size", batch_size, 0), ("max_len", max_len, 1)):
        if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < low:
            raise ValueError(f"{name} must be an int >= {low}; got {name}={n!r}")


def _leaves(tree):
    return jax.tree_util.tree_flatten_with_path(tree)


def decode_cache(model, tokens: jax.Array, cache) -> int | None:
    """Checks an ``extend`` cache against the one ``model.init_cache`` makes for ``tokens``.

    Args:
      model: the :class:`gdn_jax.models.HybridLM`.
      tokens: [B, T] ids of the call.
      cache: the ``cache`` argument.
    Returns:
      The cache's ``max_len`` (None when no layer keeps keys and values).
    Raises:
      ValueError: another structure (another model), another batch size or head shape, more
        tokens than ``max_len``, or (concrete position) an extend past ``max_len``.
    """
    from gdn_jax.models.attention import KVCache
    from gdn_jax.models.hybrid import HybridCache

    if not isinstance(cache, HybridCache):
        raise ValueError(
            f"cache must be a HybridCache from init_cache or extend; got {type(cache).__name__}"
        )
    B, T = tokens.shape
    kv = [c for c in cache.layers if isinstance(c, KVCache)]
    max_len = kv[0].k.shape[1] if kv and kv[0].k.ndim == 4 else None
    expected = jax.eval_shape(lambda: model.init_cache(B, max_len or 1))
    got, want = _leaves(cache), _leaves(expected)
    if jax.tree.structure(cache) != jax.tree.structure(expected):
        raise ValueError(
            f"cache does not belong to this model: it has {len(cache.layers)} layers of types "
            f"{[type(c).__name__ for c in cache.layers]}, the model expects "
            f"{[type(c).__name__ for c in expected.layers]} (make it with model.init_cache)"
        )
    for (path, x), (_, e) in zip(got[0], want[0], strict=True):
        if getattr(x, "shape", None) != e.shape:
            where = "cache" + jax.tree_util.keystr(path)
            raise ValueError(
                f"{where} must have shape {e.shape} for tokens of shape {tokens.shape} "
                f"(batch {B}) with this model; got {getattr(x, 'shape', type(x).__name__)}: the "
                "cache belongs to another batch size or model (make it with model.init_cache)"
            )
    if max_len is None:
        return None
    if T > max_len:
        raise ValueError(
            f"tokens.shape={tokens.shape}: {T} tokens do not fit in the cache (max_len={max_len})"
        )
    if checks.is_concrete(cache.pos):
        pos = int(cache.pos)
        if pos + T > max_len:
            raise ValueError(
                f"extend past the cache: cache.pos={pos} + {T} tokens > max_len={max_len}"
            )
    else:
        checks.check(
            cache.pos + T <= max_len,
            f"extend past the cache: cache.pos={{}} + {T} tokens > max_len={max_len}",
            cache.pos,
        )
    return max_len


def fits_or_nan(logits: jax.Array, pos: jax.Array, T: int, max_len: int | None) -> jax.Array:
    """``logits`` [B, T or 1, vocab], all NaN when ``pos + T > max_len`` (the cache overflowed)."""
    if max_len is None or checks.is_concrete(pos):
        return logits
    over = pos + T > max_len
    return jnp.where(over, jnp.nan, logits)


def pad_time(chunk: int, *xs: jax.Array) -> tuple[jax.Array, ...]:
    """Pads every [B, T, ...] array with zeros along T to a multiple of ``chunk``."""
    T = xs[0].shape[1]
    extra = -T % chunk
    return tuple(jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2)) for x in xs)
