"""Pallas Mosaic GPU kernels of the channel-gated variants (GDN2, KDA): CPU interpreter numerics,
CUDA lowering, GPU accuracy/robustness at realistic shapes.

Forward and backward run on the kernels of :mod:`pallas_kernels.channel` through the public ops.
GPU tests (``-m gpu``, on an H200) apply the 2x rule (docs/design.md) against
the f32 recurrent oracle: error(kernel) <= 2 * error(oracle run in the io dtype).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from channel_cases import NAMES, channel_case, check_channel_2x, loss_and_grads, pallas_op
from gdn_cases import RECURRENT, kernel_launches, lowered_kernels, run_interpreted, smem_per_cta
from test_channel_packed_states import check_one_lane

import gdn_jax
from gdn_jax.ops._channel_pallas import CHANNEL_PALLAS, channel_pallas
from gdn_jax.testing import check_2x, random_inputs, rel_rms
from pallas_kernels import _compat as pk
from pallas_kernels.channel.plan import channel_plan

# every kernel, forward and backward, must appear as a Mosaic GPU custom call in the lowered
# fwd+bwd
KERNELS = (
    "chan_intra_wy", "chan_intra_qk", "chan_chunk_fwd", "chan_chunk_h", "chan_bwd_dh",
    "chan_bwd_dqkw", "chan_bwd_wy", "gate_cumsum", "gate_cumsum_rev",
)  # fmt: skip


# ------------------------------------------------------------------------------------------------
# CPU: Mosaic GPU interpreter (tiny shapes; ~20 s each)


@pytest.mark.parametrize(
    "variant,B,T,H,HV,cu,K,V",
    [
        ("gdn2", 1, 100, 1, 2, None, 64, 64),  # GVA, partial last chunk, initial/final state
        ("kda", 1, 100, 1, 1, [0, 30, 30, 100], 64, 64),  # packed with an empty sequence, states
        ("gdn2", 1, 70, 1, 1, None, 64, 128),  # K != V both ways
        ("kda", 1, 70, 1, 2, None, 128, 64),
    ],
)
def test_interpret_forward_and_grads(variant, B, T, H, HV, cu, K, V):
    x, cu, cts = channel_case(0, variant, B, T, H, HV, K, V, cu)
    run_interpreted(
        lambda: check_channel_2x(variant, pallas_op(variant), x, cu, cts, jnp.bfloat16, jit=False)
    )


@pytest.mark.parametrize(
    "variant,T,HV,K,V,g_val",
    [("gdn2", 100, 2, 64, 64, None), ("kda", 128, 1, 128, 128, -5.0),
     # K != V: the intra kernel with separate K and V passes; at K = 128 the K-split
     # backward forms with V = 64, at K = 64 the phased dq/dk/dw body and the unsplit WY kernel
     ("gdn2", 128, 1, 64, 128, -5.0), ("kda", 128, 1, 128, 64, -5.0),
     ("kda", 100, 2, 64, 128, 0.0), ("gdn2", 100, 1, 128, 64, 0.0)],
)  # fmt: skip
def test_interpret_f16_forward_and_grads(variant, T, HV, K, V, g_val):
    """f16 io: the decay-factored operands with f32's range (tf32 in the intra kernel, bf16 hi/lo
    pairs in the backward) and the state scaled into f16 keep
    the 2x rule against the recurrence run in f16, also with log-decay -5 per token in every
    channel (factors up to e^{40}, beyond f16) and with no decay. At -5 over two full chunks dg
    is ~100x smaller than dP's diagonal terms, whose row and column halves must cancel exactly
    (the gate's 2x rule failed, 4x, while bwd_dqkw still put them in its decayed products)."""
    x, cu, cts = channel_case(2, variant, 1, T, 1, HV, K, V)
    if g_val is not None:
        x["g"] = jnp.full_like(x["g"], g_val)
    run_interpreted(
        lambda: check_channel_2x(variant, pallas_op(variant), x, cu, cts, jnp.float16, jit=False)
    )


# ------------------------------------------------------------------------------------------------
# CPU: the real GPU lowering (layout inference, wgmma operand checks, SMEM budget)


def planned_ctas(name: str, plan, dtype) -> int:
    """CTAs per SM whose shared memory kernel ``name`` is sized for under ``plan``
    (:mod:`pallas_kernels.channel.plan`): for the intra kernels (the reason they are two
    kernels), qk four with bf16 io and three with f16 (qg and kg leave through q's and k's
    tiles), wy three with bf16 io and for KDA's f16 (it loads v only after its L passes), two for
    GDN2's f16; two for the gate cumsum and the K-split / phased backward forms; one for the
    state loops and the one-CTA backward forms. (Registers can allow fewer: the intra kernels
    run two per SM, ``benchmarks/kernel_resources.py``.)"""
    bf16 = jnp.dtype(dtype) == jnp.bfloat16
    if name == "chan_intra_qk":
        return 4 if bf16 else 3
    if name == "chan_intra_wy":
        return 3 if bf16 or plan.scalar_beta else 2
    if name in ("gate_cumsum", "gate_cumsum_rev"):
        return 2
    if name == "chan_bwd_dqkw":
        return 1 if plan.dqkw == "one_cta" else 2
    if name == "chan_bwd_wy":
        return 2 if plan.wy_split else 1
    return 1


# Every pair of (variant, K, V, dtype, packed) values in six cases (a pairwise covering array),
# each variant with 2 and 4 value heads.
@pytest.mark.parametrize(
    "variant,K,V,HV,dtype,packed",
    [("kda", 64, 64, 2, "bfloat16", False), ("gdn2", 64, 128, 2, "float16", True),
     ("gdn2", 128, 64, 2, "bfloat16", True), ("kda", 128, 128, 4, "float16", False),
     ("kda", 128, 64, 4, "float16", True), ("gdn2", 128, 128, 4, "bfloat16", False)],
)  # fmt: skip
def test_lowers_for_cuda(variant, K, V, HV, dtype, packed):
    """fwd+bwd of the op with initial and final states lowers every kernel for the GPU:
    packed sequences on one lane (the chunk loops driven by the sequence table; the lane's rows,
    table and state rows checked by test_channel_packed_states.check_one_lane) or a dense batch
    of two rows (the loops without the table), and then also the forward alone (the intra
    kernels without A stored). Each kernel fits the shared memory of the CTAs per SM its plan
    sizes it for (:func:`planned_ctas`), by Mosaic GPU's own count."""
    B, T, H = (1 if packed else 2), 200, 2
    S, bf, f = jax.ShapeDtypeStruct, jnp.dtype(dtype), jnp.float32
    gates = (S((B, T, HV, K), f), S((B, T, HV, K), f), S((B, T, HV, V), f))
    if variant == "kda":
        gates = (S((B, T, HV, K), f), S((B, T, HV), f))
    args = (S((B, T, H, K), bf), S((B, T, H, K), bf), S((B, T, HV, V), bf), *gates)
    args += (S((3 if packed else B, HV, K, V), f),)
    cu = S((4,), jnp.int32) if packed else None
    op = pallas_op(variant)

    def f(*a, cu):
        *xs, h0 = a

        def loss(xs, h0):
            o, s = op(
                *xs, initial_state=h0, output_final_state=True, cu_seqlens=cu, use_qk_l2norm=True
            )
            return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

        return jax.value_and_grad(loss, argnums=(0, 1))(tuple(xs), h0)

    with pk.cuda_lowering_mesh(), kernel_launches() as smem:
        txt = jax.jit(f).trace(*args, cu=cu).lower(lowering_platforms=("cuda",)).as_text()
        fwd_bwd_kernels = set(smem)  # the recorder saw every kernel of the fwd+bwd
        if not packed:
            fwd = jax.jit(lambda *a: op(*a[:-1], use_qk_l2norm=True)[0])
            fwd.trace(*args).lower(lowering_platforms=("cuda",))
    found = lowered_kernels(txt, KERNELS)
    assert found == set(KERNELS), found
    assert fwd_bwd_kernels == set(KERNELS), fwd_bwd_kernels
    if packed:
        check_one_lane(txt, T, 3, HV, K, V)
    plan = channel_plan(bf, K, V, scalar_beta=variant == "kda", store_a=True)
    over = {n: k.smem for n, k in smem.items() if k.smem > smem_per_cta(planned_ctas(n, plan, bf))}
    assert not over, (over, plan)


# ------------------------------------------------------------------------------------------------
# CPU: what the kernels refuse (the selector then falls back to "xla"), and the plumbing


def _direct_args(dtype=jnp.bfloat16, K=64, V=64):
    x = random_inputs(0, B=1, T=64, H=1, HV=1, K=K, V=V, variant="gdn2")
    return [x[n].astype(dtype) for n in ("q", "k", "v")] + [x["g"], x["b"], x["w"]]


_KW = dict(
    scale=0.125, initial_state=None, output_final_state=False, use_qk_l2norm=False, cu_seqlens=None
)


@pytest.mark.parametrize(
    "dtype,K,V,chunk",
    [
        (jnp.float32, 64, 64, 64),
        (jnp.bfloat16, 32, 32, 64),
        (jnp.bfloat16, 64, 32, 64),
        (jnp.bfloat16, 64, 64, 32),
    ],
)
def test_not_implemented(dtype, K, V, chunk):
    with pk.use_mode("interpret"), pytest.raises(NotImplementedError):
        channel_pallas(*_direct_args(dtype, K, V), chunk_size=chunk, **_KW)


def test_not_implemented_without_gpu():
    if pk.is_hopper():
        pytest.skip("on a Hopper GPU the kernels run")
    with pytest.raises(NotImplementedError):
        channel_pallas(*_direct_args(), chunk_size=64, **_KW)


@pytest.mark.parametrize("K,V", [(64, 128), (128, 64)])
def test_f16_k_ne_v_runs_pallas(K, V):
    """f16 with K != V is served by the kernels (no fall-back to "xla")."""
    x = random_inputs(3, B=1, T=64, H=1, HV=1, K=K, V=V, variant="kda")
    args = [x[n].astype(jnp.float16) for n in ("q", "k", "v")] + [x["g"], x["beta"]]
    o, _ = run_interpreted(lambda: gdn_jax.kda(*args, implementation="pallas", use_qk_l2norm=True))
    ref, _ = RECURRENT["kda"](*args, use_qk_l2norm=True)
    assert o.dtype == jnp.float16 and rel_rms(o, ref) < 1e-2


def test_registry_and_kda_reads_scalar_beta():
    assert set(CHANNEL_PALLAS) == {"kda", "gdn2"}
    x = random_inputs(0, B=1, T=64, H=1, HV=1, K=64, V=64, variant="kda")
    args = [x[n].astype(jnp.bfloat16) for n in ("q", "k", "v")] + [x["g"], x["beta"]]
    with pk.use_mode("gpu"):  # traced only, never run
        jaxpr = str(jax.make_jaxpr(lambda *a: pallas_op("kda")(*a)[0])(*args))
    # the intra kernel's gate operand is β [N, HV, T], not a K-wide b
    assert "f32[1,1,64]" in jaxpr


def test_residual_named_for_remat_policies():
    from gdn_jax import remat

    x = random_inputs(0, B=1, T=64, H=1, HV=1, K=64, V=64, variant="gdn2")
    args = [x[n].astype(jnp.bfloat16) for n in ("q", "k", "v")] + [x["g"], x["b"], x["w"]]

    def f(*a):
        return jnp.sum(pallas_op("gdn2")(*a)[0].astype(jnp.float32))

    policy = jax.checkpoint_policies.save_only_these_names(remat.GDN_GATE_CUMSUM)
    with pk.use_mode("gpu"):  # traced only, never run
        jaxpr = jax.make_jaxpr(jax.grad(jax.checkpoint(f, policy=policy), argnums=range(6)))(*args)
    assert remat.GDN_GATE_CUMSUM in str(jaxpr)


# ------------------------------------------------------------------------------------------------
# GPU (H200): realistic shapes, every gradient, 2x rule, reductions, extreme gates, determinism

SLOW = pytest.mark.slow
f32, bf16, f16 = jnp.float32, jnp.bfloat16, jnp.float16
# B, T, H, HV, cu_seqlens; K, V. Each shape is compiled once per process (channel_cases caches the
# programs) and serves several tests. DENSE: 16 chunks, the last one partial, GVA, two batch rows
# with initial/final states, K = V = 128; PACKED: packed sequences with an empty and a one-token
# one and states, on one lane (every sequence ends in a partial chunk), 16 heads, K != V (GDN2
# K 64 / V 128, KDA K 128 / V 64: at K = 128 the K-split backward forms with V = 64, at K = 64
# the phased dq/dk/dw body and the unsplit WY kernel).
DENSE = (2, 1000, 4, 8, None)
PACKED = (1, 4096, 16, 16, [0, 1000, 1000, 2500, 2501, 4096])
K_NE_V = {"gdn2": (64, 128), "kda": (128, 64)}


def _kv(variant, shape):
    return K_NE_V[variant] if shape == "packed" else (128, 128)


def _dense(seed, variant):
    return channel_case(seed, variant, *DENSE[:4], 128, 128, DENSE[4])


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape,dtype",
    [
        ("dense", bf16),
        ("packed", bf16),
        # f16 is in the quick set kernel by kernel (test_channel_f16_*); here end to end
        pytest.param("packed", f16, marks=pytest.mark.slow),
    ],
    ids=["dense-bf16", "packed-bf16", "packed-f16"],
)
@pytest.mark.parametrize("variant", ["gdn2", "kda"])
def test_gpu_matches_reference(variant, shape, dtype):
    """Forward and every gradient (2x rule); f16: the wide factored operands and the scaled f16
    state in every kernel (f16 with GVA and K = V = 128: the per-kernel f16 tests and the slow
    dense-f16 cases)."""
    B, T, H, HV, cu = DENSE if shape == "dense" else PACKED
    x, cu, cts = channel_case(7, variant, B, T, H, HV, *_kv(variant, shape), cu)
    check_channel_2x(variant, pallas_op(variant), x, cu, cts, dtype)


