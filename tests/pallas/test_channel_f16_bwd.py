"""f16 io in the channel-decay backward kernels ``channel_bwd_dqkw`` and ``channel_bwd_wy``.

docs/design.md: with f16 io the decayed "rows"/"cols" products
(:mod:`pallas_kernels.channel.bwd_decay`) stage both operands as bf16 hi/lo pairs (the factored
operands reach ``e^{8 d}``, far beyond f16's 65504), and bwd_dqkw stages the f32 states h and dh as
f16 with one scale per row (scaled f16 staging). Checked here:

- CPU interpreter at tiny shapes against the kernels' formulas in f32 jnp
  (:func:`test_channel_pallas_bwd._kernel_refs`) on the same f16 inputs, with log-decays of −5 per
  token (the factored operands then exceed f16's range: asserted on the inputs) and 0, and f32
  states whose rows span 2^-12 … 2^17 (beyond f16's range: asserted);
- the CUDA lowering of the f16 forms within the per-form shared-memory limits, and the forms
  that cannot serve f16 raising NotImplementedError;
- GPU (H200, not run on CPU): realistic shapes, the same references.

Tolerance (relative RMS, every output): 2e-3. The kernels' own errors are the f16 roundings of
the staged states (2^-11 relative per row), of the non-factored f16 operands (bk e^G, w_gate v,
dA hi/lo) and of the f16 outputs (dq without GVA, dw, dv): 1e-4 … 3e-4 measured on the
interpreter; the hi/lo products add ~2^-16. A single bf16 rounding of D (the bf16 io kernels,
checked at 2e-2 in test_channel_pallas_bwd) is 2^-9 ≈ 2e-3 relative; staging the factored
operands in plain f16 gives inf (asserted in :func:`test_inputs_exceed_f16`: they exceed 65504).
Per-channel decays that change strongly from one 16-row block to the next
(:func:`test_interpret_block_decays`) check the products' per-block references and masks.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gdn_cases import compiled, run_interpreted, smem_limit, smem_per_cta
from test_channel_ksplit_dqkw import _shapes as dqkw_shapes
from test_channel_pallas_bwd import _kernel_refs, kernel_refs

from gdn_jax.ops import _channel_pallas as cpm
from gdn_jax.testing import rel_rms
from pallas_kernels import _compat as pk
from pallas_kernels.channel.bwd_dqkw import channel_bwd_dqkw
from pallas_kernels.channel.bwd_wy import ChannelBwdWyConfig, channel_bwd_wy
from pallas_kernels.channel.intra import reference_rows

f32, f16 = jnp.float32, jnp.float16
F16_MAX = 65504.0
TOL = 2e-3
DQKW_OUTS = ("dq", "dk", "dw", "dG(qk)")


def _hi_lo(x):
    hi = x.astype(f16)
    return hi, (x - hi.astype(f32)).astype(f16)


def f16_inputs(seed, variant, T, H, HV, K, g_val, *, wide_state=True, big_da=False, V=None,
               g=None):  # fmt: skip
    """Kernel inputs in f16 io (V = K unless given, one sequence): q, k, v, do, v_new, dv2 hi/lo,
    A, dw f16; G (chunk-local cumsum of the log-decays ``g`` [1, T, HV, K] if given, else of a
    constant log-decay ``g_val``, or uniform in [−1, 0] for None), gates and the states h, dh
    f32. ``wide_state``: the state rows are scaled by 2^e, e uniform in [−12, 17] (f16 would
    overflow and flush them); else N(0, 1) states. ``big_da``: v × 16 and dv2, dw × 2^8, so that
    bwd_wy's f32 gradient dA exceeds f16's range (its outputs stay inside).

    Returns the dict :func:`_kernel_refs` reads (its bwd_dh part gets zero placeholders) and
    ``out`` with dh, dv2 hi/lo and dw."""
    r = np.random.default_rng(seed)
    N, V, nt = 1, K if V is None else V, T // 64
    nrm = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    arr = lambda a, dt=f16: jnp.asarray(a, dt)
    q = arr(nrm(r.standard_normal((N, T, H, K))))
    k = arr(nrm(r.standard_normal((N, T, H, K))))
    v = arr((16.0 if big_da else 1.0) * r.standard_normal((N, T, HV, V)))
    if g is None:
        g = r.uniform(-1, 0, (N, T, HV, K)) if g_val is None else np.full((N, T, HV, K), g_val)
    G = cpm.lane_gate_cumsum(jnp.asarray(g, f32))
    gr, gl = reference_rows(G)
    if variant == "kda":
        b, w = arr(r.uniform(0, 1, (N, T, HV)), f32), None
        bk = b.transpose(0, 2, 1)
    else:
        b = bk = arr(r.uniform(0, 1, (N, T, HV, K)), f32)
        w = arr(r.uniform(0, 1, (N, T, HV, V)), f32)

    def state():
        s = r.standard_normal((N, nt, HV, K, V))
        if wide_state:
            s = s * 2.0 ** r.uniform(-12, 17, (N, nt, HV, K, 1))
        return arr(s, f32)

    h, dh = state(), state()
    # the state products' outputs stay inside f16 (dw, and dq without GVA, leave in f16): small
    # cotangents against the wide states
    amp = 2.0**-8 if wide_state else 1.0
    amp_do = amp if HV == H else 1.0
    cot = 2.0**8 if big_da else 1.0
    dv2 = arr(cot * amp * r.standard_normal((N, T, HV, V)), f32)
    dvh, dvl = _hi_lo(dv2)
    # A = (I + L)⁻¹ per chunk: unit lower triangular, moderate entries
    eye = np.eye(64)
    L = np.tril(0.3 * r.standard_normal((N, nt, HV, 64, 64)), -1)
    A = np.linalg.inv(eye + L).transpose(0, 1, 3, 2, 4).reshape(N, T, HV, 64)
    zeros = lambda *s: jnp.zeros(s, f16)
    x = dict(
        q=q, k=k, v=v, G=G, gr=gr, gl=gl, b=b, w=w, bk=bk, h=h,
        vn=arr(r.standard_normal((N, T, HV, V))),
        do=arr(amp_do * r.standard_normal((N, T, HV, V))),
        A=arr(A),
        # bwd_dh's inputs: unused here (_kernel_refs forms its reference too)
        qg=zeros(N, T, HV, K), kg=zeros(N, T, HV, K), wk=zeros(N, T, HV, K),
        aqk=zeros(N, T, HV, 64), dht=jnp.zeros((N, HV, K, V), f32),
    )  # fmt: skip
    out = dict(dh=dh, dvh=dvh, dvl=dvl, dwk=arr(0.1 * cot * r.standard_normal((N, T, HV, K))))
    return x, out


def factored_max(G) -> float:
    """The largest decay factor the staged operands carry: e^{r_I − G_j} (the "rows" product)
    and e^{G_j − r_I} (the "cols" product) for rows j of block I, r_I = G at row 16 I + 8."""
    N, T, HV, K = G.shape
    Gc = np.asarray(G, np.float64).reshape(N, T // 64, 64, HV, K)
    m = 0.0
    for i in range(4):
        ref = Gc[:, :, 16 * i + 8][:, :, None]
        blk = Gc[:, :, 16 * i : 16 * (i + 1)]
        m = max(m, float(np.exp(ref - blk).max()), float(np.exp(blk - ref).max()))
    return m


def _dqkw(x, out, scale, *, k_split):
    o = channel_bwd_dqkw(
        x["q"], x["k"], x["G"], x["gr"], x["gl"], x["h"], out["dh"], x["vn"], x["do"],
        out["dvh"], out["dvl"], scale=scale, k_split=k_split,
    )  # fmt: skip
    return dict(zip(DQKW_OUTS, o, strict=True))


def _wy(x, out, *, k_split):
    cfg = ChannelBwdWyConfig(scalar_beta=x["w"] is None, k_split=k_split)
    return channel_bwd_wy(
        x["k"], x["v"], x["G"], x["gr"], x["gl"], x["bk"], x["w"], x["A"], out["dwk"],
        out["dvh"], out["dvl"], cfg,
    )  # fmt: skip


def _compare(tag, got: dict, ref: dict, tol: float):
    report, bad = [], []
    for name, val in got.items():
        err = rel_rms(val, ref[name])
        report.append(f"{name}: {err:.1e}")
        if not err <= tol:
            bad.append(name)
    print(tag, "; ".join(report), flush=True)
    assert not bad, (bad, "; ".join(report))


def check_dqkw(x, out, *, k_split, tol=TOL, jit=True):
    scale = x["q"].shape[-1] ** -0.5
    run = compiled(_dqkw, jit=jit, scale=scale, k_split=k_split)
    got = run(x, out)
    HV, H = x["v"].shape[2], x["q"].shape[2]
    assert got["dq"].dtype == (f16 if HV == H else f32) and got["dw"].dtype == f16
    ref = kernel_refs(x, out, scale)
    _compare(f"dqkw {k_split=}", got, ref, tol)


def wy_names(scalar):
    return ("dk(wy)", "dv", "dG(wy)") + (("dbeta",) if scalar else ("db", "dw_gate"))


def check_wy(x, out, *, k_split, tol=TOL, jit=True):
    scale = x["q"].shape[-1] ** -0.5
    got = compiled(_wy, jit=jit, k_split=k_split)(x, out)
    assert got[1].dtype == f16
    ref = kernel_refs(x, out, scale)
    names = wy_names(x["w"] is None)
    _compare(f"wy {k_split=}", dict(zip(names, got, strict=True)), ref, tol)


# ------------------------------------------------------------------------------------------------
# CPU: the inputs really are out of f16's range


def test_inputs_exceed_f16():
    """At −5 per token the factored operands reach e^{40}: staged in plain f16 they would be
    inf (hence bf16 hi/lo pairs); the wide states overflow f16 too (hence scaled staging)."""
    x, out = f16_inputs(0, "kda", 128, 1, 1, 64, -5.0)
    assert factored_max(x["G"]) > 1e17  # e^{8·5} ≈ 2.4e17; × |k| ≥ 1e-3 still ≫ 65504
    assert factored_max(x["G"]) * float(jnp.max(jnp.abs(x["k"].astype(f32)))) > F16_MAX
    assert float(jnp.max(jnp.abs(x["h"]))) > F16_MAX
    assert float(jnp.max(jnp.abs(out["dh"]))) > F16_MAX
    x0, _ = f16_inputs(0, "kda", 128, 1, 1, 64, 0.0)
    assert factored_max(x0["G"]) == 1.0


# ------------------------------------------------------------------------------------------------
# CPU: Mosaic GPU interpreter


@pytest.mark.parametrize(
    "HV,g_val,wide,k_split",
    [
        (1, -5.0, False, False),  # f16 dq, N(0, 1) states
        (1, -5.0, False, True),
        (2, 0.0, True, False),  # GVA (f32 dq), wide states
        (2, -5.0, True, True),
    ],
)
def test_interpret_dqkw_k64(HV, g_val, wide, k_split):
    """K = 64: the one-CTA form, and (k_split, f16 only) the split form's phased body on one
    CTA per (chunk, value head)."""
    x, out = f16_inputs(1, "kda", 128, 1, HV, 64, g_val, wide_state=wide)
    run_interpreted(lambda: check_dqkw(x, out, k_split=k_split, jit=False))


@pytest.mark.parametrize(
    "HV,g_val,wide,V",
    [(1, -5.0, False, 128), (2, 0.0, True, 128), (2, -5.0, True, 128), (1, -5.0, True, 64),
     (2, 0.0, False, 64)],
)  # fmt: skip
def test_interpret_dqkw_ksplit_k128(HV, g_val, wide, V):
    """K = 128: the K-split form (two CTAs per chunk and value head, each with all V columns)."""
    x, out = f16_inputs(2, "gdn2", 64, 1, HV, 128, g_val, wide_state=wide, V=V)
    run_interpreted(lambda: check_dqkw(x, out, k_split=True, jit=False))


@pytest.mark.parametrize("variant,HV,g_val", [("kda", 1, -5.0), ("gdn2", 2, 0.0)])
def test_interpret_wy_k64(variant, HV, g_val):
    x, out = f16_inputs(3, variant, 128, 1, HV, 64, g_val)
    run_interpreted(lambda: check_wy(x, out, k_split=False, jit=False))


@pytest.mark.parametrize("variant,K,k_split", [("kda", 64, False), ("gdn2", 128, True)])
def test_interpret_block_decays(variant, K, k_split):
    """Per-channel log-decays that change strongly from one 16-row block to the next, down to
    the clamp (:func:`test_channel_pallas_bwd.block_decays`): the decayed products' per-block
    references and masks, with D and the factored operands as bf16 hi/lo pairs."""
    from test_channel_pallas_bwd import block_decays

    T = 128 if K == 64 else 64
    g = block_decays(1, T, 1, K)
    x, out = f16_inputs(8, variant, T, 1, 1, K, None, wide_state=False, g=g)
    assert factored_max(x["G"]) > F16_MAX
    run_interpreted(lambda: check_dqkw(x, out, k_split=k_split, jit=False))
    run_interpreted(lambda: check_wy(x, out, k_split=k_split, jit=False))


@pytest.mark.parametrize(
    "variant,HV,g_val,V",
    [("gdn2", 1, -5.0, 128), ("kda", 2, 0.0, 128), ("gdn2", 2, 0.0, 64), ("kda", 1, -5.0, 64)],
)  # fmt: skip
def test_interpret_wy_ksplit_k128(variant, HV, g_val, V):
    """K = 128: the K-split form; at V = 64 both CTAs form dA's V part whole and the first
    K-half's writes dv, dw_gate (KDA: its partial dβ alone holds the V part)."""
    x, out = f16_inputs(4, variant, 64, 1, HV, 128, g_val, V=V)
    run_interpreted(lambda: check_wy(x, out, k_split=True, jit=False))


