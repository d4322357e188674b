"""A hybrid decoder LM: Gated DeltaNet layers with gated softmax attention every few layers.

Layer ``i`` is softmax attention iff ``(i + 1) % full_attention_interval == 0`` (Qwen3.5: layers
3, 7, 11, ... of 0-based indices, 3 GDN : 1 attention), GDN otherwise; ``layer_pattern`` gives
any other pattern. Each layer is pre-norm::

    h = x + mixer(RMSNorm(x));  y = h + SwiGLU(RMSNorm(h))

:meth:`HybridConfig.from_hf` / :meth:`HybridConfig.to_hf` translate Hugging Face Qwen3.5 configs;
a model built from one computes what transformers' ``Qwen3_5ForCausalLM`` computes
(``gdn_jax.convert.load_hf_model`` loads the weights).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from flax.typing import Dtype
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gdn_jax import ops, remat
from gdn_jax.models import _checks, _lm_head
from gdn_jax.models.attention import GatedAttention, KVCache
from gdn_jax.nn.gated_deltanet import GatedDeltaNet, GDNCache, Variant
from gdn_jax.nn.layers import (
    EMBED,
    MLP,
    VOCAB,
    RMSNorm,
    _projection,
    dense,
    partitioned,
    project,
    sequence_starts,
)
from gdn_jax.ops._validate import prepare_cu_seqlens
from gdn_jax.sharding import (
    _entry,
    check_sequence_layout,
    explicit_axes_of,
    explicit_mesh,
    in_auto_axes,
)

if TYPE_CHECKING:
    from gdn_jax.qat import QATConfig
    from gdn_jax.sharding import ShardingConfig

__all__ = [
    "HybridConfig",
    "HybridLM",
    "HybridCache",
    "SwiGLU",
    "DecoderLayer",
    "PRESETS",
    "get_config",
]


class HybridCache(NamedTuple):
    """Decode state of a :class:`HybridLM`.

    Attributes:
      layers: per layer, a :class:`gdn_jax.nn.GDNCache` (conv tails + f32 state) or a
        :class:`gdn_jax.models.attention.KVCache` (keys and values up to ``max_len``).
      pos: int32 scalar, the number of tokens processed so far.
    """

    layers: tuple[GDNCache | KVCache, ...]
    pos: jax.Array


@dataclasses.dataclass(frozen=True)
class HybridConfig:
    """Shape of a :class:`HybridLM`.

    Attributes:
      vocab_size, hidden_size, num_layers, intermediate_size: LM width, depth and SwiGLU width.
      linear_num_heads, linear_num_v_heads, linear_head_dim, linear_v_head_dim: GDN layer heads
        (q/k heads H, value heads HV, K, V).
      attn_num_heads, attn_num_kv_heads, attn_head_dim: softmax-attention heads.
      partial_rotary_factor, rope_theta: rotary embedding of the attention layers (the first
        ``int(attn_head_dim * partial_rotary_factor)`` dims of each head, base ``rope_theta``).
      full_attention_interval: every n-th layer is softmax attention; 0 means GDN only.
      variant: GDN variant of the linear layers ("gdn", "kda", "gdn2").
      conv_kernel: short-conv taps of the GDN layers.
      chunk_size: chunk length of the GDN layers' chunked core.
      norm_eps: epsilon of every RMSNorm.
      tie_embeddings: the LM head reuses the embedding matrix.
      layer_pattern: ``"linear"`` or ``"attention"`` per layer (``num_layers`` entries); when
        given it replaces ``full_attention_interval``.
      zero_centered_norm: the decoder, final and attention q/k RMSNorms scale by
        ``1 + weight`` (weights start at 0), as Qwen3.5 does; the GDN output norm always
        multiplies by its weight directly.
      max_position_embeddings, bos_token_id, eos_token_id, pad_token_id: carried to and from HF
        configs (``eos_token_id`` is what :func:`gdn_jax.models.generate` stops at when asked).
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    intermediate_size: int
    linear_num_heads: int
    linear_num_v_heads: int
    linear_head_dim: int
    linear_v_head_dim: int
    attn_num_heads: int
    attn_num_kv_heads: int
    attn_head_dim: int
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10_000_000.0
    full_attention_interval: int = 4
    variant: Variant = "gdn"
    conv_kernel: int = 4
    chunk_size: int = 64
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    layer_pattern: tuple[str, ...] | None = None
    zero_centered_norm: bool = False
    max_position_embeddings: int = 262_144
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.layer_pattern is not None:
            pattern = tuple(self.layer_pattern)
            object.__setattr__(self, "layer_pattern", pattern)  # lists become hashable tuples
            if len(pattern) != self.num_layers or not set(pattern) <= {"linear", "attention"}:
                raise ValueError(
                    f"layer_pattern={pattern}: expected {self.num_layers} (num_layers) entries "
                    "of 'linear' or 'attention'"
                )
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

    @property
    def layer_types(self) -> tuple[str, ...]:
        """``"attention"`` or ``"linear"`` per layer."""
        if self.layer_pattern is not None:
            return self.layer_pattern
        n = self.full_attention_interval
        return tuple(
            "attention" if n and (i + 1) % n == 0 else "linear" for i in range(self.num_layers)
        )

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], **overrides) -> HybridConfig:
        """The config of a Hugging Face Qwen3.5 dense checkpoint (its ``config.json`` as a dict).

        Accepts a text config (``model_type`` ``"qwen3_5_text"``, ``Qwen3_5ForCausalLM``) or a
        composite one (``"qwen3_5"``, ``Qwen3_5ForConditionalGeneration``: the ``text_config``
        is used; the LM head is tied per the top-level ``tie_word_embeddings`` when present).
        Keys a config leaves out take transformers' ``Qwen3_5TextConfig`` defaults. RoPE:
        ``rope_parameters`` (``rope_theta``, ``partial_rotary_factor``; legacy top-level keys
        are read too). Text-only positions make the multimodal RoPE (``mrope_section``) equal
        plain RoPE: all three of its position streams are the token index.

        Args:
          config: the parsed ``config.json``.
          overrides: fields of this class to set on top (e.g. ``chunk_size``).
        Returns:
          The config; a model built from it computes what transformers computes.
        Raises:
          NotImplementedError: MoE models (``qwen3_5_moe``, ``qwen3_next``) and options this
            model does not implement (non-default ``rope_type``, ``attention_bias``, a
            ``hidden_act`` other than silu, no attention output gate, an odd rotary dim).
          ValueError: an unknown ``model_type`` or ``layer_types`` entry.
        """
        from gdn_jax.models._hf_config import config_from_hf

        return config_from_hf(cls, config, overrides)

    def to_hf(self) -> dict[str, Any]:
        """The ``config.json`` of a ``Qwen3_5ForCausalLM`` with this shape (no ``dtype`` key).

        Raises:
          NotImplementedError: the config has no Qwen3.5 equivalent (a variant other than
            ``"gdn"``, or ``zero_centered_norm=False``).
        """
        from gdn_jax.models._hf_config import config_to_hf

        return config_to_hf(self)


