"""A hybrid LM (GDN layers + gated softmax attention; Qwen3.5 configs), its presets, generation."""

from gdn_jax.models.attention import GatedAttention, KVCache
from gdn_jax.models.generation import generate, sample_logits
from gdn_jax.models.hybrid import (
    PRESETS,
    DecoderLayer,
    HybridCache,
    HybridConfig,
    HybridLM,
    SwiGLU,
    get_config,
)

__all__ = [
    "DecoderLayer",
    "GatedAttention",
    "KVCache",
    "HybridCache",
    "HybridConfig",
    "HybridLM",
    "PRESETS",
    "SwiGLU",
    "generate",
    "get_config",
    "sample_logits",
]
