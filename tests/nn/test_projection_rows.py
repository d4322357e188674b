"""One-row projections (decode at batch 1) run as a two-row matrix product with the same result."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn_jax.nn.layers import project


def _dot_lhs_shapes(fn, *args):
    jaxpr = jax.make_jaxpr(fn)(*args)
    return [e.invars[0].aval.shape for e in jaxpr.eqns if e.primitive.name == "dot_general"]


@pytest.mark.parametrize("shape", [(1, 1, 16), (1, 16), (3, 1, 16)])
def test_project_matches_matmul(shape):
    x = jax.random.normal(jax.random.key(0), shape, jnp.float32)
    w = jax.random.normal(jax.random.key(1), (16, 24), jnp.float32)
    got = jax.jit(project)(x, w)
    assert got.shape == (*shape[:-1], 24)
    np.testing.assert_allclose(got, np.asarray(x) @ np.asarray(w), rtol=1e-5, atol=1e-5)
    rows = [int(np.prod(s[:-1])) for s in _dot_lhs_shapes(project, x, w)]
    assert rows == [max(2, int(np.prod(shape[:-1])))]


def test_one_row_gradient():
    x = jax.random.normal(jax.random.key(0), (1, 1, 16), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (16, 24), jnp.float32)
    gx, gw = jax.grad(lambda x, w: jnp.sum(jnp.sin(project(x, w))), argnums=(0, 1))(x, w)
    rx, rw = jax.grad(lambda x, w: jnp.sum(jnp.sin(x @ w)), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(gx, rx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gw, rw, rtol=1e-5, atol=1e-5)
