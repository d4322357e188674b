"""Training tasks for examples/train.py: batches are pure functions of the step number.

Each task returns ``batch(step) -> dict(inputs, targets, mask)`` ([B, T] int32, int32, f32),
traceable inside ``jax.jit``: the data of step ``s`` depends only on (seed, s), so a run restored
from a checkpoint sees exactly the batches an uninterrupted run sees.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

Batch = dict[str, jax.Array]


def mqar(
    *, seed: int, batch_size: int, num_pairs: int, num_keys: int, num_values: int
) -> Callable[[jax.Array], Batch]:
    """Multi-query associative recall (Zoology, Arora et al. 2023).

    A sequence lists ``num_pairs`` key-value pairs, then queries every key again in a random
    order, each followed by its value: ``k1 v1 k2 v2 ... | k7 v7 k2 v2 ...``. Loss and accuracy
    count only the predictions made at the query keys (the value must be recalled from the context).
    Keys are tokens ``[0, num_keys)``, values ``[num_keys, num_keys + num_values)``; keys in a
    sequence are distinct. Sequence length is ``4 * num_pairs``; chance accuracy ``1/num_values``.
    """
    if num_pairs > num_keys:
        raise ValueError(f"{num_pairs=} must be <= {num_keys=} (keys are distinct)")
    base = jax.random.key(seed)
    n = num_pairs

    def one(key):
        kk, kv, kq = jax.random.split(key, 3)
        keys = jax.random.permutation(kk, num_keys)[:n]
        values = jax.random.randint(kv, (n,), num_keys, num_keys + num_values)
        order = jax.random.permutation(kq, n)
        context = jnp.stack([keys, values], -1).reshape(2 * n)
        queries = jnp.stack([keys[order], values[order]], -1).reshape(2 * n)
        return jnp.concatenate([context, queries]).astype(jnp.int32)

    T = 4 * n
    # Query keys sit at positions 2n, 2n + 2, ...; their next token is the value to recall.
    mask = ((jnp.arange(T) >= 2 * n) & (jnp.arange(T) % 2 == 0)).astype(jnp.float32)

    def batch(step):
        seq = jax.vmap(one)(jax.random.split(jax.random.fold_in(base, step), batch_size))
        targets = jnp.concatenate([seq[:, 1:], jnp.zeros((batch_size, 1), jnp.int32)], axis=1)
        return dict(inputs=seq, targets=targets, mask=jnp.broadcast_to(mask, (batch_size, T)))

    return batch


def text(
    path: str | Path, *, seed: int, batch_size: int, seq_len: int
) -> Callable[[jax.Array], Batch]:
    """Next-byte prediction on random windows of a text file (byte vocabulary, 256 tokens)."""
    data = np.frombuffer(Path(path).read_bytes(), dtype=np.uint8)
    if data.size < seq_len + 2:
        raise ValueError(f"{path}: {data.size} bytes, need more than {seq_len + 1}")
    data = jnp.asarray(data, jnp.int32)
    base = jax.random.key(seed)

    def batch(step):
        starts = jax.random.randint(
            jax.random.fold_in(base, step), (batch_size,), 0, data.size - seq_len - 1
        )
        windows = jax.vmap(lambda s: jax.lax.dynamic_slice(data, (s,), (seq_len + 1,)))(starts)
        return dict(
            inputs=windows[:, :-1],
            targets=windows[:, 1:],
            mask=jnp.ones((batch_size, seq_len), jnp.float32),
        )

    return batch
