"""Helpers for testing GDN implementations: random inputs and error measures.

Used by this package's tests and usable by anyone checking a new implementation against
``gdn_jax.reference``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["rel_rms", "random_inputs", "upcast"]


def rel_rms(x, ref) -> float:
    """Relative RMS error ``‖x − ref‖ / ‖ref‖`` in float64 (NaN anywhere gives inf)."""
    x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    if not np.all(np.isfinite(x)):
        return float("inf")
    return float(np.sqrt(np.sum((x - ref) ** 2) / max(np.sum(ref**2), 1e-300)))


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
