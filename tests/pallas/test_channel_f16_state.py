"""f16 io in the channel-decay state loops: ``channel_chunk_fwd`` (forward and ``store_h``,
:mod:`pallas_kernels.recurrence.chunk_fwd`) and ``channel_bwd_dh``
(:mod:`pallas_kernels.recurrence.bwd_dh`).

With f16 io the f32 state S (forward) and state gradient dH (backward) are staged as the f16 B
operand of their products with one scale per V column (docs/design.md: never through plain f16, max
65504), and the per-chunk h / dh are written in f32. Checked here:

- numerics (CPU interpreter, tiny shapes): each kernel against its stage equations in f32 jnp,
  from the same f16 inputs (the intra stage's outputs qg, kg, w, u, Aqk by their formulas,
  :func:`test_channel_intra._refs`, rounded to f16), with per-token log-decay −5 on every
  channel, no decay, random decays, GVA and a zero-padded partial chunk; and a large-state case
  (state / state gradient ~1e5) where the reference with plain f16 staging is not finite;
- the CUDA lowering of the f16 kernels within an SM's shared memory, and NotImplementedError for
  the forms that do not fit;
- the bf16 kernels trace to the jaxprs they had before f16 support (pinned hashes);
- GPU (``-m gpu``, H200): the same checks at a realistic shape.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gdn_cases import cached_jit, compiled, run_interpreted, smem_limit, smem_per_cta
from test_channel_intra import _refs as _intra_refs

from gdn_jax.ops import _channel_pallas as cpm
from gdn_jax.testing import rel_rms
from pallas_kernels import _compat as pk
from pallas_kernels._tiles import LoopConfig
from pallas_kernels.channel.intra import reference_rows
from pallas_kernels.recurrence.bwd_dh import channel_bwd_dh
from pallas_kernels.recurrence.chunk_fwd import ChunkFwdConfig, channel_chunk_fwd

f32, f16, bf16 = jnp.float32, jnp.float16, jnp.bfloat16
HI = jax.lax.Precision.HIGHEST  # the GPU's default f32 matmul is TF32: the oracle must not be
F16_MAX = 65504.0
# Relative RMS against the f32 stage equations from the same f16 inputs. f16 operands (11-bit
# significands, the state's relative to its column's amax) and f32 accumulation: the interpreter
# measures ≤ 3.4e-4 (o, v_new, dv2 rounded to f16 and re-used). On the GPU, 32 chunks of
# accumulated rounding: 5e-3. Plain f16 staging of the large state gives inf (the control).
TOL = 2e-3
GPU_TOL = 5e-3


# ------------------------------------------------------------------------------------------------
# Inputs and the stage equations in f32


def stage_inputs(seed, variant, N, T, H, HV, K, *, g_val=None, gate_scale=1.0, valid=None):
    """The chunk loops' f16 inputs, from the intra stage's formulas in f32.

    q, k unit rows, v normal (rounded to f16), per-channel log-decays uniform in
    [−gate_scale, 0] (or all ``g_val``), gates in [0, 1]. ``valid``: tokens from ``valid`` on
    are padding as the glue makes it (zero q, k, v; the cumulative gate repeats its last valid
    value), so the last chunk is partial. V = K.

    Returns:
      dict: qg, kg, w, u, aqk [N, T, HV, K or 64] f16; egl [N, HV, T/64, K] f32 (e^{G_last}).
    """
    r = np.random.default_rng(seed)
    nrm = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q, k = nrm(r.standard_normal((N, T, H, K))), nrm(r.standard_normal((N, T, H, K)))
    v = r.standard_normal((N, T, HV, K))
    if g_val is None:
        g = -gate_scale * r.uniform(0, 1, (N, T, HV, K))
    else:
        g = np.full((N, T, HV, K), g_val)
    if valid is not None:
        for x in (q, k, v, g):
            x[:, valid:] = 0.0
    G = cpm.lane_gate_cumsum(jnp.asarray(g, f32))
    q, k, v = (jnp.asarray(x, f16) for x in (q, k, v))
    if variant == "kda":
        b, w = jnp.asarray(r.uniform(0, 1, (N, HV, T)), f32), None
    else:
        b = jnp.asarray(r.uniform(0, 1, (N, T, HV, K)), f32)
        w = jnp.asarray(r.uniform(0, 1, (N, T, HV, K)), f32)
    ref = _intra_refs((q, k, v, G, b, w))
    x = {n: ref[n].astype(f16) for n in ("qg", "kg", "w", "u", "aqk")}
    x["egl"] = jnp.exp(reference_rows(G)[1])
    return x


def _c5(a, nt):  # [N, T, HV, D] -> [N, nt, 64, HV, D] f32
    N, T, HV, D = a.shape
    return a.astype(f32).reshape(N, nt, 64, HV, D)


def _plain_f16(x):
    """What casting an f32 operand to f16 leaves of it (inf beyond 65504)."""
    return x.astype(f16).astype(f32)


def fwd_ref(x, h0, scale, *, plain_f16=False):
    """chunk_fwd's equations in f32: (o, final state, h, v_new), o / v_new [N, T, HV, V], h
    [N, T/64, HV, K, V]. ``plain_f16``: the state operand of ``w S`` and ``qg S`` cast to f16
    (the staging docs/design.md rules out; the negative control)."""
    N, T, HV, K = x["kg"].shape
    nt = T // 64
    qg, kg, w, u, aqk = (_c5(x[n], nt) for n in ("qg", "kg", "w", "u", "aqk"))
    mm = functools.partial(jnp.einsum, precision=HI)
    S, hs, os_, vns = h0, [], [], []
    for c in range(nt):
        hs.append(S)
        Sb = _plain_f16(S) if plain_f16 else S
        vn = u[:, c] - mm("nihk,nhkv->nihv", w[:, c], Sb)
        o = scale * (mm("nihk,nhkv->nihv", qg[:, c], Sb) + mm("nihj,njhv->nihv", aqk[:, c], vn))
        S = x["egl"][:, :, c, :, None] * S + mm("nihk,nihv->nhkv", kg[:, c], vn)
        os_.append(o)
        vns.append(vn)
    flat = lambda a: jnp.stack(a, 1).reshape(N, T, HV, -1)  # noqa: E731
    return flat(os_), S, jnp.stack(hs, 1), flat(vns)


def dh_ref(x, do, dht, scale, *, plain_f16=False):
    """bwd_dh's equations in f32: (dh [N, T/64, HV, K, V], dv2 [N, T, HV, V], dh0).
    ``plain_f16``: dH cast to f16 as the operand of ``kg dH`` (the negative control)."""
    N, T, HV, K = x["kg"].shape
    nt = T // 64
    qg, kg, w, aqk, dos = (_c5(a, nt) for a in (x["qg"], x["kg"], x["w"], x["aqk"], do))
    mm = functools.partial(jnp.einsum, precision=HI)
    dH, dhs, dv2s = dht, [], []
    for c in range(nt - 1, -1, -1):
        dhs.append(dH)
        dHb = _plain_f16(dH) if plain_f16 else dH
        dv2 = mm("nihk,nhkv->nihv", kg[:, c], dHb) + scale * mm(
            "nihj,nihv->njhv", aqk[:, c], dos[:, c]
        )
        dH = (
            x["egl"][:, :, c, :, None] * dH
            + scale * mm("nihk,nihv->nhkv", qg[:, c], dos[:, c])
            - mm("nihk,nihv->nhkv", w[:, c], dv2)
        )
        dv2s.append(dv2)
    return jnp.stack(dhs[::-1], 1), jnp.stack(dv2s[::-1], 1).reshape(N, T, HV, -1), dH


# ------------------------------------------------------------------------------------------------
# Kernel runs and checks


def run_fwd(x, h0, scale, block_v=64):
    """Both modes of chunk_fwd: (o, final, h, v_new)."""
    o, ht = channel_chunk_fwd(
        x["qg"], x["kg"], x["w"], x["u"], x["aqk"], x["egl"], h0,
        ChunkFwdConfig(scale=scale, block_v=block_v),
    )  # fmt: skip
    h, vn = channel_chunk_fwd(
        None, x["kg"], x["w"], x["u"], None, x["egl"], h0,
        ChunkFwdConfig(scale=scale, block_v=block_v, store_h=True),
    )  # fmt: skip
    return o, ht, h, vn


def run_dh(x, do, dht, scale, block_v=64):
    """bwd_dh: (dh, dv2 = hi + lo in f32, dh0), after checking the output dtypes."""
    dh, dvh, dvl, dh0 = channel_bwd_dh(
        x["qg"], x["kg"], x["w"], do, x["aqk"], x["egl"], dht,
        LoopConfig(scale=scale, block_v=block_v),
    )  # fmt: skip
    assert (dh.dtype, dvh.dtype, dvl.dtype, dh0.dtype) == (f32, f16, f16, f32)
    return dh, dvh.astype(f32) + dvl.astype(f32), dh0


def _compare(tag, names, got, ref, tol):
    report = [f"{n}: {rel_rms(a, b):.1e}" for n, a, b in zip(names, got, ref, strict=True)]
    print(tag, "; ".join(report), flush=True)
    bad = [n for n, a, b in zip(names, got, ref, strict=True) if not rel_rms(a, b) <= tol]
    assert not bad, (bad, "; ".join(report))


FWD_NAMES = ("o", "final", "h", "v_new")
DH_NAMES = ("dh", "dv2", "dh0")


def check_fwd(x, h0, scale, *, tol=TOL, block_v=64, jit=True):
    run = compiled(run_fwd, jit=jit, scale=scale, block_v=block_v)
    ref_fn = cached_jit(fwd_ref, reference=True, scale=scale)
    got, ref = run(x, h0), ref_fn(x, h0)
    o, ht, h, vn = got
    assert (o.dtype, ht.dtype, h.dtype, vn.dtype) == (f16, f32, f32, f16)
    _compare("chunk_fwd f16", FWD_NAMES, got, ref, tol)
    return ref


def check_dh(x, do, dht, scale, *, tol=TOL, block_v=64, jit=True):
    run = compiled(run_dh, jit=jit, scale=scale, block_v=block_v)
    ref_fn = cached_jit(dh_ref, reference=True, scale=scale)
    got, ref = run(x, do, dht), ref_fn(x, do, dht)
    _compare("bwd_dh f16", DH_NAMES, got, ref, tol)
    return ref


def _states(seed, N, HV, K, amp):
    """h0 / dht [N, HV, K, V] f32: normal, times ``amp``, each V column further scaled by
    10^U(−1, 0) (columns of different magnitudes: one scale per column)."""
    r = np.random.default_rng(seed)
    col = 10.0 ** r.uniform(-1, 0, (N, HV, 1, K))
    return jnp.asarray(amp * col * r.standard_normal((N, HV, K, K)), f32)


def _do(seed, N, T, HV, K):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((N, T, HV, K)), f16)


def large_state_inputs(seed, N, T, HV, K, variant="kda"):
    """A state and a state gradient of ~1e5 (far beyond f16's 65504) with outputs that fit f16:
    no decay (the state keeps its size over the chunks), w and the q side (qg, Aqk) scaled by
    1e-3 / 1e-2 (the state is mostly carried and read, like a small β and small queries), and kg
    by 1e-2 in the backward (dv2 = kg dH + … is an f16 output)."""
    x = stage_inputs(seed, variant, N, T, 1, HV, K, g_val=0.0)
    x = dict(x, w=x["w"] * f16(1e-3), qg=x["qg"] * f16(1e-2), aqk=x["aqk"] * f16(1e-2))
    xb = dict(x, kg=x["kg"] * f16(1e-2))
    return x, xb, _states(seed + 1, N, HV, K, 1e5), _states(seed + 2, N, HV, K, 1e5)


def check_large_state(x, xb, h0, dht, do, scale, *, tol=TOL, jit=True):
    """Both kernels on the large state, and the negative control: the same equations with the
    state (gradient) operand cast to plain f16 are not finite, so they fail the tolerance."""
    ref = check_fwd(x, h0, scale, tol=tol, jit=jit)
    assert float(jnp.max(jnp.abs(ref[2]))) > 2 * F16_MAX  # h: the staged operand
    assert 1.0 < float(jnp.max(jnp.abs(ref[0]))) < F16_MAX  # o: not negligible, fits f16
    plain = cached_jit(fwd_ref, reference=True, scale=scale, plain_f16=True)(x, h0)
    assert not rel_rms(plain[0], ref[0]) <= tol  # o through plain f16 staging
    rdh = check_dh(xb, do, dht, scale, tol=tol, jit=jit)
    assert float(jnp.max(jnp.abs(rdh[0]))) > 2 * F16_MAX
    assert 1.0 < float(jnp.max(jnp.abs(rdh[1]))) < F16_MAX  # dv2 fits f16
    plain = cached_jit(dh_ref, reference=True, scale=scale, plain_f16=True)(xb, do, dht)
    assert not rel_rms(plain[1], rdh[1]) <= tol  # dv2 through plain f16 staging


# ------------------------------------------------------------------------------------------------
# CPU: Mosaic GPU interpreter (tiny shapes)

CPU_CASES = [
    # variant, H, HV, K, T, g_val, valid
    pytest.param("gdn2", 1, 1, 64, 128, None, None, id="random-gates"),
    pytest.param("kda", 1, 2, 64, 192, -5.0, 150, id="decay5-gva-partial"),
    pytest.param("gdn2", 1, 1, 64, 128, 0.0, None, id="no-decay"),
    pytest.param("kda", 1, 1, 128, 128, None, None, id="k128"),
]


@pytest.mark.parametrize("variant,H,HV,K,T,g_val,valid", CPU_CASES)
def test_interpret_fwd(variant, H, HV, K, T, g_val, valid):
    x = stage_inputs(1, variant, 1, T, H, HV, K, g_val=g_val, valid=valid)
    h0 = _states(2, 1, HV, K, 1.0)
    run_interpreted(lambda: check_fwd(x, h0, K**-0.5, jit=False))


@pytest.mark.parametrize("variant,H,HV,K,T,g_val,valid", CPU_CASES)
def test_interpret_bwd_dh(variant, H, HV, K, T, g_val, valid):
    x = stage_inputs(3, variant, 1, T, H, HV, K, g_val=g_val, valid=valid)
    do = _do(4, 1, T, HV, K)
    if valid is not None:
        do = do.at[:, valid:].set(0)
    dht = _states(5, 1, HV, K, 1.0)
    run_interpreted(lambda: check_dh(x, do, dht, K**-0.5, jit=False))


def test_interpret_large_state():
    """State and state gradient ~1e5: per-column f16 staging keeps them; plain f16 would not."""
    x, xb, h0, dht = large_state_inputs(6, 1, 128, 1, 64)
    do = _do(7, 1, 128, 1, 64)
    run_interpreted(lambda: check_large_state(x, xb, h0, dht, do, 0.125, jit=False))


# ------------------------------------------------------------------------------------------------
# CPU: the real GPU lowering (layout inference, wgmma operand checks, the SMEM budget)


def _shapes(K, V, dt, B=1, T=192, HV=2):
    S, nt = jax.ShapeDtypeStruct, T // 64
    return dict(
        qk=S((B, T, HV, K), dt), u=S((B, T, HV, V), dt), aqk=S((B, T, HV, 64), dt),
        egl=S((B, HV, nt, K), f32), st=S((B, HV, K, V), f32),
    )  # fmt: skip


def _kernel_fns(K, V, dt, block_v):
    """(name, fn, args) of the three kernel forms (forward, store_h, bwd_dh) on shapes."""
    s = _shapes(K, V, dt)
    fwd = ChunkFwdConfig(scale=0.1, block_v=block_v)
    sh = ChunkFwdConfig(scale=0.1, block_v=block_v, store_h=True)
    return [
        ("chan_chunk_fwd", lambda *a: channel_chunk_fwd(*a, fwd),
         (s["qk"], s["qk"], s["qk"], s["u"], s["aqk"], s["egl"], s["st"])),
        ("chan_chunk_h", lambda kg, w, u, e, h0: channel_chunk_fwd(None, kg, w, u, None, e, h0, sh),
         (s["qk"], s["qk"], s["u"], s["egl"], s["st"])),
        ("chan_bwd_dh", lambda *a: channel_bwd_dh(*a, LoopConfig(scale=0.1, block_v=block_v)),
         (s["qk"], s["qk"], s["qk"], s["u"], s["aqk"], s["egl"], s["st"])),
    ]  # fmt: skip


# K = 128 with block_v = 64, the op's form there, lowers with the op:
# test_channel_pallas.py::test_lowers_for_cuda.
@pytest.mark.parametrize("K,V,block_v", [(64, 64, 64), (64, 128, 128)])
def test_f16_lowers_for_cuda(K, V, block_v):
    """The f16 forms lower within one SM's shared memory, h / dh typed f32."""
    for name, fn, args in _kernel_fns(K, V, f16, block_v):
        with pk.cuda_lowering_mesh(), smem_limit(smem_per_cta(1)):
            txt = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        calls = [ln for ln in txt.splitlines() if "custom_call @mosaic_gpu" in ln]
        assert len(calls) == 1 and re.search(rf"\\00{name}\\00", calls[0]), (name, len(calls))
        if name != "chan_chunk_fwd":  # h / dh: the state is never stored in f16
            assert jax.eval_shape(fn, *args)[0].dtype == f32, name


def test_f16_forward_k128_block_v128_lowers():
    """The f16 forward (single o tile) fits at K = block_v = 128, as the bf16 one does."""
    name, fn, args = _kernel_fns(128, 128, f16, 128)[0]
    with pk.cuda_lowering_mesh(), smem_limit(smem_per_cta(1)):
        txt = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert re.search(rf"\\00{name}\\00", txt)


def test_f16_forms_that_do_not_fit_raise():
    """K = block_v = 128 with f32 h / dh tiles exceeds SMEM: NotImplementedError before tracing
    the kernel (the glue picks block_v = 64)."""
    for _, fn, args in _kernel_fns(128, 128, f16, 128)[1:]:
        with pytest.raises(NotImplementedError, match="shared memory"):
            jax.eval_shape(fn, *args)


def _jaxpr(fn, args):
    with pk.cuda_lowering_mesh():
        return str(jax.make_jaxpr(fn)(*args))


def test_only_f16_stages_with_scales():
    """The per-column scales (a max over K of |S|) appear in the f16 kernels only."""
    for dt, want in ((bf16, False), (f16, True)):
        for name, fn, args in _kernel_fns(64, 64, dt, 64):
            assert ("reduce_max" in _jaxpr(fn, args)) == want, (name, dt)


# ------------------------------------------------------------------------------------------------
# GPU (H200): realistic shapes

GPU_CASES = [
    # variant, g_val
    pytest.param("kda", None, id="kda-random-gates"),
    pytest.param("gdn2", None, id="gdn2-random-gates"),
    pytest.param("kda", -5.0, id="kda-decay5"),
    pytest.param("gdn2", 0.0, id="gdn2-no-decay"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("variant,g_val", GPU_CASES)
def test_gpu_fwd(variant, g_val):
    x = stage_inputs(11, variant, 2, 2048, 8, 16, 128, g_val=g_val)
    check_fwd(x, _states(12, 2, 16, 128, 1.0), 128**-0.5, tol=GPU_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("variant,g_val", GPU_CASES)
def test_gpu_bwd_dh(variant, g_val):
    x = stage_inputs(13, variant, 2, 2048, 8, 16, 128, g_val=g_val)
    dht = _states(15, 2, 16, 128, 1.0)
    check_dh(x, _do(14, 2, 2048, 16, 128), dht, 128**-0.5, tol=GPU_TOL)


@pytest.mark.gpu
def test_gpu_large_state():
    x, xb, h0, dht = large_state_inputs(16, 2, 2048, 16, 128)
    check_large_state(x, xb, h0, dht, _do(17, 2, 2048, 16, 128), 128**-0.5, tol=GPU_TOL)
