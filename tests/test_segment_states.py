"""The context-parallel segment maths of ``gdn_jax.sharding.context`` on one device: a sequence
cut into segments laid side by side along the batch, each segment's affine state map, the prefix
combine of the maps and the output corrected for each segment's start equal the unsplit op."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gdn_jax
from gdn_jax.sharding import context
from gdn_jax.testing import random_inputs, rel_rms

TOL = 1e-5
OPS = {"gdn": gdn_jax.gated_delta_rule, "gdn2": gdn_jax.gdn2}
GATES = {"gdn": ("g", "beta"), "gdn2": ("g", "b", "w")}
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _to_segments(x, n):
    """[B, T, ...] -> [n·B, T/n, ...], segment-major."""
    return jnp.concatenate(jnp.split(x, n, axis=1), axis=0)


def _from_segments(x, n):
    return jnp.concatenate(jnp.split(x, n, axis=0), axis=1)


@pytest.mark.parametrize("variant", ["gdn", "gdn2"])
def test_segments_on_one_device_equal_the_unsplit_op(variant):
    # K != V, so the map M [K, K] and the offset c [K, V] differ in shape; 4 segments of 16.
    n, B = 4, 2
    x = random_inputs(0, variant=variant, B=B, T=64, H=2, HV=4, K=8, V=16)
    arrays = [x[m] for m in ("q", "k", "v", *GATES[variant])]
    h0 = x["initial_state"]
    kw = dict(implementation="xla", chunk_size=16)

    def op(*a, **k):
        return OPS[variant](*a, **kw, **k)

    def split(arrays, h0):
        M, c, o_0, o_M = context.segment_map(op, [_to_segments(a, n) for a in arrays])
        per_segment = lambda s: s.reshape(n, B, *s.shape[1:])  # [n·B, ...] -> [n, B, ...]
        starts, final = context.combine_segment_states(per_segment(M), per_segment(c), h0)
        o = context.output_from_start(o_0, o_M, starts.reshape(n * B, *starts.shape[2:]))
        return _from_segments(o, n), final

    o1, s1 = jax.jit(split, compiler_options=FAST)(arrays, h0)
    o0, s0 = jax.jit(lambda a, h: op(*a, initial_state=h, output_final_state=True))(arrays, h0)
    assert rel_rms(o1, o0) < TOL and rel_rms(s1, s0) < TOL, (rel_rms(o1, o0), rel_rms(s1, s0))


def test_combine_segment_states_unrolled_and_scanned():
    """The prefix ``S_{j+1} = M_j S_j + c_j`` against a NumPy loop, for a few segments (unrolled)
    and many (a lax.scan), with and without a start state; bad shapes are ValueErrors."""
    rng = np.random.default_rng(0)
    for n in (3, 40):
        Ms = rng.normal(size=(n, 1, 2, 4, 4)).astype(np.float32) * 0.4
        cs = rng.normal(size=(n, 1, 2, 4, 3)).astype(np.float32)
        for h0 in (None, rng.normal(size=(1, 2, 4, 3)).astype(np.float32)):
            S = np.zeros((1, 2, 4, 3)) if h0 is None else h0.astype(np.float64)
            want = []
            for j in range(n):
                want.append(S)
                S = np.einsum("bhij,bhjv->bhiv", Ms[j].astype(np.float64), S) + cs[j]
            starts, final = context.combine_segment_states(Ms, cs, h0)
            assert starts.shape == (n, 1, 2, 4, 3) and starts.dtype == jnp.float32
            assert rel_rms(starts, np.stack(want)) < TOL and rel_rms(final, S) < TOL
    with pytest.raises(ValueError, match=r"Ms \(1, 2, 4, 4\) and cs .*expected Ms \[n, B"):
        context.combine_segment_states(Ms[0], cs)
    with pytest.raises(ValueError, match=r"h0 \(2, 4, 3\): expected \[B, HV, K, V\]"):
        context.combine_segment_states(Ms, cs, h0[0])
