"""The forward chunk loop (:mod:`pallas_kernels.recurrence.chunk_fwd`) against a NumPy recurrence.

Its two compute warpgroups hand the staged state and v_new over through double-buffered SMEM
tiles and two barriers per slot; these tests run the loop itself in the Mosaic GPU interpreter at
chunk counts that reach every case of that hand-over (one chunk: no slot reused; two: both slots,
none reused; three and five: slots reused, odd and even ends), for both gate shapes, bf16 and f16,
with an initial state, and against the backward's recomputation (``store_h``) of the same loop;
and the whole-state CTA (``block_v = 128``), whose scalar gate hands over through one slot.
The GPU runs the same loop in every op-level GPU test (``-m gpu``).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _compat as pk
from pallas_kernels.recurrence.chunk_fwd import ChunkFwdConfig, channel_chunk_fwd, chunk_fwd

C = 64
f32 = np.float32


def _rnd(rng, shape, scale=0.1):
    return (rng.standard_normal(shape) * scale).astype(f32)


def _io(x, dtype):
    """x rounded to the io dtype, as f32 (what the kernel's 16-bit operands hold)."""
    return np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))


def _reference(channel, q, k, w, u, g, a, h0, scale):
    """o [T, V] and the end state [K, V] of one head, in f32 from the io-rounded inputs."""
    T, S = q.shape[0], h0.copy()
    o = np.zeros((T, u.shape[1]), f32)
    for c in range(T // C):
        r = slice(c * C, (c + 1) * C)
        v_new = u[r] - w[r] @ S
        if channel:  # q, k: qg, kg; a: Aqk; g: e^{G_last} [T/64, K]
            o[r] = scale * (q[r] @ S + a[r] @ v_new)
            S = g[c][:, None] * S + k[r].T @ v_new
        else:  # g: G [T], chunk-local cumulative
            gc = g[r]
            p = np.tril(q[r] @ k[r].T * np.exp(gc[:, None] - gc[None, :]))
            o[r] = scale * ((q[r] @ S) * np.exp(gc)[:, None] + p @ v_new)
            S = np.exp(gc[-1]) * S + k[r].T @ (v_new * np.exp(gc[-1] - gc)[:, None])
    return o, S


def _inputs(rng, channel, T, K, V):
    """One batch row, one head: (q, k, w, u, gate, Aqk or None, h0) as f32 arrays."""
    q, k, w, u = _rnd(rng, (T, K)), _rnd(rng, (T, K)), _rnd(rng, (T, K)), _rnd(rng, (T, V))
    h0 = _rnd(rng, (K, V), 1.0)
    if channel:
        gate = np.exp(-rng.uniform(0.0, 2.0, (T // C, K))).astype(f32)  # e^{G_last}
        a = np.tril(_rnd(rng, (T, C))[None].reshape(T // C, C, C)).reshape(T, C)
    else:
        gate = np.cumsum(-rng.uniform(0.0, 0.1, (T // C, C)), axis=1).reshape(T).astype(f32)
        a = None
    return q, k, w, u, gate, a, h0


@pytest.mark.parametrize("channel", [False, True], ids=["scalar", "channel"])
@pytest.mark.parametrize(
    "chunks,dtype,block_v",
    [(n, dt, 64) for n in (1, 2, 3, 5) for dt in ("bfloat16", "float16")]
    # the whole-state CTA (QAT "matrix"): the scalar gate's one slot, the channel's one stage
    + [(n, "bfloat16", 128) for n in (1, 2, 3)],
)
def test_interpret_forward_matches_recurrence(channel, chunks, dtype, block_v):
    """o and the final state within the io rounding of the staged operands (2^-8 relative for
    bf16: a swapped or stale slot is off by the whole state's contribution)."""
    K = V = block_v
    T = chunks * C
    rng = np.random.default_rng(chunks + 10 * channel)
    q, k, w, u, gate, a, h0 = _inputs(rng, channel, T, K, V)
    dt = jnp.dtype(dtype)
    q, k, w, u = (_io(x, dt) for x in (q, k, w, u))
    a = None if a is None else _io(a, dt)
    scale = K**-0.5
    o_ref, s_ref = _reference(channel, q, k, w, u, gate, a, h0, scale)
    cfg = ChunkFwdConfig(scale=scale, block_v=block_v)

    def head(x):  # [T, n] -> [1, T, 1, n]
        return jnp.asarray(x, dt)[None, :, None, :]

    with pk.use_mode("interpret"):
        try:
            if channel:
                egl = jnp.asarray(gate)[None, None]
                o, ht = channel_chunk_fwd(
                    head(q), head(k), head(w), head(u), head(a), egl, jnp.asarray(h0)[None, None],
                    cfg,
                )  # fmt: skip
                h, vn = channel_chunk_fwd(
                    None, head(k), head(w), head(u), None, egl, jnp.asarray(h0)[None, None],
                    ChunkFwdConfig(scale=scale, block_v=block_v, store_h=True),
                )  # fmt: skip
            else:
                G = jnp.asarray(gate)[None, None]
                o, ht = chunk_fwd(
                    head(q), head(k), head(w), head(u), G, jnp.asarray(h0)[None, None], cfg
                )
                h, vn = chunk_fwd(
                    None, head(k), head(w), head(u), G, jnp.asarray(h0)[None, None],
                    ChunkFwdConfig(scale=scale, block_v=block_v, store_h=True),
                )  # fmt: skip
            o, ht, h = (np.asarray(jnp.asarray(x, jnp.float32)) for x in (o, ht, h))
        finally:
            pk.reset_interpreter()
    tol = 2e-2 if dtype == "bfloat16" else 4e-3
    assert np.max(np.abs(o[0, :, 0] - o_ref)) <= tol * np.max(np.abs(o_ref))
    assert np.max(np.abs(ht[0, 0] - s_ref)) <= tol * np.max(np.abs(s_ref))
    # the recomputation's h[c] is the state entering chunk c: h[0] = h0, and the forward's end
    # state continues from h[-1] over the last chunk
    np.testing.assert_allclose(h[0, 0, 0], _io(h0, dt) if dtype == "bfloat16" else h0, atol=0)
    last = slice((chunks - 1) * C, T)
    _, s_last = _reference(
        channel, q[last], k[last], w[last], u[last], gate[chunks - 1 :] if channel else gate[last],
        None if a is None else a[last], h[0, -1, 0], scale,
    )  # fmt: skip
    assert np.max(np.abs(ht[0, 0] - s_last)) <= tol * np.max(np.abs(s_ref))
