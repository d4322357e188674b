"""Times chunked GDN forward and forward+backward: pallas vs xla vs FLA, in one run.

Usage (on the GPU machine, from the checkout)::

    PYTHONPATH=. python3 benchmarks/bench_gdn.py [--shapes NAME ...] [--impls pallas xla fla]
        [--json PATH|auto|none] [--stages] [--variant gdn|kda|gdn2] [--fwd-only]
        [--qat [off column_row matrix_tile]] [--segments S ...]

Timing: jitted JAX functions are dispatched ``iters`` times back to back after a warm-up and the
device is synchronised once; the per-call time of each such batch is recorded and the median of
``reps`` batches is reported (the GPU queue stays full, so this is device time). FLA is timed with
``triton.testing.do_bench`` (CUDA events, median). q and k are L2-normalised beforehand and the op
runs with ``use_qk_l2norm=False`` in every implementation, so the core op alone is compared.

FLA's gated backward is refused on Triton < 3.7.1 (its issue #640, a Triton miscompile); for timing
only, this script sets ``fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 = True`` and says so.

Results: the run updates the ``ops`` file of :mod:`benchmarks.results` (rows ``variant, shape,
mode, dtype, pallas_ms, xla_ms, fla_ms, floor_ms``; ``--qat`` rows add ``qat``; ``--stages`` adds
``stages``, per-kernel times: ours each timed alone, FLA's from a ``torch.profiler`` trace of its
forward and of its forward+backward when ``fla`` is among the impls), by default
``benchmarks/results/ops_<device>.json`` on a GPU; it is rewritten after every shape, so a run cut
short keeps what it measured.

Long context (``benchmarks.shapes.LONG_CONTEXT``, packed ``_P`` shapes run with ``cu_seqlens``):
every row prints the segment count the pallas path picks (``pallas_segments``); on shapes where
that count is > 1, ``--segments 1 2 8`` also times the pallas path at those forced counts, and
for GDN ``--stages`` then times the kernels of the segmented loops too (dense shapes).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import statistics
import sys
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, ".")
from benchmarks import results  # noqa: E402
from benchmarks.shapes import CHUNKED, SHAPES  # noqa: E402
from pallas_kernels import CHUNK as C  # noqa: E402

COPY_BW = 4.07e12  # bytes/s, H200 device-to-device copy bandwidth (a large jitted copy)
MM_RATE = 700e12  # FLOP/s, bf16 dense matmul ceiling used for the floor


def roofline(s) -> dict:
    """Minimal HBM bytes and matmul FLOPs of the chunked algorithm (C = 64) for one shape.

    fwd per (chunk, value head): K Kᵀ, doubling inverse (10 wgmma of C³), w, u, then w S, q S,
    q kᵀ, P v_new, kᵀ v_dec. bwd: recompute (intra + states), dh loop, dv_local, dq/dk/dw, WY bwd.
    Bytes: inputs read and outputs written once (io dtype 2 bytes, gates f32).
    """
    B, T, H, HV, K, V = s.B, s.T, s.H, s.HV, s.K, s.V
    nch = B * HV * math.ceil(T / C)
    intra = 2 * C * C * K + 20 * C**3 + 2 * C * C * (K + V)
    loop = 6 * C * K * V + 2 * C * C * (K + V)
    fwd = nch * (intra + loop)
    bwd_extra = 3 * 2 * C * K * V + 2 * C * C * (K + V)  # dh loop + dv_local
    bwd_extra += 3 * 2 * C * K * V + 2 * C * C * (2 * K + V)  # dq, dk, dw
    bwd_extra += 2 * C * C * (2 * K + 2 * V) + 4 * C**3 + 4 * C * C * K  # WY bwd
    bwd = nch * (intra + 4 * C * K * V + bwd_extra)  # recompute: intra, w S and kᵀ v_dec
    io = 2
    x_bytes = B * T * (2 * H * K + HV * V) * io + 2 * B * T * HV * 4
    o_bytes = B * T * HV * V * io
    fwd_bytes = x_bytes + o_bytes
    fb_bytes = 2 * x_bytes + 2 * o_bytes  # + do read, + dq dk dv dg dbeta written
    return {
        "fwd_flops": fwd,
        "fwdbwd_flops": fwd + bwd,
        "fwd_bytes": fwd_bytes,
        "fwdbwd_bytes": fb_bytes,
        "fwd_floor_ms": 1e3 * max(fwd_bytes / COPY_BW, fwd / MM_RATE),
        "fwdbwd_floor_ms": 1e3 * max(fb_bytes / COPY_BW, (fwd + bwd) / MM_RATE),
    }


def inputs(s, seed=0, variant="gdn"):
    r = np.random.default_rng(seed)
    B, T, H, HV, K, V = s.B, s.T, s.H, s.HV, s.K, s.V

    def unit(shape):
        x = r.standard_normal(shape, dtype=np.float32)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    gshape = (B, T, HV) if variant == "gdn" else (B, T, HV, K)
    x = dict(
        q=unit((B, T, H, K)),
        k=unit((B, T, H, K)),
        v=r.standard_normal((B, T, HV, V), dtype=np.float32),
        g=np.log(r.uniform(0.9, 1.0, gshape)).astype(np.float32),
        beta=r.uniform(0.0, 1.0, (B, T, HV)).astype(np.float32),
        do=r.standard_normal((B, T, HV, V), dtype=np.float32),
    )
    if variant == "gdn2":  # erase gate per key channel, write gate per value channel
        x["b"] = r.uniform(0.0, 1.0, (B, T, HV, K)).astype(np.float32)
        x["w"] = r.uniform(0.0, 1.0, (B, T, HV, V)).astype(np.float32)
        del x["beta"]
    return x


def time_jax(f, args, *, iters=20, reps=7) -> float:
    out = f(*args)
    jax.block_until_ready(out)
    for _ in range(3):
        jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = f(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    return 1e3 * statistics.median(times)


def pallas_vs_xla_main(doc: str, shapes: dict, bench, argv=None, *, iters: int = 20) -> int:
    """The command line of a script that times one op's pallas and xla forms in one run
    (``bench_short_conv.py``, ``bench_lm_head.py``): ``bench(name, iters)`` returns a shape's
    ``ops`` rows (with ``pallas_ms``, ``xla_ms``, ``floor_ms``); they are printed as a table and
    added to the ``ops`` file of :mod:`benchmarks.results`."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--shapes", nargs="*", default=list(shapes), choices=list(shapes))
    p.add_argument("--iters", type=int, default=iters)
    p.add_argument("--json", default="auto", help="ops file to update; auto: on a GPU")
    args = p.parse_args(argv)
    date, rows = results.now(), []
    w = max(map(len, args.shapes), default=5)
    print(f"{'shape':{w}s} {'mode':7s} {'pallas ms':>9s} {'xla ms':>8s} {'xla/pallas':>10s} "
          f"{'floor ms':>8s}")  # fmt: skip
    for name in args.shapes:
        for r in bench(name, args.iters):
            rows.append(r)
            ratio = r["xla_ms"] / r["pallas_ms"]
            print(f"{name:{w}s} {r['mode']:7s} {r['pallas_ms']:9.3f} {r['xla_ms']:8.3f} "
                  f"{ratio:10.2f} {r['floor_ms']:8.3f}", flush=True)  # fmt: skip
    results.write(results.output_path(args.json, "ops"), "ops", rows, date=date)
    return 0


