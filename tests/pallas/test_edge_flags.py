"""The non-finite flags on the Mosaic GPU kernels (pallas_kernels.edge_flags) and the op's Poison
made from them (gdn_jax.ops._sanitize.inputs, dense inputs).

CPU: both kernels under the Mosaic GPU interpreter against numpy (bf16, f16, f32; head dims 64
and 128; NaN, ±inf, a bad value in a block's first and last row, in a tile's first and last
column), the Poison of GDN-, KDA- and GDN2-shaped inputs (GVA, gates with and without channels)
equal to XLA's, what the kernels refuse, and the CUDA lowering in half an SM's shared memory.
GPU (``-m gpu``, H200): the Poison at the KDA and GDN2 benchmark shape equal to XLA's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gdn_cases import lowered_kernels, run_interpreted, smem_limit, smem_per_cta

from gdn_jax.ops import _sanitize
from pallas_kernels import _compat as pk
from pallas_kernels.edge_flags import col_first, row_flags, tiles_per_cta

f32 = jnp.float32
BAD = (np.nan, np.inf, -np.inf)


def _dirty(shape, seed, n_bad=12):
    """Normal values with NaN / ±inf at random places and at the corners of the tiles."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    R, C = shape
    at = [(0, 0), (63, C - 1), (64, 0), (R - 1, C - 1)]
    at += [(int(rng.integers(R)), int(rng.integers(C))) for _ in range(n_bad)]
    for i, (r, c) in enumerate(at):
        x[r, c] = BAD[i % 3]
    return x


