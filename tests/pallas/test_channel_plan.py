"""The channel-decay kernels' plan (:mod:`pallas_kernels.channel.plan`): the form of every stage
for each (dtype, K, V, variant, A stored), and what the kernels refuse. CPU only, no tracing."""

from __future__ import annotations

import dataclasses
import itertools

import jax.numpy as jnp
import pytest

from pallas_kernels import _compat as pk
from pallas_kernels.channel.plan import ChannelPlan, channel_plan, check_supported

# (dtype, K, V, variant, store_a) -> (dq/dk/dw form, WY K-split), written out
EXPECTED = {
    # bf16: K-split backward at K = V = 128
    ("bf16", 64, 64, "kda", False): ("one_cta", False),
    ("bf16", 64, 64, "kda", True): ("one_cta", False),
    ("bf16", 64, 64, "gdn2", False): ("one_cta", False),
    ("bf16", 64, 64, "gdn2", True): ("one_cta", False),
    ("bf16", 64, 128, "kda", False): ("one_cta", False),
    ("bf16", 64, 128, "kda", True): ("one_cta", False),
    ("bf16", 64, 128, "gdn2", False): ("one_cta", False),
    ("bf16", 64, 128, "gdn2", True): ("one_cta", False),
    ("bf16", 128, 64, "kda", False): ("one_cta", False),
    ("bf16", 128, 64, "kda", True): ("one_cta", False),
    ("bf16", 128, 64, "gdn2", False): ("one_cta", False),
    ("bf16", 128, 64, "gdn2", True): ("one_cta", False),
    ("bf16", 128, 128, "kda", False): ("k_split", True),
    ("bf16", 128, 128, "kda", True): ("k_split", True),
    ("bf16", 128, 128, "gdn2", False): ("k_split", True),
    ("bf16", 128, 128, "gdn2", True): ("k_split", True),
    # f16: K-split backward at K = 128, the phased dq/dk/dw at K = 64
    ("f16", 64, 64, "kda", False): ("phased", False),
    ("f16", 64, 64, "kda", True): ("phased", False),
    ("f16", 64, 64, "gdn2", False): ("phased", False),
    ("f16", 64, 64, "gdn2", True): ("phased", False),
    ("f16", 64, 128, "kda", False): ("phased", False),
    ("f16", 64, 128, "kda", True): ("phased", False),
    ("f16", 64, 128, "gdn2", False): ("phased", False),
    ("f16", 64, 128, "gdn2", True): ("phased", False),
    ("f16", 128, 64, "kda", False): ("k_split", True),
    ("f16", 128, 64, "kda", True): ("k_split", True),
    ("f16", 128, 64, "gdn2", False): ("k_split", True),
    ("f16", 128, 64, "gdn2", True): ("k_split", True),
    ("f16", 128, 128, "kda", False): ("k_split", True),
    ("f16", 128, 128, "kda", True): ("k_split", True),
    ("f16", 128, 128, "gdn2", False): ("k_split", True),
    ("f16", 128, 128, "gdn2", True): ("k_split", True),
}
DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16}


def test_table_is_complete():
    grid = itertools.product(DTYPES, (64, 128), (64, 128), ("kda", "gdn2"), (False, True))
    assert set(EXPECTED) == set(grid)


@pytest.mark.parametrize("case", sorted(EXPECTED), ids=lambda c: "-".join(map(str, c)))
def test_plan_table(case):
    dt, K, V, variant, store_a = case
    scalar = variant == "kda"
    plan = channel_plan(DTYPES[dt], K, V, scalar_beta=scalar, store_a=store_a)
    assert (plan.dqkw, plan.wy_split) == EXPECTED[case]
    # the kernels' configurations carry the plan's forms and the call's variant
    icfg = plan.intra_config()
    assert (icfg.store_a, icfg.scalar_beta) == (store_a, scalar)
    wcfg = plan.wy_config()
    assert (wcfg.k_split, wcfg.scalar_beta) == (plan.wy_split, scalar)
    assert plan.dqkw_k_split == (plan.dqkw != "one_cta")


