"""Decode: T ≥ 1 tokens appended to a carried f32 state, in place, in GDN2 form.

One CTA (one warpgroup) per (batch row, value head, ``block_v``-wide V block). It reads its state
slice S [K, BV] once (TMA → SMEM → registers, WGMMA layout), runs the T tokens on it in f32 on the
CUDA cores (matrix-vector work: no tensor cores), and writes it back once, into the same buffer
(the state input is aliased to the state output). Per token, with row vectors over K and column
vectors over V::

    S     ← Diag(e^{g}) S                       (g scalar or per K channel)
    v'    = w ⊙ v − Sᵀ (b ⊙ k)                  (b scalar or per K channel; w scalar b, or per V)
    S     ← S + k v'ᵀ
    o     = scale · Sᵀ q

GDN is scalar g and b = w = β; KDA is channel g with b = w = β; GDN2 is channel g, b and w. The
column sums ``Sᵀ x`` are reductions over the K axis of the register tile (across warps, through
the reduction scratch). Scalar gates are read as a [T, HV] tile per CTA (TMA needs a unit last
stride, so a [T] column of [B, T, HV] cannot be copied), then by scalar SMEM reads, so nothing is
broadcast to K in HBM. q and k are read per q/k head (GVA: value head ``h`` reads ``h // group``),
optionally L2-normalised in the kernel.

Non-finite inputs: the kernel takes the op's raw inputs and makes the ops' sanitation itself
(:mod:`gdn_jax.ops._sanitize`): non-finite q, k, v, b, w read as 0, g clamped to
[``log_decay_floor``, 0], and NaN put where the token recurrence has it (a bad value in k, g or b
at token t: the head's outputs from t on and its state; in v or w: that value column's; in q:
token t's outputs only). So a step is this kernel and the gates' casts to f32: no XLA pass over
its inputs, its output or the carried state (which at large batch a pass of its own would read and
write a second time).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _compat as cp
from pallas_kernels._compat import pl, plgpu
from pallas_kernels._tiles import finite, nonfinite, per_v_block_kernel, v_block_coords

__all__ = ["StepConfig", "decode_step", "SUPPORTED_DIMS"]

f32 = jnp.float32
SUPPORTED_DIMS = (64, 128)
L2NORM_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static configuration of :func:`decode_step`.

    Attributes:
      scale: output scale (Python float).
      log_decay_floor: g is clamped to [log_decay_floor, 0] as it is read (NaN and −inf to the
        floor, +inf to 0), the ops' clamp (``gdn_jax.ops._sanitize.LOG_DECAY_FLOOR``).
      channel_g: g is per key channel [B, T, HV, K] (else a scalar per head [B, T, HV]).
      channel_b: b is per key channel [B, T, HV, K] (else a scalar per head [B, T, HV]).
      has_w: a separate write gate w [B, T, HV, V]; without it the write gate is b (scalar b).
      use_qk_l2norm: L2-normalise q and k over K inside the kernel (f32, eps 1e-6).
      block_v: V columns per CTA (32, 64 or 128; smaller gives more CTAs at small batch).
    """

    scale: float
    log_decay_floor: float
    channel_g: bool = False
    channel_b: bool = False
    has_w: bool = False
    use_qk_l2norm: bool = False
    block_v: int = 64

    def __post_init__(self):
        if not isinstance(self.scale, float):
            raise TypeError(f"{self.scale=} must be a Python float")
        if self.block_v not in (32, 64, 128):
            raise ValueError(f"{self.block_v=} must be 32, 64 or 128")
        if self.has_w and not self.channel_b:
            raise ValueError("has_w (a V-channel write gate) needs channel_b (GDN2 form)")
        if not isinstance(self.log_decay_floor, float) or not self.log_decay_floor < 0:
            raise ValueError(f"{self.log_decay_floor=} must be a negative Python float")


def _clean_any(x: jax.Array):
    """(vector x with non-finite values as 0, 1.0 where any of x is non-finite else 0.0)."""
    x, bad = _clean_each(x)
    return x, jnp.minimum(jnp.sum(bad), 1.0)