def _row_ref(x, D, neg_inf_ok):
    bad = (np.isnan(x) | (x == np.inf)) if neg_inf_ok else ~np.isfinite(x)
    R, C = x.shape
    return bad.reshape(R, C // D, D).any(-1).T.astype(np.float32)


def _col_ref(x):
    R, C = x.shape
    blk = ~np.isfinite(x).reshape(R // 64, 64, C)
    return np.where(blk.any(1), blk.argmax(1), 64).astype(np.float32)


@pytest.mark.parametrize(
    "dtype,shape,D",
    [(jnp.bfloat16, (256, 384), 128), (jnp.float16, (192, 256), 64), (f32, (128, 256), 128)],
)
def test_interpret_kernels_match_numpy(dtype, shape, D):
    x = jnp.asarray(_dirty(shape, seed=D), dtype)
    xf = np.asarray(x.astype(f32))
    rows, rows_g, cols = run_interpreted(
        lambda a: (row_flags(a, D), row_flags(a, D, neg_inf_ok=True), col_first(a, D)), x
    )
    np.testing.assert_array_equal(np.asarray(rows), _row_ref(xf, D, False))
    np.testing.assert_array_equal(np.asarray(rows_g), _row_ref(xf, D, True))
    np.testing.assert_array_equal(np.asarray(cols), _col_ref(xf))
    assert 0 < float(np.asarray(rows).sum()) < rows.size  # the case has both kinds of rows


# (variant, B, T, H, HV, K, V): GVA, K != V, the gates each variant has
CASES = [
    ("gdn", 2, 128, 2, 4, 128, 64),
    ("kda", 1, 192, 2, 2, 64, 128),
    ("gdn2", 2, 128, 1, 2, 128, 128),
]


def _op_inputs(variant, B, T, H, HV, K, V, seed):
    rng = np.random.default_rng(seed)

    def arr(shape, bad_at=(), gate=False):
        x = (-rng.uniform(0, 2, shape) if gate else rng.standard_normal(shape)).astype(np.float32)
        for i, idx in enumerate(bad_at):
            x[idx] = BAD[i % 3]
        return x

    q = arr((B, T, H, K), [(0, 70, 0, 3)])
    k = arr((B, T, H, K), [(B - 1, 5, H - 1, K - 1)])
    v = arr((B, T, HV, V), [(0, 100, HV - 1, 0), (B - 1, 63, 0, V - 1), (0, 64, 0, 1)])
    gk = (B, T, HV) if variant == "gdn" else (B, T, HV, K)
    g = arr(gk, gate=True)
    g[(0, 90, 0) + (() if variant == "gdn" else (2,))] = np.nan
    g[(B - 1, 20, HV - 1) + (() if variant == "gdn" else (0,))] = -np.inf  # a reset, not bad
    g[(B - 1, 120, HV - 1) + (() if variant == "gdn" else (1,))] = np.inf
    bf = jnp.bfloat16
    if variant == "gdn2":
        heads = (jnp.asarray(arr((B, T, HV, K), [(0, 33, 1, 7)])),)
        cols = (jnp.asarray(arr((B, T, HV, V), [(B - 1, 77, 0, 5)])),)
    else:
        heads, cols = (
            (jnp.asarray(arr((B, T, HV) + (() if variant == "gdn" else (1,)), [(0, 40, 1)])),),
            (),
        )
    return (jnp.asarray(q, bf), jnp.asarray(k, bf), jnp.asarray(v, bf), jnp.asarray(g), heads, cols)


def _poisons(args, monkeypatch):
    """(the kernels' Poison, XLA's Poison) of the same inputs."""
    got = run_interpreted(lambda: _sanitize.inputs(*args, None)[1])
    monkeypatch.setattr(_sanitize, "_kernels_serve", lambda *a: False)
    ref = _sanitize.inputs(*args, None)[1]
    return got, ref


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_interpret_poison_matches_xla_flags(case, monkeypatch):
    args = _op_inputs(*case, seed=3)
    with pk.use_mode("interpret"):
        assert _sanitize._kernels_serve(args[0], args[2], args[3], args[4], args[5], None)
    got, ref = _poisons(args, monkeypatch)
    T = case[2]
    np.testing.assert_array_equal(np.asarray(got.first), np.asarray(ref.first))
    np.testing.assert_array_equal(np.asarray(got.now), np.asarray(ref.now))
    assert got.seq is None and ref.seq is None
    first = np.asarray(ref.first)
    assert (first < T).any() and bool(np.asarray(ref.now).any())  # the case has bad values


def test_kernels_refuse_and_xla_serves():
    x = jnp.zeros((100, 256), f32)
    with pytest.raises(NotImplementedError, match="R % 64"):
        row_flags(x, 128)
    with pytest.raises(NotImplementedError, match="D in"):
        col_first(jnp.zeros((64, 96), f32), 96)
    with pytest.raises(NotImplementedError, match="bf16/f16/f32"):
        row_flags(jnp.zeros((64, 128), jnp.int32), 128)
    args = _op_inputs("kda", 1, 128, 1, 2, 128, 128, seed=0)
    with pk.use_mode("interpret"):  # T % 64, packed sequences, odd head dims: XLA's flags
        assert not _sanitize._kernels_serve(args[0][:, :100], args[2], args[3], (), (), None)
        assert not _sanitize._kernels_serve(*args[:1], args[2], args[3], (), (), jnp.zeros(2))
        assert not _sanitize._kernels_serve(args[0], args[2][..., :96], args[3], (), (), None)
    assert not _sanitize._kernels_serve(*args[:1], args[2], args[3], (), (), None)  # CPU: auto


def test_tiles_per_cta():
    # B4 T4096 HV16: 4096 tiles; 16 per CTA would leave fewer than two CTAs per SM
    assert tiles_per_cta(4096) == 8 and tiles_per_cta(6) == 1 and tiles_per_cta(264) == 1


@pytest.mark.parametrize("dtype", [jnp.bfloat16, f32])
def test_lowers_for_cuda_in_half_an_sm(dtype):
    x = jax.ShapeDtypeStruct((4 * 4096, 16 * 128), dtype)
    with pk.cuda_lowering_mesh(), smem_limit(smem_per_cta(2)):
        txt = (
            jax.jit(lambda a: (row_flags(a, 128), col_first(a, 128)))
            .trace(x)
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
    names = ("edge_row_flags", "edge_col_first")
    assert lowered_kernels(txt, names) == set(names)


# ------------------------------------------------------------------------------------------------
# GPU (H200)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["kda", "gdn2", "gdn"])
def test_gpu_poison_matches_xla_flags(variant, monkeypatch):
    """B4 T4096 H16 HV16 D128 (the benchmark shape), bad values as in the CPU cases."""
    args = _op_inputs(variant, 4, 4096, 16, 16, 128, 128, seed=5)
    assert _sanitize._kernels_serve(args[0], args[2], args[3], args[4], args[5], None)
    got = jax.jit(lambda *a: _sanitize.inputs(*a, None)[1])(*args)
    monkeypatch.setattr(_sanitize, "_kernels_serve", lambda *a: False)
    ref = jax.jit(lambda *a: _sanitize.inputs(*a, None)[1])(*args)
    np.testing.assert_array_equal(np.asarray(got.first), np.asarray(ref.first))
    np.testing.assert_array_equal(np.asarray(got.now), np.asarray(ref.now))