def _da_max(x, out) -> float:
    """max |dA| (bwd_wy's f32 gradient of A, staged through an f16 tile) over all chunks."""
    from test_channel_pallas_bwd import _chunks, _rep

    HV = x["v"].shape[2]
    k, G, v = _chunks(_rep(x["k"], HV)), _chunks(x["G"]), _chunks(x["v"])
    if x["w"] is None:
        b = wg = _chunks(x["b"][..., None])
    else:
        b, wg = _chunks(x["b"]), _chunks(x["w"])
    dv2 = _chunks(out["dvh"].astype(f32) + out["dvl"].astype(f32))
    dA = jnp.einsum("mik,mjk->mij", _chunks(out["dwk"]), b * k * jnp.exp(G))
    dA = dA + jnp.einsum("miv,mjv->mij", dv2, wg * v)
    return float(jnp.max(jnp.abs(dA)))


@pytest.mark.parametrize("variant,K,k_split", [("kda", 64, False), ("gdn2", 128, True)])
def test_interpret_wy_large_dA(variant, K, k_split):
    """dA beyond f16's range: staged per row (and dA Aᵀ per column) into it."""
    T = 128 if K == 64 else 64
    x, out = f16_inputs(7, variant, T, 1, 1, K, -5.0, wide_state=False, big_da=True)
    assert _da_max(x, out) > F16_MAX
    run_interpreted(lambda: check_wy(x, out, k_split=k_split, jit=False))


