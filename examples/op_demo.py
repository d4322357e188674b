"""Runs the GDN op forward and backward, prints its errors against the f32 token recurrence and
its time. Picks the Pallas kernels on a Hopper GPU and the xla path elsewhere.

    python examples/op_demo.py [--T 1024] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

import gdn_jax
from gdn_jax.ops import default_implementations
from gdn_jax.testing import random_inputs, rel_rms, upcast


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--B", type=int, default=2)
    p.add_argument("--T", type=int, default=1024)
    p.add_argument("--H", type=int, default=2)
    p.add_argument("--HV", type=int, default=4)
    p.add_argument("--D", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    a = p.parse_args()

    x = random_inputs(0, B=a.B, T=a.T, H=a.H, HV=a.HV, K=a.D, V=a.D, dtype=jnp.dtype(a.dtype))
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    h0 = x["initial_state"]
    impl = default_implementations()[0]
    print(f"devices: {jax.devices()}  implementation: {impl}")

    def loss(fn, args, h0):
        o, s = fn(*args, initial_state=h0, output_final_state=True, use_qk_l2norm=True)
        return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(s**2), (o, s)

    def value_and_grad(fn):
        return jax.jit(
            jax.value_and_grad(lambda a, h: loss(fn, a, h), argnums=(0, 1), has_aux=True)
        )

    op = value_and_grad(gdn_jax.gated_delta_rule)
    oracle = value_and_grad(gdn_jax.reference.recurrent_gated_delta_rule)
    (_, (o, s)), grads = jax.block_until_ready(op(args, h0))
    t0 = time.perf_counter()
    n = 5
    for _ in range(n):
        jax.block_until_ready(op(args, h0))
    ms = (time.perf_counter() - t0) / n * 1e3
    (_, (o_ref, s_ref)), g_ref = oracle(upcast(args), h0)
    (_, (o_lo, s_lo)), g_lo = oracle(args, h0)  # the recurrence run in the io dtype

    print(f"shape B={a.B} T={a.T} H={a.H} HV={a.HV} K=V={a.D} {a.dtype}: fwd+bwd {ms:.1f} ms")
    print("relative RMS error vs the f32 token recurrence (op | recurrence in the io dtype):")
    names = ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
    vals = [o, s] + list(grads[0]) + [grads[1]]
    refs = [o_ref, s_ref] + list(g_ref[0]) + [g_ref[1]]
    lows = [o_lo, s_lo] + list(g_lo[0]) + [g_lo[1]]
    for name, v, r, lo in zip(names, vals, refs, lows, strict=True):
        print(f"  {name:12s} {rel_rms(v, r):.2e} | {rel_rms(lo, r):.2e}")


if __name__ == "__main__":
    main()