# heavier shapes on the same code paths (-m "gpu and slow")
SLOW_CASES = [
    # variant, B, T, H, HV, cu_seqlens, K, V, dtype
    ("gdn2", 2, 2048, 16, 32, None, 128, 128, bf16),
    ("kda", 2, 2048, 16, 32, None, 128, 128, bf16),
    ("gdn2", 1, 8192, 16, 16, None, 128, 128, bf16),
    ("kda", 1, 8192, 16, 16, None, 128, 128, bf16),
    ("gdn2", *PACKED, 128, 128, bf16),
    ("kda", *PACKED, 128, 128, bf16),
    ("gdn2", 2, 2048, 4, 8, None, 64, 128, bf16),
    ("kda", 2, 2048, 4, 8, None, 128, 64, bf16),
    ("gdn2", 2, 2048, 4, 8, None, 64, 128, f16),
    ("kda", 2, 2048, 4, 8, None, 128, 64, f16),
    ("gdn2", *DENSE, 64, 64, f16),
    ("kda", *DENSE, 64, 64, f16),
    ("gdn2", *DENSE, 128, 128, f16),
    ("kda", *DENSE, 128, 128, f16),
]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("variant,B,T,H,HV,cu,K,V,dtype", SLOW_CASES)
def test_gpu_matches_reference_large(variant, B, T, H, HV, cu, K, V, dtype):
    x, cu, cts = channel_case(7, variant, B, T, H, HV, K, V, cu)
    check_channel_2x(variant, pallas_op(variant), x, cu, cts, dtype)


