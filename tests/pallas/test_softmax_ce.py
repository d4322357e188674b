"""Pallas Mosaic GPU softmax cross-entropy kernels of the LM head (pallas_kernels.softmax_ce).

CPU: the kernels under the Mosaic GPU interpreter against jnp (statistics with ties inside and
across tiles and splits, the last split's clamped tiles, a NaN row; the logit gradient), the
head's loss and gradients on them against the xla head, what they refuse, and the CUDA lowering.
GPU (``-m gpu``, H200): one chunk of qwen3_5_0_8b's head at B4 (2048 rows, 248 320 columns).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gdn_cases import run_interpreted

from gdn_jax.models import _lm_head
from gdn_jax.testing import rel_rms
from pallas_kernels import _compat as pk
from pallas_kernels import softmax_ce as ce

f32 = jnp.float32


def _logits(R, V, seed=0, dtype=jnp.bfloat16):
    x = (4 * jax.random.normal(jax.random.key(seed), (R, V), f32)).astype(dtype)
    top = x.max() + 1
    x = x.at[3, 7].set(top).at[3, V - 5].set(top)  # a tie across tiles (and splits)
    x = x.at[4, 130].set(top).at[4, 131].set(top)  # a tie inside a tile
    return x


def _kernels(x, targets, scale):
    lse, top = ce.combine(*ce.ce_stats(x))
    return lse, top, ce.ce_grad(x, lse, targets.astype(f32), scale)


def _reference(x, targets, scale):
    xf = x.astype(f32)
    lse = jax.nn.logsumexp(xf, axis=-1)
    d = (jax.nn.softmax(xf, axis=-1) - jax.nn.one_hot(targets, x.shape[1])) * scale[:, None]
    return lse, jnp.argmax(xf, axis=-1), d


@pytest.mark.parametrize("min_ctas,splits", [(ce.MIN_CTAS, (7, 1)), (6, (3, 3))])
def test_interpret_matches_jnp(min_ctas, splits, monkeypatch):
    """R 128, V 7 tiles; with 6 CTAs wanted: 3 splits of 3 tiles, the last one reading its
    single tile and two clamped repeats of it."""
    monkeypatch.setattr(ce, "MIN_CTAS", min_ctas)
    R, V = 128, 7 * ce.COLS
    assert ce.splits_for(R, V) == splits
    x = _logits(R, V)
    targets = jax.random.randint(jax.random.key(1), (R,), 0, V)
    scale = jax.random.uniform(jax.random.key(2), (R,), f32)
    lse, top, d = run_interpreted(jax.jit(_kernels), x, targets, scale)
    lse_ref, top_ref, d_ref = _reference(x, targets, scale)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-6)
    np.testing.assert_array_equal(top, top_ref)
    assert top[3] == 7 and top[4] == 130
    assert d.dtype == jnp.bfloat16 and rel_rms(d, d_ref) <= 4e-3


def test_interpret_nan_row():
    x = _logits(64, 2 * ce.COLS).at[9, 200].set(jnp.nan)
    lse, _ = run_interpreted(jax.jit(lambda x: ce.combine(*ce.ce_stats(x))), x)
    assert np.isnan(lse[9]) and np.all(np.isfinite(np.delete(np.asarray(lse), 9)))


@pytest.mark.parametrize("vocab_major", [True, False])
def test_head_loss_on_the_kernels_matches_xla(vocab_major):
    """The chunked head loss (2 chunks of 64 rows) and its gradients on the kernels equal the
    xla statistics and gradient up to 16-bit rounding of the logit gradient."""
    B, T, D, V = 2, 64, 32, 2 * ce.COLS
    k = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(k[0], (B, T, D), f32).astype(jnp.bfloat16)
    w = (jax.random.normal(k[1], (V, D) if vocab_major else (D, V), f32) / 4).astype(x.dtype)
    targets = jax.random.randint(k[2], (B, T), 0, V)
    mask = jnp.ones((B, T), f32).at[1, 50:].set(0)

    def loss(impl):
        def f(x, w):
            out = _lm_head.head_cross_entropy(x, w, targets, mask, 32, vocab_major, impl)
            return out[0], out

        return jax.jit(jax.grad(f, argnums=(0, 1), has_aux=True))

    (dx, dw), (nll, acc) = run_interpreted(loss("pallas"), x, w)
    (dx_x, dw_x), (nll_x, acc_x) = loss("xla")(x, w)
    np.testing.assert_allclose(nll, nll_x, rtol=1e-5)
    np.testing.assert_allclose(acc, acc_x)
    assert dw.shape == w.shape and dx.dtype == x.dtype
    assert rel_rms(dx, dx_x) <= 1e-2 and rel_rms(dw, dw_x) <= 1e-2


def test_refuses_what_it_does_not_serve():
    with pytest.raises(NotImplementedError, match="V % 128"):
        ce.ce_stats(jnp.zeros((64, 200), jnp.bfloat16))
    with pytest.raises(NotImplementedError, match="bf16/f16"):
        ce.ce_stats(jnp.zeros((64, 128), f32))
    with pytest.raises(ValueError, match="lse: expected"):
        z = jnp.zeros((64,), f32)
        ce.ce_grad(jnp.zeros((64, 128), jnp.bfloat16), z[:8], z, z)


def test_head_refuses_auto_mesh_axes():
    """Under Auto mesh axes the kernels (opaque to the partitioner) are not tried: the head's
    check raises NotImplementedError, so HybridLM.loss falls back to xla."""
    x = jnp.zeros((2, 64, 32), jnp.bfloat16)
    w = jnp.zeros((ce.COLS, 32), jnp.bfloat16)
    with pk.use_mode("interpret"):
        _lm_head.check_pallas(x, w, 128, ce.COLS)  # no mesh: served
        mesh = jax.make_mesh(
            (2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2
        )
        with jax.set_mesh(mesh), pytest.raises(NotImplementedError, match="partitioner"):
            _lm_head.check_pallas(x, w, 128, ce.COLS)


def test_lowers_for_cuda():
    R, V = 2048, 1940 * ce.COLS  # one chunk of qwen3_5_0_8b's head at B4
    args = (
        jax.ShapeDtypeStruct((R, V), jnp.bfloat16),
        jax.ShapeDtypeStruct((R,), jnp.int32),
        jax.ShapeDtypeStruct((R,), f32),
    )
    with pk.cuda_lowering_mesh():
        txt = jax.jit(_kernels).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = [ln for ln in txt.splitlines() if "custom_call @mosaic_gpu" in ln]
    assert len(calls) == 2


@pytest.mark.gpu
def test_gpu_matches_jnp():
    R, V = 2048, 1940 * ce.COLS
    x = _logits(R, V)
    targets = jax.random.randint(jax.random.key(1), (R,), 0, V)
    scale = jax.random.uniform(jax.random.key(2), (R,), f32)
    lse, top, d = jax.jit(_kernels)(x, targets, scale)
    lse_ref, top_ref, d_ref = jax.jit(_reference)(x, targets, scale)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-5)
    np.testing.assert_array_equal(top, top_ref)
    assert rel_rms(d, d_ref) <= 4e-3, rel_rms(d, d_ref)
