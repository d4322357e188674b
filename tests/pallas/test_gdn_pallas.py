"""Pallas Mosaic GPU GDN kernels: CPU interpreter numerics, CUDA lowering, GPU accuracy/robustness.

CPU tests run the kernels under the Mosaic GPU interpreter at tiny shapes (~1-10 s each) and lower
the whole op (forward and backward) for CUDA to check that every kernel is a Mosaic GPU custom call.
GPU tests (``-m gpu``, on an H200) compare against the f32 recurrent oracle at realistic shapes
with the 2x rule (docs/design.md): error(kernel, f32 oracle) <= 2 * error(oracle run in the io
dtype).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from channel_cases import NAMES as ALL_NAMES
from channel_cases import channel_case, check_channel_2x, loss_and_grads, pallas_op
from gdn_cases import RECURRENT, kernel_launches, lowered_kernels, smem_per_cta

import gdn_jax
from gdn_jax.ops._gdn_pallas import gated_delta_rule_pallas
from gdn_jax.reference import chunk_gated_delta_rule, recurrent_gated_delta_rule
from gdn_jax.testing import check_2x, random_inputs, reference_jit, rel_rms
from pallas_kernels import _compat as pk

NAMES = ALL_NAMES["gdn"]
# every kernel must appear as a Mosaic GPU custom call in the lowered fwd+bwd
KERNELS = (
    "gdn_intra", "gdn_chunk_fwd", "gdn_chunk_h", "gdn_chunk_bwd_dh", "gdn_bwd_dqkw", "gdn_bwd_wy"
)  # fmt: skip
f32, bf16, f16 = jnp.float32, jnp.bfloat16, jnp.float16


def _pallas(q, k, v, g, beta, **kw):
    return gdn_jax.gated_delta_rule(q, k, v, g, beta, implementation="pallas", **kw)


def _case(seed, B, T, H, HV, K, V, cu, gate_scale=1.0):
    return channel_case(seed, "gdn", B, T, H, HV, K, V, cu, gate_scale)


def _unit_case(seed, B, T, H, HV, K, V, cu):
    """:func:`_case` with unit q and k rows: the inputs an op without the l2norm is stable on
    (the raw random rows make the f16 recurrence overflow)."""
    x, cu, cts = _case(seed, B, T, H, HV, K, V, cu)
    for n in ("q", "k"):
        x[n] = x[n] / jnp.linalg.norm(x[n], axis=-1, keepdims=True)
    return x, cu, cts


def _check_2x(x, cu, cts, dtype, *, floor=1e-5, **kw):
    return check_channel_2x("gdn", pallas_op("gdn"), x, cu, cts, dtype, floor=floor, **kw)


# ------------------------------------------------------------------------------------------------
# CPU: Mosaic GPU interpreter (tiny shapes)


@pytest.mark.parametrize(
    "B,T,H,HV,K,V,cu",
    [
        (1, 100, 1, 2, 64, 64, None),  # GVA, partial last chunk, initial state
        # packed with initial/final states on one lane; empty sequences first, inside and last
        (1, 100, 1, 1, 64, 64, [0, 0, 70, 70, 100, 100]),
        (1, 128, 1, 1, 64, 128, None),  # K != V
    ],
)
def test_interpret_forward_and_grads(B, T, H, HV, K, V, cu):
    x, cu, cts = _case(0, B, T, H, HV, K, V, cu)
    with pk.use_mode("interpret"):
        try:
            _check_2x(x, cu, cts, jnp.bfloat16)
        finally:
            pk.reset_interpreter()


@pytest.mark.parametrize(
    "T,K,V,cu,dtype",
    [(100, 64, 64, None, "bfloat16"), (128, 64, 128, [0, 0, 70, 128], "bfloat16"),
     (100, 128, 64, None, "float16")],
)  # fmt: skip
def test_interpret_grads_in_io_dtype(T, K, V, cu, dtype):
    """Without the l2norm and with one value head per q/k head, dq leaves bwd_dqkw and dk (its
    state part added) bwd_wy in the io dtype: the 2x rule on every gradient, K != V, packed.

    f16: dg is reported, not asserted. At T = 100 with one head it breaks the rule with either
    dtype of dq, dk and with the l2norm as well (this case: 8.1e-4 against the f16 recurrence's
    3.5e-4; 2 of 4 seeds at K = 128, V = 64, 1 of 4 at K = V = 64), where the xla path keeps it.
    The final state's cotangent makes it (dk's error in rows 95-99 is 50x dq's; with that
    cotangent zero, dg's error equals xla's): the f16 backward's gap, pinned by
    :func:`test_interpret_f16_final_state_cotangent_dg_gap`, not this path's."""
    x, cu, cts = _unit_case(3, 1, T, 1, 1, K, V, cu)
    names = None if dtype == "bfloat16" else tuple(n for n in NAMES if n != "dg")
    with pk.use_mode("interpret"):
        try:
            _check_2x(x, cu, cts, jnp.dtype(dtype), use_qk_l2norm=False, names=names)
        finally:
            pk.reset_interpreter()


