"""Chunk-local gate cumsum of GDN2 / KDA on the Mosaic GPU kernel
(pallas_kernels.channel.gate_cumsum) and its custom_vjp (gdn_jax.ops._gate_cumsum).

CPU: the kernel under the Mosaic GPU interpreter, forward and reverse, against a sequential f32
cumsum (bitwise) and an f64 one (to f32 rounding of the running sum, a bound that a bf16 product
breaks), the VJP against autodiff of XLA's form, what it refuses, and the CUDA lowering with its
shared-memory budget. GPU (``-m gpu``, H200): the KDA shape B4 T4096 HV16 K128.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gdn_cases import lowered_kernels, run_interpreted, smem_limit, smem_per_cta

from gdn_jax.ops import _gate_cumsum
from gdn_jax.reference.chunked import gate_cumsum
from pallas_kernels import _compat as pk
from pallas_kernels.channel.gate_cumsum import MIN_CTAS, chunk_cumsum, tiles_per_cta

f32 = jnp.float32
# max |error| / max |G| of a chunk cumsum of log-decays in [-10, 0] against f64: a sequential f32
# sum stays within a few f32 ulps of the running sum (~3e-7 measured); bf16 operands give ~2e-3
TOL = 2e-6


def _gates(shape, seed=0, scale=10.0):
    """Log-decays in [-scale, 0], as the glue feeds the cumsum after its clamp at -10."""
    return -scale * np.random.default_rng(seed).uniform(0, 1, shape).astype(np.float32)


def _sequential(g, reverse=False, dtype=np.float32):
    """np.cumsum (a sequential sum in ``dtype``) over the rows of each 64-row chunk."""
    N, Tp = g.shape[:2]
    c = np.asarray(g, dtype).reshape((N, Tp // 64, 64) + g.shape[2:])
    if reverse:
        return np.flip(np.cumsum(np.flip(c, 2), 2, dtype=dtype), 2).reshape(g.shape)
    return np.cumsum(c, 2, dtype=dtype).reshape(g.shape)


def _err(x, ref64) -> float:
    return float(np.max(np.abs(np.asarray(x, np.float64) - ref64)) / np.max(np.abs(ref64)))


def _bf16_product(g):
    """The cumsum as a product with bf16 operands (f32 accumulation): not accurate enough."""
    N, Tp = g.shape[:2]
    c = jnp.asarray(g).reshape((N, Tp // 64, 64, -1)).astype(jnp.bfloat16)
    tril = jnp.tril(jnp.ones((64, 64), jnp.bfloat16))
    return jnp.einsum("ij,ncjd->ncid", tril, c, preferred_element_type=f32).reshape(g.shape)


# (shape, per_cta): K = 64 with an even HV and K = 128; per_cta > 1 runs the load pipeline
# through slot reuse (tiles = N · Tp / 64 · HV · K / 128)
CASES = [((1, 128, 2, 64), None), ((2, 64, 1, 128), None), ((1, 256, 2, 128), 4)]


@pytest.mark.parametrize("shape,per_cta", CASES)
def test_interpret_matches_sequential_cumsum(shape, per_cta):
    g = _gates(shape)
    f = jax.jit(lambda g: [chunk_cumsum(g, reverse=r, per_cta=per_cta) for r in (False, True)])
    fwd, rev = run_interpreted(f, g)
    for got, reverse in ((fwd, False), (rev, True)):
        assert got.shape == g.shape and got.dtype == f32
        # rows added one after the other in f32: bitwise a sequential f32 cumsum
        np.testing.assert_array_equal(np.asarray(got), _sequential(g, reverse))
        assert _err(got, _sequential(g, reverse, np.float64)) <= TOL


def test_bf16_product_breaks_the_tolerance():
    """The tolerance of these tests is tight enough to reject bf16 operands (input rounding
    ~2e-3 relative), while the kernel's f32 sum passes it."""
    g = _gates((1, 128, 2, 64), seed=1)
    ref64 = _sequential(g, False, np.float64)
    assert _err(_bf16_product(g), ref64) > 100 * TOL
    got = run_interpreted(jax.jit(chunk_cumsum), g)
    assert _err(got, ref64) <= TOL


