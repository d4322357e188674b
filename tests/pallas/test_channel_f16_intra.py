"""f16 io of the channel-decay intra kernel: tf32 factored operands.

With f16 q, k, v the decay-factored operands of the L and Aqk products (``x_i e^{G_i − r_J}``
and ``k_j e^{r_J − G_j}`` around the reference row r_J of column block J, factors up to
e^{8·|g|}: e^{40} at a log-decay of −5 per token) do not fit f16 (max 65504); the kernel stages
them in f32 tiles rounded to tf32 (f32's range, 11 significant bits) for one tf32 product per
block. Everything else (A, the gated k and v, the outputs) stays f16.

Checked: every output against the stage's formulas in f32 jnp on the same f16 inputs (per-token
log-decays −5, −0.1 and 0 in every channel, and random ones in [−1, 0]); a jnp emulation of the
factored Aqk product shows that plain f16 operands overflow at −5 per token, plain bf16 ones miss
the tolerance, and tf32-rounded ones (the kernel's :func:`round_tf32`) meet it; the rounding itself
is checked bit by bit against its definition. The f16 kernels' CUDA lowering within half an SM's
shared memory per CTA is checked with the op's in test_channel_pallas.py::test_lowers_for_cuda.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from gdn_cases import cached_jit, compiled, run_interpreted
from test_channel_intra import OUTS, _refs
from test_channel_pallas_bwd import _chunks, _explicit, core_case

from gdn_jax.testing import check_2x, rel_rms
from pallas_kernels._tiles import round_tf32
from pallas_kernels.channel.intra import ChannelIntraConfig, channel_intra

f32, f16, bf16 = jnp.float32, jnp.float16, jnp.bfloat16
F16_MAX = 65504.0

# Relative RMS tolerance per output. Each output is rounded once to f16 (unit roundoff 2^-11,
# relative RMS ≈ 2^-11/√3 ≈ 2.8e-4); w and u also take A and their right operands as f16
# tensor-core operands (a few roundings of that size; measured ≤ 3.5e-4 at the tiny shapes); the
# factored L / Aqk operands are rounded to tf32 (2^-11, like f16; Aqk measured ≤ 3.7e-4 at the
# tiny shapes). 1e-3 is about three f16 roundings and a twentieth of the bf16 kernels' tolerance
# (2e-2): staging the factored operands in plain bf16 instead already misses it (2.1e-3 on Aqk,
# test_factored_operands_need_f32_range), plain f16 overflows to inf.
TOL = 1e-3


def _f16_inputs(seed, variant, N, T, H, HV, K, g_val=None, V=None):
    """channel_intra's inputs (q, k, v f16; G, gates f32) from the backward tests' core case: unit
    q/k rows, per-channel log-decays in [−1, 0] (or all ``g_val``), gates in [0, 1]; KDA's β as
    [N, HV, T]. ``V`` (default K): v [N, T, HV, V] N(0, 1) and GDN2's write gate in [0, 1]."""
    _, (q, k, v, G, b, w, _), _ = core_case(seed, variant, N, T, H, HV, K, g_val=g_val)
    if V is not None and V != K:
        r = np.random.default_rng(seed + 1)
        v = jnp.asarray(r.standard_normal((N, T, HV, V)), f32)
        w = None if w is None else jnp.asarray(r.uniform(0, 1, (N, T, HV, V)), f32)
    b = b.transpose(0, 2, 1) if w is None else b
    return q.astype(f16), k.astype(f16), v.astype(f16), G, b, w


def _intra(args, store_a=True):
    q, k, v, G, b, w = args
    cfg = ChannelIntraConfig(scalar_beta=w is None, store_a=store_a)
    return dict(zip(OUTS, channel_intra(q, k, v, G, b, w, cfg), strict=False))