def _check_packed_one_lane(B, T, H, HV, K, V, cu, dtype, seed=0):
    """Packed sequences without initial/final states: the single-lane path (state wipe gate)."""
    x = random_inputs(seed, B=B, T=T, H=H, HV=HV, K=K, V=V)
    cu = jnp.asarray(cu, jnp.int32)
    do = jnp.asarray(np.random.default_rng(seed + 1).standard_normal(x["v"].shape), jnp.float32)

    def run(fn, dt, reference):
        def loss(q, k, v, g, b, cu, do):
            o, s = fn(q, k, v, g, b, cu_seqlens=cu, use_qk_l2norm=True)
            assert s is None
            return jnp.sum(o.astype(jnp.float32) * do), o

        args = [x[n].astype(dt) for n in ("q", "k", "v")] + [x["g"], x["beta"], cu, do]
        vg = jax.value_and_grad(loss, argnums=range(5), has_aux=True)
        (_, o), grads = (reference_jit(vg) if reference else jax.jit(vg))(*args)
        return (o, *grads)

    def one_lane(q, k, v, g, b, **kw):  # direct call: the op may ask for final states
        K = q.shape[-1]
        return gated_delta_rule_pallas(
            q, k, v, g, b, scale=K**-0.5, initial_state=None, output_final_state=False,
            chunk_size=64, **kw,
        )  # fmt: skip

    ref32 = run(recurrent_gated_delta_rule, jnp.float32, True)
    ref_lo = run(recurrent_gated_delta_rule, dtype, True)
    got = run(one_lane, dtype, False)
    print(check_2x(("o", "dq", "dk", "dv", "dg", "dbeta"), got, ref_lo, ref32))


def test_interpret_packed_one_lane():
    with pk.use_mode("interpret"):
        try:
            _check_packed_one_lane(1, 150, 1, 2, 64, 64, [0, 30, 30, 100, 150], jnp.bfloat16)
        finally:
            pk.reset_interpreter()


def test_interpret_f16():
    """f16 io: the kernels stage the f32 state (and its gradient) as f16 with per-column/row
    scales and pass h, dh in f32, so the state keeps its range (docs/design.md)."""
    x, cu, cts = _case(0, 1, 100, 1, 2, 64, 64, None)
    with pk.use_mode("interpret"):
        try:
            _check_2x(x, cu, cts, jnp.float16)
        finally:
            pk.reset_interpreter()


def test_interpret_f16_final_state_cotangent_dg_gap():
    """The known f16 gap (docs/ops.md, the 2x rule), pinned: one head, T = 100, K = V = 128 and a
    cotangent of the final state; dg alone breaks the rule (2.0e-3 against the f16 recurrence's
    7.7e-4; the xla path: 4.0e-4). With that cotangent zero every output and gradient keeps it.
    When this test fails, the gap is closed or moved: update docs/ops.md and this test."""
    x, cu, cts = _unit_case(3, 1, 100, 1, 1, 128, 128, None)
    with pk.use_mode("interpret"):
        try:
            with pytest.raises(AssertionError, match=r"2x rule broken for \['dg'\]:"):
                _check_2x(x, cu, cts, jnp.float16)
            _check_2x(x, cu, (cts[0], jnp.zeros_like(cts[1])), jnp.float16)
        finally:
            pk.reset_interpreter()


