"""Sequence-parallel GDN chunk loops (segments inside one device) on the Pallas kernels.

CPU: the real CUDA lowering of the segmented forward and backward (every kernel a Mosaic GPU
custom call), and Mosaic GPU interpreter runs at tiny shapes (bf16; f16 with strong gates).
GPU (``-m gpu``): segment counts 1, 2, 7 and 16 with packed sequences and initial/final states,
o, final state and every gradient under the 2x rule against the f32 recurrent oracle, and the
segmented op against the unsplit one; in the slow set (``-m "gpu and slow"``) also B1 T 131072
against the f32 chunked xla path.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gdn_cases import lowered_kernels, run_interpreted
from jax import lax

from gdn_jax.ops._gdn_pallas import gated_delta_rule_pallas
from gdn_jax.reference import recurrent_gated_delta_rule
from gdn_jax.testing import check_2x, random_inputs, reference_jit, rel_rms
from pallas_kernels import _compat as pk

NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0")
SEGMENT_KERNELS = (
    "gdn_intra", "gdn_segment_map", "gdn_chunk_fwd", "gdn_chunk_h", "gdn_segment_dh",
    "gdn_chunk_bwd_dh", "gdn_bwd_dqkw", "gdn_bwd_wy",
)  # fmt: skip


def _op(segments):
    def fn(q, k, v, g, beta, *, initial_state, output_final_state, cu_seqlens, use_qk_l2norm):
        return gated_delta_rule_pallas(
            q, k, v, g, beta, scale=q.shape[-1] ** -0.5, initial_state=initial_state,
            output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm,
            cu_seqlens=cu_seqlens, chunk_size=64, segments=segments,
        )  # fmt: skip

    return fn


def _case(seed, B, T, H, HV, K, V, cu, gate_scale):
    n = B if cu is None else len(cu) - 1
    x = random_inputs(seed, B=B, T=T, H=H, HV=HV, K=K, V=V, n_states=n, gate_scale=gate_scale)
    x["initial_state"] = 0.1 * x["initial_state"]
    r = np.random.default_rng(seed + 1)
    cts = (
        jnp.asarray(r.standard_normal((B, T, HV, V)), jnp.float32),
        jnp.asarray(r.standard_normal((n, HV, K, V)), jnp.float32),
    )
    return x, (None if cu is None else jnp.asarray(cu, jnp.int32)), cts


def _program(fn, cu, dtype, *, reference=False):
    """The jitted ``(x, (do, dht)) -> (o, final_state, *grads)`` of ``fn`` (a reference:
    ``reference_jit``). The cotangents are arguments: closed over, they would be constants that
    XLA folds at compile time (minutes at T = 131072)."""

    def loss(do, dht, q, k, v, g, beta, h0):
        o, s = fn(
            q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
            use_qk_l2norm=True,
        )  # fmt: skip
        return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(s * dht), (o, s)

    def run(x, cts):
        args = [x["q"].astype(dtype), x["k"].astype(dtype), x["v"].astype(dtype)]
        args += [x["g"], x["beta"], x["initial_state"]]
        grad_fn = jax.value_and_grad(loss, argnums=range(2, 8), has_aux=True)
        (_, (o, s)), grads = grad_fn(*cts, *args)
        return (o, s, *grads)

    return reference_jit(run) if reference else jax.jit(run)


def _grads(fn, x, cu, dtype, cts, *, reference=False):
    return _program(fn, cu, dtype, reference=reference)(x, cts)


# ------------------------------------------------------------------------------------------------
# CPU


@pytest.mark.parametrize("packed", [False, True])
def test_segments_lower_for_cuda(packed):
    B, T, H, HV, K, V = 1, 1024, 2, 4, 128, 128
    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    n = 3 if packed else B
    args = (
        S((B, T, H, K), bf), S((B, T, H, K), bf), S((B, T, HV, V), bf),
        S((B, T, HV), jnp.float32), S((B, T, HV), jnp.float32), S((n, HV, K, V), jnp.float32),
    )  # fmt: skip
    cu = jnp.asarray([0, 300, 300, T], jnp.int32) if packed else None

    def f(q, k, v, g, b, h0):
        def loss(q, k, v, g, b, h0):
            o, s = _op(4)(
                q, k, v, g, b, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                use_qk_l2norm=False,
            )  # fmt: skip
            return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

        return jax.value_and_grad(loss, argnums=range(6))(q, k, v, g, b, h0)

    with pk.cuda_lowering_mesh():
        txt = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    found = lowered_kernels(txt, SEGMENT_KERNELS)
    assert found == set(SEGMENT_KERNELS), found


def _interpreted_2x(T, cu, S, dtype, gate_scale):
    """One packed lane (H 1, HV 2: GVA; K = V = 64) with states at S segments under the Mosaic GPU
    interpreter: o, final state and every gradient under the 2x rule against the recurrence."""
    x, cu, cts = _case(0, 1, T, 1, 2, 64, 64, cu, gate_scale=gate_scale)
    ref32 = _grads(recurrent_gated_delta_rule, x, cu, jnp.float32, cts, reference=True)
    ref_lo = _grads(recurrent_gated_delta_rule, x, cu, dtype, cts, reference=True)
    got = run_interpreted(_grads, _op(S), x, cu, dtype, cts)
    print(check_2x(NAMES, got, ref_lo, ref32, floor=1e-5))


def test_interpret_segments_packed_states():
    """S = 4 on one packed lane of 5 chunks (padded to 8): a sequence spans segments 1 and 2,
    so a non-zero segment map carries state between segments; GVA; empty sequence."""
    _interpreted_2x(256, [0, 20, 20, 256], 4, jnp.bfloat16, gate_scale=0.05)


def test_interpret_segments_f16_decayed_maps():
    """f16 io, S = 2 segments of 4 chunks, full-strength gates: the segment maps' columns decay
    through f32's 1e-35 .. 1e-38 range, where the f16 staging scale 2^14 / amax would overflow
    without its amax floor."""
    _interpreted_2x(512, [0, 20, 20, 512], 2, jnp.float16, gate_scale=1.0)


def _bad_k_stays_in_its_sequence(T, cu, S, states):
    """The kernels get the raw k (the op poisons itself): a NaN in k of the first packed sequence
    gives, bitwise, the outputs and final states of the same run with that value 0 everywhere
    except its own sequence from the bad token on (a NaN state crosses no sequence start: the
    wipe gate's 0 · NaN, the segment maps, the states set from h0)."""
    x, cuj, _ = _case(5, 1, T, 1, 2, 64, 64, cu, gate_scale=0.05)
    q, k, v = (x[n].astype(jnp.bfloat16) for n in ("q", "k", "v"))
    h0 = x["initial_state"] if states else None
    t0 = 10

    def run(k):
        return _op(S)(q, k, v, x["g"], x["beta"], initial_state=h0, output_final_state=states,
                      cu_seqlens=cuj, use_qk_l2norm=False)  # fmt: skip

    bad, zero = (jax.jit(run)(k.at[0, t0, 0, 3].set(val)) for val in (jnp.nan, 0.0))
    o, oz = np.asarray(bad[0], np.float32), np.asarray(zero[0], np.float32)
    np.testing.assert_array_equal(o[:, :t0], oz[:, :t0])
    np.testing.assert_array_equal(o[:, cu[1] :], oz[:, cu[1] :])
    if states:
        np.testing.assert_array_equal(np.asarray(bad[1][1:]), np.asarray(zero[1][1:]))


def test_interpret_bad_k_stays_in_its_sequence():
    """S = 2 on a packed lane of 4 chunks without states: the wipe gate resets the state."""
    run_interpreted(_bad_k_stays_in_its_sequence, 256, [0, 64, 256], 2, False)


# ------------------------------------------------------------------------------------------------
# GPU (H200)


@pytest.mark.gpu
@pytest.mark.parametrize("S,states", [(2, False), (7, False), (7, True)])
def test_gpu_bad_k_stays_in_its_sequence(S, states):
    _bad_k_stays_in_its_sequence(4096, [0, 1000, 1000, 4096], S, states)


# one packed lane (an empty sequence, a one-token one, sequences longer than a segment) with
# initial and final states, at every segment count; mild gates so that states cross segments
SLOW = pytest.mark.slow
PACKED = (1, 4096, 2, 4, [0, 1000, 1000, 1001, 2500, 4096])
_refs: dict = {}


def _reference(name, case, dtype):
    """The oracle's outputs and gradients for ``case`` in ``dtype`` (cached: shared by tests)."""
    key = (name, jnp.dtype(dtype).name)
    if key not in _refs:
        x, cu, cts = case
        _refs[key] = _grads(recurrent_gated_delta_rule, x, cu, dtype, cts, reference=True)
    return _refs[key]


def _check(name, case, S, dtype=jnp.bfloat16, *, deterministic=False):
    x, cu, cts = case
    program = _program(_op(S), cu, dtype)
    got = program(x, cts)
    ref32, ref_lo = _reference(name, case, jnp.float32), _reference(name, case, dtype)
    print(f"{name} segments={S}\n" + check_2x(NAMES, got, ref_lo, ref32, floor=1e-5))
    if deterministic:  # the segment combine and every kernel: bitwise the same on a rerun
        for n, a, b in zip(NAMES, got, program(x, cts), strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b)), n
    return got


