"""The channel-decay intra-chunk kernel (:func:`pallas_kernels.channel.intra.channel_intra`).

Two kernels, one CTA each per (chunk, value head): ``chan_intra_wy`` forms L → A → w, u (and A),
``chan_intra_qk`` Aqk, qg, kg, with the
decay of L and Aqk factored per 16-column block (one 64 × 16 × K product per block). Checked
against the stage's formulas in f32 jnp (:func:`gdn_jax.reference.chunked.intra_chunk` for A, w,
u; explicit pairwise decays for Aqk) at random, strong random and clamp-strength decays. Their
CUDA lowering and shared-memory budgets (two wy CTAs, three bf16 qk CTAs per SM) are checked with
the op's in test_channel_pallas.py::test_lowers_for_cuda.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gdn_cases import cached_jit, compiled, run_interpreted
from test_channel_pallas_bwd import _chunks, _explicit, _rep, _unchunk, core_case

from gdn_jax.reference.chunked import intra_chunk
from gdn_jax.testing import rel_rms
from pallas_kernels.channel.intra import ChannelIntraConfig, channel_intra

f32 = jnp.float32
OUTS = ("qg", "kg", "w", "u", "aqk", "A")  # channel_intra's outputs (A with store_a), in order


def _inputs(seed, variant, T, H, HV, K, g_val=None, gate_scale=1.0):
    """channel_intra's inputs (q, k, v, G, b, w_gate) from the backward tests' core case: unit
    q/k rows, per-channel log-decays in [−gate_scale, 0] (or all ``g_val``), gates in [0, 1];
    KDA's β as [B, HV, T]."""
    _, (q, k, v, G, b, w, _), _ = core_case(
        seed, variant, 1, T, H, HV, K, g_val=g_val, gate_scale=gate_scale
    )
    return q, k, v, G, (b.transpose(0, 2, 1) if w is None else b), w


def _intra(args, *, store_a=True):
    q, k, v, G, b, w = args
    cfg = ChannelIntraConfig(scalar_beta=w is None, store_a=store_a)
    return dict(zip(OUTS, channel_intra(q, k, v, G, b, w, cfg), strict=False))


def _refs(args):
    """The stage's outputs by their formulas in f32 jnp (chunk-major [N·nt·HV, 64, D] → [N, T,
    HV, D]) from the same 16-bit inputs."""
    q, k, v, G, b, w = args
    N, T, HV, K = G.shape
    nt = T // 64
    c4 = lambda x: x.reshape(N, nt, 64, *x.shape[2:])  # noqa: E731
    kr, qr = _rep(k, HV), _rep(q, HV)
    if w is None:  # KDA: b = w_gate = β per token
        b = w = b.transpose(0, 2, 1)[..., None]
    A, wk, u = intra_chunk(c4(kr), c4(v), c4(b), c4(w), c4(G), dtype=f32)
    Gc = _chunks(G)
    aqk = jnp.einsum("mid,mjd,mijd->mij", _chunks(qr), _chunks(kr), _explicit(G))
    kg = _chunks(kr) * jnp.exp(Gc[:, -1:] - Gc)
    A = A.transpose(0, 1, 3, 2, 4).reshape(N, T, HV, 64)  # [N, nt, HV, C, C] → rows of chunks
    return dict(
        qg=qr.astype(f32) * jnp.exp(G), kg=_unchunk(kg, N, T, HV), w=wk.reshape(N, T, HV, K),
        u=u.reshape(N, T, HV, -1), aqk=_unchunk(aqk, N, T, HV), A=A,
    )  # fmt: skip


def check_intra(args, *, tol, jit=True):
    """Every output finite and within ``tol`` relative RMS of the formulas (the 16-bit operand
    and output roundings: ~3e-3 measured for bf16)."""
    run, refs = compiled(_intra, jit=jit), cached_jit(_refs, reference=True)
    got, ref = run(args), refs(args)
    report, bad = [], []
    for name in OUTS:
        assert got[name].shape == ref[name].shape and got[name].dtype == args[1].dtype, name
        assert np.isfinite(np.asarray(got[name], f32)).all(), name
        e = rel_rms(got[name], ref[name])
        report.append(f"{name} {e:.1e}")
        if not e <= tol:
            bad.append(name)
    print("intra vs formulas:", ", ".join(report), flush=True)
    assert not bad, (bad, report)


# ------------------------------------------------------------------------------------------------
# CPU: Mosaic GPU interpreter (two chunks, one q/k head; GVA: two value heads read it)

TOL = 1e-2  # relative RMS against the f32 formulas (bf16 io; measured ≤ 3e-3)