def check_f16(args, *, tol=TOL, jit=False):
    """Every output f16, finite, and within ``tol`` + 2·floor relative RMS of the f32 formulas,
    floor being the error of the formulas' value rounded to f16 (the best f16 output): under
    strong decay qg and w hold values below f16's smallest normal 6.1e-5, whose subnormal grid
    alone costs ~1e-2 at a log-decay of −10, and w's right operand b ⊙ e^G ⊙ k is itself an f16
    tensor-core operand (a second rounding of that size); elsewhere floor is ~2e-4."""
    run, refs = compiled(_intra, jit=jit), cached_jit(_refs, reference=True)
    got, ref = run(args), refs(args)
    for name in OUTS:
        assert got[name].dtype == f16, (name, got[name].dtype)
    rounded = [ref[n].astype(f16) for n in OUTS]
    report = check_2x(OUTS, [got[n] for n in OUTS], rounded, [ref[n] for n in OUTS], floor=tol)
    print("f16 intra", report, flush=True)


# ------------------------------------------------------------------------------------------------
# CPU: Mosaic GPU interpreter (two chunks, one q/k head; GVA: two value heads read it)


@pytest.mark.parametrize(
    "variant,HV,g_val",
    [
        ("kda", 2, -5.0),  # the required strongest decay, GVA
        ("gdn2", 1, -5.0),
        ("gdn2", 2, -0.1),  # GVA
        ("kda", 1, 0.0),  # no decay: every factor 1
        ("gdn2", 1, None),  # random per-channel log-decays in [−1, 0]
    ],
)
def test_interpret_f16_k64(variant, HV, g_val):
    args = _f16_inputs(3, variant, 1, 128, 1, HV, 64, g_val=g_val)
    run_interpreted(lambda: check_f16(args))


def test_interpret_f16_k128():
    """Two 64-column passes (K = V = 128) at −5 per token."""
    args = _f16_inputs(5, "gdn2", 1, 64, 1, 1, 128, g_val=-5.0)
    run_interpreted(lambda: check_f16(args))


@pytest.mark.parametrize("variant,K,V", [("gdn2", 64, 128), ("kda", 128, 64)])
def test_interpret_f16_k_ne_v(variant, K, V):
    """K != V: the K-contraction in K/64 passes, w in K-halves, u in V-halves, at −5 per token."""
    args = _f16_inputs(7, variant, 1, 64, 1, 1, K, g_val=-5.0, V=V)
    run_interpreted(lambda: check_f16(args))


def test_interpret_f16_clamp_decay():
    """Log-decay −10 per token (the op's clamp): factors up to e^{80}, still finite in bf16; the
    products above the diagonal overflow (inf, or NaN from inf − inf) and are dropped."""
    args = _f16_inputs(6, "kda", 1, 64, 1, 1, 64, g_val=-10.0)
    run_interpreted(lambda: check_f16(args))


def test_interpret_f16_without_a():
    """store_a=False: the same five outputs as with it."""
    args = _f16_inputs(4, "kda", 1, 64, 1, 1, 64, g_val=-5.0)

    def run():
        with_a, without = _intra(args), _intra(args, store_a=False)
        assert len(without) == 5
        for name, x in without.items():
            assert np.array_equal(np.asarray(x), np.asarray(with_a[name])), name

    run_interpreted(run)


# ------------------------------------------------------------------------------------------------
# CPU: why f32's range — the factored operands at −5 per token, emulated in jnp


def _factored_aqk(q, k, G, stage):
    """Aqk_ij = Σ_d q_id k_jd e^{G_id − G_jd} (i ≥ j) computed as the kernel does: per column
    block J, rows ``q e^{G − r_J}`` (i ≥ 16 J, 0 above) times columns ``k e^{r_J − G}`` (j in
    J), both operands passed through ``stage`` (a pair of [M, rows, K] f32 → list of (row, col)
    term pairs). q, k: [N, T, HV, K]; G: [N, T, HV, K] f32. Returns [M, 64, 64] f32 and the
    largest operand magnitude."""
    Gc, qc, kc = _chunks(G), _chunks(q), _chunks(k)
    r = Gc[:, 8::16]  # [M, 4, K] reference rows
    Y = kc * jnp.exp(jnp.repeat(r, 16, axis=1) - Gc)  # every column against its own block
    i = jnp.arange(64)[:, None]
    j = jnp.arange(64)[None, :]
    blocks, big = [], jnp.max(jnp.abs(Y))
    for J in range(4):
        keep = (jnp.arange(64) >= 16 * J)[None, :, None]
        X = jnp.where(keep, qc * jnp.exp(jnp.where(keep, Gc - r[:, J : J + 1], 0.0)), 0.0)
        big = jnp.maximum(big, jnp.max(jnp.abs(X)))
        YJ = Y[:, 16 * J : 16 * (J + 1)]
        terms = stage(X, YJ)
        blocks.append(sum(jnp.einsum("mid,mjd->mij", a, b, precision="highest") for a, b in terms))
    out = jnp.concatenate(blocks, axis=2)
    return jnp.where((i >= j)[None], out, 0.0), big