PRESETS: dict[str, HybridConfig] = {
    # Runs on a CPU in seconds: the demo and the tests.
    "tiny": HybridConfig(
        vocab_size=256,
        hidden_size=64,
        num_layers=4,
        intermediate_size=192,
        linear_num_heads=2,
        linear_num_v_heads=2,
        linear_head_dim=32,
        linear_v_head_dim=32,
        attn_num_heads=2,
        attn_num_kv_heads=1,
        attn_head_dim=32,
    ),
    # Qwen3.5-0.8B's text model (Qwen/Qwen3.5-0.8B config.json's text_config; about 0.75B
    # parameters with tied embeddings): HybridConfig.from_hf of that config gives this.
    "qwen3_5_0_8b": HybridConfig(
        vocab_size=248_320,
        hidden_size=1024,
        num_layers=24,
        intermediate_size=3584,
        linear_num_heads=16,
        linear_num_v_heads=16,
        linear_head_dim=128,
        linear_v_head_dim=128,
        attn_num_heads=8,
        attn_num_kv_heads=2,
        attn_head_dim=256,
        partial_rotary_factor=0.25,
        rope_theta=10_000_000.0,
        norm_eps=1e-6,
        tie_embeddings=True,
        zero_centered_norm=True,
        max_position_embeddings=262_144,
        eos_token_id=248_044,
    ),
}


