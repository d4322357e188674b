"""Autoregressive generation with a :class:`gdn_jax.models.HybridLM`.

Prompts of different lengths share one batch (right-padded, with ``prompt_lengths``). The
tokens every prompt has (the shortest prompt's length) go through one prefill
(:meth:`HybridLM.extend`: the chunked GDN op and full attention); from there every position is
one decode step for the whole batch (the decode kernels): a sequence still inside its prompt is
fed its next prompt token, the others their sampled token. So every sequence's caches see
exactly its own tokens in order, no padding token ever enters a recurrent state, and all
sequences share one position counter. The decode steps run on the device in one jitted
``lax.while_loop`` (the caches are its carry, updated in place; no host round trip per token)
that ends when every sequence is done; it compiles once per (batch size, cache length, new-token
count, sampling options).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

if TYPE_CHECKING:
    from gdn_jax.models.hybrid import HybridLM

__all__ = ["generate", "sample_logits"]


def sample_logits(
    logits: jax.Array,
    key: jax.Array | None,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> jax.Array:
    """Next tokens from logits.

    Args:
      logits: [B, vocab].
      key: PRNG key (unused when ``temperature == 0``).
      temperature: 0 gives the argmax (greedy); otherwise logits are divided by it.
      top_k: keep only the k largest logits.
      top_p: keep the smallest set of largest-probability tokens whose probability reaches
        ``top_p`` (nucleus sampling; the most likely token is always kept).
    Returns:
      [B] int32 token ids.
    """
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    x = logits.astype(jnp.float32) / temperature
    if top_k is not None:
        kth = jax.lax.top_k(x, top_k)[0][:, -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if top_p is not None and top_p < 1.0:
        sorted_x = jnp.sort(x, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_x, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
        keep = before < top_p
        threshold = jnp.min(jnp.where(keep, sorted_x, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x < threshold, -jnp.inf, x)
    return jax.random.categorical(key, x, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _prefill(graphdef, state, cache, tokens):
    model = nnx.merge(graphdef, state)
    logits, cache = model.extend(tokens, cache, last_only=True)
    return logits[:, -1], cache


@functools.partial(
    jax.jit,
    static_argnums=(0,),
    static_argnames=("temperature", "top_k", "top_p"),
)
def _decode_loop(
    graphdef, state, cache, logits, start, stop, prompts, lengths, eos, rng, out,
    *, temperature, top_k, top_p,
):  # fmt: skip
    """Decode positions ``start .. stop - 1`` on the device, stopping early once all are done.

    Each step chooses the token at position ``p`` for every sequence (its next prompt token while
    ``p < lengths``, else a sampled one), records it in ``out`` and feeds it through
    :meth:`HybridLM.extend`. One ``lax.while_loop``: no host round trip per token.
    """
    B, max_new = out.shape
    rows = jnp.arange(B)

    def step(carry):
        p, cache, logits, out, done = carry
        key = None if rng is None else jax.random.fold_in(rng, p)
        sampled = sample_logits(logits, key, temperature=temperature, top_k=top_k, top_p=top_p)
        in_prompt = p < lengths
        tok = jnp.where(in_prompt, jax.lax.dynamic_index_in_dim(prompts, p, 1, False), sampled)
        j = p - lengths  # index among the sequence's new tokens
        write = ~in_prompt & ~done
        col = jnp.clip(j, 0, max_new - 1)
        out = out.at[rows, col].set(jnp.where(write, tok, out[rows, col]))
        done = done | (write & ((tok == eos) | (j >= max_new - 1)))
        model = nnx.merge(graphdef, state)
        next_logits, cache = model.extend(tok[:, None], cache)
        return p + 1, cache, next_logits[:, 0], out, done

    def more(carry):
        p, _, _, _, done = carry
        return (p < stop) & ~jnp.all(done)

    done = jnp.zeros((B,), bool)
    _, _, _, out, _ = jax.lax.while_loop(more, step, (start, cache, logits, out, done))
    return out


def generate(
    model: HybridLM,
    prompts: jax.Array,
    *,
    max_new_tokens: int,
    prompt_lengths: jax.Array | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | None = None,
    rng: jax.Array | None = None,
) -> jax.Array:
    """Generate ``max_new_tokens`` tokens after each prompt.

    Args:
      model: the LM.
      prompts: [B, L] int token ids, right-padded where prompts are shorter than L.
      max_new_tokens: tokens to generate per sequence (>= 1).
      prompt_lengths: [B] ints in [1, L]; default: every prompt is L tokens.
      temperature: 0 (default): greedy (the argmax of the logits); > 0: sampling.
      top_k, top_p: sampling filters (see :func:`sample_logits`); need ``temperature > 0``.
      eos_token_id: a sequence stops after generating this token; later positions of its row
        hold ``eos_token_id``.
      rng: PRNG key for sampling (required when ``temperature > 0``).
    Returns:
      [B, max_new_tokens] int32: the new tokens of each sequence (not the prompt).
    Raises:
      ValueError: bad shapes or options (naming the argument).
    """
    prompts = jnp.asarray(prompts)
    if prompts.ndim != 2 or not jnp.issubdtype(prompts.dtype, jnp.integer):
        raise ValueError(f"prompts: expected [B, L] integer token ids; got {prompts.shape=} "
                         f"{prompts.dtype=}")  # fmt: skip
    B, L = prompts.shape
    if B == 0 or L == 0:
        raise ValueError(f"prompts: expected B >= 1 and L >= 1; got {prompts.shape=}")
    if not isinstance(max_new_tokens, int | np.integer) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: expected an int >= 1")
    if prompt_lengths is None:
        lengths = np.full((B,), L, np.int32)
    else:
        lengths = np.asarray(prompt_lengths)
        if lengths.shape != (B,) or not np.issubdtype(lengths.dtype, np.integer):
            raise ValueError(
                f"prompt_lengths: expected [B] = [{B}] integers; got shape {lengths.shape} "
                f"dtype {lengths.dtype}"
            )
        if lengths.min() < 1 or lengths.max() > L:
            raise ValueError(f"prompt_lengths={lengths.tolist()}: each must be in [1, {L}]")
        lengths = lengths.astype(np.int32)
    if not temperature >= 0.0:
        raise ValueError(f"{temperature=}: expected >= 0")
    if temperature == 0.0 and (top_k is not None or top_p is not None):
        raise ValueError(f"{top_k=}, {top_p=}: sampling filters need temperature > 0")
    if top_k is not None and not (1 <= top_k <= model.config.vocab_size):
        raise ValueError(f"{top_k=}: expected 1 <= top_k <= vocab_size")
    if top_p is not None and not (0.0 < top_p <= 1.0):
        raise ValueError(f"{top_p=}: expected 0 < top_p <= 1")
    if temperature > 0.0 and rng is None:
        raise ValueError("rng: a PRNG key is required when temperature > 0")
    if temperature == 0.0:
        rng = None

    lo, hi = int(lengths.min()), int(lengths.max())
    max_len = hi + max_new_tokens  # positions fed: 0 .. hi + max_new_tokens - 1
    graphdef, state = nnx.split(model)
    cache = model.init_cache(B, max_len)
    logits, cache = _prefill(graphdef, state, cache, prompts[:, :lo].astype(jnp.int32))
    # Prompt tokens indexed by position; positions past L are never read (they are generated).
    padded = jnp.zeros((B, max_len), jnp.int32).at[:, :L].set(prompts.astype(jnp.int32))
    fill = 0 if eos_token_id is None else int(eos_token_id)
    out = jnp.full((B, max_new_tokens), fill, jnp.int32)
    eos = jnp.int32(-1 if eos_token_id is None else eos_token_id)
    opts = dict(temperature=float(temperature), top_k=top_k, top_p=top_p)
    start, stop = jnp.int32(lo), jnp.int32(hi + max_new_tokens)
    out = _decode_loop(
        graphdef, state, cache, logits, start, stop, padded, jnp.asarray(lengths), eos, rng, out,
        **opts,
    )  # fmt: skip
    return out
