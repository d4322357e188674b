"""Hostile inputs and edge values: each gets a clear ValueError or a correct, finite answer
(docs/ops.md, "Bad input and edge values")."""

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental import checkify

import gdn_jax
from gdn_jax.models import HybridLM, get_config
from gdn_jax.nn import GatedDeltaNet
from gdn_jax.reference import recurrent as rec
from gdn_jax.testing import random_inputs

f32 = jnp.float32
OPS = {"gdn": gdn_jax.gated_delta_rule, "kda": gdn_jax.kda, "gdn2": gdn_jax.gdn2}
STEPS = {"gdn": gdn_jax.gated_delta_rule_step, "kda": gdn_jax.kda_step, "gdn2": gdn_jax.gdn2_step}
RECURRENT = {
    "gdn": rec.recurrent_gated_delta_rule,
    "kda": rec.recurrent_kda,
    "gdn2": rec.recurrent_gdn2,
}
GATES = {"gdn": ("g", "beta"), "kda": ("g", "beta"), "gdn2": ("g", "b", "w")}


def op_args(variant="gdn", *, B=1, T=8, H=1, HV=2, K=8, V=8, seed=0):
    x = random_inputs(seed, B=B, T=T, H=H, HV=HV, K=K, V=V, variant=variant)
    return [x[n] for n in ("q", "k", "v") + GATES[variant]], x["initial_state"]


def xla(variant, *args, **kw):
    return OPS[variant](*args, implementation="xla", **kw)


# One shape for every run below, so that each function compiles once: T = 80 is a full chunk
# and a partial one.
SHAPE = dict(T=80, K=16, V=16)
KW = dict(output_final_state=True, use_qk_l2norm=True)


@functools.cache
def fwd(variant, packed=False):
    """Jitted (o, final) of the xla op (or the recurrence: variant "rec_<variant>")."""
    if variant.startswith("rec_"):
        fn = RECURRENT[variant[4:]]
    else:
        fn = functools.partial(OPS[variant], implementation="xla")
    if packed:
        return jax.jit(lambda a, cu: fn(*a, cu_seqlens=cu, **KW))
    return jax.jit(lambda a, h0: fn(*a, initial_state=h0, **KW))


# ---------------------------------------------------------------------------------------------
# Unclear errors of the ops: now a ValueError naming the argument


def _with(args, i, x):
    args = list(args)
    args[i] = x
    return args


@pytest.mark.parametrize(
    "case,match",
    [
        ("q_list", "q must be a jax.Array or numpy array; got list"),
        ("g_list", "g must be a jax.Array"),
        ("cu_list", "cu_seqlens must be a jax.Array"),
        ("chunk_float", "chunk_size must be an int"),
        ("scale_array", "scale must be a scalar"),
        ("scale_nan", "scale must be finite"),
        ("scale_inf", "scale must be finite"),
        ("scale_str", "scale must be a real number"),
        ("K0", "head dim K must be >= 1"),
        ("V0", "value head dim V must be >= 1"),
        ("H0", "heads H must be >= 1"),
        ("impl_empty", "implementation must be None.*non-empty sequence"),
        ("impl_int", "implementation must be None"),
        ("g_positive", "g is a log-decay and must be <= 0"),
        ("g_plus_inf", "g is a log-decay and must be <= 0"),
    ],
)
def test_op_argument_errors(case, match):
    args, _ = op_args()
    kw = {}
    if case == "q_list":
        args = _with(args, 0, np.asarray(args[0]).tolist())
    elif case == "g_list":
        args = _with(args, 3, np.asarray(args[3]).tolist())
    elif case == "cu_list":
        kw["cu_seqlens"] = [0, 4, 8]
    elif case == "chunk_float":
        kw["chunk_size"] = 64.0
    elif case == "scale_array":
        kw["scale"] = jnp.ones((2,))
    elif case in ("scale_nan", "scale_inf"):
        kw["scale"] = float("nan") if case == "scale_nan" else float("inf")
    elif case == "scale_str":
        kw["scale"] = "0.5"
    elif case in ("K0", "V0", "H0"):
        a = dict(K0=dict(K=0), V0=dict(V=0), H0=dict(H=0, HV=0))[case]
        args, _ = op_args(**a)
    elif case == "impl_empty":
        with pytest.raises(ValueError, match=match):
            gdn_jax.gated_delta_rule(*args, implementation=[])
        return
    elif case == "impl_int":
        with pytest.raises(ValueError, match=match):
            gdn_jax.gated_delta_rule(*args, implementation=3)
        return
    elif case == "g_positive":
        args = _with(args, 3, args[3].at[0, 3, 1].set(50.0))
    elif case == "g_plus_inf":
        args = _with(args, 3, args[3].at[0, 3, 1].set(jnp.inf))
    with pytest.raises(ValueError, match=match):
        xla("gdn", *args, **kw)


