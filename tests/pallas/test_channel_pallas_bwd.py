"""Backward kernels of the channel-gated variants (GDN2, KDA): CPU interpreter numerics, GPU
accuracy/robustness at realistic shapes (the CUDA lowering of the op's fwd+bwd, dense and packed:
test_channel_pallas.py::test_lowers_for_cuda).

The op's core is the ``custom_vjp`` of :mod:`gdn_jax.ops._channel_pallas`, whose backward is the
driver :func:`gdn_jax.ops._channel_pallas_bwd.channel_backward_pallas`. Three levels:

- kernels: each backward launch against its formulas in jnp;
- core: the backward driver against the VJP of the xla chunked core on the same padded lanes,
  with the 2x rule against that core run in f32 (cheap, isolates the kernels);
- op: every gradient of the public op against the f32 recurrent oracle (2x rule of docs/design.md),
  through the glue (l2norm, GVA, padding, packed sequences, initial/final states).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from channel_cases import NAMES, channel_case, check_channel_2x, loss_and_grads, pallas_op
from gdn_cases import RECURRENT, cached_jit, run_interpreted

from gdn_jax.ops import _channel_pallas as cpm
from gdn_jax.ops._channel_pallas_bwd import channel_backward_pallas
from gdn_jax.testing import check_2x, reference_jit, rel_rms
from pallas_kernels import _compat as pk

CORE_NAMES = ("dq", "dk", "dv", "dG", "db", "dw", "dh0")
f32 = jnp.float32


def core_case(seed, variant, N, T, H, HV, K, *, g_val=None, gate_scale=1.0, g=None):
    """Residuals and cotangents of the core on padded lanes (T % 64 == 0), l2-normalised q/k.
    Log-decays per token: ``g`` ([N, T, HV, K]) if given, else ``g_val`` everywhere, else uniform
    in [−gate_scale, 0]."""
    r = np.random.default_rng(seed)
    nrm = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    q = jnp.asarray(nrm(r.standard_normal((N, T, H, K))), jnp.bfloat16)
    k = jnp.asarray(nrm(r.standard_normal((N, T, H, K))), jnp.bfloat16)
    v = jnp.asarray(r.standard_normal((N, T, HV, K)), jnp.bfloat16)
    if g is not None:
        pass
    elif g_val is None:
        g = -gate_scale * r.uniform(0, 1, (N, T, HV, K))
    else:
        g = np.full((N, T, HV, K), g_val)
    G = cpm.lane_gate_cumsum(jnp.asarray(g, f32))
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


def core_plan(cfg, res, *, whole: bool):
    """The plan the op's backward runs for these residuals; ``whole``: with the one-CTA dq/dk/dw
    and the unsplit WY kernels forced instead (the forms it does not pick at K = V = 128)."""
    plan = cpm.core_plan(cfg, res[0], res[2], store_a=True)
    return dataclasses.replace(plan, dqkw="one_cta", wy_split=False) if whole else plan


def _core_fns(cfg, whole):
    def xla_vjp(res, cts):  # the xla core computes in its inputs' dtype: f32 inputs, f32 core
        _, vjp = jax.vjp(lambda *a: cpm._xla_core(cfg, *a), *res)
        return vjp(cts)

    def mine(res, cts):  # the forward kernels' products, then the backward driver
        products = cpm._forward(cfg, True, *res)[2]
        plan = core_plan(cfg, res, whole=whole)
        return channel_backward_pallas(*res, products, *cts, scale=cfg.scale, plan=plan)

    return xla_vjp, mine


@functools.cache
def _core_programs(cfg, whole):
    """The compiled xla core VJP (a reference) and driver, shared by every case of their shapes;
    cotangents are arguments: as closure constants XLA would constant-fold them (slow)."""
    xla_vjp, mine = _core_fns(cfg, whole)
    return reference_jit(xla_vjp), jax.jit(mine)


def check_core(cfg, res, cts, *, floor=1e-2, jit=True, whole=False):
    """Driver vs the xla core's VJP: error(driver, f32 core) <= 2 error(bf16 core, f32 core) +
    floor. The inputs are already bf16 here, so the bf16 core differs from the f32 one only where
    it rounds operands (its state-gradient loop is f32: its dh0 error is ~1e-6); the kernels stage
    the state gradient and dv2 through bf16 tensor-core operands (each rounding 2^-9 relative),
    hence the floor. The op-level tests apply the strict 2x rule against the recurrent oracle."""
    up = lambda x: None if x is None else x.astype(f32)
    xla_vjp, mine = _core_programs(cfg, whole)
    if not jit:  # the kernels' interpreter callbacks: a program for this call only
        mine = jax.jit(_core_fns(cfg, whole)[1])
    ref32 = xla_vjp(tuple(up(x) for x in res), cts)
    ref_lo = xla_vjp(res, cts)
    with pk.use_mode(cfg.mode):
        got = mine(res, cts)
    print("core", check_2x(CORE_NAMES, got, ref_lo, ref32, floor=floor))
    return got


def check_op(variant, x, cu, cts, *, floor=1e-5, jit=True):
    """2x rule of docs/design.md for every gradient of the op (bf16 io). o and the final state come
    from the forward kernels: reported here, asserted by tests/pallas/test_channel_pallas.py."""
    ref = functools.partial(loss_and_grads, RECURRENT[variant], variant, x, cu, jit=jit)
    ref32 = ref(f32, cts, reference=True)
    ref_lo = ref(jnp.bfloat16, cts, reference=True)
    got = loss_and_grads(pallas_op(variant), variant, x, cu, jnp.bfloat16, cts, jit=jit)
    report = check_2x(
        NAMES[variant], got, ref_lo, ref32, floor=floor, checked=lambda n: n.startswith("d")
    )
    print(variant, "op", report, flush=True)
    return got


# ------------------------------------------------------------------------------------------------
# CPU: Mosaic GPU interpreter (tiny shapes)


@pytest.mark.parametrize("variant", ["gdn2", "kda"])
def test_interpret_core_grads(variant):
    """All five backward launches against the xla core's VJP (GVA, initial state, 2 chunks)."""
    with pk.use_mode("interpret"):
        cfg, res, cts = core_case(0, variant, 1, 128, 1, 2, 64)
    run_interpreted(lambda: check_core(cfg, res, cts, jit=False))


