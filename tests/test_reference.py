"""The chunked reference equals the token recurrence, and the variants reduce to each other."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gdn_cases import CHUNK, RECURRENT, positional

from gdn_jax.testing import check_2x, random_inputs, rel_rms


@pytest.mark.parametrize("variant", ["gdn", "kda", "gdn2"])
@pytest.mark.parametrize(
    "T,H,HV,K,V,C",
    [(1, 1, 1, 16, 16, 16), (63, 2, 4, 16, 8, 32), (65, 1, 2, 8, 16, 64), (200, 2, 2, 16, 16, 64)],
)
def test_chunk_matches_recurrent(variant, T, H, HV, K, V, C):
    x = random_inputs(0, B=2, T=T, H=H, HV=HV, K=K, V=V, variant=variant)
    args = positional(x, variant)
    kw = dict(initial_state=x["initial_state"], output_final_state=True, use_qk_l2norm=True)
    o_ref, s_ref = RECURRENT[variant](*args, **kw)
    o, s = CHUNK[variant](*args, chunk_size=C, **kw)
    assert rel_rms(o, o_ref) <= 1e-5
    assert rel_rms(s, s_ref) <= 1e-5


@pytest.mark.parametrize("gate_scale", [0.01, 1.0, 10.0])
@pytest.mark.parametrize("variant", ["gdn", "kda"])
def test_gate_scales(variant, gate_scale):
    x = random_inputs(1, B=1, T=96, H=1, HV=2, K=16, V=16, variant=variant, gate_scale=gate_scale)
    args = positional(x, variant)
    kw = dict(initial_state=x["initial_state"], output_final_state=True, use_qk_l2norm=True)
    o_ref, s_ref = RECURRENT[variant](*args, **kw)
    o, s = CHUNK[variant](*args, **kw)
    assert rel_rms(o, o_ref) <= 1e-5
    assert rel_rms(s, s_ref) <= 1e-5


def test_gdn2_with_b_w_beta_is_kda():
    x = random_inputs(2, B=1, T=70, H=2, HV=2, K=16, V=8, variant="kda")
    beta = x["beta"]
    b = jnp.broadcast_to(beta[..., None], x["g"].shape)
    w = jnp.broadcast_to(beta[..., None], x["v"].shape)
    for fam in (CHUNK, RECURRENT):
        o1, s1 = fam["kda"](x["q"], x["k"], x["v"], x["g"], beta, output_final_state=True)
        o2, s2 = fam["gdn2"](x["q"], x["k"], x["v"], x["g"], b, w, output_final_state=True)
        assert rel_rms(o2, o1) <= 1e-5 and rel_rms(s2, s1) <= 1e-5


def test_kda_with_channel_constant_gate_is_gdn():
    x = random_inputs(3, B=1, T=70, H=1, HV=2, K=16, V=8, variant="gdn")
    gk = jnp.broadcast_to(x["g"][..., None], x["g"].shape + (16,))
    for fam in (CHUNK, RECURRENT):
        o1, s1 = fam["gdn"](x["q"], x["k"], x["v"], x["g"], x["beta"], output_final_state=True)
        o2, s2 = fam["kda"](x["q"], x["k"], x["v"], gk, x["beta"], output_final_state=True)
        assert rel_rms(o2, o1) <= 1e-5 and rel_rms(s2, s1) <= 1e-5


def test_channel_decay_stays_finite_with_strong_gates():
    # -5 per token per channel over whole chunks: e^{-320} underflows, nothing may overflow.
    x = random_inputs(4, B=1, T=128, H=1, HV=1, K=16, V=16, variant="kda", gate_scale=5.0)
    g = jnp.full_like(x["g"], -5.0)
    args = (x["q"], x["k"], x["v"], g, x["beta"])
    o_ref, s_ref = RECURRENT["kda"](*args, output_final_state=True, use_qk_l2norm=True)
    o, s = CHUNK["kda"](*args, output_final_state=True, use_qk_l2norm=True)
    assert jnp.all(jnp.isfinite(o)) and jnp.all(jnp.isfinite(s))
    assert rel_rms(o, o_ref) <= 1e-5


def test_check_2x_rule():
    """gdn_jax.testing.check_2x: passes within 2x of the io-dtype reference, fails outside it and
    on a non-finite output even where the reference overflowed, skips absent outputs."""
    r = np.ones(8)
    lo = r + 0.01  # budget: 1e-2
    assert "a: " in check_2x(["a", "b"], [r + 0.015, None], [lo, None], [r, None])
    with pytest.raises(AssertionError, match=r"\['a'\]"):
        check_2x(["a"], [r + 0.03], [lo], [r], floor=0.0)
    with pytest.raises(AssertionError, match=r"\['a'\]"):
        check_2x(["a"], [np.full(8, np.inf)], [np.full(8, np.inf)], [r])
    check_2x(["da", "o"], [r, r + 1.0], [lo, lo], [r, r], checked=lambda n: n.startswith("d"))


@pytest.mark.parametrize("cu", [[0, 300], [0, 0, 70, 70, 200, 300], [0, 64, 128, 300, 300]])
def test_packed_chunk_layout_moves_rows_both_ways_by_gathers(cu):
    """to_chunks / from_chunks of packed sequences (empty ones included): the values and the
    cotangents of a row gather (zero padding rows) and of its scatter-add transpose, while the
    gradient's program has no scatter."""
    from gdn_jax.reference._common import chunk_layout, from_chunks, to_chunks

    T = cu[-1]
    layout = chunk_layout(1, T, 64, jnp.asarray(cu, jnp.int32))
    x = jax.random.normal(jax.random.PRNGKey(0), (1, T, 3, 5))
    tok = layout.token.reshape(-1)

    def gather_to(a):  # the plain gather: zero rows where a slot has no token
        rows = a.reshape(T, 3, 5)[jnp.maximum(tok, 0)]
        return jnp.where((tok >= 0)[:, None, None], rows, 0.0).reshape(layout.token.shape + (3, 5))

    def gather_from(y):
        return y.reshape(-1, 3, 5)[layout.slot].reshape(1, T, 3, 5)

    y, vjp = jax.vjp(lambda a: to_chunks(a, layout), x)
    y0, vjp0 = jax.vjp(gather_to, x)
    np.testing.assert_array_equal(y, y0)
    assert int((tok >= 0).sum()) == T  # every token has a slot
    dy = jax.random.normal(jax.random.PRNGKey(1), y.shape)
    np.testing.assert_array_equal(vjp(dy)[0], vjp0(dy)[0])

    z, vjp = jax.vjp(lambda a: from_chunks(a, layout, 1, T), y)
    z0, vjp0 = jax.vjp(gather_from, y)
    np.testing.assert_array_equal(z, x)
    np.testing.assert_array_equal(z, z0)
    dz = jax.random.normal(jax.random.PRNGKey(2), z.shape)
    np.testing.assert_array_equal(vjp(dz)[0], vjp0(dz)[0])

    loss = lambda a: jnp.sum(jnp.sin(from_chunks(2 * to_chunks(a, layout), layout, 1, T)))
    np.testing.assert_allclose(jax.grad(loss)(x), 2 * jnp.cos(2 * x), rtol=1e-6, atol=1e-6)
    assert "scatter" not in str(jax.make_jaxpr(jax.grad(loss))(x))


@pytest.mark.parametrize("multiple", [1, 3, 4])
def test_packed_chunk_layout_rounds_its_chunk_count(multiple):
    """chunk_layout(..., chunk_multiple) adds only padding chunks: the lane's chunk count is a
    multiple, every token keeps its slot and the round trip through the chunks is exact."""
    from gdn_jax.reference._common import chunk_layout, from_chunks, to_chunks

    cu = jnp.asarray([0, 0, 70, 70, 200, 300], jnp.int32)
    base = chunk_layout(1, 300, 64, cu)
    layout = chunk_layout(1, 300, 64, cu, multiple)
    nc, nc0 = layout.token.shape[1], base.token.shape[1]
    assert nc % multiple == 0 and nc0 <= nc < nc0 + multiple
    np.testing.assert_array_equal(layout.slot, base.slot)
    np.testing.assert_array_equal(layout.token[:, :nc0], base.token)
    assert (layout.token[:, nc0:] == -1).all() and not layout.first[:, nc0:].any()
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 300, 2))
    np.testing.assert_array_equal(from_chunks(to_chunks(x, layout), layout, 1, 300), x)
