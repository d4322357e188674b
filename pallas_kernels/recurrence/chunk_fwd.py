"""Stages 3+4 of the chunked forms: the inter-chunk state recurrence fused with the output, one
kernel body per loop for both gate shapes.

One CTA per (batch row, value head, block of ``block_v`` value columns) runs over the chunks in
order, with the state S [K, BV] in f32 registers as the pipeline's carry. Each chunk the state is
cast to the io dtype once, into one SMEM tile that is the B operand of both ``w S`` and ``q S``.
Per chunk (C = 64 rows, G the chunk-local cumulative log-decay):

- scalar gate (GDN, :func:`chunk_fwd`; w, u from :func:`pallas_kernels.gdn.intra.intra_chunk`,
  q and k read per query/key head, so GVA costs no copies)::

      v_new = u − w S
      o     = scale · [ (q S) ⊙ e^{G} + (q kᵀ ⊙ e^{G_i − G_j} ⊙ [i ≥ j]) v_new ]
      S     ← e^{G_last} S + kᵀ (v_new ⊙ e^{G_last − G})

- decay per key channel (GDN2 / KDA, :func:`channel_chunk_fwd`; the decayed operands come from
  :func:`pallas_kernels.channel.intra.channel_intra`, per value head)::

      v_new = u − w S
      o     = scale · [ qg S + Aqk v_new ]              qg = q e^{G}, Aqk causal and decayed
      S     ← Diag(e^{G_last}) S + kgᵀ v_new            kg = k e^{G_last − G}

  The decay of the state is a row scaling of the state tile (WGMMA layout, vector loaded with
  ``WGMMA.reduce(1)``).

The forward (o and the final state) splits each CTA into roles: a memory warpgroup runs the TMA
pipeline of the chunk inputs (``emit_pipeline_warp_specialized``), the *state* warpgroup runs
the sequential path (stage S, v_new, the update of S) and the *output* warpgroup the rest of the
chunk (q kᵀ and P, then q S, P v_new and the o store) one step behind it. They share the staged
S and v_new tiles, double-buffered and handed over by two SMEM barriers per slot (``ready``: the
state role has written them; ``free``: the output role has read them); the output role forms P
before it waits for them. A chunk step then costs the state path alone, not the state path plus
the output (with at most one loop CTA per SM, the loop is bound by that latency). The scalar
gate's update decays and sanitises the keys into a tile of its own (k ⊙ e^{G_last − G}, its
non-finite values read as 0), so the output role reads the raw k tile meanwhile. The h0 load and
the end-state store go through the staged-state tiles' memory, before and after the loop; a
packed lane, whose sequences start and end mid-loop, has a staging tile of its own.

``store_h`` is the backward's recomputation: one warpgroup writes the state entering each chunk
(h) and v_new instead of o and the final state; it has no output products to take off the state
path. Padded rows (zero q, k, w, u, and a repeated cumulative gate) leave S unchanged; G_last is
the cumulative gate of the chunk's last valid row.

Segments (``segments = S > 1``): each lane is cut into S segments of equal chunk count that run as
separate CTAs from the states in ``h0`` (one row per segment; the combine pass that makes those
states is :mod:`gdn_jax.ops._segments`).

QAT (``state_quant``): the state entering each chunk (after a packed sequence's h0 is loaded) is
fake-quantised to FP8-E4M3 in registers (:func:`pallas_kernels.gdn.fake_quant.fake_quant_e4m3`,
one scale per V column or one per K×V state), and that quantised state is the one the chunk's
products, its decayed update and, with ``store_h``, the stored h use (as in the xla path). A
per-state scale needs the whole state in one CTA (``block_v == V``).

Non-finite inputs (``poison``): the op's NaN (:mod:`gdn_jax.ops._sanitize`) is added to o in
registers before its store, instead of a pass of its own over o: from a per-chunk vector of the
row from which each value column is NaN, and for the rows whose whole output is NaN (a bad q),
from a per-row vector (channel; its q comes sanitised from the intra kernel) or from the chunk's
own q kᵀ (scalar gate: a non-finite q makes every entry of its row non-finite).

Packed sequences on one lane (``meta``): each sequence starts at a chunk boundary and a per-chunk
table, read from SMEM as scalars, names the sequence whose first chunk this is (the state is set
to its h0 row, TMA-loaded into a staging tile under a predicate) and the one whose last chunk this
is (its end state is written from the same tile).

f16 io (docs/design.md: an f32 state is never staged through plain f16, whose maximum is 65504):
the state tile is staged as f16 with one scale per V column
(:func:`pallas_kernels.gdn.fake_quant.f16_stage_scales`, each column's amax at 2^14), and the
columns of ``w S`` and ``q S`` are multiplied back by the scales in f32 (the output role reads
them from SMEM). With ``store_h``, h is written in f32 from a second, f32 SMEM tile
(double-buffered for its TMA store), so the staged tile is single-buffered; those f32 h tiles do
not fit at K = block_v = 128. v_new and o stay f16 (the update has no state operand).

Shared memory (K = 128, 16-bit io): the forward at ``block_v = 64`` holds two pipeline stages of
the chunk inputs (~113 KB scalar gate, ~130 KB channel), the staged S, v_new and o tiles
double-buffered, and the scalar gate's P and decayed keys; a packed lane's f32 staging tile
leaves room for one o tile. A whole-state CTA (``block_v = 128``, QAT ``"matrix"``) has one o
tile; the scalar gate's keeps two pipeline stages (~129 KB), so the memory warpgroup loads chunk
c + 1 while the roles work on chunk c, with one slot of S and v_new (the state role waits for
each step's ``free``) whose space, with the keys tile's, holds the f32 h0 / end-state tile
(224 312 B as Mosaic lowers it, bf16); the channel's (~145 KB of inputs per stage) has one
pipeline stage and both slots.
"""