def test_interpret_vjp_matches_autodiff_of_xla_form():
    """lane_gate_cumsum's VJP (the reverse kernel) against jax.grad of the f32 product."""
    shape = (1, 128, 4, 64)
    g = _gates(shape, seed=2)
    ct = np.random.default_rng(3).standard_normal(shape).astype(np.float32)

    def xla_form(g):
        return gate_cumsum(g.reshape(1, 2, 64, 4, 64)).reshape(shape)

    def loss(fn, g):
        return jnp.sum(fn(g) * ct)

    def kernel_value_and_grad(g):
        assert _gate_cumsum.kernel_serves(g)
        return jax.value_and_grad(functools.partial(loss, _gate_cumsum.lane_gate_cumsum))(g)

    val, dg = run_interpreted(jax.jit(kernel_value_and_grad), g)
    val_ref, dg_ref = jax.jit(jax.value_and_grad(functools.partial(loss, xla_form)))(g)
    np.testing.assert_allclose(float(val), float(val_ref), rtol=1e-5)
    dg64 = _sequential(ct, True, np.float64)  # the transpose of the cumsum: a suffix sum
    assert _err(dg, dg64) <= TOL
    assert _err(dg_ref, dg64) <= 10 * TOL  # XLA's HIGHEST f32 product, for scale
    np.testing.assert_array_equal(np.asarray(dg), _sequential(ct, True))


