"""GatedDeltaNet: shapes, dtypes, init, decode == prefill, packed == separate, Linen, sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gdn_jax.nn import GatedDeltaNet, GDNCache, gated_deltanet_linen

D = 32
VARIANTS = ["gdn", "kda", "gdn2"]


def make(variant="gdn", **kw):
    # GVA (2 q/k heads, 4 value heads) and K != V by default.
    args = dict(num_heads=2, head_dim=8, num_v_heads=4, v_head_dim=6, chunk_size=16)
    args.update(kw)
    return GatedDeltaNet(D, variant=variant, **args, rngs=nnx.Rngs(0))


@nnx.jit
def run(layer, x, cu_seqlens=None):
    return layer(x, cu_seqlens=cu_seqlens)


def rand(shape, seed=1, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


def max_err(a, b):
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


@pytest.mark.parametrize("variant", VARIANTS)
def test_shapes_and_param_shapes(variant):
    layer = make(variant)
    y = run(layer, rand((2, 13, D)))
    assert y.shape == (2, 13, D) and y.dtype == jnp.float32
    H, K, HV, V = 2, 8, 4, 6
    G = HV if variant == "gdn" else HV * K
    assert layer.a_proj.kernel.shape == (D, G)
    assert layer.dt_bias.shape == (G,)
    assert layer.A_log.shape == (HV,)
    assert layer.b_proj.kernel.shape == (D, HV * K if variant == "gdn2" else HV)
    assert layer.q_conv.weight.shape == (4, H * K) and layer.v_conv.weight.shape == (4, HV * V)
    assert hasattr(layer, "w_proj") == (variant == "gdn2")


def test_dtypes():
    layer = make("gdn", dtype=jnp.bfloat16)
    x = rand((1, 9, D))
    assert run(layer, x).dtype == jnp.bfloat16
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(layer, nnx.Param)))
    # Gates are f32 whatever the compute dtype.
    assert all(g.dtype == jnp.float32 for g in layer._gates(x.astype(jnp.bfloat16)))
    half = make("gdn", param_dtype=jnp.bfloat16)
    assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(nnx.state(half, nnx.Param)))


def test_bf16_close_to_f32():
    x = rand((1, 20, D))
    f32 = run(make("gdn"), x)
    bf16 = run(make("gdn", dtype=jnp.bfloat16), x)
    assert max_err(f32, bf16) < 0.05 * float(jnp.max(jnp.abs(f32)))


def test_init_statistics():
    layer = GatedDeltaNet(16, num_heads=64, head_dim=4, num_v_heads=256, rngs=nnx.Rngs(3))
    A = np.exp(np.asarray(layer.A_log[...]))
    assert A.min() >= 1.0 and A.max() <= 16.0
    assert abs(A.mean() - 8.5) < 1.0  # U(1, 16)
    dt = np.asarray(jax.nn.softplus(layer.dt_bias[...]))
    assert dt.min() >= 1e-3 * (1 - 1e-4) and dt.max() <= 0.1 * (1 + 1e-4)
    # log-uniform: log(dt) has mean (log 1e-3 + log 0.1) / 2.
    assert abs(np.log(dt).mean() - 0.5 * (np.log(1e-3) + np.log(0.1))) < 0.4
    np.testing.assert_array_equal(np.asarray(layer.norm.weight[...]), 1.0)
    assert np.abs(np.asarray(layer.q_conv.weight[...])).max() <= 0.5  # U(+-1/sqrt(4))
    kernel = np.asarray(layer.q_proj.kernel[...])
    assert abs(kernel.std() - 16**-0.5) < 0.1 * 16**-0.5  # LeCun normal


@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_equals_prefill(variant):
    layer = make(variant)
    x = rand((2, 41, D))
    want = run(layer, x)
    cache = layer.init_cache(2)
    assert isinstance(cache, GDNCache) and cache.state.dtype == jnp.float32
    outs = []
    # A short prefill (shorter than the conv tail), a chunked prefill crossing chunk boundaries,
    # then token-by-token decode.
    for lo, hi in [(0, 2), (2, 35)] + [(t, t + 1) for t in range(35, 41)]:
        y, cache = jax.jit(layer.extend)(x[:, lo:hi], cache)
        outs.append(y)
    assert max_err(jnp.concatenate(outs, axis=1), want) < 1e-4


@pytest.mark.parametrize("variant", VARIANTS)
def test_packed_equals_separate(variant):
    layer = make(variant)
    lengths = [7, 0, 20, 5]
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    x = rand((1, sum(lengths), D))
    packed = run(layer, x, cu)
    for i, n in enumerate(lengths):
        if n:
            lo = int(cu[i])
            assert max_err(packed[:, lo : lo + n], run(layer, x[:, lo : lo + n])) < 1e-4


def test_gradients_reach_every_parameter():
    layer = make("gdn2")
    graphdef, params = nnx.split(layer, nnx.Param)
    x = rand((1, 12, D))
    grads = jax.jit(jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p)(x) ** 2)))(params)
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        assert bool(jnp.all(jnp.isfinite(g))) and float(jnp.abs(g).max()) > 0, path


def test_qat_reaches_the_core():
    from gdn_jax.qat import QATConfig

    layer = make("gdn", chunk_size=64)  # QAT is defined for 64-token chunks
    x = rand((1, 130, D))
    plain = run(layer, x)
    layer.qat = QATConfig()
    quantised = run(layer, x)
    assert 0 < max_err(plain, quantised) < 0.1 * float(jnp.abs(plain).max())


@pytest.mark.slow
def test_linen_adapter_matches_nnx():
    kw = dict(num_heads=2, head_dim=8, num_v_heads=4, v_head_dim=6, chunk_size=16)
    x = rand((2, 10, D))
    linen_layer = gated_deltanet_linen(D, **kw)
    variables = jax.jit(linen_layer.init)(jax.random.key(0), x)
    y_linen = jax.jit(linen_layer.apply)(variables, x)
    # The same weights in an NNX layer give the same output.
    layer = GatedDeltaNet(D, **kw, rngs=nnx.Rngs(123))
    graphdef, state = nnx.split(layer)
    pure = jax.tree.map(
        lambda m: m.value, variables["params"], is_leaf=lambda m: hasattr(m, "value")
    )
    nnx.replace_by_pure_dict(state, pure)
    y_nnx = run(nnx.merge(graphdef, state), x)
    np.testing.assert_array_equal(np.asarray(y_linen), np.asarray(y_nnx))


def test_every_param_has_logical_axes():
    layer = make("gdn2")
    for path, var in jax.tree_util.tree_leaves_with_path(
        nnx.state(layer, nnx.Param), is_leaf=lambda v: isinstance(v, nnx.Variable)
    ):
        axes = var.get_metadata().get("out_sharding")
        assert axes is not None and len(axes) == var.ndim, path


def test_sharded_init_and_forward():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rules = [("embed", None), ("heads", "model"), ("conv_taps", None), ("norm", None)]
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        layer = GatedDeltaNet(D, num_heads=4, head_dim=8, chunk_size=16, rngs=nnx.Rngs(0))
        assert layer.q_proj.kernel[...].sharding.spec == jax.P(None, "model")
        assert layer.A_log[...].sharding.spec == jax.P("model")
        y = nnx.jit(lambda m, x: m(x))(layer, rand((2, 8, D)))
    assert y.shape == (2, 8, D)


def test_bad_arguments():
    with pytest.raises(ValueError, match="variant"):
        make("mamba")
    with pytest.raises(ValueError, match="num_v_heads"):
        make(num_v_heads=3)
