"""The K-split form of the channel-decay dq/dk/dw kernel (``channel_bwd_dqkw(k_split=True)``).

Two CTAs per (chunk, value head), each computing one 64-column half of K = 128. Checked against
the one-CTA form on the same inputs (the maths is the same per key column, so they agree to f32
accumulation order and 16-bit output rounding) and against the jnp formulas of
:func:`test_channel_pallas_bwd._kernel_refs`. Its CUDA lowering within the shared memory of two CTAs
per SM is checked with the op's (test_channel_pallas.py::test_lowers_for_cuda); here, that the
one-CTA form does not fit there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from gdn_cases import compiled, run_interpreted, smem_limit, smem_per_cta
from test_channel_pallas_bwd import _kernel_inputs, kernel_refs

from gdn_jax.testing import rel_rms
from pallas_kernels import _compat as pk
from pallas_kernels.channel.bwd_dqkw import channel_bwd_dqkw
from pallas_kernels.recurrence.bwd_dh import channel_bwd_dh

f32 = jnp.float32
OUTS = ("dq", "dk", "dwk", "dG")  # channel_bwd_dqkw's outputs, in order
REF = {"dq": "dq", "dk": "dk", "dwk": "dw", "dG": "dG(qk)"}  # their names in _kernel_refs
# Two CTAs per SM: 228 KiB of shared memory per SM, of which 1 KiB per CTA is reserved.


def _dh(x, scale):
    """bwd_dh's outputs (dh, dv2 hi, dv2 lo): the state-gradient inputs of bwd_dqkw."""
    from pallas_kernels._tiles import LoopConfig

    dh, dvh, dvl, _ = channel_bwd_dh(
        x["qg"], x["kg"], x["wk"], x["do"], x["aqk"], jnp.exp(x["gl"]), x["dht"],
        LoopConfig(scale=scale),
    )  # fmt: skip
    return dh, dvh, dvl


def _dqkw(x, dh, dvh, dvl, scale, *, k_split):
    out = channel_bwd_dqkw(
        x["q"], x["k"], x["G"], x["gr"], x["gl"], x["h"], dh, x["vn"], x["do"], dvh, dvl,
        scale=scale, k_split=k_split,
    )  # fmt: skip
    return dict(zip(OUTS, out, strict=True))


def check_ksplit(x, *, tol_split, tol_ref, jit=True):
    """k_split=True against k_split=False (``tol_split``) and against the jnp formulas
    (``tol_ref``), every output, relative RMS."""
    x = dict(x)
    scale = x.pop("cfg").scale
    dh, dvh, dvl = _dh(x, scale)
    run_s, run_u = (compiled(_dqkw, jit=jit, scale=scale, k_split=s) for s in (True, False))
    split = run_s(x, dh, dvh, dvl)
    plain = run_u(x, dh, dvh, dvl)
    # _kernel_refs forms every backward kernel's reference; bwd_dqkw's read dh and dv2 (and
    # the bwd_wy part reads dw, given the split kernel's here)
    ref = kernel_refs(x, dict(dh=dh, dvh=dvh, dvl=dvl, dwk=split["dwk"]), scale)
    HV = x["v"].shape[2]
    assert split["dq"].dtype == (x["q"].dtype if HV == x["q"].shape[2] else f32)
    report, bad = [], []
    for name in OUTS:
        assert split[name].shape == plain[name].shape and split[name].dtype == plain[name].dtype
        e_split = rel_rms(split[name], plain[name])
        e_ref = rel_rms(split[name], ref[REF[name]])
        e_plain = rel_rms(plain[name], ref[REF[name]])
        report.append(f"{name}: split/plain {e_split:.1e}, split/ref {e_ref:.1e} "
                      f"(plain/ref {e_plain:.1e})")  # fmt: skip
        if not (e_split <= tol_split and e_ref <= tol_ref):
            bad.append(name)
    print("k_split", "; ".join(report), flush=True)
    assert not bad, (bad, "; ".join(report))


# ------------------------------------------------------------------------------------------------
# CPU: Mosaic GPU interpreter (one value head pair, two chunks)


@pytest.mark.parametrize(
    "H,HV",
    [
        (1, 1),  # dq in the io dtype
        (1, 2),  # GVA: f32 dq (summed over value heads by the caller)
    ],
)
def test_interpret_ksplit_matches(H, HV):
    with pk.use_mode("interpret"):
        x = run_interpreted(lambda: _kernel_inputs(5, "kda", 1, 128, H, HV, 128))
    run_interpreted(lambda: check_ksplit(x, tol_split=1e-4, tol_ref=2e-2, jit=False))


def test_ksplit_k64_falls_back():
    """At K = 64 the flag is ignored (the one-CTA form already works on [64, 64] tiles): the
    same kernel is traced, so the lowered modules are identical."""
    args = _shapes(1, 128, 1, 2, 64, jnp.bfloat16)

    def lowered(k_split):
        f = functools.partial(channel_bwd_dqkw, scale=0.125, k_split=k_split)
        with pk.cuda_lowering_mesh():
            return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    assert lowered(True) == lowered(False)
    with pytest.raises(NotImplementedError, match="k_split"):  # raised before any tracing
        channel_bwd_dqkw(*_shapes(1, 128, 1, 1, 96, jnp.bfloat16), scale=0.125, k_split=True)


# ------------------------------------------------------------------------------------------------
# CPU: the real GPU lowering (layout inference, wgmma operand checks, SMEM budget)


def _shapes(B, T, H, HV, K, dt, V=None, state_dt=None):
    """ShapeDtypeStructs of channel_bwd_dqkw's 11 inputs: V defaults to K, the states h and dh
    to the io dtype ``dt`` (f32 for f16 io, as the forward writes them then)."""
    S, nt = jax.ShapeDtypeStruct, T // 64
    V = K if V is None else V
    st = dt if state_dt is None else state_dt
    return (
        S((B, T, H, K), dt), S((B, T, H, K), dt), S((B, T, HV, K), f32),
        S((B, HV, T // 16, K), f32), S((B, HV, nt, K), f32),
        S((B, nt, HV, K, V), st), S((B, nt, HV, K, V), st),
        *(S((B, T, HV, V), dt) for _ in range(4)),
    )  # fmt: skip


def test_unsplit_needs_a_whole_sm():
    """The reason for the split: the one-CTA form does not fit in half an SM at K = 128 (the
    K-split form does: test_channel_pallas.py::test_lowers_for_cuda checks each planned form's
    budget)."""
    f = functools.partial(channel_bwd_dqkw, scale=0.125)
    with pk.cuda_lowering_mesh(), smem_limit(smem_per_cta(2)):
        with pytest.raises(ValueError, match="exceeds available shared memory"):
            jax.jit(f).trace(*_shapes(1, 128, 1, 1, 128, jnp.bfloat16)).lower(
                lowering_platforms=("cuda",)
            )  # fmt: skip


# ------------------------------------------------------------------------------------------------
# GPU (H200): test_channel_pallas_bwd.py::test_gpu_ksplit_dqkw runs check_ksplit at a
# realistic shape, in the module whose worker holds the per-kernel tests' inputs and kernels.