def test_interpret_floor_clamps_raw_gates():
    """``floor``: the kernel clamps the raw log-decay as it reads it (NaN, ±inf, growth, values
    below the floor, the floor itself): the cumsum equals the sequential cumsum of
    clamped_log_decay(g), and the gradient equals autodiff of that composition (0 outside,
    ½ exactly at the floor)."""
    shape, floor = (2, 128, 2, 64), -10.0
    g = _gates(shape, seed=4, scale=12.0)  # some below the floor
    g[0, 3, 0, :4] = [np.nan, np.inf, -np.inf, 0.5]
    g[0, 70, 1, 5:8] = [floor, 0.0, -1e30]
    ct = np.random.default_rng(5).standard_normal(shape).astype(np.float32)

    g[1, 0, 1, 0] = np.nan  # (batch row 1, the first row of a chunk)
    g[1, 127, 0, 63] = np.inf  # (the last row)
    g[0, 5, 0, 9] = np.inf  # (a later bad row of a chunk with one already)

    def kernel_value_and_grad(g):
        loss = lambda g: jnp.sum(_gate_cumsum.lane_gate_cumsum(g, floor)[0] * ct)  # noqa: E731
        return _gate_cumsum.lane_gate_cumsum(g, floor), jax.grad(loss)(g)

    (G, first_bad), dg = run_interpreted(jax.jit(kernel_value_and_grad), g)
    # the rows holding NaN or +inf per chunk and head (−inf is a valid reset), as XLA's form
    want_first = np.full((shape[0], shape[2], shape[1] // 64), 64.0, np.float32)
    want_first[0, 0, 0], want_first[1, 1, 0], want_first[1, 0, 1] = 3, 0, 63
    np.testing.assert_array_equal(np.asarray(first_bad), want_first)
    assert not _gate_cumsum.kernel_serves(jnp.asarray(g))  # outside the interpreter: XLA's form
    xla_first = _gate_cumsum.lane_gate_cumsum(jnp.asarray(g), floor)[1]
    np.testing.assert_array_equal(np.asarray(xla_first), want_first)
    clamped = np.asarray(_gate_cumsum.clamped_log_decay(jnp.asarray(g), floor))
    assert np.all(np.isfinite(clamped)) and clamped.min() == floor and clamped.max() == 0.0
    np.testing.assert_array_equal(np.asarray(G), _sequential(clamped))
    want = jax.grad(
        lambda g: jnp.sum(_gate_cumsum.clamped_log_decay(g, floor) * _sequential(ct, True))
    )
    np.testing.assert_array_equal(np.asarray(dg), np.asarray(want(jnp.asarray(g))))
    assert np.asarray(dg)[0, 70, 1, 5] == 0.5 * _sequential(ct, True)[0, 70, 1, 5]
    with pytest.raises(ValueError, match="floor"):
        chunk_cumsum(jnp.zeros(shape, f32), floor=1.0)


def test_xla_form_where_the_kernel_does_not_serve():
    g = _gates((1, 64, 1, 64))  # HV · K = 64: no 128-column tile
    with pk.use_mode("interpret"):
        assert not _gate_cumsum.kernel_serves(g)
        got = _gate_cumsum.lane_gate_cumsum(jnp.asarray(g))
    assert _err(got, _sequential(g, False, np.float64)) <= 10 * TOL
    if not pk.is_hopper():  # the default mode off-GPU takes XLA's form
        assert not _gate_cumsum.kernel_serves(_gates((1, 64, 2, 64)))


def test_refuses_what_it_does_not_serve():
    with pytest.raises(ValueError, match=r"g.shape=\(1, 64, 128\).*\[N, Tp, HV, K\] float32"):
        chunk_cumsum(jnp.zeros((1, 64, 128), f32))
    with pytest.raises(ValueError, match="float32"):
        chunk_cumsum(jnp.zeros((1, 64, 2, 64), jnp.bfloat16))
    with pytest.raises(ValueError, match="multiple of 64"):
        chunk_cumsum(jnp.zeros((1, 100, 2, 64), f32))
    with pytest.raises(NotImplementedError, match="HV \\* K % 128"):
        chunk_cumsum(jnp.zeros((1, 64, 3, 64), f32))
    with pytest.raises(ValueError, match="per_cta"):
        chunk_cumsum(jnp.zeros((1, 128, 3, 128), f32), per_cta=4)  # 6 tiles


def test_tiles_per_cta():
    # B4 T4096 HV16 K128: 4096 tiles; 16 per CTA would leave fewer than two CTAs per SM
    assert 4096 // 16 < MIN_CTAS <= 4096 // 8 and tiles_per_cta(4096) == 8
    assert tiles_per_cta(6) == 1 and tiles_per_cta(1) == 1


def test_lowers_for_cuda_in_half_an_sm():
    """Both kernels lower for sm_90a at the benchmark shape within half an SM's shared memory
    (two CTAs per SM), forward (with and without the raw form's flags) and through the VJP."""
    g = jax.ShapeDtypeStruct((4, 4096, 16, 128), f32)

    def f(g, ct):
        G, vjp = jax.vjp(_gate_cumsum.lane_gate_cumsum, g)
        # the raw form (floor) with its bad-row flags
        (Gr, first), vjp_r = jax.vjp(lambda g: _gate_cumsum.lane_gate_cumsum(g, -10.0), g)
        return G, vjp(ct)[0], Gr, first, vjp_r((ct, jnp.zeros_like(first)))[0]

    with pk.cuda_lowering_mesh(), smem_limit(smem_per_cta(2)):
        txt = jax.jit(f).trace(g, g).lower(lowering_platforms=("cuda",)).as_text()
    names = ("gate_cumsum", "gate_cumsum_rev")
    assert lowered_kernels(txt, names) == set(names)


# ------------------------------------------------------------------------------------------------
# GPU (H200)

GPU_SHAPE = (4, 4096, 16, 128)  # the KDA benchmark shape B4_T4096_H16_HV16_D128


@pytest.mark.gpu
@pytest.mark.parametrize("reverse", [False, True])
def test_gpu_matches_sequential_cumsum(reverse):
    g = _gates(GPU_SHAPE, seed=4)
    got = np.asarray(jax.jit(functools.partial(chunk_cumsum, reverse=reverse))(g))
    np.testing.assert_array_equal(got, _sequential(g, reverse))
    ref = jnp.cumsum(jnp.asarray(g).reshape(4, 64, 64, 16, 128)[:, :, :: -1 if reverse else 1], 2)
    ref = np.asarray(ref[:, :, :: -1 if reverse else 1]).reshape(GPU_SHAPE)
    assert _err(got, ref.astype(np.float64)) <= TOL


@pytest.mark.gpu
def test_gpu_vjp_matches_sequential_suffix_sum():
    g = _gates(GPU_SHAPE, seed=5)
    ct = np.random.default_rng(6).standard_normal(GPU_SHAPE).astype(np.float32)
    assert _gate_cumsum.kernel_serves(jnp.asarray(g))
    G, vjp = jax.vjp(_gate_cumsum.lane_gate_cumsum, jnp.asarray(g))
    np.testing.assert_array_equal(np.asarray(G), _sequential(g))
    np.testing.assert_array_equal(np.asarray(vjp(jnp.asarray(ct))[0]), _sequential(ct, True))


@pytest.mark.gpu
def test_gpu_raw_gates_bad_rows():
    """The raw form at the benchmark shape: the clamped cumsum and the first NaN / +inf row per
    chunk and head, as XLA's form computes them."""
    g = _gates(GPU_SHAPE, seed=7, scale=12.0)
    g[0, 3, 0, 5], g[0, 9, 0, 7], g[2, 4095, 15, 127] = np.nan, np.inf, np.inf
    g[3, 64, 4, 0] = -np.inf  # a reset, not bad
    assert _gate_cumsum.kernel_serves(jnp.asarray(g))
    G, first = jax.jit(lambda g: _gate_cumsum.lane_gate_cumsum(g, -10.0))(g)
    clamped = np.asarray(_gate_cumsum.clamped_log_decay(jnp.asarray(g), -10.0))
    np.testing.assert_array_equal(np.asarray(G), _sequential(clamped))
    want = np.full((4, 16, 64), 64.0, np.float32)
    want[0, 0, 0], want[2, 15, 63] = 3, 63
    np.testing.assert_array_equal(np.asarray(first), want)