def _clean_each(x: jax.Array):
    """(x with non-finite values as 0, 1.0 at each non-finite value else 0.0)."""
    return finite(x), nonfinite(x)


def _log_decay(g: jax.Array, floor: float):
    """(g clamped to [floor, 0] as :func:`gdn_jax.ops._sanitize.log_decay` does: NaN and −inf
    to ``floor``, +inf and growth to 0; 1.0 where g (any of a vector) is NaN or +inf)."""
    bad = jnp.isnan(g) | (g == jnp.inf)
    clamped = jnp.where((g > floor) & (g <= 0.0), g, jnp.where(g > 0.0, 0.0, floor))
    flag = jnp.where(bad, 1.0, 0.0)
    return clamped, (jnp.minimum(jnp.sum(flag), 1.0) if g.ndim else flag)


def _body(*refs, cfg: StepConfig, group: int, T: int):
    q_g, k_g, v_g, g_g, b_g = refs[:5]
    rest = refs[5:]
    if cfg.has_w:
        w_g, rest = rest[0], rest[1:]
    s_in, o_g, s_out = rest  # s_in and s_out are the same buffer (aliased)
    del s_in
    BV = cfg.block_v
    iv, hv, b, cols = v_block_coords(BV)
    hk = hv // group
    K = q_g.shape[-1]

    # (gmem source, smem allocation) for every input tile this CTA reads
    loads = [
        (s_out.at[b, hv, :, cols], cp.smem((K, BV), f32)),
        (q_g.at[b, :, hk, :], cp.smem((T, K), q_g.dtype, swizzled=False)),
        (k_g.at[b, :, hk, :], cp.smem((T, K), k_g.dtype, swizzled=False)),
        (v_g.at[b, :, hv, cols], cp.smem((T, BV), v_g.dtype, swizzled=False)),
    ]
    for flag, x_g in ((cfg.channel_g, g_g), (cfg.channel_b, b_g)):
        if flag:  # [T, K] channel gate of this value head
            loads.append((x_g.at[b, :, hv, :], cp.smem((T, K), x_g.dtype, swizzled=False)))
        else:  # [T, HV]: every head's scalar gate of this batch row (unit last stride for TMA)
            loads.append((x_g.at[b], cp.smem((T, x_g.shape[-1]), x_g.dtype, swizzled=False)))
    if cfg.has_w:
        loads.append((w_g.at[b, :, hv, cols], cp.smem((T, BV), w_g.dtype, swizzled=False)))
    n = len(loads)

    def scoped(*scratch):
        bufs, (o_s, bar) = scratch[:n], scratch[n:]
        for i, ((src, _), dst) in enumerate(zip(loads, bufs, strict=True)):
            plgpu.copy_gmem_to_smem(src, dst, bar.at[i])
        for i in range(n):
            plgpu.barrier_wait(bar.at[i])
        s_s, q_s, k_s, v_s, g_s, b_s = bufs[:6]
        w_s = bufs[6] if cfg.has_w else None

        def token(t, carry):
            # bad: [BV], 1.0 for the value columns a non-finite input has reached (their
            # outputs from that token on and their state are NaN)
            S, bad = carry
            q, bad_q = _clean_any(cp.row_vec(q_s.at[t]).astype(f32))
            k, bad_k = _clean_any(cp.row_vec(k_s.at[t]).astype(f32))
            if cfg.use_qk_l2norm:
                q = q * lax.rsqrt(jnp.sum(q * q) + L2NORM_EPS)
                k = k * lax.rsqrt(jnp.sum(k * k) + L2NORM_EPS)
            if cfg.channel_g:
                g, bad_g = _log_decay(cp.row_vec(g_s.at[t]).astype(f32), cfg.log_decay_floor)
                S = S * cp.bcast_rows(jnp.exp(g), (K, BV))
            else:
                g, bad_g = _log_decay(g_s[t, hv].astype(f32), cfg.log_decay_floor)
                S = S * jnp.exp(g)
            if cfg.channel_b:
                bch, bad_b = _clean_any(cp.row_vec(b_s.at[t]).astype(f32))
                bk = k * bch
            else:
                beta, bad_b = _clean_each(b_s[t, hv].astype(f32))
                bk = k * beta
            erase = jnp.sum(S * cp.bcast_rows(bk, (K, BV)), axis=0)
            v, bad_v = _clean_each(cp.col_vec(v_s.at[t], BV).astype(f32))
            if cfg.has_w:
                wv, bad_w = _clean_each(cp.col_vec(w_s.at[t], BV).astype(f32))
                v, bad_v = v * wv, jnp.maximum(bad_v, bad_w)
            else:
                v = v * beta
            bad = jnp.maximum(jnp.maximum(bad, bad_v), jnp.maximum(bad_k, bad_g + bad_b))
            S = S + cp.bcast_rows(k, (K, BV)) * cp.bcast_cols(v - erase, (K, BV))
            o = jnp.sum(S * cp.bcast_rows(q, (K, BV)), axis=0) * cfg.scale
            o = jnp.where(jnp.maximum(bad, bad_q) > 0.0, jnp.nan, o)
            o_s.at[t][...] = o.astype(o_s.dtype)
            return S, bad

        S = cp.load_tile(s_s)
        no_bad = plgpu.layout_cast(jnp.zeros((BV,), f32), plgpu.Layout.WGMMA.reduce(0))
        S, bad = lax.fori_loop(0, T, token, (S, no_bad))
        s_s[...] = S + cp.bcast_cols(jnp.where(bad > 0.0, jnp.nan, 0.0), (K, BV))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(s_s, s_out.at[b, hv, :, cols])
        plgpu.copy_smem_to_gmem(o_s, o_g.at[b, :, hv, cols])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(
        scoped,
        *(alloc for _, alloc in loads),
        cp.smem((T, BV), o_g.dtype, swizzled=False),
        plgpu.Barrier(num_barriers=n),
    )