@pytest.mark.parametrize(
    "variant,H,HV,K",
    [
        ("kda", 1, 2, 128),  # GVA
        ("gdn2", 1, 2, 128),  # GVA
        ("gdn2", 1, 1, 64),  # one 64-column pass
    ],
)
def test_interpret_matches(variant, H, HV, K):
    args = _inputs(3, variant, 128, H, HV, K)
    run_interpreted(lambda: check_intra(args, tol=TOL, jit=False))


def test_interpret_strongest_decay():
    """Log-decay −10 per token and channel (the op's clamp): the column-block factors reach
    e^{±80} and products above the diagonal overflow; they are dropped, nothing else is hit."""
    args = _inputs(6, "kda", 64, 1, 1, 128, g_val=-10.0)
    run_interpreted(lambda: check_intra(args, tol=TOL, jit=False))


def test_interpret_strong_random_decay():
    """Per-channel log-decays uniform in [−10, 0]: every row and column factor of a block takes a
    different exponent per channel, within e^{±80} (GDN2, GVA, two 64-column passes)."""
    args = _inputs(8, "gdn2", 128, 1, 2, 128, gate_scale=10.0)
    run_interpreted(lambda: check_intra(args, tol=TOL, jit=False))


def test_interpret_without_a():
    """store_a=False: the same five outputs as with it (A's store is the only difference)."""
    args = _inputs(4, "kda", 64, 1, 1, 128)

    def run():
        with_a = _intra(args)
        without = _intra(args, store_a=False)
        assert len(without) == 5 and len(with_a) == 6
        for name, x in without.items():
            assert np.array_equal(np.asarray(x), np.asarray(with_a[name])), name

    run_interpreted(run)


@pytest.mark.parametrize("variant,K", [("kda", 128), ("gdn2", 128), ("kda", 64)])
def test_interpret_reads_bad_values_as_zero(variant, K):
    """Non-finite values in the raw q, k, v (GVA: one q/k head, two value heads; two chunks; K =
    128: two 64-column passes, K = 64: one): the products equal those of the inputs with them as
    0 (where they are, the op's XLA flags say; GDN2's v the glue gates)."""
    q, k, v, G, b, w = _inputs(5, variant, 128, 1, 2, K)
    q = q.at[0, 7, 0, K - 28].set(jnp.nan).at[0, 70, 0, 3].set(-jnp.inf)
    k = k.at[0, 64, 0, K - 1].set(jnp.inf)
    v = v.at[0, 30, 1, 5].set(jnp.nan).at[0, 20, 1, 5].set(jnp.inf)
    v = v.at[0, 127, 0, K - 1].set(jnp.nan)
    raw = (q, k, v, G, b, w)
    clean = tuple(
        x if i > 2 or x is None else jnp.where(jnp.isfinite(x), x, 0).astype(x.dtype)
        for i, x in enumerate(raw)
    )
    if variant == "gdn2":  # (the glue gates GDN2's v in XLA: the wy kernel never sees it)
        raw = raw[:2] + clean[2:]
    cfg = ChannelIntraConfig(scalar_beta=w is None, store_a=True)

    def run():
        got = channel_intra(*raw, cfg)
        want = channel_intra(*clean, cfg)
        assert len(got) == len(OUTS)
        for name, a, c in zip(OUTS, got, want, strict=True):
            assert np.isfinite(np.asarray(a, f32)).all(), name
            np.testing.assert_array_equal(np.asarray(a, f32), np.asarray(c, f32), err_msg=name)

    run_interpreted(run)


def test_needs_k64_or_k128():
    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    B, T, HV, K = 1, 64, 1, 192
    args = (S((B, T, 1, K), bf), S((B, T, 1, K), bf), S((B, T, HV, K), bf),
            S((B, T, HV, K), f32), S((B, HV, T), f32), None)  # fmt: skip
    cfg = ChannelIntraConfig(scalar_beta=True)
    with pytest.raises(NotImplementedError, match="K, V"):
        jax.eval_shape(lambda *a: channel_intra(*a, cfg), *args)


def test_config_validates():
    with pytest.raises(TypeError, match="scalar_beta"):
        ChannelIntraConfig(scalar_beta=1)
    with pytest.raises(TypeError, match="store_a"):
        ChannelIntraConfig(store_a=None)


# ------------------------------------------------------------------------------------------------
# GPU (H200): test_channel_pallas_bwd.py::test_gpu_intra runs check_intra at a realistic shape,
# in the module whose worker holds the per-kernel tests' inputs and kernels.
