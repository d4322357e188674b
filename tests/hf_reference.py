"""A float64 NumPy forward of Hugging Face's Qwen3.5 text model, written from the equations of
transformers 5.17's ``modeling_qwen3_5.py`` (Qwen3_5TextModel / Qwen3_5ForCausalLM); it shares no
code with gdn_jax. Also: random checkpoints in HF's key layout, written with safetensors.

- ``Qwen3_5RMSNorm``: ``x / sqrt(mean(x²) + eps) · (1 + w)`` (decoder, final, q/k norms).
- ``Qwen3_5RMSNormGated`` (GDN output): ``w · x / sqrt(mean(x²) + eps) · silu(z)``.
- Attention: ``q_proj`` gives ``[B, T, N, 2·Dh]`` split into query and gate per head; q/k
  RMSNorm per head; RoPE on the first ``int(Dh · partial_rotary_factor)`` dims with the
  multimodal (interleaved mrope) recomposition of three position streams; GQA by
  ``repeat_kv``; softmax(q kᵀ / sqrt(Dh) + causal) v; output ``· sigmoid(gate)``; ``o_proj``.
- GatedDeltaNet: ``in_proj_qkv`` → causal depthwise conv + SiLU → q, k, v; ``g = −exp(A_log) ·
  softplus(a + dt_bias)``, ``β = sigmoid(b)``; L2-normalised q/k repeated to the value heads;
  the delta rule token by token; gated RMSNorm; ``out_proj``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# ---------------------------------------------------------------------------------------------
# Config helpers
# ---------------------------------------------------------------------------------------------


def text_part(config: dict) -> tuple[dict, str, bool]:
    """(text config, decoder key prefix, tied) of a CausalLM or ConditionalGeneration config."""
    if config.get("model_type") == "qwen3_5":
        text = config["text_config"]
        tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        return text, "model.language_model.", bool(tied)
    return config, "model.", bool(config.get("tie_word_embeddings", False))


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every text-model tensor of a Qwen3.5 checkpoint with its HF shape."""
    c, body, tied = text_part(config)
    D, I, Vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    N, NKV, Dh = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    H, HV = c["linear_num_key_heads"], c["linear_num_value_heads"]
    K, V, W = c["linear_key_head_dim"], c["linear_value_head_dim"], c["linear_conv_kernel_dim"]
    out = {body + "embed_tokens.weight": (Vocab, D), body + "norm.weight": (D,)}
    for i, kind in enumerate(c["layer_types"]):
        p = f"{body}layers.{i}."
        out[p + "input_layernorm.weight"] = (D,)
        out[p + "post_attention_layernorm.weight"] = (D,)
        out[p + "mlp.gate_proj.weight"] = (I, D)
        out[p + "mlp.up_proj.weight"] = (I, D)
        out[p + "mlp.down_proj.weight"] = (D, I)
        if kind == "full_attention":
            a = p + "self_attn."
            out[a + "q_proj.weight"] = (2 * N * Dh, D)
            out[a + "k_proj.weight"] = (NKV * Dh, D)
            out[a + "v_proj.weight"] = (NKV * Dh, D)
            out[a + "o_proj.weight"] = (D, N * Dh)
            out[a + "q_norm.weight"] = (Dh,)
            out[a + "k_norm.weight"] = (Dh,)
        else:
            a = p + "linear_attn."
            out[a + "in_proj_qkv.weight"] = (2 * H * K + HV * V, D)
            out[a + "in_proj_z.weight"] = (HV * V, D)
            out[a + "in_proj_b.weight"] = (HV, D)
            out[a + "in_proj_a.weight"] = (HV, D)
            out[a + "conv1d.weight"] = (2 * H * K + HV * V, 1, W)
            out[a + "A_log"] = (HV,)
            out[a + "dt_bias"] = (HV,)
            out[a + "norm.weight"] = (V,)
            out[a + "out_proj.weight"] = (D, HV * V)
    if not tied:
        out["lm_head.weight"] = (Vocab, D)
    return out


