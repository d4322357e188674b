"""Which form of each channel-decay (KDA / GDN2) kernel stage serves a call: one plan per call.

:func:`channel_plan` maps (io dtype, K, V, KDA or GDN2, whether the forward stores A, the QAT
granularities) to the form of every stage that has more than one, and :func:`check_supported`
says whether the channel kernels serve a call at all. The glue
(:mod:`gdn_jax.ops._channel_pallas` for the forward, :mod:`gdn_jax.ops._channel_pallas_bwd` for
the backward) takes its forms from the plan and from nowhere else.

Forms (``f16``: f16 io; K, V ∈ {64, 128}):

- intra: one form (:func:`pallas_kernels.channel.intra.channel_intra`: two kernels, wy and qk,
  one CTA each per chunk and value head, column-block decay factoring) for every call.
- dq/dk/dw (``ChannelPlan.dqkw``): ``"k_split"`` (two CTAs, one per 64-column half of K) at
  K = 128 when V = 128 or f16; ``"phased"`` (the K-split kernel's phases on one CTA, all of K)
  for f16 at K = 64; ``"one_cta"`` otherwise (bf16 at K = 64, or K = 128 with V = 64).
- WY backward: K-split (two CTAs, one per half of K; ``ChannelBwdWyConfig.k_split``) at K = 128
  when V = 128 or f16; else one CTA.
- state loop (forward and the backward's recomputation of h): 64 value columns per CTA
  (``ChannelPlan.block_v``), all V with the QAT state granularity ``"matrix"``.

QAT (``state_quant`` / ``w_quant``, the granularities of ``gdn_jax.qat.QATConfig`` whose sites are
on): w is fake-quantised in the intra kernel, the chunk-entering state in the state loop; no other
kernel changes (the gradient is straight-through and the backward reads the quantised w and h).
Refused (:func:`check_supported`), with the state granularity ``"matrix"`` at V = 128: f16 (a
whole-state CTA has no shared memory for f16's f32 h tiles), and packed sequences with initial or
final states (no shared memory for the per-sequence state staging at ``block_v = 128``; one lane
per sequence would quantise the state again in every padding chunk after a short sequence).

Reasons:

- intra: column-block decay factoring runs one 64 × 64 × K product's worth per L and Aqk (a
  64 × 16 × K product per column block) and leaves shared memory for f16's f32 (tf32)
  operands, so one form serves every call. L → A → w, u and Aqk, qg, kg share only k and G, so
  they are two kernels, each with its own registers and shared memory: at KDA B4 T4096 HV16
  K = V = 128 on the H200 the two take 0.349 + 0.280 ms where one kernel with both tasks as
  branches took 0.930 ms (``benchmarks/profile_ops.py``, same run).
- dq/dk/dw and WY K-split: half-size register tiles and under half the shared memory per CTA, so
  two CTAs share an SM. On the H200 at B4 T4096 HV16 (``bench_gdn.py --stages``, bf16,
  K = V = 128) it takes 0.59 vs 3.63 ms (dq/dk/dw) and 0.79 vs 2.74 ms (WY), RESULTS.md's stage
  table. bf16 keeps the K-split at K = V = 128 only (the shape of that benchmark; at
  V = 64 the one-CTA kernels run). f16 at K = 128 needs it at either V: the one-CTA forms have
  no shared memory for the f16 staging tiles there.
- dq/dk/dw at K = 64: the one-CTA bf16 kernel already has [C, 64] tiles; f16 runs the K-split
  kernel's phased body on one CTA, whose scopes fit two CTAs per SM where the one-CTA form with
  the f16 tiles (144 KB and more) does not.
- WY at K = 64: the unsplit kernel already has [C, 64] tiles (bf16 and f16).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels import _compat as pk
from pallas_kernels._tiles import CHUNK
from pallas_kernels.channel.bwd_wy import ChannelBwdWyConfig
from pallas_kernels.channel.intra import ChannelIntraConfig
from pallas_kernels.gdn.fake_quant import STATE_QUANT, W_QUANT
from pallas_kernels.recurrence.chunk_fwd import ChunkFwdConfig

__all__ = ["DQKW_FORMS", "ChannelPlan", "channel_plan", "check_supported"]

DQKW_FORMS = ("k_split", "phased", "one_cta")
"""The forms of the dq/dk/dw kernel (:func:`pallas_kernels.channel.bwd_dqkw.channel_bwd_dqkw`)."""

HEAD_SIZES = (64, 128)


@dataclasses.dataclass(frozen=True)
class ChannelPlan:
    """The form of every channel-decay kernel stage for one call (see the module docstring).

    Attributes:
      scalar_beta: KDA (one β per token); else GDN2 gates.
      store_a: the forward's intra kernel stores A (a differentiated forward).
      dqkw: the dq/dk/dw kernel's form, one of :data:`DQKW_FORMS`.
      wy_split: the WY backward's K-split form (``ChannelBwdWyConfig.k_split``).
      block_v: value columns per CTA of the state loop (64, or V with a per-matrix state scale).
      state_quant: QAT granularity of the chunk-entering state (None: off).
      w_quant: QAT granularity of w (None: off).
    """

    scalar_beta: bool
    store_a: bool
    dqkw: str
    wy_split: bool
    block_v: int = 64
    state_quant: str | None = None
    w_quant: str | None = None

    def __post_init__(self):
        for name in ("scalar_beta", "store_a", "wy_split"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ChannelPlan.{name}={getattr(self, name)!r} must be a bool")
        if self.dqkw not in DQKW_FORMS:
            raise ValueError(f"ChannelPlan.dqkw={self.dqkw!r} must be one of {DQKW_FORMS}")
        if self.state_quant is not None and self.state_quant not in STATE_QUANT:
            raise ValueError(f"ChannelPlan.state_quant={self.state_quant!r}")
        if self.w_quant is not None and self.w_quant not in W_QUANT:
            raise ValueError(f"ChannelPlan.w_quant={self.w_quant!r}")

    def intra_config(self) -> ChannelIntraConfig:
        """The intra kernel's configuration."""
        return ChannelIntraConfig(
            scalar_beta=self.scalar_beta, store_a=self.store_a, w_quant=self.w_quant
        )

    def fwd_config(self, scale: float, *, store_h: bool = False) -> ChunkFwdConfig:
        """The state loop's configuration: the forward's, or with ``store_h`` the backward's
        recomputation of h (the same block_v and state quantisation, so h is what the forward
        used)."""
        return ChunkFwdConfig(
            scale=scale, block_v=self.block_v, store_h=store_h, state_quant=self.state_quant
        )

    @property
    def dqkw_k_split(self) -> bool:
        """``channel_bwd_dqkw``'s ``k_split`` argument: the two-CTA form at K = 128, the phased
        one-CTA form for f16 at K = 64."""
        return self.dqkw != "one_cta"

    def wy_config(self) -> ChannelBwdWyConfig:
        """The WY backward kernel's configuration."""
        return ChannelBwdWyConfig(scalar_beta=self.scalar_beta, k_split=self.wy_split)