def test_interpret_negative_controls(monkeypatch):
    """The tolerance catches the plain-f16 stagings these replace: factored operands
    and D staged in f16 (no bf16 hi/lo staging) give inf at −5 per token; dA staged unscaled (the
    scales forced to 1) gives inf when dA exceeds 65504."""
    import pallas_kernels.channel.bwd_dqkw as dqkw_mod
    import pallas_kernels.channel.bwd_wy as wy_mod

    x, out = f16_inputs(1, "kda", 128, 1, 1, 64, -5.0, wide_state=False)
    scale = 64**-0.5
    with monkeypatch.context() as m:
        m.setattr(dqkw_mod, "operand_dtype", lambda dt: dt)
        got = run_interpreted(lambda: _dqkw(x, out, scale, k_split=False))
    ref = _kernel_refs(x, out, scale)
    assert rel_rms(got["dq"], ref["dq"]) > TOL and rel_rms(got["dk"], ref["dk"]) > TOL

    x, out = f16_inputs(7, "kda", 128, 1, 1, 64, -5.0, wide_state=False, big_da=True)

    def unit_scales(v, axis):
        one = jnp.max(jnp.abs(v), axis=axis) * 0.0 + 1.0
        return one, one

    with monkeypatch.context() as m:
        m.setattr(wy_mod, "f16_stage_scales", unit_scales)
        got = run_interpreted(lambda: _wy(x, out, k_split=False))
    ref = _kernel_refs(x, out, scale)
    assert rel_rms(got[0], ref["dk(wy)"]) > TOL


