"""Remat and host-offload policies (gdn_jax.remat) on CPU.

The CPU lowering drops host offload (the copies become no-ops), so these tests check what a CPU
can: the jaxpr moves the chosen tensors to host memory, the lowering *for cuda* carries the
``pinned_host`` placements, and results do not change.
"""

from __future__ import annotations

import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

import gdn_jax
from gdn_jax import remat


def host_shapes(jaxpr_text: str) -> list[str]:
    """(dtype, shape) of every value the forward pass copies to host memory."""
    return re.findall(r"\w+:(\w+)<host>(\[[\d,]*\]) = device_put", jaxpr_text)


def test_constants_kept():
    assert remat.CORE_RESIDUALS == ("gdn_gate_cumsum", "gdn_A", "gdn_chunk_states", "gdn_intra")
    assert len(set(remat.ALL_NAMES)) == len(remat.ALL_NAMES)
    assert set(remat.CORE_RESIDUALS) <= set(remat.ALL_NAMES)


def _toy(x):
    a = checkpoint_name(jnp.sin(x), "big")
    b = checkpoint_name(jnp.cos(x[:2, :2]), "small")
    c = checkpoint_name(jnp.tanh(x), "other")
    return jnp.sum(a * jnp.exp(a)) + jnp.sum(b * jnp.exp(b)) + jnp.sum(c * c)


def _grad_jaxpr(f, policy, *args):
    return str(jax.make_jaxpr(jax.grad(jax.checkpoint(f, policy=policy)))(*args))


def test_policy_actions_and_threshold():
    x = jnp.linspace(-1, 1, 64 * 64).reshape(64, 64)
    spec = {"big": "offload", "small": "offload", "other": "save"}
    text = _grad_jaxpr(_toy, remat.remat_policy(spec), x)
    assert sorted(host_shapes(text)) == [("f32", "[2,2]"), ("f32", "[64,64]")]
    # Threshold: the 4-element tensor stays on the device, the 4096-element one moves.
    text = _grad_jaxpr(_toy, remat.remat_policy(spec, offload_threshold=100), x)
    assert host_shapes(text) == [("f32", "[64,64]")]
    # remat: nothing moves.
    assert host_shapes(_grad_jaxpr(_toy, remat.remat_policy({"big": "remat"}), x)) == []
    # Offloading moves bits, it does not change them: bitwise equal to saving on the device.
    # (Against no checkpoint at all, recomputation may fuse differently: rounding level.)
    on_device = {"big": "save", "small": "save", "other": "save"}
    saved = jax.jit(jax.grad(jax.checkpoint(_toy, policy=remat.remat_policy(on_device))))(x)
    for th in (0, 100):
        pol = remat.remat_policy(spec, offload_threshold=th)
        g = jax.jit(jax.grad(jax.checkpoint(_toy, policy=pol)))(x)
        np.testing.assert_array_equal(g, saved)
    np.testing.assert_allclose(g, jax.grad(_toy)(x), rtol=1e-5, atol=1e-7)


def test_bad_spec_raises():
    with pytest.raises(ValueError, match="must be one of"):
        remat.remat_policy({"big": "keep"})
    with pytest.raises(ValueError, match="offload_threshold"):
        remat.remat_policy({"big": "offload"}, offload_threshold=-1)
    with pytest.raises(ValueError, match="fraction"):
        remat.layer_policies({"big": "offload"}, 4, offload_fraction=1.5)


@pytest.mark.parametrize("fraction, expected", [(0, 0), (0.5, 2), (1, 4)])
def test_offload_fraction(fraction, expected):
    assert remat.offloaded_layers(4, fraction) == tuple(i < expected for i in range(4))
    x = jnp.ones((8, 8))
    pols = remat.layer_policies({"big": "offload"}, 4, offload_fraction=fraction)
    moved = [bool(host_shapes(_grad_jaxpr(_toy, p, x))) for p in pols]
    assert moved == [i < expected for i in range(4)]


def test_spec_from_flags():
    spec = remat.spec_from_flags("save", "core,mlp_hidden")
    assert {n for n, a in spec.items() if a == "offload"} == {
        *remat.CORE_RESIDUALS,
        remat.MLP_HIDDEN,
    }
    assert spec[remat.GDN_QKV] == "save"
    assert set(remat.spec_from_flags("remat").values()) == {"remat"}


