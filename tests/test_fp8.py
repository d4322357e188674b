"""FP8 projections (gdn_jax.fp8): native backend numerics, the core guard, TE recipe checks.

Tolerances (relative RMS against the BF16 layer, stated here and in docs/training.md): e4m3 has
3 mantissa bits, so one rounding is off by up to 2^-4 of the value (RMS ≈ 2^-4/√3 ≈ 3.6 %); a
projection's output carries the error of two roundings (≈ 4-5 %) and the gradients, which add an
e5m2 rounding (2 mantissa bits, RMS ≈ 7 %), ≈ 8-10 %. Through the whole GDN layer we allow 10 %
on the output and 20 % on every gradient.
"""

from __future__ import annotations

import contextlib
import re
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import gdn_jax
from gdn_jax import fp8
from gdn_jax.fp8 import te_bridge
from gdn_jax.nn import GatedDeltaNet
from gdn_jax.nn import gated_deltanet as gdn_layer
from gdn_jax.testing import rel_rms

DN = (((2,), (0,)), ((), ()))  # [B, T, D] x [D, F]


@pytest.fixture(autouse=True)
def _exact_f32_matmuls():
    """The references below are f32 matmuls; on a GPU XLA would run them in TF32 (1e-3 error)."""
    with jax.default_matmul_precision("highest"):
        yield


def _xw(dtype=jnp.float32):
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (2, 24, 32), jnp.float32).astype(dtype)
    w = (0.2 * jax.random.normal(kw, (32, 48), jnp.float32)).astype(dtype)
    return x, w


def _deq(x, dtype):
    q, s = fp8.quantize(x, dtype)
    return q.astype(jnp.float32) * s


def test_quantize():
    x = jnp.array([0.0, 1.0, -3.0, 896.0])
    q, s = fp8.quantize(x)
    assert q.dtype == jnp.float8_e4m3fn and s.dtype == jnp.float32
    assert float(s) == 2.0  # amax 896 maps to e4m3's max 448
    np.testing.assert_array_equal(q.astype(jnp.float32) * s, x)
    q, s = fp8.quantize(jnp.zeros(3), fp8.E5M2)
    assert float(s) == 1.0 and q.dtype == jnp.float8_e5m2 and not jnp.any(q.astype(float))


def test_native_forward_is_scaled_fp8_gemm():
    x, w = _xw()
    y = fp8.native_fp8_dot_general(x, w, DN)
    assert y.shape == (2, 24, 48) and y.dtype == jnp.float32
    # Exactly a GEMM of the dequantised operands (up to where the scale is applied).
    ref = jnp.einsum("btd,df->btf", _deq(x, fp8.E4M3), _deq(w, fp8.E4M3))
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
    assert rel_rms(y, x @ w) < 0.06
    # Compute dtype in, compute dtype out (f32 accumulation inside).
    xb, wb = _xw(jnp.bfloat16)
    assert fp8.native_fp8_dot_general(xb, wb, DN).dtype == jnp.bfloat16
    assert fp8.native_fp8_dot_general(xb, wb, DN, preferred_element_type=jnp.float32).dtype == (
        jnp.float32
    )


def test_native_backward_uses_e5m2_cotangent():
    x, w = _xw()
    ct = jax.random.normal(jax.random.key(3), (2, 24, 48))
    _, vjp = jax.vjp(lambda a, b: fp8.native_fp8_dot_general(a, b, DN), x, w)
    dx, dw = vjp(ct)
    g = _deq(ct.reshape(48, 48), fp8.E5M2)
    qx = _deq(x.reshape(48, 32), fp8.E4M3)
    qw = _deq(w, fp8.E4M3)
    np.testing.assert_allclose(dx, (g @ qw.T).reshape(x.shape), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, qx.T @ g, rtol=1e-5, atol=1e-5)
    _, vjp_ref = jax.vjp(lambda a, b: jnp.einsum("btd,df->btf", a, b), x, w)
    for a, b in zip((dx, dw), vjp_ref(ct), strict=True):
        assert rel_rms(a, b) < 0.1
    # The jaxpr holds the FP8 GEMMs: e4m3 x e4m3 forward, e5m2 x e4m3 backward.
    text = str(
        jax.make_jaxpr(jax.grad(lambda a, b: fp8.native_fp8_dot_general(a, b, DN).sum(), (0, 1)))(
            x, w
        )
    )
    assert "f8_e4m3fn" in text and "f8_e5m2" in text


def test_native_rejects_batch_dims():
    with pytest.raises(NotImplementedError, match="batch dims"):
        fp8.native_fp8_dot_general(
            jnp.ones((2, 3, 4)), jnp.ones((2, 4, 5)), (((2,), (1,)), ((0,), (0,)))
        )


