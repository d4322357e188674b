"""benchmarks/bench_gdn.py on the CPU: forced segment counts go through the public op; the timed
forward+backward is the op's VJP with the cotangent do; the channel stage times run the plan's
kernel forms in the io dtype asked for."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gdn_cases import lowered_kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gdn_jax  # noqa: E402
from benchmarks.bench_gdn import forced_segments, forward_backward, inputs  # noqa: E402
from pallas_kernels import _compat as pk  # noqa: E402


@pytest.mark.parametrize("segments,has_map", [(None, True), (1, False), (4, True)])
def test_forced_segments_reach_the_public_op(segments, has_map):
    """B1 T2048 H2 HV2 (4 CTAs): the op splits by itself (None); a forced count of 1 removes the
    segment pass, 4 keeps it; the public op (sanitation included) is what gets timed."""
    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    B, T, H, K = 1, 2048, 2, 128
    args = (S((B, T, H, K), bf),) * 3 + (S((B, T, H), jnp.float32),) * 2

    def fwd(q, k, v, g, beta):
        return gdn_jax.gated_delta_rule(q, k, v, g, beta, implementation="pallas")[0]

    with forced_segments(segments), pk.cuda_lowering_mesh():
        txt = jax.jit(fwd).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert lowered_kernels(txt, ("gdn_segment_map",)) == ({"gdn_segment_map"} if has_map else set())


def test_forward_backward_is_the_vjp_with_do():
    """forward_backward(op)(*args, do) returns o and the gradients of Σ o·do (what FLA's
    o.backward(do) computes), without that loss in the program."""
    from benchmarks.shapes import Shape

    s = Shape("B1_T64_H1_HV2_D64", 1, 64, 1, 2)
    x = inputs(s, variant="kda")
    args = tuple(jnp.asarray(x[n], jnp.bfloat16) for n in ("q", "k", "v"))
    args += (jnp.asarray(x["g"]), jnp.asarray(x["beta"]))
    do = jnp.asarray(x["do"], jnp.bfloat16)

    def op(*a):
        return gdn_jax.kda(*a, implementation="xla")[0]

    o, grads = jax.jit(forward_backward(op))(*args, do)
    loss = lambda *a: jnp.sum(op(*a).astype(jnp.float32) * do.astype(jnp.float32))  # noqa: E731
    want = jax.grad(loss, argnums=range(len(args)))(*args)
    np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(op(*args), np.float32))
    assert len(grads) == len(args)
    for a, b in zip(grads, want, strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.abs(b).max() > 0
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2 * np.abs(b).max())


def test_channel_stages_time_the_plan_forms(monkeypatch):
    """--stages for KDA in f16 (K = V = 64, two chunks, in the interpreter, each kernel run once
    instead of timed): every kernel runs in the io dtype asked for and in the form the call's
    plan picks (f16 at K = 64: the phased dq/dk/dw, the one-CTA WY backward)."""
    import benchmarks.bench_gdn as bench
    from benchmarks.shapes import Shape

    ran = []

    def run_once(f, args, **kw):
        ran.append({str(a.dtype) for a in jax.tree.leaves(args) if a.ndim == 4})
        jax.block_until_ready(f(*args))
        return 0.0

    monkeypatch.setattr(bench, "time_jax", run_once)
    s = Shape("B1_T128_H1_HV1_D64", 1, 128, 1, 1, 64, 64)
    with pk.use_mode("interpret"):
        times = bench.bench_channel_stages(s, inputs(s, variant="kda"), "kda", "float16")
    assert {"chan_bwd_dqkw(phased)", "chan_bwd_wy(one_cta)", "chan_intra", "chan_chunk_fwd"} <= set(
        times
    )
    assert not any("k_split" in name for name in times)
    # the kernels' 16-bit operands are f16 (G, states and gates are f32), never bf16
    assert all("bfloat16" not in dts for dts in ran) and any("float16" in dts for dts in ran)


def test_gdn_stages_run_every_kernel(monkeypatch):
    """--stages for GDN (K = V = 64, two chunks, in the interpreter, each kernel run once instead
    of timed): every kernel of the pallas path and the op's poison flags run with the arguments
    the bench builds."""
    import benchmarks.bench_gdn as bench
    from benchmarks.shapes import Shape

    def run_once(f, args, **kw):
        jax.block_until_ready(f(*args))
        return 0.0

    monkeypatch.setattr(bench, "time_jax", run_once)
    s = Shape("B1_T128_H1_HV1_D64", 1, 128, 1, 1, 64, 64)
    with pk.use_mode("interpret"):
        times = bench.bench_stages(s, inputs(s))
    assert set(times) == {
        "poison_flags", "gdn_intra", "gdn_intra(store_a)", "gdn_chunk_fwd", "gdn_chunk_h",
        "gdn_chunk_bwd_dh", "gdn_bwd_dqkw", "gdn_bwd_wy",
    }  # fmt: skip