def random_tensors(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random f32 weights with realistic ranges for every text tensor of ``config``."""
    rng = np.random.default_rng(seed)
    out = {}
    for key, shape in tensor_shapes(config).items():
        name = key.rsplit(".", 2)[-2] if key.endswith(".weight") else key.rsplit(".", 1)[-1]
        if key.endswith("A_log"):
            x = np.log(rng.uniform(1, 16, shape))
        elif key.endswith("dt_bias"):
            x = rng.normal(0, 1, shape)
        elif key.endswith("linear_attn.norm.weight"):
            x = rng.uniform(0.5, 1.5, shape)  # the gated norm multiplies directly
        elif "norm" in name:
            x = rng.normal(0, 0.2, shape)  # zero-centred norms: scale 1 + w
        elif name == "conv1d":
            x = rng.uniform(-0.5, 0.5, shape)
        elif name == "embed_tokens":
            x = rng.normal(0, 1, shape)
        else:
            x = rng.normal(0, shape[-1] ** -0.5, shape)
        out[key] = x.astype(np.float32)
    return out


def write_checkpoint(
    path: Path, config: dict, tensors: dict[str, np.ndarray], *, shards: int = 1
) -> Path:
    """Write ``config.json`` and the tensors as HF does: one ``model.safetensors`` or ``shards``
    files with ``model.safetensors.index.json``."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    keys = list(tensors)
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    weight_map = {}
    for i, part in enumerate(np.array_split(np.arange(len(keys)), shards)):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        chunk = {keys[j]: tensors[keys[j]] for j in part}
        save_file(chunk, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, name))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


