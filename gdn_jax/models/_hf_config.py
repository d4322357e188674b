"""Hugging Face Qwen3.5 ``config.json`` <-> :class:`gdn_jax.models.HybridConfig`.

Field names and defaults follow transformers 5.17's ``Qwen3_5TextConfig``
(``transformers/models/qwen3_5/configuration_qwen3_5.py``): a key a checkpoint's config leaves
out takes the value transformers would give it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["config_from_hf", "config_to_hf", "TEXT_MODEL_TYPE", "COMPOSITE_MODEL_TYPE"]

TEXT_MODEL_TYPE = "qwen3_5_text"  # Qwen3_5ForCausalLM
COMPOSITE_MODEL_TYPE = "qwen3_5"  # Qwen3_5ForConditionalGeneration (text_config + vision_config)
# Hybrid models with an MoE MLP: same token mixers, different MLP and checkpoint keys.
MOE_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")

# Qwen3_5TextConfig's class defaults.
_DEFAULTS = dict(
    vocab_size=248_320,
    hidden_size=4096,
    intermediate_size=12_288,
    num_hidden_layers=32,
    num_attention_heads=16,
    num_key_value_heads=4,
    hidden_act="silu",
    max_position_embeddings=32_768,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    attention_bias=False,
    head_dim=256,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    full_attention_interval=4,
)
_DEFAULT_ROPE_THETA = 10_000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta
_DEFAULT_PARTIAL_ROTARY = 0.25  # Qwen3_5TextConfig.__post_init__
# HF layer type names (and the short legacy ones) -> ours.
_LAYER_TYPES = {
    "linear_attention": "linear",
    "full_attention": "attention",
    "linear": "linear",
    "attention": "attention",
}


def _model_type(config: Mapping[str, Any]) -> str | None:
    mt = config.get("model_type")
    if mt is None and config.get("architectures"):
        arch = config["architectures"][0]
        mt = {
            "Qwen3_5ForCausalLM": TEXT_MODEL_TYPE,
            "Qwen3_5ForConditionalGeneration": COMPOSITE_MODEL_TYPE,
        }.get(arch)
    return mt


def text_config(config: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """The text part of an HF config and the checkpoint kind (``model_type``).

    Raises:
      NotImplementedError: an MoE model type.
      ValueError: an unknown model type.
    """
    mt = _model_type(config)
    text = config.get("text_config")
    text_mt = text.get("model_type") if isinstance(text, Mapping) else None
    for t in (mt, text_mt):
        if t in MOE_MODEL_TYPES:
            raise NotImplementedError(
                f"model_type {t!r} is a mixture-of-experts model: gdn_jax's HybridLM has a dense "
                "SwiGLU MLP only (supported: 'qwen3_5_text', 'qwen3_5')"
            )
    if mt == COMPOSITE_MODEL_TYPE or (mt is None and isinstance(text, Mapping)):
        if not isinstance(text, Mapping):
            raise ValueError(f"model_type {mt!r} config lacks a 'text_config' mapping")
        merged = dict(text)
        # The composite config owns the LM head: its tie flag wins where it has one.
        if "tie_word_embeddings" in config:
            merged["tie_word_embeddings"] = config["tie_word_embeddings"]
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if merged.get(key) is None and config.get(key) is not None:
                merged[key] = config[key]
        return merged, COMPOSITE_MODEL_TYPE
    if mt in (TEXT_MODEL_TYPE, None):
        return dict(config), TEXT_MODEL_TYPE
    raise ValueError(
        f"config model_type={mt!r}: expected {TEXT_MODEL_TYPE!r} (Qwen3_5ForCausalLM) or "
        f"{COMPOSITE_MODEL_TYPE!r} (Qwen3_5ForConditionalGeneration)"
    )


def _rope(c: Mapping[str, Any]) -> tuple[float, float]:
    params = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"rope_parameters={params!r}: expected a mapping")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise NotImplementedError(
            f"rope_parameters rope_type={rope_type!r}: only 'default' RoPE is implemented"
        )
    theta = params.get("rope_theta", c.get("rope_theta", _DEFAULT_ROPE_THETA))
    factor = params.get(
        "partial_rotary_factor", c.get("partial_rotary_factor", _DEFAULT_PARTIAL_ROTARY)
    )
    return float(theta), float(factor)


def config_from_hf(cls, config: Mapping[str, Any], overrides: Mapping[str, Any]):
    """See :meth:`gdn_jax.models.HybridConfig.from_hf`."""
    if not isinstance(config, Mapping):
        raise ValueError(f"config: expected a mapping (config.json); got {type(config).__name__}")
    text, _ = text_config(config)
    c = {**_DEFAULTS, **{k: v for k, v in text.items() if v is not None}}
    if c["hidden_act"] != "silu":
        raise NotImplementedError(f"hidden_act={c['hidden_act']!r}: only 'silu' is implemented")
    if c["attention_bias"]:
        raise NotImplementedError("attention_bias=True: the attention projections have no bias")
    if c.get("attn_output_gate", True) is False:
        raise NotImplementedError("attn_output_gate=False: Qwen3.5 attention is always gated")
    if c.get("mlp_only_layers"):
        raise NotImplementedError(f"mlp_only_layers={c['mlp_only_layers']}: not implemented")
    theta, factor = _rope(c)
    head_dim = int(c["head_dim"])
    rotary = int(head_dim * factor)
    if rotary % 2:
        raise NotImplementedError(
            f"int(head_dim * partial_rotary_factor) = int({head_dim} * {factor}) = {rotary} is "
            "odd: rotary dims rotate in pairs"
        )
    n = int(c["num_hidden_layers"])
    interval = int(c.get("full_attention_interval") or 4)
    if c.get("layer_types") is not None:
        types = list(c["layer_types"])
        bad = [t for t in types if t not in _LAYER_TYPES]
        if bad or len(types) != n:
            raise ValueError(
                f"layer_types={types}: expected {n} (num_hidden_layers) entries of "
                f"'linear_attention' or 'full_attention'"
            )
        pattern = tuple(_LAYER_TYPES[t] for t in types)
    else:
        pattern = tuple("linear" if (i + 1) % interval else "attention" for i in range(n))
    by_interval = tuple("linear" if (i + 1) % interval else "attention" for i in range(n))
    eos = c.get("eos_token_id")
    fields = dict(
        vocab_size=int(c["vocab_size"]),
        hidden_size=int(c["hidden_size"]),
        num_layers=n,
        intermediate_size=int(c["intermediate_size"]),
        linear_num_heads=int(c["linear_num_key_heads"]),
        linear_num_v_heads=int(c["linear_num_value_heads"]),
        linear_head_dim=int(c["linear_key_head_dim"]),
        linear_v_head_dim=int(c["linear_value_head_dim"]),
        attn_num_heads=int(c["num_attention_heads"]),
        attn_num_kv_heads=int(c["num_key_value_heads"]),
        attn_head_dim=head_dim,
        partial_rotary_factor=factor,
        rope_theta=theta,
        full_attention_interval=interval,
        variant="gdn",
        conv_kernel=int(c["linear_conv_kernel_dim"]),
        norm_eps=float(c["rms_norm_eps"]),
        tie_embeddings=bool(c["tie_word_embeddings"]),
        layer_pattern=None if pattern == by_interval else pattern,
        zero_centered_norm=True,
        max_position_embeddings=int(c["max_position_embeddings"]),
        bos_token_id=c.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list | tuple) else eos,
        pad_token_id=c.get("pad_token_id"),
    )
    fields.update(overrides)
    return cls(**fields)


def config_to_hf(config) -> dict[str, Any]:
    """See :meth:`gdn_jax.models.HybridConfig.to_hf`."""
    c = config
    if c.variant != "gdn":
        raise NotImplementedError(f"variant={c.variant!r}: Qwen3.5 linear layers are 'gdn'")
    if not c.zero_centered_norm:
        raise NotImplementedError(
            "zero_centered_norm=False: Qwen3.5's RMSNorms scale by 1 + weight; build the model "
            "with zero_centered_norm=True to save it in HF format"
        )
    types = {"linear": "linear_attention", "attention": "full_attention"}
    out: dict[str, Any] = dict(
        architectures=["Qwen3_5ForCausalLM"],
        model_type=TEXT_MODEL_TYPE,
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.attn_num_heads,
        num_key_value_heads=c.attn_num_kv_heads,
        head_dim=c.attn_head_dim,
        hidden_act="silu",
        attention_bias=False,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.norm_eps,
        tie_word_embeddings=c.tie_embeddings,
        linear_conv_kernel_dim=c.conv_kernel,
        linear_key_head_dim=c.linear_head_dim,
        linear_value_head_dim=c.linear_v_head_dim,
        linear_num_key_heads=c.linear_num_heads,
        linear_num_value_heads=c.linear_num_v_heads,
        layer_types=[types[t] for t in c.layer_types],
        rope_parameters=dict(
            rope_type="default",
            rope_theta=c.rope_theta,
            partial_rotary_factor=c.partial_rotary_factor,
        ),
    )
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(c, key)
        if value is not None:
            out[key] = list(value) if isinstance(value, tuple) else value
    return out
