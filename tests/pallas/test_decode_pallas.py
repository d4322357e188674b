"""Pallas Mosaic GPU decode kernel (gated_delta_rule_step / kda_step / gdn2_step).

CPU: the kernel under the Mosaic GPU interpreter at tiny shapes against the f32 token recurrence
(the xla step on upcast inputs), extreme gates, the selector, donation/aliasing and the CUDA
lowering. GPU (``-m gpu``, H200): serving shapes against the f32 recurrence with the 2x rule of
docs/design.md, the state updated in place (same buffer, no copy in the compiled HLO), and packed
prefill followed by decode steps equal to one long prefill.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gdn_cases import run_interpreted

import gdn_jax
from gdn_jax.ops import _step_pallas
from gdn_jax.ops._step_pallas import step_pallas
from gdn_jax.testing import check_2x, random_inputs, rel_rms, upcast
from pallas_kernels import _compat as pk

STEPS = {"gdn": gdn_jax.gated_delta_rule_step, "kda": gdn_jax.kda_step, "gdn2": gdn_jax.gdn2_step}
VARIANTS = tuple(STEPS)


def _inputs(variant, seed, *, B, T, H, HV, D, dtype=jnp.bfloat16, gate_scale=1.0):
    x = random_inputs(
        seed, B=B, T=T, H=H, HV=HV, K=D, V=D, variant=variant, dtype=dtype, gate_scale=gate_scale
    )
    gates = (x["b"], x["w"]) if variant == "gdn2" else (x["beta"],)
    return (x["q"], x["k"], x["v"], x["g"], *gates), x["initial_state"]


def _step(variant, args, state, implementation, **kw):
    return STEPS[variant](*args, state, use_qk_l2norm=True, implementation=implementation, **kw)


# one compilation per (variant, implementation, shapes) instead of op-by-op dispatch (GPU time)
_step_jit = jax.jit(_step, static_argnums=(0, 3))


def _check(variant, args, state, *, tight: bool, jit: bool = False):
    """Pallas vs the f32 recurrence on the same (rounded) inputs, and the 2x rule on o."""
    step = _step_jit if jit else _step
    ref32 = step(variant, upcast(args), state, "xla")
    ref_lo = step(variant, args, state, "xla")
    got = step(variant, args, state, "pallas")
    assert got[0].dtype == args[2].dtype and got[1].dtype == jnp.float32
    report = check_2x(("o", "state"), got, ref_lo, ref32)
    # the kernel computes in f32: its state matches the f32 recurrence on the same inputs tightly
    if tight:
        assert rel_rms(got[1], ref32[1]) <= 1e-5, report
    print(f"{variant}: {report}")
    return got


# ------------------------------------------------------------------------------------------------
# CPU: Mosaic GPU interpreter (tiny shapes: B=2, H=2, HV=4 (GVA), K=V=64)


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("variant", VARIANTS)
def test_interpret_matches_recurrence(variant, T):
    args, state = _inputs(variant, 0, B=2, T=T, H=2, HV=4, D=64)
    run_interpreted(_check, variant, args, state, tight=True)


@pytest.mark.parametrize("variant", ["gdn", "gdn2"])
def test_interpret_wide_value_blocks(variant, monkeypatch):
    """64 value columns per CTA (one CTA per head at V = 64): the large-batch form (the tiny
    shapes here get 32 by default, value_block)."""
    monkeypatch.setattr(_step_pallas, "BLOCK_V", 64)
    args, state = _inputs(variant, 5, B=1, T=3, H=2, HV=4, D=64)
    run_interpreted(_check, variant, args, state, tight=True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_interpret_extreme_gates(variant):
    """g = 0 (no decay) and g = −20 (state wiped), erase/write gates 0 and 1."""
    args, state = _inputs(variant, 1, B=2, T=3, H=2, HV=4, D=64)
    for g_val, b_val in ((0.0, 0.0), (0.0, 1.0), (-20.0, 1.0), (-20.0, 0.0)):
        a = list(args)
        a[3] = jnp.full_like(a[3], g_val)
        a[4:] = [jnp.full_like(x, b_val) for x in a[4:]]
        o, s = run_interpreted(_check, variant, tuple(a), state, tight=True)
        assert bool(jnp.all(jnp.isfinite(o.astype(jnp.float32)))) and bool(jnp.all(jnp.isfinite(s)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_interpret_other_dtypes(dtype):
    args, state = _inputs("kda", 2, B=2, T=1, H=4, HV=4, D=64, dtype=dtype)
    run_interpreted(_check, "kda", args, state, tight=True)


def test_interpret_no_l2norm_and_scale():
    args, state = _inputs("gdn2", 3, B=2, T=2, H=1, HV=4, D=64)
    kw = dict(scale=0.3, use_qk_l2norm=False)
    ref = STEPS["gdn2"](*upcast(args), state, implementation="xla", **kw)
    got = run_interpreted(STEPS["gdn2"], *args, state, implementation="pallas", **kw)
    assert rel_rms(got[1], ref[1]) <= 1e-5
    assert rel_rms(got[0], ref[0]) <= 1e-2


@pytest.mark.parametrize("variant", VARIANTS)
def test_interpret_poison_added_in_the_kernel(variant):
    """Non-finite inputs: the kernel puts the op's NaN into o and the state itself (as the xla
    path's recurrence has them): a NaN in v (token 1, head 0, column 3: that column from token 1
    on), an inf in k of key head 1 (token 2: its two value heads, GVA, from token 2 on), a NaN in
    q (token 0, key head 0: that token's outputs of value heads 0 and 1 only, not the state), a
    NaN gate (batch row 1, token 0, value head 3: the whole head). Everything else equals the
    clean inputs' step."""
    args, state = _inputs(variant, 6, B=2, T=3, H=2, HV=4, D=64)
    a = list(args)
    a[2] = a[2].at[0, 1, 0, 3].set(jnp.nan)
    a[1] = a[1].at[0, 2, 1, 5].set(jnp.inf)
    a[0] = a[0].at[1, 0, 0, 7].set(jnp.nan)
    a[3] = a[3].at[1, 0, 3].set(jnp.nan)
    ref = _step(variant, upcast(tuple(a)), state, "xla")
    got = run_interpreted(_step, variant, tuple(a), state, "pallas")
    for x, r in zip(got, ref, strict=True):
        np.testing.assert_array_equal(np.isnan(np.asarray(x, np.float32)), np.isnan(r))
    want_s = np.zeros(state.shape, bool)
    want_s[0, 0, :, 3] = want_s[0, 2:4] = want_s[1, 3] = True
    np.testing.assert_array_equal(np.isnan(np.asarray(got[1])), want_s)
    bad_o = np.isnan(np.asarray(got[0], np.float32))
    assert bad_o[1, 0, :2].all() and not bad_o[1, 1:, :2].any()  # the bad q's token only
    ok = ~np.isnan(np.asarray(ref[1]))
    assert rel_rms(np.asarray(got[1])[ok], np.asarray(ref[1])[ok]) <= 1e-5


@pytest.mark.parametrize(
    "variant,edit",
    [("gdn", "g_posinf"), ("kda", "g_neginf"), ("gdn", "beta_nan"), ("gdn2", "b_inf"),
     ("gdn2", "w_nan"), ("kda", "g_positive")],
)  # fmt: skip
def test_interpret_gate_edge_values(variant, edit):
    """The gates' edge values read in the kernel as the op's sanitation has them, against the xla
    step (same NaN pattern, same finite values): +inf g poisons the head, −inf g decays the
    state to 0 and poisons nothing, a traced g > 0 is clamped to 0, a non-finite β / b poisons
    the head, a NaN w (GDN2) its value column."""
    args, state = _inputs(variant, 7, B=2, T=3, H=2, HV=4, D=64)
    a = list(args)
    at = (1, 1, 2)  # batch row 1, token 1, value head 2
    if edit.startswith("g_"):
        val = {"g_posinf": jnp.inf, "g_neginf": -jnp.inf, "g_positive": 0.5}[edit]
        a[3] = a[3].at[at].set(val)
    elif edit in ("beta_nan", "b_inf"):
        a[4] = a[4].at[at].set(jnp.nan if edit == "beta_nan" else jnp.inf)
    else:
        a[5] = a[5].at[at + (9,)].set(jnp.nan)

    def step(impl):  # traced gates (a concrete g > 0 is refused before any kernel)
        return jax.jit(lambda *x: _step(variant, x[:-1], x[-1], impl))(*a, state)

    ref = step("xla")
    got = run_interpreted(step, "pallas")
    for x, r in zip(got, ref, strict=True):
        x, r = np.asarray(x, np.float32), np.asarray(r, np.float32)
        np.testing.assert_array_equal(np.isnan(x), np.isnan(r))
        ok = ~np.isnan(r)
        assert rel_rms(x[ok], r[ok]) <= 1e-2
    poisoned = edit in ("g_posinf", "beta_nan", "b_inf", "w_nan")
    assert bool(np.isnan(np.asarray(got[1])).any()) == poisoned


def test_interpret_donated_state_is_consumed():
    """Jitted with the state donated, the caller's state buffer is given to the kernel."""
    args, state = _inputs("gdn", 4, B=2, T=1, H=2, HV=4, D=64)
    ref = _step("gdn", upcast(args), state, "xla")
    mine = state + 0  # a buffer of our own to donate
    with pk.use_mode("interpret"):
        try:
            f = jax.jit(lambda *a: _step("gdn", a[:-1], a[-1], "pallas"), donate_argnums=(5,))
            o, s = f(*args, mine)
        finally:
            pk.reset_interpreter()
    assert mine.is_deleted()
    assert rel_rms(s, ref[1]) <= 1e-5


def test_prefill_then_decoderun_interpreted():
    """Packed prefill (cu_seqlens) then two Pallas decode steps == the whole sequences at once."""
    N, P, D, H, HV = 2, (5, 9), 64, 2, 4
    steps = 2
    x = random_inputs(5, B=N, T=max(P) + steps, H=H, HV=HV, K=D, V=D)
    names = ("q", "k", "v", "g", "beta")
    cu = jnp.asarray(np.cumsum((0,) + P), jnp.int32)
    packed = [jnp.concatenate([x[n][i, : P[i]] for i in range(N)])[None] for n in names]
    kw = dict(use_qk_l2norm=True, implementation="xla")
    _, state = gdn_jax.gated_delta_rule(*packed, cu_seqlens=cu, output_final_state=True, **kw)
    outs = []
    for t in range(steps):  # token P[i] + t of every sequence
        tok = [jnp.stack([x[n][i, P[i] + t] for i in range(N)])[:, None] for n in names]
        o, state = run_interpreted(
            gdn_jax.gated_delta_rule_step, *tok, state, use_qk_l2norm=True,
            implementation="pallas",
        )  # fmt: skip
        outs.append(o[:, 0])
    for i in range(N):
        full = [x[n][i : i + 1, : P[i] + steps] for n in names]
        o_ref, s_ref = gdn_jax.gated_delta_rule(*full, output_final_state=True, **kw)
        for t in range(steps):
            assert rel_rms(outs[t][i], o_ref[0, P[i] + t]) <= 1e-4
        assert rel_rms(state[i], s_ref[0]) <= 1e-4


@pytest.mark.parametrize("variant", ["gdn", "gdn2"])
def test_layer_decode_cache_with_pallas_steps(variant, monkeypatch):
    """GatedDeltaNet.extend: an xla prefill, then one-token extends on the Pallas decode kernel
    (the layer passes its ``implementation`` to the step op), equals one forward pass."""
    from flax import nnx

    from gdn_jax.nn import GatedDeltaNet
    from gdn_jax.ops import _step_pallas

    calls = []

    def spy(*a, **kw):
        calls.append(1)
        return step_pallas(*a, **kw)

    monkeypatch.setattr(_step_pallas, "step_pallas", spy)

    layer = GatedDeltaNet(
        32, variant=variant, num_heads=2, head_dim=64, num_v_heads=4, v_head_dim=64,
        implementation="xla", rngs=nnx.Rngs(0),
    )  # fmt: skip
    x = jax.random.normal(jax.random.key(1), (2, 7, 32), jnp.float32)
    want = layer(x)
    y0, cache = layer.extend(x[:, :5], layer.init_cache(2))
    layer.implementation = "pallas"  # the one-token extends below must run the kernel
    ys = [y0]
    with pk.use_mode("interpret"):
        try:
            for t in (5, 6):
                y, cache = layer.extend(x[:, t : t + 1], cache)
                ys.append(y)
        finally:
            pk.reset_interpreter()
    got = jnp.concatenate(ys, axis=1)
    assert len(calls) == 2
    assert rel_rms(got, want) <= 1e-5, rel_rms(got, want)


# ------------------------------------------------------------------------------------------------
# CPU: selector, refusals, the real CUDA lowering with the state aliased


def test_not_implemented_and_fallback():
    args, state = _inputs("gdn", 0, B=1, T=1, H=1, HV=2, D=64)  # scalar gates need HV % 4 == 0
    with pk.use_mode("interpret"), pytest.raises(NotImplementedError, match="HV % 4"):
        step_pallas(*args, None, state, scale=0.125, use_qk_l2norm=False)
    with pk.use_mode("interpret"):
        o, s = gdn_jax.gated_delta_rule_step(*args, state, implementation=("pallas", "xla"))
    ref = gdn_jax.gated_delta_rule_step(*args, state, implementation="xla")
    assert np.array_equal(np.asarray(s), np.asarray(ref[1]))
    x = random_inputs(0, B=1, T=1, H=1, HV=4, K=32, V=64)
    bad = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    with pk.use_mode("interpret"), pytest.raises(NotImplementedError, match="K, V in"):
        step_pallas(*bad, None, x["initial_state"], scale=0.1, use_qk_l2norm=False)
    if not pk.is_hopper():
        with pytest.raises(ExceptionGroup):
            gdn_jax.gated_delta_rule_step(*args, state, implementation="pallas")
    with pytest.raises(ValueError, match="implementation"):
        gdn_jax.gated_delta_rule_step(*args, state, implementation="triton")


def test_value_block_rule(monkeypatch):
    """32 value columns per CTA while 64 would give fewer than two CTAs per SM; the step applies
    the rule unless BLOCK_V forces a width."""
    # H200 (132 SMs), HV 16, V 128: 64-column blocks give B · 32 CTAs, < 264 up to B 8
    assert [_step_pallas.value_block(B, 16, 128, 132) for B in (1, 2, 4, 8, 9, 64, 256)] == [
        32, 32, 32, 32, 64, 64, 64,
    ]  # fmt: skip
    assert _step_pallas.value_block(8, 16, 64, 132) == 32  # V 64: one block per head
    assert _step_pallas.value_block(17, 16, 64, 132) == 64
    assert _step_pallas.value_block(1, 16, 128, 16) == 64  # a small GPU
    seen = []
    monkeypatch.setattr(_step_pallas, "decode_step", lambda *a: seen.append(a[-1].block_v) or a)
    monkeypatch.setattr(_step_pallas, "sm_count", lambda: 132)
    with pk.use_mode("interpret"):
        for B in (1, 64):
            x = random_inputs(0, B=B, T=1, H=4, HV=16, K=128, V=128)
            step_pallas(x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["initial_state"],
                        scale=0.1, use_qk_l2norm=False)  # fmt: skip
        monkeypatch.setattr(_step_pallas, "BLOCK_V", 128)
        step_pallas(x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["initial_state"],
                    scale=0.1, use_qk_l2norm=False)  # fmt: skip
    assert seen == [32, 64, 128]


@pytest.mark.parametrize("variant,D,HV,T,block_v", [("gdn", 128, 32, 1, 64), ("kda", 64, 4, 3, 64),
                                                    ("gdn2", 128, 16, 2, 64),
                                                    ("gdn2", 128, 16, 2, 32)])  # fmt: skip
def test_lowers_for_cuda_with_state_aliased(variant, D, HV, T, block_v, monkeypatch):
    monkeypatch.setattr(_step_pallas, "BLOCK_V", block_v)
    B, H = 8, 4
    bf, f = jnp.bfloat16, jnp.float32
    S = jax.ShapeDtypeStruct
    gk = (B, T, HV) if variant == "gdn" else (B, T, HV, D)
    gates = [S(gk, f), S((B, T, HV, D) if variant == "gdn2" else (B, T, HV), f)]
    if variant == "gdn2":
        gates.append(S((B, T, HV, D), f))
    args = [S((B, T, H, D), bf), S((B, T, H, D), bf), S((B, T, HV, D), bf), *gates]
    state = S((B, HV, D, D), f)
    n = len(args)

    def f_(*a):
        return _step(variant, a[:n], a[n], "pallas")

    with pk.cuda_lowering_mesh():
        txt = jax.jit(f_, donate_argnums=(n,)).trace(*args, state)
        txt = txt.lower(lowering_platforms=("cuda",)).as_text()
    calls = [ln for ln in txt.splitlines() if "custom_call @mosaic_gpu" in ln]
    assert len(calls) == 1 and re.search(r"\\00gdn_decode_step\\00", calls[0])
    # the kernel writes the state operand's buffer, and the donated argument is that buffer
    alias = re.search(r"output_operand_aliases = \[(.*?)\]\}", calls[0]).group(1)
    assert f"output_tuple_indices = [1], operand_index = {n}" in alias, alias
    main = next(ln for ln in txt.splitlines() if "func.func public @main" in ln)
    assert f"%arg{n}: tensor<{B}x{HV}x{D}x{D}xf32> {{tf.aliasing_output = 1" in main, main
    # the kernel makes the sanitation of non-finite inputs and puts the NaN into o and the state:
    # the step is the kernel and the gates' casts to f32, no XLA pass over inputs or state
    ops = set(re.findall(r"= (stablehlo\.\w+)", txt))
    assert ops <= {"stablehlo.custom_call", "stablehlo.convert"}, ops


# ------------------------------------------------------------------------------------------------
# GPU (H200)


@pytest.mark.gpu
def test_gpu_state_updated_in_place():
    """Same device buffer in and out, and no copy of the state in the compiled step."""
    args, state = _inputs("gdn2", 9, B=64, T=1, H=16, HV=16, D=128)
    ref = _step("gdn2", upcast(args), state, "xla")
    n = len(args)
    f = jax.jit(lambda *a: _step("gdn2", a[:n], a[n], "pallas"), donate_argnums=(n,))
    hlo = f.lower(*args, state).compile().as_text()
    shape = "f32[64,16,128,128]"
    copies = [ln for ln in hlo.splitlines() if " copy(" in ln and shape in ln]
    assert not copies, copies
    mine = state + 0
    ptr = mine.unsafe_buffer_pointer()
    o, s = f(*args, mine)
    assert s.unsafe_buffer_pointer() == ptr
    assert rel_rms(s, ref[1]) <= 1e-5
    a, b = f(*args, s + 0), f(*args, s + 0)  # deterministic
    assert np.array_equal(np.asarray(a[1]), np.asarray(b[1]))


GPU_CASES = [
    # variant, B, T, H, HV: batch 64 and 256, 1-3 tokens, GVA or not, across the variants
    ("gdn", 256, 3, 16, 32),
    ("kda", 64, 2, 16, 32),
    ("gdn2", 256, 1, 16, 16),
    pytest.param("gdn", 64, 1, 16, 16, marks=pytest.mark.slow),
    pytest.param("kda", 256, 1, 16, 16, marks=pytest.mark.slow),
    pytest.param("gdn2", 64, 1, 16, 32, marks=pytest.mark.slow),
]


@pytest.mark.gpu
@pytest.mark.parametrize("variant,B,T,H,HV", GPU_CASES)
def test_gpu_matches_recurrence(variant, B, T, H, HV):
    args, state = _inputs(variant, 7, B=B, T=T, H=H, HV=HV, D=128)
    _check(variant, args, state, tight=False, jit=True)


@pytest.mark.gpu
@pytest.mark.parametrize("block_v", [32, 64])
@pytest.mark.parametrize("variant,B", [("gdn", 1), ("gdn2", 8)])
def test_gpu_small_batch(variant, B, block_v, monkeypatch):
    """B1 and B8, where 32 value columns per CTA give more CTAs (the default there: value_block),
    and 64 (bench_decode.py --block-v)."""
    monkeypatch.setattr(_step_pallas, "BLOCK_V", block_v)
    args, state = _inputs(variant, 8, B=B, T=2, H=16, HV=16, D=128)
    _check(variant, args, state, tight=False)  # eager: BLOCK_V is read when the step is traced


def _packed_prefill_then_decode(P, steps, H, HV, D, impl):
    """Packed prefill (gated_delta_rule with cu_seqlens) then ``steps`` decode steps for all
    sequences at once, vs each whole sequence through the f32 token recurrence (2x rule)."""
    N = len(P)
    x = random_inputs(11, B=N, T=max(P) + steps, H=H, HV=HV, K=D, V=D)
    names = ("q", "k", "v", "g", "beta")
    cu = jnp.asarray(np.cumsum((0,) + tuple(P)), jnp.int32)

    @jax.jit
    def split(xs):
        packed = [jnp.concatenate([xs[n][i, : P[i]] for i in range(N)])[None] for n in names]
        kw = dict(use_qk_l2norm=True, implementation=impl)
        _, state = gdn_jax.gated_delta_rule(*packed, cu_seqlens=cu, output_final_state=True, **kw)
        outs = []
        for t in range(steps):
            tok = [jnp.stack([xs[n][i, P[i] + t] for i in range(N)])[:, None] for n in names]
            o, state = gdn_jax.gated_delta_rule_step(*tok, state, **kw)
            outs.append(o[:, 0])
        return jnp.stack(outs, 1), state  # [N, steps, HV, V], [N, HV, K, V]

    L = [p + steps for p in P]
    off = np.cumsum([0] + L)
    cu_l = jnp.asarray(off, jnp.int32)

    @jax.jit
    def long(xs):  # every whole sequence in one packed recurrence
        full = [jnp.concatenate([xs[n][i, : L[i]] for i in range(N)])[None] for n in names]
        o, s = gdn_jax.reference.recurrent_gated_delta_rule(
            *full, cu_seqlens=cu_l, output_final_state=True, use_qk_l2norm=True
        )
        return jnp.stack([o[0, off[i] + P[i] : off[i + 1]] for i in range(N)]), s

    def cast(dtype):
        return {n: (x[n].astype(dtype) if n in "qkv" else x[n]) for n in names}

    got = split(cast(jnp.bfloat16))
    ref32, ref_lo = long(cast(jnp.float32)), long(cast(jnp.bfloat16))
    print(check_2x(("o", "state"), got, ref_lo, ref32))


@pytest.mark.gpu
def test_gpu_packed_prefill_then_decode():
    """Packed prefill on the Pallas GDN kernels, then 4 Pallas decode steps == one long prefill."""
    _packed_prefill_then_decode((700, 1, 64, 65, 1000, 333, 128, 2), 4, 16, 32, 128, "pallas")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
def test_gpu_extreme_gates(variant):
    """On the shapes of test_gpu_matches_recurrence's first case per variant (its programs)."""
    B, T, H, HV = next(c[1:] for c in GPU_CASES if isinstance(c, tuple) and c[0] == variant)
    args, state = _inputs(variant, 8, B=B, T=T, H=H, HV=HV, D=128)
    for g_val, b_val in ((0.0, 0.0), (0.0, 1.0), (-20.0, 1.0), (-20.0, 0.0)):
        a = list(args)
        a[3] = jnp.full_like(a[3], g_val)
        a[4:] = [jnp.full_like(x, b_val) for x in a[4:]]
        _check(variant, tuple(a), state, tight=False, jit=True)
