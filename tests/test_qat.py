"""QAT: FP8 fake quantisation at the state and w sites of the chunked path."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from gdn_cases import CHUNK, OPS, RECURRENT, positional, value_and_grads

from gdn_jax import qat
from gdn_jax.nn import apply_qat_policy
from gdn_jax.testing import random_inputs, rel_rms

XLA = dict(implementation="xla")


@pytest.mark.parametrize("axes", [(-1,), (-2,), (-2, -1)])
def test_fake_quant_matches_numpy_e4m3(axes):
    x = np.random.default_rng(0).standard_normal((4, 16, 8)).astype(np.float32) * 7
    x[0] = 0.0  # an all-zero group stays zero
    x[1] *= np.float32(1e-37)  # a decayed state: 448 / amax would overflow f32 without the floor
    amax = np.maximum(np.max(np.abs(x), axis=axes, keepdims=True), np.float32(2.0**-100))
    inv_scale = (np.float32(448.0) / amax).astype(np.float32)
    scale = (amax * np.float32(1 / 448.0)).astype(np.float32)
    want = (x * inv_scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale
    got = np.asarray(qat.fake_quant(jnp.asarray(x), axes))
    np.testing.assert_array_equal(got, want)
    assert np.all(got[0] == 0) and np.all(np.isfinite(got))
    assert np.all(np.abs(got[1]) <= 2.0**-100)  # quantised on the floor's scale: about zero


def test_fake_quant_gradient_is_straight_through():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((4, 8)), jnp.float32)
    ct = jnp.asarray(np.random.default_rng(2).standard_normal((4, 8)), jnp.float32)
    _, vjp = jax.vjp(lambda x: qat.fake_quant(x, (-1,)), x)
    np.testing.assert_array_equal(np.asarray(vjp(ct)[0]), np.asarray(ct))


def test_state_site_equals_recurrence_quantised_every_chunk():
    """Exact reference: the token recurrence with the state fake-quantised every 64 tokens."""
    cfg = qat.QATConfig(sites=("state",))
    x = random_inputs(3, B=2, T=150, H=1, HV=2, K=16, V=16, variant="gdn")
    args, h0 = positional(x, "gdn"), x["initial_state"]
    kw = dict(use_qk_l2norm=True, qat=cfg)
    (o_r, s_r), g_r = value_and_grads(RECURRENT["gdn"], args, h0, **kw)
    (o, s), g = value_and_grads(OPS["gdn"], args, h0, **XLA, **kw)
    assert rel_rms(o, o_r) <= 1e-5 and rel_rms(s, s_r) <= 1e-5
    for a, b in zip(g, g_r, strict=True):
        assert rel_rms(a, b) <= 1e-5


@pytest.mark.parametrize("variant", ["gdn", "gdn2"])
@pytest.mark.parametrize("granularity", [("column", "row"), ("matrix", "tile")])
def test_xla_matches_chunk_reference_with_both_sites(variant, granularity):
    cfg = qat.QATConfig(state_granularity=granularity[0], w_granularity=granularity[1])
    x = random_inputs(4, B=1, T=140, H=1, HV=2, K=16, V=8, variant=variant)
    args, h0 = positional(x, variant), x["initial_state"]
    kw = dict(use_qk_l2norm=True, qat=cfg)
    (o_r, s_r), g_r = value_and_grads(CHUNK[variant], args, h0, **kw)
    (o, s), g = value_and_grads(OPS[variant], args, h0, **XLA, **kw)
    assert rel_rms(o, o_r) <= 1e-6 and rel_rms(s, s_r) <= 1e-6
    for a, b in zip(g, g_r, strict=True):
        assert rel_rms(a, b) <= 1e-5


def test_enabling_changes_output_and_disabling_restores_it_bitwise():
    """The op without ``qat``, with ``qat=None`` (bitwise the same) and with each site on (each
    call jitted: a program per setting)."""
    x = random_inputs(5, B=1, T=130, H=1, HV=2, K=16, V=16, dtype=jnp.bfloat16)
    args = positional(x, "gdn")
    default = jax.jit(lambda *a: OPS["gdn"](*a, use_qk_l2norm=True, **XLA)[0])
    with_qat = jax.jit(
        lambda *a, cfg: OPS["gdn"](*a, use_qk_l2norm=True, qat=cfg, **XLA)[0],
        static_argnames="cfg",
    )
    base = default(*args)
    np.testing.assert_array_equal(np.asarray(base), np.asarray(with_qat(*args, cfg=None)))
    for sites in (("state",), ("w",)):
        on = with_qat(*args, cfg=qat.QATConfig(sites=sites))
        assert 0 < rel_rms(on, base) < 0.2, sites  # changed, but by FP8 rounding only


def test_policy_last_match_wins_and_round_trips():
    on = qat.QATConfig()
    state_only = qat.QATConfig(sites=("state",), state_granularity="matrix")
    policy = qat.QATPolicy(
        (
            qat.QATRule("layers.*", on),
            qat.QATRule("layers.3.*", None),
            qat.QATRule("layers.3.mixer", state_only),
        )
    )
    assert policy.resolve("layers.0.mixer") == on
    assert policy.resolve("layers.3.mlp") is None
    assert policy.resolve("layers.3.mixer") == state_only
    assert policy.resolve("embed") is None
    again = qat.policy_from_json(qat.policy_to_json(policy))
    assert again == policy


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(fmt="e5m2"), "fmt must be one of"),
        (dict(sites=("state", "h")), "sites must be"),
        (dict(state_granularity="row"), "state_granularity"),
        (dict(w_granularity="column"), "w_granularity"),
    ],
)
def test_bad_configs_are_rejected(kw, match):
    with pytest.raises(ValueError, match=match):
        qat.QATConfig(**kw)


def test_unsupported_op_options_are_rejected():
    x = random_inputs(6, B=1, T=20, H=1, HV=1, K=8, V=8)
    args = positional(x, "gdn")
    with pytest.raises(ValueError, match="chunk_size=64"):
        OPS["gdn"](*args, chunk_size=32, qat=qat.QATConfig())
    with pytest.raises(ValueError, match="QATConfig"):
        OPS["gdn"](*args, qat={"sites": ["state"]})


def _tiny_model():
    from flax import nnx

    from gdn_jax.models import HybridLM, get_config

    return HybridLM(get_config("tiny"), implementation="xla", rngs=nnx.Rngs(0))


def test_policy_on_the_hybrid_model_and_an_optimizer_step():
    import optax
    from flax import nnx

    tokens = jnp.asarray(np.random.default_rng(7).integers(0, 256, (2, 70)), jnp.int32)
    policy = qat.QATPolicy(
        (qat.QATRule("layers.*.mixer", qat.QATConfig()), qat.QATRule("layers.1.*", None))
    )
    model = _tiny_model()
    # jitted: a whole-model program per QAT setting (the policy is part of the module graph, so
    # each setting traces anew) instead of hundreds of op-by-op compiles
    forward = nnx.jit(lambda m, t: m(t))
    base = forward(model, tokens)
    resolved = apply_qat_policy(model, policy)
    assert resolved == {"layers.0.mixer": qat.QATConfig(), "layers.1.mixer": None,
                        "layers.2.mixer": qat.QATConfig()}  # fmt: skip
    quantised = forward(model, tokens)
    assert 0 < rel_rms(quantised, base) < 0.1
    apply_qat_policy(model, qat.QATPolicy())  # all off: bitwise the model without QAT
    np.testing.assert_array_equal(np.asarray(forward(model, tokens)), np.asarray(base))

    # One AdamW step with QAT on trains (finite loss, every parameter moves).
    apply_qat_policy(model, policy)
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

    def loss_fn(m):
        logits = m(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    @nnx.jit
    def step(m, opt):
        loss, grads = nnx.value_and_grad(loss_fn)(m)
        opt.update(m, grads)
        return loss

    before = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
    loss = step(model, opt)
    assert np.isfinite(float(loss))
    moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), before, nnx.state(model, nnx.Param))
    assert all(jax.tree.leaves(moved))


def test_checkpoint_round_trip_keeps_the_policy(tmp_path):
    import orbax.checkpoint as ocp
    from flax import nnx

    tokens = jnp.asarray(np.random.default_rng(8).integers(0, 256, (1, 40)), jnp.int32)
    policy = qat.QATPolicy((qat.QATRule("layers.2.mixer", qat.QATConfig(sites=("w",))),))
    model = _tiny_model()
    apply_qat_policy(model, policy)
    forward = nnx.jit(lambda m, t: m(t))  # one program serves both models (the same graph)
    want = forward(model, tokens)
    with ocp.CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(0, args=ocp.args.StandardSave(nnx.state(model, nnx.Param)))
        mgr.wait_until_finished()
    qat.save_policy(tmp_path / "ckpt", policy)

    fresh = _tiny_model()
    with ocp.CheckpointManager(tmp_path / "ckpt") as mgr:
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, nnx.state(fresh, nnx.Param))
        nnx.update(fresh, mgr.restore(0, args=ocp.args.StandardRestore(target)))
    restored = qat.load_policy(tmp_path / "ckpt")
    assert restored == policy
    apply_qat_policy(fresh, restored)
    np.testing.assert_array_equal(np.asarray(forward(fresh, tokens)), np.asarray(want))
