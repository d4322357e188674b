"""Helpers for testing GDN implementations: random inputs and error measures.

Used by this package's tests and usable by anyone checking a new implementation against
``gdn_jax.reference``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["rel_rms", "check_2x", "reference_jit", "random_inputs", "upcast"]


def rel_rms(x, ref) -> float:
    """Relative RMS error ``‖x − ref‖ / ‖ref‖`` in float64 (NaN anywhere gives inf)."""
    x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    if not np.all(np.isfinite(x)):
        return float("inf")
    return float(np.sqrt(np.sum((x - ref) ** 2) / max(np.sum(ref**2), 1e-300)))


def check_2x(names, got, ref_lo, ref32, *, floor: float = 1e-5, checked=None) -> str:
    """The 2x rule of docs/design.md for each named output: ``rel_rms(got, ref32) <= 2 *
    rel_rms(ref_lo, ref32) + floor``, with ``ref32`` the f32 oracle and ``ref_lo`` the same
    oracle run in the io dtype.

    Args:
      names: one name per output; got, ref_lo, ref32: sequences of arrays (None where an output
        does not exist, in all three).
      floor: absolute slack for outputs whose budget is ~0.
      checked: optional predicate on the name; outputs it rejects are reported, not asserted.
    Returns:
      The report, ``"name: err (ref budget); ..."``.
    Raises:
      AssertionError: naming the outputs that break the rule, with the whole report.
    """
    report, bad = [], []
    for name, a, lo, r in zip(names, got, ref_lo, ref32, strict=True):
        if a is None:
            assert lo is None and r is None, name
            continue
        err, budget = rel_rms(a, r), rel_rms(lo, r)
        report.append(f"{name}: {err:.2e} (ref {budget:.2e})")
        # a non-finite output (err = inf) fails even where the reference overflowed too
        ok = np.isfinite(err) and err <= 2 * budget + floor
        if (checked is None or checked(name)) and not ok:
            bad.append(name)
    line = "; ".join(report)
    assert not bad, f"2x rule broken for {bad}: {line}"
    return line


def reference_jit(fn, **jit_kwargs):
    """``jax.jit(fn)`` for a reference run on the default device (the GPU in GPU tests).

    ``fn`` is traced with f32 matmuls at HIGHEST precision (the GPU's default f32 matmul is TF32)
    and compiled with ``xla_allow_excess_precision=False``: under XLA:GPU's default (true) a
    fusion may keep bf16/f16 intermediates in f32 and drop ``f32 -> narrow -> f32`` convert
    chains, so a reference "run in bf16/f16" would be partly f32 and the 2x budget would shrink.
    With the flag off, XLA rounds where the reference says, as XLA:CPU does
    (``tests/pallas/test_gdn_pallas.py::test_gpu_reference_budget_matches_host`` checks the
    budgets against the host's).

    Args:
      fn: the function to compile; ``jit_kwargs`` go to :func:`jax.jit`.
    Returns:
      The jitted function.
    """

    def traced(*args, **kwargs):
        with jax.default_matmul_precision("highest"):
            return fn(*args, **kwargs)

    opts = dict(jit_kwargs.pop("compiler_options", None) or {})
    opts["xla_allow_excess_precision"] = False
    if jax.default_backend() == "gpu":
        opts["xla_gpu_autotune_level"] = 0  # a reference's speed does not matter; its compile does
    return jax.jit(traced, compiler_options=opts, **jit_kwargs)


def upcast(tree):
    """Floating leaves to f32 (the oracle's inputs); other leaves unchanged."""

    def f(x):
        if isinstance(x, jax.Array | np.ndarray) and jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.asarray(x, jnp.float32)
        return x

    return jax.tree.map(f, tree)


def random_inputs(
    seed: int,
    *,
    B: int,
    T: int,
    H: int,
    HV: int,
    K: int,
    V: int,
    variant: str = "gdn",
    dtype=jnp.float32,
    gate_scale: float = 1.0,
    n_states: int | None = None,
) -> dict:
    """Random op inputs with realistic ranges.

    q, k ~ N(0, 1) in ``dtype``; v ~ N(0, 1); the log-decay is ``-gate_scale * U(0, 1)`` per token
    (per key channel for kda/gdn2); beta, b, w ~ U(0, 1); initial_state ~ N(0, 1) f32 with
    ``n_states`` rows (default B).

    Returns:
      dict with q, k, v, g and beta (gdn, kda) or b, w (gdn2), plus initial_state.
    """
    r = np.random.default_rng(seed)
    out = {
        "q": jnp.asarray(r.standard_normal((B, T, H, K)), dtype),
        "k": jnp.asarray(r.standard_normal((B, T, H, K)), dtype),
        "v": jnp.asarray(r.standard_normal((B, T, HV, V)), dtype),
    }
    gshape = (B, T, HV) if variant == "gdn" else (B, T, HV, K)
    out["g"] = jnp.asarray(-gate_scale * r.uniform(0, 1, gshape), jnp.float32)
    if variant == "gdn2":
        out["b"] = jnp.asarray(r.uniform(0, 1, (B, T, HV, K)), jnp.float32)
        out["w"] = jnp.asarray(r.uniform(0, 1, (B, T, HV, V)), jnp.float32)
    else:
        out["beta"] = jnp.asarray(r.uniform(0, 1, (B, T, HV)), jnp.float32)
    N = B if n_states is None else n_states
    out["initial_state"] = jnp.asarray(r.standard_normal((N, HV, K, V)), jnp.float32)
    return out