@pytest.mark.gpu
# S = 1 (the unsplit loops, which every other GDN test runs) and 16 (the most segments) in the
# slow set; quick: 2 and 7 (segments that split and pad)
@pytest.mark.parametrize("S", [pytest.param(1, marks=SLOW), 2, 7, pytest.param(16, marks=SLOW)])
def test_gpu_segments_packed_states(S):
    B, T, H, HV, cu = PACKED
    case = _case(21, B, T, H, HV, 128, 128, cu, gate_scale=0.05)
    got = _check("packed", case, S, deterministic=S == 7)
    key = ("packed", "segments=1")
    if S == 1:
        _refs[key] = got
    elif key in _refs:  # and close to the unsplit kernels (the bf16 staging differs only)
        for name, a, b in zip(NAMES, got, _refs[key], strict=True):
            err = rel_rms(a, b)
            print(f"{name}: vs segments=1 rel rms {err:.2e}")
            assert err < 2e-2, (name, err)


@pytest.mark.gpu
@pytest.mark.slow  # segments at S = 1, 2, 7, 16 with packed states are in the quick set
def test_gpu_segments_dense_f16_and_default_count():
    """Dense batch rows with initial states: S = 7 (T/64 = 32 chunks, padded to 35); f16 io
    (scaled f16 staging of the state in the segment pass) and the default segment count."""
    case = _case(23, 2, 2048, 2, 4, 128, 128, None, gate_scale=0.05)
    _check("dense", case, 7)
    _check("dense", case, None, jnp.float16)


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_long_context_t131072():
    """B1, T = 131072, 16 heads, default segment count: fwd+bwd fits in memory and passes the
    2x rule against the f32 chunked xla path on the GPU (its bf16 run as the dtype reference),
    both compiled as references (``reference_jit``: f32 matmuls at full precision, not TF32).

    With H = HV every head is independent of the others (the loss is a sum over heads), so the
    references (f32 at full precision, 40 s for two heads on the H200) run on the first
    ``REF_HEADS`` heads only and are compared with those heads of the kernels' 16-head run."""
    import gdn_jax

    def xla(q, k, v, g, beta, **kw):
        return gdn_jax.gated_delta_rule(q, k, v, g, beta, implementation="xla", **kw)

    REF_HEADS = 2
    t0 = time.perf_counter()
    x, cu, cts = _case(27, 1, 131072, 16, 16, 128, 128, None, gate_scale=0.05)
    head_axis = {"q": 2, "k": 2, "v": 2, "g": 2, "beta": 2, "initial_state": 1}
    x_ref = {n: lax.slice_in_dim(a, 0, REF_HEADS, axis=head_axis[n]) for n, a in x.items()}
    cts_ref = (cts[0][:, :, :REF_HEADS], cts[1][:, :REF_HEADS])
    print(f"inputs: {time.perf_counter() - t0:.1f} s")  # where a slow run spends its time
    t = time.perf_counter()
    out = jax.block_until_ready(_grads(_op(None), x, cu, jnp.bfloat16, cts))
    print(f"pallas: {time.perf_counter() - t:.1f} s (compile + run)")
    # output axes of (o, final_state, dq, dk, dv, dg, dbeta, dh0) that hold the head
    runs = {"pallas": [lax.slice_in_dim(a, 0, REF_HEADS, axis=ax)
                       for a, ax in zip(out, (2, 1, 2, 2, 2, 2, 2, 1), strict=True)]}  # fmt: skip
    del out
    for name, dtype in (("xla f32", jnp.float32), ("xla bf16", jnp.bfloat16)):
        t = time.perf_counter()
        runs[name] = jax.block_until_ready(_grads(xla, x_ref, cu, dtype, cts_ref, reference=True))
        print(f"{name}: {time.perf_counter() - t:.1f} s (compile + run, {REF_HEADS} heads)")
    print("T=131072\n" + check_2x(NAMES, runs["pallas"], runs["xla bf16"], runs["xla f32"]))