def test_scale_concrete_scalar_array_accepted():
    from gdn_jax.ops import _validate

    assert _validate.check_scale(jnp.asarray(0.25), 8) == 0.25
    assert _validate.check_scale(np.float32(0.5), 8) == 0.5
    assert _validate.check_scale(None, 16) == 0.25


def test_traced_scale_rejected():
    args, _ = op_args()
    with pytest.raises(ValueError, match="scale must be a static Python float"):
        jax.jit(lambda s: xla("gdn", *args, scale=s))(0.5)


@pytest.mark.parametrize("variant", ["gdn", "kda"])
def test_empty_batch(variant):
    args, _ = op_args(variant, B=0)
    o, s = xla(variant, *args, output_final_state=True)
    assert o.shape == (0, 8, 2, 8) and s.shape == (0, 2, 8, 8)
    o, s = STEPS[variant](*args, jnp.zeros((0, 2, 8, 8), f32), implementation="xla")
    assert o.shape == (0, 8, 2, 8) and s.shape == (0, 2, 8, 8)


@pytest.mark.parametrize("variant", ["gdn", "kda", "gdn2"])
def test_step_without_state(variant):
    args, _ = op_args(variant)
    with pytest.raises(ValueError, match="state is required"):
        STEPS[variant](*args, None)


def test_step_rejects_positive_gate():
    args, _ = op_args("kda")
    args = _with(args, 3, args[3].at[0, 0, 0, 0].set(1.0))
    with pytest.raises(ValueError, match="g is a log-decay"):
        gdn_jax.kda_step(*args, jnp.zeros((1, 2, 8, 8), f32))


# ---------------------------------------------------------------------------------------------
# Log-decay edge values: -inf is a full reset, g > 0 is clamped to 0 under jit


def _loss(fn, args, h0, **kw):
    o, s = fn(*args, initial_state=h0, output_final_state=True, use_qk_l2norm=True, **kw)
    w = jnp.cos(jnp.arange(o.size, dtype=f32)).reshape(o.shape)
    return jnp.sum(o * w) + 0.3 * jnp.sum(s), (o, s)


@functools.cache
def _reset_fns(variant, grads):
    """Jitted (loss, (o, final)) and gradients of the xla op and of the recurrence."""
    op = functools.partial(OPS[variant], implementation="xla")

    def make(fn):
        return jax.jit(
            lambda a, h0: jax.value_and_grad(lambda a: _loss(fn, a, h0), has_aux=True)(a)
        )

    if not grads:
        return (lambda a, h0: ((None, fwd(variant)(a, h0)), ()),
                lambda a, h0: ((None, fwd("rec_" + variant)(a, h0)), ()))  # fmt: skip
    return make(op), make(RECURRENT[variant])


