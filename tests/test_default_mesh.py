"""Plain ``jax.jit`` on sharded inputs, no ``ShardingConfig``: the ops, the GDN layer and the hybrid
LM on ``Explicit`` mesh axes (``jax.make_mesh``'s default) and on ``Auto`` ones, with and without
``jax.set_mesh``, equal their unsharded results (8 fake CPU devices, f32, ``implementation="xla"``;
the Pallas path is checked by lowering for CUDA).

Layouts: batch over ``data`` and heads over ``tensor`` (DP × TP), and batch over ``data`` × ``fsdp``
with heads over ``tensor`` (the FSDP model rules' activations). Shapes are tiny and every test
compiles one program per case: the CPU is shared.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gdn_jax
from gdn_jax import sharding as sh
from gdn_jax.models import HybridLM, get_config
from gdn_jax.nn import GatedDeltaNet
from gdn_jax.testing import random_inputs, rel_rms

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake CPU) devices")

OPS = {"gdn": gdn_jax.gated_delta_rule, "kda": gdn_jax.kda, "gdn2": gdn_jax.gdn2}
STEPS = {"gdn": gdn_jax.gated_delta_rule_step, "kda": gdn_jax.kda_step, "gdn2": gdn_jax.gdn2_step}
GATES = {"gdn": ("g", "beta"), "kda": ("g", "beta"), "gdn2": ("g", "b", "w")}
TOL = 1e-5
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
EXPLICIT, AUTO = AxisType.Explicit, AxisType.Auto
# (mesh, batch axes, head axes); the first is used with jax.set_mesh, the second without.
LAYOUTS = {
    "dp_tp": ("data=2,tensor=4", "data", "tensor"),
    "fsdp_tp": ("data=2,fsdp=2,tensor=2", ("data", "fsdp"), "tensor"),
}
SET_MESH = {"dp_tp": True, "fsdp_tp": False}


def _mesh(layout, axis_type):
    return sh.make_mesh(LAYOUTS[layout][0], axis_type=axis_type)


def _ctx(mesh, on: bool):
    return jax.set_mesh(mesh) if on else contextlib.nullcontext()


def _place(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def _token_spec(layout, ndim):
    _, b, h = LAYOUTS[layout]
    return P(b, None, h, *([None] * (ndim - 3)))


def _state_spec(layout):
    _, b, h = LAYOUTS[layout]
    return P(b, h, None, None)


def _has_spec(x, mesh, spec):
    return x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim)


def _close(got, want, what):
    for i, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
        err = rel_rms(a, b)
        assert err < TOL, f"{what}: leaf {i} {err:.2e}"


# ------------------------------------------------------------------------------------------------
# ops


def _op_inputs(variant):
    x = random_inputs(0, variant=variant, B=4, T=24, H=4, HV=8, K=8, V=8)
    return [x[n] for n in ("q", "k", "v", *GATES[variant])], x["initial_state"]


def _op_program(variant):
    op = OPS[variant]

    def f(arrays, h0):
        def loss(arrays, h0):
            o, s = op(*arrays, initial_state=h0, output_final_state=True, chunk_size=16,
                      use_qk_l2norm=True, implementation="xla")  # fmt: skip
            return jnp.sum(o * jnp.sin(3.0 * o)) + jnp.sum(s * jnp.cos(2.0 * s)), (o, s)

        (_, (o, s)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(arrays, h0)
        return o, s, grads

    return jax.jit(f, compiler_options=FAST)


_OP_WANT: dict = {}


def _op_want(variant):
    if variant not in _OP_WANT:
        _OP_WANT[variant] = _op_program(variant)(*_op_inputs(variant))
    return _OP_WANT[variant]


# Every variant on DP × TP; GDN2 (the op with the most gates) also on FSDP × TP.
CASES = [(v, "dp_tp") for v in OPS] + [("gdn2", "fsdp_tp")]


@pytest.mark.parametrize("axis_type", [EXPLICIT, AUTO], ids=["explicit", "auto"])
@pytest.mark.parametrize("variant,layout", CASES)
def test_chunked_op(variant, layout, axis_type):
    arrays, h0 = _op_inputs(variant)
    mesh = _mesh(layout, axis_type)
    xs = [_place(x, mesh, _token_spec(layout, x.ndim)) for x in arrays]
    h0s = _place(h0, mesh, _state_spec(layout))
    with _ctx(mesh, SET_MESH[layout]):
        o, s, grads = _op_program(variant)(xs, h0s)
    _close((o, s, grads), _op_want(variant), f"{variant} {layout} {axis_type}")
    # Batch and heads come out split like the inputs (on Auto axes the partitioner picks the
    # same here); so do the gradients.
    assert _has_spec(o, mesh, _token_spec(layout, 4)), o.sharding
    assert _has_spec(s, mesh, _state_spec(layout)), s.sharding
    if axis_type == EXPLICIT:
        dx, dh0 = grads
        assert all(_has_spec(d, mesh, _token_spec(layout, d.ndim)) for d in dx)
        assert _has_spec(dh0, mesh, _state_spec(layout))


def test_op_inputs_in_mixed_layouts():
    """Only v and the state placed (q, k, the gates replicated): the op reads the layout off v
    and moves the rest there; a sharded K dimension is gathered."""
    arrays, h0 = _op_inputs("gdn")
    mesh = _mesh("dp_tp", EXPLICIT)
    q, k, v, g, beta = arrays
    v = _place(v, mesh, P("data", None, "tensor", None))
    q = _place(q, mesh, P(None, None, None, "tensor"))  # K split: gathered
    h0s = _place(h0, mesh, P("data"))
    o, s, grads = _op_program("gdn")([q, k, v, g, beta], h0s)
    _close((o, s, grads), _op_want("gdn"), "mixed layouts")
    assert _has_spec(o, mesh, P("data", None, "tensor", None))


@pytest.mark.parametrize("axis_type", [EXPLICIT, AUTO], ids=["explicit", "auto"])
@pytest.mark.parametrize("variant", list(STEPS))
def test_decode_step(variant, axis_type):
    x = random_inputs(1, variant=variant, B=4, T=2, H=4, HV=8, K=8, V=8)
    arrays = [x[n] for n in ("q", "k", "v", *GATES[variant])]
    state = x["initial_state"]
    step = jax.jit(lambda a, s: STEPS[variant](*a, s, use_qk_l2norm=True, implementation="xla"))
    want = step(arrays, state)
    mesh = _mesh("fsdp_tp", axis_type)
    xs = [_place(a, mesh, _token_spec("fsdp_tp", a.ndim)) for a in arrays]
    with _ctx(mesh, axis_type == EXPLICIT):
        got = step(xs, _place(state, mesh, _state_spec("fsdp_tp")))
    _close(got, want, f"{variant}_step {axis_type}")
    assert _has_spec(got[0], mesh, _token_spec("fsdp_tp", 4))
    assert _has_spec(got[1], mesh, _state_spec("fsdp_tp"))


@pytest.mark.parametrize("step", [False, True], ids=["chunked", "decode"])
def test_sequence_axis_sharded_is_a_clear_error(step):
    arrays, h0 = _op_inputs("kda")
    mesh = _mesh("dp_tp", EXPLICIT)
    xs = [_place(x, mesh, P(None, "tensor")) for x in arrays]
    if step:
        fn = lambda: gdn_jax.kda_step(*xs, h0, implementation="xla")
        match = r"sequence axis T .* mesh axis 'tensor'; decode steps cannot be context-sharded"
    else:
        fn = lambda: gdn_jax.kda(*xs, implementation="xla")
        match = r"sequence axis T \(dim 1\) of v .* mesh axis 'tensor'.*context='tensor'"
    with pytest.raises(ValueError, match=match):
        jax.jit(fn).trace()


def test_shard_op_reshards_placed_inputs():
    """``shard_op`` on an Explicit mesh moves inputs placed in another layout (here T split)."""
    arrays, h0 = _op_inputs("gdn")
    mesh = _mesh("dp_tp", EXPLICIT)
    cfg = sh.ShardingConfig(mesh, batch="data", heads="tensor")
    op = sh.shard_op(gdn_jax.gated_delta_rule, cfg)
    xs = [_place(x, mesh, P(None, "data")) for x in arrays]
    run = lambda op: jax.jit(lambda a: op(*a, chunk_size=16, implementation="xla")[0])
    o = run(op)(xs)
    want = run(gdn_jax.gated_delta_rule)(arrays)
    assert rel_rms(o, want) < TOL
    assert _has_spec(o, mesh, P("data", None, "tensor"))


# ------------------------------------------------------------------------------------------------
# Pallas: the glue under Explicit-sharded inputs lowers for CUDA with the kernels per shard


@pytest.mark.parametrize("variant", ["gdn", "kda", "step"])
def test_pallas_lowers_per_shard_for_cuda(variant):
    from pallas_kernels import _compat as pk

    mesh = _mesh("dp_tp", EXPLICIT)
    B, H, HV, D = 4, 4, 16, 64  # a shard has HV = 4: the decode kernel needs HV % 4 == 0
    T = 1 if variant == "step" else 64
    bf, f = jnp.bfloat16, jnp.float32

    def S(shape, dtype):
        spec = P("data", "tensor") if len(shape) == 4 and shape[1] == HV else P(
            "data", None, "tensor")  # fmt: skip
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    g_shape = (B, T, HV) if variant != "kda" else (B, T, HV, D)
    args = [S((B, T, H, D), bf), S((B, T, H, D), bf), S((B, T, HV, D), bf), S(g_shape, f),
            S((B, T, HV), f), S((B, HV, D, D), f)]  # fmt: skip
    if variant == "step":
        fn = lambda *a: gdn_jax.gated_delta_rule_step(*a, implementation="pallas")
    elif variant == "kda":  # forward only (the backward's glue is GDN's shard_map too)
        fn = lambda *a: gdn_jax.kda(*a[:5], initial_state=a[5], implementation="pallas")
    else:

        def fn(*a):
            def loss(*a):
                o, s = OPS[variant](*a[:5], initial_state=a[5], output_final_state=True,
                                    use_qk_l2norm=True, implementation="pallas")  # fmt: skip
                return jnp.sum(o.astype(f)) + jnp.sum(s)

            return jax.value_and_grad(loss, argnums=range(6))(*a)

    with pk.use_mode("gpu"):
        txt = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = [ln for ln in txt.splitlines() if "custom_call @mosaic_gpu" in ln]
    assert calls
    # The kernels run inside the per-shard region on one shard's operands (B/2, HV/4).
    assert "sdy.manual_computation" in txt
    shard_v = f"tensor<{B // 2}x{T}x{HV // 4}x{D}xbf16>"
    assert shard_v in txt, shard_v


def test_pallas_refuses_auto_axes_and_xla_serves():
    """Under Auto mesh axes the layout is unknown at trace time: the Pallas path refuses with a
    NotImplementedError (the default order then runs xla)."""
    from gdn_jax.sharding import pallas_layout_error

    mesh = _mesh("dp_tp", AUTO)
    with jax.set_mesh(mesh):
        why = pallas_layout_error([])
    assert why is not None and "Auto mesh axes ('data', 'tensor')" in why
    assert pallas_layout_error([]) is None


# ------------------------------------------------------------------------------------------------
# the layer and the model

CONFIG = get_config(
    "tiny", num_layers=2, full_attention_interval=2, hidden_size=32, intermediate_size=64,
    linear_num_heads=2, linear_num_v_heads=4, linear_head_dim=8, linear_v_head_dim=8,
    attn_num_heads=2, attn_num_kv_heads=1, attn_head_dim=8, chunk_size=16, vocab_size=64,
)  # fmt: skip


def _model_program(graphdef, tx):
    def run(params, opt_state, tokens):
        def loss_fn(params):
            m = nnx.merge(graphdef, params)
            return m.loss(m.hidden(tokens[:, :-1]), tokens[:, 1:], chunk=8)[0]

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        new = optax.apply_updates(params, updates)
        m = nnx.merge(graphdef, params)
        logits = m(tokens)
        cache = m.init_cache(tokens.shape[0], tokens.shape[1])
        prefill, cache = m.extend(tokens[:, :12], cache)
        decode, cache = m.extend(tokens[:, 12:13], cache)
        return dict(loss=loss, grads=grads, new=new, logits=logits, prefill=prefill,
                    decode=decode, state=cache.layers[0].state)  # fmt: skip

    return jax.jit(run, compiler_options=FAST)


@pytest.fixture(scope="module")
def model_setup():
    model = HybridLM(CONFIG, implementation="xla", rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.adamw(1e-3)
    tokens = jax.random.randint(jax.random.key(1), (4, 17), 0, CONFIG.vocab_size)
    program = _model_program(graphdef, tx)
    want = program(params, tx.init(params), tokens)
    return graphdef, params, tx, tokens, program, want


@pytest.mark.parametrize("axis_type", [EXPLICIT, AUTO], ids=["explicit", "auto"])
def test_hybrid_lm_train_step_forward_extend(model_setup, axis_type):
    """DP × FSDP × TP (data=2, fsdp=2, tensor=2): loss, gradients, one AdamW update, logits and
    prefill + decode through ``extend`` equal one device's."""
    _, params, tx, tokens, program, want = model_setup
    mesh = _mesh("fsdp_tp", axis_type)
    rules = sh.logical_axis_rules(mesh)
    p = jax.device_put(params, sh.model_shardings(params, mesh, rules))
    opt_state = jax.jit(tx.init)(p)
    tok = jax.device_put(tokens, sh.batch_sharding(mesh, rules))
    with _ctx(mesh, axis_type == AUTO):
        got = program(p, opt_state, tok)
    for key in ("loss", "grads", "logits", "prefill", "decode", "state"):
        _close(got[key], want[key], f"{key} {axis_type}")
    # Adam's first step is ~ g/|g| per element: rounding of tiny gradients shows up at 1e-4.
    for a, b in zip(jax.tree.leaves(got["new"]), jax.tree.leaves(want["new"]), strict=True):
        assert rel_rms(a, b) < 1e-4
    if axis_type == EXPLICIT:
        # Logits: batch like the tokens, the vocabulary like the LM head; grads like the params.
        assert _has_spec(got["logits"], mesh, P(("data", "fsdp"), None, "tensor"))
        assert _has_spec(got["decode"], mesh, P(("data", "fsdp"), None, "tensor"))
        for g, q in zip(jax.tree.leaves(got["grads"]), jax.tree.leaves(p), strict=True):
            assert g.sharding.is_equivalent_to(q.sharding, q.ndim)