from __future__ import annotations

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _compat as cp
from pallas_kernels._compat import pl, plgpu
from pallas_kernels._tiles import (
    CHUNK,
    META_COLS,
    LoopConfig,
    check_meta,
    chunk_offset,
    finite,
    load_state_row,
    nonfinite,
    per_v_block_kernel,
    segment_coords,
    store_final_state,
    v_block_coords,
)
from pallas_kernels.gdn.fake_quant import (
    STATE_QUANT,
    fake_quant_e4m3,
    stage_columns,
    unstage_columns,
)

__all__ = ["ChunkFwdConfig", "chunk_fwd", "channel_chunk_fwd"]

f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class ChunkFwdConfig(LoopConfig):
    """Static configuration of :func:`chunk_fwd` and :func:`channel_chunk_fwd`:
    :class:`~pallas_kernels._tiles.LoopConfig` (scale, block_v: 64 keeps the state carry at ~140
    registers, no spills; segments) plus

    Attributes:
      store_h: backward recomputation mode: write h and v_new instead of o and the final state.
      state_quant: QAT fake quantisation (FP8-E4M3, dynamic scale) of the state entering each
        chunk, which both the chunk's products and its update then use: ``None`` (off),
        ``"column"`` (one scale per V column, amax over K) or ``"matrix"`` (one per K×V state;
        needs the whole state in one CTA, i.e. ``block_v == V``).
    """

    store_h: bool = False
    state_quant: str | None = None

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.store_h, bool):
            raise TypeError(f"{self.store_h=} must be a bool")
        if self.state_quant is not None and self.state_quant not in STATE_QUANT:
            raise ValueError(f"{self.state_quant=} must be None or one of {tuple(STATE_QUANT)}")


def _loop_refs(refs, *, store_h: bool, channel: bool, packed: bool, poisoned: bool):
    """Names the kernel's GMEM refs (inputs in :func:`_launch` order, then the outputs).

    Returns a namespace: q (q or qg; None with ``store_h``), k (k or kg), w, u, a (Aqk: the
    channel forward only), g (G [B, HV, T] or e^{G_last} [B, HV, T/64, K]), h0, nan_rows
    (poisoned channel forward), nan_from (poisoned), meta (packed) and the outputs: o, ht
    (forward) or h, vn (``store_h``).
    """
    refs = list(refs)
    out = refs[-2:]
    ins = refs[:-2]
    q = None if store_h else ins.pop(0)
    k, w, u = ins[:3]
    a = ins.pop(3) if channel and not store_h else None
    g, h0 = ins[3:5]
    rest = ins[5:]
    nan_rows = rest.pop(0) if poisoned and channel else None
    nan_from = rest.pop(0) if poisoned else None
    meta = rest.pop(0) if packed else None
    named = dict(q=q, k=k, w=w, u=u, a=a, g=g, h0=h0, nan_rows=nan_rows, nan_from=nan_from)
    named.update(meta=meta, **dict(zip(("h", "vn") if store_h else ("o", "ht"), out, strict=True)))
    return types.SimpleNamespace(**named)


