"""HF Qwen3-Next / Qwen3.5 linear_attn weights -> GatedDeltaNet, checked against a NumPy HF forward.

The NumPy forward below is written from the HF layer's equations (Qwen3NextGatedDeltaNet /
Qwen3_5GatedDeltaNet): fused or split input projections, depthwise causal conv + SiLU over the
concatenated q|k|v channels, L2-normalised q/k repeated to the value heads, gates, the
token-by-token delta rule, the gated RMSNorm and the output projection. It shares no code with
gdn_jax.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from gdn_jax.convert import gated_deltanet_from_hf

CONFIG = dict(
    hidden_size=48,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=6,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _softplus(x):
    return np.logaddexp(0.0, x)


def _l2norm(x):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def hf_forward(sd, cfg, x, layout):
    """The HF linear_attn forward in float64 NumPy; x [B, T, D] -> [B, T, D]."""
    B, T, D = x.shape
    H, HV = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    K, V = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    W, eps = cfg["linear_conv_kernel_dim"], cfg["rms_norm_eps"]
    r = HV // H
    if layout == "qwen3_next":
        # fix_query_key_value_ordering: view [..., H, 2K + 2rV] then split q, k, v, z per key head.
        qkvz = (x @ sd["in_proj_qkvz.weight"].T).reshape(B, T, H, 2 * K + 2 * r * V)
        q = qkvz[..., :K]
        k = qkvz[..., K : 2 * K]
        v = qkvz[..., 2 * K : 2 * K + r * V].reshape(B, T, HV, V)
        z = qkvz[..., 2 * K + r * V :].reshape(B, T, HV, V)
        ba = (x @ sd["in_proj_ba.weight"].T).reshape(B, T, H, 2 * r)
        b, a = ba[..., :r].reshape(B, T, HV), ba[..., r:].reshape(B, T, HV)
        mixed = np.concatenate(
            [q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], axis=-1
        )
    else:
        mixed = x @ sd["in_proj_qkv.weight"].T
        z = (x @ sd["in_proj_z.weight"].T).reshape(B, T, HV, V)
        b = x @ sd["in_proj_b.weight"].T
        a = x @ sd["in_proj_a.weight"].T
    # Conv1d(groups=C, padding=W-1) truncated to T outputs: out[t] = sum_j w[c, j] x[t - W + 1 + j].
    w = sd["conv1d.weight"][:, 0, :]
    xp = np.concatenate([np.zeros((B, W - 1, mixed.shape[-1])), mixed], axis=1)
    conv = sum(xp[:, j : j + T] * w[:, j] for j in range(W))
    mixed = _silu(conv)
    q = mixed[..., : H * K].reshape(B, T, H, K)
    k = mixed[..., H * K : 2 * H * K].reshape(B, T, H, K)
    v = mixed[..., 2 * H * K :].reshape(B, T, HV, V)
    beta = 1.0 / (1.0 + np.exp(-b))
    g = -np.exp(sd["A_log"]) * _softplus(a + sd["dt_bias"])
    q, k = _l2norm(q), _l2norm(k)
    q, k = np.repeat(q, r, axis=2), np.repeat(k, r, axis=2)  # repeat_interleave over heads
    scale = K**-0.5
    o = np.zeros((B, T, HV, V))
    for bb in range(B):
        for h in range(HV):
            S = np.zeros((K, V))
            for t in range(T):
                S = S * np.exp(g[bb, t, h])
                kv_mem = S.T @ k[bb, t, h]
                delta = (v[bb, t, h] - kv_mem) * beta[bb, t, h]
                S = S + np.outer(k[bb, t, h], delta)
                o[bb, t, h] = S.T @ q[bb, t, h] * scale
    # Qwen3NextRMSNormGated: weight * x / rms(x) * silu(z).
    o = o / np.sqrt((o * o).mean(-1, keepdims=True) + eps) * sd["norm.weight"] * _silu(z)
    return o.reshape(B, T, HV * V) @ sd["out_proj.weight"].T


def random_state_dict(cfg, layout, seed=0):
    rng = np.random.default_rng(seed)
    D, H, HV = cfg["hidden_size"], cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    K, V, W = (
        cfg["linear_key_head_dim"],
        cfg["linear_value_head_dim"],
        cfg["linear_conv_kernel_dim"],
    )

    def lin(out, inp):
        return rng.normal(0, inp**-0.5, (out, inp)).astype(np.float32)

    sd = {
        "conv1d.weight": rng.uniform(-0.5, 0.5, (2 * H * K + HV * V, 1, W)).astype(np.float32),
        "A_log": np.log(rng.uniform(1, 16, HV)).astype(np.float32),
        "dt_bias": rng.normal(0, 1, HV).astype(np.float32),
        "norm.weight": rng.uniform(0.5, 1.5, V).astype(np.float32),
        "out_proj.weight": lin(D, HV * V),
    }
    if layout == "qwen3_next":
        sd["in_proj_qkvz.weight"] = lin(2 * H * K + 2 * HV * V, D)
        sd["in_proj_ba.weight"] = lin(2 * HV, D)
    else:
        sd["in_proj_qkv.weight"] = lin(2 * H * K + HV * V, D)
        sd["in_proj_z.weight"] = lin(HV * V, D)
        sd["in_proj_b.weight"] = lin(HV, D)
        sd["in_proj_a.weight"] = lin(HV, D)
    return sd


@pytest.mark.parametrize("layout", ["qwen3_next", "qwen3_5"])
def test_matches_numpy_hf_forward(layout):
    sd = random_state_dict(CONFIG, layout)
    x = np.random.default_rng(1).normal(0, 1, (2, 13, CONFIG["hidden_size"]))
    want = hf_forward({k: v.astype(np.float64) for k, v in sd.items()}, CONFIG, x, layout)
    layer = gated_deltanet_from_hf(sd, CONFIG, layout=layout)
    got = np.asarray(layer(jnp.asarray(x, jnp.float32)))
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


def test_prefixed_keys_and_attribute_config():
    class Cfg:
        pass

    cfg = Cfg()
    cfg.__dict__.update(CONFIG)
    sd = random_state_dict(CONFIG, "qwen3_5")
    prefixed = {f"model.layers.0.linear_attn.{k}": v for k, v in sd.items()}
    x = jnp.ones((1, 5, CONFIG["hidden_size"]))
    a = gated_deltanet_from_hf(prefixed, cfg, layout="qwen3_5")(x)
    b = gated_deltanet_from_hf(sd, CONFIG, layout="qwen3_5")(x)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_layouts_differ_only_by_ordering():
    # Re-pack a qwen3_5 dict into the fused qwen3_next layout; both must give the same layer.
    cfg = CONFIG
    H, HV = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    K, V, D = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["hidden_size"]
    r = HV // H
    sd = random_state_dict(cfg, "qwen3_5")
    q, k, v = np.split(sd["in_proj_qkv.weight"], [H * K, 2 * H * K])
    z = sd["in_proj_z.weight"]
    groups = [
        np.concatenate(
            [
                q.reshape(H, K, D)[h],
                k.reshape(H, K, D)[h],
                v.reshape(H, r * V, D)[h],
                z.reshape(H, r * V, D)[h],
            ]
        )
        for h in range(H)
    ]
    ba = [
        np.concatenate(
            [sd["in_proj_b.weight"].reshape(H, r, D)[h], sd["in_proj_a.weight"].reshape(H, r, D)[h]]
        )
        for h in range(H)
    ]
    fused = {key: sd[key] for key in ("conv1d.weight", "A_log", "dt_bias", "norm.weight")}
    fused["out_proj.weight"] = sd["out_proj.weight"]
    fused["in_proj_qkvz.weight"] = np.concatenate(groups)
    fused["in_proj_ba.weight"] = np.concatenate(ba)
    x = jnp.asarray(np.random.default_rng(2).normal(0, 1, (1, 7, D)), jnp.float32)
    a = gated_deltanet_from_hf(sd, cfg, layout="qwen3_5")(x)
    b = gated_deltanet_from_hf(fused, cfg, layout="qwen3_next")(x)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_inputs():
    sd = random_state_dict(CONFIG, "qwen3_5")
    with pytest.raises(ValueError, match="layout"):
        gated_deltanet_from_hf(sd, CONFIG, layout="megatron")
    with pytest.raises(ValueError, match="in_proj_qkvz"):
        gated_deltanet_from_hf(sd, CONFIG, layout="qwen3_next")
    with pytest.raises(ValueError, match="expected"):
        gated_deltanet_from_hf(sd, dict(CONFIG, linear_value_head_dim=5), layout="qwen3_5")
    with pytest.raises(ValueError, match="linear_num_key_heads"):
        gated_deltanet_from_hf(sd, {"hidden_size": 48}, layout="qwen3_5")