def get_config(name: str, **overrides) -> HybridConfig:
    """A preset (``"tiny"``, ``"qwen3_5_0_8b"``) with fields replaced by ``overrides``."""
    if name not in PRESETS:
        raise ValueError(f"{name=}: expected one of {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)


class SwiGLU(nnx.Module):
    """``(silu(x W_gate) * x W_up) W_down``, ``[..., D] -> [..., D]``."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        fp8: str | None = None,
        fp8_recipe: str = "current",
        rngs: nnx.Rngs,
    ):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs, fp8=fp8, fp8_recipe=fp8_recipe)
        self.gate_proj = dense(hidden_size, intermediate_size, (EMBED, MLP), **kw)
        self.up_proj = dense(hidden_size, intermediate_size, (EMBED, MLP), **kw)
        self.down_proj = dense(intermediate_size, hidden_size, (MLP, EMBED), **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = remat.name(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x), remat.MLP_HIDDEN)
        return self.down_proj(h)


class DecoderLayer(nnx.Module):
    """One pre-norm residual layer: a token mixer (GDN or gated attention) then a SwiGLU MLP."""

    def __init__(
        self,
        config: HybridConfig,
        layer_type: str,
        *,
        implementation: str | tuple[str, ...] | None = None,
        qat: QATConfig | None = None,
        sharding: ShardingConfig | None = None,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        fp8: str | None = None,
        fp8_recipe: str = "current",
        rngs: nnx.Rngs,
    ):
        c = config
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        fkw = dict(kw, fp8=fp8, fp8_recipe=fp8_recipe)  # modules with projections
        self.layer_type = layer_type
        nkw = dict(kw, eps=c.norm_eps, zero_centered=c.zero_centered_norm)
        self.input_norm = RMSNorm(c.hidden_size, **nkw)
        if layer_type == "attention":
            self.mixer = GatedAttention(
                c.hidden_size,
                num_heads=c.attn_num_heads,
                num_kv_heads=c.attn_num_kv_heads,
                head_dim=c.attn_head_dim,
                partial_rotary_factor=c.partial_rotary_factor,
                rope_theta=c.rope_theta,
                norm_eps=c.norm_eps,
                zero_centered_norm=c.zero_centered_norm,
                **fkw,
            )
        elif layer_type == "linear":
            self.mixer = GatedDeltaNet(
                c.hidden_size,
                num_heads=c.linear_num_heads,
                head_dim=c.linear_head_dim,
                num_v_heads=c.linear_num_v_heads,
                v_head_dim=c.linear_v_head_dim,
                variant=c.variant,
                conv_kernel=c.conv_kernel,
                chunk_size=c.chunk_size,
                norm_eps=c.norm_eps,
                implementation=implementation,
                qat=qat,
                sharding=sharding,
                **fkw,
            )
        else:
            raise ValueError(f"{layer_type=}: expected 'attention' or 'linear'")
        self.post_norm = RMSNorm(c.hidden_size, **nkw)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size, **fkw)

    def __call__(self, x, *, positions, mask, cu_seqlens):
        # Scope names group the layer's ops in profiles (benchmarks/profile_step.py).
        with jax.named_scope("norm"):
            h = self.input_norm(x)
        if self.layer_type == "attention":
            with jax.named_scope("attention"):
                h = self.mixer(h, positions=positions, mask=mask)
        else:
            h = self.mixer(h, cu_seqlens=cu_seqlens)
        x = x + h
        with jax.named_scope("norm"):
            h = self.post_norm(x)
        with jax.named_scope("mlp"):
            return x + self.mlp(h)

    def extend(self, x, cache, pos):
        h = self.input_norm(x)
        if self.layer_type == "attention":
            h, cache = self.mixer.extend(h, cache, pos)
        else:
            h, cache = self.mixer.extend(h, cache)
        x = x + h
        return x + self.mlp(self.post_norm(x)), cache


def _call_layer(layer, x, positions, mask, cu_seqlens):
    return layer(x, positions=positions, mask=mask, cu_seqlens=cu_seqlens)


class HybridLM(nnx.Module):
    """Decoder-only LM over token ids, ``[B, T] -> logits [B, T, vocab]``.

    Args:
      config: model shape (see :data:`PRESETS`).
      implementation: GDN core implementation (``None``: Pallas on Hopper GPUs, XLA elsewhere).
      qat, sharding: passed to every GDN layer (see :class:`gdn_jax.nn.GatedDeltaNet`); a layer's
        ``mixer.qat`` can also be set after construction to quantise only some layers.
      dtype: compute dtype (e.g. ``jnp.bfloat16``); param_dtype: parameter dtype.
      fp8, fp8_recipe: FP8 backend of the layers' projections (None, "native", "te";
        gdn_jax.fp8). The embedding and LM head stay in the compute dtype.
      remat_policies: one ``jax.checkpoint`` policy (or None: no checkpoint) per layer, e.g.
        ``gdn_jax.remat.layer_policies(spec, num_layers, offload_fraction=0.5)``.
      rngs: init randomness.

    Example:
      >>> model = HybridLM(get_config("tiny"), rngs=nnx.Rngs(0))
      >>> model(jnp.zeros((2, 16), jnp.int32)).shape
      (2, 16, 256)
    """

    def __init__(
        self,
        config: HybridConfig,
        *,
        implementation: str | tuple[str, ...] | None = None,
        qat: QATConfig | None = None,
        sharding: ShardingConfig | None = None,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        fp8: str | None = None,
        fp8_recipe: str = "current",
        remat_policies: Sequence[Callable | None] | None = None,
        rngs: nnx.Rngs,
    ):
        c = config
        self.config = config
        self.dtype = dtype
        self.implementation = implementation
        if remat_policies is not None and len(remat_policies) != c.num_layers:
            raise ValueError(f"{len(remat_policies)=} must equal {c.num_layers=}")
        self.remat_policies = tuple(remat_policies or (None,) * c.num_layers)
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.embed = nnx.Embed(
            c.vocab_size,
            c.hidden_size,
            embedding_init=partitioned(
                nnx.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0),
                (VOCAB, EMBED),
            ),
            **kw,
        )
        self.layers = nnx.List(
            [
                DecoderLayer(
                    c,
                    t,
                    implementation=implementation,
                    qat=qat,
                    sharding=sharding,
                    fp8=fp8,
                    fp8_recipe=fp8_recipe,
                    **kw,
                )
                for t in config.layer_types
            ]
        )
        self.norm = RMSNorm(c.hidden_size, eps=c.norm_eps, zero_centered=c.zero_centered_norm, **kw)
        if not c.tie_embeddings:
            self.lm_head = dense(c.hidden_size, c.vocab_size, (EMBED, VOCAB), **kw)

    def __call__(self, tokens: jax.Array, *, cu_seqlens: jax.Array | None = None) -> jax.Array:
        """Next-token logits.

        Args:
          tokens: [B, T] int token ids.
          cu_seqlens: optional [N + 1] int32 boundaries of packed sequences (B == 1): positions
            restart and no layer mixes tokens across a boundary.
        Returns:
          [B, T, vocab] logits in f32.
        """
        return self._logits(self.hidden(tokens, cu_seqlens=cu_seqlens))

    def hidden(
        self,
        tokens: jax.Array,
        *,
        cu_seqlens: jax.Array | None = None,
        remat_policies: Sequence[Callable | None] | None = None,
    ) -> jax.Array:
        """The decoder stack's output before the final norm and the LM head.

        Args: as for ``__call__``; ``remat_policies`` (one per layer) overrides the model's own
        for this call (e.g. to compare policies on the same parameters).
        Returns: [B, T, hidden] in the compute dtype.
        """
        policies = self.remat_policies if remat_policies is None else tuple(remat_policies)
        if len(policies) != len(self.layers):
            raise ValueError(f"{len(policies)=} must equal the number of layers {len(self.layers)}")
        tokens = _checks.token_ids("tokens", tokens, self.config.vocab_size)
        context = any(
            getattr(layer.mixer, "sharding", None) is not None and layer.mixer.sharding.context
            for layer in self.layers
        )
        check_sequence_layout("HybridLM", "tokens", tokens, context=context)
        B, T = tokens.shape
        cu_seqlens = prepare_cu_seqlens(cu_seqlens, B, T)
        t = jnp.arange(T, dtype=jnp.int32)
        if cu_seqlens is None:
            positions, mask = jnp.broadcast_to(t, (B, T)), None
        else:
            start = sequence_starts(cu_seqlens, T)
            positions = (t - start)[None]
            # Same sequence (same start) and causal.
            mask = ((start[:, None] == start[None, :]) & (t[:, None] >= t[None, :]))[None, None]
        x = self._embed(tokens)
        for layer, policy in zip(self.layers, policies, strict=True):
            if policy is None:
                x = layer(x, positions=positions, mask=mask, cu_seqlens=cu_seqlens)
            else:
                # The layer's named tensors are saved, offloaded or recomputed per the policy.
                x = nnx.remat(_call_layer, policy=policy, prevent_cse=True)(
                    layer, x, positions, mask, cu_seqlens
                )
        return x

    def loss(
        self,
        x: jax.Array,
        targets: jax.Array,
        *,
        mask: jax.Array | None = None,
        chunk: int | None = 512,
    ) -> tuple[jax.Array, jax.Array]:
        """Mean next-token cross-entropy and accuracy of the hidden states ``x``, computed
        ``chunk`` positions at a time so that the [B, T, vocab] f32 logits never exist at once.

        The logits of a 248k vocabulary are 3.8 GiB in f32 at B·T = 4096, more than all 24
        layers' saved activations of ``qwen3_5_0_8b``: a training step that materialises them
        peaks there, and the memory effect of remat/offload is hidden under them. Under
        differentiation each chunk's logit gradient ``mask · (softmax − onehot) / Σ mask`` is
        formed in the forward pass, right after its logits, and turned into the chunk's input
        gradient and a share of the head's weight gradient (f32 sum over chunks) there: the
        head costs its three [B, chunk, hidden] × [hidden, vocab] products and no recomputation,
        and the backward pass only scales the two gradients by the loss's cotangent. (A
        ``jax.custom_vjp``: reverse mode only; the mask gets no gradient.) On Explicit mesh axes,
        and for an LM head other than a plain projection, each chunk's logits are recomputed in
        the backward pass instead (``jax.checkpoint``).

        Args:
          x: [B, T, hidden] from :meth:`hidden`.
          targets: [B, T] int next-token ids.
          mask: optional [B, T] weights (1: counted, 0: padding); default all ones.
          chunk: positions per chunk; ``None`` (or ≥ T): one chunk, the plain computation. Any T
            works: the last chunk is padded with positions of weight 0.
        Returns:
          (loss, accuracy): f32 scalars, means over the weighted positions.
        """
        if mask is not None and getattr(mask, "shape", None) != getattr(targets, "shape", None):
            raise ValueError(f"mask must have targets' shape [B, T]; got {mask.shape=}, "
                             f"{targets.shape=}")  # fmt: skip
        targets = _checks.token_ids("targets", targets, self.config.vocab_size, mask=mask)
        B, T = targets.shape
        if x.shape[:2] != (B, T):
            raise ValueError(f"{x.shape=} must be [B, T, hidden] with [B, T] = {targets.shape=}")
        if mask is None:
            mask = jnp.ones((B, T), jnp.float32)
        mask = mask.astype(jnp.float32)

        def sums(x, targets, mask):  # [B, c, D], [B, c], [B, c] -> (Σ nll, Σ correct)
            logits = self._logits(x)
            lse = jax.nn.logsumexp(logits, axis=-1)
            # (A gather from vocabulary-sharded logits: on Explicit axes the partitioner does it.)
            target = in_auto_axes(
                lambda lg, t: jnp.take_along_axis(lg, t[..., None], axis=-1)[..., 0],
                P(*(_entry(a) for a in explicit_axes_of(targets))), logits, targets,
            )  # fmt: skip
            correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
            return jnp.sum((lse - target) * mask), jnp.sum(correct * mask)

        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int)
                                  or chunk <= 0):  # fmt: skip
            raise ValueError(f"chunk must be a positive int or None; got {chunk=}")
        head = self._plain_head(x)
        if head is not None:
            xn, w, vocab_major = head
            if chunk is None or chunk >= T:
                chunk = T
            xn, targets, mask = _checks.pad_time(chunk, xn, targets, mask)  # padding: weight 0
            vocab = w.shape[0] if vocab_major else w.shape[1]

            def run(impl):
                with jax.named_scope("lm_head"):
                    return _lm_head.head_cross_entropy(
                        xn, w, targets, mask, chunk, vocab_major, impl
                    )

            def run_pallas():
                _lm_head.check_pallas(xn, w, B * chunk, vocab)
                return run("pallas")

            order = ops.with_xla_fallback(self.implementation)
            return ops._run("lm_head", order, lambda: run("xla"), run_pallas, default="lm_head")
        if chunk is None or chunk >= T:
            nll, correct = sums(x, targets, mask)
        else:
            x, targets, mask = _checks.pad_time(chunk, x, targets, mask)  # padding: weight 0
            n = x.shape[1] // chunk
            split = lambda a: a.reshape(B, n, chunk, *a.shape[2:]).swapaxes(0, 1)
            body = jax.checkpoint(lambda xs: sums(*xs))  # logits recomputed in the backward

            def step(acc, xs):
                return jax.tree.map(jnp.add, acc, body(xs)), None

            zero = jnp.zeros((), jnp.float32)
            (nll, correct), _ = jax.lax.scan(
                step, (zero, zero), (split(x), split(targets), split(mask))
            )
        n_tok = jnp.maximum(jnp.sum(mask), 1.0)
        return nll / n_tok, correct / n_tok

    def _embed(self, tokens):
        mesh = explicit_mesh(tokens)
        if mesh is None:
            return self.embed(tokens)
        # Explicit mesh axes: the lookup from a (vocab / FSDP) sharded table is left to XLA's
        # partitioner; the embeddings are laid out like the tokens.
        out = P(*(_entry(a) for a in explicit_axes_of(tokens)), None)
        return self.embed(tokens, out_sharding=NamedSharding(mesh, out))

    def _plain_head(self, x):
        """``(norm(x), W, vocab_major)`` in the compute dtype when the LM head is the plain
        projection ``norm(x) @ W`` (tied embeddings: the table [vocab, hidden], vocab_major; an
        unconverted bias-free ``nnx.Linear``: its kernel [hidden, vocab]) and no input is on
        Explicit mesh axes; None otherwise."""
        if self.config.tie_embeddings:
            table = self.embed.embedding[...]
            if explicit_mesh(x, table) is not None:
                return None
            x, table = self.embed.promote_dtype((self.norm(x), table), dtype=self.dtype)
            return x, table, True
        head = self.lm_head
        plain = (
            type(head) is nnx.Linear
            and head.bias is None
            and head.dot_general is _projection(jax.lax.dot_general)
            and getattr(head, "dot_general_cls", None) is None
            and getattr(head, "preferred_element_type", None) is None
            and head.precision is None
        )
        if not plain or explicit_mesh(x, head.kernel[...]) is not None:
            return None
        x, kernel = head.promote_dtype((self.norm(x), head.kernel[...]), dtype=head.dtype)
        return x, kernel, False

    def _logits(self, x):
        x = self.norm(x)
        if self.config.tie_embeddings:
            x, table = self.embed.promote_dtype((x, self.embed.embedding[...]), dtype=self.dtype)
            logits = project(x, table.T)
        else:
            logits = self.lm_head(x)
        return logits.astype(jnp.float32)

    def init_cache(self, batch_size: int, max_len: int) -> HybridCache:
        """An empty decode cache for sequences of up to ``max_len`` tokens.

        GDN layers keep a constant-size state; attention layers keep keys and values of every
        position (in the compute dtype, f32 if unset).
        """
        _checks.cache_size(batch_size, max_len)
        dtype = self.dtype or jnp.float32
        layers = tuple(
            layer.mixer.init_cache(batch_size, max_len, dtype)
            if layer.layer_type == "attention"
            else layer.mixer.init_cache(batch_size, dtype)
            for layer in self.layers
        )
        return HybridCache(layers=layers, pos=jnp.zeros((), jnp.int32))

    def extend(
        self, tokens: jax.Array, cache: HybridCache, *, last_only: bool = False
    ) -> tuple[jax.Array, HybridCache]:
        """Append T >= 1 tokens to every sequence (prefill, then decode token by token).

        Any split of a sequence into ``extend`` calls gives the logits one ``__call__`` gives.

        Args:
          tokens: [B, T] int token ids.
          cache: from :meth:`init_cache` or a previous ``extend``.
          last_only: compute the logits of the last position only (a prefill that samples the
            next token needs no others).
        Returns:
          logits [B, T, vocab] f32 ([B, 1, vocab] with ``last_only``) and the updated cache.
        """
        tokens = _checks.token_ids("tokens", tokens, self.config.vocab_size)
        max_len = _checks.decode_cache(self, tokens, cache)
        x = self._embed(tokens)
        new = []
        for layer, layer_cache in zip(self.layers, cache.layers, strict=True):
            x, layer_cache = layer.extend(x, layer_cache, cache.pos)
            new.append(layer_cache)
        if last_only:
            x = x[:, -1:]
        logits = _checks.fits_or_nan(self._logits(x), cache.pos, tokens.shape[1], max_len)
        return logits, HybridCache(tuple(new), cache.pos + tokens.shape[1])