def _plain(dt):
    return lambda X, Y: [(X.astype(dt).astype(f32), Y.astype(dt).astype(f32))]


def _tf32(X, Y):
    """The kernel's staging: both operands rounded to tf32, one product."""
    return [(round_tf32(X), round_tf32(Y))]


def test_round_tf32_is_round_to_nearest():
    """round_tf32 keeps 11 significant bits, rounding to nearest (ties away from zero), keeps
    f32's range, sign and zeros, and is idempotent."""
    r = np.random.default_rng(0)
    x = np.concatenate(
        [r.standard_normal(4096) * np.exp(r.uniform(-80, 80, 4096)), [0.0, -0.0, 1.0, -3.0]]
    ).astype(np.float32)
    got = np.asarray(round_tf32(jnp.asarray(x)))
    m, e = np.frexp(x.astype(np.float64))  # x = m 2^e, 0.5 <= |m| < 1
    want = np.sign(m) * np.floor(np.abs(m) * 2**11 + 0.5) / 2**11 * 2.0**e
    assert np.array_equal(got, want.astype(np.float32))
    assert np.array_equal(np.asarray(round_tf32(jnp.asarray(got))), got)
    assert np.signbit(got[-3]) and not np.signbit(got[-4])
    assert float(np.max(np.abs(got - x) / np.maximum(np.abs(x), 1e-30))) <= 2.0**-11


def test_factored_operands_need_f32_range():
    """At −5 per token the factored operands reach ~e^{40} (> 65504): plain f16 staging gives
    inf/NaN, plain bf16 misses the tolerance, tf32 meets it."""
    q, k, v, G, b, w = _f16_inputs(3, "gdn2", 1, 128, 1, 1, 64, g_val=-5.0)
    ref = jnp.einsum("mid,mjd,mijd->mij", _chunks(q), _chunks(k), _explicit(G))
    got_tf32, big = _factored_aqk(q, k, G, _tf32)
    got_f16, _ = _factored_aqk(q, k, G, _plain(f16))
    got_bf16, _ = _factored_aqk(q, k, G, _plain(bf16))
    assert float(big) > 1e4 * F16_MAX, float(big)  # e^{40}·|q| ≈ 1e16
    e_tf32, e_f16, e_bf16 = (rel_rms(x, ref) for x in (got_tf32, got_f16, got_bf16))
    print(f"factored Aqk: tf32 {e_tf32:.1e}, f16 {e_f16:.1e}, bf16 {e_bf16:.1e}", flush=True)
    assert e_tf32 <= TOL / 2, e_tf32
    assert not np.isfinite(np.asarray(got_f16)).all() and e_f16 == float("inf")
    assert e_bf16 > TOL, e_bf16


# ------------------------------------------------------------------------------------------------
# GPU (H200): a realistic shape, with GVA, at −5 per token and at random decays


@pytest.mark.gpu
@pytest.mark.parametrize("g_val", [-5.0, None])
@pytest.mark.parametrize("variant", ["kda", "gdn2"])
def test_gpu_f16_intra(variant, g_val):
    args = _f16_inputs(2, variant, 2, 2048, 4, 16, 128, g_val=g_val)
    check_f16(args, jit=True)
