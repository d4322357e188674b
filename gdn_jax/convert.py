"""Hugging Face weights -> :class:`gdn_jax.nn.GatedDeltaNet`.

One HF decoder layer's ``linear_attn`` module (Qwen3-Next or Qwen3.5) becomes one ``GatedDeltaNet``
(variant ``"gdn"``, ``use_qk_l2norm=True``) that computes what the HF layer computes. PyTorch
``Linear`` weights are ``[out, in]``; our kernels are ``[in, out]`` (transposed).

HF key (layout)                   -> gdn_jax parameter
in_proj_qkvz.weight (qwen3_next)  -> q_proj, k_proj, v_proj, z_proj kernels; rows grouped per key
                                     head h: [q (K) | k (K) | v (r·V) | z (r·V)], r = HV / H
in_proj_ba.weight (qwen3_next)    -> b_proj, a_proj; rows per key head [b (r) | a (r)]
in_proj_qkv.weight (qwen3_5)      -> q_proj, k_proj, v_proj; rows [q (H·K) | k (H·K) | v (HV·V)]
in_proj_{z,b,a}.weight (qwen3_5)  -> z_proj, b_proj, a_proj
conv1d.weight [2·H·K + HV·V, 1, W] -> q_conv, k_conv, v_conv weights [W, C] (channels q | k | v)
A_log, dt_bias [HV]               -> A_log, dt_bias
norm.weight [V]                   -> norm.weight (gated RMSNorm, multiplies directly)
out_proj.weight [D, HV·V]         -> out_proj kernel
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.typing import Dtype

from gdn_jax.nn.gated_deltanet import GatedDeltaNet

__all__ = ["gated_deltanet_from_hf", "Layout"]

Layout = Literal["qwen3_next", "qwen3_5"]

_KEYS = {
    "qwen3_next": ("in_proj_qkvz.weight", "in_proj_ba.weight"),
    "qwen3_5": ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"),
}
_COMMON_KEYS = ("conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight")


def _cfg(config: Any, name: str, default: Any = None) -> Any:
    value = (
        config.get(name, default) if isinstance(config, Mapping) else getattr(config, name, default)
    )
    if value is None:
        raise ValueError(f"config lacks {name!r}")
    return value


def _lookup(state_dict: Mapping[str, Any], name: str) -> np.ndarray:
    # Accept bare names ("A_log") and prefixed ones ("model.layers.0.linear_attn.A_log").
    hits = [k for k in state_dict if k == name or k.endswith("." + name)]
    if len(hits) != 1:
        raise ValueError(
            f"state_dict must hold exactly one key ending in {name!r}; found {hits or 'none'}"
        )
    return np.asarray(state_dict[hits[0]], dtype=np.float32)


def _expect(name: str, x: np.ndarray, shape: tuple[int, ...]) -> None:
    if x.shape != shape:
        raise ValueError(f"{name}: got shape {x.shape}, expected {shape} from the config")


def gated_deltanet_from_hf(
    state_dict: Mapping[str, Any],
    config: Any,
    *,
    layout: Layout,
    dtype: Dtype | None = None,
    param_dtype: Dtype = jnp.float32,
    chunk_size: int = 64,
    implementation: str | tuple[str, ...] | None = None,
) -> GatedDeltaNet:
    """Build a ``GatedDeltaNet`` from one HF layer's ``linear_attn`` weights.

    Args:
      state_dict: numpy arrays (or anything ``np.asarray`` takes) keyed by HF names, bare
        (``"in_proj_qkvz.weight"``) or with a prefix (``"model.layers.0.linear_attn.A_log"``).
      config: the HF text config, as a mapping or an object with attributes ``hidden_size``,
        ``linear_num_key_heads``, ``linear_num_value_heads``, ``linear_key_head_dim``,
        ``linear_value_head_dim``, ``linear_conv_kernel_dim`` (default 4), ``rms_norm_eps``
        (default 1e-6).
      layout: ``"qwen3_next"`` (fused ``in_proj_qkvz`` / ``in_proj_ba``, interleaved per key-head
        group) or ``"qwen3_5"`` (separate ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
        ``in_proj_a``).
      dtype, param_dtype, chunk_size, implementation: as for :class:`GatedDeltaNet`.
    Returns:
      The layer with the HF weights.
    """
    if layout not in _KEYS:
        raise ValueError(f"{layout=}: expected one of {tuple(_KEYS)}")
    D = int(_cfg(config, "hidden_size"))
    H = int(_cfg(config, "linear_num_key_heads"))
    HV = int(_cfg(config, "linear_num_value_heads"))
    K = int(_cfg(config, "linear_key_head_dim"))
    V = int(_cfg(config, "linear_value_head_dim"))
    W = int(_cfg(config, "linear_conv_kernel_dim", 4))
    eps = float(_cfg(config, "rms_norm_eps", 1e-6))
    if HV % H:
        raise ValueError(f"linear_num_value_heads={HV} must be a multiple of {H=}")
    r = HV // H
    sd = {name: _lookup(state_dict, name) for name in _KEYS[layout] + _COMMON_KEYS}

    if layout == "qwen3_next":
        qkvz = sd["in_proj_qkvz.weight"]
        _expect("in_proj_qkvz.weight", qkvz, (H * (2 * K + 2 * r * V), D))
        qkvz = qkvz.reshape(H, 2 * K + 2 * r * V, D)
        q, k, v, z = np.split(qkvz, [K, 2 * K, 2 * K + r * V], axis=1)
        # Within a key head, value heads j = 0..r-1 are consecutive: global value head h * r + j.
        q, k = q.reshape(H * K, D), k.reshape(H * K, D)
        v, z = v.reshape(HV * V, D), z.reshape(HV * V, D)
        ba = sd["in_proj_ba.weight"]
        _expect("in_proj_ba.weight", ba, (2 * HV, D))
        b, a = np.split(ba.reshape(H, 2 * r, D), [r], axis=1)
        b, a = b.reshape(HV, D), a.reshape(HV, D)
    else:
        qkv = sd["in_proj_qkv.weight"]
        _expect("in_proj_qkv.weight", qkv, (2 * H * K + HV * V, D))
        q, k, v = np.split(qkv, [H * K, 2 * H * K], axis=0)
        z, b, a = sd["in_proj_z.weight"], sd["in_proj_b.weight"], sd["in_proj_a.weight"]
        _expect("in_proj_z.weight", z, (HV * V, D))
        _expect("in_proj_b.weight", b, (HV, D))
        _expect("in_proj_a.weight", a, (HV, D))

    conv = sd["conv1d.weight"]
    _expect("conv1d.weight", conv, (2 * H * K + HV * V, 1, W))
    conv_q, conv_k, conv_v = np.split(conv[:, 0, :].T, [H * K, 2 * H * K], axis=1)
    for name, shape in (("A_log", (HV,)), ("dt_bias", (HV,)), ("norm.weight", (V,))):
        _expect(name, sd[name], shape)
    _expect("out_proj.weight", sd["out_proj.weight"], (D, HV * V))

    pure = {
        "q_proj": {"kernel": q.T},
        "k_proj": {"kernel": k.T},
        "v_proj": {"kernel": v.T},
        "z_proj": {"kernel": z.T},
        "b_proj": {"kernel": b.T},
        "a_proj": {"kernel": a.T},
        "q_conv": {"weight": conv_q},
        "k_conv": {"weight": conv_k},
        "v_conv": {"weight": conv_v},
        "A_log": sd["A_log"],
        "dt_bias": sd["dt_bias"],
        "norm": {"weight": sd["norm.weight"]},
        "out_proj": {"kernel": sd["out_proj.weight"].T},
    }

    # Build abstractly (no random init of weights we overwrite), then fill in the HF values.
    abstract = nnx.eval_shape(
        lambda: GatedDeltaNet(
            D,
            num_heads=H,
            head_dim=K,
            num_v_heads=HV,
            v_head_dim=V,
            variant="gdn",
            conv_kernel=W,
            norm_eps=eps,
            use_qk_l2norm=True,
            chunk_size=chunk_size,
            implementation=implementation,
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=nnx.Rngs(0),
        )
    )
    graphdef, state = nnx.split(abstract)
    pure = {
        name: (
            {p: jnp.asarray(x, param_dtype) for p, x in value.items()}
            if isinstance(value, dict)
            else jnp.asarray(value, param_dtype)
        )
        for name, value in pure.items()
    }
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)
