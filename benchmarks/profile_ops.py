"""Where a chunked op's device time goes: a ``jax.profiler`` trace of its kernels and XLA fusions.

Times the public op (``gated_delta_rule``, ``kda``, ``gdn2``; inputs of
``bench_gdn.inputs``, ``--dtype`` io: q, k, v, do and the gates β, b, w, as ``bench_gdn.py``
passes them) forward and forward+backward (the forward and its VJP with the
cotangent ``do``, :func:`bench_gdn.forward_backward`) as ``bench_gdn.py`` does, traces
``--iters`` calls of each and prints, per HLO op of the compiled program, its device time per
call, its category and the JAX operation that made it (:func:`profile_step.op_times`,
:func:`profile_step.hlo_ops`). Unlike ``bench_gdn.py --stages``, which times each kernel jitted
alone, this shows the op's own XLA work (input sanitation, gate cumsum, transposes, output
poisoning) as XLA fused it.

    python benchmarks/profile_ops.py gdn:B1_T32768_H16_HV16_D128 kda:B4_T4096_H16_HV16_D128
    python benchmarks/profile_ops.py --dtype float16 kda:B4_T4096_H16_HV16_D128
    python benchmarks/profile_ops.py --impl xla gdn:B1_T256_H2_HV2_D128 --iters 1   # CPU check

A case is ``variant:shape`` with a name of ``shapes.SHAPES`` (packed ``_P`` shapes run with
``cu_seqlens``) or any ``B<b>_T<t>_H<h>_HV<hv>_D<d>``.
Each op's row has the bytes it moves (its operands and result once each, from the HLO:
:func:`profile_step.hlo_ops`) and the bandwidth that gives; the first line is the bandwidth of a
plain elementwise pass (``2 x`` over 256 MiB of f32) in the same process, the ceiling that a
memory-bound op's bandwidth is read against.
Prints only; ``--hlo-dir`` also writes each compiled program's HLO text there.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Kernels inside XLA's GPU command buffers carry the buffer's name, not their op's.
os.environ.setdefault("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import bench_gdn  # noqa: E402
from benchmarks import shapes as shape_table  # noqa: E402
from benchmarks.profile_step import hlo_ops, join, op_times  # noqa: E402

_SHAPE = re.compile(r"B(\d+)_T(\d+)_H(\d+)_HV(\d+)_D(\d+)$")


def parse_case(case: str):
    """``variant:shape`` -> (variant, :class:`shapes.Shape`)."""
    variant, _, name = case.partition(":")
    if variant not in ("gdn", "kda", "gdn2"):
        raise ValueError(f"case {case!r}: variant must be gdn, kda or gdn2")
    if name in shape_table.SHAPES:
        return variant, shape_table.SHAPES[name]
    m = _SHAPE.match(name)
    if not m:
        raise ValueError(f"case {case!r}: shape must be in shapes.SHAPES or B_T_H_HV_D")
    B, T, H, HV, D = map(int, m.groups())
    return variant, shape_table.Shape(name, B, T, H, HV, D, D)


def programs(variant: str, s, impl: str, dtype: str = "bfloat16"):
    """{"fwd": (jitted fn, args), "fwdbwd": (jitted fn, args)} of the public op with io
    ``dtype`` (q, k, v, do and the gates β, b, w; the log-decay g f32, as in
    :func:`bench_gdn.bench_jax`)."""
    import gdn_jax

    io = jnp.dtype(dtype)
    x = bench_gdn.inputs(s, variant=variant)
    q, k, v = (jnp.asarray(x[n], io) for n in ("q", "k", "v"))
    gates = ("b", "w") if variant == "gdn2" else ("beta",)
    args = (q, k, v, jnp.asarray(x["g"])) + tuple(jnp.asarray(x[n], io) for n in gates)
    do = jnp.asarray(x["do"], io)
    fn = {"gdn": gdn_jax.gated_delta_rule, "kda": gdn_jax.kda, "gdn2": gdn_jax.gdn2}[variant]
    cu = s.cu_seqlens()
    kw = {} if cu is None else {"cu_seqlens": jnp.asarray(cu, jnp.int32)}

    def op(*a):
        return fn(*a, implementation=impl, **kw)[0]

    fb = bench_gdn.forward_backward(op)
    return {"fwd": (jax.jit(op), args), "fwdbwd": (jax.jit(fb), args + (do,))}


def profile(f, args, iters: int) -> tuple[dict, dict, str]:
    """(times {op: (ns per call, launches per call)}, hlo ops, hlo text) of ``iters`` calls."""
    for _ in range(2):
        jax.block_until_ready(f(*args))
    hlo = f.lower(*args).compile().as_text()
    ops = hlo_ops(hlo)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(iters):
                out = f(*args)
            jax.block_until_ready(out)
        (xspace,) = Path(d).rglob("*.xplane.pb")
        times, _ = join(op_times(xspace), ops)
    return {k: (ns / iters, n // iters) for k, (ns, n) in times.items()}, ops, hlo


def elementwise_gbps(mib: int, iters: int) -> float:
    """GB/s (bytes read + written) of ``2 x`` over ``mib`` MiB of f32, device time per call."""
    x = jnp.ones((mib * 2**18,), jnp.float32)
    times, _, _ = profile(jax.jit(lambda a: 2 * a), (x,), iters)
    ns = sum(t for t, _ in times.values())
    return 2 * x.nbytes / ns


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cases", nargs="+", help="variant:shape")
    p.add_argument("--impl", default="pallas", choices=["pallas", "xla"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="io dtype")
    p.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--hlo-dir", default=None)
    p.add_argument("--ceiling-mib", type=int, default=256, help="the elementwise pass's size")
    a = p.parse_args(argv)
    gbps = elementwise_gbps(a.ceiling_mib, a.iters)
    print(f"elementwise 2x of {a.ceiling_mib} MiB f32: {gbps:.0f} GB/s (read + written)")
    for case in a.cases:
        variant, s = parse_case(case)
        progs = programs(variant, s, a.impl, a.dtype)
        for mode in a.modes:
            times, ops, hlo = profile(*progs[mode], a.iters)
            total = sum(ns for ns, _ in times.values())
            head = f"== {variant} {s.name} {a.dtype} {mode} ({a.impl})"
            print(f"{head}: {total / 1e6:.3f} ms device time per call")
            for name, (ns, n) in sorted(times.items(), key=lambda kv: -kv[1][0])[: a.top]:
                info = ops.get(name, {})
                cat, src = info.get("category", ""), info.get("source", "")
                mb = info.get("bytes", 0) / 1e6
                bw = f"{mb * 1e6 / ns:6.0f}" if ns else "     -"
                print(f"  {ns / 1e6:7.3f} ms  x{n:<2d} {mb:8.1f} MB {bw} GB/s  {name[:30]:30s} "
                      f"{cat[:18]:18s} {src[-60:]}")  # fmt: skip
            if a.hlo_dir:
                os.makedirs(a.hlo_dir, exist_ok=True)
                Path(a.hlo_dir, f"{variant}_{s.name}_{mode}.hlo").write_text(hlo)
    return 0


if __name__ == "__main__":
    sys.exit(main())