# KDA runs the code of GDN2 (b = w = β): its gradients are covered there and not compiled again.
@pytest.mark.parametrize("variant,grads", [("gdn", True), ("kda", False), ("gdn2", True)])
@pytest.mark.parametrize("case", ["one_inf", "all_inf", "minus_1e38", "56_inf_then_decay"])
def test_full_reset_gate_matches_recurrence(variant, grads, case):
    """g = -inf (and -1e38): the chunked op equals the recurrence, gradients included; the
    gradient of g at -inf is 0. 56 resets then 8 ordinary tokens in one chunk: the chunk-local
    cumulative gate reaches 56 * LOG_DECAY_FLOOR, where f32 resolves the last tokens' decays to
    a few 1e-4 (relative)."""
    args, h0 = op_args(variant, **SHAPE)
    g = args[3]
    g = {
        "one_inf": g.at[0, 40].set(-jnp.inf),
        "all_inf": jnp.full_like(g, -jnp.inf),
        "minus_1e38": g.at[0, 40].set(-1e38),
        "56_inf_then_decay": g.at[0, :56].set(-jnp.inf),
    }[case]
    args = _with(args, 3, g)
    ours, ref = _reset_fns(variant, grads)
    (_, (o, s)), dx = ours(args, h0)
    (_, (ro, rs)), rdx = ref(args, h0)
    tol = 1e-3 if case == "56_inf_then_decay" else 5e-5
    for a, b in [(o, ro), (s, rs), *zip(dx, rdx, strict=True)]:
        assert bool(jnp.all(jnp.isfinite(a)))
        np.testing.assert_allclose(a, b, rtol=0, atol=tol * float(jnp.max(jnp.abs(b)) + 1e-6))
    if grads:
        assert bool(jnp.all(jnp.where(jnp.isneginf(g), dx[3] == 0, True)))


@pytest.mark.parametrize("variant", ["gdn", "gdn2"])
def test_growth_gate_under_jit_is_clamped_to_zero(variant):
    args, h0 = op_args(variant, **SHAPE)
    o, s = fwd(variant)(_with(args, 3, args[3].at[0, 10:20].set(50.0)), h0)
    oc, sc = fwd(variant)(_with(args, 3, args[3].at[0, 10:20].set(0.0)), h0)
    assert bool(jnp.all(jnp.isfinite(o)))
    np.testing.assert_array_equal(o, oc)
    np.testing.assert_array_equal(s, sc)


def test_pallas_receives_the_sanitised_gates(monkeypatch):
    """The op sanitises before choosing an implementation: GDN's Pallas entry point sees g
    clamped to [LOG_DECAY_FLOOR, 0] and the raw q, k, v; KDA's and GDN2's see all inputs raw
    (their kernels and glue make the replacements, see the interpreter test below)."""
    import gdn_jax.ops as ops
    from gdn_jax.ops._sanitize import LOG_DECAY_FLOOR

    class Seen(Exception):
        pass

    def spy(*a, **kw):
        raise Seen(a)

    monkeypatch.setattr(ops, "_pallas", lambda variant: spy)
    for variant in ("gdn", "kda", "gdn2"):
        args, _ = op_args(variant)
        g = args[3].at[0, 2].set(-jnp.inf).at[0, 5].set(-1e38)
        v = args[2].at[0, 6, 1, 3].set(jnp.nan)
        with pytest.raises(Seen) as e:
            OPS[variant](*_with(_with(args, 3, g), 2, v), implementation="pallas")
        got = e.value.args[0]
        want_g = jnp.maximum(g, LOG_DECAY_FLOOR) if variant == "gdn" else g
        np.testing.assert_array_equal(got[3], want_g)
        np.testing.assert_array_equal(got[2], v)


def test_pallas_interpreter_full_reset():
    """One tiny Mosaic GPU interpreter run: GDN with one -inf token equals the recurrence."""
    pk = pytest.importorskip("pallas_kernels._compat")
    x = random_inputs(3, B=1, T=64, H=1, HV=1, K=64, V=64)
    args = [x[n].astype(jnp.bfloat16) for n in ("q", "k", "v")]
    g = x["g"].at[0, 20].set(-jnp.inf)
    with pk.use_mode("interpret"):
        try:
            o, _ = gdn_jax.gated_delta_rule(
                *args, g, x["beta"], implementation="pallas", use_qk_l2norm=True
            )
        finally:
            pk.reset_interpreter()
    ref, _ = rec.recurrent_gated_delta_rule(*args, g, x["beta"], use_qk_l2norm=True)
    o, ref = o.astype(f32), ref.astype(f32)
    assert bool(jnp.all(jnp.isfinite(o)))
    assert float(jnp.sqrt(jnp.mean((o - ref) ** 2) / jnp.mean(ref**2))) < 1e-2