def _pipeline_inputs(r, *, store_h: bool, channel: bool, b, hk, hv, iv, at, BV: int):
    """The chunk pipeline's block specs and GMEM refs, in the order the step receives its
    tiles: [q], k, w, u, [Aqk], G (or e^{G_last}), [nan_rows], [nan_from], [meta]."""
    C = CHUNK
    K, dt = r.k.shape[-1], r.k.dtype
    tile = lambda cols_: dict(dtype=dt, cols=cols_)  # noqa: E731
    qk_spec = lambda: cp.block_spec((None, C, None, K), lambda c: (b, at(c), hk, 0), **tile(K))  # noqa: E731
    specs = [] if store_h else [qk_spec()]  # q
    specs += [
        qk_spec(),  # k
        cp.block_spec((None, C, None, K), lambda c: (b, at(c), hv, 0), **tile(K)),  # w
        cp.block_spec((None, C, None, BV), lambda c: (b, at(c), hv, iv), **tile(BV)),  # u
    ]
    ins = [r.k, r.w, r.u] if store_h else [r.q, r.k, r.w, r.u]
    if r.a is not None:
        specs.append(cp.block_spec((None, C, None, C), lambda c: (b, at(c), hv, 0), **tile(C)))
        ins.append(r.a)
    if channel:  # e^{G_last} per key channel
        specs.append(cp.block_spec((None, None, None, K), lambda c: (b, hv, at(c), 0)))
    else:  # G [B, HV, T]
        specs.append(cp.block_spec((None, None, C), lambda c: (b, hv, at(c))))
    ins.append(r.g)
    if r.nan_rows is not None:
        specs.append(cp.block_spec((None, None, C), lambda c: (b, hv, at(c))))
        ins.append(r.nan_rows)
    if r.nan_from is not None:
        specs.append(cp.block_spec((None, None, None, BV), lambda c: (b, hv, at(c), iv)))
        ins.append(r.nan_from)
    if r.meta is not None:
        specs.append(cp.block_spec((None, META_COLS), lambda c: (at(c), 0)))  # (reset, final)
        ins.append(r.meta)
    return specs, ins


def _step_tiles(tiles, *, store_h: bool, channel: bool, packed: bool, poisoned: bool):
    """Names one pipeline step's SMEM tiles (the order of :func:`_pipeline_inputs`)."""
    tiles = list(tiles)
    m = tiles.pop() if packed else None
    nf = tiles.pop() if poisoned else None
    nr = tiles.pop() if poisoned and channel else None
    q = None if store_h else tiles.pop(0)
    k, w, u = tiles[:3]
    a = tiles[3] if channel and not store_h else None
    return types.SimpleNamespace(q=q, k=k, w=w, u=u, a=a, g=tiles[-1], nr=nr, nf=nf, m=m)


# the forward loop's state-role warpgroup (the output role is warpgroup 1; the memory warpgroup,
# which runs the TMA pipeline, is the last)
_STATE = 0
# the state role's SMEM tiles, in the order they share memory with the f32 state staging tile
_STATE_TILES = ("s", "vn", "kd")


