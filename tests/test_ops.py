"""The public ops (implementation "xla") against the token recurrence: values, every gradient,
low-precision dtypes, packed sequences, state passing, decode steps, determinism and memory."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gdn_cases import OPS, RECURRENT, STEPS, positional, value_and_grads

import gdn_jax
from gdn_jax.testing import check_2x, random_inputs, rel_rms, upcast

XLA = dict(implementation="xla")


@pytest.mark.parametrize("variant", ["gdn", "kda", "gdn2"])
@pytest.mark.parametrize(
    "T,H,HV,K,V,C,l2",
    [(65, 2, 4, 16, 8, 32, True), (63, 1, 1, 8, 16, 16, False), (130, 1, 2, 16, 16, 64, True)],
)
def test_xla_values_and_gradients_f32(variant, T, H, HV, K, V, C, l2):
    x = random_inputs(10, B=2, T=T, H=H, HV=HV, K=K, V=V, variant=variant)
    args, h0 = positional(x, variant), x["initial_state"]
    kw = dict(use_qk_l2norm=l2)
    (o_ref, s_ref), g_ref = value_and_grads(RECURRENT[variant], args, h0, **kw)
    (o, s), g = value_and_grads(OPS[variant], args, h0, chunk_size=C, **XLA, **kw)
    assert rel_rms(o, o_ref) <= 1e-5
    assert rel_rms(s, s_ref) <= 1e-5
    names = ["dq", "dk", "dv", "dg"] + (["db", "dw"] if variant == "gdn2" else ["dbeta"]) + ["dh0"]
    for name, a, b in zip(names, g, g_ref, strict=True):
        assert rel_rms(a, b) <= 1e-5, name


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("variant", ["gdn", "gdn2"])
def test_low_precision_two_times_rule(variant, dtype):
    """Error vs the f32 oracle is at most 2x that of the recurrence run in the same dtype."""
    x = random_inputs(11, B=1, T=100, H=2, HV=2, K=16, V=16, variant=variant, dtype=dtype)
    args, h0 = positional(x, variant), x["initial_state"]
    kw = dict(use_qk_l2norm=True)
    (o32, s32), g32 = value_and_grads(RECURRENT[variant], upcast(args), h0, **kw)
    (o_lo, s_lo), g_lo = value_and_grads(RECURRENT[variant], args, h0, **kw)
    (o, s), g = value_and_grads(OPS[variant], args, h0, **XLA, **kw)
    assert o.dtype == dtype and s.dtype == jnp.float32
    names = ["o", "final_state"] + [f"d{i}" for i in range(len(g))]
    check_2x(names, (o, s, *g), (o_lo, s_lo, *g_lo), (o32, s32, *g32), floor=1e-6)


@pytest.mark.parametrize("variant", ["gdn", "kda"])
@pytest.mark.slow
def test_packed_equals_separate(variant):
    lengths = [0, 37, 64, 0, 90]
    cu = jnp.asarray(np.cumsum([0] + lengths), jnp.int32)
    T = int(cu[-1])
    x = random_inputs(12, B=1, T=T, H=1, HV=2, K=16, V=16, variant=variant, n_states=5)
    args, h0 = positional(x, variant), x["initial_state"]
    (o, s), g = value_and_grads(OPS[variant], args, h0, cu_seqlens=cu, chunk_size=32, **XLA)
    (o_r, s_r), g_r = value_and_grads(RECURRENT[variant], args, h0, cu_seqlens=cu)
    assert rel_rms(o, o_r) <= 1e-5 and rel_rms(s, s_r) <= 1e-5
    for a, b in zip(g, g_r, strict=True):
        assert rel_rms(a, b) <= 1e-5
    # Each sequence alone gives the same output rows and final state.
    for n, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        if hi == lo:
            np.testing.assert_array_equal(s[n], h0[n])  # empty: final state = initial state
            continue
        part = tuple(a[:, lo:hi] for a in args)
        o_n, s_n = jax.jit(
            functools.partial(OPS[variant], output_final_state=True, chunk_size=32, **XLA)
        )(*part, initial_state=h0[n : n + 1])
        assert rel_rms(o[:, lo:hi], o_n) <= 1e-5 and rel_rms(s[n], s_n[0]) <= 1e-5


@pytest.mark.parametrize("variant", ["gdn", "gdn2"])
@pytest.mark.slow
def test_split_with_state_passing_equals_one_pass(variant):
    x = random_inputs(13, B=2, T=150, H=1, HV=2, K=16, V=8, variant=variant)
    args, h0 = positional(x, variant), x["initial_state"]
    r = np.random.default_rng(3)
    do = jnp.asarray(r.standard_normal(x["v"].shape), jnp.float32)
    ds = jnp.asarray(r.standard_normal(h0.shape), jnp.float32)
    op = functools.partial(OPS[variant], use_qk_l2norm=True)

    def whole(args, h0):
        o, s = op(*args, initial_state=h0, output_final_state=True, **XLA)
        return jnp.sum(o * do) + jnp.sum(s * ds), (o, s)

    def split(args, h0, at=77):
        o1, s1 = op(*(a[:, :at] for a in args), initial_state=h0, output_final_state=True, **XLA)
        o2, s2 = op(*(a[:, at:] for a in args), initial_state=s1, output_final_state=True, **XLA)
        o = jnp.concatenate([o1, o2], axis=1)
        return jnp.sum(o * do) + jnp.sum(s2 * ds), (o, s2)

    grads = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))
    (_, (o_a, s_a)), g_a = grads(whole)(args, h0)
    (_, (o_b, s_b)), g_b = grads(split)(args, h0)
    assert rel_rms(o_b, o_a) <= 1e-5 and rel_rms(s_b, s_a) <= 1e-5
    for a, b in zip(jax.tree.leaves(g_b), jax.tree.leaves(g_a), strict=True):
        assert rel_rms(a, b) <= 1e-5  # includes d initial_state


@pytest.mark.parametrize("variant", ["gdn", "kda", "gdn2"])
def test_step_ops_equal_recurrence(variant):
    x = random_inputs(14, B=3, T=9, H=1, HV=2, K=8, V=8, variant=variant)
    args, h0 = positional(x, variant), x["initial_state"]
    o_ref, s_ref = RECURRENT[variant](
        *args, initial_state=h0, output_final_state=True, use_qk_l2norm=True
    )
    step = jax.jit(lambda *a: STEPS[variant](*a, use_qk_l2norm=True), donate_argnums=(len(args),))
    state, outs = jnp.array(h0), []
    for lo, hi in ((0, 1), (1, 4), (4, 5), (5, 9)):  # one token and a few tokens at a time
        o, state = step(*(a[:, lo:hi] for a in args), state)
        outs.append(o)
    assert rel_rms(jnp.concatenate(outs, axis=1), o_ref) <= 1e-5
    assert rel_rms(state, s_ref) <= 1e-5


def test_same_call_twice_is_bitwise_equal():
    x = random_inputs(15, B=2, T=90, H=2, HV=4, K=16, V=16, dtype=jnp.bfloat16)
    args, h0 = positional(x, "gdn"), x["initial_state"]
    a = value_and_grads(OPS["gdn"], args, h0, **XLA)
    b = value_and_grads(OPS["gdn"], args, h0, **XLA)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


@pytest.mark.parametrize("cu", [None, [0, 100, 100, 256]])
def test_backward_residuals_stay_within_memory_bound(cu):
    """No K×V state per token is kept: residuals are O(T·(K+V+C)) + O(T/C·K·V)."""
    from jax._src.ad_checkpoint import saved_residuals

    B, T, H, HV, K, V, C = (2, 256, 1, 2, 64, 64, 16) if cu is None else (1, 256, 1, 2, 64, 64, 16)
    x = random_inputs(16, B=B, T=T, H=H, HV=HV, K=K, V=V, n_states=None if cu is None else 3)
    cu = None if cu is None else jnp.asarray(cu, jnp.int32)

    def f(q, k, v, g, beta, h0):
        o, s = gdn_jax.gated_delta_rule(
            q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm=True,
            cu_seqlens=cu, chunk_size=C, **XLA,
        )  # fmt: skip
        return jnp.sum(o) + jnp.sum(s)

    res = saved_residuals(f, *positional(x, "gdn"), x["initial_state"])
    sizes = [int(np.prod(a.shape)) for a, _ in res]
    n_chunks = T // C + (0 if cu is None else 3)
    per_token = B * T * HV * (K + V + C)
    per_chunk_state = B * n_chunks * HV * K * V
    assert sum(sizes) <= 8 * per_token + per_chunk_state + 3 * HV * K * V
    assert max(sizes) <= per_chunk_state  # one state per chunk, never one per token
    states = [a.shape for a, _ in res if a.shape[-2:] == (K, V) and len(a.shape) == 5]
    assert states == [(B, n_chunks, HV, K, V)]  # exactly one state per chunk


def test_selector_falls_back_and_rejects_unknown():
    x = random_inputs(17, B=1, T=20, H=1, HV=1, K=8, V=8, dtype=jnp.float32)
    args = positional(x, "gdn")
    o_x, _ = gdn_jax.gated_delta_rule(*args, implementation="xla")
    # f32 inputs are not served by the Pallas kernels: the sequence falls back to xla.
    o_s, _ = gdn_jax.gated_delta_rule(*args, implementation=("pallas", "xla"))
    np.testing.assert_array_equal(np.asarray(o_x), np.asarray(o_s))
    with pytest.raises(ExceptionGroup):
        gdn_jax.gated_delta_rule(*args, implementation="pallas")
    with pytest.raises(ValueError, match="implementation"):
        gdn_jax.gated_delta_rule(*args, implementation="triton")


def test_default_order_per_variant(monkeypatch):
    """Off Hopper every op runs xla; on Hopper every variant and the decode steps try Pallas
    first, falling back to xla."""
    from gdn_jax import ops

    assert all(ops.default_implementations(v) == ("xla",) for v in ("gdn", "kda", "step"))
    monkeypatch.setattr(ops, "_on_hopper", lambda: True)
    assert ops.default_implementations("gdn") == ("pallas", "xla")
    assert ops.default_implementations("step") == ("pallas", "xla")
    for v in ("kda", "gdn2", "short_conv", "lm_head"):
        assert ops.default_implementations(v) == ("pallas", "xla")
    assert ops.with_xla_fallback(None) is None
    assert ops.with_xla_fallback("pallas") == ("pallas", "xla")
    assert ops.with_xla_fallback(("xla", "pallas")) == ("xla", "pallas")


def test_broken_kernel_import_raises(monkeypatch):
    """A kernel module that fails to import raises ImportError: neither NotImplementedError nor a
    silent fall-back to xla."""
    import sys

    from gdn_jax import ops

    monkeypatch.setitem(sys.modules, "gdn_jax.ops._channel_pallas", None)
    with pytest.raises(ImportError) as info:
        ops._pallas("kda")
    assert not isinstance(info.value, NotImplementedError)
    x = random_inputs(19, B=1, T=20, H=1, HV=1, K=64, V=64, variant="kda")
    args = [x[n].astype(jnp.bfloat16) for n in ("q", "k", "v")] + [x["g"], x["beta"]]
    with pytest.raises(ImportError):
        gdn_jax.kda(*args, implementation=("pallas", "xla"))
    with pytest.raises(ValueError, match="variant"):
        ops._pallas("gdn3")


def test_empty_time_axis():
    x = random_inputs(18, B=2, T=0, H=1, HV=1, K=8, V=8)
    o, s = gdn_jax.gated_delta_rule(
        *positional(x, "gdn"), initial_state=x["initial_state"], output_final_state=True
    )
    assert o.shape == (2, 0, 1, 8)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(x["initial_state"]))


@pytest.mark.parametrize("variant", ["gdn", "gdn2"])
def test_packed_prefill_then_decode_equals_one_long_prefill(variant):
    """Serving: prefill several prompts packed with cu_seqlens, then decode each one token at a
    time from the final states; equals running each sequence in one pass."""
    prompt, extra, N = [5, 0, 23], 4, 3
    total = [p + extra for p in prompt]
    x = random_inputs(19, B=N, T=max(total), H=1, HV=2, K=8, V=8, variant=variant)
    args = positional(x, variant)
    cu = jnp.asarray(np.cumsum([0] + prompt), jnp.int32)
    packed = tuple(
        jnp.concatenate([a[n : n + 1, : prompt[n]] for n in range(N)], axis=1) for a in args
    )
    _, states = OPS[variant](*packed, cu_seqlens=cu, output_final_state=True, **XLA)
    step = jax.jit(STEPS[variant], donate_argnums=(len(args),))
    outs = []
    for t in range(extra):
        tok = tuple(jnp.stack([a[n, prompt[n] + t] for n in range(N)])[:, None] for a in args)
        o, states = step(*tok, states)
        outs.append(o[:, 0])
    for n in range(N):
        o_ref, s_ref = RECURRENT[variant](
            *(a[n : n + 1, : total[n]] for a in args), output_final_state=True
        )
        got = jnp.stack([o[n] for o in outs])
        assert rel_rms(got, o_ref[0, prompt[n] :]) <= 1e-5
        assert rel_rms(states[n], s_ref[0]) <= 1e-5


def test_decode_step_updates_state_in_place():
    """With the state donated, the compiled step aliases the new state to the old buffer."""
    x = random_inputs(20, B=4, T=1, H=1, HV=2, K=8, V=8)
    args = positional(x, "gdn")
    step = jax.jit(gdn_jax.gated_delta_rule_step, donate_argnums=(5,))
    text = step.lower(*args, x["initial_state"]).compile().as_text()
    assert "input_output_alias" in text
