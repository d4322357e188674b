"""Pallas Mosaic GPU row L2 norm of q and k (pallas_kernels.l2norm), used inside the GDN core.

CPU: the kernels under the Mosaic GPU interpreter against the jnp norm and its autodiff (f32), with
gradient parts and GVA heads summed in the kernel, what they refuse, and the CUDA lowering. GPU
(``-m gpu``, H200): the q/k shape of qwen3_5_0_8b at B4 T4096.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gdn_cases import run_interpreted

from gdn_jax.reference._common import L2NORM_EPS, l2norm
from gdn_jax.testing import rel_rms
from pallas_kernels import _compat as pk
from pallas_kernels.l2norm import MIN_CTAS, l2norm_bwd, l2norm_fwd, tiles_per_cta

f32 = jnp.float32


def _case(R, K, G, n_parts, dtype=jnp.bfloat16, seed=0):
    keys = jax.random.split(jax.random.key(seed), 1 + n_parts)
    x = (3 * jax.random.normal(keys[0], (R, K), f32)).astype(dtype)
    x = x.at[5].set(0)  # a zero row (padding): y = 0, dx = g / sqrt(eps)
    parts = tuple(jax.random.normal(k, (R, G, K), f32) for k in keys[1:])
    return x, parts


def _reference(x, parts):
    y, vjp = jax.vjp(lambda x: l2norm(x, f32), x.astype(f32))
    (dx,) = vjp(sum(p.sum(1) for p in parts))
    return y, dx


def _kernels(x, parts):
    return l2norm_fwd(x, eps=L2NORM_EPS), l2norm_bwd(x, parts, eps=L2NORM_EPS)


@pytest.mark.parametrize("K,G,n_parts,dtype", [(128, 1, 2, jnp.bfloat16), (64, 2, 1, jnp.float16)])
def test_interpret_matches_autodiff(K, G, n_parts, dtype):
    x, parts = _case(256, K, G, n_parts, dtype)
    y, dx = run_interpreted(jax.jit(_kernels), x, parts)
    y_ref, dx_ref = _reference(x, parts)
    assert y.dtype == dx.dtype == dtype
    # both outputs are f32 maths rounded once to 16 bits
    assert rel_rms(y, y_ref) <= 4e-3 and rel_rms(dx, dx_ref) <= 4e-3, (
        rel_rms(y, y_ref), rel_rms(dx, dx_ref))  # fmt: skip
    assert np.all(np.asarray(y[5], f32) == 0)


def test_interpret_reads_non_finite_values_as_zero():
    """NaN and ±inf in x are read as 0 forward and backward (gdn_jax.ops._sanitize.finite, whose
    derivative is straight through): the op passes the raw q and k to the kernels."""
    x, parts = _case(128, 128, 1, 1)
    x = x.at[3, 7].set(jnp.nan).at[9, 0].set(jnp.inf).at[9, 5].set(-jnp.inf)
    y, dx = run_interpreted(jax.jit(_kernels), x, parts)
    y_ref, dx_ref = _reference(jnp.where(jnp.isfinite(x), x, 0), parts)
    assert bool(jnp.all(jnp.isfinite(y))) and bool(jnp.all(jnp.isfinite(dx)))
    assert float(y[3, 7]) == 0 and float(y[9, 0]) == 0
    assert rel_rms(y, y_ref) <= 4e-3 and rel_rms(dx, dx_ref) <= 4e-3, (
        rel_rms(y, y_ref), rel_rms(dx, dx_ref))  # fmt: skip


def test_refuses_what_it_does_not_serve():
    with pytest.raises(NotImplementedError, match="R % 64"):
        l2norm_fwd(jnp.zeros((100, 128), jnp.bfloat16), eps=1e-6)
    with pytest.raises(NotImplementedError, match="bf16/f16"):
        l2norm_fwd(jnp.zeros((64, 128), f32), eps=1e-6)
    with pytest.raises(ValueError, match="parts must be"):
        l2norm_bwd(jnp.zeros((64, 128), jnp.bfloat16), (jnp.zeros((64, 1, 64), f32),), eps=1e-6)


def test_tiles_per_cta():
    # 4096 tiles of q at B4 T4096 H16: 16 per CTA would leave 256 CTAs, fewer than two per SM
    assert 4096 // 16 < MIN_CTAS <= 4096 // 8 and tiles_per_cta(4096 * 64) == 8
    assert tiles_per_cta(64 * 3) == 1  # a divisor of the tile count


def test_lowers_for_cuda():
    x, parts = _case(512, 128, 2, 2)
    with pk.cuda_lowering_mesh():
        txt = jax.jit(_kernels).trace(x, parts).lower(lowering_platforms=("cuda",)).as_text()
    calls = [ln for ln in txt.splitlines() if "custom_call @mosaic_gpu" in ln]
    assert len(calls) == 2


@pytest.mark.gpu
def test_gpu_matches_autodiff():
    x, parts = _case(4 * 4096 * 16, 128, 1, 2)
    y, dx = jax.jit(_kernels)(x, parts)
    y_ref, dx_ref = jax.jit(_reference)(x, parts)
    assert rel_rms(y, y_ref) <= 4e-3 and rel_rms(dx, dx_ref) <= 4e-3, (
        rel_rms(y, y_ref), rel_rms(dx, dx_ref))  # fmt: skip


@pytest.mark.gpu
def test_gpu_reads_non_finite_values_as_zero():
    x, parts = _case(4 * 4096 * 16, 128, 1, 2)
    x = x.at[3, 7].set(jnp.nan).at[9, 0].set(jnp.inf).at[70000, 5].set(-jnp.inf)
    y, dx = jax.jit(_kernels)(x, parts)
    y_ref, dx_ref = jax.jit(_reference)(jnp.where(jnp.isfinite(x), x, 0), parts)
    assert bool(jnp.all(jnp.isfinite(y))) and bool(jnp.all(jnp.isfinite(dx)))
    assert float(y[3, 7]) == 0 and float(y[70000, 5]) == 0
    assert rel_rms(y, y_ref) <= 4e-3 and rel_rms(dx, dx_ref) <= 4e-3, (
        rel_rms(y, y_ref), rel_rms(dx, dx_ref))  # fmt: skip