@pytest.mark.parametrize("axis_type", [EXPLICIT], ids=["explicit"])  # Auto: the model test
def test_gdn_layer(axis_type):
    layer = GatedDeltaNet(32, num_heads=2, num_v_heads=4, head_dim=8, variant="gdn2",
                          chunk_size=16, implementation="xla", rngs=nnx.Rngs(0))  # fmt: skip
    graphdef, params = nnx.split(layer, nnx.Param)
    x = jax.random.normal(jax.random.key(2), (4, 24, 32))

    @jax.jit
    def f(params, x):
        def loss(params, x):
            y = nnx.merge(graphdef, params)(x)
            return jnp.sum(y * jnp.sin(y)), y

        (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
        return y, grads

    want = f(params, x)
    mesh = _mesh("fsdp_tp", axis_type)
    rules = sh.logical_axis_rules(mesh)
    p = jax.device_put(params, sh.model_shardings(params, mesh, rules))
    xs = _place(x, mesh, P(("data", "fsdp")))
    with _ctx(mesh, axis_type == EXPLICIT):
        got = f(p, xs)
    _close(got, want, f"layer {axis_type}")
    assert _has_spec(got[0], mesh, P(("data", "fsdp")))
    if axis_type == EXPLICIT:
        # T split (sequence-sharded activations) without context parallelism: a clear error.
        xt = _place(x, mesh, P(None, "data"))
        with pytest.raises(ValueError, match=r"sequence axis T .* mesh axis 'data'.*context="):
            jax.jit(lambda p, x: nnx.merge(graphdef, p)(x)).trace(p, xt)


def test_model_tokens_replicated_under_set_mesh(model_setup):
    """Unsharded inputs under ``jax.set_mesh`` (Explicit axes) run too (replicated)."""
    graphdef, params, tx, tokens, program, want = model_setup
    mesh = _mesh("dp_tp", EXPLICIT)
    with jax.set_mesh(mesh):
        logits = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, tokens)
    assert rel_rms(logits, want["logits"]) < TOL