# ------------------------------------------------------------------------------------------------
# CPU: the real GPU lowering (layout inference, wgmma operand dtypes, SMEM budget)


def _dqkw_shapes(B, T, H, HV, K, V):
    """channel_bwd_dqkw's inputs with f16 io (h and dh f32)."""
    return dqkw_shapes(B, T, H, HV, K, f16, V=V, state_dt=f32)


def _lowers(f, args, limit, name):
    with pk.cuda_lowering_mesh(), smem_limit(limit):
        txt = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = [ln for ln in txt.splitlines() if "custom_call @mosaic_gpu" in ln]
    assert len(calls) == 1 and re.search(rf"\\00{name}\\00", calls[0]), len(calls)


# The planned f16 forms (K-split at K = 128, phased at K = 64, the WY K-split for KDA) lower within
# their budgets with the op: test_channel_pallas.py::test_lowers_for_cuda. Here: the forms its
# pairwise cases do not reach.
@pytest.mark.parametrize("V", [64, 128])
def test_dqkw_one_cta_k64_lowers(V):
    """K = 64 without k_split: the one-CTA form with the f16 tiles lowers in one SM."""
    f = functools.partial(channel_bwd_dqkw, scale=0.125, k_split=False)
    _lowers(f, _dqkw_shapes(1, 192, 2, 4, 64, V), smem_per_cta(1), "chan_bwd_dqkw")