@pytest.mark.parametrize("l2norm", [False, True])
@pytest.mark.parametrize("variant", ["gdn", "kda", "gdn2"])
def test_pallas_interpreter_non_finite_raw_inputs(variant, l2norm):
    """The Pallas paths get the raw q, k, v (KDA/GDN2 the raw gates too): NaN and ±inf in q, k,
    v, g and the gates, in the chunk the clean rows are in. Outputs, final state and gradients
    match the xla path's (which runs on the sanitised copies), NaN exactly where it has NaN."""
    pk = pytest.importorskip("pallas_kernels._compat")
    args, _ = op_args(variant, B=1, T=64, H=1, HV=1, K=64, V=64)
    q, k, v, g, *gates = args
    # unit q, k rows (a stable recurrence either way), then the 16-bit io of the kernels
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q, k, v = unit(q).astype(jnp.bfloat16), unit(k).astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    q = q.at[0, 12, 0, 5].set(jnp.nan)  # (before the other bad values: its own row only)
    k = k.at[0, 40, 0, 1].set(jnp.inf)
    v = v.at[0, 30, 0, 2].set(-jnp.inf)
    g = g.at[0, 45, 0].set(jnp.nan)
    gates = [x.at[0, 35].set(jnp.nan) for x in gates]
    if variant == "gdn2":  # w's bad value poisons one value column
        gates[1] = gates[1].at[0, 20, 0, 3].set(jnp.inf)
        gates[0] = gates[0].at[0, 35].set(gates[0][0, 34])  # b's NaN would poison the head early
    xs = (q, k, v, g, *gates)

    def run(impl, *xs):
        return OPS[variant](*xs, implementation=impl, use_qk_l2norm=l2norm, output_final_state=True)

    def outputs_and_grads(impl):
        """(o, final state) and the gradients of Σ o (NaN read as 0), from one forward pass."""

        def loss(*xs):
            o, s = run(impl, *xs)
            o32 = o.astype(f32)
            return jnp.sum(jnp.where(jnp.isnan(o32), 0, o32)), (o, s)

        return jax.grad(loss, argnums=tuple(range(len(xs))), has_aux=True)(*xs)[::-1]

    with pk.use_mode("interpret"):
        try:
            got = outputs_and_grads("pallas")
        finally:
            pk.reset_interpreter()
    want = outputs_and_grads("xla")
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
        fin = np.isfinite(b)
        if fin.any():
            err = np.sqrt(np.mean((a[fin] - b[fin]) ** 2) / max(np.mean(b[fin] ** 2), 1e-30))
            assert err < 2e-2, err
    o = np.asarray(got[0][0], np.float32)
    assert np.all(np.isnan(o[0, 12])) and np.all(np.isnan(o[0, 40:]))
    assert np.all(np.isfinite(np.delete(o[0, :20], 12, axis=0)))


def _poison_on_the_lanes(variant, B, states, T, mode):
    """The Pallas paths put the op's NaN into o as the chunk loop stores it, in lane
    coordinates: dense rows (B = 2) or packed sequences on one lane (B = 1: an empty sequence,
    one ending mid-chunk; the wipe gate without states, the per-chunk table with them), with
    GVA (and, on the GPU at T = 4096, segments). NaN exactly where the xla path has it, the
    other values close to its."""
    pk = pytest.importorskip("pallas_kernels._compat")
    args, h0 = op_args(variant, B=B, T=T, H=1, HV=2, K=64, V=64, seed=3)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q, k, v, *gates = args
    q, k, v = unit(q).astype(jnp.bfloat16), unit(k).astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    t_q, t_k = T // 2 + 6, T - 28
    v = v.at[0, 10, 1, 3].set(jnp.nan)  # a column of head 1 from token 10 (sequence 0)
    q = q.at[B - 1, t_q, 0, 5].set(jnp.inf)  # token t_q's outputs
    k = k.at[B - 1, t_k, 0, 1].set(jnp.nan)  # both heads from token t_k
    cu = None if B > 1 else jnp.asarray([0, 40, 40, T], jnp.int32)
    n = B if cu is None else 3
    kw = dict(cu_seqlens=cu, output_final_state=states)
    kw["initial_state"] = 0.1 * jnp.ones((n,) + h0.shape[1:], jnp.float32) if states else None
    xs = (q, k, v, *gates)
    with pk.use_mode(mode):
        try:
            o, s = OPS[variant](*xs, implementation="pallas", **kw)
        finally:
            if mode == "interpret":
                pk.reset_interpreter()
    want_o, want_s = OPS[variant](*xs, implementation="xla", **kw)
    pairs = [(o, want_o)] + ([(s, want_s)] if states else [])
    for a, b in pairs:
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
        fin = np.isfinite(b)
        err = np.sqrt(np.mean((a[fin] - b[fin]) ** 2) / np.mean(b[fin] ** 2))
        assert err < 2e-2, err
    bad = np.isnan(np.asarray(want_o, np.float32))
    assert bad[0, 10:40, 1, 3].all() and not bad[0, :10].any()
    assert bad[B - 1, t_q].all() and bad[B - 1, t_k:].all()


