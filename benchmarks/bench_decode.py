"""Times one decode step (one token appended to each of B carried f32 states) against the
memory-bandwidth floor, for GDN, KDA and GDN2 and each implementation (``pallas``, ``xla``) in one
run; FLA's ``fused_recurrent_*`` too when ``fla`` imports.

Usage (on the GPU machine, from the checkout)::

    PYTHONPATH=. python3 benchmarks/bench_decode.py [--batch 64 256] [--variants gdn kda gdn2]
        [--impls pallas xla fla] [--json PATH|auto|none]

The step is jitted with the state donated, so it updates the state in place; the floor is reading
and writing the f32 state once (``2 · B · HV · K · V · 4`` bytes) over the measured copy bandwidth,
and GB/s is those bytes over the measured time. Two timings per JAX implementation:

- ``*_ms``: device time per step of a decode loop, ``STEPS_PER_LOOP`` steps inside one jitted
  ``fori_loop`` (the state is the loop carry; the outputs are summed so none is dead code), so
  host dispatch is excluded, as in FLA's ``do_bench`` (CUDA events) timing;
- ``*_call_ms``: one jitted, state-donating call per step from Python (bench_gdn.py timing:
  batches of back-to-back calls, median), i.e. what a host-driven decode loop sees.

Results: the run updates the ``decode`` file of :mod:`benchmarks.results` (rows ``variant, B, H,
HV, K, V, floor_ms, {impl}_ms, {impl}_call_ms, {impl}_GBps, {impl}_per_floor``), by default
``benchmarks/results/decode_<device>.json`` on a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, ".")
import gdn_jax  # noqa: E402
from benchmarks import results  # noqa: E402
from benchmarks.bench_gdn import COPY_BW, time_jax  # noqa: E402
from benchmarks.shapes import SHAPES  # noqa: E402

STEPS = {"gdn": gdn_jax.gated_delta_rule_step, "kda": gdn_jax.kda_step, "gdn2": gdn_jax.gdn2_step}


def step_inputs(variant: str, B: int, H: int, HV: int, K: int, V: int, seed: int = 0):
    """One token per sequence: (q, k, v, *gates) in bf16/f32 and the f32 state [B, HV, K, V]."""
    r = np.random.default_rng(seed)
    bf = jnp.bfloat16
    q = jnp.asarray(r.standard_normal((B, 1, H, K)), bf)
    k = jnp.asarray(r.standard_normal((B, 1, H, K)), bf)
    v = jnp.asarray(r.standard_normal((B, 1, HV, V)), bf)
    gshape = (B, 1, HV) if variant == "gdn" else (B, 1, HV, K)
    g = jnp.asarray(-r.uniform(0.01, 1, gshape), jnp.float32)
    if variant == "gdn2":
        gates = (g, jnp.asarray(r.uniform(0, 1, (B, 1, HV, K)), jnp.float32),
                 jnp.asarray(r.uniform(0, 1, (B, 1, HV, V)), jnp.float32))  # fmt: skip
    else:
        gates = (g, jnp.asarray(r.uniform(0, 1, (B, 1, HV)), jnp.float32))
    state = jnp.asarray(r.standard_normal((B, HV, K, V)), jnp.float32)
    return (q, k, v) + gates, state


STEPS_PER_LOOP = 50


def bench_jax(
    variant: str, impl: str, B: int, H: int, HV: int, K: int, V: int, timing: str = "both"
) -> dict:
    """ms per step of ``impl``: in a jitted decode loop (device) and/or per jitted call (host)."""
    args, state = step_inputs(variant, B, H, HV, K, V)
    n = len(args)

    def one(a, s):
        return STEPS[variant](*a, s, use_qk_l2norm=True, implementation=impl)

    step = jax.jit(lambda *a: one(a[:n], a[n]), donate_argnums=(n,))

    def loop(a, s):
        def body(_, c):
            s, acc = c
            o, s = one(a, s)
            return s, acc + o.astype(jnp.float32)

        acc = jnp.zeros(args[2].shape, jnp.float32)
        return jax.lax.fori_loop(0, STEPS_PER_LOOP, body, (s, acc))

    run = jax.jit(loop, donate_argnums=(1,))
    box = [state + 0]  # each timing donates a buffer of its own

    def call():
        o, box[0] = step(*args, box[0])
        return o

    r = {}
    if timing in ("call", "both"):
        r[f"{impl}_call_ms"] = time_jax(lambda: call(), ())
    if timing == "call":
        r[f"{impl}_ms"] = r[f"{impl}_call_ms"]
        return r
    box2 = [state + 0]

    def call_loop():
        box2[0], acc = run(args, box2[0])
        return acc

    r[f"{impl}_ms"] = time_jax(lambda: call_loop(), (), iters=3) / STEPS_PER_LOOP
    return r


def bench_fla(variant: str, B: int, H: int, HV: int, K: int, V: int) -> float:
    """ms per step of FLA's fused_recurrent kernel for ``variant``."""
    import torch
    import triton

    if variant == "gdn":
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fn
    elif variant == "kda":
        from fla.ops.kda import fused_recurrent_kda as fn
    else:
        from fla.ops.gdn2 import fused_recurrent_gdn2 as fn
    args, state = step_inputs(variant, B, H, HV, K, V)
    t = [torch.from_numpy(np.asarray(a.astype(jnp.float32))).cuda() for a in args]
    q, k, v = (x.to(torch.bfloat16) for x in t[:3])
    # FLA 0.6's fused_recurrent kernels read GVA q/k per value head group themselves
    g = t[3]
    if variant == "gdn2":  # erase gate b [B,1,HV,K], write gate w [B,1,HV,V]
        gates = {"b": t[4].to(torch.bfloat16), "w": t[5].to(torch.bfloat16)}
    else:
        gates = {"beta": t[4].to(torch.bfloat16)}
    h0 = torch.from_numpy(np.asarray(state)).cuda()

    def run():
        with torch.no_grad():
            fn(q, k, v, g, **gates, initial_state=h0, output_final_state=True,
               use_qk_l2norm_in_kernel=True)  # fmt: skip

    return triton.testing.do_bench(run, warmup=50, rep=300, return_mode="median")


