"""Argument checks shared by every public op: caller mistakes raise ``ValueError`` naming the
argument, its shape/dtype and what was expected."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

IO_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
GATE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
CHUNK_SIZES = (16, 32, 64)


def _dtype_ok(x, allowed) -> bool:
    return any(x.dtype == jnp.dtype(d) for d in allowed)


def check_qkv(q, k, v) -> tuple[int, int, int, int, int, int]:
    """Checks q, k [B, T, H, K] and v [B, T, HV, V]; returns (B, T, H, HV, K, V)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
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
    if HV % H != 0:
        raise ValueError(
            f"value heads must be a multiple of q/k heads (GVA); got HV={HV} (v.shape={v.shape}) "
            f"and H={H} (q.shape={q.shape})"
        )
    return B, T, H, HV, K, V


def check_gate(name: str, x, shape: tuple[int, ...]) -> None:
    """A gate must have exactly ``shape`` and a float dtype."""
    if x.shape != shape:
        raise ValueError(f"{name} must have shape {shape}; got {name}.shape={x.shape}")
    if not _dtype_ok(x, GATE_DTYPES):
        raise ValueError(f"{name} must be f32 (bf16/f16 accepted); got {name}.dtype={x.dtype}")


def check_state(name: str, s, shape: tuple[int, ...]) -> None:
    if s.shape != shape:
        raise ValueError(
            f"{name} must have shape {shape} [N, HV, K, V]; got {name}.shape={s.shape}"
        )
    if s.dtype != jnp.float32:
        raise ValueError(
            f"{name} must be float32 (the state is always f32); got {name}.dtype={s.dtype}"
        )


def check_cu_seqlens(cu_seqlens, B: int, T: int) -> int:
    """Checks a packed-sequence offset vector; returns N. Values are checked when concrete."""
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


def check_chunk_size(chunk_size) -> None:
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