@pytest.mark.parametrize(
    "variant,B,states,segments",
    [("gdn", 2, True, 1), ("gdn", 1, False, 1), ("gdn", 1, True, 2), ("kda", 1, True, 1),
     ("kda", 1, False, 2), ("gdn2", 1, True, 2)],
)  # fmt: skip
def test_pallas_interpreter_poison_on_the_lanes(variant, B, states, segments, monkeypatch):
    """(segments 2: the lane's chunk loop split in two, the poison's tables padded with it)"""
    from gdn_jax.ops import _channel_pallas, _gdn_pallas

    glue = _gdn_pallas if variant == "gdn" else _channel_pallas
    monkeypatch.setattr(glue, "_segments_for", lambda *a, **kw: segments)
    _poison_on_the_lanes(variant, B, states, 128, "interpret")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["gdn", "kda", "gdn2"])
@pytest.mark.parametrize("B,states", [(2, True), (1, False), (1, True)])
def test_gpu_poison_on_the_lanes(variant, B, states):
    """As the interpreter test, at T = 4096 (the default segment count for GDN)."""
    _poison_on_the_lanes(variant, B, states, 4096, "auto")


# ---------------------------------------------------------------------------------------------
# Non-finite values do not spread backwards within a chunk


@pytest.mark.parametrize(
    "variant,where",
    [
        ("gdn", "v"),
        ("kda", "v"),
        ("gdn2", "v"),
        ("gdn", "k"),
        ("gdn", "q"),  # guard: q only reaches its own row (already so before sanitising)
        ("gdn", "g"),
        ("gdn", "beta"),
        ("gdn2", "w"),
        ("gdn", "v_inf"),
    ],
)
def test_bad_value_stays_causal(variant, where):
    """A NaN (or inf) at t = 50: outputs before it equal those of a finite stand-in exactly;
    NaN / non-finite where (and only where) the f32 recurrence has them, final state included."""
    t0 = 50
    args, h0 = op_args(variant, **SHAPE)
    names = ("q", "k", "v") + GATES[variant]
    i = names.index(where.split("_")[0])
    bad = jnp.inf if where == "v_inf" else jnp.nan
    x = args[i]
    idx = (0, t0, 1) if x.ndim == 3 else (0, t0, 0 if names[i] in "qk" else 1, 3)
    dirty = _with(args, i, x.at[idx].set(bad))
    stand_in = _with(args, i, x.at[idx].set(0.5 if where != "g" else -0.5))
    o, s = fwd(variant)(dirty, h0)
    oc, _ = fwd(variant)(stand_in, h0)
    ro, rs = fwd("rec_" + variant)(dirty, h0)
    np.testing.assert_array_equal(o[:, :t0], oc[:, :t0])
    np.testing.assert_array_equal(~jnp.isfinite(o), ~jnp.isfinite(ro))
    np.testing.assert_array_equal(~jnp.isfinite(s), ~jnp.isfinite(rs))
    assert bool(jnp.any(~jnp.isfinite(o[:, t0])))
    fin = jnp.isfinite(ro)
    np.testing.assert_allclose(jnp.where(fin, o, 0), jnp.where(fin, ro, 0), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("T", [1, 63, 64, 65, 130, 200])
def test_poison_first_bad_token(T):
    """Poison.first, the first bad token per (row, head, column), reduced over 64-token blocks
    and then over the blocks (padding T to a multiple of 64), equals a plain search of the
    flags for every T, with several bad values per column and columns without any."""
    from gdn_jax.ops import _sanitize

    r = np.random.default_rng(T)
    B, H, HV, K, V = 2, 1, 2, 4, 3
    q = r.standard_normal((B, T, H, K)).astype(np.float32)
    k = r.standard_normal((B, T, H, K)).astype(np.float32)
    v = r.standard_normal((B, T, HV, V)).astype(np.float32)
    g = -r.uniform(0, 1, (B, T, HV)).astype(np.float32)
    beta = r.uniform(0, 1, (B, T, HV)).astype(np.float32)
    for x, bad in ((v, np.nan), (v, np.inf), (k, -np.inf), (g, np.nan), (beta, np.inf)):
        for _ in range(2):
            x[tuple(r.integers(0, n) for n in x.shape)] = bad
    _, poison = jax.jit(lambda *a: _sanitize.inputs(*a[:4], (a[4],), (), None))(q, k, v, g, beta)
    head = ~np.isfinite(k).all(-1).repeat(HV // H, 2) | ~np.isfinite(g) | ~np.isfinite(beta)
    col = head[..., None] | ~np.isfinite(v)
    want = np.where(col.any(1), col.argmax(1), T)
    np.testing.assert_array_equal(np.minimum(np.asarray(poison.first), T), want)


def test_bad_value_in_a_packed_sequence_stays_in_it():
    args, _ = op_args(**SHAPE)
    cu = jnp.asarray([0, 30, 30, 80], jnp.int32)  # with an empty sequence
    dirty = _with(args, 2, args[2].at[0, 10, 0, 2].set(jnp.nan))
    o, s = fwd("gdn", packed=True)(dirty, cu)
    ro, rs = fwd("rec_gdn", packed=True)(dirty, cu)
    np.testing.assert_array_equal(jnp.isnan(o), jnp.isnan(ro))
    np.testing.assert_array_equal(jnp.isnan(s), jnp.isnan(rs))
    assert bool(jnp.all(jnp.isfinite(o[:, 30:])))


def test_decode_step_bad_value():
    """Guard for the steps' sanitisation (the recurrence already propagates NaN so): a NaN in
    v at token 1, column 0 of head 0 gives the recurrence's pattern (that column from token 1
    on, in the outputs and the state)."""
    args, h0 = op_args("gdn", T=3)
    dirty = _with(args, 2, args[2].at[0, 1, 0, 0].set(jnp.nan))
    o, s = gdn_jax.gated_delta_rule_step(*dirty, h0, implementation="xla")
    want = jnp.zeros(o.shape, bool).at[0, 1:, 0, 0].set(True)
    np.testing.assert_array_equal(jnp.isnan(o), want)
    np.testing.assert_array_equal(jnp.isnan(s), jnp.zeros(s.shape, bool).at[0, 0, :, 0].set(True))


# ---------------------------------------------------------------------------------------------
# cu_seqlens under jit: sanitised, and checked in checked mode

_CU_CASES = {
    "decreasing": ([0, 50, 20, 80], [0, 50, 50, 80]),
    "past_T": ([0, 30, 60, 200], [0, 30, 60, 80]),
    "negative": ([0, -5, 40, 80], [0, 0, 40, 80]),
    "start_not_0": ([10, 40, 60, 80], [0, 40, 60, 80]),
    "end_before_T": ([0, 40, 50, 60], [0, 40, 50, 80]),
}


@pytest.mark.parametrize("case", list(_CU_CASES))
def test_traced_cu_seqlens_are_sanitised(case):
    bad, fixed = (jnp.asarray(c, jnp.int32) for c in _CU_CASES[case])
    args, _ = op_args(**SHAPE)
    o, s = fwd("gdn", packed=True)(args, bad)
    ro, rs = fwd("gdn", packed=True)(args, fixed)
    assert bool(jnp.all(jnp.isfinite(o)))
    np.testing.assert_array_equal(o, ro)
    np.testing.assert_array_equal(s, rs)
    with pytest.raises(ValueError, match="cu_seqlens"):  # concrete: rejected
        xla("gdn", *args, cu_seqlens=bad)


def test_checked_mode_reports_cu_seqlens_and_gates():
    args, _ = op_args()

    def f(g, cu):
        return xla("gdn", *_with(args, 3, g), cu_seqlens=cu)[0]

    good_cu, bad_cu = jnp.asarray([0, 2, 8], jnp.int32), jnp.asarray([0, 6, 2], jnp.int32)
    with gdn_jax.checked():
        f = checkify.checkify(jax.jit(f))
        ok, _ = f(args[3], good_cu)
        bad_offsets, _ = f(args[3], bad_cu)
        bad_gate, _ = f(args[3].at[0, 1, 0].set(3.0), good_cu)
    ok.throw()
    with pytest.raises(checkify.JaxRuntimeError, match="non-decreasing"):
        bad_offsets.throw()
    with pytest.raises(checkify.JaxRuntimeError, match="log-decay"):
        bad_gate.throw()


# ---------------------------------------------------------------------------------------------
# Layer and model


@pytest.fixture(scope="module")
def layer():
    return GatedDeltaNet(16, num_heads=2, head_dim=8, rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
    "case,match",
    [
        ("head_dim_0", "head_dim must be an int >= 1"),
        ("num_heads_0", "num_heads must be an int >= 1"),
        ("wrong_hidden", r"x must be \[B, T, hidden_size=16\]"),
        ("rank_2", r"x must be \[B, T, hidden_size=16\]"),
        ("x_list", "x must be a jax.Array"),
        ("cache_other_batch", r"cache.conv_q must have shape \(1, 3, 16\)"),
        ("cache_none", "cache must be a GDNCache"),
    ],
)
def test_layer_argument_errors(layer, case, match):
    with pytest.raises(ValueError, match=match):
        if case == "head_dim_0":
            GatedDeltaNet(16, num_heads=2, head_dim=0, rngs=nnx.Rngs(0))
        elif case == "num_heads_0":
            GatedDeltaNet(16, num_heads=0, head_dim=8, rngs=nnx.Rngs(0))
        elif case == "wrong_hidden":
            layer(jnp.ones((1, 4, 12)))
        elif case == "rank_2":
            layer(jnp.ones((4, 16)))
        elif case == "x_list":
            layer([[[0.0] * 16]])
        elif case == "cache_other_batch":
            layer.extend(jnp.ones((1, 2, 16)), layer.init_cache(2))
        elif case == "cache_none":
            layer.extend(jnp.ones((1, 2, 16)), None)


CFG = get_config("tiny", num_layers=2, full_attention_interval=2, vocab_size=64)


@pytest.fixture(scope="module")
def model():
    return HybridLM(CFG, rngs=nnx.Rngs(0))


def _tokens(B=1, T=6, seed=0):
    return jax.random.randint(jax.random.key(seed), (B, T), 0, CFG.vocab_size)


@pytest.mark.parametrize(
    "case,match",
    [
        ("rank_1", r"tokens must be 2-D \[B, T\]"),
        ("float_ids", "tokens must be integer token ids"),
        ("id_too_big", r"tokens must lie in \[0, 64\)"),
        ("id_negative", r"tokens must lie in \[0, 64\)"),
        ("target_too_big", r"targets must lie in \[0, 64\)"),
        ("loss_chunk_float", "chunk must be a positive int"),
        ("cache_other_batch", r"cache.layers\[0\].conv_q must have shape"),
        ("cache_other_model", "cache does not belong to this model"),
        ("prefill_past_max_len", "do not fit in the cache"),
        ("extend_past_max_len", "extend past the cache"),
        ("init_cache_max_len_0", "max_len must be an int >= 1"),
    ],
)
def test_model_argument_errors(model, case, match):
    t = _tokens()
    with pytest.raises(ValueError, match=match):
        if case == "rank_1":
            model(t[0])
        elif case == "float_ids":
            model(t.astype(f32))
        elif case == "id_too_big":
            model(t.at[0, 2].set(64))
        elif case == "id_negative":
            model(t.at[0, 2].set(-1))
        elif case == "target_too_big":
            model.loss(jnp.zeros((1, 6, CFG.hidden_size)), t.at[0, 1].set(99))
        elif case == "loss_chunk_float":
            model.loss(jnp.zeros((1, 6, CFG.hidden_size)), t, chunk=2.0)
        elif case == "cache_other_batch":
            model.extend(t, model.init_cache(2, 16))
        elif case == "cache_other_model":  # layer types in another order
            cache = model.init_cache(1, 16)
            model.extend(t, cache._replace(layers=cache.layers[::-1]))
        elif case == "prefill_past_max_len":
            model.extend(_tokens(T=20), model.init_cache(1, 16))
        elif case == "extend_past_max_len":
            cache = model.init_cache(1, 16)
            model.extend(_tokens(T=6), cache._replace(pos=jnp.asarray(12, jnp.int32)))
        elif case == "init_cache_max_len_0":
            model.init_cache(1, 0)


def test_masked_out_of_range_targets_accepted(model):
    x = jnp.ones((1, 6, CFG.hidden_size))
    t = _tokens()
    mask = jnp.ones((1, 6)).at[0, 5].set(0.0)
    a = model.loss(x, t.at[0, 5].set(-100), mask=mask)
    b = model.loss(x, t, mask=mask)
    np.testing.assert_allclose(a, b, rtol=1e-6)


def test_traced_token_ids_are_clipped_and_checked(model):
    t = _tokens()
    bad = t.at[0, 1].set(64).at[0, 3].set(-3)
    clipped = t.at[0, 1].set(63).at[0, 3].set(0)
    with gdn_jax.checked():
        f = checkify.checkify(jax.jit(lambda tok: model(tok)))
        err, got = f(bad)
        ok, want = f(clipped)
    ok.throw()
    with pytest.raises(checkify.JaxRuntimeError, match="tokens must lie in"):
        err.throw()
    assert bool(jnp.all(jnp.isfinite(got)))
    np.testing.assert_array_equal(got, want)


def test_traced_targets_give_a_finite_loss(model):
    x = jax.random.normal(jax.random.key(2), (1, 6, CFG.hidden_size))
    t = _tokens()
    loss = jax.jit(lambda x, t: model.loss(x, t)[0])
    got = loss(x, t.at[0, 2].set(1000))
    assert bool(jnp.isfinite(got))
    np.testing.assert_allclose(got, loss(x, t.at[0, 2].set(63)), rtol=1e-6)


def test_traced_extend_past_max_len_gives_nan_and_checks(model):
    cache = model.init_cache(1, 8)
    with gdn_jax.checked():
        f = checkify.checkify(jax.jit(lambda tok, c: model.extend(tok, c)[0]))
        ok, fits = f(_tokens(T=3), cache._replace(pos=jnp.asarray(5, jnp.int32)))
        err, over = f(_tokens(T=3), cache._replace(pos=jnp.asarray(6, jnp.int32)))
    ok.throw()
    with pytest.raises(checkify.JaxRuntimeError, match="extend past the cache"):
        err.throw()
    assert bool(jnp.all(jnp.isfinite(fits))) and bool(jnp.all(jnp.isnan(over)))


def test_loss_any_length_pads_the_last_chunk(model):
    x = jax.random.normal(jax.random.key(3), (2, 10, CFG.hidden_size))
    t = _tokens(B=2, T=10)
    mask = jnp.ones((2, 10)).at[1, 7:].set(0.0)
    full = model.loss(x, t, mask=mask, chunk=None)
    np.testing.assert_allclose(model.loss(x, t, mask=mask, chunk=4), full, rtol=1e-5)


def test_import_makes_subpackages_available(monkeypatch):
    monkeypatch.delattr(gdn_jax, "sharding", raising=False)
    monkeypatch.delitem(sys.modules, "gdn_jax.sharding", raising=False)
    assert gdn_jax.sharding.ShardingConfig is not None  # imported on first use
    assert {"sharding", "remat", "fp8"} <= set(gdn_jax.__all__)
    assert gdn_jax.remat.GDN_QKV and gdn_jax.fp8.dot_general