def test_interpret_f16_final_state_cotangent_dbeta():
    """f16 with a cotangent of the final state (one head, T = 100, K = V = 128): dβ and dv keep the
    2x rule because the reverse loop stages dH for dv2 = k dH as an f16 pair (hi + lo). One f16
    rounding of dH gives dβ 3.1e-4 here against the f16 recurrence's 1.3e-4: its terms cancel."""
    x, cu, cts = _unit_case(3, 1, 100, 1, 1, 128, 128, None)
    with pk.use_mode("interpret"):
        try:
            _check_2x(x, cu, cts, jnp.float16, names=("dbeta", "dv"))
        finally:
            pk.reset_interpreter()


def test_f16_large_state_keeps_its_range():
    """A state of ~1e6, far beyond f16's 65504: plain f16 staging would make o inf. With β = 0
    the state is only read (o = scale Sᵀ q e^G, q small so that o fits f16)."""
    x, _, _ = _case(4, 1, 64, 1, 1, 64, 64, None)
    h0 = 1e6 * x["initial_state"]
    args = [1e-4 * x["q"], x["k"], x["v"], x["g"], jnp.zeros_like(x["beta"])]
    kw = dict(initial_state=h0, output_final_state=True)
    ref = recurrent_gated_delta_rule(*args, **kw)
    with pk.use_mode("interpret"):
        try:
            got = _pallas(*[a.astype(jnp.float16) for a in args[:3]], *args[3:], **kw)
        finally:
            pk.reset_interpreter()
    assert float(jnp.max(jnp.abs(ref[0]))) > 10.0  # o is not negligible
    for a, r in zip(got, ref, strict=True):
        assert rel_rms(a, r) < 2e-3, rel_rms(a, r)


# ------------------------------------------------------------------------------------------------
# CPU: the real GPU lowering (layout inference, wgmma operand checks, SMEM budget)


@pytest.mark.parametrize(
    "K,V,HV,dtype,l2norm",
    [(128, 128, 4, "bfloat16", True), (64, 64, 2, "bfloat16", True),
     (128, 64, 2, "bfloat16", True), (64, 128, 2, "bfloat16", True),
     (128, 128, 4, "float16", True),
     # one value head per q/k head, no l2norm: dq and dk leave the kernels in the io dtype
     (128, 128, 2, "bfloat16", False), (128, 64, 2, "float16", False),
     (64, 128, 2, "bfloat16", False)],
)  # fmt: skip
def test_lowers_for_cuda(K, V, HV, dtype, l2norm):
    B, T, H = 1, 200, 2
    S, bf = jax.ShapeDtypeStruct, jnp.dtype(dtype)
    args = (
        S((B, T, H, K), bf), S((B, T, H, K), bf), S((B, T, HV, V), bf),
        S((B, T, HV), jnp.float32), S((B, T, HV), jnp.float32),
        S((3, HV, K, V), jnp.float32), S((4,), jnp.int32),
    )  # fmt: skip

    def f(q, k, v, g, b, h0, cu):
        def loss(q, k, v, g, b, h0):  # through the op: its poison goes into the chunk loop
            o, s = gdn_jax.gated_delta_rule(
                q, k, v, g, b, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                use_qk_l2norm=l2norm, implementation="pallas",
            )  # fmt: skip
            return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

        return jax.value_and_grad(loss, argnums=range(6))(q, k, v, g, b, h0)

    with pk.cuda_lowering_mesh():
        txt = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    found = lowered_kernels(txt, KERNELS)
    assert found == set(KERNELS), found


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_intra_fits_four_ctas_per_sm(dtype):
    """The intra kernel (w and u staged in k's and v's tiles) lowers for sm_90a at K = V = 128 in
    a quarter of an SM's shared memory, with A stored and without."""
    from pallas_kernels.gdn.intra import IntraConfig, intra_chunk

    S, dt = jax.ShapeDtypeStruct, jnp.dtype(dtype)
    B, T, HV = 1, 128, 2
    args = (S((B, T, HV, 128), dt), S((B, T, HV, 128), dt), S((B, HV, T), jnp.float32),
            S((B, HV, T), jnp.float32))  # fmt: skip

    def f(k, v, G, beta):
        return [intra_chunk(k, v, G, beta, IntraConfig(store_a=a)) for a in (False, True)]

    with pk.cuda_lowering_mesh(), kernel_launches() as smem:
        jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    assert 0 < smem["gdn_intra"].smem <= smem_per_cta(4), smem


