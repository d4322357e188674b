"""Backward kernels of the channel-gated variants (GDN2, KDA): CPU interpreter numerics, CUDA
lowering, GPU accuracy/robustness at realistic shapes.

The op's core is the ``custom_vjp`` of :mod:`gdn_jax.ops._channel_pallas`; these tests run it with
the Pallas backward of :mod:`gdn_jax.ops._channel_pallas_bwd` (the fixture below installs it, so
they test the kernels whether or not the op's own backward already calls them). Two levels:

- core: the backward driver against the VJP of the xla chunked core on the same padded lanes,
  with the 2x rule against that core run in f32 (cheap, isolates the kernels);
- op: every gradient of the public op against the f32 recurrent oracle (2x rule of DESIGN §7),
  through the glue (l2norm, GVA, padding, packed sequences, initial/final states).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from channel_cases import NAMES, channel_case, check_2x, loss_and_grads, pallas_op

from gdn_jax.ops import _channel_pallas as cpm
from gdn_jax.ops._channel_pallas_bwd import channel_backward_pallas
from gdn_jax.testing import rel_rms
from pallas_kernels import _compat as pk

BWD_KERNELS = ("chan_bwd_dh", "chan_bwd_dqkw", "chan_bwd_wy", "chan_intra", "chan_chunk_h")
CORE_NAMES = ("dq", "dk", "dv", "dG", "db", "dw", "dh0")
f32 = jnp.float32


def _pallas_bwd(cfg, res, cts):
    with cpm._kernels(cfg):
        return channel_backward_pallas(*res, *cts, scale=cfg.scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(cfg, q, k, v, G, b, w, h0):
    return cpm._forward(cfg, q, k, v, G, b, w, h0)


_core.defvjp(cpm._core_fwd, _pallas_bwd)


@pytest.fixture(autouse=True)
def _pallas_backward(monkeypatch):
    """The op's core with the Pallas backward (the glue looks ``_core`` up at call time)."""
    monkeypatch.setattr(cpm, "_core", _core)


def _interpret(fn):
    with pk.use_mode("interpret"):
        try:
            return fn()
        finally:
            pk.reset_interpreter()


def core_case(seed, variant, N, T, H, HV, K, *, g_val=None, gate_scale=1.0):
    """Residuals and cotangents of the core on padded lanes (T % 64 == 0), l2-normalised q/k."""
    r = np.random.default_rng(seed)
    nrm = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    q = jnp.asarray(nrm(r.standard_normal((N, T, H, K))), jnp.bfloat16)
    k = jnp.asarray(nrm(r.standard_normal((N, T, H, K))), jnp.bfloat16)
    v = jnp.asarray(r.standard_normal((N, T, HV, K)), jnp.bfloat16)
    if g_val is None:
        g = -gate_scale * r.uniform(0, 1, (N, T, HV, K))
    else:
        g = np.full((N, T, HV, K), g_val)
    G = cpm._cumsum(jnp.asarray(g, f32))
    if variant == "kda":
        b, w = jnp.asarray(r.uniform(0, 1, (N, T, HV)), f32), None
    else:
        b = jnp.asarray(r.uniform(0, 1, (N, T, HV, K)), f32)
        w = jnp.asarray(r.uniform(0, 1, (N, T, HV, K)), f32)
    h0 = 0.1 * jnp.asarray(r.standard_normal((N, HV, K, K)), f32)
    do = jnp.asarray(r.standard_normal((N, T, HV, K)), f32)
    dht = jnp.asarray(r.standard_normal((N, HV, K, K)), f32)
    cfg = cpm.ChannelConfig(scale=K**-0.5, scalar_beta=variant == "kda", mode=pk.execution_mode())
    return cfg, (q, k, v, G, b, w, h0), (do, dht)


def check_core(cfg, res, cts, *, floor=1e-2, jit=True, sliced=False):
    """Driver vs the xla core's VJP: error(driver, f32 core) <= 2 error(bf16 core, f32 core) +
    floor. The inputs are already bf16 here, so the bf16 core differs from the f32 one only where
    it rounds operands (its state-gradient loop is f32: its dh0 error is ~1e-6); the kernels stage
    the state gradient and dv2 through bf16 tensor-core operands (each rounding 2^-9 relative),
    hence the floor. The op-level tests apply the strict 2x rule against the recurrent oracle."""
    up = lambda x: None if x is None else x.astype(f32)

    def xla_vjp(res):  # the xla core computes in its inputs' dtype: f32 inputs give the f32 core
        _, vjp = jax.vjp(lambda *a: cpm._xla_core(cfg, *a), *res)
        return vjp((cts[0], cts[1]))

    def mine(res):
        return channel_backward_pallas(*res, *cts, scale=cfg.scale, sliced=sliced)

    if jit:
        xla_vjp, mine = jax.jit(xla_vjp), jax.jit(mine)
    ref32 = xla_vjp(tuple(up(x) for x in res))
    ref_lo = xla_vjp(res)
    with pk.use_mode(cfg.mode):
        got = mine(res)
    report, bad = [], []
    for name, a, b, r in zip(CORE_NAMES, got, ref_lo, ref32, strict=True):
        if a is None:
            assert b is None and r is None, name
            continue
        assert bool(jnp.all(jnp.isfinite(a))), name
        err, budget = rel_rms(a, r), rel_rms(b, r)
        report.append(f"{name}: {err:.2e} (ref {budget:.2e})")
        if not err <= 2 * budget + floor:
            bad.append(name)
    print("core", "; ".join(report))
    assert not bad, (bad, "; ".join(report))
    return got


