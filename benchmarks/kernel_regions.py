"""Where the time goes inside the Pallas kernels of an op: Mosaic GPU's on-device profiler.

    python benchmarks/kernel_regions.py kda:B4_T4096_H16_HV16_D128 --dtype float16
    python benchmarks/kernel_regions.py gdn2:B4_T4096_H16_HV16_D128 --mode fwdbwd \\
        --kernels chan_bwd_wy chan_bwd_dqkw

The op's kernels are built inside :func:`pallas_kernels._compat.profile_regions`: one thread of
each warpgroup stores the SM clock at the entry and exit of every ``jax.named_scope`` region of
the kernel body (the channel intra kernels name their K passes and tail steps). The pass
(:func:`profile_ops.programs`) runs once to compile, then once more to profile. Per kernel the tool
prints, averaged over all warpgroups of the launch, each region's clock cycles and its share of
the warpgroup's span (its first entry to its last exit), and how often a warpgroup entered it:
what a stage costs inside one CTA while the others share the SM, which the kernels' wall times
(``profile_ops.py``) cannot split. Regions run back to back in one thread's program order;
asynchronous work (TMA, wgmma) is charged to the region that waits for it. A warpgroup records
its first ``--events`` entries and exits (the chunk loops name their per-step regions: their
later steps are dropped, so a loop kernel's span covers the recorded steps). Needs a Hopper
GPU.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_TRACE = re.compile(r"(.+)-\d+-trace\.json$")


def region_cycles(events: list[dict]) -> dict:
    """``{"warpgroups", "span", "regions": {name: cycles}, "entries": {name: count}}`` of one
    kernel's Perfetto trace events (Mosaic GPU's ``ProfilerSpec.dump``: per warpgroup ``tid``,
    ``B``/``E`` events whose ``ts`` differences are clock cycles / 1000). ``span``, each region's
    cycles and its entries are means over the warpgroups that recorded anything; a region
    entered several times by a warpgroup (a loop step's) counts all its recorded entries, so
    cycles / entries is its cost per entry.

    Raises:
      ValueError: an exit without its entry, or an entry never left.
    """
    by_tid: dict[int, list[dict]] = defaultdict(list)
    for e in events:
        by_tid[e["tid"]].append(e)
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    span = 0.0
    for tid, evs in by_tid.items():
        open_: list[dict] = []
        for e in evs:
            if e["ph"] == "B":
                open_.append(e)
                continue
            if not open_ or open_[-1]["name"] != e["name"]:
                raise ValueError(f"warpgroup {tid}: exit of {e['name']!r} without its entry")
            totals[e["name"]] += (e["ts"] - open_.pop()["ts"]) * 1e3
            counts[e["name"]] += 1
        if open_:
            raise ValueError(f"warpgroup {tid}: {open_[-1]['name']!r} entered, never left")
        span += (max(e["ts"] for e in evs) - min(e["ts"] for e in evs)) * 1e3
    n = len(by_tid)
    if not n:
        return {"warpgroups": 0, "span": 0.0, "regions": {}, "entries": {}}
    return {
        "warpgroups": n,
        "span": span / n,
        "regions": {k: v / n for k, v in totals.items()},
        "entries": {k: v / n for k, v in counts.items()},
    }


def read_traces(directory: Path) -> dict[str, dict]:
    """``{kernel name: region_cycles(...)}`` of the trace files in ``directory`` (the newest
    file per kernel)."""
    newest: dict[str, Path] = {}
    for p in sorted(directory.glob("*-trace.json")):
        m = _TRACE.match(p.name)
        if m:
            newest[m.group(1)] = p
    return {k: region_cycles(json.loads(p.read_text())["traceEvents"]) for k, p in newest.items()}


def table(kernels: dict[str, dict]) -> str:
    """The printed table: per kernel its span, then each region's cycles, share of the span and
    entries per warpgroup."""
    lines = [f"{'kernel / region':40s} {'kcycles':>9s} {'share':>6s} {'entries':>8s}"]
    for name in sorted(kernels):
        k = kernels[name]
        lines.append(f"{name:40s} {k['span'] / 1e3:9.2f}  ({k['warpgroups']} warpgroups)")
        for region, cyc in k["regions"].items():
            share = cyc / k["span"] if k["span"] else 0.0
            n = k["entries"][region]
            lines.append(f"  {region:38s} {cyc / 1e3:9.2f} {share:6.1%} {n:8.1f}")
    return "\n".join(lines)


def profile(case: str, dtype: str, mode: str, events: int) -> dict[str, dict]:
    """Runs the pass of ``case`` twice under the profiler and reads the second run's traces."""
    import jax

    from benchmarks import profile_ops
    from pallas_kernels import _compat as pk

    variant, shape = profile_ops.parse_case(case)
    with tempfile.TemporaryDirectory() as d, pk.profile_regions(d, events):
        f, args = profile_ops.programs(variant, shape, "pallas", dtype)[mode]
        for run in range(2):
            if run:
                for p in Path(d).glob("*-trace.json"):
                    p.unlink()
            jax.block_until_ready(f(*args))
            jax.effects_barrier()  # the traces are written by a host callback
        return read_traces(Path(d))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("case", help="variant:shape as for profile_ops.py")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--mode", default="fwd", choices=["fwd", "fwdbwd"])
    p.add_argument("--kernels", nargs="*", help="only these kernels (default: all)")
    p.add_argument("--events", type=int, default=64, help="region entries a warpgroup may record")
    p.add_argument("--out", type=Path, help="also write the per-kernel figures as JSON here")
    a = p.parse_args(argv)
    import jax

    if jax.default_backend() != "gpu":
        p.error("needs a Hopper GPU (Mosaic GPU's profiler runs on the device)")
    kernels = profile(a.case, a.dtype, a.mode, a.events)
    if a.kernels:
        kernels = {k: v for k, v in kernels.items() if k in a.kernels}
    print(f"{a.case} {a.dtype} {a.mode} on {jax.devices()[0].device_kind}")
    print(table(kernels))
    if a.out:
        a.out.write_text(json.dumps(kernels, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
