"""Sharded ops and the sharded model train step equal their unsharded results (8 CPU devices).

The multi-device tests use ``implementation="xla"``: the Pallas interpreter cannot run under an
8-device ``shard_map``. Shapes are tiny: the CPU is shared.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gdn_jax
from gdn_jax import sharding as sh
from gdn_jax.models import HybridLM, get_config
from gdn_jax.nn import gated_deltanet as gdn_layer
from gdn_jax.testing import random_inputs, rel_rms

OPS = {"gdn": gdn_jax.gated_delta_rule, "kda": gdn_jax.kda, "gdn2": gdn_jax.gdn2}
GATES = {"gdn": ("g", "beta"), "kda": ("g", "beta"), "gdn2": ("g", "b", "w")}
TOL = 1e-5
# Compile fast: these programs are tiny and compilation dominates the tests' time.
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake CPU) devices")


def _arrays(variant, **shape):
    x = random_inputs(0, variant=variant, **shape)
    return [x[n] for n in ("q", "k", "v", *GATES[variant])], x["initial_state"]


def _value_and_grads(op, arrays, h0, **kw):
    """o, final state and the gradients of every input under fixed random cotangents."""
    kw = dict(implementation="xla", chunk_size=16, use_qk_l2norm=True, **kw)

    def f(arrays, h0):
        o, s = op(*arrays, initial_state=h0, output_final_state=True, **kw)
        # Random cotangents for o and the final state (cos/sin of the values: fixed, non-trivial).
        return jnp.sum(o * jnp.sin(3.0 * o)) + jnp.sum(s * jnp.cos(2.0 * s)), (o, s)

    vg = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)
    (_, (o, s)), grads = jax.jit(vg, compiler_options=FAST)(arrays, h0)
    return o, s, grads


def _has_spec(x, mesh, *spec):
    return x.sharding.is_equivalent_to(NamedSharding(mesh, P(*spec)), x.ndim)


def _assert_close(got, want, what):
    o1, s1, g1 = got
    o0, s0, g0 = want
    assert rel_rms(o1, o0) < TOL, f"{what}: o {rel_rms(o1, o0)}"
    assert rel_rms(s1, s0) < TOL, f"{what}: final state {rel_rms(s1, s0)}"
    for i, (a, b) in enumerate(zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True)):
        assert rel_rms(a, b) < TOL, f"{what}: gradient {i} {rel_rms(a, b)}"


def test_batch_and_heads_gva():
    # 2 batch shards × 4 head shards; GVA (2 value heads per q/k head) stays on one shard.
    arrays, h0 = _arrays("gdn", B=2, T=40, H=4, HV=8, K=8, V=16)
    want = _value_and_grads(gdn_jax.gated_delta_rule, arrays, h0)
    mesh = sh.make_mesh("data=2,tensor=4")
    op = sh.shard_op(
        gdn_jax.gated_delta_rule, sh.ShardingConfig(mesh, batch="data", heads="tensor")
    )
    got = _value_and_grads(op, arrays, h0)
    _assert_close(got, want, "batch+heads")
    assert _has_spec(got[0], mesh, "data", None, "tensor")
    assert _has_spec(got[1], mesh, "data", "tensor")


def test_sharding_keyword_of_the_ops():
    """``sharding=`` on the public op is the same as wrapping it with ``shard_op``."""
    arrays, h0 = _arrays("kda", B=2, T=24, H=2, HV=4, K=8, V=8)
    want = _value_and_grads(gdn_jax.kda, arrays, h0)
    cfg = sh.ShardingConfig(sh.make_mesh("data=2,tensor=2,context=2"), "data", "tensor", "context")
    got = _value_and_grads(lambda *a, **kw: gdn_jax.kda(*a, sharding=cfg, **kw), arrays, h0)
    _assert_close(got, want, "sharding keyword")


def test_packed_sequences_head_sharded():
    arrays, h0 = _arrays("kda", B=1, T=50, H=2, HV=4, K=8, V=8)
    cu = jnp.asarray([0, 13, 13, 50], jnp.int32)
    h0 = jnp.concatenate([h0, h0 * 0.5, -h0])  # N = 3 sequences (one empty)
    want = _value_and_grads(gdn_jax.kda, arrays, h0, cu_seqlens=cu)
    # An Explicit mesh: shard_map asserts input layouts there, so shard_op reshards first.
    mesh = sh.make_mesh("tensor=2", devices=jax.devices()[:2], axis_type=AxisType.Explicit)
    op = sh.shard_op(gdn_jax.kda, sh.ShardingConfig(mesh, heads="tensor"))
    _assert_close(_value_and_grads(op, arrays, h0, cu_seqlens=cu), want, "packed")


@pytest.mark.parametrize("variant", ["gdn", "kda", "gdn2"])
def test_context_parallel(variant):
    # Batch, heads and sequence split at once (2 × 2 × 2); K != V so the state map M (K×K) and
    # the offset c (K×V) differ in shape; 2 chunks of 16 per context shard.
    arrays, h0 = _arrays(variant, B=2, T=64, H=4, HV=8, K=8, V=16)
    op = OPS[variant]
    want = _value_and_grads(op, arrays, h0)
    mesh = sh.make_mesh("data=2,tensor=2,context=2")
    modes = [("all_to_all", True), ("state_passing", True)]
    if variant == "gdn2":
        modes.append(("state_passing", False))  # the linear output correction instead of a rerun
    for mode, rerun in modes:
        cfg = sh.ShardingConfig(
            mesh, batch="data", heads="tensor", context="context", context_mode=mode, rerun=rerun
        )
        got = _value_and_grads(sh.shard_op(op, cfg), arrays, h0)
        _assert_close(got, want, f"{variant} {mode} {rerun=}")
        assert _has_spec(got[0], mesh, "data", "context", "tensor")


def test_context_parallel_without_initial_state():
    # Eight context shards and no initial state: the prefix combine starts from zeros.
    arrays, _ = _arrays("gdn", B=1, T=128, H=1, HV=2, K=8, V=8)
    kw = dict(implementation="xla", chunk_size=16)
    o0, s0 = gdn_jax.gated_delta_rule(*arrays, output_final_state=True, **kw)
    mesh = sh.make_mesh("context=8")
    op = sh.shard_op(gdn_jax.gated_delta_rule, sh.ShardingConfig(mesh, context="context"))
    o1, s1 = jax.jit(lambda a: op(*a, output_final_state=True, **kw), compiler_options=FAST)(arrays)
    assert rel_rms(o1, o0) < TOL and rel_rms(s1, s0) < TOL


def test_decode_step_batch_and_heads():
    x = random_inputs(1, variant="gdn2", B=2, T=3, H=2, HV=4, K=8, V=16)
    args = [x[n] for n in ("q", "k", "v", "g", "b", "w", "initial_state")]
    o0, s0 = gdn_jax.gdn2_step(*args, use_qk_l2norm=True)
    mesh = sh.make_mesh("data=2,tensor=2", devices=jax.devices()[:4])
    step = sh.shard_step(gdn_jax.gdn2_step, sh.ShardingConfig(mesh, batch="data", heads="tensor"))
    o1, s1 = jax.jit(lambda a: step(*a, use_qk_l2norm=True), compiler_options=FAST)(args)
    assert rel_rms(o1, o0) < TOL and rel_rms(s1, s0) < TOL
    assert _has_spec(s1, mesh, "data", "tensor")
    with pytest.raises(ValueError, match="decode steps cannot be context-sharded"):
        sh.shard_step(gdn_jax.gdn2_step, sh.ShardingConfig(mesh, context="tensor"))


def test_errors_name_the_axis_and_counts():
    arrays, h0 = _arrays("gdn", B=2, T=32, H=2, HV=4, K=8, V=8)
    mesh = sh.make_mesh("data=2,tensor=4")
    op = sh.shard_op(gdn_jax.gated_delta_rule, sh.ShardingConfig(mesh, heads="tensor"))
    with pytest.raises(ValueError, match=r"mesh axis 'tensor' of size 4 must divide.*H=2.*HV=4"):
        op(*arrays, implementation="xla")
    mesh = sh.make_mesh("tensor=2,context=4")
    cfg = sh.ShardingConfig(mesh, heads="tensor", context="context", context_mode="all_to_all")
    with pytest.raises(ValueError, match=r"'context' \(size 4\); H=2.*multiple of 8"):
        sh.shard_op(gdn_jax.gated_delta_rule, cfg)(*arrays, implementation="xla")
    cfg = sh.ShardingConfig(mesh, context="context")
    with pytest.raises(ValueError, match="'context' of size 4 must divide T=30"):
        sh.shard_op(gdn_jax.gated_delta_rule, cfg)(*[x[:, :30] for x in arrays])
    cu = jnp.asarray([0, 10, 32], jnp.int32)
    with pytest.raises(ValueError, match="cu_seqlens"):
        sh.shard_op(gdn_jax.gated_delta_rule, cfg)(*[x[:1] for x in arrays], cu_seqlens=cu)
    with pytest.raises(ValueError, match="q.shape"):  # the op's own checks, on global shapes
        sh.shard_op(gdn_jax.gated_delta_rule, cfg)(arrays[0][..., :4], *arrays[1:])
    with pytest.raises(ValueError, match="'model' is not in the mesh"):
        sh.ShardingConfig(mesh, heads="model")
    with pytest.raises(ValueError, match="size 4 must divide linear_num_heads=2"):
        sh.check_model_divisibility(get_config("tiny"), sh.make_mesh("data=2,tensor=4"))


def test_parse_and_make_mesh():
    assert sh.parse_mesh("data=2, fsdp=2,tensor=2") == {"data": 2, "fsdp": 2, "tensor": 2}
    mesh = sh.make_mesh("data=-1,tensor=2")
    assert dict(mesh.shape) == {"data": 4, "tensor": 2}
    for bad in ("data", "data=x", "data=2,data=2", "a=-1,b=-1", "a=0", ""):
        with pytest.raises(ValueError, match="mesh spec"):
            sh.parse_mesh(bad)
    with pytest.raises(ValueError, match="needs 16 devices"):
        sh.make_mesh("data=16")


def test_train_step_dp_fsdp_tp(monkeypatch):
    """One AdamW step of the tiny hybrid LM on a data=2, fsdp=2, tensor=2 mesh."""
    config = get_config("tiny", num_layers=2, full_attention_interval=2)  # one GDN, one attention
    model = HybridLM(config, implementation="xla", rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    r = np.random.default_rng(0)
    tokens = jnp.asarray(r.integers(0, config.vocab_size, (4, 33)), jnp.int32)
    batch = dict(inputs=tokens[:, :-1], targets=tokens[:, 1:])
    tx = optax.adamw(1e-2)

    def step(params, opt_state, batch):
        def loss_fn(p):
            logits = nnx.merge(graphdef, p)(batch["inputs"])
            logp = jax.nn.log_softmax(logits)
            return -jnp.mean(jnp.take_along_axis(logp, batch["targets"][..., None], -1))

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return loss, grads, optax.apply_updates(params, updates)

    loss0, grads0, new0 = jax.jit(step, compiler_options=FAST)(params, tx.init(params), batch)

    mesh = sh.make_mesh("data=2,fsdp=2,tensor=2")
    rules = sh.logical_axis_rules(mesh)
    sh.check_model_divisibility(config, mesh)
    shardings = sh.model_shardings(params, mesh, rules)
    params_s = jax.device_put(params, shardings)
    q_kernel = params_s["layers"][0]["mixer"]["q_proj"]["kernel"]
    assert _has_spec(q_kernel[...], mesh, "fsdp", "tensor")  # column parallel + FSDP
    out_kernel = params_s["layers"][0]["mixer"]["out_proj"]["kernel"]
    assert _has_spec(out_kernel[...], mesh, "tensor", "fsdp")  # row parallel + FSDP
    conv = params_s["layers"][0]["mixer"]["q_conv"]["weight"]
    assert _has_spec(conv[...], mesh, None, "tensor")  # sharded with its heads
    batch_s = jax.device_put(batch, sh.batch_sharding(mesh, rules))
    # The GDN core per shard through shard_map (what a Pallas kernel needs), batch over
    # data × fsdp and heads over tensor.
    core = sh.shard_op(gdn_jax.gated_delta_rule, sh.model_core_sharding(mesh))
    monkeypatch.setitem(gdn_layer._OPS, "gdn", (core, gdn_jax.gated_delta_rule_step))
    loss1, grads1, new1 = jax.jit(step, compiler_options=FAST)(
        params_s, jax.jit(tx.init)(params_s), batch_s
    )

    assert abs(float(loss1) - float(loss0)) <= TOL * abs(float(loss0))
    for a, b in zip(jax.tree.leaves(grads1), jax.tree.leaves(grads0), strict=True):
        assert rel_rms(a, b) < TOL
    # Adam's first update is about g / |g| per element, which turns the rounding of tiny
    # gradient entries into O(lr) differences: a looser bound for the updated parameters.
    for a, b in zip(jax.tree.leaves(new1), jax.tree.leaves(new0), strict=True):
        assert rel_rms(a, b) < 10 * TOL


def _bench_sharding():
    """benchmarks/bench_sharding.py as a module (benchmarks/ is no package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_sharding.py"
    spec = importlib.util.spec_from_file_location("bench_sharding", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.slow
def test_model_modes_match_one_device():
    """benchmarks/bench_sharding.py's check (what the multi-GPU run reports): three AdamW updates
    of the hybrid LM (1 GDN layer + 1 attention layer, f32) under DP, FSDP, TP and CP on two
    devices give the one-device losses and first gradients at f32 rounding level. CP passes the
    GDN states between the sequence shards and lets XLA split the conv and attention."""
    rows = _bench_sharding().main(
        "--preset tiny --layers 2 --seq 128 --batch 2 --devices 2 --iters 0 --dtype float32 "
        "--config full_attention_interval=2 --implementation xla --tol 1e-4".split()
    )
    assert [r["mode"] for r in rows] == ["dp", "fsdp", "tp", "cp"]
    for r in rows:
        assert r["loss_rel_diff"] < 1e-5 and r["grad_rel_rms"] < 1e-4, r


@pytest.mark.slow
def test_model_modes_match_one_device_bf16():
    """In bf16 (what the GPU run uses) the sharded gradients are compared with the f32 maths:
    CP (the mode whose reductions differ most from one device's: the GDN states pass between
    the sequence shards) must be no further from it than 2x the one-device bf16 run is, and that
    distance (the rounding level) is reported, non-zero. Every mode matches one device at f32
    rounding level in test_model_modes_match_one_device."""
    bench = _bench_sharding()
    rows = bench.main(
        "--preset tiny --layers 2 --seq 64 --batch 2 --devices 2 --iters 0 --modes cp "
        "--config linear_head_dim=64 linear_v_head_dim=64 --implementation xla".split()
    )
    assert [r["mode"] for r in rows] == ["cp"]
    for r in rows:
        assert 0 < r["grad_floor"] < 0.2 and bench.matches_one_device(r, 5e-3), r
    assert not bench.matches_one_device(
        {**rows[0], "grad_rel_rms_f32": 3 * rows[0]["grad_floor"]}, 5e-3
    )


@pytest.mark.parametrize("on_mesh", [True, False])
def test_init_optimizer_state_lets_the_step_compile_once(on_mesh):
    """A train step fed its own outputs compiles once when the optimizer state comes from
    init_optimizer_state; from a bare jit(tx.init) on a mesh (counters on one device) it compiles
    again for the second step."""
    tx = optax.adamw(1e-2)
    params = {"w": jnp.ones((8, 4)), "b": jnp.zeros((4,))}
    mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,)) if on_mesh else None
    if on_mesh:
        params = {
            "w": jax.device_put(params["w"], NamedSharding(mesh, P("data"))),
            "b": jax.device_put(params["b"], NamedSharding(mesh, P())),
        }
    else:
        params = jax.device_put(params, jax.devices()[0])

    def run(opt_state):
        @jax.jit
        def step(p, s):
            grads = jax.grad(lambda p: jnp.sum(p["w"] @ p["b"] + p["w"].sum()))(p)
            updates, s = tx.update(grads, s, p)
            return optax.apply_updates(p, updates), s

        p, s = step(params, opt_state)
        step(p, s)
        return step._cache_size()

    assert run(sh.init_optimizer_state(tx, params, mesh)) == 1
    if on_mesh:
        assert run(jax.jit(tx.init)(params)) == 2