# ------------------------------------------------------------------------------------------------
# CPU: Mosaic GPU interpreter (tiny shapes)


@pytest.mark.parametrize("variant,sliced", [("gdn2", False), ("kda", True)])
def test_interpret_core_grads(variant, sliced):
    """All five backward launches against the xla core's VJP (GVA, initial state, 2 chunks)."""
    with pk.use_mode("interpret"):
        cfg, res, cts = core_case(0, variant, 1, 128, 1, 2, 64)
    _interpret(lambda: check_core(cfg, res, cts, jit=False, sliced=sliced))


@pytest.mark.parametrize(
    "variant,B,T,H,HV,cu",
    [
        ("gdn2", 1, 100, 1, 2, [0, 30, 30, 100]),  # GVA, packed with an empty sequence, states
        ("kda", 2, 70, 1, 1, None),  # partial last chunk, initial/final state
    ],
)
def test_interpret_op_grads(variant, B, T, H, HV, cu):
    x, cu, cts = channel_case(0, variant, B, T, H, HV, 64, 64, cu)
    _interpret(lambda: check_2x(variant, pallas_op(variant), x, cu, cts, jnp.bfloat16, jit=False))


# ------------------------------------------------------------------------------------------------
# CPU: the real GPU lowering (layout inference, wgmma operand checks, SMEM budget)


@pytest.mark.parametrize("variant,K", [("gdn2", 128), ("kda", 128), ("gdn2", 64)])
def test_lowers_for_cuda(variant, K):
    B, T, H, HV = 1, 200, 2, 4
    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    gates = (S((B, T, HV, K), f32), S((B, T, HV, K), f32)) if variant == "gdn2" else (
        S((B, T, HV), f32),
    )  # fmt: skip
    args = (S((B, T, H, K), bf), S((B, T, H, K), bf), S((B, T, HV, K), bf), S((B, T, HV, K), f32))
    op = pallas_op(variant)

    def f(args, gates, h0, cu):
        def loss(args, gates, h0):
            o, s = op(
                *args, *gates, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                use_qk_l2norm=True,
            )  # fmt: skip
            return jnp.sum(o.astype(f32)) + jnp.sum(s)

        return jax.grad(loss, argnums=(0, 1, 2))(args, gates, h0)

    h0, cu = S((3, HV, K, K), f32), S((4,), jnp.int32)
    with pk.cuda_lowering_mesh():
        txt = jax.jit(f).trace(args, gates, h0, cu).lower(lowering_platforms=("cuda",)).as_text()
    calls = [ln for ln in txt.splitlines() if "custom_call @mosaic_gpu" in ln]
    found = {n for ln in calls for n in BWD_KERNELS if re.search(rf"\\00{n}\\00", ln)}
    assert found == set(BWD_KERNELS), (found, len(calls))


# ------------------------------------------------------------------------------------------------
# GPU (H200): realistic shapes, every gradient, 2x rule, determinism, extreme gates


@pytest.mark.gpu
@pytest.mark.parametrize("sliced", [False, True])
@pytest.mark.parametrize("variant", ["kda", "gdn2"])
def test_gpu_core_grads(variant, sliced):
    cfg, res, cts = core_case(3, variant, 2, 4096, 16, 32, 128)
    check_core(cfg, res, cts, sliced=sliced)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["kda", "gdn2"])
@pytest.mark.parametrize("g_val", [0.0, -5.0])
def test_gpu_core_extreme_gates(variant, g_val):
    """Per-token log-decay −5 on every channel over whole chunks, and no decay at all."""
    cfg, res, cts = core_case(4, variant, 1, 4096, 16, 16, 128, g_val=g_val)
    check_core(cfg, res, cts)


GPU_CASES = [
    # variant, B, T, H, HV, cu_seqlens
    ("kda", 2, 4096, 16, 32, None),
    ("gdn2", 2, 4096, 16, 32, None),
    ("kda", 1, 8192, 16, 16, [0, 1000, 1000, 2500, 8192]),  # packed, one empty, states
    ("gdn2", 1, 8192, 16, 16, [0, 1000, 1000, 2500, 8192]),
]


@pytest.mark.gpu
@pytest.mark.parametrize("variant,B,T,H,HV,cu", GPU_CASES)
def test_gpu_op_matches_reference(variant, B, T, H, HV, cu):
    x, cu, cts = channel_case(7, variant, B, T, H, HV, 128, 128, cu)
    check_2x(variant, pallas_op(variant), x, cu, cts, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["kda", "gdn2"])
def test_gpu_deterministic(variant):
    x, cu, cts = channel_case(11, variant, 2, 4096, 16, 16, 128, 128)
    a = loss_and_grads(pallas_op(variant), variant, x, cu, jnp.bfloat16, cts)
    b = loss_and_grads(pallas_op(variant), variant, x, cu, jnp.bfloat16, cts)
    for name, u, w in zip(NAMES[variant], a, b, strict=True):
        assert np.array_equal(np.asarray(u), np.asarray(w)), name
