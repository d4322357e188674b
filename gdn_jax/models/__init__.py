"""A small hybrid LM (GDN layers + gated softmax attention every 4th layer) and its presets."""

from gdn_jax.models.attention import GatedAttention, KVCache
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
    "get_config",
]
