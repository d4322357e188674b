"""HybridLM.loss with the plain LM head: the logit gradients are formed in the forward pass
(no recomputed logits), within 2x the checkpointed path's distance from the f32 maths."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn_jax.models import HybridLM, get_config

B, T = 2, 40


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.sqrt(np.mean((a - b) ** 2) / max(np.mean(b**2), 1e-30)))


def _setup(tied, dtype):
    config = get_config("tiny", num_layers=1, tie_embeddings=tied, zero_centered_norm=True)
    model = HybridLM(config, dtype=dtype, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    x = jax.random.normal(jax.random.key(1), (B, T, config.hidden_size), jnp.float32)
    targets = jax.random.randint(jax.random.key(2), (B, T), 0, config.vocab_size)
    mask = jnp.ones((B, T)).at[1, 30:].set(0.0)
    return graphdef, params, x, targets, mask


def _grad_fn(graphdef, chunk):
    def f(params, x, targets, mask):
        m = nnx.merge(graphdef, params)
        return m.loss(x.astype(m.dtype or x.dtype), targets, mask=mask, chunk=chunk)

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))


def _reference(graphdef, params, x, targets, mask):
    def f(params, x):
        logits = nnx.merge(graphdef, params)._logits(x)
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
        return jnp.sum(nll * mask) / jnp.sum(mask)

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(params, x)


def _head_dots(fn, *args) -> int:
    """dot_generals of the differentiated program with the vocabulary (256) in a shape."""
    text = fn.lower(*args).as_text()
    return sum(1 for line in text.splitlines() if "dot_general" in line and "256" in line)


@pytest.mark.parametrize("tied", [True, False])
def test_forward_formed_gradients_within_2x_of_checkpointed(tied, monkeypatch):
    """bf16, chunks of 16 (the last one padded), a mask: loss and accuracy match the
    checkpointed path; gradients of the parameters and the input are within 2x its distance
    from the f32 maths; the head costs three products with the vocabulary, not four."""
    graphdef, params, x, targets, mask = _setup(tied, jnp.bfloat16)
    fused = _grad_fn(graphdef, 16)
    (loss, acc), grads = fused(params, x, targets, mask)
    ref_graphdef, ref_params, *_ = _setup(tied, None)
    want, want_grads = _reference(ref_graphdef, ref_params, x, targets, mask)
    # three per chunk, written twice: the first chunk's (outside the scan) and the scan body's
    assert _head_dots(fused, params, x, targets, mask) == 2 * 3
    monkeypatch.setattr(HybridLM, "_plain_head", lambda self, x: None)
    checkpointed = _grad_fn(graphdef, 16)
    assert _head_dots(checkpointed, params, x, targets, mask) == 4
    (loss_c, acc_c), grads_c = checkpointed(params, x, targets, mask)
    np.testing.assert_allclose(loss, loss_c, rtol=1e-5)
    np.testing.assert_allclose(acc, acc_c)
    assert abs(float(loss) - float(want)) <= 2 * abs(float(loss_c) - float(want)) + 1e-5
    leaves = lambda g: jax.tree.leaves(g)
    for got, ck, ref in zip(leaves(grads), leaves(grads_c), leaves(want_grads), strict=True):
        assert _rel(got, ref) <= 2 * _rel(ck, ref) + 1e-3


def test_no_chunks_and_f32_equal_the_checkpointed_path(monkeypatch):
    """f32, one chunk (``chunk=None``): the same values and gradients as the checkpointed path,
    to f32 rounding; a cotangent other than 1 scales both gradients."""
    graphdef, params, x, targets, mask = _setup(True, None)

    def scaled(params, x):
        m = nnx.merge(graphdef, params)
        return 3.0 * m.loss(x, targets, mask=mask, chunk=None)[0]

    fn = jax.jit(jax.value_and_grad(scaled, argnums=(0, 1)))
    loss, grads = fn(params, x)
    monkeypatch.setattr(HybridLM, "_plain_head", lambda self, x: None)
    loss_c, grads_c = jax.jit(jax.value_and_grad(scaled, argnums=(0, 1)))(params, x)
    np.testing.assert_allclose(loss, loss_c, rtol=1e-6)
    for g, c in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_c), strict=True):
        np.testing.assert_allclose(g, c, rtol=2e-5, atol=1e-7)
