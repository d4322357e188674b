"""Case builders for the op tests of every variant (GDN, KDA, GDN2): inputs, cotangents, every
gradient in one compiled pass (cached per case shape), and the 2x tolerance rule
(:func:`gdn_jax.testing.check_2x`). Ops and references come from :mod:`tests.gdn_cases`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from gdn_cases import OPS, RECURRENT, cached_jit, compiled, positional

from gdn_jax.testing import check_2x, random_inputs

# names of loss_and_grads' outputs: o, final state, then d(positional args), dh0
NAMES = {
    "gdn": ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0"),
    "kda": ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0"),
    "gdn2": ("o", "final_state", "dq", "dk", "dv", "dg", "db", "dw", "dh0"),
}


def channel_case(seed, variant, B, T, H, HV, K, V, cu=None, gate_scale=1.0):
    """Random inputs (initial state scaled by 0.1), cotangents for o and the final state, and
    cu_seqlens as an int32 array (or None)."""
    n = B if cu is None else len(cu) - 1
    x = random_inputs(
        seed, B=B, T=T, H=H, HV=HV, K=K, V=V, variant=variant, n_states=n, gate_scale=gate_scale
    )
    x["initial_state"] = 0.1 * x["initial_state"]
    r = np.random.default_rng(seed + 1)
    cts = (
        jnp.asarray(r.standard_normal((B, T, HV, V)), jnp.float32),
        jnp.asarray(r.standard_normal((n, HV, K, V)), jnp.float32),
    )
    return x, (None if cu is None else jnp.asarray(cu, jnp.int32)), cts


@functools.cache
def pallas_op(variant):
    """The public op with ``implementation="pallas"`` (one function per variant, so that jitted
    programs built on it are cached)."""

    def fn(*args, **kw):
        return OPS[variant](*args, implementation="pallas", **kw)

    return fn


def _loss_and_grads(x, cu, cts, *, op, variant, dtype, kw):
    # cotangents and cu_seqlens are arguments, not closure constants: XLA would constant-fold
    # transposes of large constants (slow compiles); kw: op's keyword arguments as sorted items
    def loss(args, h0, cts, cu):
        do, dht = cts
        o, s = op(*args, initial_state=h0, output_final_state=True, cu_seqlens=cu, **dict(kw))
        return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(s * dht), (o, s)

    args = positional(x, variant)
    args = tuple(a.astype(dtype) for a in args[:3]) + tuple(args[3:])
    f = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    (_, (o, s)), (dargs, dh0) = f(args, x["initial_state"], cts, cu)
    return (o, s, *dargs, dh0)


def loss_and_grads(fn, variant, x, cu, dtype, cts, *, jit=True, reference=False, **kw):
    """(o, final state, *grads of Σ o·do + Σ final·dfinal w.r.t. the positional args and h0),
    with q, k, v cast to ``dtype``; gates stay f32. ``kw`` go to ``fn`` (default l2norm on).

    One compiled fwd+bwd: a ``reference`` (:func:`gdn_jax.testing.reference_jit`'s) and, with
    ``jit``, ``fn`` run the program shared by every test of a process with the same case shapes;
    without ``jit`` (the interpreter tests) ``fn`` runs in one compiled for this call only
    (:func:`gdn_cases.compiled`)."""
    kw = tuple(sorted(dict(dict(use_qk_l2norm=True), **kw).items()))
    case = dict(op=fn, variant=variant, dtype=jnp.dtype(dtype), kw=kw)
    if reference:
        return cached_jit(_loss_and_grads, reference=True, **case)(x, cu, cts)
    return compiled(_loss_and_grads, jit=jit, **case)(x, cu, cts)


def check_channel_2x(variant, fn, x, cu, cts, dtype, *, floor=1e-5, names=None, jit=True, **kw):
    """:func:`gdn_jax.testing.check_2x` on every output and gradient of ``fn`` against the f32
    recurrence, with the recurrence run in ``dtype`` as the budget; ``names`` (default all)
    selects the outputs that are asserted, the others are only reported. ``kw``: the ops' keyword
    arguments (:func:`loss_and_grads`). Returns fn's results and prints the relative RMS errors.
    Works for all three variants (``NAMES``)."""
    ref = functools.partial(loss_and_grads, RECURRENT[variant], variant, x, cu, jit=jit, **kw)
    ref32 = ref(jnp.float32, cts, reference=True)
    ref_lo = ref(dtype, cts, reference=True)
    got = loss_and_grads(fn, variant, x, cu, dtype, cts, jit=jit, **kw)
    checked = None if names is None else (lambda name: name in names)
    print(variant, check_2x(NAMES[variant], got, ref_lo, ref32, floor=floor, checked=checked))
    return got