def _fwd_body(
    *refs, cfg: ChunkFwdConfig, channel: bool, group: int, nt: int, packed: bool, poisoned: bool
):
    """The forward chunk loop of one CTA: two compute warpgroups in roles (module docstring).
    ``channel``: decay per key channel (inputs qg, kg, w, u, Aqk, e^{G_last}); else the scalar
    gate (inputs q, k, w, u, G; ``group`` value heads per key head). ``poisoned``: o gets the
    op's NaN from the poison inputs (see :func:`chunk_fwd`).
    """
    C, BV = CHUNK, cfg.block_v
    r = _loop_refs(refs, store_h=False, channel=channel, packed=packed, poisoned=poisoned)
    iv, hv, _, cols = v_block_coords(BV)
    # segments: this CTA runs chunks c0 … c0 + nt − 1 of batch row b; bs is its state row
    b, bs, c0 = segment_coords(cfg.segments, nt)
    hk = hv if channel else hv // group  # (the channel loop's GVA is expanded by its intra kernel)
    at = lambda c: chunk_offset(c0, c)  # noqa: E731
    K, dt = r.k.shape[-1], r.k.dtype
    wg = lax.axis_index(cp.WG_AXIS)
    # f16 io: the state is staged as f16 with one scale per column (its range is kept; the
    # output warpgroup reads the scales from SMEM)
    scaled = dt == jnp.float16
    # shared memory (module docstring): a whole-state CTA (block_v = 128) of the scalar gate has
    # one slot of the staged tiles, so the state role waits for each step's ``free``; the
    # channel's has one pipeline stage instead; both have one o tile. A packed lane's state
    # staging tile leaves room for one o tile, which the scalar gate's P shares (both [C, C] at
    # block_v = 64: P is formed once the last o store has read the tile)
    whole = BV == 128
    stages = 1 if whole and channel else 2
    slots = 1 if whole and not channel else 2
    o_single = packed or whole
    p_in_o = packed and not channel
    specs, ins = _pipeline_inputs(
        r, store_h=False, channel=channel, b=b, hk=hk, hv=hv, iv=iv, at=at, BV=BV
    )

    def scoped(r_s):
        if not packed:  # h0 and the final state: the state role's tiles' memory (RefUnion)
            state_tiles, r_s["st"] = r_s.pop("union")
            r_s.update(zip(_STATE_TILES, state_tiles, strict=False))
        s_s, vn_s, o_s, st_s = r_s["s"], r_s["vn"], r_s["o"], r_s["st"]
        ready, free, st_bar = r_s["ready"], r_s["free"], r_s["st_bar"]
        kd_s, sc_s = r_s.get("kd"), r_s.get("sc")
        p_s = o_s if p_in_o else r_s.get("p")

        def ctx(run):
            zeros = cp.to_wgmma(jnp.zeros((K, BV), f32))
            if packed:  # every state is set by its sequence's first chunk
                S0 = zeros
            else:

                def load_h0():
                    plgpu.copy_gmem_to_smem(r.h0.at[bs, hv, :, cols], st_s, st_bar)
                    plgpu.barrier_wait(st_bar)
                    return cp.load_tile(st_s)

                S0 = lax.cond(wg == _STATE, load_h0, lambda: zeros)
            S = run(S0)

            @pl.when(wg == _STATE)
            def _():
                # the output warpgroup's last reads of the staged tiles (every phase of a
                # barrier is waited for), then the end state
                for j in range(min(nt, slots)):
                    plgpu.barrier_wait(free.at[(nt - 1 - j) % slots])
                if not packed:
                    st_s[...] = S
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(st_s, r.ht.at[bs, hv, :, cols])

            plgpu.wait_smem_to_gmem(0)

        def step(idx, *args):
            *tiles, S = args
            t = _step_tiles(tiles, store_h=False, channel=channel, packed=packed, poisoned=poisoned)
            (c,) = idx
            slot = lax.rem(c, slots)
            # the state entering chunk c (staged), v_new and f16's column scales: written by the
            # state role, read by the output role; a slot is rewritten ``slots`` steps later,
            # once the output role has released it (``free``)
            s_ref, vn_ref = s_s.at[slot], vn_s.at[slot]
            sc_ref = sc_s.at[slot] if scaled else None

            def state_role(S):
                if packed:  # a sequence's first chunk loads its h0
                    S = load_state_row(t.m[0], r.h0, hv, cols, st_s, st_bar, S)
                if cfg.state_quant is not None:
                    # QAT: the carry becomes the quantised state; the chunk's products and its
                    # decayed update use it (as the xla path does)
                    S = fake_quant_e4m3(S, STATE_QUANT[cfg.state_quant])

                @pl.when(c >= slots)
                def _():
                    with jax.named_scope("state: wait free"):
                        plgpu.barrier_wait(free.at[slot])

                with jax.named_scope("state: stage S"):
                    unstage = stage_columns(S, s_ref, scaled, scales=sc_ref)
                    plgpu.commit_smem()
                with jax.named_scope("state: v_new"):
                    v_new = t.u[...].astype(f32) - unstage(cp.matmul(t.w, s_ref, (C, BV)))
                    vn_ref[...] = v_new.astype(dt)
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(ready.at[slot])
                with jax.named_scope("state: update"):
                    if channel:
                        decay = cp.bcast_rows(cp.row_vec(t.g), (K, BV))
                        S = S * decay + cp.matmul(t.k.T, vn_ref, (K, BV))
                    else:
                        # the update's keys k ⊙ e^{G_last − G}, from the op's raw k with non-finite
                        # values read as 0 (a NaN state would survive a packed lane's wipe gate,
                        # 0 · NaN, into the next sequence), in a tile of their own: the output role
                        # reads the raw tile meanwhile
                        g_r = cp.row_vec(t.g)
                        g_last = t.g[C - 1]
                        kd = finite(cp.load_tile(t.k).astype(f32))
                        kd_s[...] = (kd * cp.bcast_rows(jnp.exp(g_last - g_r), (C, K))).astype(dt)
                        plgpu.commit_smem()
                        S = S * jnp.exp(g_last) + cp.matmul(kd_s.T, vn_ref, (K, BV))
                if packed:  # a sequence's last chunk writes its end state
                    store_final_state(t.m[1], S, st_s, r.ht, hv, cols)
                return cp.to_wgmma(S)

            def output_role(S):
                unstage = unstage_columns(sc_ref, scaled)
                if not channel:  # P, before the state role's tiles are needed
                    g_r = cp.row_vec(t.g)  # (loaded before the iotas: Mosaic's layout inference)
                    row = cp.iota((C, C), 0)
                    col = cp.iota((C, C), 1)
                    causal = row >= col
                    g_c = cp.col_vec(t.g, C)
                    gd = cp.bcast_rows(g_r, (C, C)) - cp.bcast_cols(g_c, (C, C))
                    # the op's raw q and k: a non-finite k_j makes column j of q kᵀ non-finite,
                    # so the causal rows i >= j of o, which the op's NaN covers (a bad k
                    # poisons its token's outputs and all later ones); a non-finite q makes
                    # every entry of its row non-finite, the causal ones included
                    qk = cp.matmul(t.q, t.k.T, (C, C))
                    if poisoned:
                        q_bad = jnp.max(jnp.where(causal, nonfinite(qk), 0.0), axis=1)
                    p = jnp.where(causal, qk * jnp.exp(jnp.where(causal, gd, 0.0)), 0.0)
                    if p_in_o:  # the last o store has read the tile
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    p_s[...] = p.astype(dt)
                    plgpu.commit_smem()
                with jax.named_scope("output: wait ready"):
                    plgpu.barrier_wait(ready.at[slot])
                o_inter = unstage(cp.matmul(t.q, s_ref, (C, BV)))
                if not channel:  # (the channel loop's qg is decayed already)
                    o_inter = o_inter * cp.bcast_rows(jnp.exp(g_r), (C, BV))
                intra = t.a if channel else p_s  # the causal, decayed q kᵀ of the chunk
                o = (o_inter + cp.matmul(intra, vn_ref, (C, BV))) * cfg.scale
                plgpu.barrier_arrive(free.at[slot])
                if poisoned:  # the op's NaN: whole rows (a bad q) and columns from a row on
                    rows = cp.iota((C, BV), 0).astype(f32)
                    from_row = cp.bcast_cols(cp.col_vec(t.nf, BV), (C, BV))
                    if channel:
                        o = o + cp.bcast_rows(cp.row_vec(t.nr), (C, BV))
                    else:
                        o = o + jnp.where(cp.bcast_rows(q_bad, (C, BV)) > 0, jnp.nan, 0.0)
                    o = o + jnp.where(rows >= from_row, jnp.nan, 0.0)
                # the o store that last read this tile has finished reading it (with P in the o
                # tile, P v_new has read P: the product waits for its wgmma)
                plgpu.wait_smem_to_gmem(0 if o_single else 1, wait_read_only=True)
                o_ref = o_s if o_single else o_s.at[slot]
                o_ref[...] = o.astype(dt)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_ref, r.o.at[b, pl.ds(at(c) * C, C), hv, cols])
                return cp.to_wgmma(S)

            return lax.cond(wg == _STATE, state_role, output_role, S)

        plgpu.emit_pipeline_warp_specialized(
            step,
            grid=(nt,),
            memory_registers=40,
            in_specs=specs,
            max_concurrent_steps=stages,
            wg_axis=cp.WG_AXIS,
            num_compute_wgs=2,
            compute_context=ctx,
        )(*ins)

    # the state role's tiles (_STATE_TILES order): the staged state, v_new, the decayed keys
    state_tiles = [cp.smem((slots, K, BV), dt), cp.smem((slots, C, BV), dt)]
    if not channel:
        state_tiles.append(cp.smem((C, K), dt))
    # the f32 staging tile shares the staged state's memory; a whole-state CTA's needs v_new's
    # and the keys' too
    shared = len(state_tiles) if whole and not channel else 1
    scratch = dict(
        o=cp.smem((C, BV) if o_single else (2, C, BV), dt),
        ready=plgpu.Barrier(num_barriers=slots),  # the state role has staged S and v_new
        free=plgpu.Barrier(num_barriers=slots),  # the output role has read them
        st_bar=plgpu.Barrier(),  # the h0 loads
    )
    st = cp.smem((K, BV), f32)  # h0 / final state staging
    if packed:  # its own f32 tile: sequences start and end mid-loop
        scratch.update(zip(_STATE_TILES, state_tiles, strict=False), st=st)
    else:
        scratch["union"] = plgpu.RefUnion(tuple(state_tiles[:shared]), st)
        scratch.update(zip(_STATE_TILES[shared:], state_tiles[shared:], strict=False))
    if not channel and not p_in_o:
        scratch["p"] = cp.smem((C, C), dt)
    if scaled:
        scratch["sc"] = plgpu.SMEM((slots, BV), f32)  # the staged state's column scales
    pl.run_scoped(lambda **r_s: scoped(r_s), **scratch, collective_axes=cp.WG_AXIS)


