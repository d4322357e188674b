"""ShortConv and the RMS norms against direct NumPy formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn_jax.nn import GatedRMSNorm, RMSNorm, ShortConv


def np_conv(x, w):
    """Causal depthwise conv + SiLU: y[t] = silu(sum_j w[j] x[t - W + 1 + j]); x [T, C], w [W, C]"""
    W = w.shape[0]
    xp = np.concatenate([np.zeros((W - 1, x.shape[1])), x])
    y = sum(xp[j : j + len(x)] * w[j] for j in range(W))
    return y / (1 + np.exp(-y))


def test_short_conv_matches_numpy_and_respects_packing():
    conv = ShortConv(5, kernel_size=4, rngs=nnx.Rngs(0))
    w = np.asarray(conv.weight[...], np.float64)
    x = np.random.default_rng(0).normal(size=(1, 12, 5))
    np.testing.assert_allclose(conv(jnp.asarray(x, jnp.float32))[0], np_conv(x[0], w), atol=1e-5)
    cu = jnp.asarray([0, 2, 2, 9, 12], jnp.int32)  # includes an empty sequence
    packed = np.asarray(conv(jnp.asarray(x, jnp.float32), cu_seqlens=cu))[0]
    for lo, hi in [(0, 2), (2, 9), (9, 12)]:
        np.testing.assert_allclose(packed[lo:hi], np_conv(x[0, lo:hi], w), atol=1e-5)


def test_short_conv_tail_continues_a_sequence():
    conv = ShortConv(3, kernel_size=4, rngs=nnx.Rngs(1))
    x = jax.random.normal(jax.random.key(0), (2, 10, 3))
    tail = jnp.zeros((2, 3, 3))
    outs = []
    for lo, hi in [(0, 1), (1, 6), (6, 10)]:
        outs.append(conv(x[:, lo:hi], tail=tail))
        tail = conv.next_tail(x[:, lo:hi], tail)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), conv(x), atol=1e-6)
    with pytest.raises(ValueError, match="tail.shape"):
        conv(x, tail=jnp.zeros((2, 2, 3)))
    with pytest.raises(ValueError, match="channels"):
        conv(jnp.zeros((1, 4, 7)))


def test_norms():
    x = np.random.default_rng(0).normal(size=(3, 8))
    z = np.random.default_rng(1).normal(size=(3, 8))
    rms = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6)
    norm = RMSNorm(8, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(norm(jnp.asarray(x)), rms, rtol=1e-5)
    gated = GatedRMSNorm(8, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    y = gated(jnp.asarray(x, jnp.float32), jnp.asarray(z, jnp.float32))
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), rms * z / (1 + np.exp(-z)), rtol=2e-2)