def test_dot_general_table():
    assert fp8.dot_general(None) is jax.lax.dot_general
    assert fp8.dot_general("native") is fp8.native_fp8_dot_general
    with pytest.raises(ValueError, match="TEDense"):
        fp8.dot_general("te")
    with pytest.raises(ValueError, match="expected one of"):
        fp8.dot_general("int8")


# -- the GDN layer ---------------------------------------------------------------------------


def _layer(backend):
    layer = GatedDeltaNet(
        32, num_heads=2, head_dim=16, chunk_size=16, implementation="xla",
        dtype=jnp.bfloat16, rngs=nnx.Rngs(0),
    )  # fmt: skip
    return fp8.convert_projections(layer, backend)


def _layer_loss(layer, x, ct):
    y = layer(x)
    return jnp.sum(y.astype(jnp.float32) * ct), y


@pytest.fixture(scope="module")
def layer_data():
    kx, kc = jax.random.split(jax.random.key(1))
    return jax.random.normal(kx, (2, 32, 32)), jax.random.normal(kc, (2, 32, 32))


def test_layer_native_vs_bf16(layer_data):
    x, ct = layer_data
    out, grads = {}, {}
    for backend in (None, "native"):
        layer = _layer(backend)
        step = nnx.jit(nnx.grad(_layer_loss, argnums=(0, 1), has_aux=True))
        grads[backend], out[backend] = step(layer, x, ct)
    assert out["native"].dtype == jnp.bfloat16
    assert 0 < rel_rms(out["native"], out[None]) < 0.10
    (gp_n, gx_n), (gp_b, gx_b) = grads["native"], grads[None]
    assert rel_rms(gx_n, gx_b) < 0.20
    flat_n, flat_b = dict(nnx.to_flat_state(gp_n)), dict(nnx.to_flat_state(gp_b))
    assert flat_n.keys() == flat_b.keys()
    for path in flat_b:
        err = rel_rms(flat_n[path][...], flat_b[path][...])
        assert err < 0.20, (path, err)


def test_core_never_sees_fp8(layer_data, monkeypatch):
    """The core's inputs and outputs are never FP8, also with FP8 handed to the guard."""
    x, ct = layer_data
    seen = []
    core = gdn_layer._OPS["gdn"][0]

    def spy(*args, **kwargs):
        out = core(*args, **kwargs)
        seen.append(([a.dtype for a in args], [o.dtype for o in jax.tree.leaves(out)]))
        seen[-1] += (fp8.fp8_enabled(),)
        return out

    guarded = fp8.fp8_free(spy)
    monkeypatch.setitem(gdn_layer._OPS, "gdn", (guarded, gdn_layer._OPS["gdn"][1]))
    layer = _layer("native")
    jax.make_jaxpr(jax.grad(jax.checkpoint(lambda x: _layer_loss(layer, x, ct)[0])))(x)
    assert seen
    for ins, outs, enabled in seen:
        assert not enabled
        assert not any(
            jnp.finfo(d).bits == 8 for d in ins + outs if jnp.issubdtype(d, jnp.floating)
        )
    # FP8 arguments are upcast before the core sees them.
    q = jnp.ones((1, 16, 2, 16), jnp.float8_e4m3fn)
    g, beta = -jnp.ones((1, 16, 2)) * 0.1, jnp.ones((1, 16, 2)) * 0.5
    o, _ = guarded(q, q, q, g, beta, chunk_size=16, implementation="xla")
    assert seen[-1][0][:3] == [jnp.bfloat16] * 3 and o.dtype == jnp.bfloat16


def test_no_fp8_region_has_no_fp8_ops():
    """A projection traced inside the guard (forward and backward, under remat) stays BF16."""
    x, w = _xw(jnp.bfloat16)

    def f(x, w):
        with fp8.no_fp8():
            y = fp8.native_fp8_dot_general(x, w, DN)
            o, _ = gdn_jax.gated_delta_rule(
                y[..., :32].reshape(2, 24, 2, 16), y[..., 16:48].reshape(2, 24, 2, 16),
                y[..., :32].reshape(2, 24, 2, 16), -jnp.ones((2, 24, 2)) * 0.1,
                jnp.ones((2, 24, 2)) * 0.5, chunk_size=16, implementation="xla",
            )  # fmt: skip
        return o.astype(jnp.float32).sum()

    text = str(jax.make_jaxpr(jax.grad(jax.checkpoint(f), (0, 1)))(x, w))
    assert "f8" not in text