def test_fp8_native_projections_on_explicit_axes():
    """``fp8="native"`` projections on DP × FSDP × TP Explicit axes: loss and gradients equal one
    device's (the per-tensor scales are global maxima, so the quantisation is the same)."""
    config = dataclasses.replace(CONFIG, num_layers=1, full_attention_interval=0)  # one GDN layer
    model = HybridLM(config, implementation="xla", fp8="native", rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    tokens = jax.random.randint(jax.random.key(1), (4, 17), 0, CONFIG.vocab_size)

    @jax.jit(compiler_options=FAST)
    def f(params, tokens):
        def loss_fn(params):
            m = nnx.merge(graphdef, params)
            return m.loss(m.hidden(tokens[:, :-1]), tokens[:, 1:])[0]

        return jax.value_and_grad(loss_fn)(params)

    want = f(params, tokens)
    mesh = _mesh("fsdp_tp", EXPLICIT)
    rules = sh.logical_axis_rules(mesh)
    p = jax.device_put(params, sh.model_shardings(params, mesh, rules))
    got = f(p, jax.device_put(tokens, sh.batch_sharding(mesh, rules)))
    _close(got, want, "fp8 native")
    for g, q in zip(jax.tree.leaves(got[1]), jax.tree.leaves(p), strict=True):
        assert g.sharding.is_equivalent_to(q.sharding, q.ndim)


def test_context_parallelism_on_explicit_axes_is_a_clear_error():
    """The model and the GDN layer built for context parallelism refuse a T split over Explicit
    axes at their entry, pointing to Auto axes; without context parallelism it is the T-split
    ValueError."""
    mesh = sh.make_mesh("data=2,context=2,tensor=2", axis_type=EXPLICIT)
    cp = sh.model_core_sharding(mesh)
    split = NamedSharding(mesh, P("data", "context"))
    auto = r"Explicit mesh axis 'context'.*AxisType.Auto"
    model = HybridLM(CONFIG, implementation="xla", sharding=cp, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    tokens = jax.device_put(jnp.zeros((4, 16), jnp.int32), split)
    run = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))
    with pytest.raises(NotImplementedError, match="HybridLM: context parallelism .*" + auto):
        run.trace(params, tokens)
    plain = nnx.split(HybridLM(CONFIG, implementation="xla", rngs=nnx.Rngs(0)), nnx.Param)
    with pytest.raises(ValueError, match=r"HybridLM: the sequence axis T .* 'context'.*context="):
        jax.jit(lambda p, t: nnx.merge(plain[0], p)(t)).trace(plain[1], tokens)

    layer = GatedDeltaNet(32, num_heads=2, num_v_heads=4, head_dim=8, chunk_size=16,
                          implementation="xla", sharding=cp, rngs=nnx.Rngs(0))  # fmt: skip
    lg, lp = nnx.split(layer, nnx.Param)
    x = jax.device_put(jnp.zeros((4, 16, 32)), NamedSharding(mesh, P("data", "context")))
    with pytest.raises(NotImplementedError, match="GatedDeltaNet: context parallelism .*" + auto):
        jax.jit(lambda p, x: nnx.merge(lg, p)(x)).trace(lp, x)