def bench_jax(
    s,
    impl,
    x,
    variant="gdn",
    fwd_only=False,
    qat=None,
    skip_fwd=False,
    dtype="bfloat16",
    segments=None,
) -> dict:
    """Times of one implementation; q, k, v, do and the gates β, b, w in the io ``dtype`` (the
    tensors FLA's op gets, :func:`_fla_calls`), the log-decay g f32. ``segments`` (pallas):
    force the segment count of the forward's chunk loop (GDN: and of the backward's)."""
    import gdn_jax

    bf = jnp.dtype(dtype)
    q, k, v = (jnp.asarray(x[n], bf) for n in ("q", "k", "v"))
    gates = ("b", "w") if variant == "gdn2" else ("beta",)
    gate_args = (jnp.asarray(x["g"]), *(jnp.asarray(x[n], bf) for n in gates))
    do = jnp.asarray(x["do"], bf)
    fn = {"gdn": gdn_jax.gated_delta_rule, "kda": gdn_jax.kda, "gdn2": gdn_jax.gdn2}[variant]
    cu = s.cu_seqlens()
    kw = {} if cu is None else {"cu_seqlens": jnp.asarray(cu, jnp.int32)}
    if segments is not None and impl != "pallas":
        raise ValueError(f"{segments=} needs impl 'pallas'")

    def op(*a):
        return fn(*a, implementation=impl, qat=qat, **kw)[0]

    fwd = jax.jit(op)
    # do is an argument, not a closure constant: XLA would constant-fold its transposes (minutes)
    args = (q, k, v) + gate_args
    fb = jax.jit(forward_backward(op))
    with forced_segments(segments, variant):  # active while the programs are traced (first call)
        r = {} if skip_fwd else {"fwd_ms": time_jax(fwd, args)}
        if not fwd_only:
            r["fwdbwd_ms"] = time_jax(fb, (*args, do), iters=10)
    return r


def forward_backward(op):
    """``(*args, do) -> (o, grads of args)``: ``op``'s forward and its VJP with the output
    cotangent ``do`` — the work of FLA's ``o = op(...); o.backward(do)``, with no loss reduction
    or elementwise product on top."""

    def run(*a):
        *a, do = a
        o, pullback = jax.vjp(op, *a)
        return o, pullback(do)

    return run


def forced_segments(segments: int | None, variant: str = "gdn"):
    """Context in which the public op of ``variant`` uses ``segments`` segments (None: its own
    choice), so that forced counts are timed through the same op (input sanitation included) as
    the default."""
    if segments is None:
        return contextlib.nullcontext()
    from gdn_jax.ops import _channel_pallas, _gdn_pallas

    glue = _gdn_pallas if variant == "gdn" else _channel_pallas
    return mock.patch.object(glue, "_segments_for", lambda *a, **kw: segments)