def decode_step(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    b: jax.Array,
    w: jax.Array | None,
    state: jax.Array,
    config: StepConfig,
) -> tuple[jax.Array, jax.Array]:
    """Appends T tokens of every batch row to its state; the state is updated in place.

    The inputs may hold non-finite values: the kernel reads them as the ops' sanitation does and
    puts NaN into o and the state where the token recurrence has it (module docstring).

    Args:
      q, k: [B, T, H, K] (bf16, f16 or f32); v: [B, T, HV, V], same dtype.
      g: [B, T, HV, K] f32 with ``config.channel_g``, else [B, T, HV] f32.
      b: [B, T, HV, K] f32 with ``config.channel_b``, else [B, T, HV] f32.
      w: [B, T, HV, V] f32 with ``config.has_w``, else None.
      state: [B, HV, K, V] f32; aliased to the returned state (donate it under jit).
      config: :class:`StepConfig`.
    Returns:
      (o [B, T, HV, V] in v.dtype, new state [B, HV, K, V] f32).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K not in SUPPORTED_DIMS or V not in SUPPORTED_DIMS:
        raise ValueError(f"{q.shape=} {v.shape=}: K and V must be in {SUPPORTED_DIMS}")
    if V % config.block_v:
        raise ValueError(f"{v.shape=}: V must be a multiple of {config.block_v=}")
    if (w is None) == config.has_w:
        raise ValueError(f"w is {'missing' if w is None else 'given'} but {config.has_w=}")
    ins = [q, k, v, g, b] + ([w] if config.has_w else []) + [state]
    out_type = (
        jax.ShapeDtypeStruct((B, T, HV, V), v.dtype),
        jax.ShapeDtypeStruct((B, HV, K, V), f32),
    )

    def body(*refs):
        _body(*refs, cfg=config, group=HV // H, T=T)

    fn = per_v_block_kernel(
        body,
        out_type,
        v_blocks=V // config.block_v,
        HV=HV,
        B=B,
        name="gdn_decode_step",
        input_output_aliases={len(ins) - 1: 1},
    )
    return fn(*ins)