# ---------------------------------------------------------------------------------------------
# The forward
# ---------------------------------------------------------------------------------------------


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _rms(x, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def _l2norm(x):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def rope_cos_sin(c: dict, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3_5TextRotaryEmbedding: cos, sin [B, T, rotary_dim] from [3, B, T] positions
    (temporal, height, width streams), interleaved mrope recomposition."""
    rope = c.get("rope_parameters") or {}
    theta = rope.get("rope_theta", c.get("rope_theta", 10_000.0))
    factor = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25))
    section = rope.get("mrope_section", [11, 11, 10])
    dim = int(c["head_dim"] * factor)
    inv_freq = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    freqs = positions[..., None].astype(np.float64) * inv_freq  # [3, B, T, dim / 2]
    thw = freqs[0].copy()
    for stream, offset in ((1, 1), (2, 2)):
        idx = slice(offset, section[stream] * 3, 3)
        thw[..., idx] = freqs[stream][..., idx]
    emb = np.concatenate([thw, thw], axis=-1)
    return np.cos(emb), np.sin(emb)


def _rotate_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def _attention(sd, p, c, x, cos, sin):
    B, T, _ = x.shape
    N, NKV, Dh = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    eps = c["rms_norm_eps"]
    qg = (x @ sd[p + "q_proj.weight"].T).reshape(B, T, N, 2 * Dh)
    q, gate = qg[..., :Dh], qg[..., Dh:].reshape(B, T, N * Dh)
    q = _rms(q, eps) * (1.0 + sd[p + "q_norm.weight"])
    k = (x @ sd[p + "k_proj.weight"].T).reshape(B, T, NKV, Dh)
    k = _rms(k, eps) * (1.0 + sd[p + "k_norm.weight"])
    v = (x @ sd[p + "v_proj.weight"].T).reshape(B, T, NKV, Dh)
    r = cos.shape[-1]
    cs, sn = cos[:, :, None], sin[:, :, None]
    q = np.concatenate([q[..., :r] * cs + _rotate_half(q[..., :r]) * sn, q[..., r:]], axis=-1)
    k = np.concatenate([k[..., :r] * cs + _rotate_half(k[..., :r]) * sn, k[..., r:]], axis=-1)
    # repeat_kv: kv head j serves query heads j·g .. j·g + g − 1.
    g = N // NKV
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    scores = np.einsum("btnd,bsnd->bnts", q, k) * Dh**-0.5
    scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
    scores = np.exp(scores - scores.max(-1, keepdims=True))
    probs = scores / scores.sum(-1, keepdims=True)
    o = np.einsum("bnts,bsnd->btnd", probs, v).reshape(B, T, N * Dh)
    return (o * _sigmoid(gate)) @ sd[p + "o_proj.weight"].T


def linear_attention(sd: dict, p: str, c: dict, x: np.ndarray) -> np.ndarray:
    """Qwen3_5GatedDeltaNet (no cache): x [B, T, D] -> [B, T, D]; ``p`` prefixes the keys."""
    B, T, _ = x.shape
    H, HV = c["linear_num_key_heads"], c["linear_num_value_heads"]
    K, V = c["linear_key_head_dim"], c["linear_value_head_dim"]
    W, eps = c["linear_conv_kernel_dim"], c["rms_norm_eps"]
    mixed = x @ sd[p + "in_proj_qkv.weight"].T
    z = (x @ sd[p + "in_proj_z.weight"].T).reshape(B, T, HV, V)
    b = x @ sd[p + "in_proj_b.weight"].T
    a = x @ sd[p + "in_proj_a.weight"].T
    # Conv1d(groups=C, padding=W-1) truncated to T outputs, then SiLU.
    w = sd[p + "conv1d.weight"][:, 0, :]
    xp = np.concatenate([np.zeros((B, W - 1, mixed.shape[-1])), mixed], axis=1)
    mixed = _silu(sum(xp[:, j : j + T] * w[:, j] for j in range(W)))
    q = mixed[..., : H * K].reshape(B, T, H, K)
    k = mixed[..., H * K : 2 * H * K].reshape(B, T, H, K)
    v = mixed[..., 2 * H * K :].reshape(B, T, HV, V)
    beta = _sigmoid(b)
    g = -np.exp(sd[p + "A_log"]) * np.logaddexp(0.0, a + sd[p + "dt_bias"])
    q, k = np.repeat(_l2norm(q), HV // H, axis=2), np.repeat(_l2norm(k), HV // H, axis=2)
    q = q * K**-0.5
    S = np.zeros((B, HV, K, V))
    o = np.zeros((B, T, HV, V))
    for t in range(T):
        S = S * np.exp(g[:, t])[..., None, None]
        mem = np.einsum("bhkv,bhk->bhv", S, k[:, t])
        delta = (v[:, t] - mem) * beta[:, t, :, None]
        S = S + k[:, t, :, :, None] * delta[:, :, None, :]
        o[:, t] = np.einsum("bhkv,bhk->bhv", S, q[:, t])
    o = _rms(o, eps) * sd[p + "norm.weight"] * _silu(z)
    return o.reshape(B, T, HV * V) @ sd[p + "out_proj.weight"].T


def forward(config: dict, tensors: dict[str, np.ndarray], ids: np.ndarray) -> np.ndarray:
    """Logits [B, T, vocab] (float64) of Qwen3_5ForCausalLM / ForConditionalGeneration on text.

    Args:
      config: the checkpoint's config.json (all keys present).
      tensors: HF key -> array.
      ids: [B, T] token ids.
    """
    c, body, tied = text_part(config)
    sd = {k: np.asarray(v, np.float64) for k, v in tensors.items()}
    B, T = ids.shape
    eps = c["rms_norm_eps"]
    x = sd[body + "embed_tokens.weight"][ids]
    # Text-only inputs: all three mrope streams are the token index.
    positions = np.broadcast_to(np.arange(T), (3, B, T))
    cos, sin = rope_cos_sin(c, positions)
    for i, kind in enumerate(c["layer_types"]):
        p = f"{body}layers.{i}."
        h = _rms(x, eps) * (1.0 + sd[p + "input_layernorm.weight"])
        if kind == "full_attention":
            h = _attention(sd, p + "self_attn.", c, h, cos, sin)
        else:
            h = linear_attention(sd, p + "linear_attn.", c, h)
        x = x + h
        h = _rms(x, eps) * (1.0 + sd[p + "post_attention_layernorm.weight"])
        gate = h @ sd[p + "mlp.gate_proj.weight"].T
        up = h @ sd[p + "mlp.up_proj.weight"].T
        x = x + (_silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    x = _rms(x, eps) * (1.0 + sd[body + "norm.weight"])
    head = sd[body + "embed_tokens.weight"] if tied else sd["lm_head.weight"]
    return x @ head.T


def cross_entropy(logits: np.ndarray, targets: np.ndarray) -> float:
    """Mean next-token cross-entropy (HF's loss with labels = targets, no ignored positions)."""
    m = logits.max(-1, keepdims=True)
    lse = np.log(np.exp(logits - m).sum(-1)) + m[..., 0]
    picked = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    return float(np.mean(lse - picked))
