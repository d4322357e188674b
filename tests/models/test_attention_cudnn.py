"""Gated attention through cuDNN's flash attention where it serves (GPU, bf16/f16, causal).

The choice (``attention_implementation``) is checked everywhere; the cuDNN path itself on the
GPU (``-m gpu``): it is taken (the compiled step calls cuDNN's fused attention) and its output
and gradients are within 2x the XLA path's distance from the f32 maths.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn_jax.models import attention
from gdn_jax.models.attention import GatedAttention, attention_implementation


def test_xla_where_cudnn_does_not_serve():
    """On a CPU, in f32, or with an explicit mask, attention stays on XLA's implementation."""
    bf = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
    f32 = bf.astype(jnp.float32)
    mask = jnp.ones((1, 1, 8, 8), bool)
    assert attention_implementation(f32, f32, None) is None
    assert attention_implementation(bf, bf, mask) is None
    if jax.default_backend() == "cpu":
        assert attention_implementation(bf, bf, None) is None


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b**2)))


def _layer(dtype, head_dim):
    return GatedAttention(
        512, num_heads=8, num_kv_heads=2, head_dim=head_dim, zero_centered_norm=True,
        dtype=dtype, rngs=nnx.Rngs(0),
    )  # fmt: skip


def _loss_and_grads(layer, x, positions):
    graphdef, params = nnx.split(layer, nnx.Param)

    def f(params, x):
        y = nnx.merge(graphdef, params)(x, positions=positions)
        return jnp.sum(y.astype(jnp.float32) * jnp.cos(jnp.arange(y.shape[-1]))), y

    fn = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))
    return fn, (params, x)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128, 256])
def test_cudnn_attention_within_2x_of_xla(head_dim, monkeypatch):
    """bf16, causal, GQA 8/2 heads, T=512: the cuDNN path is compiled in, and its output and
    gradients (parameters and input) are within 2x the XLA path's error vs the f32 maths."""
    if (
        attention_implementation(
            jnp.zeros((1, 1, 1, head_dim), jnp.bfloat16),
            jnp.zeros((1, 1, 1, head_dim), jnp.bfloat16),
            None,
        )
        is None
    ):
        pytest.skip("cuDNN flash attention does not serve this GPU / head dim")  # fmt: skip
    B, T = 2, 512
    x = jax.random.normal(jax.random.key(1), (B, T, 512), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    fn, args = _loss_and_grads(_layer(jnp.bfloat16, head_dim), x, positions)
    assert "__cudnn$fmha" in fn.lower(*args).compile().as_text()
    (_, y), grads = fn(*args)
    ref_fn, ref_args = _loss_and_grads(_layer(jnp.float32, head_dim), x, positions)
    (_, y_ref), g_ref = ref_fn(*ref_args)
    monkeypatch.setattr(attention, "attention_implementation", lambda *a: None)
    xla_fn, _ = _loss_and_grads(_layer(jnp.bfloat16, head_dim), x, positions)
    assert "__cudnn$fmha" not in xla_fn.lower(*args).compile().as_text()
    (_, y_xla), g_xla = xla_fn(*args)
    floor = 1e-3  # bf16 rounding of the output alone
    assert _rel(y, y_ref) <= 2 * _rel(y_xla, y_ref) + floor
    for got, xla, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(g_xla),
                             jax.tree.leaves(g_ref), strict=True):  # fmt: skip
        assert _rel(got, ref) <= 2 * _rel(xla, ref) + floor