def _core_inputs(T=48, H=2, K=16):
    ks = jax.random.split(jax.random.key(1), 5)
    q = jax.random.normal(ks[0], (1, T, H, K), jnp.bfloat16)
    k = jax.random.normal(ks[1], (1, T, H, K), jnp.bfloat16)
    v = jax.random.normal(ks[2], (1, T, H, K), jnp.bfloat16)
    g = -jax.nn.softplus(jax.random.normal(ks[3], (1, T, H)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (1, T, H)))
    return q, k, v, g, beta


def _core_loss(q, k, v, g, beta):
    o, _ = gdn_jax.gated_delta_rule(
        jnp.sin(q), k, v, g, beta, use_qk_l2norm=True, chunk_size=16, implementation="xla"
    )
    return jnp.sum(jnp.square(o.astype(jnp.float32)))


def test_core_residuals_offloaded_and_results_unchanged():
    args = _core_inputs()
    spec = dict.fromkeys(remat.CORE_RESIDUALS, "offload")
    pol = remat.remat_policy(spec)
    text = _grad_jaxpr(_core_loss, pol, *args)
    # T=48, C=16: 3 chunks; G [1,3,16,2,1], A [1,3,2,16,16], states [1,3,2,16,16].
    shapes = sorted(s for _, s in host_shapes(text))
    assert len(shapes) == 3, shapes
    assert "[1,3,2,16,16]" in shapes
    # Offloading the residuals gives the bits that saving them on the device gives.
    outs = []
    for action in ("save", "offload"):
        p = remat.remat_policy(dict.fromkeys(remat.CORE_RESIDUALS, action))
        step = jax.jit(jax.grad(jax.checkpoint(_core_loss, policy=p), argnums=(0, 1, 2, 3, 4)))
        outs.append(step(*args))
    for a, b in zip(*outs, strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_compiler_options_serialise_offload_copies():
    """A step that offloads is compiled without XLA's GPU latency-hiding scheduler (which brought
    offloaded tensors back early, raising device memory on the H200); one that does not offload
    keeps the defaults. The option is one this XLA knows (a misspelt one fails to compile) and
    changes no result."""
    offload = dict.fromkeys(remat.CORE_RESIDUALS, "offload")
    opts = remat.compiler_options(offload)
    assert opts == {"xla_gpu_enable_latency_hiding_scheduler": False}
    assert remat.compiler_options(offload, overlap_copies=True) == {}
    assert remat.compiler_options(dict.fromkeys(remat.CORE_RESIDUALS, "save")) == {}
    assert remat.compiler_options(None) == {}
    args = _core_inputs()
    outs = []
    for options in (None, opts):
        p = remat.remat_policy(offload)
        grad = jax.grad(jax.checkpoint(_core_loss, policy=p), argnums=(0, 1, 2, 3, 4))
        outs.append(jax.jit(grad, compiler_options=options)(*args))
    for a, b in zip(*outs, strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    with pytest.raises(Exception, match="No such compile option"):
        misspelt = {"xla_gpu_enable_latency_hiding_schedulr": False}
        jax.jit(lambda x: x + 1, compiler_options=misspelt)(1.0)


def test_cuda_lowering_has_pinned_host():
    args = _core_inputs()
    pol = remat.remat_policy({remat.GDN_CHUNK_STATES: "offload", remat.GDN_A: "save"})
    f = jax.jit(jax.grad(jax.checkpoint(_core_loss, policy=pol)))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "annotate_device_placement" in text
    assert '_xla_buffer_placement = "pinned_host"' in text
    # and the CPU lowering of the same step holds no placement (why CPU checks the jaxpr).
    assert "pinned_host" not in f.trace(*args).lower().as_text()


@pytest.mark.parametrize("fraction, expected", [(0.0, 0), (0.5, 3), (1.0, 3)])
def test_model_offload_fraction(fraction, expected):
    """HybridLM(remat_policies=...): with 2 layers (GDN, attention) and the core's residuals
    offloaded, fraction 0.5 offloads layer 0 (the GDN layer: 3 tensors), fraction 0 none."""
    from flax import nnx

    from gdn_jax.models import HybridLM, get_config

    config = get_config(
        "tiny", num_layers=2, full_attention_interval=2, hidden_size=32, intermediate_size=64
    )
    spec = remat.spec_from_flags("save", "core")
    pols = remat.layer_policies(spec, 2, offload_fraction=fraction)
    model = HybridLM(config, dtype=jnp.bfloat16, remat_policies=pols, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    tokens = jnp.zeros((1, 16), jnp.int32)

    def loss(params):
        return nnx.merge(graphdef, params)(tokens).sum()

    assert len(host_shapes(str(jax.make_jaxpr(jax.grad(loss))(params)))) == expected


def _kda_pallas_loss(q, k, v, g, beta):
    # linear in o: its gradient does not need o itself (the layer names o GDN_CORE_OUT for that)
    o, _ = gdn_jax.kda(q, k, v, g, beta, implementation="pallas")
    return jnp.sum(o.astype(jnp.float32))


def _kernel_launches(jaxpr, name: str) -> int:
    """Pallas kernel launches named ``name`` in ``jaxpr``, sub-jaxprs counted at each use (the
    printed jaxpr shows a sub-jaxpr used twice once)."""
    n = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "mpmd_map" and eqn.params.get("name") == name:
            n += 1
            continue
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            n += _kernel_launches(sub, name)
    return n


def test_channel_pallas_products_follow_the_policy():
    """The KDA/GDN2 Pallas core keeps its intra kernel's products as named residuals: an offload
    policy moves them (5 ``gdn_intra`` + A, [1, 64, 2, 64] each) to host memory, and only a remat
    policy makes the backward rerun the intra kernel. Checked on the traced program, and the remat
    one also as lowered for CUDA (the CPU interpreter's ordered callbacks cannot run under
    ``jax.checkpoint``)."""
    from pallas_kernels import _compat as pk

    T, H, K = 64, 2, 64
    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    args = (S((1, T, H, K), bf),) * 3 + (S((1, T, H, K), jnp.float32), S((1, T, H), jnp.float32))
    for action in ("save", "offload", "remat"):
        pol = remat.remat_policy(dict.fromkeys((remat.GDN_INTRA, remat.GDN_A), action))
        f = jax.value_and_grad(jax.checkpoint(_kda_pallas_loss, policy=pol), argnums=range(5))
        with pk.cuda_lowering_mesh():
            jaxpr = jax.make_jaxpr(f)(*args)
        moved = host_shapes(str(jaxpr))
        assert sorted(moved) == ([("bf16", f"[1,{T},{H},64]")] * 6 if action == "offload" else [])
        intra = _kernel_launches(jaxpr.jaxpr, "chan_intra_wy")
        assert intra == (2 if action == "remat" else 1), (action, intra)
    assert action == "remat"  # the last policy's program, lowered
    with pk.cuda_lowering_mesh():
        txt = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = [ln for ln in txt.splitlines() if "custom_call @mosaic_gpu" in ln]
    assert sum(bool(re.search(r"\\00chan_intra_wy\\00", ln)) for ln in calls) == 2


def _pinned_names(jaxpr) -> dict[str, bool]:
    """For each checkpoint name in ``jaxpr`` (sub-jaxprs included): whether every tensor it names
    comes from ``layout_constraint(optimization_barrier(x))`` (remat.name's pin)."""
    out: dict[str, bool] = {}

    def visit(jx):
        producer = {}
        for eqn in jx.eqns:
            for v in eqn.outvars:
                producer[v] = eqn
            if eqn.primitive.name == "name":
                lc = producer.get(eqn.invars[0])
                ok = lc is not None and lc.primitive.name == "layout_constraint"
                bar = producer.get(lc.invars[0]) if ok else None
                ok = ok and bar is not None and bar.primitive.name == "optimization_barrier"
                out[eqn.params["name"]] = out.get(eqn.params["name"], True) and ok
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                visit(sub)

    visit(jaxpr)
    return out


def test_named_tensors_are_pinned():
    """Every tensor the library names is pinned (an optimisation barrier, then a row-major layout)
    before ``checkpoint_name``: what makes saving and offloading it compile to the same programs
    on the GPU (bitwise equal training there; without the pin XLA keeps a saved tensor in another
    form, e.g. a transposed copy, than the one it must copy to the host)."""
    pol = remat.remat_policy(dict.fromkeys(remat.CORE_RESIDUALS, "save"))
    jaxpr = jax.make_jaxpr(jax.grad(jax.checkpoint(_core_loss, policy=pol)))(*_core_inputs())
    pinned = _pinned_names(jaxpr.jaxpr)
    assert set(pinned) == {remat.GDN_GATE_CUMSUM, remat.GDN_A, remat.GDN_CHUNK_STATES}, pinned
    assert all(pinned.values()), pinned
