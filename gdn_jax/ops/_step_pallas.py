"""``implementation="pallas"`` of the decode steps (:func:`gdn_jax.gated_delta_rule_step`,
:func:`gdn_jax.kda_step`, :func:`gdn_jax.gdn2_step`): glue around the Mosaic GPU decode kernel.

There is nothing to reshape: the kernel reads q, k, v, the gates and the state in their public
layouts (scalar gates stay [B, T, HV], so they are never broadcast to K in HBM), L2-normalises q and
k itself, makes the ops' sanitation of non-finite inputs (read as 0, NaN put into o and the state as
the token recurrence has it) and writes the new state into the state's buffer. Jitted with the state
donated, a step therefore reads and writes the state exactly once and copies nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gdn_jax.ops._sanitize import LOG_DECAY_FLOOR
from gdn_jax.ops._segments import sm_count
from pallas_kernels import _compat as pk
from pallas_kernels.decode import SUPPORTED_DIMS, StepConfig, decode_step

__all__ = ["step_pallas", "value_block", "MAX_TOKENS"]

# tokens per call: every CTA stages its T tokens in SMEM (~2 KiB per token at K = V = 128 with
# channel gates, next to the 32 KiB state slice); longer appends are prefill, not decode
MAX_TOKENS = 64
# V columns per CTA (pallas_kernels.decode.StepConfig.block_v) when set; None: value_block's
# rule. A module attribute so that benchmarks and tests can force 32 / 64 / 128.
BLOCK_V: int | None = None


def value_block(B: int, HV: int, V: int, sms: int) -> int:
    """V columns per CTA of the decode step: 32 while 64-column blocks would give fewer than two
    CTAs per SM (``B · HV · V / 64 < 2 · sms``), else 64.

    The step is latency-bound at small batch: at HV 16, K = V = 128 on the H200, 32 columns took
    0.0126 / 0.0134 / 0.0160 / 0.0183 ms per step at B 1 / 2 / 4 / 8 against 0.0164 / 0.0151 /
    0.0165 / 0.0217 ms with 64 (``bench_decode.py --timing loop --block-v``). At B64 and above,
    64-column blocks already give every SM several CTAs.

    Args:
      B: batch rows; HV: value heads; V: value head size (64 or 128); sms: SMs of the device.
    Returns:
      32 or 64.
    """
    return 32 if B * HV * (V // 64) < 2 * sms else 64


def _unsupported(q, v, g, b) -> str | None:
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K not in SUPPORTED_DIMS or V not in SUPPORTED_DIMS:
        return f"{q.shape=} {v.shape=}: the Pallas decode kernel needs K, V in {SUPPORTED_DIMS}"
    if T > MAX_TOKENS:
        return f"{q.shape=}: the Pallas decode kernel appends at most {MAX_TOKENS} tokens per call"
    if (g.ndim == 3 or b.ndim == 3) and HV % 4:
        # a scalar gate is read as the [T, HV] f32 row of its batch row: TMA needs 16-byte rows
        return f"{v.shape=}: with a scalar gate the Pallas decode kernel needs HV % 4 == 0"
    if pk.execution_mode() == "auto" and not pk.is_hopper():
        return "no Hopper GPU (and the Mosaic GPU interpreter was not requested)"
    return None


def step_pallas(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    b: jax.Array,
    w: jax.Array | None,
    state: jax.Array,
    *,
    scale: float,
    use_qk_l2norm: bool,
) -> tuple[jax.Array, jax.Array]:
    """One decode call in GDN2 form; inputs already validated by the public step op, raw (the
    kernel makes the ops' sanitation of non-finite values, :mod:`gdn_jax.ops._sanitize`).

    Args:
      q, k: [B, T, H, K] bf16/f16/f32; v: [B, T, HV, V] same dtype.
      g: [B, T, HV] (scalar decay, GDN) or [B, T, HV, K] (KDA, GDN2) f32.
      b: [B, T, HV] (β of GDN/KDA, also the write gate) or [B, T, HV, K] (GDN2 erase gate) f32.
      w: [B, T, HV, V] f32 write gate (GDN2) or None (the write gate is the scalar b).
      state: [B, HV, K, V] f32, updated in place (donate it under jit).
      scale: query scale; use_qk_l2norm: L2-normalise q and k over K in the kernel.
    Returns:
      (o [B, T, HV, V] in v.dtype, new state [B, HV, K, V] f32).
    Raises:
      NotImplementedError: head size, token count, head count or platform not served.
    """
    why = _unsupported(q, v, g, b)
    if why is not None:
        raise NotImplementedError(why)
    f32 = jnp.float32
    cfg = StepConfig(
        scale=float(scale),
        channel_g=g.ndim == 4,
        channel_b=b.ndim == 4,
        has_w=w is not None,
        use_qk_l2norm=bool(use_qk_l2norm),
        block_v=BLOCK_V or value_block(q.shape[0], v.shape[2], v.shape[3], sm_count()),
        log_decay_floor=LOG_DECAY_FLOOR,
    )
    gates = (g.astype(f32), b.astype(f32), None if w is None else w.astype(f32))
    return decode_step(q, k, v, *gates, state, cfg)