def _store_h_body(*refs, cfg: ChunkFwdConfig, channel: bool, group: int, nt: int, packed: bool):
    """The backward's recomputation loop of one CTA (one warpgroup): writes h and v_new.
    ``channel`` and ``group`` as for :func:`_fwd_body`."""
    C, BV = CHUNK, cfg.block_v
    r = _loop_refs(refs, store_h=True, channel=channel, packed=packed, poisoned=False)
    iv, hv, _, cols = v_block_coords(BV)
    b, bs, c0 = segment_coords(cfg.segments, nt)
    hk = hv if channel else hv // group
    at = lambda c: chunk_offset(c0, c)  # noqa: E731
    K, dt = r.k.shape[-1], r.k.dtype
    # f16 io: the state is staged as f16 with one scale per column, and h is written in f32
    # from a second, f32 tile (docs/design.md: never stage the state through plain f16)
    scaled = dt == jnp.float16

    def load_h0(h0_s, bar):
        plgpu.copy_gmem_to_smem(r.h0.at[bs, hv, :, cols], h0_s, bar)
        plgpu.barrier_wait(bar)
        return cp.to_wgmma(h0_s[...])

    if packed:  # every state is set by its sequence's first chunk
        S0 = cp.to_wgmma(jnp.zeros((K, BV), f32))
    else:
        S0 = pl.run_scoped(load_h0, cp.smem((K, BV), f32), plgpu.Barrier())
    specs, ins = _pipeline_inputs(
        r, store_h=True, channel=channel, b=b, hk=hk, hv=hv, iv=iv, at=at, BV=BV
    )

    def scoped(s_s, vn_s, *bufs):
        # scalar gate: vd_s; f16: the f32 h tiles; packed: the h0 staging tile and its barrier
        bufs = list(bufs)
        st_s, st_bar = (bufs.pop(), bufs.pop())[::-1] if packed else (None, None)
        vd_s = None if channel else bufs.pop(0)
        hf_s = bufs.pop(0) if scaled else None

        def step(idx, *args):
            *tiles, S = args
            t = _step_tiles(tiles, store_h=True, channel=channel, packed=packed, poisoned=False)
            (c,) = idx
            slot = lax.rem(c, 2)
            if packed:  # a sequence's first chunk loads its h0
                S = load_state_row(t.m[0], r.h0, hv, cols, st_s, st_bar, S)
            if cfg.state_quant is not None:  # QAT: h is the quantised state the forward used
                S = fake_quant_e4m3(S, STATE_QUANT[cfg.state_quant])
            # the stores issued two steps ago (same slot) must have finished reading SMEM
            plgpu.wait_smem_to_gmem(2, wait_read_only=True)
            # with f16 h is stored from the f32 tile, so the staged one is not a TMA source
            s_ref = s_s if scaled else s_s.at[slot]
            vn_ref = vn_s.at[slot]
            unstage = stage_columns(S, s_ref, scaled)
            if scaled:
                hf_s.at[slot][...] = S
            plgpu.commit_smem()
            h_src = hf_s.at[slot] if scaled else s_ref
            plgpu.copy_smem_to_gmem(h_src, r.h.at[b, at(c), hv, :, cols])
            v_new = t.u[...].astype(f32) - unstage(cp.matmul(t.w, s_ref, (C, BV)))
            vn_ref[...] = v_new.astype(dt)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(vn_ref, r.vn.at[b, pl.ds(at(c) * C, C), hv, cols])
            if channel:
                decay = cp.bcast_rows(cp.row_vec(t.g), (K, BV))
                return S * decay + cp.matmul(t.k.T, vn_ref, (K, BV))
            g_r = cp.row_vec(t.g)
            g_last = t.g[C - 1]
            vd = v_new * cp.bcast_rows(jnp.exp(g_last - g_r), (C, BV))
            vd_s[...] = vd.astype(dt)
            plgpu.commit_smem()
            return S * jnp.exp(g_last) + cp.matmul(t.k.T, vd_s, (K, BV))

        plgpu.emit_pipeline(
            step, grid=(nt,), in_specs=specs, max_concurrent_steps=2, init_carry=S0
        )(*ins)
        plgpu.wait_smem_to_gmem(0)

    bufs = () if channel else (cp.smem((C, BV), dt),)
    if scaled:
        bufs += (cp.smem((2, K, BV), f32),)  # f16: h in f32
    if packed:
        bufs += (cp.smem((K, BV), f32), plgpu.Barrier())  # h0 staging
    s_shape = (K, BV) if scaled else (2, K, BV)
    pl.run_scoped(scoped, cp.smem(s_shape, dt), cp.smem((2, C, BV), dt), *bufs)