def _kernel_hashes(n_layers: int) -> list[str]:
    """Mosaic GPU kernel hashes in a CUDA lowering of ``n_layers`` stacked GDN layers' fwd+bwd."""
    B, T, H, D = 1, 128, 2, 64
    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    args = (S((B, T, H, D), bf), S((B, T, H, D), bf), S((B, T, H), jnp.float32), S((B, T, H), bf))

    def loss(x, k, g, beta):
        for _ in range(n_layers):
            o, _ = _pallas(x, k, x, g, beta, use_qk_l2norm=True)
            x = o.astype(bf)
        return jnp.sum(x.astype(jnp.float32))

    with pk.cuda_lowering_mesh():
        lowered = jax.jit(jax.value_and_grad(loss)).trace(*args).lower(lowering_platforms=("cuda",))
    return re.findall(r'kernel_hash = "((?:[^"\\]|\\.)*)"', lowered.as_text())


def test_layers_share_kernels():
    """Identical GDN layers lower each kernel once, to modules equal across separate programs.

    Mosaic GPU compiles a kernel per distinct module hash, once per process: per-layer copies
    made a model's first step compile 7 kernels per GDN layer (~10 s per layer on the H200).
    """
    one, three = _kernel_hashes(1), _kernel_hashes(3)
    # 2 forward + 5 backward launches, and the L2 norm's forwards (q's keeps the NaN rows of a
    # bad q, k's does not) and backward (of q: the loss is differentiated with respect to x only)
    assert len(one) == 10 and len(set(one)) == 10
    assert set(three) == set(one)  # one compile per kernel for the whole model
    # and the layers share their lowerings (the jitted launches); the first and the last layer
    # may differ in their cotangents' avals
    assert len(three) < 3 * len(one)


# ------------------------------------------------------------------------------------------------
# CPU: what the kernels refuse (the selector then falls back to "xla")


def _args(dtype=jnp.bfloat16, K=64, V=64):
    x = random_inputs(0, B=1, T=64, H=1, HV=1, K=K, V=V)
    return [x[n].astype(dtype) for n in ("q", "k", "v")] + [x["g"], x["beta"]]


@pytest.mark.parametrize(
    "dtype,K,V,chunk", [(jnp.float32, 64, 64, 64), (jnp.bfloat16, 32, 64, 64),
                        (jnp.bfloat16, 64, 96, 64), (jnp.bfloat16, 64, 64, 32)]
)  # fmt: skip
def test_not_implemented(dtype, K, V, chunk):
    kw = dict(scale=0.125, initial_state=None, output_final_state=False, use_qk_l2norm=False,
              cu_seqlens=None, chunk_size=chunk)  # fmt: skip
    with pk.use_mode("interpret"), pytest.raises(NotImplementedError):
        gated_delta_rule_pallas(*_args(dtype, K, V), **kw)


def test_not_implemented_without_gpu():
    if pk.is_hopper():
        pytest.skip("on a Hopper GPU the kernels run")
    kw = dict(scale=0.125, initial_state=None, output_final_state=False, use_qk_l2norm=False,
              cu_seqlens=None, chunk_size=64)  # fmt: skip
    with pytest.raises(NotImplementedError):
        gated_delta_rule_pallas(*_args(), **kw)


