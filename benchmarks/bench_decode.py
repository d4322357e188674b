"""Times one decode step (one token appended to each of B carried f32 states) against the
memory-bandwidth floor, for GDN, KDA and GDN2, in one run; FLA's ``fused_recurrent_*`` too when
``fla`` imports.

Usage (on the GPU machine, from the checkout)::

    PYTHONPATH=. python3 benchmarks/bench_decode.py [--batch 64 256] [--variants gdn kda gdn2]
        [--json out.json]

The step is jitted with the state donated, so XLA updates it in place; the floor is reading and
writing the f32 state once (``2 · B · HV · K · V · 4`` bytes) over the measured copy bandwidth.
Timing as in bench_gdn.py: batches of back-to-back calls, median of the per-call times.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, ".")
import gdn_jax  # noqa: E402
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


def bench_xla(variant: str, B: int, H: int, HV: int, K: int, V: int) -> float:
    """ms per step of the jitted, state-donating decode step."""
    args, state = step_inputs(variant, B, H, HV, K, V)
    n = len(args)
    step = jax.jit(lambda *a: STEPS[variant](*a, use_qk_l2norm=True), donate_argnums=(n,))
    box = [state]

    def call():
        o, box[0] = step(*args, box[0])
        return o

    return time_jax(lambda: call(), ())


def bench_fla(variant: str, B: int, H: int, HV: int, K: int, V: int) -> float:
    """ms per step of FLA's fused_recurrent kernel (GDN / KDA only)."""
    import torch
    import triton

    if variant == "gdn":
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fn
    elif variant == "kda":
        from fla.ops.kda import fused_recurrent_kda as fn
    else:
        raise NotImplementedError("no FLA fused_recurrent for gdn2 in this benchmark")
    args, state = step_inputs(variant, B, H, HV, K, V)
    t = [torch.from_numpy(np.asarray(a.astype(jnp.float32))).cuda() for a in args]
    q, k, v = (x.to(torch.bfloat16) for x in t[:3])
    if HV != H:  # FLA's fused_recurrent reads q/k per value head
        q, k = (x.repeat_interleave(HV // H, dim=2) for x in (q, k))
    g, beta = t[3], t[4].to(torch.bfloat16)
    h0 = torch.from_numpy(np.asarray(state)).cuda()

    def run():
        with torch.no_grad():
            fn(q, k, v, g, beta=beta, initial_state=h0, output_final_state=True,
               use_qk_l2norm_in_kernel=True)  # fmt: skip

    return triton.testing.do_bench(run, warmup=50, rep=300, return_mode="median")


def main(argv=None) -> list[dict]:
    base = SHAPES["B64_H16_D128"]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="*", default=[base.B, 256])
    p.add_argument("--variants", nargs="*", default=list(STEPS))
    p.add_argument("--H", type=int, default=base.H)
    p.add_argument("--HV", type=int, default=base.HV)
    p.add_argument("--D", type=int, default=base.K)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    print(json.dumps({"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                      "device": jax.devices()[0].device_kind, "jax": jax.__version__}))  # fmt: skip
    rows = []
    for B in a.batch:
        floor_ms = 1e3 * 2 * B * a.HV * a.D * a.D * 4 / COPY_BW
        for variant in a.variants:
            row = dict(variant=variant, B=B, floor_ms=floor_ms)
            row["xla_ms"] = bench_xla(variant, B, a.H, a.HV, a.D, a.D)
            try:
                row["fla_ms"] = bench_fla(variant, B, a.H, a.HV, a.D, a.D)
            except Exception as e:  # FLA absent (CPU, no wheel) or no such kernel
                row["fla_ms"] = float("nan")
                row["fla_note"] = f"{type(e).__name__}: {e}"[:120]
            rows.append(row)
            print(json.dumps(row))
    print(
        f"{'variant':8s} {'B':>5s} {'xla ms':>9s} {'fla ms':>9s} {'floor ms':>9s} {'xla/floor':>9s}"
    )
    for r in rows:
        print(f"{r['variant']:8s} {r['B']:5d} {r['xla_ms']:9.4f} {r['fla_ms']:9.4f} "
              f"{r['floor_ms']:9.4f} {r['xla_ms'] / r['floor_ms']:9.2f}")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
