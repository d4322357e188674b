"""QAT fused into the Pallas GDN kernels: the in-kernel fake quant, pallas vs xla, off = bitwise.

The fake-quantised references are the xla path's (``gdn_jax.reference.chunked`` with ``qat``) and,
for the state site alone, the token recurrence quantised every 64 tokens. FP8 rounding amplifies
tiny operand differences (a bf16-level change can flip an e4m3 rounding), so implementations are
compared by the 2x rule (docs/design.md) against the f32 fake-quantised reference: error(pallas) <=
2 * error(reference run in the io dtype, QAT on). The quantiser itself is checked bitwise against
``gdn_jax.qat.fake_quant``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import gdn_jax
from gdn_jax import qat
from gdn_jax.reference import chunk_gated_delta_rule, recurrent_gated_delta_rule
from gdn_jax.testing import check_2x, random_inputs, reference_jit
from pallas_kernels import _compat as pk
from pallas_kernels._compat import pl, plgpu
from pallas_kernels.gdn.fake_quant import fake_quant_e4m3

NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0")
GROUP_AXES = {"rows": (-1,), "cols": (-2,), "all": (-2, -1)}
CONFIGS = {
    "column_row": qat.QATConfig(state_granularity="column", w_granularity="row"),
    "matrix_tile": qat.QATConfig(state_granularity="matrix", w_granularity="tile"),
}


def _fq_kernel(x, groups):
    """A one-CTA kernel: load an f32 tile, fake-quantise it in registers, store it."""
    R, N = x.shape

    def body(x_g, o_g):
        def scoped(x_s, bar):
            plgpu.copy_gmem_to_smem(x_g, x_s, bar.at[0])
            plgpu.barrier_wait(bar.at[0])
            x_s[...] = fake_quant_e4m3(pk.load_tile(x_s), groups)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(x_s, o_g)
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scoped, pk.smem((R, N), jnp.float32), plgpu.Barrier(num_barriers=1))

    out = jax.ShapeDtypeStruct((R, N), jnp.float32)
    return pk.kernel(body, out_type=out, grid=(1,), grid_names=("x",), name="gdn_fq_probe")(x)


def _fq_input(N):
    x = np.random.default_rng(0).standard_normal((64, N)).astype(np.float32) * 3.0
    x[:, 5] *= 1e-30  # tiny column: e4m3 subnormals after scaling
    x[7] = 0.0  # an all-zero row keeps scale 1
    x[:, 9] = 0.0  # and an all-zero column
    x[3, 3] = 1e4  # one large value sets the tile's amax
    return jnp.asarray(x)


def _fq_exact(x, axes):
    """The definition of gdn_jax.qat.fake_quant in numpy: IEEE f32 division and multiplies,
    round-to-nearest-even to e4m3 (ml_dtypes)."""
    x = np.asarray(x, np.float32)
    amax = np.max(np.abs(x), axis=axes, keepdims=True)
    nz = amax > 0
    one = np.float32(1.0)
    inv = np.where(nz, np.float32(448.0) / np.where(nz, amax, one), one).astype(np.float32)
    scale = np.where(nz, amax * np.float32(1.0 / 448.0), one).astype(np.float32)
    return (x * inv).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale


def _check_fq_bitwise(N):
    """The kernel's quantiser is bitwise the exact definition. XLA's fake_quant is reported: on
    the GPU, XLA lowers f32 division to div.full (not correctly rounded), which can move
    448 / amax by an ulp and flip an e4m3 rounding at a tie."""
    x = _fq_input(N)
    for groups, axes in GROUP_AXES.items():
        got = np.asarray(jax.jit(_fq_kernel, static_argnums=1)(x, groups))
        want = _fq_exact(x, axes)
        xla = np.asarray(jax.jit(qat.fake_quant, static_argnums=(1, 2))(x, axes, "e4m3"))
        print(f"fake quant {groups}: kernel != exact at {np.sum(got != want)}, "
              f"xla != exact at {np.sum(xla != want)} of {x.size}")  # fmt: skip
        assert np.array_equal(got, want), (groups, np.max(np.abs(got - want)))
        assert not np.array_equal(got, np.asarray(x)), groups  # it does quantise


def test_interpret_fake_quant_is_bitwise_the_qat_definition():
    with pk.use_mode("interpret"):
        try:
            _check_fq_bitwise(64)
        finally:
            pk.reset_interpreter()


def _pallas(q, k, v, g, beta, **kw):
    return gdn_jax.gated_delta_rule(q, k, v, g, beta, implementation="pallas", **kw)


def _xla(q, k, v, g, beta, **kw):
    return gdn_jax.gated_delta_rule(q, k, v, g, beta, implementation="xla", **kw)


def _case(seed, B, T, H, HV, K, V, gate_scale=0.05):
    # slow decay: the quantised state must matter for the whole sequence, not only its start
    x = random_inputs(seed, B=B, T=T, H=H, HV=HV, K=K, V=V, gate_scale=gate_scale)
    x["initial_state"] = 0.1 * x["initial_state"]
    r = np.random.default_rng(seed + 1)
    cts = (
        jnp.asarray(r.standard_normal((B, T, HV, V)), jnp.float32),
        jnp.asarray(r.standard_normal((B, HV, K, V)), jnp.float32),
    )
    return x, cts


def _loss_and_grads(fn, x, dtype, cts, cfg):
    do, dht = cts

    def loss(q, k, v, g, beta, h0):
        o, s = fn(
            q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm=True,
            qat=cfg,
        )  # fmt: skip
        return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(s * dht), (o, s)

    args = [x[n].astype(dtype) for n in ("q", "k", "v")]
    args += [x["g"], x["beta"], x["initial_state"]]
    (_, (o, s)), grads = jax.value_and_grad(loss, argnums=range(6), has_aux=True)(*args)
    return (o, s, *grads)


def _check_2x(x, cts, cfg, ref_fn, dtype=jnp.bfloat16, floor=1e-5):
    """pallas (QAT on) vs the f32 fake-quantised ``ref_fn``, budget = ``ref_fn`` in ``dtype``."""

    def run(fn, dt, reference=False):
        # one compiled program per run (eager op-by-op dispatch costs minutes on the GPU)
        f = lambda x, cts: _loss_and_grads(fn, x, dt, cts, cfg)  # noqa: E731
        return (reference_jit(f) if reference else jax.jit(f))(x, cts)

    ref32 = run(ref_fn, jnp.float32, reference=True)
    ref_lo = run(ref_fn, dtype, reference=True)
    got = run(_pallas, dtype)
    print(check_2x(NAMES, got, ref_lo, ref32, floor=floor))
    return got, ref32


def _chunk_ref(q, k, v, g, beta, **kw):
    return chunk_gated_delta_rule(q, k, v, g, beta, **kw)


# ------------------------------------------------------------------------------------------------
# CPU: Mosaic GPU interpreter (tiny shapes)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_interpret_pallas_matches_xla_with_qat(name):
    """Forward and every gradient, both sites, each granularity pair; the budget is the xla path
    in bf16 against the xla path in f32 (both with the same QAT)."""
    x, cts = _case(0, 1, 100, 1, 2, 64, 64)  # GVA, partial last chunk, initial state
    with pk.use_mode("interpret"):
        try:
            _check_2x(x, cts, CONFIGS[name], _xla)
        finally:
            pk.reset_interpreter()


def _off_e4m3_grid(x, axes) -> float:
    """How far (worst case, in units of the allowed slack) the values of ``x`` are from
    ``e4m3 * scale`` with one scale ``amax / 448`` per group over ``axes``.

    The kernels store quantised values rounded to bf16 (2^-9 relative) and amax is taken from
    those rounded values, so ``x / scale`` must lie within ~2^-8 relative of an e4m3 value; the
    e4m3 grid itself is 2^-4..2^-3 relative apart, so unquantised values or another group's
    scale land far off it. Returns <= 1 when every value is on the grid.
    """
    x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    amax = np.max(np.abs(x), axis=axes, keepdims=True)
    e = x / np.where(amax > 0, amax / 448.0, 1.0)
    nearest = np.asarray(
        jnp.asarray(e, jnp.float32).astype(jnp.float8_e4m3fn).astype(jnp.float32), np.float64
    )
    return float(np.max(np.abs(e - nearest) / (2**-7 * np.abs(nearest) + 2**-12)))


def test_interpret_kernels_quantise_w_and_the_state_per_group():
    """The intra kernel emits w and the recomputation kernel the chunk-entering states h on the
    e4m3 grid of exactly the configured groups (and not on that of the other granularity)."""
    from pallas_kernels.gdn.intra import IntraConfig, intra_chunk
    from pallas_kernels.recurrence.chunk_fwd import ChunkFwdConfig, chunk_fwd

    B, T, H, HV, K = 1, 128, 1, 2, 64
    x = random_inputs(3, B=B, T=T, H=H, HV=HV, K=K, V=K, dtype=jnp.bfloat16, gate_scale=0.05)
    k = x["k"].astype(jnp.float32)
    k = (k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(jnp.bfloat16)  # as with l2norm
    G = jnp.cumsum(x["g"].reshape(B, T // 64, 64, HV), axis=2).reshape(B, T, HV)
    G, beta = G.transpose(0, 2, 1), x["beta"].transpose(0, 2, 1)
    w_axes = {"row": (-1,), "tile": (2, 4)}  # w as [B, T/64, 64, HV, K]
    s_axes = {"column": (-2,), "matrix": (-2, -1)}  # h [B, T/64, HV, K, V]
    with pk.use_mode("interpret"):
        try:
            for sq, wq in (("column", "row"), ("matrix", "tile")):
                w, u = intra_chunk(k, x["v"], G, beta, IntraConfig(w_quant=wq))[0]
                cfg = ChunkFwdConfig(scale=0.125, store_h=True, state_quant=sq)
                h, _ = chunk_fwd(None, k, w, u, G, x["initial_state"], cfg)
                w5 = w.reshape(B, T // 64, 64, HV, K)
                other_w, other_s = ({"row": "tile", "tile": "row"}[wq],
                                    {"column": "matrix", "matrix": "column"}[sq])  # fmt: skip
                assert _off_e4m3_grid(w5, w_axes[wq]) <= 1, wq
                assert _off_e4m3_grid(w5, w_axes[other_w]) > 4, wq
                assert _off_e4m3_grid(h, s_axes[sq]) <= 1, sq
                assert _off_e4m3_grid(h, s_axes[other_s]) > 4, sq
            w, u = intra_chunk(k, x["v"], G, beta, IntraConfig())[0]
            plain = dataclasses.replace(cfg, state_quant=None)
            h, _ = chunk_fwd(None, k, w, u, G, x["initial_state"], plain)
        finally:
            pk.reset_interpreter()
    assert _off_e4m3_grid(w.reshape(B, T // 64, 64, HV, K), w_axes["row"]) > 4
    assert _off_e4m3_grid(h, s_axes["column"]) > 4


def test_interpret_qat_none_is_bitwise_the_plain_kernels():
    x, _ = _case(1, 1, 64, 1, 1, 64, 64)
    args = [x[n].astype(jnp.bfloat16) for n in ("q", "k", "v")] + [x["g"], x["beta"]]
    kw = dict(initial_state=x["initial_state"], output_final_state=True)
    with pk.use_mode("interpret"):
        try:
            plain = _pallas(*args, **kw)
            off = _pallas(*args, qat=None, **kw)
        finally:
            pk.reset_interpreter()
    for a, b in zip(plain, off, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------------------------------------
# CPU: the real GPU lowering with QAT (layouts of the reductions, fp8 casts, SMEM of block_v=128)


@pytest.mark.parametrize("name,K", [("column_row", 64), ("matrix_tile", 128)])
def test_lowers_for_cuda_with_qat(name, K):
    B, T, H, HV = 1, 200, 2, 4
    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    args = (
        S((B, T, H, K), bf), S((B, T, H, K), bf), S((B, T, HV, K), bf),
        S((B, T, HV), jnp.float32), S((B, T, HV), jnp.float32), S((B, HV, K, K), jnp.float32),
    )  # fmt: skip

    def f(*a):
        def loss(q, k, v, g, b, h0):
            o, s = _pallas(
                q, k, v, g, b, initial_state=h0, output_final_state=True, qat=CONFIGS[name]
            )
            return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

        return jax.value_and_grad(loss, argnums=range(6))(*a)

    with pk.cuda_lowering_mesh():
        txt = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert txt.count("custom_call @mosaic_gpu") >= 6


def test_matrix_state_scale_needs_the_whole_state_in_one_cta():
    from pallas_kernels.recurrence.chunk_fwd import ChunkFwdConfig, chunk_fwd

    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    cfg = ChunkFwdConfig(scale=1.0, block_v=64, state_quant="matrix")
    args = (S((1, 64, 1, 128), bf),) * 3 + (
        S((1, 64, 1, 128), bf), S((1, 1, 64), jnp.float32), S((1, 1, 128, 128), jnp.float32)
    )  # fmt: skip
    with pk.cuda_lowering_mesh(), pytest.raises(NotImplementedError, match="matrix"):
        jax.eval_shape(lambda *a: chunk_fwd(*a, cfg), *args)


def test_packed_states_with_matrix_state_quant_at_v128_fall_back_to_xla():
    """Padded lanes per sequence would quantise a short sequence's final state again in each
    padding chunk, so the Pallas path refuses this combination and the default selection runs
    xla: its final states are the unquantised end states (an empty sequence keeps h0)."""
    cfg = qat.QATConfig(sites=("state",), state_granularity="matrix")
    cu = jnp.asarray([0, 10, 10, 200], jnp.int32)  # a short sequence, an empty one, a long one
    x = random_inputs(0, B=1, T=200, H=1, HV=1, K=64, V=128, n_states=3, dtype=jnp.bfloat16)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    kw = dict(initial_state=x["initial_state"], output_final_state=True, cu_seqlens=cu, qat=cfg)
    with pk.use_mode("interpret"):
        with pytest.raises(ExceptionGroup) as e:
            jax.eval_shape(lambda *a: gdn_jax.gated_delta_rule(*a, implementation="pallas", **kw),
                           *args)  # fmt: skip
        assert all(isinstance(err, NotImplementedError) for err in e.value.exceptions)
        assert "matrix" in str(e.value.exceptions[0])
        o, ht = gdn_jax.gated_delta_rule(*args, **kw)
    o_x, ht_x = gdn_jax.gated_delta_rule(*args, implementation="xla", **kw)
    np.testing.assert_array_equal(np.asarray(ht), np.asarray(ht_x))
    np.testing.assert_array_equal(np.asarray(ht[1]), np.asarray(x["initial_state"][1]))


# ------------------------------------------------------------------------------------------------
# GPU (H200): realistic shapes


@pytest.mark.gpu
def test_gpu_fake_quant_is_bitwise_the_qat_definition():
    """The in-kernel quantiser (division, e4m3 cvt) against XLA's fake_quant on the same GPU."""
    _check_fq_bitwise(128)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_gpu_pallas_matches_xla_with_qat(name):
    x, cts = _case(7, 1, 2048, 16, 16, 128, 128)
    _check_2x(x, cts, CONFIGS[name], _chunk_ref)


@pytest.mark.gpu
def test_gpu_pallas_matches_xla_with_qat_f16():
    x, cts = _case(10, 2, 1000, 4, 8, 128, 128)
    _check_2x(x, cts, CONFIGS["column_row"], _chunk_ref, dtype=jnp.float16)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "granularity",
    # matrix: the kernels' matrix state scales are checked (both sites) by
    # test_gpu_pallas_matches_xla_with_qat[matrix_tile]; here in the slow set
    ["column", pytest.param("matrix", marks=pytest.mark.slow)],
)
def test_gpu_state_qat_matches_quantised_recurrence(granularity):
    """State site alone: the 2x rule against the token recurrence quantised every 64 tokens."""
    cfg = qat.QATConfig(sites=("state",), state_granularity=granularity)
    x, cts = _case(8, 1, 4096, 16, 16, 128, 128)
    _check_2x(x, cts, cfg, recurrent_gated_delta_rule)