QAT_CONFIGS = ("off", "column_row", "matrix_tile")


def bench_qat(shapes, impls, names=QAT_CONFIGS, skip_fwd=False) -> list[dict]:
    """QAT cost: fwd and fwd+bwd of each impl with QAT off and on (both sites; ``names`` picks
    granularity pairs state_w), all in one run; ``skip_fwd`` times fwd+bwd only."""
    from gdn_jax.qat import QATConfig

    configs = {
        "off": None,
        "column_row": QATConfig(state_granularity="column", w_granularity="row"),
        "matrix_tile": QATConfig(state_granularity="matrix", w_granularity="tile"),
    }
    configs = {n: configs[n] for n in names}
    rows = []
    for name in shapes:
        s, x = SHAPES[name], inputs(SHAPES[name])
        for impl in impls:
            for cname, cfg in configs.items():
                try:
                    r = bench_jax(s, impl, x, qat=cfg, skip_fwd=skip_fwd)
                except Exception as e:  # noqa: BLE001  report and go on
                    r = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                rows.append({"shape": name, "impl": impl, "qat": cname, **r})
                print(name, impl, "qat", cname, json.dumps(r), flush=True)
    return rows


def print_qat(rows: list[dict]) -> None:
    """The QAT-cost table of :func:`bench_qat`'s rows."""
    hdr = ("shape", "impl", "qat", "fwd", "cost", "fwd+bwd", "cost")
    print("\n{:26s} {:7s} {:12s} {:>8s} {:>7s} {:>8s} {:>7s}".format(*hdr))
    base = {(r["shape"], r["impl"]): r for r in rows if r["qat"] == "off"}
    for r in rows:
        b = base.get((r["shape"], r["impl"]), {})
        keys = ("fwd_ms", "fwdbwd_ms")
        t = [r.get(k, float("nan")) for k in keys]
        c = [r.get(k, float("nan")) / b.get(k, float("nan")) - 1 for k in keys]
        print(
            f"{r['shape']:26s} {r['impl']:7s} {r['qat']:12s} "
            f"{t[0]:8.3f} {c[0]:+7.1%} {t[1]:8.3f} {c[1]:+7.1%}"
        )


MODES = (("fwd", "fwd_ms"), ("fwdbwd", "fwdbwd_ms"))


def ops_rows(row: dict, qat: str | None = None) -> list[dict]:
    """One measured shape (``{"shape", "variant", "dtype", impl: {"fwd_ms", ...}}``) as result
    rows, one per mode that was timed (``--fwd-only`` gives no fwdbwd rows, so it keeps those of
    an earlier run): ``{impl}_ms`` (None where not measured) and ``{impl}_error``; and one per
    forced segment count and timed mode."""

    def timed(m: dict, key: str) -> bool:
        return m.get(key) is not None or "error" in m

    out = []
    for mode, key in MODES:
        if not any(timed(row.get(impl, {}), key) for impl in ("pallas", "xla", "fla")):
            continue
        r = {k: row[k] for k in ("variant", "shape", "dtype")} | {"mode": mode}
        if qat is not None:
            r["qat"] = qat
        for impl in ("pallas", "xla", "fla"):
            m = row.get(impl, {})
            r[f"{impl}_ms"] = m.get(key)
            if "error" in m:
                r[f"{impl}_error"] = m["error"]
        if "fwd_floor_ms" in row:
            r["floor_ms"] = row[f"{mode}_floor_ms"]
        if "pallas_segments" in row:
            r["pallas_segments"] = row["pallas_segments"]
        if row.get("fla", {}).get("patched_triton_gate") and mode == "fwdbwd":
            r["fla_note"] = "gated backward forced on for timing (TRITON_ABOVE_3_7_1)"
        out.append(r)
        # forced segment counts (``--segments``): rows of their own, keyed by the count
        for S, m in row.get("pallas_by_segments", {}).items():
            if not timed(m, key):
                continue
            f = {k: row[k] for k in ("variant", "shape", "dtype")} | {"mode": mode}
            f |= {"segments": int(S), "pallas_ms": m.get(key)}
            f["pallas_segments"] = row.get("pallas_segments")
            if "error" in m:
                f["pallas_error"] = m["error"]
            out.append(f)
    return out


@jax.jit
def poison_flags(v, rows, heads, log_decays, cols):
    """The public op's edge-value work in XLA on the pallas path (:func:`gdn_jax.ops._sanitize.
    poison`): the flags of what the kernels do not flag (GDN: the gates; KDA, GDN2: q, k, v and
    the gates) and the first bad token per head and value column. The kernels read the inputs'
    non-finite values as 0 (GDN's also find k's and v's) and the loops add the NaN to o."""
    from gdn_jax.ops import _sanitize

    return _sanitize.poison(v.shape, None, rows=rows, heads=heads, log_decays=log_decays, cols=cols)