def main(argv=None) -> list[dict]:
    base = SHAPES["B64_H16_D128"]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="*", default=[base.B, 256])
    p.add_argument("--variants", nargs="*", default=list(STEPS))
    p.add_argument("--impls", nargs="*", default=["pallas", "xla", "fla"])
    p.add_argument("--H", type=int, default=base.H)
    p.add_argument("--HV", type=int, default=base.HV)
    p.add_argument("--D", type=int, default=base.K)
    p.add_argument("--timing", choices=("loop", "call", "both"), default="both")
    p.add_argument(
        "--block-v",
        type=int,
        default=None,
        help="pallas: force V columns per CTA (default: _step_pallas.value_block)",
    )
    p.add_argument(
        "--json", default="auto", help="results file to update; auto: the topic file on a GPU"
    )
    a = p.parse_args(argv)
    if a.block_v is not None:
        from gdn_jax.ops import _step_pallas

        _step_pallas.BLOCK_V = a.block_v
    date = results.now()
    device = jax.devices()[0].device_kind
    print(json.dumps({"date": date, "device": device, "jax": jax.__version__}))
    state_bytes = lambda B: 2 * B * a.HV * a.D * a.D * 4
    rows = {
        (B, v): dict(
            variant=v, B=B, H=a.H, HV=a.HV, K=a.D, V=a.D, floor_ms=1e3 * state_bytes(B) / COPY_BW
        )
        for B in a.batch
        for v in a.variants
    }
    # implementation-major, one printed line per measurement: a run cut short keeps what it did
    for impl in a.impls:
        for (B, variant), row in rows.items():
            try:
                if impl == "fla":
                    row["fla_ms"] = bench_fla(variant, B, a.H, a.HV, a.D, a.D)
                else:
                    row.update(bench_jax(variant, impl, B, a.H, a.HV, a.D, a.D, a.timing))
            except Exception as e:  # FLA absent (CPU, no wheel), no such kernel, no GPU
                row[f"{impl}_ms"] = None
                row[f"{impl}_note"] = f"{type(e).__name__}: {e}"[:160]
            t = row[f"{impl}_ms"]
            row[f"{impl}_GBps"] = None if t is None else state_bytes(B) / (t * 1e-3) / 1e9
            row[f"{impl}_per_floor"] = None if t is None else t / row["floor_ms"]
            keys = [k for k in row if k.startswith(impl + "_")]
            print(json.dumps({"variant": variant, "B": B, **{k: row[k] for k in keys}}), flush=True)
    rows = list(rows.values())
    hdr = f"{'variant':7s} {'B':>4s} {'floor ms':>9s}"
    for impl in a.impls:
        hdr += f" {impl + ' ms':>10s} {'GB/s':>6s} {'/floor':>6s}"
    print(hdr)
    for r in rows:
        line = f"{r['variant']:7s} {r['B']:4d} {r['floor_ms']:9.4f}"
        for impl in a.impls:
            t, gbps, per = (r[f"{impl}_{k}"] for k in ("ms", "GBps", "per_floor"))
            line += f" {t:10.4f} {gbps:6.0f} {per:6.2f}" if t is not None else f" {'-':>24s}"
        print(line)
    results.write(results.output_path(a.json, "decode"), "decode", rows, date=date)
    return rows


if __name__ == "__main__":
    main()
