"""Pallas Mosaic GPU short convolution (gdn_jax.ops.short_conv, pallas_kernels.short_conv).

CPU: the kernels under the Mosaic GPU interpreter at tiny shapes against the xla form (values and
the gradients of x and the taps: T not a multiple of 64, packed sequences with an empty one, SiLU
and no activation, 3 and 4 taps, bf16 and f16), the selector's fallbacks, and the CUDA lowering.
GPU (``-m gpu``, H200): the GDN layers' shapes with the 2x rule against the f32 xla form.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gdn_cases import run_interpreted

import gdn_jax
from gdn_jax.testing import check_2x, rel_rms
from pallas_kernels import _compat as pk

f32 = jnp.float32


def _inputs(seed, B, T, C, W, dtype):
    kx, kw, ky = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (B, T, C), f32).astype(dtype)
    w = jax.random.uniform(kw, (W, C), f32, -0.5, 0.5)
    dy = jax.random.normal(ky, (B, T, C), f32).astype(dtype)
    return x, w, dy


def _value_and_grads(x, w, dy, implementation, **kw):
    def f(x, w):
        return gdn_jax.ops.short_conv(x, w, implementation=implementation, **kw)

    y, vjp = jax.vjp(f, x, w)
    return (y, *vjp(dy.astype(y.dtype)))


CASES = {
    # B, T, C, W, packed cu_seqlens, activation, dtype
    "partial_block": (2, 100, 128, 4, None, jax.nn.silu, jnp.bfloat16),
    "packed": (1, 150, 64, 4, (0, 5, 5, 64, 67, 150), jax.nn.silu, jnp.bfloat16),
    "linear_3taps_f16": (2, 64, 64, 3, None, None, jnp.float16),
}


@pytest.mark.parametrize("case", CASES)
def test_interpret_matches_xla(case):
    B, T, C, W, cu, activation, dtype = CASES[case]
    x, w, dy = _inputs(0, B, T, C, W, dtype)
    kw = dict(activation=activation, cu_seqlens=None if cu is None else jnp.asarray(cu, jnp.int32))
    got = run_interpreted(jax.jit(lambda x, w, dy: _value_and_grads(x, w, dy, "pallas", **kw)),
                          x, w, dy)  # fmt: skip
    ref = _value_and_grads(x, w, dy, "xla", **kw)
    assert got[0].dtype == dtype and got[1].dtype == dtype and got[2].dtype == f32
    for name, a, b in zip(("y", "dx", "dw"), got, ref, strict=True):
        # y and dx: f32 sums rounded once to 16 bits in both; dw: f32 sums in both
        tol = 1e-5 if name == "dw" else 4e-3
        assert rel_rms(a, b) <= tol, (name, rel_rms(a, b))


@pytest.mark.parametrize("packed", [False, True])
def test_interpret_walks_several_blocks_per_cta(packed):
    """Groups of 2 blocks over 5 (the last group has one): the double-buffered block loop, the
    zeroed rows before t = 0 in the first block only, and dw summed over a CTA's blocks."""
    from pallas_kernels import short_conv as sc

    B, T, C, W = (1, 300, 64, 4) if packed else (2, 300, 64, 4)
    x, w, dy = _inputs(6, B, T, C, W, jnp.bfloat16)
    cu = jnp.asarray([0, 64, 64, 130, 300], jnp.int32) if packed else None
    reach = None
    if packed:
        dist = jnp.arange(T) - jnp.asarray([0] * 64 + [64] * 66 + [130] * 170)
        reach = jnp.broadcast_to(jnp.minimum(dist, W - 1)[:, None], (T, 64)).astype(jnp.int8)
    wb = jnp.broadcast_to(w[:, None, :], (W, sc.SUB, C))

    def run(x, wb, dy):
        y = sc.short_conv_fwd(x, wb, reach, activation="silu", out_dtype=x.dtype, blocks=2)
        return (y, *sc.short_conv_bwd(x, wb, reach, dy, activation="silu", blocks=2))

    got = run_interpreted(jax.jit(run), x, wb, dy)
    ref = _value_and_grads(x, w, dy, "xla", cu_seqlens=cu)
    for name, a, b in zip(("y", "dx", "dw"), got, ref, strict=True):
        assert rel_rms(a, b) <= (1e-5 if name == "dw" else 4e-3), (name, rel_rms(a, b))


