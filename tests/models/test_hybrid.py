"""Hybrid LM: layer pattern, presets, causality, packed sequences, sharding annotations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn_jax.models import PRESETS, GatedAttention, HybridLM, get_config
from gdn_jax.models.attention import apply_rotary
from gdn_jax.nn import GatedDeltaNet

SMALL = dict(num_layers=2, full_attention_interval=2, vocab_size=64)  # layer 1 is attention


@nnx.jit
def run(model, tokens, cu_seqlens=None):
    return model(tokens, cu_seqlens=cu_seqlens)


def test_layer_pattern_is_qwen3_5():
    types = get_config("qwen3_5_0_8b").layer_types
    assert len(types) == 24
    assert [i for i, t in enumerate(types) if t == "attention"] == [3, 7, 11, 15, 19, 23]
    assert set(get_config("tiny", full_attention_interval=0).layer_types) == {"linear"}


def test_tiny_forward_and_mixers():
    model = HybridLM(get_config("tiny"), rngs=nnx.Rngs(0))
    mixers = [type(layer.mixer) for layer in model.layers]
    assert mixers == [GatedDeltaNet] * 3 + [GatedAttention]
    tokens = jax.random.randint(jax.random.key(0), (2, 24), 0, 256)
    logits = run(model, tokens)
    assert logits.shape == (2, 24, 256) and logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))


def test_causal():
    model = HybridLM(get_config("tiny", **SMALL), rngs=nnx.Rngs(0))
    a = jax.random.randint(jax.random.key(0), (1, 20), 0, 64)
    b = a.at[:, 12:].set((a[:, 12:] + 1) % 64)
    la, lb = run(model, a), run(model, b)
    np.testing.assert_allclose(la[:, :12], lb[:, :12], atol=1e-5)
    assert float(jnp.abs(la[:, 12:] - lb[:, 12:]).max()) > 1e-3


def test_packed_equals_separate():
    model = HybridLM(get_config("tiny", **SMALL), rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 30), 0, 64)
    cu = jnp.asarray([0, 11, 11, 30], jnp.int32)
    packed = run(model, tokens, cu)
    np.testing.assert_allclose(packed[:, :11], run(model, tokens[:, :11]), atol=2e-5)
    np.testing.assert_allclose(packed[:, 11:], run(model, tokens[:, 11:]), atol=2e-5)


def test_bf16_compute():
    model = HybridLM(get_config("tiny", **SMALL), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    logits = run(model, jnp.zeros((1, 8), jnp.int32))
    assert logits.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(logits)))


def test_qwen3_5_0_8b_preset():
    config = PRESETS["qwen3_5_0_8b"]
    assert (config.hidden_size, config.intermediate_size, config.vocab_size) == (1024, 3584, 248320)
    model = nnx.eval_shape(lambda: HybridLM(config, rngs=nnx.Rngs(0)))
    params = nnx.state(model, nnx.Param)
    n = sum(x.size for x in jax.tree.leaves(params))
    assert 0.7e9 < n < 0.9e9, n
    gdn, attn = model.layers[0].mixer, model.layers[3].mixer
    assert (gdn.num_heads, gdn.num_v_heads, gdn.head_dim, gdn.v_head_dim) == (16, 16, 128, 128)
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.rotary_dim) == (8, 2, 256, 64)


def test_every_param_has_logical_axes():
    model = nnx.eval_shape(lambda: HybridLM(get_config("tiny"), rngs=nnx.Rngs(0)))
    leaves = jax.tree_util.tree_leaves_with_path(
        nnx.state(model, nnx.Param), is_leaf=lambda v: isinstance(v, nnx.Variable)
    )
    assert leaves
    for path, var in leaves:
        axes = var.get_metadata().get("out_sharding")
        assert axes is not None and len(axes) == len(var.shape), path


def test_rotary():
    x = jax.random.normal(jax.random.key(0), (1, 5, 2, 16))
    pos = jnp.arange(5)[None]
    y = apply_rotary(x, pos, rotary_dim=4, theta=10_000.0)
    np.testing.assert_array_equal(y[..., 4:], x[..., 4:])  # partial: the rest passes through
    np.testing.assert_allclose(  # rotations keep the norm of each pair
        jnp.linalg.norm(y[..., :4], axis=-1), jnp.linalg.norm(x[..., :4], axis=-1), rtol=1e-5
    )
    np.testing.assert_array_equal(apply_rotary(x, pos, rotary_dim=0, theta=1.0), x)


def test_bad_config():
    with pytest.raises(ValueError, match="name"):
        get_config("llama")
    with pytest.raises(ValueError, match="num_kv_heads"):
        GatedAttention(8, num_heads=3, num_kv_heads=2, head_dim=4, rngs=nnx.Rngs(0))


def test_decode_equals_forward():
    model = HybridLM(get_config("tiny", **SMALL), rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, 64)
    want = run(model, tokens)
    extend = nnx.jit(lambda m, t, c: m.extend(t, c))
    cache = model.init_cache(2, max_len=16)
    outs = []
    for lo, hi in [(0, 7)] + [(t, t + 1) for t in range(7, 12)]:
        logits, cache = extend(model, tokens[:, lo:hi], cache)
        outs.append(logits)
    assert int(cache.pos) == 12
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), want, atol=2e-5)


@pytest.mark.slow
def test_chunked_loss_equals_full_logits_loss():
    """``loss`` over 16-position chunks equals cross-entropy of the full logits (value, accuracy
    and gradients), weights padding by ``mask``, and never builds the [B, T, vocab] logits. One
    GDN layer: the LM head's chunking does not depend on the layers below it."""
    model = HybridLM(get_config("tiny", num_layers=1), implementation="xla", rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    tokens = jax.random.randint(jax.random.key(1), (2, 65), 0, 256)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    mask = jnp.ones((2, 64)).at[1, 40:].set(0.0)

    def chunked(params, chunk):
        m = nnx.merge(graphdef, params)
        return m.loss(m.hidden(inputs), targets, mask=mask, chunk=chunk)

    def full(params):
        logits = nnx.merge(graphdef, params)(inputs)
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
        acc = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
        return jnp.sum(nll * mask) / jnp.sum(mask), jnp.sum(acc * mask) / jnp.sum(mask)

    grad_chunked = jax.jit(jax.value_and_grad(chunked, has_aux=True), static_argnums=1)
    (loss, acc), grads = grad_chunked(params, 16)
    (want, want_acc), want_grads = jax.jit(jax.value_and_grad(full, has_aux=True))(params)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    np.testing.assert_allclose(acc, want_acc, rtol=1e-6)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)
    forward = jax.jit(chunked, static_argnums=1)
    np.testing.assert_allclose(forward(params, None)[0], want, rtol=1e-5)
    hlo = grad_chunked.lower(params, 16).as_text()
    # chunks of B · 16 rows, never the [B, T, vocab] (or [B · T, vocab]) logits
    assert "2x64x256xf32" not in hlo and "128x256xf32" not in hlo and "<32x256xf32>" in hlo
    np.testing.assert_allclose(forward(params, 24)[0], want, rtol=1e-5)  # last chunk padded
