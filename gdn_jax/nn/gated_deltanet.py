"""The Gated DeltaNet layer (Qwen3-Next / Qwen3.5 linear-attention block) and its decode cache.

Forward, for x [B, T, D] (docs/layers.md)::

    q, k, v = silu(conv(x Wq)), silu(conv(x Wk)), silu(conv(x Wv))   # depthwise causal, kernel 4
    g    = -exp(A_log) * softplus(x Wa + dt_bias)                      # f32, log-space decay
    beta = sigmoid(x Wb)                                               # gdn2: b, w = sigmoid(..)
    o    = core(q, k, v, g, beta, use_qk_l2norm=True)                  # gated_delta_rule/kda/gdn2
    y    = (RMSNorm(o) * silu(x Wz)) Wo

Variants: ``"gdn"`` (one decay and one beta per value head), ``"kda"`` (decay per key channel),
``"gdn2"`` (decay and erase gate ``b`` per key channel, write gate ``w`` per value channel).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.typing import Dtype

from gdn_jax import fp8 as fp8_lib
from gdn_jax import ops, remat
from gdn_jax.nn.layers import EMBED, HEADS, GatedRMSNorm, ShortConv, dense, partitioned
from gdn_jax.ops._validate import check_array, prepare_cu_seqlens
from gdn_jax.sharding import check_sequence_layout, check_sequence_unsplit, laid_out_like

if TYPE_CHECKING:
    from gdn_jax.qat import QATConfig
    from gdn_jax.sharding import ShardingConfig

__all__ = ["GatedDeltaNet", "GDNCache", "Variant"]

Variant = Literal["gdn", "kda", "gdn2"]

# variant -> (chunked op, decode op).
_OPS = {
    "gdn": (ops.gated_delta_rule, ops.gated_delta_rule_step),
    "kda": (ops.kda, ops.kda_step),
    "gdn2": (ops.gdn2, ops.gdn2_step),
}


class GDNCache(NamedTuple):
    """What decode carries between calls of :meth:`GatedDeltaNet.extend`.

    Attributes:
      conv_q, conv_k: [B, conv_kernel - 1, H * K], the last pre-conv inputs of the q / k convs.
      conv_v: [B, conv_kernel - 1, HV * V].
      state: [B, HV, K, V] f32 recurrent state.
    """

    conv_q: jax.Array
    conv_k: jax.Array
    conv_v: jax.Array
    state: jax.Array


def _a_log_init(low: float, high: float):
    # A ~ U(low, high), stored as log(A) so the decay rate stays positive under training.
    def init(key, shape, dtype=jnp.float32):
        return jnp.log(jax.random.uniform(key, shape, jnp.float32, low, high)).astype(dtype)

    return init


def _dt_bias_init(dt_min: float, dt_max: float, dt_floor: float = 1e-4):
    # softplus(dt_bias) = dt with dt log-uniform in [dt_min, dt_max] (Mamba/Qwen): the initial decay
    # rate of each head spans two decades of time scales.
    def init(key, shape, dtype=jnp.float32):
        u = jax.random.uniform(key, shape, jnp.float32)
        dt = jnp.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = jnp.maximum(dt, dt_floor)
        # Inverse softplus: log(exp(dt) - 1) = dt + log(1 - exp(-dt)), stable for small dt.
        return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)

    return init


class GatedDeltaNet(nnx.Module):
    """Gated DeltaNet linear-attention layer ``[B, T, D] -> [B, T, D]``.

    Args:
      hidden_size: model width D.
      num_heads: q/k heads H.
      head_dim: q/k head dim K.
      num_v_heads: value heads HV (a multiple of H; GVA: value head i reads q/k head i // (HV//H)).
        Defaults to ``num_heads``.
      v_head_dim: value head dim V; defaults to ``head_dim``.
      variant: ``"gdn"``, ``"kda"`` or ``"gdn2"``.
      conv_kernel: taps of the short causal conv on q, k, v.
      norm_eps: epsilon of the gated output RMSNorm.
      use_qk_l2norm: L2-normalise q and k inside the core op (Qwen does).
      chunk_size: chunk length of the chunked core.
      implementation: passed to the core op (``None`` = Pallas on Hopper GPUs, ``"xla"``
        elsewhere); the short convolutions try the same order, then ``"xla"``.
      qat: optional :class:`gdn_jax.qat.QATConfig` for the chunked core (FP8 fake quantisation).
      sharding: optional :class:`gdn_jax.sharding.ShardingConfig`: the chunked core runs per shard.
      a_log_range: A = exp(A_log) is drawn from U(a_log_range) at init.
      dt_range: softplus(dt_bias) is drawn log-uniformly from this range at init.
      dtype: compute dtype of projections, conv and core inputs (None: inferred from inputs and
        params, as ``nnx.Linear`` does). Gates are always f32.
      param_dtype: dtype of the parameters.
      fp8: FP8 backend of the projections (None, "native", "te"; gdn_jax.fp8); the core op
        always runs in the compute dtype.
      fp8_recipe: TE recipe name for ``fp8="te"`` ("current" or "delayed").
      rngs: random streams for the initialisation.

    Example:
      >>> layer = GatedDeltaNet(64, num_heads=2, head_dim=16, rngs=nnx.Rngs(0))
      >>> layer(jnp.ones((1, 8, 64))).shape
      (1, 8, 64)
    """

    def __init__(
        self,
        hidden_size: int,
        *,
        num_heads: int,
        head_dim: int = 128,
        num_v_heads: int | None = None,
        v_head_dim: int | None = None,
        variant: Variant = "gdn",
        conv_kernel: int = 4,
        norm_eps: float = 1e-6,
        use_qk_l2norm: bool = True,
        chunk_size: int = 64,
        implementation: str | tuple[str, ...] | None = None,
        qat: QATConfig | None = None,
        sharding: ShardingConfig | None = None,
        a_log_range: tuple[float, float] = (1.0, 16.0),
        dt_range: tuple[float, float] = (1e-3, 0.1),
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        fp8: fp8_lib.Backend = None,
        fp8_recipe: str = "current",
        rngs: nnx.Rngs,
    ):
        num_v_heads = num_heads if num_v_heads is None else num_v_heads
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        if variant not in _OPS:
            raise ValueError(f"{variant=}: expected one of {tuple(_OPS)}")
        sizes = dict(
            hidden_size=hidden_size, num_heads=num_heads, head_dim=head_dim,
            num_v_heads=num_v_heads, v_head_dim=v_head_dim, conv_kernel=conv_kernel,
        )  # fmt: skip
        for name, n in sizes.items():
            if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
                raise ValueError(f"{name} must be an int >= 1; got {name}={n!r}")
        if num_v_heads % num_heads:
            raise ValueError(f"{num_v_heads=} must be a multiple of {num_heads=}")
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_v_heads = num_v_heads
        self.v_head_dim = v_head_dim
        self.variant = variant
        self.conv_kernel = conv_kernel
        self.use_qk_l2norm = use_qk_l2norm
        self.chunk_size = chunk_size
        self.implementation = implementation
        self.qat = qat
        self.sharding = sharding
        self.dtype = dtype

        D, H, K, HV, V = hidden_size, num_heads, head_dim, num_v_heads, v_head_dim
        # Per-key-channel gates for kda/gdn2, one per value head for gdn.
        G = HV if variant == "gdn" else HV * K
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        pkw = dict(kw, fp8=fp8, fp8_recipe=fp8_recipe)  # projections may run in FP8
        self.q_proj = dense(D, H * K, (EMBED, HEADS), **pkw)
        self.k_proj = dense(D, H * K, (EMBED, HEADS), **pkw)
        self.v_proj = dense(D, HV * V, (EMBED, HEADS), **pkw)
        self.z_proj = dense(D, HV * V, (EMBED, HEADS), **pkw)
        self.a_proj = dense(D, G, (EMBED, HEADS), **pkw)
        self.b_proj = dense(D, HV if variant == "kda" else G, (EMBED, HEADS), **pkw)
        if variant == "gdn2":
            self.w_proj = dense(D, HV * V, (EMBED, HEADS), **pkw)
        conv_order = ops.with_xla_fallback(implementation)
        ckw = dict(kw, kernel_size=conv_kernel, implementation=conv_order)
        self.q_conv = ShortConv(H * K, **ckw)
        self.k_conv = ShortConv(H * K, **ckw)
        self.v_conv = ShortConv(HV * V, **ckw)
        self.A_log = nnx.Param(
            partitioned(_a_log_init(*a_log_range), (HEADS,))(rngs.params(), (HV,), param_dtype)
        )
        self.dt_bias = nnx.Param(
            partitioned(_dt_bias_init(*dt_range), (HEADS,))(rngs.params(), (G,), param_dtype)
        )
        self.norm = GatedRMSNorm(V, eps=norm_eps, **kw)
        self.out_proj = dense(HV * V, D, (HEADS, EMBED), **pkw)

    def _check_input(self, x) -> None:
        check_array("x", x)
        if x.ndim != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"x must be [B, T, hidden_size={self.hidden_size}]; got x.shape={x.shape}"
            )

    def _check_cache(self, x, cache) -> None:
        """``cache`` must be the GDNCache :meth:`init_cache` makes for x's batch size."""
        want = jax.eval_shape(lambda: self.init_cache(x.shape[0]))
        if not isinstance(cache, GDNCache):
            raise ValueError(f"cache must be a GDNCache (init_cache); got {type(cache).__name__}")
        for name, e in zip(GDNCache._fields, want, strict=True):
            got = getattr(getattr(cache, name), "shape", None)
            if got != e.shape:
                raise ValueError(
                    f"cache.{name} must have shape {e.shape} for x.shape={x.shape} with this "
                    f"layer; got {got} (a cache of another batch size or layer?)"
                )

    def _gates(self, x: jax.Array) -> tuple[jax.Array, ...]:
        """The core op's gate arguments after (q, k, v), all f32."""
        B, T, _ = x.shape
        HV, K, V = self.num_v_heads, self.head_dim, self.v_head_dim
        f32 = jnp.float32
        # f32 before exp/softplus: in f16 exp(A_log) can overflow (HF's comment on Qwen3-Next).
        a = self.a_proj(x).astype(f32) + self.dt_bias[...].astype(f32)
        rate = jnp.exp(self.A_log[...].astype(f32))
        b = jax.nn.sigmoid(self.b_proj(x).astype(f32))
        if self.variant == "gdn":
            return -rate * jax.nn.softplus(a), b
        g = -rate[:, None] * jax.nn.softplus(a.reshape(B, T, HV, K))
        if self.variant == "kda":
            return g, b
        w = jax.nn.sigmoid(self.w_proj(x).astype(f32)).reshape(B, T, HV, V)
        return g, b.reshape(B, T, HV, K), w

    def _heads(self, q, k, v):
        B, T, _ = q.shape
        H, K, HV, V = self.num_heads, self.head_dim, self.num_v_heads, self.v_head_dim
        return q.reshape(B, T, H, K), k.reshape(B, T, H, K), v.reshape(B, T, HV, V)

    def _core_options(self) -> dict:
        # Only non-default options are passed, so the chunked op can be swapped for any callable
        # with the gated_delta_rule signature.
        opts = dict(chunk_size=self.chunk_size, implementation=self.implementation)
        if self.qat is not None:
            opts["qat"] = self.qat
        if self.sharding is not None:
            opts["sharding"] = self.sharding
        return opts

    def _output(self, o: jax.Array, x: jax.Array) -> jax.Array:
        B, T = x.shape[:2]
        o = remat.name(o, remat.GDN_CORE_OUT)
        z = self.z_proj(x).reshape(o.shape)
        y = self.norm(o, z).reshape(B, T, self.num_v_heads * self.v_head_dim)
        return remat.name(self.out_proj(y), remat.MIXER_OUT)

    def __call__(self, x: jax.Array, *, cu_seqlens: jax.Array | None = None) -> jax.Array:
        """Process whole sequences (training / scoring).

        Args:
          x: [B, T, D].
          cu_seqlens: optional [N + 1] int32 boundaries of packed sequences (B == 1); sequences do
            not see each other, neither in the conv nor in the recurrence.
        Returns:
          [B, T, D].
        """
        self._check_input(x)
        cu_seqlens = prepare_cu_seqlens(cu_seqlens, x.shape[0], x.shape[1])
        context = self.sharding is not None and bool(self.sharding.context)
        check_sequence_layout("GatedDeltaNet", "x", x, context=context)
        # Scope names group the layer's ops in profiles (benchmarks/profile_step.py).
        with jax.named_scope("gdn_in"):
            q = self.q_conv(self.q_proj(x), cu_seqlens=cu_seqlens)
            k = self.k_conv(self.k_proj(x), cu_seqlens=cu_seqlens)
            v = self.v_conv(self.v_proj(x), cu_seqlens=cu_seqlens)
            # Named so remat policies (gdn_jax.remat) can save, offload or recompute them.
            qkv = remat.name(self._heads(q, k, v), remat.GDN_QKV)
            gates = remat.name(self._gates(x), remat.GDN_GATES)
        with jax.named_scope("gdn_core"):
            # The core never runs in FP8 (inputs upcast, TE autocast off inside; gdn_jax.fp8).
            o, _ = fp8_lib.fp8_free(_OPS[self.variant][0])(
                *qkv,
                *gates,
                use_qk_l2norm=self.use_qk_l2norm,
                cu_seqlens=cu_seqlens,
                **self._core_options(),
            )
        with jax.named_scope("gdn_out"):
            return self._output(o, x)

    def init_cache(self, batch_size: int, dtype: Dtype = jnp.float32) -> GDNCache:
        """An empty decode cache (zeros): the state before the first token.

        Args:
          batch_size: B.
          dtype: dtype of the conv tails (the state is always f32).
        """
        W = self.conv_kernel - 1
        qk = self.num_heads * self.head_dim
        return GDNCache(
            conv_q=jnp.zeros((batch_size, W, qk), dtype),
            conv_k=jnp.zeros((batch_size, W, qk), dtype),
            conv_v=jnp.zeros((batch_size, W, self.num_v_heads * self.v_head_dim), dtype),
            state=jnp.zeros(
                (batch_size, self.num_v_heads, self.head_dim, self.v_head_dim), jnp.float32
            ),
        )

    def extend(self, x: jax.Array, cache: GDNCache) -> tuple[jax.Array, GDNCache]:
        """Append T >= 1 tokens to a cached prefix (prefill, then decode one token at a time).

        A single token goes through the decode op (``*_step``); longer inputs go through the
        chunked op started from the cached state. Any split of a sequence into ``extend`` calls
        gives what one ``__call__`` on the whole sequence gives.

        Args:
          x: [B, T, D].
          cache: from :meth:`init_cache` or a previous ``extend``.
        Returns:
          y [B, T, D] and the updated cache.
        """
        self._check_input(x)
        self._check_cache(x, cache)
        check_sequence_unsplit("GatedDeltaNet.extend", "x", x, decode=x.shape[1] == 1)
        xq, xk, xv = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = self.q_conv(xq, tail=cache.conv_q)
        k = self.k_conv(xk, tail=cache.conv_k)
        v = self.v_conv(xv, tail=cache.conv_v)
        chunked, step = (fp8_lib.fp8_free(op) for op in _OPS[self.variant])
        args = (*self._heads(q, k, v), *self._gates(x))
        if x.shape[1] == 1:
            o, state = step(
                *args,
                cache.state,
                use_qk_l2norm=self.use_qk_l2norm,
                implementation=self.implementation,
            )
        else:
            o, state = chunked(
                *args,
                initial_state=cache.state,
                output_final_state=True,
                use_qk_l2norm=self.use_qk_l2norm,
                **self._core_options(),
            )
        # On Explicit mesh axes the new cache keeps the layout of the one passed in.
        new_cache = GDNCache(
            conv_q=laid_out_like(self.q_conv.next_tail(xq, cache.conv_q), cache.conv_q),
            conv_k=laid_out_like(self.k_conv.next_tail(xk, cache.conv_k), cache.conv_k),
            conv_v=laid_out_like(self.v_conv.next_tail(xv, cache.conv_v), cache.conv_v),
            state=laid_out_like(state, cache.state),
        )
        return self._output(o, x), new_cache