def _check_shapes(config: ChunkFwdConfig, T: int, V: int) -> None:
    if T % CHUNK or V % config.block_v:
        raise ValueError(f"{T=}, {V=}, block_v={config.block_v}: T % 64 and V % block_v must be 0")


def _check_state_quant(config: ChunkFwdConfig, V: int) -> None:
    if config.state_quant == "matrix" and config.block_v != V:
        raise NotImplementedError(
            f"V={V}, block_v={config.block_v}: QAT state granularity 'matrix' needs the "
            "whole K×V state in one CTA (block_v == V); use 'column' or block_v=V"
        )


def _check_segments(config: ChunkFwdConfig, shape, nt: int, packed: bool, h0) -> int:
    """The segment count, checked against the lanes (``shape`` [B, T, ...]) and h0's rows."""
    segs, B = config.segments, shape[0]
    if nt % segs:
        raise ValueError(f"{shape=}, segments={segs}: T / 64 must be a multiple of segments")
    if segs > 1 and config.state_quant is not None:
        raise NotImplementedError("segments > 1 with the QAT state quant (not an affine map)")
    if segs > 1 and not packed and h0.shape[0] != B * segs:
        raise ValueError(f"{h0.shape=}: with segments={segs} h0 needs B·segments = {B * segs} rows")
    return segs


