"""Shared test plumbing: the three variants' ops and references, positional argument packing,
and the loss used to check every gradient under random cotangents."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdn_jax
from gdn_jax import reference
from gdn_jax.testing import reference_jit
from pallas_kernels import _compat as pk

OPS = {"gdn": gdn_jax.gated_delta_rule, "kda": gdn_jax.kda, "gdn2": gdn_jax.gdn2}
RECURRENT = {
    "gdn": reference.recurrent_gated_delta_rule,
    "kda": reference.recurrent_kda,
    "gdn2": reference.recurrent_gdn2,
}
CHUNK = {
    "gdn": reference.chunk_gated_delta_rule,
    "kda": reference.chunk_kda,
    "gdn2": reference.chunk_gdn2,
}
STEPS = {"gdn": gdn_jax.gated_delta_rule_step, "kda": gdn_jax.kda_step, "gdn2": gdn_jax.gdn2_step}


def positional(x: dict, variant: str) -> tuple:
    """The op's positional arguments from a ``random_inputs`` dict."""
    gates = (x["b"], x["w"]) if variant == "gdn2" else (x["beta"],)
    return (x["q"], x["k"], x["v"], x["g"]) + gates


def value_and_grads(fn, args, h0, cotangent_seed=1, **kw):
    """(o, final) and the gradients of Σ o·do + Σ final·dfinal w.r.t. args and h0.

    One compiled program (``reference_jit``: rounding where the code says, as op-by-op would).
    """
    shapes = jax.eval_shape(
        lambda a, h: fn(*a, initial_state=h, output_final_state=True, **kw), tuple(args), h0
    )
    r = np.random.default_rng(cotangent_seed)
    do = jnp.asarray(r.standard_normal(shapes[0].shape), jnp.float32)
    dfinal = jnp.asarray(r.standard_normal(shapes[1].shape), jnp.float32)

    def loss(args, h0):
        o, f = fn(*args, initial_state=h0, output_final_state=True, **kw)
        return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(f * dfinal), (o, f)

    (_, (o, final)), grads = reference_jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        tuple(args), h0
    )
    return (o, final), tuple(grads[0]) + (grads[1],)


def run_interpreted(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with the Pallas kernels under the Mosaic GPU interpreter (CPU),
    resetting the interpreter's shared state afterwards."""
    with pk.use_mode("interpret"):
        try:
            return fn(*args, **kwargs)
        finally:
            pk.reset_interpreter()


def cached_jit(fn, *, reference: bool = False, **kw):
    """``jax.jit(functools.partial(fn, **kw))`` (:func:`gdn_jax.testing.reference_jit`'s when
    ``reference``), one per (fn, kw, kernel execution mode): the tests of a process that share
    input shapes share its compiled programs. ``kw`` values must be hashable."""
    return _cached_jit(fn, reference, tuple(sorted(kw.items())), pk.execution_mode())


def compiled(fn, *, jit: bool, **kw):
    """``functools.partial(fn, **kw)`` compiled, for a function that runs the kernels. ``jit``
    (the GPU tests): :func:`cached_jit`'s program, shared by the tests of a process. Without (the
    interpreter tests): a program compiled for this call only, since the interpreted kernels'
    callbacks belong to the interpreter state of one :func:`run_interpreted` (reset when it
    ends). References have no kernels: they always take :func:`cached_jit`'s program."""
    return cached_jit(fn, **kw) if jit else jax.jit(functools.partial(fn, **kw))


@functools.cache
def _cached_jit(fn, reference, kw, mode):
    del mode  # a key only: kernels traced under another execution mode are another program
    f = functools.partial(fn, **dict(kw))
    return reference_jit(f) if reference else jax.jit(f)


def lowered_kernels(txt: str, names) -> set[str]:
    """The kernels of ``names`` that lowered text ``txt`` calls as Mosaic GPU custom calls (a
    kernel's symbol sits NUL-delimited inside the serialized module of its custom call)."""
    calls = [ln for ln in txt.splitlines() if "custom_call @mosaic_gpu" in ln]
    return {name for ln in calls for name in names if re.search(rf"\\00{name}\\00", ln)}


def smem_per_cta(ctas: int) -> int:
    """Shared memory bytes per CTA when ``ctas`` CTAs share one Hopper SM (228 KB, 1 KB of it
    reserved per CTA)."""
    return (228 - ctas) * 1024 // ctas


def _mosaic_core():
    from jax.experimental.mosaic.gpu import core

    return core


def smem_limit(limit: int):
    """Mosaic GPU's test hook bounding the shared memory a kernel may use when it lowers (jax
    0.11.2: ``artificial_shared_memory_limit``); the test is skipped where JAX lacks it."""
    hook = getattr(_mosaic_core(), "artificial_shared_memory_limit", None)
    if hook is None:
        pytest.skip("this JAX has no artificial_shared_memory_limit")
    return hook(limit)


def kernel_launches():
    """:func:`pallas_kernels._compat.record_kernel_launches`: a context recording
    ``{kernel name: KernelLaunch(smem, threads)}`` of every Mosaic GPU kernel lowered inside it,
    by Mosaic GPU's own count; the test is skipped where JAX lacks the hooks it reads."""
    from pallas_kernels import _compat as pk

    try:
        return pk.record_kernel_launches()
    except NotImplementedError as e:
        pytest.skip(str(e))