@pytest.mark.parametrize(
    "variant,B,T,H,HV,cu",
    [
        ("gdn2", 1, 100, 1, 2, [0, 30, 30, 100]),  # GVA, packed with an empty sequence, states
        ("kda", 2, 70, 1, 1, None),  # partial last chunk, initial/final state
    ],
)
def test_interpret_op_grads(variant, B, T, H, HV, cu):
    x, cu, cts = channel_case(0, variant, B, T, H, HV, 64, 64, cu)
    run_interpreted(lambda: check_op(variant, x, cu, cts, jit=False))


def test_interpret_f16_final_state_cotangent_dbeta():
    """KDA f16 with a cotangent of the final state (one head, T = 100, K = V = 128, unit q and k
    rows): dβ and dv keep the 2x rule because the reverse loop stages dH for dv2 = k dH as an f16
    pair (hi + lo). One f16 rounding of dH gives dβ 7.1e-4 here against the f16 recurrence's
    2.9e-4 (budget 5.9e-4): its terms cancel."""
    x, cu, cts = channel_case(0, "kda", 1, 100, 1, 1, 128, 128)
    for n in ("q", "k"):
        x[n] = x[n] / jnp.linalg.norm(x[n], axis=-1, keepdims=True)
    run_interpreted(
        lambda: check_channel_2x(
            "kda", pallas_op("kda"), x, cu, cts, jnp.float16, names=("dbeta", "dv"), jit=False
        )
    )


