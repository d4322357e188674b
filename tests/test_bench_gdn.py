"""benchmarks/bench_gdn.py on the CPU: forced segment counts go through the public op."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from gdn_cases import lowered_kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gdn_jax  # noqa: E402
from benchmarks.bench_gdn import forced_segments  # noqa: E402
from pallas_kernels import _compat as pk  # noqa: E402


@pytest.mark.parametrize("segments,has_map", [(None, True), (1, False), (4, True)])
def test_forced_segments_reach_the_public_op(segments, has_map):
    """B1 T2048 H2 HV2 (4 CTAs): the op splits by itself (None); a forced count of 1 removes the
    segment pass, 4 keeps it; the public op (sanitation included) is what gets timed."""
    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    B, T, H, K = 1, 2048, 2, 128
    args = (S((B, T, H, K), bf),) * 3 + (S((B, T, H), jnp.float32),) * 2

    def fwd(q, k, v, g, beta):
        return gdn_jax.gated_delta_rule(q, k, v, g, beta, implementation="pallas")[0]

    with forced_segments(segments), pk.cuda_lowering_mesh():
        txt = jax.jit(fwd).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert lowered_kernels(txt, ("gdn_segment_map",)) == ({"gdn_segment_map"} if has_map else set())