@pytest.mark.gpu
# GDN2 in the slow set; quick: GDN2's f16 kernels one by one (test_channel_f16_*.py)
@pytest.mark.parametrize("variant", [pytest.param("gdn2", marks=SLOW), "kda"])
@pytest.mark.parametrize("g_val", [0.0, -5.0])
def test_gpu_f16_extreme_gates(variant, g_val):
    """On the PACKED f16 programs."""
    x, cu, cts = channel_case(12, variant, *PACKED[:4], *K_NE_V[variant], PACKED[4])
    x["g"] = jnp.full_like(x["g"], g_val)
    got = check_channel_2x(variant, pallas_op(variant), x, cu, cts, f16)
    for name, a in zip(NAMES[variant], got, strict=True):
        assert bool(jnp.all(jnp.isfinite(a.astype(jnp.float32)))), name


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["gdn2", "kda"])
@pytest.mark.parametrize(
    "g_val,gate_val", [(0.0, 0.0), (0.0, 1.0), (-5.0, 1.0), (-5.0, 0.0), (-20.0, 1.0)]
)
def test_gpu_extreme_gates(variant, g_val, gate_val):
    x, cu, cts = _dense(5, variant)
    x["g"] = jnp.full_like(x["g"], g_val)
    for n in ("beta", "b", "w"):
        if n in x:
            x[n] = jnp.full_like(x[n], gate_val)
    got = check_channel_2x(
        variant, pallas_op(variant), x, cu, cts, bf16, names=("o", "final_state")
    )
    for name, a in zip(NAMES[variant], got, strict=True):
        assert bool(jnp.all(jnp.isfinite(a.astype(jnp.float32)))), name


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["kda", "gdn2"])
def test_gpu_deterministic(variant):
    """Two runs of the DENSE fwd+bwd program (GVA, states) are bitwise equal."""
    x, cu, cts = _dense(11, variant)
    a = loss_and_grads(pallas_op(variant), variant, x, cu, bf16, cts)
    b = loss_and_grads(pallas_op(variant), variant, x, cu, bf16, cts)
    for name, u, w in zip(NAMES[variant], a, b, strict=True):
        assert np.array_equal(np.asarray(u), np.asarray(w)), name