def check_one_lane(variant, T, H, HV, cu, K, seed=0):
    """Packed sequences without initial/final states (one lane, state wiped at every sequence
    start): every gradient against the f32 recurrent oracle, 2x rule."""
    from gdn_cases import positional

    from gdn_jax.testing import random_inputs

    x = random_inputs(seed, B=1, T=T, H=H, HV=HV, K=K, V=K, variant=variant)
    cu = jnp.asarray(cu, jnp.int32)
    do = jnp.asarray(np.random.default_rng(seed + 1).standard_normal(x["v"].shape), f32)

    def run(fn, dt, reference=False):
        def loss(args, do):
            o, s = fn(*args, cu_seqlens=cu, use_qk_l2norm=True)
            assert s is None
            return jnp.sum(o.astype(f32) * do), o

        args = positional(x, variant)
        args = tuple(a.astype(dt) for a in args[:3]) + tuple(args[3:])
        g = jax.value_and_grad(loss, has_aux=True)  # inputs and do as arguments (no constants)
        g = reference_jit(g) if reference else jax.jit(g)
        (_, o), grads = g(args, do)
        return (o, *grads)

    ref32 = run(RECURRENT[variant], f32, reference=True)
    ref_lo = run(RECURRENT[variant], jnp.bfloat16, reference=True)
    got = run(pallas_op(variant), jnp.bfloat16)
    names = [n for n in NAMES[variant] if n not in ("final_state", "dh0")]
    print(variant, "one lane", check_2x(names, got, ref_lo, ref32))


@pytest.mark.parametrize("variant", ["kda", "gdn2"])
def test_interpret_packed_one_lane(variant):
    """Two chunks, the last one partial: an empty sequence, a sequence across the chunk boundary
    and one starting in the second chunk (its start wipes the state carried in)."""
    cu = [0, 30, 30, 100, 120]
    run_interpreted(lambda: check_one_lane(variant, 120, 1, 2, cu, 64))


# ------------------------------------------------------------------------------------------------
# GPU (H200): realistic shapes, every gradient, 2x rule, determinism, extreme gates


SLOW = pytest.mark.slow
# the core cases' shape (N, T, H, HV, K): 32 chunks, GVA; one compile per form and variant serves
# the random-gate and the extreme-gate cases
CORE = (1, 2048, 4, 8, 128)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "whole",
    [
        False,  # the op's forms (the plan's)
        # the other forms' kernels: test_gpu_kernels (whole), test_channel_ksplit_*.py
        pytest.param(True, marks=SLOW),
    ],
    ids=["ksplit", "whole"],
)
@pytest.mark.parametrize("variant", ["kda", "gdn2"])
def test_gpu_core_grads(variant, whole):
    cfg, res, cts = core_case(3, variant, *CORE)
    check_core(cfg, res, cts, whole=whole)


@pytest.mark.gpu
@pytest.mark.parametrize("whole", [pytest.param(True, marks=SLOW), False], ids=["whole", "ksplit"])
@pytest.mark.parametrize("variant", ["kda", "gdn2"])
@pytest.mark.parametrize("g_val", [0.0, -5.0])
def test_gpu_core_extreme_gates(variant, g_val, whole):
    """Per-token log-decay −5 on every channel over whole chunks, and no decay at all."""
    cfg, res, cts = core_case(4, variant, *CORE, g_val=g_val)
    check_core(cfg, res, cts, whole=whole)


# Every gradient of the op at heavier shapes (-m "gpu and slow"). The same code paths, every
# gradient with the 2x rule, are checked by test_channel_pallas.py::test_gpu_matches_reference
# (dense: B 2, GVA, states; packed: an empty sequence, states).
GPU_CASES = [
    # variant, B, T, H, HV, cu_seqlens
    ("kda", 2, 4096, 16, 32, None),
    ("gdn2", 2, 4096, 16, 32, None),
    ("kda", 1, 8192, 16, 16, [0, 1000, 1000, 2500, 8192]),  # packed, one empty, states
    ("gdn2", 1, 8192, 16, 16, [0, 1000, 1000, 2500, 8192]),
]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("variant,B,T,H,HV,cu", GPU_CASES)
def test_gpu_op_matches_reference(variant, B, T, H, HV, cu):
    x, cu, cts = channel_case(7, variant, B, T, H, HV, 128, 128, cu)
    check_op(variant, x, cu, cts)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "T,H,HV,cu,K",
    [
        # an empty and a one-token sequence, GVA; K = V = 64 (quick: one packed lane with states,
        # an empty and a one-token sequence, in test_channel_pallas.py's packed cases, K != V)
        pytest.param(4096, 8, 16, [0, 1000, 1000, 2500, 2501, 4096], 64, marks=SLOW),
        pytest.param(8192, 16, 32, [0, 1000, 1000, 2500, 2501, 8192], 128, marks=SLOW),
    ],
)
@pytest.mark.parametrize("variant", ["kda", "gdn2"])
def test_gpu_packed_one_lane(variant, T, H, HV, cu, K):
    check_one_lane(variant, T, H, HV, cu, K, seed=3)


