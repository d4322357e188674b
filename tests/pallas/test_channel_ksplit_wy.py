"""The K-split form of the channel-decay WY backward (``ChannelBwdWyConfig(k_split=True)``).

Two CTAs per (chunk, value head) each produce one 64-column half of dk, dG, db and of dv,
dw_gate (KDA: a partial dβ, summed by the launcher). Checked against the unsplit kernel on the
same inputs and against the kernel formulas in jnp (:func:`test_channel_pallas_bwd._kernel_refs`);
the inputs are the forward's intermediates and the upstream backward kernels' dw / dv2, built by
the helpers of ``test_channel_pallas_bwd``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from gdn_cases import compiled, run_interpreted
from test_channel_pallas_bwd import (
    _kernel_inputs,
    _kernel_outputs,
    kernel_refs,
)

from gdn_jax.testing import rel_rms
from pallas_kernels import _compat as pk
from pallas_kernels.channel.bwd_wy import ChannelBwdWyConfig, channel_bwd_wy

f32 = jnp.float32


def _names(scalar: bool) -> tuple[str, ...]:
    return ("dk(wy)", "dv", "dG(wy)") + (("dbeta",) if scalar else ("db", "dw_gate"))


def _split_wy(x, out):
    """channel_bwd_wy with k_split on the upstream kernels' dw / dv2 (hi, lo)."""
    cfg = ChannelBwdWyConfig(scalar_beta=x["w"] is None, k_split=True)
    return channel_bwd_wy(
        x["k"], x["v"], x["G"], x["gr"], x["gl"], x["bk"], x["w"], x["A"], out["dwk"],
        out["dvh"], out["dvl"], cfg,
    )  # fmt: skip


def check_split(x, *, tol: float, jit: bool = True):
    """K-split outputs vs the unsplit kernel's and vs the jnp formulas (relative RMS ≤ tol)."""
    x = dict(x)
    scale = x.pop("cfg").scale
    scalar = x["w"] is None
    out = _kernel_outputs(x, scale)  # bwd_dh, bwd_dqkw, unsplit bwd_wy
    got = compiled(_split_wy, jit=jit)(x, out)
    ref = kernel_refs(x, out, scale)
    report, bad = [], []
    for name, mine, unsplit in zip(_names(scalar), got, out["wy"], strict=True):
        assert mine.shape == unsplit.shape and mine.dtype == unsplit.dtype, name
        e_unsplit = rel_rms(mine, unsplit)
        e_ref = rel_rms(mine, ref[name])
        report.append(f"{name}: {e_unsplit:.1e} (unsplit) {e_ref:.1e} (formula)")
        if not (e_unsplit <= tol and e_ref <= 2 * tol):
            bad.append(name)
    print("k_split wy", "; ".join(report), flush=True)
    assert not bad, (bad, "; ".join(report))


# ------------------------------------------------------------------------------------------------
# CPU: Mosaic GPU interpreter (one chunk pair, GVA, K = V = 128; f16 at V = 64 in
# test_channel_f16_bwd)


@pytest.mark.parametrize("variant", ["kda", "gdn2"])
def test_interpret_split_matches_unsplit(variant):
    with pk.use_mode("interpret"):
        x = run_interpreted(lambda: _kernel_inputs(5, variant, 1, 128, 1, 2, 128))
        run_interpreted(lambda: check_split(x, tol=1e-2, jit=False))


def test_k_split_needs_k128():
    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    B, T, HV, K = 1, 64, 1, 64
    cfg = ChannelBwdWyConfig(scalar_beta=True, k_split=True)
    args = (
        S((B, T, 1, K), bf), S((B, T, HV, K), bf), S((B, T, HV, K), f32), S((B, HV, 4, K), f32),
        S((B, HV, 1, K), f32), S((B, HV, T), f32), None, S((B, T, HV, 64), bf),
        S((B, T, HV, K), bf), S((B, T, HV, K), bf), S((B, T, HV, K), bf),
    )  # fmt: skip
    with pytest.raises(NotImplementedError, match="K = 128"):
        jax.eval_shape(lambda *a: channel_bwd_wy(*a, cfg), *args)


def test_config_validates_k_split():
    with pytest.raises(TypeError, match="k_split"):
        ChannelBwdWyConfig(k_split=1)


# ------------------------------------------------------------------------------------------------
# GPU (H200): test_channel_pallas_bwd.py::test_gpu_ksplit_wy runs check_split at a
# realistic shape, in the module whose worker holds the per-kernel tests' inputs and kernels.
