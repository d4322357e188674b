"""Sequence-parallel forward state loop of KDA / GDN2 (segments inside one device) on the Pallas
kernels: the channel segment pass (``chan_segment_map``), the combine, and the chunk loop from
every segment's entering state; the backward runs its loops unsplit on the same padded lanes.

CPU: the real CUDA lowering of the segmented forward (dense and packed), and Mosaic GPU
interpreter runs at tiny shapes: o, final state and every gradient under the 2x rule against the
f32 recurrence (packed lane with states, dense rows with GVA), and the packed lane without
states (the wipe gate) against the unsplit loop. GPU (``-m gpu``): segment counts 2 and 7 on a
packed lane with states, and the default count at B1 T 8192, under the 2x rule.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from channel_cases import channel_case, check_channel_2x
from gdn_cases import lowered_kernels, run_interpreted

from gdn_jax.ops._channel_pallas import channel_pallas
from gdn_jax.testing import rel_rms
from pallas_kernels import _compat as pk

bf16 = jnp.bfloat16
FORWARD = ("chan_intra_wy", "chan_intra_qk", "chan_segment_map", "chan_chunk_fwd")


@functools.cache
def segmented_op(variant: str, segments: int | None):
    """The Pallas path of ``variant`` at a forced segment count (None: the default count)."""

    def fn(q, k, v, g, *gates, initial_state, output_final_state, cu_seqlens, use_qk_l2norm):
        b, w = (gates[0][..., None],) * 2 if variant == "kda" else gates
        return channel_pallas(
            q, k, v, g, b, w, scale=q.shape[-1] ** -0.5, initial_state=initial_state,
            output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm,
            cu_seqlens=cu_seqlens, chunk_size=64, segments=segments,
        )  # fmt: skip

    return fn


# ------------------------------------------------------------------------------------------------
# CPU


@pytest.mark.parametrize("packed", [False, True])
def test_segments_lower_for_cuda(packed):
    B, T, H, HV, K, V = 1, 1024, 2, 4, 128, 128
    S, bf, f = jax.ShapeDtypeStruct, bf16, jnp.float32
    n = 3 if packed else B
    args = (
        S((B, T, H, K), bf), S((B, T, H, K), bf), S((B, T, HV, V), bf),
        S((B, T, HV, K), f), S((B, T, HV, K), f), S((B, T, HV, V), f), S((n, HV, K, V), f),
    )  # fmt: skip
    cu = jnp.asarray([0, 300, 300, T], jnp.int32) if packed else None

    def f(q, k, v, g, b, w, h0):
        return segmented_op("gdn2", 4)(
            q, k, v, g, b, w, initial_state=h0, output_final_state=True, cu_seqlens=cu,
            use_qk_l2norm=False,
        )  # fmt: skip

    with pk.cuda_lowering_mesh():
        txt = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert lowered_kernels(txt, FORWARD) == set(FORWARD)


@pytest.mark.parametrize(
    "variant,B,HV,cu,S",
    [("gdn2", 1, 2, [0, 20, 20, 256], 4), ("kda", 2, 2, None, 2)],
    ids=["gdn2-packed-S4", "kda-dense-S2"],
)
def test_interpret_segments_2x(variant, B, HV, cu, S):
    """Packed: one lane of 5 chunks cut into 4 segments (padded to 8), a sequence across
    segments 1 and 2 (a non-zero map carries its state on), an empty one; dense: two rows with
    initial states, GVA. Every output and gradient against the f32 recurrence."""
    x, cuj, cts = channel_case(0, variant, B, 256 if cu else 128, 1, HV, 64, 64, cu, 0.3)
    run_interpreted(
        lambda: check_channel_2x(variant, segmented_op(variant, S), x, cuj, cts, bf16, jit=False)
    )


def test_interpret_segments_wipe_gate():
    """A packed lane without states (the wipe gate resets the state at each sequence start),
    S = 2: o as the unsplit loop's, up to the bf16 staging of the segments' entering states."""
    x, cu, _ = channel_case(1, "kda", 1, 256, 1, 2, 64, 64, [0, 100, 256], 0.3)
    args = [x[n].astype(bf16) for n in ("q", "k", "v")] + [x["g"], x["beta"]]
    kw = dict(initial_state=None, output_final_state=False, cu_seqlens=cu, use_qk_l2norm=True)
    got, want = (
        run_interpreted(lambda s=s: segmented_op("kda", s)(*args, **kw)[0]) for s in (2, 1)
    )
    assert rel_rms(got, want) < 2e-2, rel_rms(got, want)


# ------------------------------------------------------------------------------------------------
# GPU (H200)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["kda", "gdn2"])
@pytest.mark.parametrize("S", [2, 7])
def test_gpu_segments_packed_states(variant, S):
    x, cu, cts = channel_case(21, variant, 1, 4096, 2, 4, 128, 128, [0, 1000, 1000, 1001, 4096])
    check_channel_2x(variant, segmented_op(variant, S), x, cu, cts, bf16)


@pytest.mark.gpu
def test_gpu_default_segments_long_lane():
    """B1 T 8192 HV 16: the default count splits the lane (2·132 // 32 CTAs = 8 segments)."""
    x, cu, cts = channel_case(23, "kda", 1, 8192, 16, 16, 128, 128, None, 0.3)
    got = check_channel_2x("kda", segmented_op("kda", None), x, cu, cts, bf16)
    assert np.isfinite(np.asarray(got[0], np.float32)).all()
