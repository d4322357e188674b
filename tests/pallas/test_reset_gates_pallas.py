"""H200: full-reset gates (g = -inf) through the Pallas kernels give the recurrence's answer.

The op clamps log-decays to [LOG_DECAY_FLOOR, 0] before it chooses an implementation
(docs/ops.md), so the kernels see finite gates whose decay factor is exactly 0 in f32. This checks
on the GPU that the kernels' decay factoring keeps every output and gradient within the 2x rule
of the f32 recurrence run on the raw -inf gates, and that d g is 0 where g = -inf.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from channel_cases import NAMES, channel_case, check_channel_2x, pallas_op

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("variant", ["gdn", "kda", "gdn2"])
@pytest.mark.parametrize("case", ["one_token", "whole_chunk"])
def test_reset_gates_bf16(variant, case):
    x, cu, cts = channel_case(0, variant, B=2, T=200, H=2, HV=4, K=64, V=64)
    g = x["g"]
    x["g"] = g.at[:, 100].set(-jnp.inf) if case == "one_token" else g.at[:, 64:128].set(-jnp.inf)
    got = check_channel_2x(variant, pallas_op(variant), x, cu, cts, jnp.bfloat16)
    assert all(bool(jnp.all(jnp.isfinite(a))) for a in got)
    dg = got[NAMES[variant].index("dg")]
    np.testing.assert_array_equal(np.asarray(dg)[np.isneginf(np.asarray(x["g"]))], 0.0)