def _unsupported_shape(dtype, K: int, V: int) -> str | None:
    """Why the channel kernels cannot serve io dtype ``dtype`` with head sizes K, V (None: they
    can)."""
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        return f"dtype={jnp.dtype(dtype)}: the Pallas kernels take bf16 or f16 (f32 runs on 'xla')"
    if K not in HEAD_SIZES or V not in HEAD_SIZES:
        return f"{K=} {V=}: the Pallas kernels need K, V in {{64, 128}}"
    return None


def _unsupported_qat(dtype, V: int, state_quant: str | None, packed_states: bool) -> str | None:
    """Why the channel kernels cannot fuse QAT with state granularity ``state_quant`` (None: they
    can); ``packed_states``: packed sequences whose states the loops set and write per sequence."""
    if state_quant != "matrix" or V == 64:
        return None
    if jnp.dtype(dtype) == jnp.float16:
        return "f16 with the QAT state granularity 'matrix' and V = 128 (use 'column')"
    if packed_states:
        return (
            "packed sequences with states and the QAT state granularity 'matrix' at V = 128 "
            "(no shared memory for the state staging at block_v = 128; use 'column')"
        )
    return None


def check_supported(
    dtype,
    K: int,
    V: int,
    chunk_size: int,
    *,
    state_quant: str | None = None,
    packed_states: bool = False,
) -> None:
    """Whether the channel kernels serve a call: io dtype ``dtype`` (q, k, v), head sizes K, V,
    ``chunk_size``, the QAT state granularity ``state_quant`` (None: no state quantisation; every
    w granularity is served), whether packed sequences come with initial or final states
    (``packed_states``) and the platform (a Hopper GPU, or an execution mode other than "auto",
    see :func:`pallas_kernels.use_mode`).

    Raises:
      NotImplementedError: with the reason, when they do not (the op then falls back to "xla").
    """
    why = _unsupported_shape(dtype, K, V)
    if why is None:
        why = _unsupported_qat(dtype, V, state_quant, packed_states)
    if why is None and chunk_size != CHUNK:
        why = f"{chunk_size=}: the Pallas kernels use chunks of {CHUNK}"
    if why is None and pk.execution_mode() == "auto" and not pk.is_hopper():
        why = "no Hopper GPU (and the Mosaic GPU interpreter was not requested)"
    if why is not None:
        raise NotImplementedError(why)


def channel_plan(
    dtype,
    K: int,
    V: int,
    *,
    scalar_beta: bool,
    store_a: bool,
    state_quant: str | None = None,
    w_quant: str | None = None,
) -> ChannelPlan:
    """The form of every stage for io dtype ``dtype`` (bf16 or f16), head sizes K, V ∈ {64, 128},
    KDA (``scalar_beta``) or GDN2, with or without A stored by the forward (the backward's plan
    is the differentiated forward's: ``store_a=True``), and the QAT granularities of the state
    and of w (None: that site off).

    Raises:
      NotImplementedError: dtype, head sizes or QAT the kernels do not serve.
    """
    why = _unsupported_shape(dtype, K, V) or _unsupported_qat(dtype, V, state_quant, False)
    if why is not None:
        raise NotImplementedError(why)
    f16 = jnp.dtype(dtype) == jnp.float16
    k_split = K == 128 and (V == 128 or f16)
    if k_split:
        dqkw = "k_split"
    elif f16:  # K = 64
        dqkw = "phased"
    else:
        dqkw = "one_cta"
    return ChannelPlan(
        scalar_beta=scalar_beta,
        store_a=store_a,
        dqkw=dqkw,
        wy_split=k_split,
        block_v=V if state_quant == "matrix" else 64,
        state_quant=state_quant,
        w_quant=w_quant,
    )
