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


def _taps_by_autodiff(w, xp, keep, activation):
    """The conv as plain jnp ops (JAX differentiates them): xp [B, T + W - 1, C]."""
    T = xp.shape[1] - w.shape[0] + 1
    y = sum(jnp.where(keep[None, :, j, None], xp[:, j : j + T] * w[j], 0.0) for j in range(len(w)))
    return y if activation is None else activation(y)


@pytest.mark.parametrize("case", ["dense", "packed", "tail", "no_activation"])
def test_short_conv_gradients_match_autodiff_of_the_taps(case):
    """ShortConv's gradients (weights, inputs, decode tail) against JAX's gradient of the taps
    written out with an independently built mask of packed sequences."""
    activation = None if case == "no_activation" else jax.nn.silu
    conv = ShortConv(6, kernel_size=4, activation=activation, rngs=nnx.Rngs(2))
    graphdef, state = nnx.split(conv)
    B, T, W = (1 if case == "packed" else 2), 17, 4
    ks = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(ks[0], (B, T, 6))
    tail = jax.random.normal(ks[1], (B, W - 1, 6)) if case == "tail" else None
    ct = jax.random.normal(ks[2], (B, T, 6))
    cu = jnp.asarray([0, 3, 3, 10, 17], jnp.int32) if case == "packed" else None
    keep = jnp.ones((T, W), bool)
    if cu is not None:  # tap j reads t - (W - 1 - j): kept inside t's sequence
        seq_start = np.asarray([0, 0, 0, 3, 3, 3, 3, 3, 3, 3, 10, 10, 10, 10, 10, 10, 10])
        keep = jnp.asarray(np.arange(T)[:, None] - (W - 1 - np.arange(W)) >= seq_start[:, None])

    def ours(state, x, tail):
        return jnp.sum(nnx.merge(graphdef, state)(x, cu_seqlens=cu, tail=tail) * ct)

    def reference(state, x, tail):
        lead = jnp.zeros((B, W - 1, 6)) if tail is None else tail
        xp = jnp.concatenate([lead, x], axis=1)
        return jnp.sum(_taps_by_autodiff(state["weight"][...], xp, keep, activation) * ct)

    argnums = (0, 1, 2) if tail is not None else (0, 1)
    got = jax.jit(jax.grad(ours, argnums))(state, x, tail)
    want = jax.grad(reference, argnums)(state, x, tail)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(jax.tree.leaves(got)[0]).max()) > 0.1  # a weight gradient, not zeros


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