def bench_stages(s, x) -> dict:
    """Per-kernel times of the pallas path (padded layout, T a multiple of 64), and
    ``poison_flags``: the public op's edge-value flags around them (:func:`poison_flags`)."""
    from pallas_kernels._tiles import LoopConfig
    from pallas_kernels.gdn.bwd_dqkw import bwd_dqkw
    from pallas_kernels.gdn.bwd_wy import bwd_wy
    from pallas_kernels.gdn.intra import IntraConfig, intra_chunk
    from pallas_kernels.recurrence.bwd_dh import chunk_bwd_dh
    from pallas_kernels.recurrence.chunk_fwd import ChunkFwdConfig, chunk_fwd

    bf = jnp.bfloat16
    q, k, v = (jnp.asarray(x[n], bf) for n in ("q", "k", "v"))
    B, T, HV = s.B, s.T, s.HV
    G = jnp.cumsum(jnp.asarray(x["g"]).reshape(B, T // C, C, HV), 2).reshape(B, T, HV)
    G = G.transpose(0, 2, 1)
    beta = jnp.asarray(x["beta"]).transpose(0, 2, 1)
    h0 = jnp.zeros((B, HV, s.K, s.V), jnp.float32)
    cfg = ChunkFwdConfig(scale=s.K**-0.5)
    intra = jax.jit(lambda k, v, G, b: intra_chunk(k, v, G, b, IntraConfig()))
    intra_a = jax.jit(lambda k, v, G, b: intra_chunk(k, v, G, b, IntraConfig(store_a=True)))
    w, u = intra(k, v, G, beta)[0]
    fwd = jax.jit(lambda q, k, w, u, G, h0: chunk_fwd(q, k, w, u, G, h0, cfg))
    cfg_h = ChunkFwdConfig(scale=s.K**-0.5, store_h=True)
    hrec = jax.jit(lambda k, w, u, G, h0: chunk_fwd(None, k, w, u, G, h0, cfg_h))
    _, _, A = intra_a(k, v, G, beta)[0]
    h, vn = hrec(k, w, u, G, h0)
    do = jnp.asarray(x["do"], bf)
    dht = jnp.zeros_like(h0)
    dh_fn = jax.jit(
        lambda q, k, w, do, G, dht: chunk_bwd_dh(q, k, w, do, G, dht, LoopConfig(s.K**-0.5))
    )
    dh, dv2, _ = dh_fn(q, k, w, do, G, dht)
    # dq and dk in the dtype the op (no l2norm, as timed here) has them leave the kernels
    gdt = bf if s.H == HV else jnp.float32
    dqkw = jax.jit(lambda *a: bwd_dqkw(*a, scale=s.K**-0.5, dq_dtype=gdt))
    dks, dw = dqkw(q, k, h, dh, vn, do, dv2, G)[1:3]
    wy = jax.jit(lambda *a: bwd_wy(*a, dk_dtype=gdt))
    g_raw, b_raw = jnp.asarray(x["g"]), jnp.asarray(x["beta"])
    return {
        "poison_flags": time_jax(poison_flags, (v, (), (b_raw,), (g_raw,), ())),
        "gdn_intra": time_jax(intra, (k, v, G, beta)),
        "gdn_intra(store_a)": time_jax(intra_a, (k, v, G, beta)),
        "gdn_chunk_fwd": time_jax(fwd, (q, k, w, u, G, h0)),
        "gdn_chunk_h": time_jax(hrec, (k, w, u, G, h0)),
        "gdn_chunk_bwd_dh": time_jax(dh_fn, (q, k, w, do, G, dht)),
        "gdn_bwd_dqkw": time_jax(dqkw, (q, k, h, dh, vn, do, dv2, G)),
        "gdn_bwd_wy": time_jax(wy, (k, v, A, G, beta, dw, dv2, dks)),
    }


def segments_chosen(s, variant: str = "gdn", dtype: str = "bfloat16") -> int:
    """The segment count the pallas path of ``variant`` picks for a shape on this device."""
    from gdn_jax.ops import _channel_pallas, _gdn_pallas

    cu = s.cu_seqlens()
    cu = None if cu is None else jnp.asarray(cu, jnp.int32)
    if variant == "gdn":
        return _gdn_pallas._segments_for(
            _gdn_pallas.PallasConfig(scale=1.0), s.B, s.T, s.HV, s.V, cu
        )
    cfg = _channel_pallas.ChannelConfig(scale=1.0, scalar_beta=variant == "kda")
    return _channel_pallas._segments_for(cfg, s.B, s.T, s.HV, s.K, s.V, jnp.dtype(dtype), cu)


def bench_segment_stages(s, x, S: int) -> dict:
    """Per-kernel times of the segmented chunk loops with S segments (dense, T % (64 S) == 0):
    the segment pass (forward: S − 1 segments; training: all S), the combines, the segmented
    forward loop, the state recomputation, the reverse segment pass and the reverse loop."""
    from gdn_jax.ops._segments import segment_end_cotangents, segment_starts
    from pallas_kernels._tiles import LoopConfig
    from pallas_kernels.gdn.intra import IntraConfig, intra_chunk
    from pallas_kernels.gdn.segment_state import segment_maps
    from pallas_kernels.recurrence.bwd_dh import chunk_bwd_dh
    from pallas_kernels.recurrence.chunk_fwd import ChunkFwdConfig, chunk_fwd

    bf = jnp.bfloat16
    q, k, v = (jnp.asarray(x[n], bf) for n in ("q", "k", "v"))
    B, T, HV, K, V = s.B, s.T, s.HV, s.K, s.V
    if s.lengths is not None or T % (C * S):
        raise ValueError(f"{s.name}: segment stages need a dense shape with T % (64·{S}) == 0")
    G = jnp.cumsum(jnp.asarray(x["g"]).reshape(B, T // C, C, HV), 2).reshape(B, T, HV)
    G = G.transpose(0, 2, 1)
    beta = jnp.asarray(x["beta"]).transpose(0, 2, 1)
    h0 = jnp.zeros((B, HV, K, V), jnp.float32)
    w, u = jax.jit(lambda k, v, G, b: intra_chunk(k, v, G, b, IntraConfig()))(k, v, G, beta)[0]
    lcfg = LoopConfig(s.K**-0.5, segments=S)
    maps_f = jax.jit(lambda *a: segment_maps(*a, lcfg))
    maps_t = jax.jit(lambda *a: segment_maps(*a, lcfg, all_segments=True))
    ends = maps_t(k, w, u, G, h0).reshape(B, S, HV, K, V + K)
    comb = jax.jit(lambda e, h0: segment_starts(e[:, : S - 1], h0))
    starts, _ = comb(ends, h0)
    h0s = starts.reshape(B * S, HV, K, V)
    cfg = ChunkFwdConfig(scale=s.K**-0.5, segments=S)
    cfg_h = ChunkFwdConfig(scale=s.K**-0.5, segments=S, store_h=True)
    fwd = jax.jit(lambda q, k, w, u, G, h0: chunk_fwd(q, k, w, u, G, h0, cfg))
    hrec = jax.jit(lambda k, w, u, G, h0: chunk_fwd(None, k, w, u, G, h0, cfg_h))
    do = jnp.asarray(x["do"], bf)
    dz = jnp.zeros((B * S, HV, K, V), jnp.float32)
    dpass = jax.jit(lambda *a: chunk_bwd_dh(*a, lcfg, state_only=True))
    d = dpass(q, k, w, do, G, dz).reshape(B, S, HV, K, V)
    maps = ends[..., V:]
    bcomb = jax.jit(lambda m, d, dht: segment_end_cotangents(m, d, dht))
    dh_fn = jax.jit(lambda *a: chunk_bwd_dh(*a, lcfg))
    return {
        f"S{S} gdn_segment_map(fwd)": time_jax(maps_f, (k, w, u, G, h0)),
        f"S{S} gdn_segment_map(all)": time_jax(maps_t, (k, w, u, G, h0)),
        f"S{S} combine": time_jax(comb, (ends, h0)),
        f"S{S} gdn_chunk_fwd": time_jax(fwd, (q, k, w, u, G, h0s)),
        f"S{S} gdn_chunk_h": time_jax(hrec, (k, w, u, G, h0s)),
        f"S{S} gdn_segment_dh": time_jax(dpass, (q, k, w, do, G, dz)),
        f"S{S} combine(bwd)": time_jax(bcomb, (maps, d, h0)),
        f"S{S} gdn_chunk_bwd_dh": time_jax(dh_fn, (q, k, w, do, G, dz)),
    }


def bench_channel_stages(s, x, variant, dtype="bfloat16") -> dict:
    """Per-kernel times of the GDN2/KDA pallas forward and backward (padded layout, T a multiple
    of 64) in the io ``dtype``, each kernel in the form the call's plan picks
    (:func:`pallas_kernels.channel.plan.channel_plan`): ``chan_intra`` (its two kernels, wy and
    qk) as inference runs it, ``chan_intra(store_a)`` as a differentiated forward runs it
    (keeping A for the backward), then the backward's kernels in the order
    :func:`gdn_jax.ops._channel_pallas_bwd.channel_backward_pallas` runs them, the dq/dk/dw and
    WY kernels named with their form. ``poison_flags`` times the public op's edge-value flags
    (:func:`poison_flags`), ``gate_clamp_cumsum`` the glue's gate clamp and chunk-local
    cumsum (the ``gate_cumsum`` kernel where it serves, which clamps as it reads),
    ``gate_cumsum_bwd`` their VJP (the ``gate_cumsum_rev`` kernel and the clamp's
    derivative)."""
    from gdn_jax.ops._channel_pallas import (
        MIN_LOG_DECAY,
        decay_last,
        kernel_beta,
        lane_gate_cumsum,
    )
    from pallas_kernels._tiles import LoopConfig
    from pallas_kernels.channel.bwd_dqkw import channel_bwd_dqkw
    from pallas_kernels.channel.bwd_wy import channel_bwd_wy
    from pallas_kernels.channel.intra import channel_intra, reference_rows
    from pallas_kernels.channel.plan import channel_plan
    from pallas_kernels.recurrence.bwd_dh import channel_bwd_dh
    from pallas_kernels.recurrence.chunk_fwd import channel_chunk_fwd

    bf = jnp.dtype(dtype)
    q, k, v = (jnp.asarray(x[n], bf) for n in ("q", "k", "v"))
    B, T, HV, K = s.B, s.T, s.HV, s.K
    scale = K**-0.5
    G = jnp.cumsum(jnp.asarray(x["g"]).reshape(B, T // C, C, HV, K), 2).reshape(B, T, HV, K)
    scalar = variant == "kda"
    if scalar:
        gates = (kernel_beta(jnp.asarray(x["beta"])), None)
    else:
        gates = (jnp.asarray(x["b"]), jnp.asarray(x["w"]))
    # the differentiated forward's plan (A stored); inference runs its intra without A
    plan = channel_plan(bf, K, s.V, scalar_beta=scalar, store_a=True)
    icfg = dataclasses.replace(plan.intra_config(), store_a=False)
    intra = jax.jit(lambda q, k, v, G, b, w: channel_intra(q, k, v, G, b, w, icfg))
    qg, kg, wk, u, aqk = intra(q, k, v, G, *gates)
    dl = decay_last(G)
    h0 = jnp.zeros((B, HV, K, s.V), jnp.float32)
    fwd = jax.jit(lambda *a: channel_chunk_fwd(*a, plan.fwd_config(scale)))
    times = {
        "chan_intra": time_jax(intra, (q, k, v, G, *gates)),
        "chan_chunk_fwd": time_jax(fwd, (qg, kg, wk, u, aqk, dl, h0)),
    }
    # differentiated forward (stores A), then the backward kernels' inputs as the driver makes them
    acfg = plan.intra_config()
    intra_a = jax.jit(lambda q, k, v, G, b, w: channel_intra(q, k, v, G, b, w, acfg))
    A = intra_a(q, k, v, G, *gates)[-1]
    hcfg = plan.fwd_config(scale, store_h=True)
    hrec = jax.jit(lambda kg, wk, u, dl, h0: channel_chunk_fwd(None, kg, wk, u, None, dl, h0, hcfg))
    h, vn = hrec(kg, wk, u, dl, h0)
    do = jnp.asarray(x["do"], bf)
    dht = jnp.zeros_like(h0)
    dh_fn = jax.jit(lambda *a: channel_bwd_dh(*a, LoopConfig(scale=scale)))
    dh, dvh, dvl, _ = dh_fn(qg, kg, wk, do, aqk, dl, dht)
    gr, gl = reference_rows(G)
    bk, w_gate = gates
    dqkw = jax.jit(lambda *a: channel_bwd_dqkw(*a, scale=scale, k_split=plan.dqkw_k_split))
    dqkw_args = (q, k, G, gr, gl, h, dh, vn, do, dvh, dvl)
    dwk = dqkw(*dqkw_args)[2]
    wcfg = plan.wy_config()
    wy = jax.jit(lambda *a: channel_bwd_wy(*a, wcfg))
    wy_args = (k, v, G, gr, gl, bk, w_gate, A, dwk, dvh, dvl)
    # the public op's edge-value handling and the glue's gate clamp + chunk-local cumsum
    # (gdn_jax/ops/_sanitize.py, gdn_jax/ops/_channel_pallas.py) around the kernels
    g_raw = jnp.asarray(x["g"])
    heads = (k, jnp.asarray(x["beta"]) if scalar else jnp.asarray(x["b"]))
    cols = (v,) if scalar else (v, jnp.asarray(x["w"]))
    cumsum = jax.jit(lambda g: lane_gate_cumsum(g, MIN_LOG_DECAY))
    clamped = lambda g: lane_gate_cumsum(g, MIN_LOG_DECAY)[0]  # noqa: E731
    cumsum_bwd = jax.jit(lambda g, dG: jax.vjp(clamped, g)[1](dG)[0])
    wy_form = "k_split" if wcfg.k_split else "one_cta"
    times.update({
        "poison_flags": time_jax(poison_flags, (v, (q,), heads, (), cols)),
        "gate_clamp_cumsum": time_jax(cumsum, (g_raw,)),
        "gate_cumsum_bwd": time_jax(cumsum_bwd, (g_raw, g_raw)),
        "chan_intra(store_a)": time_jax(intra_a, (q, k, v, G, *gates)),
        "chan_chunk_h": time_jax(hrec, (kg, wk, u, dl, h0)),
        "chan_bwd_dh": time_jax(dh_fn, (qg, kg, wk, do, aqk, dl, dht)),
        f"chan_bwd_dqkw({plan.dqkw})": time_jax(dqkw, dqkw_args),
        f"chan_bwd_wy({wy_form})": time_jax(wy, wy_args),
    })  # fmt: skip
    return times


def _fla_calls(s, x, variant: str, dtype: str):
    """FLA's op on the inputs ``x`` as ``(fwd, fwd_bwd, grads, patched)``: the no-grad forward, the
    forward + ``o.backward(do)``, the tensors whose gradients it sets, and whether the Triton gate
    of FLA's gated backward had to be forced on."""
    import fla.ops.common.chunk_o as fla_chunk_o
    import fla.utils
    import torch

    if variant == "kda":
        from fla.ops.kda import chunk_kda as chunk_gated_delta_rule
    elif variant == "gdn2":
        from fla.ops.gdn2 import chunk_gdn2 as chunk_gated_delta_rule  # absent in older fla
    else:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    patched = not fla.utils.TRITON_ABOVE_3_7_1  # the package-wide flag is never patched
    fla_chunk_o.TRITON_ABOVE_3_7_1 = True  # timing only: FLA refuses its gated bwd on Triton<3.7.1
    dev = "cuda"
    cu = s.cu_seqlens()
    kw = {} if cu is None else {"cu_seqlens": torch.tensor(cu, dtype=torch.long, device=dev)}
    bf = getattr(torch, dtype)
    t = {n: torch.from_numpy(x[n]).to(dev) for n in x}
    q, k, v = (t[n].to(bf).requires_grad_() for n in ("q", "k", "v"))
    g = t["g"].requires_grad_()
    if variant == "gdn2":
        gates = [g, t["b"].to(bf).requires_grad_(), t["w"].to(bf).requires_grad_()]
    else:
        gates = [g, t["beta"].to(bf).requires_grad_()]
    do = t["do"].to(bf)

    def fwd():
        with torch.no_grad():
            return chunk_gated_delta_rule(q, k, v, *gates, scale=s.K**-0.5, **kw)[0]

    def fb():
        o = chunk_gated_delta_rule(q, k, v, *gates, scale=s.K**-0.5, **kw)[0]
        o.backward(do)

    return fwd, fb, [q, k, v, *gates], patched


def bench_fla(s, x, variant="gdn", fwd_only=False, dtype="bfloat16") -> dict:
    import triton

    fwd, fb, grads, patched = _fla_calls(s, x, variant, dtype)
    f_ms = triton.testing.do_bench(fwd, warmup=50, rep=300, return_mode="median")
    if fwd_only:
        return {"fwd_ms": f_ms}
    fb_ms = triton.testing.do_bench(
        fb, warmup=50, rep=500, grad_to_none=grads, return_mode="median"
    )
    return {"fwd_ms": f_ms, "fwdbwd_ms": fb_ms, "patched_triton_gate": patched}


def kernel_times(averages, iters: int) -> dict[str, float]:
    """Per-call device ms of every GPU kernel in a ``torch.profiler`` ``key_averages()`` over
    ``iters`` calls, heaviest first (host-side events, which carry no device time of their own,
    are left out)."""
    out: dict[str, float] = {}
    for e in averages:
        if str(e.device_type).rsplit(".", 1)[-1] != "CUDA":
            continue
        if e.self_device_time_total > 0:
            out[e.key] = out.get(e.key, 0.0) + e.self_device_time_total / iters / 1e3
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def fla_stages(s, x, variant: str, dtype: str, iters: int = 20) -> dict[str, float]:
    """FLA's kernels by name in its forward and in its forward+backward (``torch.profiler``,
    after warm-up and autotuning): ``{"fwd: <kernel>": ms, "fwdbwd: <kernel>": ms, ...}``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fwd, fb, grads, _ = _fla_calls(s, x, variant, dtype)
    times = {}
    for mode, fn in (("fwd", fwd), ("fwdbwd", fb)):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                fn()
                for t in grads:
                    t.grad = None
            torch.cuda.synchronize()
        times.update(
            {f"{mode}: {k}": v for k, v in kernel_times(prof.key_averages(), iters).items()}
        )
    return times


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="*", default=list(CHUNKED))
    p.add_argument("--impls", nargs="*", default=["pallas", "fla", "xla"])
    p.add_argument(
        "--json", default="auto", help="results file to update; auto: the topic file on a GPU"
    )
    p.add_argument("--stages", action="store_true", help="per-kernel times of the pallas path")
    p.add_argument("--variant", choices=("gdn", "kda", "gdn2"), default="gdn")
    p.add_argument("--fwd-only", action="store_true", help="time the forward only")
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16", help="io dtype")
    p.add_argument(
        "--qat", nargs="*", choices=QAT_CONFIGS, default=None,
        help="QAT cost (off vs on) for pallas and xla; optionally which configs",
    )  # fmt: skip
    p.add_argument(
        "--segments", nargs="*", type=int, default=None,
        help="also time the pallas path at these forced segment counts",
    )  # fmt: skip
    a = p.parse_args(argv)

    dev = jax.devices()[0]
    meta = {"date": results.now(), "device": dev.device_kind, "jax": jax.__version__}
    try:
        import fla
        import triton

        meta["fla"] = getattr(fla, "__version__", "?")
        meta["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001  FLA is optional
        meta["fla"] = f"unavailable ({type(e).__name__}: {e})"
    print(json.dumps(meta), flush=True)
    out = results.output_path(a.json, "ops")
    if a.qat is not None:
        qat_rows = bench_qat(a.shapes, [i for i in a.impls if i != "fla"], a.qat or QAT_CONFIGS)
        print_qat(qat_rows)
        by_run = {}
        for r in qat_rows:
            key = (r["shape"], r["qat"])
            by_run.setdefault(key, {"shape": r["shape"], "variant": "gdn", "dtype": "bfloat16"})
            by_run[key][r["impl"]] = {
                k: v for k, v in r.items() if k.endswith("_ms") or k == "error"
            }
        rows = [x for (_, q), row in by_run.items() for x in ops_rows(row, qat=q)]
        results.write(out, "ops", rows, date=meta["date"])
        return

    rows, stages = [], []
    for name in a.shapes:
        s = SHAPES[name]
        x = inputs(s, variant=a.variant)
        row = {"shape": name, "variant": a.variant, "dtype": a.dtype, **roofline(s)}
        if "pallas" in a.impls:
            row["pallas_segments"] = segments_chosen(s, a.variant, a.dtype)
            print(name, "pallas segments", row["pallas_segments"], flush=True)
        for impl in a.impls:
            try:
                bench = bench_fla if impl == "fla" else functools.partial(bench_jax, impl=impl)
                r = bench(s, x=x, variant=a.variant, fwd_only=a.fwd_only, dtype=a.dtype)
            except Exception as e:  # noqa: BLE001  report and go on with the other impls
                r = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            row[impl] = r
            print(name, impl, json.dumps(r), flush=True)
        split = row.get("pallas_segments", 1) > 1  # forced counts: where the path splits
        for S in (a.segments or ()) if split else ():
            try:
                r = bench_jax(
                    s, "pallas", x, a.variant, fwd_only=a.fwd_only, dtype=a.dtype, segments=S
                )
            except Exception as e:  # noqa: BLE001
                r = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            row.setdefault("pallas_by_segments", {})[str(S)] = r
            print(name, f"pallas segments={S}", json.dumps(r), flush=True)
        if a.stages:
            try:
                if a.variant == "gdn":
                    row["pallas_stages_ms"] = bench_stages(s, x)
                else:
                    row["pallas_stages_ms"] = bench_channel_stages(s, x, a.variant, a.dtype)
            except Exception as e:  # noqa: BLE001
                row["pallas_stages_ms"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            gdn_split = split and a.variant == "gdn"  # (the kernels of GDN's segmented loops)
            for S in (
                sorted({*(a.segments or ()), row["pallas_segments"]} - {1}) if gdn_split else ()
            ):
                try:
                    row["pallas_stages_ms"].update(bench_segment_stages(s, x, S))
                except Exception as e:  # noqa: BLE001
                    row["pallas_stages_ms"][f"S{S} error"] = f"{type(e).__name__}: {str(e)[:200]}"
            print(name, "stages", json.dumps(row["pallas_stages_ms"]), flush=True)
            if "fla" in a.impls:
                try:
                    row["fla_stages_ms"] = fla_stages(s, x, a.variant, a.dtype)
                except Exception as e:  # noqa: BLE001
                    row["fla_stages_ms"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                print(name, "fla stages", json.dumps(row["fla_stages_ms"]), flush=True)
            stages += [
                {"variant": a.variant, "shape": name, "dtype": a.dtype, "impl": impl,
                 "kernel": k, "ms": v}
                for impl in ("pallas", "fla")
                for k, v in row.get(f"{impl}_stages_ms", {}).items()
                if isinstance(v, float)
            ]  # fmt: skip
        rows.append(row)
        # rewritten after every shape, so a run cut short keeps what it measured
        result_rows = [x for r in rows for x in ops_rows(r)]
        results.write(out, "ops", result_rows, date=meta["date"], stages=stages)

    def ms(row, impl, key):
        v = row.get(impl, {}).get(key)
        return v if isinstance(v, float) else float("nan")

    print()
    print(f"{meta['device']}  jax {meta['jax']}  fla {meta.get('fla')}  {meta['date']}", end="")
    print(f"  variant {a.variant}  io {a.dtype}")
    if any(r.get("fla", {}).get("patched_triton_gate") for r in rows):
        print("NOTE: FLA gated backward forced on (TRITON_ABOVE_3_7_1 = True), timing only")
    hdr = (
        f"{'shape':34s} {'mode':7s} {'pallas':>8s} {'xla':>8s} {'fla':>8s} "
        f"{'xla/pal':>8s} {'pal/fla':>8s} {'floor':>7s} {'seg':>3s}"
    )
    print(hdr)
    for r in rows:
        for mode, key in (("fwd", "fwd_ms"), ("fwd+bwd", "fwdbwd_ms")):
            p_, x_, f_ = ms(r, "pallas", key), ms(r, "xla", key), ms(r, "fla", key)
            floor = r["fwd_floor_ms"] if mode == "fwd" else r["fwdbwd_floor_ms"]
            print(
                f"{r['shape']:34s} {mode:7s} {p_:8.3f} {x_:8.3f} {f_:8.3f} "
                f"{x_ / p_:8.2f} {p_ / f_:8.2f} {floor:7.3f} {r.get('pallas_segments', 1):3d}"
            )
        for S, t in r.get("pallas_by_segments", {}).items():
            cells = ", ".join(f"{k}={v:.3f}" for k, v in t.items() if isinstance(v, float))
            print(f"   pallas segments={S}: {cells or t.get('error')}")
        if "pallas_stages_ms" in r:
            st = r["pallas_stages_ms"]
            print("   stages (ms): " + ", ".join(f"{k}={v:.3f}" for k, v in st.items()
                                                  if isinstance(v, float)))  # fmt: skip


if __name__ == "__main__":
    main()