def _check_packed(config: ChunkFwdConfig, meta) -> None:
    if meta is not None and config.block_v == 128:
        raise NotImplementedError("packed states with block_v=128: no SMEM for the state staging")


def _poison_inputs(poison, config: ChunkFwdConfig, channel: bool, B, HV, T, V) -> tuple:
    """The kernel's poison inputs: ``(nan_rows, nan_from)`` for the channel loop, ``(nan_from,)``
    for the scalar gate's (it finds the rows of a bad q itself), () without poison."""
    if poison is None:
        return ()
    if config.store_h:
        raise ValueError("poison: the store_h loop writes no o")
    nan_rows, nan_from = poison
    if (nan_rows is None) == channel:
        need = "an array" if channel else "None (the loop finds the rows of a bad q itself)"
        raise ValueError(f"poison: nan_rows must be {need}")
    ins = (nan_rows, nan_from) if channel else (nan_from,)
    want = ((B, HV, T), (B, HV, T // CHUNK, V))[2 - len(ins) :]
    got = tuple(tuple(x.shape) for x in ins)
    if got != want or any(x.dtype != f32 for x in ins):
        raise ValueError(f"poison shapes {got}: expected f32 arrays of shapes {want}")
    return ins


def _launch(ins, meta, poison, config: ChunkFwdConfig, *, rows: int, name: str, **body_kw):
    """Runs the loop on its inputs ``ins`` (keys, w, u [B, T, HV, V], ..., h0 last; keys
    [B, T, ·, K] are ``ins[0]`` with ``store_h``, else ``ins[1]``) on ``rows`` lanes
    (B · segments), with the poison inputs (:func:`_poison_inputs`) and the per-chunk table
    (or None)."""
    keys = ins[0] if config.store_h else ins[1]
    u, h0 = ins[2 if config.store_h else 3], ins[-1]
    B, T, _, K = keys.shape
    HV, V = u.shape[2], u.shape[3]
    dt = keys.dtype
    if config.store_h:
        out_type = (
            jax.ShapeDtypeStruct((B, T // CHUNK, HV, K, V), f32 if dt == jnp.float16 else dt),
            jax.ShapeDtypeStruct((B, T, HV, V), dt),
        )
    else:
        out_type = (
            jax.ShapeDtypeStruct((B, T, HV, V), dt),
            jax.ShapeDtypeStruct(h0.shape if meta is not None else (rows, HV, K, V), f32),
        )

    packed = meta is not None
    if config.store_h:
        body = functools.partial(_store_h_body, cfg=config, packed=packed, **body_kw)
    else:
        body = functools.partial(
            _fwd_body, cfg=config, packed=packed, poisoned=bool(poison), **body_kw
        )
    # the forward: two compute warpgroups in roles and the pipeline's memory warpgroup
    fn = per_v_block_kernel(
        body,
        out_type,
        v_blocks=V // config.block_v,
        HV=HV,
        B=rows,
        name=name,
        warpgroups=1 if config.store_h else 3,
    )
    return fn(*ins, *poison, *(() if meta is None else (meta,)))


def chunk_fwd(
    q: jax.Array | None,
    k: jax.Array,
    w: jax.Array,
    u: jax.Array,
    g_cum: jax.Array,
    h0: jax.Array,
    config: ChunkFwdConfig,
    meta: jax.Array | None = None,
    poison: tuple[None, jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The chunk loop of the scalar gate (GDN).

    Args:
      q, k: [B, T, H, K] (q unused/None with ``store_h``); T a multiple of 64. Non-finite
        values in k are read as 0; in q they reach only their own row of o.
      w: [B, T, HV, K]; u: [B, T, HV, V] (from :func:`pallas_kernels.gdn.intra.intra_chunk`).
      g_cum: [B, HV, T] f32 chunk-local cumulative log-decay.
      h0: [B, HV, K, V] f32 initial state ([N, HV, K, V] with ``meta``). With
        ``config.segments = S > 1`` (T/64 a multiple of S): [B·S, HV, K, V], the state entering
        each segment (row b·S + j: segment j of batch row b); with ``meta`` the table rows that
        column 0 names (every segment's first chunk must name one).
      config: :class:`ChunkFwdConfig`.
      meta: packed sequences on one lane (B == 1): [T/64, META_COLS] int32, column 0 the
        sequence whose first chunk this is (its state is set to h0[that]) or -1, column 1 the
        sequence whose last chunk this is (its end state is written to final[that]) or -1.
      poison: the op's NaN, added to o as it is stored (the non-finite inputs' outputs,
        :mod:`gdn_jax.ops._sanitize`), or None: ``(None, nan_from [B, HV, T/64, V] f32)``, per
        chunk the row from which each value column is NaN (64: none); the rows of a non-finite
        q (every entry of their q kᵀ row is non-finite) are NaN as well. Not with ``store_h``.
    Returns:
      Default: (o [B, T, HV, V] in k.dtype, final state [B, HV, K, V] f32; [N, HV, K, V] with
      ``meta``, rows of sequences without chunks unwritten; [B·S, HV, K, V] with S segments and
      no ``meta``: each segment's end state).
      ``store_h``: (h [B, T/64, HV, K, V] in k.dtype (f32 for f16 io), the state entering each
      chunk (after ``config.state_quant``); v_new [B, T, HV, V]).
    Raises:
      NotImplementedError: f16 ``store_h`` with block_v = 128 (the f32 h tiles and the decayed
        v_new tile do not fit in SMEM); see also :func:`channel_chunk_fwd`; segments with the
        QAT state quant (the segment map is not affine then).
    """
    B, T, H, K = k.shape
    HV, V = u.shape[2], u.shape[3]
    _check_shapes(config, T, V)
    if config.store_h and k.dtype == jnp.float16 and config.block_v == 128:
        raise NotImplementedError("f16 with block_v=128: the f32 h tiles do not fit in SMEM")
    _check_state_quant(config, V)
    nt = T // CHUNK
    packed = meta is not None
    check_meta(meta, B, nt)
    segs = _check_segments(config, k.shape, nt, packed, h0)
    _check_packed(config, meta)
    poison = _poison_inputs(poison, config, False, B, HV, T, V)
    ins = (k, w, u, g_cum, h0) if config.store_h else (q, k, w, u, g_cum, h0)
    name = "gdn_chunk_h" if config.store_h else "gdn_chunk_fwd"
    body_kw = dict(channel=False, group=HV // H, nt=nt // segs)
    return _launch(ins, meta, poison, config, rows=B * segs, name=name, **body_kw)


def channel_chunk_fwd(
    qg: jax.Array | None,
    kg: jax.Array,
    w: jax.Array,
    u: jax.Array,
    aqk: jax.Array | None,
    decay_last: jax.Array,
    h0: jax.Array,
    config: ChunkFwdConfig,
    meta: jax.Array | None = None,
    poison: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The chunk loop of the decay per key channel (GDN2 / KDA).

    Args:
      qg, kg, w: [B, T, HV, K] (from :func:`pallas_kernels.channel.intra.channel_intra`);
        qg unused/None with ``store_h``. T a multiple of 64.
      u: [B, T, HV, V]; aqk: [B, T, HV, 64] (None with ``store_h``).
      decay_last: [B, HV, T/64, K] f32, e^{G_last} per chunk and key channel.
      h0: [B, HV, K, V] f32 initial state ([N, HV, K, V] with ``meta``); with segments, the
        state entering each segment, as for :func:`chunk_fwd`.
      config: :class:`ChunkFwdConfig`.
      meta: packed sequences on one lane (B == 1): the table of :func:`chunk_fwd`.
      poison: the op's NaN added to o as for :func:`chunk_fwd`, or None: ``(nan_rows [B, HV, T]
        f32`` (NaN on the rows whose whole output is NaN, a bad q's; else 0), ``nan_from)``.
    Returns:
      Default: (o [B, T, HV, V] in kg.dtype, final state [B, HV, K, V] f32; [N, HV, K, V] with
      ``meta``, rows of sequences without chunks unwritten; [B·S, HV, K, V] with S segments and
      no ``meta``: each segment's end state).
      ``store_h``: (h [B, T/64, HV, K, V] in kg.dtype (f32 for f16 io), the state entering each
      chunk; v_new [B, T, HV, V] in kg.dtype).
    Raises:
      NotImplementedError: f16 io with ``store_h`` at K = block_v = 128 (the f32 h tiles do not
        fit in shared memory; block_v = 64 does); ``meta`` with block_v = 128 (no shared memory
        for the state staging tile); ``state_quant="matrix"`` with block_v < V (the state's
        scale needs all of it in one CTA); segments with the QAT state quant.
    """
    B, T, HV, K = kg.shape
    V = u.shape[3]
    _check_shapes(config, T, V)
    f16 = kg.dtype == jnp.float16
    if config.store_h and f16 and K * config.block_v > 128 * 64:
        raise NotImplementedError(
            f"f16 store_h with K={K}, block_v={config.block_v}: the two f32 [K, block_v] h tiles "
            "do not fit in shared memory; use block_v=64"
        )
    _check_state_quant(config, V)
    nt = T // CHUNK
    check_meta(meta, B, nt)
    segs = _check_segments(config, kg.shape, nt, meta is not None, h0)
    _check_packed(config, meta)
    poison = _poison_inputs(poison, config, True, B, HV, T, V)
    ins = (kg, w, u, decay_last, h0) if config.store_h else (qg, kg, w, u, aqk, decay_last, h0)
    name = "chan_chunk_h" if config.store_h else "chan_chunk_fwd"
    body_kw = dict(channel=True, group=1, nt=nt // segs)
    return _launch(ins, meta, poison, config, rows=B * segs, name=name, **body_kw)