def _reduction_check(pairs):
    """pairs: (name, kernel result A, kernel result B, f32 reference, bf16 reference). Each kernel
    result obeys the 2x rule against the reference; A and B then differ by at most 4x the bf16
    reference's error (triangle inequality)."""
    names = [f"{name} {ab}" for name, *_ in pairs for ab in "AB"]
    got = [x for _, a, b, _, _ in pairs for x in (a, b)]
    ref32 = [r for *_, r, _ in pairs for _ in "AB"]
    ref_lo = [lo for *_, lo in pairs for _ in "AB"]
    print(check_2x(names, got, ref_lo, ref32))
    for name, a, b, ref, lo in pairs:
        d, budget = rel_rms(a, b), rel_rms(lo, ref)
        assert d <= 4 * budget, f"{name}: |A-B| {d:.2e} > 4x ref {budget:.2e}"


def _forward(variant, x, cu, cts, dtype, reference=False):
    """o and the final state of the cached DENSE fwd+bwd program of ``variant``."""
    fn = RECURRENT[variant] if reference else pallas_op(variant)
    return loss_and_grads(fn, variant, x, cu, dtype, cts, reference=reference)[:2]


@pytest.mark.gpu
def test_gpu_gdn2_with_equal_gates_is_kda():
    x, cu, cts = _dense(9, "kda")
    x2 = dict(x)
    del x2["beta"]
    x2["b"] = jnp.broadcast_to(x["beta"][..., None], x["g"].shape)
    x2["w"] = jnp.broadcast_to(x["beta"][..., None], x["v"].shape).astype(f32)
    o2, s2 = _forward("gdn2", x2, cu, cts, bf16)
    ok, sk = _forward("kda", x, cu, cts, bf16)
    ref, rs = _forward("kda", x, cu, cts, f32, reference=True)
    ref_lo, rs_lo = _forward("kda", x, cu, cts, bf16, reference=True)
    _reduction_check([("o", o2, ok, ref, ref_lo), ("final_state", s2, sk, rs, rs_lo)])


