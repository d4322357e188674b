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


@pytest.mark.parametrize(
    "kernel_size, packed, with_tail, activation, dtype",
    [
        (4, False, False, jax.nn.silu, jnp.float32),
        (4, True, False, jax.nn.silu, jnp.float32),
        (3, False, True, None, jnp.float32),
        (1, True, False, jax.nn.silu, jnp.float32),
        (4, True, False, jax.nn.silu, jnp.bfloat16),
    ],
)
def test_short_conv_gradients_match_autodiff_of_its_forward(
    kernel_size, packed, with_tail, activation, dtype
):
    """The conv's written-out backward gives JAX's autodiff of the same forward (the taps summed
    in f32, then the activation): input, weight and tail gradients, with packed sequences (one
    empty), for any kernel size, in f32 and bf16; the forward is unchanged bit for bit."""
    from gdn_jax.nn.layers import _conv_taps, sequence_starts

    B, T, C, W = 2, 11, 6, kernel_size
    conv = ShortConv(C, kernel_size=W, activation=activation, rngs=nnx.Rngs(3))
    ks = jax.random.split(jax.random.key(1), 4)
    x = jax.random.normal(ks[0], (1 if packed else B, T, C)).astype(dtype)
    tail = jax.random.normal(ks[1], (x.shape[0], W - 1, C)).astype(dtype) if with_tail else None
    dy = jax.random.normal(ks[2], x.shape).astype(dtype)
    cu = jnp.asarray([0, 3, 3, 8, T], jnp.int32) if packed else None
    w0 = conv.weight[...]

    def autodiff_conv(x, w, tail):
        pad = jnp.pad(x, ((0, 0), (W - 1, 0), (0, 0)))
        xp = pad if tail is None else jnp.concatenate([tail, x], 1)
        keep = None
        if cu is not None:
            back = W - 1 - jnp.arange(W)[:, None]  # tap j reads token t - back[j]
            keep = jnp.arange(T)[None] - back >= sequence_starts(cu, T)[None]
        y = _conv_taps(xp, w.astype(jnp.float32), keep)
        return (y if activation is None else activation(y)).astype(x.dtype)

    graphdef, state = nnx.split(conv)

    def ours(x, w, tail):
        return nnx.merge(graphdef, jax.tree.map(lambda _: w, state))(x, cu_seqlens=cu, tail=tail)

    loss = lambda f: lambda x, w, tail: jnp.sum(f(x, w, tail).astype(jnp.float32) * dy)
    np.testing.assert_array_equal(ours(x, w0, tail), autodiff_conv(x, w0, tail))
    got = jax.grad(loss(ours), argnums=(0, 1, 2))(x, w0, tail)
    want = jax.grad(loss(autodiff_conv), argnums=(0, 1, 2))(x, w0, tail)
    for name, a, b in zip(("dx", "dw", "dtail"), got, want, strict=True):
        if b is None:
            assert a is None
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, name
        tol = 1e-5 if dtype == jnp.float32 else 1e-2
        np.testing.assert_allclose(
            np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol, err_msg=name
        )
        assert np.abs(np.asarray(b, np.float32)).max() > 0, name