def test_dqkw_unsplit_k128_not_implemented():
    with pytest.raises(NotImplementedError, match="k_split"):
        jax.eval_shape(
            functools.partial(channel_bwd_dqkw, scale=0.125), *_dqkw_shapes(1, 128, 1, 1, 128, 128)
        )


def _wy_shapes(B, T, H, HV, K, V, scalar):
    S = jax.ShapeDtypeStruct
    k, v = S((B, T, H, K), f16), S((B, T, HV, V), f16)
    G, gr, gl = S((B, T, HV, K), f32), S((B, HV, T // 16, K), f32), S((B, HV, T // 64, K), f32)
    b = S((B, HV, T), f32) if scalar else S((B, T, HV, K), f32)
    w = None if scalar else S((B, T, HV, V), f32)
    A, dw, du = S((B, T, HV, 64), f16), S((B, T, HV, K), f16), S((B, T, HV, V), f16)
    return k, v, G, gr, gl, b, w, A, dw, du, du


@pytest.mark.parametrize("V", [128, 64])
def test_gdn2_wy_ksplit_lowers(V):
    """GDN2, K = 128, k_split: two CTAs per SM (Mosaic's count: 110 744 B at V = 128, 110 712 B
    at V = 64)."""
    cfg = ChannelBwdWyConfig(scalar_beta=False, k_split=True)
    f = lambda *a: channel_bwd_wy(*a, cfg)
    _lowers(f, _wy_shapes(1, 128, 2, 4, 128, V, False), smem_per_cta(2), "chan_bwd_wy")


@pytest.mark.parametrize("V", [64, 128])
def test_kda_wy_k64_lowers(V):
    """KDA, K = 64, the unsplit form: one CTA per SM with the f16 staging tiles."""
    cfg = ChannelBwdWyConfig(scalar_beta=True)
    f = lambda *a: channel_bwd_wy(*a, cfg)
    _lowers(f, _wy_shapes(1, 128, 2, 4, 64, V, True), smem_per_cta(1), "chan_bwd_wy")


def test_wy_unsplit_k128_not_implemented():
    cfg = ChannelBwdWyConfig(scalar_beta=True)
    with pytest.raises(NotImplementedError, match="k_split"):
        jax.eval_shape(
            lambda *a: channel_bwd_wy(*a, cfg), *_wy_shapes(1, 128, 1, 1, 128, 128, True)
        )


# ------------------------------------------------------------------------------------------------
# GPU (H200): realistic shapes (not run on CPU)


# GPU: the forms the op runs (K-split at K = 128, the phased form at K = 64), GVA,
# -5 per token and random gates; the interpreter tests above cover the rest of the grid.
@pytest.mark.gpu
@pytest.mark.parametrize("g_val", [-5.0, None])
@pytest.mark.parametrize("K", [128, 64])
def test_gpu_dqkw_f16(K, g_val):
    x, out = f16_inputs(5, "kda", 1024, 4, 8, K, g_val, wide_state=True)
    check_dqkw(x, out, k_split=True)


@pytest.mark.gpu
@pytest.mark.parametrize("g_val", [-5.0, None])
@pytest.mark.parametrize("variant", ["kda", "gdn2"])
@pytest.mark.parametrize("K", [128, 64])
def test_gpu_wy_f16(K, variant, g_val):
    x, out = f16_inputs(6, variant, 1024, 4, 8, K, g_val)
    check_wy(x, out, k_split=K == 128)