# ------------------------------------------------------------------------------------------------
# Per kernel: each launch against its formulas in jnp (f32, explicit pairwise decays), from the
# same 16-bit inputs. CPU interpreter at one chunk pair; GPU at a realistic shape.


def _explicit(G):
    """D[c, i, j, d] = e^{G_id − G_jd} for j ≤ i (0 above), [N·nt·HV, C, C, K] from G [N,T,HV,K]."""
    N, T, HV, K = G.shape
    Gc = G.reshape(N, T // 64, 64, HV, K).transpose(0, 1, 3, 2, 4).reshape(-1, 64, K)
    i = jnp.arange(64)[:, None]
    j = jnp.arange(64)[None, :]
    keep = (j <= i)[None, :, :, None]
    d = Gc[:, :, None, :] - Gc[:, None, :, :]
    return jnp.where(keep, jnp.exp(jnp.where(keep, d, 0.0)), 0.0)


def _chunks(x):  # [N, T, HV, D] -> [N·nt·HV, 64, D] f32
    N, T, HV, D = x.shape
    return x.astype(f32).reshape(N, T // 64, 64, HV, D).transpose(0, 1, 3, 2, 4).reshape(-1, 64, D)


def _unchunk(x, N, T, HV):
    D = x.shape[-1]
    return x.reshape(N, T // 64, HV, 64, D).transpose(0, 1, 3, 2, 4).reshape(N, T, HV, D)


def _kernel_inputs(seed, variant, N, T, H, HV, K, g=None):
    """Realistic kernel inputs: the forward's intermediates recomputed by the kernels themselves
    (``g``: the log-decays, as for :func:`core_case`)."""
    cfg, (q, k, v, G, b, w, h0), (do, dht) = core_case(seed, variant, N, T, H, HV, K, g=g)
    from pallas_kernels.channel.intra import ChannelIntraConfig, channel_intra, reference_rows
    from pallas_kernels.recurrence.chunk_fwd import ChunkFwdConfig, channel_chunk_fwd

    gr, gl = reference_rows(G)
    bk = b.transpose(0, 2, 1) if w is None else b
    icfg = ChannelIntraConfig(scalar_beta=w is None, store_a=True)
    qg, kg, wk, u, aqk, A = channel_intra(q, k, v, G, bk, w, icfg)
    h, vn = channel_chunk_fwd(
        None, kg, wk, u, None, jnp.exp(gl), h0, ChunkFwdConfig(scale=cfg.scale, store_h=True)
    )
    return dict(cfg=cfg, q=q, k=k, v=v, G=G, b=b, w=w, bk=bk, gr=gr, gl=gl, qg=qg, kg=kg, wk=wk,
                aqk=aqk, A=A, h=h, vn=vn, do=do.astype(q.dtype), dht=dht)  # fmt: skip


@functools.cache
def gpu_kernel_inputs(variant, H=4, HV=8):
    """The GPU per-kernel tests' inputs (T 1024, K 128), computed once per process."""
    return _kernel_inputs(2, variant, 1, 1024, H, HV, 128)


def _rep(x, HV):  # GVA: q/k heads repeated to the value heads
    return jnp.repeat(x, HV // x.shape[2], axis=2)


def _kernel_outputs(x, scale, k_split=False):
    """bwd_dh, then bwd_dqkw on its dh/dv2, then bwd_wy on their dw/dv2 (``k_split``: the K-split
    forms of both, K = 128)."""
    from pallas_kernels._tiles import LoopConfig
    from pallas_kernels.channel.bwd_dqkw import channel_bwd_dqkw
    from pallas_kernels.channel.bwd_wy import ChannelBwdWyConfig, channel_bwd_wy
    from pallas_kernels.recurrence.bwd_dh import channel_bwd_dh

    dh, dvh, dvl, dh0 = channel_bwd_dh(
        x["qg"], x["kg"], x["wk"], x["do"], x["aqk"], jnp.exp(x["gl"]), x["dht"],
        LoopConfig(scale=scale),
    )  # fmt: skip
    dq, dk, dwk, dG = channel_bwd_dqkw(
        x["q"], x["k"], x["G"], x["gr"], x["gl"], x["h"], dh, x["vn"], x["do"], dvh, dvl,
        scale=scale, k_split=k_split,
    )  # fmt: skip
    wy = channel_bwd_wy(
        x["k"], x["v"], x["G"], x["gr"], x["gl"], x["bk"], x["w"], x["A"], dwk, dvh, dvl,
        ChannelBwdWyConfig(scalar_beta=x["w"] is None, k_split=k_split),
    )  # fmt: skip
    return dict(dh=dh, dvh=dvh, dvl=dvl, dh0=dh0, dq=dq, dk=dk, dwk=dwk, dG=dG, wy=wy)


def _kernel_refs(x, out, scale):
    """Each kernel's outputs by its formulas in f32 jnp, from the same inputs (jittable)."""
    N, T, HV, K = x["G"].shape
    nt = T // 64
    ref = {}
    # --- bwd_dh: reverse loop
    c5 = lambda a: a.astype(f32).reshape(N, nt, 64, HV, -1)
    qg, kg, wk, do, aqk = (c5(x[n]) for n in ("qg", "kg", "wk", "do", "aqk"))
    egl = jnp.exp(x["gl"])  # [N, HV, nt, K]
    dH = x["dht"]
    dhs, dv2s = [], []
    for c in range(nt - 1, -1, -1):
        dhs.append(dH)
        dv2 = jnp.einsum("nchk,nhkv->nchv", kg[:, c], dH) + scale * jnp.einsum(
            "nihj,nihv->njhv", aqk[:, c], do[:, c]
        )
        dv2s.append(dv2)
        dH = (
            egl[:, :, c, :, None] * dH
            + scale * jnp.einsum("nchk,nchv->nhkv", qg[:, c], do[:, c])
            - jnp.einsum("nchk,nchv->nhkv", wk[:, c], dv2)
        )
    ref["dh"] = jnp.stack(dhs[::-1], 1)
    ref["dv2"] = jnp.stack(dv2s[::-1], 1).reshape(N, T, HV, -1)
    ref["dh0"] = dH
    # --- bwd_dqkw from the kernel's own dh / dv2
    D = _explicit(x["G"])  # [M, C, C, K]
    q, k = _chunks(_rep(x["q"], HV)), _chunks(_rep(x["k"], HV))
    Gc, vn, dox = _chunks(x["G"]), _chunks(x["vn"]), _chunks(x["do"])
    dv2 = _chunks(out["dvh"].astype(f32) + out["dvl"].astype(f32))
    V = x["v"].shape[-1]
    h = x["h"].astype(f32).reshape(-1, K, V)  # [N·nt·HV, K, V] (same chunk-major, head order)
    dhf = out["dh"].astype(f32).reshape(-1, K, V)
    dP = scale * jnp.einsum("miv,mjv->mij", dox, vn) * jnp.tril(jnp.ones((64, 64)))
    dq_w = scale * jnp.exp(Gc) * jnp.einsum("miv,mkv->mik", dox, h)
    dq_w = dq_w + jnp.einsum("mij,mjd,mijd->mid", dP, k, D)
    el = jnp.exp(Gc[:, -1:] - Gc)
    dks = el * jnp.einsum("miv,mkv->mik", vn, dhf)
    dk_w = dks + jnp.einsum("mij,mid,mijd->mjd", dP, q, D)
    dG_w = dq_w * q - dk_w * k
    dG_w = dG_w.at[:, -1].add(jnp.sum(dks * k, axis=1))
    ref["dq"] = _unchunk(dq_w, N, T, HV)
    ref["dk"] = _unchunk(dk_w, N, T, HV)
    ref["dw"] = _unchunk(-jnp.einsum("miv,mkv->mik", dv2, h), N, T, HV)
    ref["dG(qk)"] = _unchunk(dG_w, N, T, HV)
    # --- bwd_wy from the kernel's dw and dv2
    scalar = x["w"] is None
    A = _chunks(x["A"])
    v = _chunks(x["v"])
    if scalar:
        b = wg = _chunks(x["b"][..., None])
    else:
        b, wg = _chunks(x["b"]), _chunks(x["w"])
    bk = b * k
    dwm = _chunks(out["dwk"])
    dA = jnp.einsum("mik,mjk->mij", dwm, bk * jnp.exp(Gc)) + jnp.einsum("miv,mjv->mij", dv2, wg * v)
    dkbg = jnp.einsum("mij,mik->mjk", A, dwm)
    dwv = jnp.einsum("mij,miv->mjv", A, dv2)
    dL = -jnp.einsum("mji,mjk,mlk->mil", A, dA, A) * jnp.tril(jnp.ones((64, 64)), -1)
    dbk = dkbg * jnp.exp(Gc) + jnp.einsum("mij,mjd,mijd->mid", dL, k, D)
    dkl = jnp.einsum("mij,mid,mijd->mjd", dL, bk, D)
    ref["dk(wy)"] = _unchunk(dbk * b + dkl, N, T, HV)
    ref["dv"] = _unchunk(dwv * wg, N, T, HV)
    ref["dG(wy)"] = _unchunk(dbk * bk - dkl * k, N, T, HV)
    if scalar:
        dbe = jnp.sum(dbk * k, -1) + jnp.sum(dwv * v, -1)
        ref["dbeta"] = _unchunk(dbe[..., None], N, T, HV)[..., 0].transpose(0, 2, 1)
    else:
        ref["db"] = _unchunk(dbk * k, N, T, HV)
        ref["dw_gate"] = _unchunk(dwv * v, N, T, HV)
    return ref


def kernel_refs(x, out, scale):
    """:func:`_kernel_refs` on the kernel outputs it reads (dh, dv2 hi/lo, dw), compiled as a
    reference once per scale and input shapes (shared by the per-kernel tests of a process)."""
    out = {name: out[name] for name in ("dh", "dvh", "dvl", "dwk")}
    return cached_jit(_kernel_refs, reference=True, scale=scale)(x, out)


def check_kernels(x, *, tol=2e-2, jit=True, k_split=False):
    """Runs bwd_dh, bwd_dqkw, bwd_wy on ``x`` and compares each output with its formula."""
    x = dict(x)
    scale = x.pop("cfg").scale
    out = _kernel_outputs(x, scale, k_split)
    ref = kernel_refs(x, out, scale)
    wy = out["wy"]
    got = dict(dh=out["dh"], dv2=out["dvh"].astype(f32) + out["dvl"].astype(f32), dh0=out["dh0"],
               dq=out["dq"], dk=out["dk"], dw=out["dwk"])  # fmt: skip
    got["dG(qk)"] = out["dG"]
    got["dk(wy)"], got["dv"], got["dG(wy)"] = wy[:3]
    if x["w"] is None:
        got["dbeta"] = wy[3]
    else:
        got["db"], got["dw_gate"] = wy[3], wy[4]
    report, bad = [], []
    for name, want in ref.items():
        err = rel_rms(got[name], want)
        report.append(f"{name}: {err:.1e}")
        if not err <= tol:
            bad.append(name)
    print("kernels", "; ".join(report), flush=True)
    assert not bad, (bad, "; ".join(report))


@pytest.mark.parametrize("variant", ["gdn2", "kda"])
def test_interpret_kernels(variant):
    with pk.use_mode("interpret"):
        x = run_interpreted(lambda: _kernel_inputs(1, variant, 1, 128, 1, 2, 64))
        run_interpreted(lambda: check_kernels(x, jit=False))


def block_decays(N, T, HV, K):
    """Log-decays per token that differ strongly between the 16-row blocks of a chunk and between
    key channels: channel d decays by −[0, 0.05, 0.5, 10][(t // 16 + d) % 4] at token t (10: the
    op's clamp), [N, T, HV, K]."""
    t, d = np.arange(T)[:, None], np.arange(K)[None, :]
    g = -np.array([0.0, 0.05, 0.5, 10.0])[(t // 16 + d) % 4]
    return np.broadcast_to(g[None, :, None, :], (N, T, HV, K)).copy()


@pytest.mark.parametrize(
    "variant,K,k_split", [("gdn2", 64, False), ("kda", 64, False), ("gdn2", 128, True)]
)
def test_interpret_kernels_block_decays(variant, K, k_split):
    """The decayed products factor e^{G_i − G_j} around one reference row per 16-row block, with
    the rows outside a block's triangle masked: per-channel decays that change from block to
    block (down to the clamp, where an unmasked factor overflows) catch a wrong reference or
    mask. K = 128 with k_split: the K-split dq/dk/dw and WY kernels."""
    with pk.use_mode("interpret"):
        g = block_decays(1, 128, 2, K)
        x = run_interpreted(lambda: _kernel_inputs(5, variant, 1, 128, 1, 2, K, g=g))
        run_interpreted(lambda: check_kernels(x, jit=False, k_split=k_split))


@pytest.mark.gpu
@pytest.mark.slow  # quick: each kernel end to end, through every gradient of the op tests
@pytest.mark.parametrize("variant", ["kda", "gdn2"])
def test_gpu_kernels(variant):
    x = gpu_kernel_inputs(variant)
    check_kernels(x)


# The split forms' GPU checks (their modules hold the checks and the CPU tests), here so that they
# reuse this module's per-kernel inputs, compiled kernels and references in one worker.


@pytest.mark.gpu
@pytest.mark.slow  # quick: both forms end to end, k_split in test_channel_pallas.py's DENSE cases
# (K = V = 128, GVA), one_cta in its PACKED ones (K != V), every gradient under the 2x rule
@pytest.mark.parametrize("variant,H,HV", [("kda", 4, 8), ("gdn2", 8, 8)])
def test_gpu_ksplit_dqkw(variant, H, HV):
    """K-split dq/dk/dw against the one-CTA form and the formulas, with and without GVA."""
    from test_channel_ksplit_dqkw import check_ksplit

    check_ksplit(gpu_kernel_inputs(variant, H, HV), tol_split=1e-2, tol_ref=2e-2)


@pytest.mark.gpu
@pytest.mark.slow  # quick: the K-split WY in the DENSE op cases, the unsplit one in the PACKED ones
@pytest.mark.parametrize("variant", ["kda", "gdn2"])
def test_gpu_ksplit_wy(variant):
    """K-split WY backward against the unsplit kernel and the formulas (tolerance 2e-2)."""
    from test_channel_ksplit_wy import check_split

    check_split(gpu_kernel_inputs(variant), tol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("gate_scale", [1.0, 10.0])
@pytest.mark.parametrize("variant", ["kda", "gdn2"])
def test_gpu_intra(variant, gate_scale):
    """The intra kernel against the formulas, with GVA, at per-channel log-decays in [−1, 0]
    and in [−10, 0] (factors up to e^{±80} inside the diagonal blocks)."""
    from test_channel_intra import TOL, _inputs, check_intra

    check_intra(_inputs(2, variant, 1024, 4, 8, 128, gate_scale=gate_scale), tol=TOL)
