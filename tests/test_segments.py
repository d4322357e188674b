"""Sequence parallelism inside one device (gdn_jax.ops._segments): the segment-count heuristic and
the segment maths, driven by the xla reference recurrence on CPU.

The maths tests run the chunked reference's state recurrence (``gdn_jax.reference.chunked``) the
way the Pallas kernels run it with S segments: a segment pass on the augmented state ``[c | M]``
from ``[0 | I]`` (resets at packed sequence starts), the prefix combine, then every segment from
its own start through the extended per-chunk table; and, for the backward, the reverse combine
with the transposed maps against JAX autodiff of the unsplit recurrence.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gdn_jax.ops._pallas_common import packed_meta
from gdn_jax.ops._segments import (
    MAX_SEGMENTS,
    pad_chunks,
    segment_count,
    segment_end_cotangents,
    segment_meta,
    segment_starts,
)
from gdn_jax.reference._common import chunk_layout, l2norm, to_chunks
from gdn_jax.reference.chunked import (
    chunk_output,
    chunk_step,
    decayed_keys,
    gate_cumsum,
    intra_chunk,
)
from gdn_jax.testing import random_inputs

C = 64
f32 = jnp.float32


# ------------------------------------------------------------------------------------------------
# heuristic


@pytest.mark.parametrize(
    "B,HV,T,nv,want",
    [
        (4, 16, 4096, 2, 1),  # 128 CTAs: a full wave already
        (2, 16, 32768, 2, 2),  # 64 CTAs: one per SM after the split
        (1, 16, 32768, 2, 4),  # 32 CTAs
        (1, 8, 32768, 2, 8),
        (1, 16, 131072, 2, 4),
        (1, 16, 4096, 2, 4),  # 64 chunks: segments of >= 16 chunks
        (1, 1, 1 << 20, 1, MAX_SEGMENTS),  # capped
        (1, 16, 2048, 2, 2),  # 32 chunks: segments of >= 16 chunks
        (1, 16, 1024, 2, 1),  # too short to split
        (1, 16, 0, 2, 1),
    ],
)
def test_segment_count(B, HV, T, nv, want):
    assert segment_count(B, HV, T, nv) == want


def test_segment_count_follows_the_sm_count():
    assert segment_count(1, 16, 32768, 2, sms=264) == 8
    assert segment_count(1, 16, 32768, 2, sms=48) == 1


def test_channel_default_segments():
    """KDA/GDN2's forward loop splits as GDN's does (64-column value blocks): B1 T32768 HV16 in
    4 segments (packed: one lane), B4 T4096 not at all, and never with the QAT state quant."""
    from gdn_jax.ops._channel_pallas import ChannelConfig, _segments_for
    from gdn_jax.qat import QATConfig

    cfg = ChannelConfig(scale=1.0, scalar_beta=True)
    bf = jnp.bfloat16
    cu = jnp.asarray([0, 1000, 32768], jnp.int32)
    assert _segments_for(cfg, 1, 32768, 16, 128, 128, bf, None) == 4
    assert _segments_for(cfg, 1, 32768, 16, 128, 128, bf, cu) == 4
    assert _segments_for(cfg, 4, 4096, 16, 128, 128, bf, None) == 1
    qat = ChannelConfig(scale=1.0, qat=QATConfig(sites=("state",)))
    assert _segments_for(qat, 1, 32768, 16, 128, 128, bf, None) == 1


@pytest.mark.parametrize("bad", [dict(B=0), dict(HV=-1), dict(T=1.5), dict(sms=0)])
def test_segment_count_rejects_bad_arguments(bad):
    kw = dict(B=1, HV=16, T=4096, v_blocks=2) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        segment_count(**kw)


def test_pad_chunks():
    x = jnp.ones((1, 5 * C, 2))
    (y,) = pad_chunks((x,), (1,), 4)
    assert y.shape == (1, 8 * C, 2)
    assert float(y[:, 5 * C :].sum()) == 0.0 and float(y[:, : 5 * C].sum()) == 5 * C * 2


# ------------------------------------------------------------------------------------------------
# segment maths on the reference recurrence


def _chunked(seed, B, T, H, HV, K, V, cu):
    """Reference stage operands on lanes (``to_chunks`` layout, GVA repeated): q, k, wk, u, kdec,
    decay_last [L, NC, ...], G, the layout and initial states [N, HV, K, V]."""
    n = B if cu is None else len(cu) - 1
    x = random_inputs(seed, B=B, T=T, H=H, HV=HV, K=K, V=V, n_states=n, gate_scale=0.03)
    cu = None if cu is None else jnp.asarray(cu, jnp.int32)
    layout = chunk_layout(B, T, C, cu)
    rep = HV // H
    q, k = (jnp.repeat(l2norm(x[n_]), rep, axis=2) for n_ in ("q", "k"))
    q, k, v, g, beta = (to_chunks(a, layout) for a in (q, k, x["v"], x["g"], x["beta"]))
    G = gate_cumsum(g[..., None])
    _, wk, u = intra_chunk(k, v, beta[..., None], beta[..., None], G, dtype=f32)
    kdec, dl = decayed_keys(k, G)
    return dict(q=q, k=k, wk=wk, u=u, kdec=kdec, dl=dl, G=G), layout, x["initial_state"]


def _run(ops, S0, reset, table):
    """The chunk loop over the NC axis of one lane (chunked operands [NC, ...]): the state is
    set to ``table[reset[c]]`` where ``reset[c] >= 0``. Returns (S_in, S_out) [NC, HV, K, V']."""

    def body(S, xs):
        wk, u, kdec, dl, r = xs
        S = jnp.where(r >= 0, table[jnp.maximum(r, 0)], S)
        _, S_out = chunk_step(S[None], wk[None], u[None], kdec[None], dl[None], dtype=f32)
        return S_out[0], (S, S_out[0])

    xs = (ops["wk"], ops["u"], ops["kdec"], ops["dl"], reset)
    return jax.lax.scan(body, S0, xs)[1]


def _pad(ops, meta, S):
    """Pads the lanes' chunk axis (axis 1) to a multiple of S chunks; inert zero chunks (zero
    gates: decay 1), -1 table rows."""
    nc = ops["wk"].shape[1]
    n = -(-nc // S) * S
    out = {}
    for name, a in ops.items():
        pad = [(0, 0)] * a.ndim
        pad[1] = (0, n - nc)
        out[name] = jnp.pad(a, pad, constant_values=1.0 if name == "dl" else 0.0)
    if meta is not None:
        meta = jnp.concatenate([meta, jnp.full((n - nc, meta.shape[1]), -1, meta.dtype)])
    return out, meta


def _lane(ops, i):
    return {name: a[i] for name, a in ops.items()}


@functools.partial(jax.jit, static_argnums=3)
def _segmented_states(ops, h0, meta, S):
    """States entering every chunk (and final states) computed as the kernels do with S segments.

    Returns:
      (S_in [L, NC, HV, K, V], finals [N, HV, K, V] (packed) or [L, HV, K, V], maps [L, S, ...]).
    """
    L, NC = ops["wk"].shape[:2]
    HV, K, V = ops["u"].shape[-2], ops["wk"].shape[-1], ops["u"].shape[-1]
    Lc = NC // S
    seg = lambda a, j: a[j * Lc : (j + 1) * Lc]  # noqa: E731
    aug_ops = dict(ops, u=jnp.concatenate([ops["u"], jnp.zeros(ops["u"].shape[:-1] + (K,))], -1))
    start = jnp.concatenate([jnp.zeros((HV, K, V)), jnp.broadcast_to(jnp.eye(K), (HV, K, K))], -1)
    ends = []
    for b in range(L):
        lane = _lane(aug_ops, b)
        if meta is None:
            reset, table = -jnp.ones((NC,), jnp.int32), start[None]
        else:  # a sequence start: [h0 | 0]
            reset, table = meta[:, 0], jnp.concatenate([h0, jnp.zeros(h0.shape[:-1] + (K,))], -1)
        row = []
        for j in range(S):
            part = {n: seg(a, j) for n, a in lane.items()}
            _, S_out = _run(part, start, seg(reset, j), table)
            row.append(S_out[-1])
        ends.append(jnp.stack(row))
    ends = jnp.stack(ends)  # [L, S, HV, K, V + K]
    starts, _ = segment_starts(ends[:, : S - 1], None if meta is not None else h0)
    maps = ends[..., V:]
    S_in, finals = [], []
    for b in range(L):
        lane = _lane(ops, b)
        if meta is None:
            table = starts[b]
            reset = jnp.where(jnp.arange(NC) % Lc == 0, jnp.arange(NC) // Lc, -1)
        else:
            meta_ext, _ = segment_meta(meta, S, h0.shape[0])
            table, reset = jnp.concatenate([h0, starts[0]]), meta_ext[:, 0]
        s_in, s_out = _run(lane, jnp.zeros((HV, K, V)), reset, table)
        S_in.append(s_in)
        finals.append(s_out)
    S_in, S_out = jnp.stack(S_in), jnp.stack(finals)
    if meta is None:
        return S_in, S_out[:, -1], maps
    N = h0.shape[0]
    idx = jnp.where(meta[:, 1] >= 0, meta[:, 1], N)
    fin = jnp.zeros((N + 1, HV, K, V)).at[idx].set(S_out[0])[:N]
    return S_in, fin, maps


@jax.jit
def _unsplit_states(ops, h0, meta):
    L, NC = ops["wk"].shape[:2]
    HV, K, V = ops["u"].shape[-2], ops["wk"].shape[-1], ops["u"].shape[-1]
    outs = []
    for b in range(L):
        if meta is None:
            reset = jnp.where(jnp.arange(NC) == 0, b, -1)
        else:
            reset = meta[:, 0]
        outs.append(_run(_lane(ops, b), jnp.zeros((HV, K, V)), reset, h0))
    S_in = jnp.stack([o[0] for o in outs])
    S_out = jnp.stack([o[1] for o in outs])
    if meta is None:
        return S_in, S_out[:, -1]
    N = h0.shape[0]
    idx = jnp.where(meta[:, 1] >= 0, meta[:, 1], N)
    return S_in, jnp.zeros((N + 1, HV, K, V)).at[idx].set(S_out[0])[:N]


# dense B = 2 with GVA; packed with an empty sequence first and inside, sequences shorter and
# longer than a segment; one segment (S = 1 is the unsplit loop)
CASES = [
    (2, 600, 1, 2, None),
    (1, 1000, 2, 2, [0, 0, 70, 70, 700, 1000]),
]


@pytest.mark.parametrize("S", [2, 7, 16])
@pytest.mark.parametrize("B,T,H,HV,cu", CASES)
def test_segment_maths_match_the_unsplit_loop(B, T, H, HV, cu, S):
    """Forward: the states entering every chunk and the final states through S segments equal
    the unsplit loop's. Backward: dE_{j−1} = M_jᵀ dE_j + d_j against JAX autodiff of the unsplit
    forward (outputs and final states under random cotangents): dE_{j−1} is the gradient of a
    perturbation of the state entering segment j (before a sequence reset), d_j the gradient
    of segment j's own outputs and final states wrt its entering state."""
    ops, layout, h0 = _chunked(0, B, T, H, HV, 8, 4, cu)
    meta = None if cu is None else packed_meta(layout)
    ops, meta = _pad(ops, meta, S)
    want_in, want_fin = _unsplit_states(ops, h0, meta)
    got_in, got_fin, maps = _segmented_states(ops, h0, meta, S)
    scale = float(jnp.max(jnp.abs(want_in)))
    assert scale > 0.1  # the states carry across segments (gates are mild)
    np.testing.assert_allclose(got_in, want_in, atol=2e-5 * scale, rtol=0)
    np.testing.assert_allclose(got_fin, want_fin, atol=2e-5 * scale, rtol=0)
    if S > 7:  # the backward's unrolled per-segment autodiff compiles slowly: S = 2, 7 only
        return
    L, NC = ops["wk"].shape[:2]
    HV, K, V = ops["u"].shape[-2], ops["wk"].shape[-1], ops["u"].shape[-1]
    Lc = NC // S
    r = np.random.default_rng(2)
    do = jnp.asarray(r.standard_normal(ops["u"].shape), f32)
    n_fin = L if meta is None else h0.shape[0]
    dht = jnp.asarray(r.standard_normal((n_fin, HV, K, V)), f32)

    def lane_loss(b, chunks, S0, eps, fin_rows):
        """Σ <o, do> + Σ <final, dht> over ``chunks`` of lane b from S0, eps[j] added to the
        state entering segment j ≥ 1; fin_rows: the dense final state counts."""
        lane = {n: a[b][chunks] for n, a in ops.items()}
        nc = len(chunks)
        if meta is None:
            reset = jnp.full((nc,), -1)
        else:
            reset = meta[chunks, 0]
        seg_of = np.asarray(chunks) // Lc
        enters = (np.asarray(chunks) % Lc == 0) & (seg_of > 0)

        def body(S, xs):
            wk, u, kdec, dl, rs, enter, j = xs
            S = S + jnp.where(enter, eps[j], 0.0)
            S = jnp.where(rs >= 0, h0[jnp.maximum(rs, 0)], S)
            v_new, S_out = chunk_step(S[None], wk[None], u[None], kdec[None], dl[None], dtype=f32)
            return S_out[0], (S, v_new[0], S_out[0])

        xs = (lane["wk"], lane["u"], lane["kdec"], lane["dl"], reset, jnp.asarray(enters), seg_of)
        _, (S_in, v_new, S_out) = jax.lax.scan(body, S0, xs)
        o = chunk_output(lane["q"], lane["k"], lane["G"], S_in, v_new, scale=0.5, dtype=f32)
        loss = jnp.sum(o * do[b][chunks])
        if meta is None:
            if fin_rows:
                loss += jnp.sum(S_out[-1] * dht[b])
        else:
            fin = meta[chunks, 1]
            keep = (fin >= 0)[:, None, None, None]
            loss += jnp.sum(jnp.where(keep, S_out * dht[jnp.maximum(fin, 0)], 0.0))
        return loss

    zeros = jnp.zeros((HV, K, V))
    eps = jnp.zeros((S, HV, K, V))

    @jax.jit
    def grads(b):
        S0 = h0[b] if meta is None else zeros
        # dE[j] = gradient of eps[j + 1]: the cotangent leaving segment j
        dE = jax.grad(lambda e: lane_loss(b, np.arange(NC), S0, e, True))(eps)

        def own(s0s):  # every segment from its own entering state, zero end cotangent
            return sum(
                lane_loss(b, np.arange(j * Lc, (j + 1) * Lc), s0s[j], eps, False) for j in range(S)
            )

        return dE, jax.grad(own)(jnp.zeros((S, HV, K, V)))

    for b in range(L):
        dE, d = grads(b)
        want = jnp.concatenate([dE[1:], (dht[b] if meta is None else zeros)[None]])
        last = dht[b : b + 1] if meta is None else None
        got = segment_end_cotangents(maps[b : b + 1], d[None], last)[0]
        scale = float(jnp.max(jnp.abs(want)))
        assert scale > 0.1
        np.testing.assert_allclose(got, want, atol=2e-5 * scale, rtol=0)


def test_segment_meta():
    # 6 chunks: sequence 0 chunks 0-2, sequence 1 chunks 3-5; 3 segments of 2 chunks
    meta = jnp.full((6, 4), -1, jnp.int32)
    meta = meta.at[0, 0].set(0).at[2, 1].set(0).at[3, 0].set(1).at[5, 1].set(1)
    ext, first_seq = segment_meta(meta, 3, 2)
    np.testing.assert_array_equal(ext[:, 0], [0, -1, 2 + 1, 1, 2 + 2, -1])
    np.testing.assert_array_equal(ext[:, 1], [-1, 2 + 0, 0, 2 + 1, -1, 1])
    np.testing.assert_array_equal(first_seq, [True, False, False])


# ------------------------------------------------------------------------------------------------
# bad input


def test_bad_segment_arguments():
    from gdn_jax.ops._gdn_pallas import PallasConfig, gated_delta_rule_pallas
    from gdn_jax.qat import QATConfig
    from pallas_kernels import _compat as pk
    from pallas_kernels._tiles import LoopConfig
    from pallas_kernels.recurrence.chunk_fwd import ChunkFwdConfig, chunk_fwd

    with pytest.raises(ValueError, match="segments"):
        LoopConfig(segments=0)
    with pytest.raises(ValueError, match="segments"):
        PallasConfig(scale=1.0, segments=0)
    with pytest.raises(NotImplementedError, match="QAT state"):
        PallasConfig(scale=1.0, segments=2, qat=QATConfig())
    x = random_inputs(0, B=1, T=64, H=1, HV=1, K=64, V=64)
    args = [x[n].astype(jnp.bfloat16) for n in ("q", "k", "v")] + [x["g"], x["beta"]]
    kw = dict(
        scale=0.1, initial_state=None, output_final_state=False, use_qk_l2norm=False,
        cu_seqlens=None, chunk_size=64,
    )  # fmt: skip
    with pk.use_mode("interpret"), pytest.raises(ValueError, match="segments"):
        gated_delta_rule_pallas(*args, segments=0, **kw)
    k = jnp.zeros((1, 192, 1, 64), jnp.bfloat16)
    u = jnp.zeros((1, 192, 1, 64), jnp.bfloat16)
    G = jnp.zeros((1, 1, 192), f32)
    with pytest.raises(ValueError, match="multiple of segments"):
        chunk_fwd(k, k, k, u, G, jnp.zeros((2, 1, 64, 64)), ChunkFwdConfig(segments=2))
    with pytest.raises(ValueError, match="rows"):
        chunk_fwd(k, k, k, u, G, jnp.zeros((1, 1, 64, 64)), ChunkFwdConfig(segments=3))
    from pallas_kernels.gdn.segment_state import segment_maps
    from pallas_kernels.recurrence.bwd_dh import chunk_bwd_dh

    with pytest.raises(ValueError, match="segments >= 2"):
        segment_maps(k, k, u, G, jnp.zeros((1, 1, 64, 64)), LoopConfig(segments=1))
    with pytest.raises(ValueError, match="rows"):
        chunk_bwd_dh(k, k, k, u, G, jnp.zeros((1, 1, 64, 64)), LoopConfig(segments=3))