@pytest.mark.gpu
def test_gpu_kda_with_scalar_gate_is_gdn():
    x, cu, cts = channel_case(4, "gdn", *DENSE[:4], 128, 128, DENSE[4])
    xk = dict(x)
    xk["g"] = jnp.broadcast_to(x["g"][..., None], x["g"].shape + (x["q"].shape[-1],))
    ok, sk = _forward("kda", xk, cu, cts, bf16)
    og, sg = _forward("gdn", x, cu, cts, bf16)
    ref, rs = _forward("gdn", x, cu, cts, f32, reference=True)
    ref_lo, rs_lo = _forward("gdn", x, cu, cts, bf16, reference=True)
    _reduction_check([("o", ok, og, ref, ref_lo), ("final_state", sk, sg, rs, rs_lo)])


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["gdn", "kda", "gdn2"])
@pytest.mark.parametrize("case", ["one_token", "whole_chunk"])
def test_gpu_reset_gates(variant, case):
    """Full-reset gates (g = -inf) through the kernels give the recurrence's answer.

    The op clamps log-decays to [LOG_DECAY_FLOOR, 0] before it chooses an implementation
    (docs/ops.md), so the kernels see finite gates whose decay factor is exactly 0 in f32: every
    output and gradient keeps the 2x rule against the f32 recurrence run on the raw -inf gates,
    and d g is 0 where g = -inf. On the DENSE programs (GDN's also serve the reduction test)."""
    x, cu, cts = channel_case(0, variant, *DENSE[:4], 128, 128, DENSE[4])
    g = x["g"]
    x["g"] = g.at[:, 100].set(-jnp.inf) if case == "one_token" else g.at[:, 64:128].set(-jnp.inf)
    got = check_channel_2x(variant, pallas_op(variant), x, cu, cts, bf16)
    assert all(bool(jnp.all(jnp.isfinite(a))) for a in got)
    dg = got[NAMES[variant].index("dg")]
    np.testing.assert_array_equal(np.asarray(dg)[np.isneginf(np.asarray(x["g"]))], 0.0)
