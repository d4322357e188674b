"""Every caller mistake raises a ValueError naming the argument and what was expected."""

import jax.numpy as jnp
import numpy as np
import pytest

import gdn_jax

B, T, H, HV, K, V = 1, 8, 2, 4, 8, 8
f32 = jnp.float32


def base(**over):
    a = dict(
        q=jnp.zeros((B, T, H, K), f32),
        k=jnp.zeros((B, T, H, K), f32),
        v=jnp.zeros((B, T, HV, V), f32),
        g=jnp.zeros((B, T, HV), f32),
        beta=jnp.zeros((B, T, HV), f32),
    )
    a.update(over)
    return a


def call(kw=None, **over):
    a = base(**over)
    return gdn_jax.gated_delta_rule(
        a["q"], a["k"], a["v"], a["g"], a["beta"], implementation="xla", **(kw or {})
    )


@pytest.mark.parametrize(
    "over,match",
    [
        (dict(q=jnp.zeros((B, T, K), f32)), "q must be 4-D"),
        (dict(k=jnp.zeros((B, T, H, K + 1), f32)), "q and k must have the same shape"),
        (dict(v=jnp.zeros((B, T + 1, HV, V), f32)), "v must be"),
        (dict(v=jnp.zeros((B, T, 3, V), f32)), "multiple of q/k heads"),
        (dict(q=jnp.zeros((B, T, H, K), jnp.int32)), "q must be bf16, f16 or f32"),
        (dict(v=jnp.zeros((B, T, HV, V), jnp.bfloat16)), "share one dtype"),
        (dict(g=jnp.zeros((B, T, H), f32)), r"g must have shape \(1, 8, 4\)"),
        (dict(beta=jnp.zeros((B, T, HV, 1), f32)), "beta must have shape"),
        (dict(g=jnp.zeros((B, T, HV), jnp.int32)), "g must be f32"),
    ],
)
def test_bad_tensors(over, match):
    with pytest.raises(ValueError, match=match):
        call(**over)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(initial_state=jnp.zeros((2, HV, K, V), f32)), "initial_state must have shape"),
        (
            dict(initial_state=jnp.zeros((B, HV, K, V), jnp.bfloat16)),
            "initial_state must be float32",
        ),
        (dict(chunk_size=48), "chunk_size must be one of"),
        (dict(cu_seqlens=np.array([0, 4, 8], np.int64)), "cu_seqlens must be int32"),
        (dict(cu_seqlens=jnp.array([1, 4, 8], jnp.int32)), "must start at 0"),
        (dict(cu_seqlens=jnp.array([0, 6, 4, 8], jnp.int32)), "non-decreasing"),
        (dict(cu_seqlens=jnp.array([0, 4, 7], jnp.int32)), "must end at T"),
        (dict(cu_seqlens=jnp.array([[0, 8]], jnp.int32)), "cu_seqlens must be 1-D"),
    ],
)
def test_bad_options(kw, match):
    with pytest.raises(ValueError, match=match):
        call(kw)


def test_cu_seqlens_requires_batch_one():
    a = base(
        q=jnp.zeros((2, T, H, K), f32),
        k=jnp.zeros((2, T, H, K), f32),
        v=jnp.zeros((2, T, HV, V), f32),
        g=jnp.zeros((2, T, HV), f32),
        beta=jnp.zeros((2, T, HV), f32),
    )
    with pytest.raises(ValueError, match="requires B == 1"):
        gdn_jax.gated_delta_rule(*a.values(), cu_seqlens=jnp.array([0, 8], jnp.int32))


def test_channel_gate_shapes():
    a = base()
    with pytest.raises(ValueError, match=r"g must have shape \(1, 8, 4, 8\)"):
        gdn_jax.kda(a["q"], a["k"], a["v"], a["g"], a["beta"])
    g = jnp.zeros((B, T, HV, K), f32)
    with pytest.raises(ValueError, match=r"w must have shape \(1, 8, 4, 8\)"):
        gdn_jax.gdn2(a["q"], a["k"], a["v"], g, g, jnp.zeros((B, T, HV), f32))
    with pytest.raises(ValueError, match="b must have shape"):
        gdn_jax.gdn2(a["q"], a["k"], a["v"], g, a["beta"], jnp.zeros((B, T, HV, V), f32))


def test_step_state_checked():
    a = base()
    with pytest.raises(ValueError, match="state must have shape"):
        gdn_jax.gated_delta_rule_step(*a.values(), jnp.zeros((B, HV, K, V + 1), f32))
    with pytest.raises(ValueError, match="state must be float32"):
        gdn_jax.gated_delta_rule_step(*a.values(), jnp.zeros((B, HV, K, V), jnp.bfloat16))