def test_blocks_per_cta_keeps_the_gpu_busy():
    from pallas_kernels.short_conv import MIN_CTAS, blocks_per_cta

    assert blocks_per_cta(4, 4096, 2048) == 8  # 32 x 8 x 4 = 1024 CTAs
    assert blocks_per_cta(1, 32768, 2048) == 8
    assert blocks_per_cta(1, 4096, 2048) == 4  # 32 x 64 blocks; 8 per CTA would be 256 CTAs
    assert 32 * 64 // 8 < MIN_CTAS <= 32 * 64 // 4
    assert blocks_per_cta(1, 64, 64) == 1


def test_packed_sequences_do_not_see_each_other():
    """Each packed sequence convolved on its own (xla form) equals its slice of the kernel's, also
    next to a sequence whose last tokens are NaN and inf (masked taps are selected away)."""
    x, w, dy = _inputs(1, 1, 80, 64, 4, jnp.bfloat16)
    x = x.at[0, 2, :5].set(jnp.nan).at[0, 69, 7].set(jnp.inf)
    cu = (0, 3, 3, 70, 80)
    fn = lambda x, w: gdn_jax.ops.short_conv(
        x, w, cu_seqlens=jnp.asarray(cu, jnp.int32), implementation="pallas"
    )
    got = np.asarray(run_interpreted(jax.jit(fn), x, w), np.float32)
    for lo, hi in zip(cu[:-1], cu[1:], strict=True):
        if hi > lo:
            alone = gdn_jax.ops.short_conv(x[:, lo:hi], w, implementation="xla")
            np.testing.assert_array_equal(got[:, lo:hi], np.asarray(alone, np.float32))


def test_selector_falls_back_to_xla():
    x, w, _ = _inputs(2, 1, 16, 48, 4, jnp.bfloat16)  # 48 channels: not a multiple of 64
    with pytest.raises(ExceptionGroup, match="short_conv") as e:
        run_interpreted(gdn_jax.ops.short_conv, x, w, implementation="pallas")
    assert "multiple of 64" in str(e.value.exceptions[0])
    y = run_interpreted(gdn_jax.ops.short_conv, x, w, implementation=("pallas", "xla"))
    np.testing.assert_array_equal(y, gdn_jax.ops.short_conv(x, w, implementation="xla"))
    x64, w64, _ = _inputs(2, 1, 16, 64, 4, jnp.bfloat16)
    for kw, why in [
        (dict(activation=jax.nn.gelu), "SiLU"),
        (dict(tail=jnp.zeros((1, 3, 64), jnp.bfloat16)), "tail"),
        (dict(dtype=f32), "bf16 or f16"),
    ]:
        with pytest.raises(ExceptionGroup) as e:
            run_interpreted(gdn_jax.ops.short_conv, x64, w64, implementation="pallas", **kw)
        assert why in str(e.value.exceptions[0]), (kw, e.value.exceptions[0])
    # off Hopper and without the interpreter the default order is xla only
    assert gdn_jax.ops.default_implementations("short_conv") == ("xla",)


def test_bad_arguments_name_themselves():
    x, w, _ = _inputs(3, 2, 8, 64, 4, jnp.bfloat16)
    with pytest.raises(ValueError, match="weight must be"):
        gdn_jax.ops.short_conv(x, w[:, :32])
    with pytest.raises(ValueError, match="x must be"):
        gdn_jax.ops.short_conv(x[0], w)
    with pytest.raises(ValueError, match="tail must be"):
        gdn_jax.ops.short_conv(x, w, tail=jnp.zeros((2, 2, 64)))


@pytest.mark.parametrize("packed", [False, True])
def test_lowers_for_cuda(packed):
    B, T = (1, 200) if packed else (2, 128)
    x, w, dy = _inputs(4, B, T, 128, 4, jnp.bfloat16)
    cu = jnp.asarray([0, 70, 200], jnp.int32) if packed else None
    fn = lambda x, w, dy: _value_and_grads(x, w, dy, "pallas", cu_seqlens=cu)
    with pk.cuda_lowering_mesh():
        txt = jax.jit(fn).trace(x, w, dy).lower(lowering_platforms=("cuda",)).as_text()
    calls = [ln for ln in txt.splitlines() if "custom_call @mosaic_gpu" in ln]
    assert len(calls) == 2
    assert re.search(r"\\00short_conv_fwd\\00", calls[0] + calls[1])
    assert re.search(r"\\00short_conv_bwd\\00", calls[0] + calls[1])


