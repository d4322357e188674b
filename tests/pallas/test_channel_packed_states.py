"""Packed sequences with initial/final states for the channel-gated variants (GDN2, KDA) on the
Pallas path: all sequences on one lane (T + 64 N rows), the chunk loops driven by the per-chunk
table of sequence ids (``meta``: h0 set at a sequence's first chunk, its final state written at
its last; the backward's recomputation and reverse loop mirror both).

CPU only: the op under the Mosaic GPU interpreter against the f32 recurrence (2x rule, every
output and gradient), the op's CUDA lowering (one lane, the table passed to the three chunk
loops: :func:`check_one_lane`, run on test_channel_pallas.py's packed lowering cases) and each
table-driven kernel's CUDA lowering (SMEM budget) and argument checks. The GPU
runs of this path are test_channel_pallas.py's ``packed`` cases and test_channel_pallas_bwd.py's
packed GPU_CASES.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from channel_cases import channel_case, check_channel_2x, pallas_op
from gdn_cases import lowered_kernels, run_interpreted

from pallas_kernels import _compat as pk
from pallas_kernels._tiles import META_COLS, LoopConfig
from pallas_kernels.recurrence.bwd_dh import channel_bwd_dh
from pallas_kernels.recurrence.chunk_fwd import ChunkFwdConfig, channel_chunk_fwd

f32, bf16, f16 = jnp.float32, jnp.bfloat16, jnp.float16
LOOPS = ("chan_chunk_fwd", "chan_chunk_h", "chan_bwd_dh")
CUMSUMS = ("gate_cumsum", "gate_cumsum_rev")
KERNELS = ("chan_intra_wy", "chan_intra_qk", *LOOPS, "chan_bwd_dqkw", "chan_bwd_wy", *CUMSUMS)

# lengths 0, 1, 79 (across the token-64 boundary, two chunks on the lane), 0, 20, 0: empty
# sequences first, inside and last; a one-token sequence, whose single chunk is both its first
# and its last (h0 loaded and the final state written in one step; dht loaded and dh0 written)
CU = [0, 0, 1, 80, 80, 100, 100]


# ------------------------------------------------------------------------------------------------
# CPU: Mosaic GPU interpreter


@pytest.mark.parametrize(
    "variant,HV,dtype",
    [("kda", 1, bf16), ("gdn2", 2, bf16), ("kda", 1, f16)],
    ids=["kda-bf16", "gdn2-gva-bf16", "kda-f16"],
)
def test_interpret_packed_states(variant, HV, dtype):
    """o, every final state and every gradient (dq, dk, dv, dg, dβ / db, dw, dh0) against the
    f32 recurrence under the 2x rule, with nonzero initial states and final states asked for.
    f16: the table-driven loops with the per-column scaled state staging."""
    x, cu, cts = channel_case(0, variant, 1, 100, 1, HV, 64, 64, CU)
    assert float(jnp.max(jnp.abs(x["initial_state"]))) > 0
    run_interpreted(
        lambda: check_channel_2x(variant, pallas_op(variant), x, cu, cts, dtype, jit=False)
    )


# ------------------------------------------------------------------------------------------------
# CPU: the real GPU lowering


def _calls(txt: str) -> dict[str, list[tuple[int, ...]]]:
    """Operand shapes of each Mosaic GPU kernel of ``KERNELS`` in lowered text ``txt`` (the
    custom call's type signature closes its line: ``: (tensor<…>, …) -> (…)``)."""
    out = {}
    for ln in txt.splitlines():
        if "custom_call @mosaic_gpu" not in ln:
            continue
        (name,) = lowered_kernels(ln, KERNELS)
        operands = ln[ln.rindex(" : (") :].split(" -> ")[0]
        shapes = re.findall(r"tensor<((?:\d+x)+)[a-z]+\d*>", operands)
        out[name] = [tuple(int(d) for d in s.rstrip("x").split("x")) for s in shapes]
    return out


def check_one_lane(txt: str, T: int, N: int, HV: int, K: int, V: int) -> None:
    """Lowered fwd+bwd text ``txt`` of packed sequences with states (``N`` sequences, ``T``
    tokens) runs every kernel on one lane of 64 (ceil(T / 64) + N) rows (not N lanes of ~T
    rows), and the three chunk loops read the [rows / 64, META_COLS] int32 table and one state
    row per sequence. Run on test_channel_pallas.py::test_lowers_for_cuda's packed cases."""
    calls = _calls(txt)
    assert set(calls) == set(KERNELS), set(calls)
    rows = 64 * (-(-T // 64) + N)
    assert rows < N * T
    for name, shapes in calls.items():
        # the gate cumsums read the lane's log-decays flattened to [rows, HV * K]
        lead = (rows, HV * K) if name in CUMSUMS else (1, rows)
        assert shapes[0][:2] == lead, (name, shapes)
        tables = [s for s in shapes if s == (rows // 64, META_COLS)]
        assert len(tables) == (name in LOOPS), (name, shapes)
        if name in LOOPS:  # one state row per sequence
            assert (N, HV, K, V) in shapes, (name, shapes)


def _loop_fns(K, V, dt, N=3, T=256, HV=2, block_v=64):
    """(name, fn, argument shapes) of the three table-driven chunk loops."""
    S, nt = jax.ShapeDtypeStruct, T // 64
    qk, u, aqk = S((1, T, HV, K), dt), S((1, T, HV, V), dt), S((1, T, HV, 64), dt)
    egl, st, meta = S((1, HV, nt, K), f32), S((N, HV, K, V), f32), S((nt, META_COLS), jnp.int32)
    fwd = ChunkFwdConfig(scale=0.1, block_v=block_v)
    sh = ChunkFwdConfig(scale=0.1, block_v=block_v, store_h=True)
    dh = LoopConfig(scale=0.1, block_v=block_v)
    return [
        ("chan_chunk_fwd", lambda qg, kg, w, u, a, e, h0, m: channel_chunk_fwd(
            qg, kg, w, u, a, e, h0, fwd, m), (qk, qk, qk, u, aqk, egl, st, meta)),
        ("chan_chunk_h", lambda kg, w, u, e, h0, m: channel_chunk_fwd(
            None, kg, w, u, None, e, h0, sh, m), (qk, qk, u, egl, st, meta)),
        ("chan_bwd_dh", lambda qg, kg, w, do, a, e, dht, m: channel_bwd_dh(
            qg, kg, w, do, a, e, dht, dh, m), (qk, qk, qk, u, aqk, egl, st, meta)),
    ]  # fmt: skip


@pytest.mark.parametrize("dt", [bf16, f16], ids=["bf16", "f16"])
@pytest.mark.parametrize("K,V", [(128, 128), (64, 128)])
def test_table_driven_loops_lower_for_cuda(K, V, dt):
    """Each chunk loop with the table lowers within one SM's shared memory (Mosaic GPU checks the
    budget while lowering), its states one row per sequence."""
    for name, fn, args in _loop_fns(K, V, dt):
        with pk.cuda_lowering_mesh():
            txt = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert lowered_kernels(txt, LOOPS) == {name}
        out = jax.eval_shape(fn, *args)
        if name == "chan_chunk_fwd":
            assert out[1].shape == (3, 2, K, V)
        elif name == "chan_bwd_dh":
            assert out[3].shape == (3, 2, K, V)


def test_table_checks():
    """A table of the wrong shape or dtype, or with more than one batch row, is a ValueError; a
    table with 128-column value blocks (no SMEM for the state staging tile) NotImplementedError."""
    S = jax.ShapeDtypeStruct
    for _, fn, args in _loop_fns(128, 128, bf16):
        bad_shape = args[:-1] + (S((4, 16), jnp.int32),)
        bad_dtype = args[:-1] + (S((4, META_COLS), f32),)
        for bad in (bad_shape, bad_dtype):
            with pytest.raises(ValueError, match="meta"):
                jax.eval_shape(fn, *bad)
        two_rows = tuple(S((2,) + a.shape[1:], a.dtype) if a.ndim == 4 else a for a in args)
        with pytest.raises(ValueError, match="meta"):
            jax.eval_shape(fn, *two_rows)
    for _, fn, args in _loop_fns(128, 128, bf16, block_v=128):
        with pytest.raises(NotImplementedError, match="block_v"):
            jax.eval_shape(fn, *args)