# ------------------------------------------------------------------------------------------------
# GPU (H200): realistic shapes, every gradient, 2x rule, determinism, extreme gates


SLOW = pytest.mark.slow
# B, T, H, HV, K, V, cu_seqlens. Each shape is compiled once per process (channel_cases caches the
# programs) and serves several tests: DENSE: 16 chunks, the last one partial, GVA, two batch rows
# with initial/final states; PACKED: packed sequences with an empty one and states (every
# sequence ends in a partial chunk), 16 heads, K != V.
DENSE = (2, 1000, 4, 8, 128, 128, None)
PACKED = (1, 4096, 16, 16, 128, 64, [0, 1000, 1000, 2500, 4096])
GPU_CASES = [
    pytest.param(*DENSE, bf16, id="dense-bf16"),
    pytest.param(*DENSE, f16, id="dense-f16"),  # f16: scaled f16 staging of the state
    pytest.param(*PACKED, bf16, id="packed-k128-v64-bf16"),
    # heavier shapes on the same code paths (-m "gpu and slow")
    pytest.param(2, 2048, 16, 32, 128, 128, None, bf16, marks=SLOW, id="b2-t2048-hv32-bf16"),
    pytest.param(1, 8192, 16, 16, 128, 128, None, bf16, marks=SLOW, id="t8192-bf16"),
    pytest.param(*PACKED[:4], 128, 128, PACKED[6], bf16, marks=SLOW, id="packed-bf16"),
    pytest.param(*PACKED[:4], 128, 128, PACKED[6], f16, marks=SLOW, id="packed-f16"),
    pytest.param(2, 2000, 4, 8, 64, 128, None, bf16, marks=SLOW, id="k64-v128-bf16"),
    pytest.param(2, 2000, 4, 8, 128, 64, None, bf16, marks=SLOW, id="k128-v64-bf16"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,H,HV,K,V,cu,dtype", GPU_CASES)
def test_gpu_matches_reference(B, T, H, HV, K, V, cu, dtype):
    x, cu, cts = _case(7, B, T, H, HV, K, V, cu)
    _check_2x(x, cu, cts, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape,dtype",
    [(PACKED, bf16), ((2, 1000, 4, 4, 128, 128, None), f16)],
    ids=["packed-k128-v64-bf16", "dense-f16"],
)
def test_gpu_grads_in_io_dtype(shape, dtype):
    """Without the l2norm and with one value head per q/k head, dq and dk leave the kernels in the
    io dtype (dk with its state part added in bwd_wy): the 2x rule on every gradient."""
    x, cu, cts = _unit_case(7, *shape)
    _check_2x(x, cu, cts, dtype, use_qk_l2norm=False)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "T,H,HV,K,V,cu",
    [
        # with an empty and a one-token sequence, GVA, K != V
        (4096, 8, 16, 64, 128, [0, 1000, 1000, 2500, 2501, 4096]),
        pytest.param(8192, 16, 32, 128, 128, [0, 1000, 1000, 2500, 2501, 8192], marks=SLOW),
    ],
)
def test_gpu_packed_one_lane(T, H, HV, K, V, cu):
    _check_packed_one_lane(1, T, H, HV, K, V, cu, bf16, seed=3)


@pytest.mark.gpu
def test_gpu_deterministic():
    """Two runs of the DENSE fwd+bwd program (GVA, states) are bitwise equal."""
    x, cu, cts = _case(11, *DENSE)
    a = loss_and_grads(pallas_op("gdn"), "gdn", x, cu, bf16, cts)
    b = loss_and_grads(pallas_op("gdn"), "gdn", x, cu, bf16, cts)
    for name, u, w in zip(NAMES, a, b, strict=True):
        assert np.array_equal(np.asarray(u), np.asarray(w)), name


@pytest.mark.gpu
@pytest.mark.parametrize("g_val,beta_val", [(0.0, 0.0), (0.0, 1.0), (-20.0, 1.0), (-20.0, 0.0)])
def test_gpu_extreme_gates_finite(g_val, beta_val):
    x, cu, cts = _case(5, *DENSE)
    x["g"] = jnp.full_like(x["g"], g_val)
    x["beta"] = jnp.full_like(x["beta"], beta_val)
    got = loss_and_grads(pallas_op("gdn"), "gdn", x, cu, bf16, cts)
    for name, a in zip(NAMES, got, strict=True):
        assert bool(jnp.all(jnp.isfinite(a.astype(jnp.float32)))), name
    ref = loss_and_grads(RECURRENT["gdn"], "gdn", x, cu, f32, cts, reference=True)
    assert rel_rms(got[0], ref[0]) < 2e-2


def _chunk_qat(*args, **kw):
    from gdn_jax.qat import QATConfig

    return chunk_gated_delta_rule(*args, qat=QATConfig(), **kw)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "ref,dtypes",
    [
        (recurrent_gated_delta_rule, (bf16, f16)),
        # the chunked reference rounds through optimization barriers (reference/_common.py)
        pytest.param(_chunk_qat, (bf16,), marks=SLOW),
    ],
    ids=["recurrent", "chunk-qat"],
)
def test_gpu_reference_budget_matches_host(ref, dtypes):
    """The 2x budgets (error of the reference run in bf16/f16 against it in f32) of the GPU
    references (:func:`gdn_jax.testing.reference_jit`) are the host CPU's (the same compile
    options) to within 15 %, for every output: the GPU suite's budgets are those of references
    that round where they say, as the interpreter tests' eager references do. (XLA's default
    excess precision moves them on both backends: by 7-22 % for bf16 dq, dk on the CPU.)"""
    x, cu, cts = _case(3, 1, 256, 2, 4, 128, 128, [0, 100, 100, 256])
    cpu = jax.devices("cpu")[0]

    def host(dtype):
        f = lambda x, cu, cts: loss_and_grads(ref, "gdn", x, cu, dtype, cts, jit=False)  # noqa: E731
        f = reference_jit(f)
        with jax.default_device(cpu):
            return f(*jax.device_put((x, cu, cts), cpu))

    gpu32 = loss_and_grads(ref, "gdn", x, cu, f32, cts, reference=True)
    cpu32 = host(f32)
    bad, report = [], []
    for dtype in dtypes:
        gpu_lo = loss_and_grads(ref, "gdn", x, cu, dtype, cts, reference=True)
        cpu_lo = host(dtype)
        for name, g32, glo, c32, clo in zip(NAMES, gpu32, gpu_lo, cpu32, cpu_lo, strict=True):
            on_gpu, on_cpu = rel_rms(glo, g32), rel_rms(clo, c32)
            report.append(f"{jnp.dtype(dtype).name} {name}: gpu {on_gpu:.3e} cpu {on_cpu:.3e}")
            if not abs(on_gpu - on_cpu) <= 0.15 * on_cpu + 1e-7:
                bad.append(f"{jnp.dtype(dtype).name} {name}")
    print("; ".join(report))
    assert not bad, (bad, "; ".join(report))


def test_residual_named_for_remat_policies():
    from gdn_jax import remat

    x = random_inputs(0, B=1, T=64, H=1, HV=1, K=64, V=64)
    args = [x[n].astype(jnp.bfloat16) for n in ("q", "k", "v")] + [x["g"], x["beta"]]

    def f(q, k, v, g, b):
        return jnp.sum(_pallas(q, k, v, g, b)[0].astype(jnp.float32))

    policy = jax.checkpoint_policies.save_only_these_names(remat.GDN_GATE_CUMSUM)
    with pk.use_mode("gpu"):  # traced only, never run
        jaxpr = jax.make_jaxpr(jax.grad(jax.checkpoint(f, policy=policy), argnums=range(5)))(*args)
    assert remat.GDN_GATE_CUMSUM in str(jaxpr)
