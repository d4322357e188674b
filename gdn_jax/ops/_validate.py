"""Argument checks shared by every public op: caller mistakes raise ``ValueError`` naming the
argument, its shape/dtype and what was expected."""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from gdn_jax import checks

IO_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
GATE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
CHUNK_SIZES = (16, 32, 64)


def _dtype_ok(x, allowed) -> bool:
    return any(x.dtype == jnp.dtype(d) for d in allowed)


def check_array(name: str, x) -> None:
    """``x`` must be a jax.Array (traced or not) or a numpy array."""
    if not isinstance(x, jax.Array | np.ndarray):
        raise ValueError(
            f"{name} must be a jax.Array or numpy array; got {type(x).__name__}"
            + (" (convert it with jnp.asarray)" if isinstance(x, list | tuple) else "")
        )


def check_qkv(q, k, v) -> tuple[int, int, int, int, int, int]:
    """Checks q, k [B, T, H, K] and v [B, T, HV, V]; returns (B, T, H, HV, K, V)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_array(name, x)
        if x.ndim != 4:
            raise ValueError(f"{name} must be 4-D [B, T, heads, dim]; got {name}.shape={x.shape}")
        if not _dtype_ok(x, IO_DTYPES):
            raise ValueError(f"{name} must be bf16, f16 or f32; got {name}.dtype={x.dtype}")
    if q.shape != k.shape:
        raise ValueError(
            f"q and k must have the same shape [B, T, H, K]; got {q.shape=} {k.shape=}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype; got {q.dtype=} {k.dtype=} {v.dtype=}")
    B, T, H, K = q.shape
    if v.shape[:2] != (B, T):
        raise ValueError(f"v must be [B, T, HV, V] with q's B, T; got {v.shape=} and {q.shape=}")
    HV, V = v.shape[2], v.shape[3]
    for what, n, x in (("heads H", H, "q"), ("head dim K", K, "q"), ("value heads HV", HV, "v"),
                       ("value head dim V", V, "v")):  # fmt: skip
        if n < 1:
            shape = q.shape if x == "q" else v.shape
            raise ValueError(f"{what} must be >= 1; got {x}.shape={shape}")
    if HV % H != 0:
        raise ValueError(
            f"value heads must be a multiple of q/k heads (GVA); got HV={HV} (v.shape={v.shape}) "
            f"and H={H} (q.shape={q.shape})"
        )
    return B, T, H, HV, K, V


def check_gate(name: str, x, shape: tuple[int, ...]) -> None:
    """A gate must have exactly ``shape`` and a float dtype."""
    check_array(name, x)
    if x.shape != shape:
        raise ValueError(f"{name} must have shape {shape}; got {name}.shape={x.shape}")
    if not _dtype_ok(x, GATE_DTYPES):
        raise ValueError(f"{name} must be f32 (bf16/f16 accepted); got {name}.dtype={x.dtype}")


def check_state(name: str, s, shape: tuple[int, ...]) -> None:
    """A state must be an f32 array of exactly ``shape`` [N, HV, K, V]."""
    if s is None:
        raise ValueError(
            f"{name} is required: an f32 array of shape {shape} [N, HV, K, V] "
            "(zeros before the first token)"
        )
    check_array(name, s)
    if s.shape != shape:
        raise ValueError(
            f"{name} must have shape {shape} [N, HV, K, V]; got {name}.shape={s.shape}"
        )
    if s.dtype != jnp.float32:
        raise ValueError(
            f"{name} must be float32 (the state is always f32); got {name}.dtype={s.dtype}"
        )


def check_cu_seqlens(cu_seqlens, B: int, T: int) -> int:
    """Checks a packed-sequence offset vector; returns N. Values are checked when concrete (see
    :func:`prepare_cu_seqlens` for traced ones)."""
    check_array("cu_seqlens", cu_seqlens)
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(
            f"cu_seqlens must be 1-D [N + 1] with N >= 1; got cu_seqlens.shape={cu_seqlens.shape}"
        )
    if cu_seqlens.dtype != jnp.int32:
        raise ValueError(f"cu_seqlens must be int32; got cu_seqlens.dtype={cu_seqlens.dtype}")
    if B != 1:
        raise ValueError(f"cu_seqlens requires B == 1 (sequences packed along T); got B={B}")
    if not isinstance(cu_seqlens, jax.core.Tracer):
        c = np.asarray(cu_seqlens)
        if c[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0; got cu_seqlens[0]={c[0]}")
        if np.any(np.diff(c) < 0):
            raise ValueError(f"cu_seqlens must be non-decreasing; got {c.tolist()}")
        if c[-1] != T:
            raise ValueError(f"cu_seqlens must end at T={T}; got cu_seqlens[-1]={c[-1]}")
    return cu_seqlens.shape[0] - 1


def sanitize_cu_seqlens(cu_seqlens, T: int) -> jax.Array | None:
    """Offsets to use for ``cu_seqlens`` already shape-checked by :func:`check_cu_seqlens`.

    Concrete offsets (value-checked there) are returned unchanged. Traced ones are checked in
    checked mode (:mod:`gdn_jax.checks`) and always sanitised, so that every value gives a defined
    result: clipped to [0, T], made non-decreasing (running maximum), the first set to 0 and the
    last to T (the last sequence takes any tokens past the given end). Costs O(N).
    """
    if cu_seqlens is None or checks.is_concrete(cu_seqlens):
        return cu_seqlens
    c = cu_seqlens
    checks.check(c[0] == 0, "cu_seqlens must start at 0; got cu_seqlens[0]={}", c[0])
    checks.check(jnp.all(c[1:] >= c[:-1]), "cu_seqlens must be non-decreasing")
    checks.check(c[-1] == T, f"cu_seqlens must end at T={T}; got cu_seqlens[-1]={{}}", c[-1])
    c = jax.lax.cummax(jnp.clip(c, 0, T))
    return c.at[0].set(0).at[-1].set(T)


def prepare_cu_seqlens(cu_seqlens, B: int, T: int) -> jax.Array | None:
    """:func:`check_cu_seqlens` then :func:`sanitize_cu_seqlens` (None stays None)."""
    if cu_seqlens is None:
        return None
    check_cu_seqlens(cu_seqlens, B, T)
    return sanitize_cu_seqlens(cu_seqlens, T)


def check_log_decay(name: str, g) -> None:
    """The log-decay must be <= 0 (-inf allowed: a full reset; NaN propagates as in the
    recurrence). Concrete values are checked now (one reduction and a host read), traced ones in
    checked mode."""
    if checks.is_concrete(g):
        with jax.ensure_compile_time_eval():  # on the device, also while tracing; reads 1 value
            g32 = jnp.asarray(g, jnp.float32)
            top = float(jnp.max(jnp.where(jnp.isnan(g32), -jnp.inf, g32), initial=-1.0))
        if top > 0:
            raise ValueError(
                f"{name} is a log-decay and must be <= 0 (a decay factor e^{name} <= 1; -inf "
                f"resets the state); got max({name})={top}"
            )
    else:
        checks.check(~jnp.any(g > 0), f"{name} is a log-decay and must be <= 0; got max={{}}",
                     jnp.max(g))  # fmt: skip


def check_scale(scale, K: int) -> float:
    """``scale``: None (K**-0.5) or a finite real number (Python or a concrete scalar array)."""
    if scale is None:
        return K**-0.5
    if isinstance(scale, jax.core.Tracer):
        raise ValueError(
            "scale must be a static Python float (it is a compile-time constant of the kernels); "
            f"got a traced value of shape {scale.shape}"
        )
    if isinstance(scale, jax.Array | np.ndarray):
        if scale.size != 1:
            raise ValueError(f"scale must be a scalar; got an array of shape {scale.shape}")
        scale = scale.reshape(()).item()
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ValueError(f"scale must be a real number or None; got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite; got scale={scale}")
    return float(scale)


def check_chunk_size(chunk_size) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int | np.integer):
        raise ValueError(
            f"chunk_size must be an int, one of {CHUNK_SIZES}; got {chunk_size!r} "
            f"({type(chunk_size).__name__})"
        )
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}; got chunk_size={chunk_size}")


def check_common(q, k, v, *, initial_state, cu_seqlens, chunk_size):
    """Checks shared by the chunked ops; returns (B, T, H, HV, K, V, N)."""
    B, T, H, HV, K, V = check_qkv(q, k, v)
    check_chunk_size(chunk_size)
    N = B if cu_seqlens is None else check_cu_seqlens(cu_seqlens, B, T)
    if initial_state is not None:
        check_state("initial_state", initial_state, (N, HV, K, V))
    return B, T, H, HV, K, V, N


def check_qat(qat, chunk_size) -> None:
    """QAT needs a QATConfig and the chunk size its scales are defined for (64)."""
    from gdn_jax.qat import QATConfig

    if qat is None:
        return
    if not isinstance(qat, QATConfig):
        raise ValueError(f"qat must be a gdn_jax.qat.QATConfig or None; got {type(qat).__name__}")
    if chunk_size != 64:
        raise ValueError(f"qat fake quantisation is defined for chunk_size=64; got {chunk_size=}")