def test_context_restored_after_exception():
    assert fp8.fp8_enabled()
    with pytest.raises(RuntimeError, match="boom"), fp8.no_fp8():
        assert not fp8.fp8_enabled()
        raise RuntimeError("boom")
    assert fp8.fp8_enabled()
    with fp8.no_fp8():
        with fp8.no_fp8():
            pass
        assert not fp8.fp8_enabled()  # an inner exit restores the outer guard, not "on"
    assert fp8.fp8_enabled()


@pytest.fixture
def fake_te(monkeypatch):
    """A stand-in for TE-JAX's autocast state with the behaviour that makes restoring
    necessary: its autocast *resets* the global config on exit instead of restoring it."""
    helper = types.ModuleType("transformer_engine.jax.quantize.helper")

    class QuantizeConfig:
        INITIALIZED = False
        RECIPE = None

    helper.QuantizeConfig = QuantizeConfig

    @contextlib.contextmanager
    def autocast(enabled=False, recipe=None, mesh_resource=None):
        try:
            QuantizeConfig.INITIALIZED, QuantizeConfig.RECIPE = enabled, recipe
            yield
        finally:
            QuantizeConfig.INITIALIZED, QuantizeConfig.RECIPE = False, None

    te = types.ModuleType("transformer_engine.jax")
    te.autocast = autocast
    monkeypatch.setitem(sys.modules, "transformer_engine.jax", te)
    monkeypatch.setitem(sys.modules, helper.__name__, helper)
    return te, QuantizeConfig


def test_te_autocast_state_restored(fake_te):
    te, cfg = fake_te
    with te.autocast(enabled=True, recipe="outer"):
        with fp8.no_fp8():
            assert not cfg.INITIALIZED  # the core runs with TE's quantisation off
        assert cfg.INITIALIZED and cfg.RECIPE == "outer"  # restored, not reset
        with pytest.raises(ValueError, match="inside"), fp8.no_fp8():
            raise ValueError("inside the core")
        assert cfg.INITIALIZED and cfg.RECIPE == "outer"
        assert fp8.fp8_enabled()


# -- TE recipes and availability ---------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_blackwell_recipes_rejected_on_hopper(recipe):
    with pytest.raises(fp8.UnsupportedRecipeError) as e:
        fp8.check_recipe(recipe, compute_capability="9.0", device_kind="NVIDIA H200")
    msg = str(e.value)
    assert "NVIDIA H200" in msg and "BlockScaling" in msg and "10.0" in msg
    assert fp8.check_recipe(recipe, compute_capability="10.0", device_kind="NVIDIA B200")


def test_recipe_checks():
    for name, cls in (("delayed", "DelayedScaling"), ("current", "Float8CurrentScaling")):
        assert fp8.check_recipe(name, compute_capability="9.0") == cls
    with pytest.raises(fp8.UnsupportedRecipeError, match="8.9"):
        fp8.check_recipe("current", compute_capability="8.0", device_kind="NVIDIA A100")
    with pytest.raises(fp8.UnsupportedRecipeError, match="expected one of"):
        fp8.check_recipe("int8")

    class Float8BlockScaling:  # a TE recipe TE-JAX does not run
        pass

    with pytest.raises(fp8.UnsupportedRecipeError, match="Float8BlockScaling"):
        fp8.check_recipe(Float8BlockScaling(), compute_capability="9.0")
    if not any(d.platform == "gpu" for d in jax.devices()):
        with pytest.raises(fp8.UnsupportedRecipeError, match="needs an NVIDIA GPU"):
            fp8.check_recipe("current")


TE_OK, TE_WHY = fp8.te_available()


@pytest.mark.skipif(TE_OK, reason="TE imports here; the missing-TE error is not reachable")
def test_te_missing_is_a_clear_error():
    with pytest.raises(fp8.TEUnavailableError, match="TransformerEngine-JAX"):
        fp8.TEDense(8, 8, rngs=nnx.Rngs(0))