# ------------------------------------------------------------------------------------------------
# GPU (H200)

GPU_CASES = {
    # the q/k conv of qwen3_5_0_8b at B4 T4096, its v conv packed, and f16 with a partial block
    "qk_b4_t4096": (4, 4096, 2048, None, jnp.bfloat16),
    "packed_t8192": (1, 8192, 2048, (0, 1000, 1000, 4097, 8192), jnp.bfloat16),
    "f16_t1000": (2, 1000, 4096, None, jnp.float16),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_matches_f32_reference(case):
    B, T, C, cu, dtype = GPU_CASES[case]
    x, w, dy = _inputs(5, B, T, C, 4, dtype)
    kw = dict(cu_seqlens=None if cu is None else jnp.asarray(cu, jnp.int32))
    run = jax.jit(_value_and_grads, static_argnums=(3,))
    got = run(x, w, dy, "pallas", **kw)
    ref_lo = run(x, w, dy, "xla", **kw)
    ref32 = run(x.astype(f32), w, dy.astype(f32), "xla", **kw)
    print(case, check_2x(("y", "dx", "dw"), got, ref_lo, ref32))
    assert rel_rms(got[2], ref32[2]) <= 1e-4


def test_lowers_per_shard_on_explicit_axes():
    """On Explicit mesh axes (batch over "data", channels over "tensor") the kernels run inside a
    shard_map on one shard's block; a T split goes to the xla form."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2)
    B, T, C = 4, 128, 512

    def S(shape, spec, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    x, dy = S((B, T, C), P("data", None, "tensor")), S((B, T, C), P("data", None, "tensor"))
    w = S((4, C), P(None, "tensor"), f32)
    fn = lambda x, w, dy: _value_and_grads(x, w, dy, "pallas")
    with pk.use_mode("gpu"):  # the mesh is the arrays' (test_default_mesh lowers the ops so)
        txt = jax.jit(fn).trace(x, w, dy).lower(lowering_platforms=("cuda",)).as_text()
    assert len([ln for ln in txt.splitlines() if "custom_call @mosaic_gpu" in ln]) == 2
    assert "sdy.manual_computation" in txt and f"tensor<{B // 2}x{T}x{C // 4}xbf16>" in txt
    xt = S((B, T, C), P("data", "tensor", None))
    with pk.use_mode("gpu"), pytest.raises(ExceptionGroup) as e:
        jax.jit(lambda x, w: gdn_jax.ops.short_conv(x, w, implementation="pallas")).trace(xt, w)
    assert "per shard of batch and channels" in str(e.value.exceptions[0])


@pytest.mark.parametrize("shape", [(2, 0, 64), (0, 8, 64)])
def test_empty_inputs(shape):
    """No tokens or no rows: an empty y and zero tap gradients, whatever the implementation."""
    x, w = jnp.zeros(shape, jnp.bfloat16), jnp.ones((4, 64), f32)
    y, dx, dw = run_interpreted(_value_and_grads, x, w, jnp.zeros(shape, jnp.bfloat16), "pallas")
    assert y.shape == dx.shape == shape and dw.shape == (4, 64) and not np.any(np.asarray(dw))


@pytest.mark.gpu
def test_gpu_non_finite_values_stay_in_their_sequence():
    """A NaN and an inf in the last tokens of a packed sequence: the next sequence's outputs and
    gradients are those of the xla form (the kernels select masked taps away; on the GPU a
    multiply by a zero mask would carry the NaN across)."""
    x, w, dy = _inputs(7, 1, 4096, 2048, 4, jnp.bfloat16)
    x = x.at[0, 1999, :9].set(jnp.nan).at[0, 1998, 100].set(jnp.inf)
    cu = jnp.asarray([0, 2000, 4096], jnp.int32)
    run = jax.jit(_value_and_grads, static_argnums=(3,))
    got = run(x, w, dy, "pallas", cu_seqlens=cu)
    ref = run(x, w, dy, "xla", cu_seqlens=cu)
    for a, b in zip(got[:2], ref[:2], strict=True):
        a, b = np.asarray(a[:, 2000:], f32), np.asarray(b[:, 2000:], f32)
        assert np.all(np.isfinite(a)) and rel_rms(a, b) <= 4e-3