@pytest.mark.parametrize(
    "dtype,K,V,chunk,match",
    [
        (jnp.float32, 64, 64, 64, "bf16 or f16"),
        (jnp.bfloat16, 32, 64, 64, "K, V in"),
        (jnp.float16, 64, 256, 64, "K, V in"),
        (jnp.bfloat16, 64, 64, 32, "chunks of 64"),
    ],
)
def test_check_supported_refuses(dtype, K, V, chunk, match):
    with pk.use_mode("interpret"), pytest.raises(NotImplementedError, match=match):
        check_supported(dtype, K, V, chunk)


@pytest.mark.parametrize("dtype,K,V", [(jnp.float32, 64, 64), (jnp.bfloat16, 32, 64)])
def test_plan_refuses_what_the_kernels_do_not_serve(dtype, K, V):
    with pytest.raises(NotImplementedError):
        channel_plan(dtype, K, V, scalar_beta=True, store_a=True)


def test_check_supported_platform():
    with pk.use_mode("interpret"):
        check_supported(jnp.float16, 128, 64, 64)  # served by the interpreter
    if pk.is_hopper():
        pytest.skip("on a Hopper GPU the kernels run in the default mode")
    with pk.use_mode("auto"), pytest.raises(NotImplementedError, match="no Hopper GPU"):
        check_supported(jnp.bfloat16, 64, 64, 64)


def test_plan_validates_its_fields():
    plan = channel_plan(jnp.bfloat16, 64, 64, scalar_beta=False, store_a=True)
    with pytest.raises(ValueError, match="dqkw"):
        dataclasses.replace(plan, dqkw="two_cta")
    with pytest.raises(TypeError, match="wy_split"):
        ChannelPlan(scalar_beta=False, store_a=True, dqkw="one_cta", wy_split=1)


@pytest.mark.parametrize("dt", sorted(DTYPES))
@pytest.mark.parametrize("V", [64, 128])
@pytest.mark.parametrize(
    "state_quant,w_quant", [("column", "row"), ("matrix", "tile"), (None, None)]
)
def test_plan_carries_qat(dt, V, state_quant, w_quant):
    """The intra kernel gets the w granularity, the state loop (forward and the backward's
    recomputation) the state granularity and 64 value columns per CTA, all V for 'matrix'."""
    if dt == "f16" and state_quant == "matrix" and V == 128:
        with pytest.raises(NotImplementedError, match="matrix"):
            channel_plan(DTYPES[dt], 64, V, scalar_beta=True, store_a=True, state_quant="matrix")
        return
    plan = channel_plan(
        DTYPES[dt], 64, V, scalar_beta=True, store_a=True, state_quant=state_quant, w_quant=w_quant
    )
    assert plan.intra_config().w_quant == w_quant
    for store_h in (False, True):
        fcfg = plan.fwd_config(0.5, store_h=store_h)
        assert (fcfg.state_quant, fcfg.store_h, fcfg.scale) == (state_quant, store_h, 0.5)
        assert fcfg.block_v == (V if state_quant == "matrix" else 64)


@pytest.mark.parametrize(
    "dtype,V,packed_states,refused",
    [
        (jnp.float16, 128, False, "f16 with the QAT state granularity 'matrix'"),
        (jnp.bfloat16, 128, True, "packed sequences with states"),
        (jnp.bfloat16, 128, False, None),
        (jnp.float16, 64, True, None),
        (jnp.bfloat16, 64, True, None),
    ],
)
def test_check_supported_qat(dtype, V, packed_states, refused):
    """The state granularity 'matrix' at V = 128 is refused with f16 and with packed sequences
    with states; 'column' (and no state quantisation) is served everywhere."""
    with pk.use_mode("interpret"):
        kw = dict(packed_states=packed_states)
        check_supported(dtype, 64, V, 64, state_quant="column", **kw)
        check_supported(dtype, 64, V, 64, state_quant=None, **kw)
        if refused is None:
            check_supported(dtype, 64, V, 64, state_quant="matrix", **kw)
        else:
            with pytest.raises(NotImplementedError, match=refused):
                check_supported(dtype, 64, V, 64, state_quant="matrix", **kw)