@pytest.mark.skipif(not TE_OK, reason=f"TransformerEngine-JAX unavailable: {TE_WHY}")
@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_te_dense_vs_bf16(recipe):
    x, w = _xw(jnp.bfloat16)
    layer = fp8.TEDense(32, 48, recipe=recipe, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    layer.inner.kernel[...] = w.astype(jnp.float32)
    y = layer(x)
    assert rel_rms(y, x.astype(jnp.float32) @ w.astype(jnp.float32)) < 0.1
    state = nnx.state(layer, (nnx.Param, fp8.FP8Meta))
    graphdef = nnx.graphdef(layer)

    def loss(state):
        return nnx.merge(graphdef, state)(x).astype(jnp.float32).sum()

    grads = jax.grad(loss)(state)
    params, meta = fp8.split_fp8_meta_grads(grads)
    assert jax.tree.leaves(params)
    if recipe == "delayed":
        assert jax.tree.leaves(meta)  # amax histories / scales come back as "gradients"


def test_model_fp8_option():
    from gdn_jax.models import HybridLM, get_config

    config = get_config(
        "tiny", num_layers=2, full_attention_interval=2, hidden_size=32, intermediate_size=64
    )
    model = HybridLM(config, dtype=jnp.bfloat16, fp8="native", rngs=nnx.Rngs(0))
    linears = [(p, m) for p, m in nnx.iter_graph(model) if isinstance(m, nnx.Linear)]
    assert len(linears) == 7 + 5 + 3 * 2 + 1  # GDN, attention, 2 MLPs, LM head
    for path, lin in linears:
        native = lin.dot_general is fp8.native_fp8_dot_general
        assert native == ("lm_head" not in path), path
    with pytest.raises(fp8.TEUnavailableError if not TE_OK else fp8.UnsupportedRecipeError):
        HybridLM(config, fp8="te", fp8_recipe="mxfp8", rngs=nnx.Rngs(0))


def test_native_lowers_to_fp8_dots_for_cuda():
    """The CUDA lowering (made on this CPU) holds e4m3 x e4m3 and e5m2 x e4m3 dot_generals with
    f32 results: the form XLA's GPU compiler turns into cuBLASLt FP8 GEMMs."""
    x, w = _xw(jnp.bfloat16)
    loss = lambda a, b: fp8.native_fp8_dot_general(a, b, DN).astype(jnp.float32).sum()
    f = jax.jit(jax.value_and_grad(loss, (0, 1)))
    text = f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert any("f8E4M3FN" in d and "f8E5M2" not in d and "-> tensor<" in d for d in dots), dots
    assert sum("f8E5M2" in d and "f8E4M3FN" in d for d in dots) == 2, dots


def _gemm_backends(hlo: str) -> dict[str, int]:
    """GEMMs of a compiled GPU program by kind: cuBLASLt FP8 custom calls, Triton GEMM fusions
    whose operands are FP8, and GEMMs of any other kind (an upcast product)."""
    lt_f8 = hlo.count('custom_call_target="__cublas$lt$matmul$f8"')
    other_cublas = len(re.findall(r'custom_call_target="__cublas(?!\$lt\$matmul\$f8")', hlo))
    heads = [
        h.split("->")[0] for h in re.findall(r"^\s*%?\S*gemm_fusion\S*computation.*$", hlo, re.M)
    ]
    triton_f8 = sum("f8e" in h for h in heads)
    return dict(cublaslt_f8=lt_f8, triton_f8=triton_f8, other=other_cublas + len(heads) - triton_f8)


@pytest.mark.gpu
# the model's shape is slow to compile (XLA autotunes its GEMMs): in the slow set
@pytest.mark.parametrize("shape", ["tiny", pytest.param("model", marks=pytest.mark.slow)])
def test_native_compiles_to_fp8_gemms(shape):
    """On the H200 the native backend's forward and both backward products are FP8 tensor-core
    GEMMs, never upcast BF16 ones. At the model's MLP shape ([2, 2048, 1024] x [1024, 3584])
    they are cuBLASLt FP8 GEMMs (``__cublas$lt$matmul$f8``); at a tiny shape XLA's autotuner
    may pick its Triton FP8 GEMM fusion instead, which is still FP8."""
    if shape == "tiny":
        x, w = _xw(jnp.bfloat16)
    else:
        kx, kw = jax.random.split(jax.random.key(1))
        x = jax.random.normal(kx, (2, 2048, 1024), jnp.bfloat16)
        w = (0.03 * jax.random.normal(kw, (1024, 3584), jnp.float32)).astype(jnp.bfloat16)
    # a random cotangent, so that XLA cannot fold the backward products into constants
    r = jax.random.normal(jax.random.key(2), x.shape[:-1] + w.shape[-1:], jnp.float32)
    loss = lambda a, b: (fp8.native_fp8_dot_general(a, b, DN).astype(jnp.float32) * r).sum()
    hlo = jax.jit(jax.value_and_grad(loss, (0, 1))).lower(x, w).compile().as_text()
    kinds = _gemm_backends(hlo)
    assert kinds["other"] == 0 and kinds["cublaslt_f8"] + kinds["triton_f8"] == 3, kinds
    if shape == "model":
        assert kinds["cublaslt_f8"] == 3, kinds


# -- the TE backend's glue, against a stand-in for TE ----------------------------------------


@pytest.fixture
def stand_in_te(monkeypatch, fake_te):
    """TE-JAX replaced by a minimal stand-in with TE's interfaces: a Linen ``DenseGeneral`` whose
    delayed-scaling metadata (collection ``fp8_metas``) comes back updated as its gradient, and
    the recipe classes. Checks our bridging (NNX state, autocast, metadata update) on a CPU."""
    from flax import linen

    te, cfg = fake_te

    @jax.custom_vjp
    def dense_with_history(x, kernel, hist):
        return x @ kernel

    def fwd(x, kernel, hist):
        return x @ kernel, (x, kernel, hist)

    def bwd(res, g):
        x, kernel, hist = res
        # TE's convention: the "gradient" of the metadata is its updated value.
        new_hist = jnp.roll(hist, 1).at[0].set(jnp.max(jnp.abs(x)).astype(hist.dtype))
        return g @ kernel.T, jnp.einsum("...i,...o->io", x, g), new_hist

    dense_with_history.defvjp(fwd, bwd)

    class DenseGeneral(linen.Module):
        features: int
        use_bias: bool = True
        kernel_init: object = linen.initializers.lecun_normal()
        kernel_axes: tuple = ()
        dtype: object = jnp.float32

        @linen.compact
        def __call__(self, x):
            assert cfg.INITIALIZED, "TE modules run under autocast"
            # Like TE: the kernel carries its logical axes (a LogicallyPartitioned box).
            init = linen.with_logical_partitioning(self.kernel_init, self.kernel_axes)
            kernel = self.param("kernel", init, (x.shape[-1], self.features))
            hist = self.variable("fp8_metas", "x_amax_history", jnp.zeros, (4,), jnp.float32)
            return dense_with_history(x, kernel.astype(x.dtype), hist.value)

    recipe = types.ModuleType("transformer_engine.common.recipe")
    for name in ("DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling"):
        setattr(recipe, name, type(name, (), {"__init__": lambda self, **kw: None}))
    recipe.Format = types.SimpleNamespace(HYBRID="HYBRID")
    te_flax = types.ModuleType("transformer_engine.jax.flax")
    te_flax.DenseGeneral = DenseGeneral
    te.flax = te_flax
    root, common = (
        types.ModuleType("transformer_engine"),
        types.ModuleType("transformer_engine.common"),
    )
    root.jax, root.common, common.recipe = te, common, recipe
    for mod in (root, common, recipe, te_flax):
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setattr(te_bridge, "_gpu_capability", lambda: (9.0, "NVIDIA H200"))
    return cfg


def test_te_glue_with_stand_in(stand_in_te):
    cfg = stand_in_te
    assert fp8.te_available() == (True, "")
    with pytest.raises(fp8.UnsupportedRecipeError, match="MXFP8BlockScaling.*NVIDIA H200"):
        fp8.make_recipe("mxfp8")
    x, w = _xw(jnp.bfloat16)
    layer = fp8.TEDense(32, 48, recipe="delayed", dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    assert not cfg.INITIALIZED  # autocast left as it was found
    layer.inner.kernel[...] = w.astype(jnp.float32)
    np.testing.assert_allclose(layer(x), x @ w, rtol=1e-2)
    graphdef, params, meta = nnx.split(layer, nnx.Param, fp8.FP8Meta)
    assert [v.shape for v in jax.tree.leaves(meta)] == [(4,)]

    @jax.jit
    def step(params, meta):
        def loss(params, meta):
            return nnx.merge(graphdef, params, meta)(x).astype(jnp.float32).sum()

        grads = jax.grad(loss, argnums=(0, 1))(params, meta)
        return fp8.split_fp8_meta_grads(nnx.merge_state(*grads))

    param_grads, new_meta = step(params, meta)
    assert jax.tree.leaves(param_grads)[0].shape == (32, 48)
    hist = jax.tree.leaves(new_meta)[0]
    assert float(hist[0]) == float(jnp.max(jnp.abs(x)))  # the train step's metadata update
    # Inside the core's guard the TE layer falls back to a plain (bf16) product.
    with fp8.no_fp8():
        np.testing.assert_allclose(layer(x), x @ w, rtol=1e-2)
    # convert_projections("te") swaps Linear for TEDense holding the same kernel.
    lin = nnx.Linear(32, 48, use_bias=False, dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
    holder = nnx.Dict(proj=lin)
    fp8.convert_projections(holder, "te", recipe="current")
    assert isinstance(holder["proj"], fp8.TEDense)
    np.testing.assert_array_equal(holder["proj"].inner.kernel[...], lin.kernel[...])
