"""Where the train step's device time goes: a ``jax.profiler`` trace, top ops by time.

Builds the step of ``bench_model.build_step`` (one AdamW step, f32 parameters, bf16 compute),
runs untraced steps, then traces :func:`bench_model.time_step`'s steps (its warm-up, ``--steps``
back to back, ``--steps`` synced) with ``jax.profiler.trace`` and reads the
``*.xplane.pb`` it writes with ``jax.profiler.ProfileData`` (part of jaxlib; no TensorBoard or
xprof needed). Per HLO op of the compiled step (the ``hlo_op`` stat of each kernel on the
device's stream lines; on a CPU, of each XLA thunk on the host) it sums the time, per step, and
joins the op with the compiled HLO text for its opcode, its category (``gemm``, ``attention``,
``pallas``, ``fusion``, ``copy``, ...) and the JAX operation that made it (``op_name``).

    python benchmarks/profile_step.py --preset qwen3_5_0_8b --batch 4 --seq 4096 --setting bf16+none
    python benchmarks/profile_step.py --preset tiny --batch 2 --seq 64 --steps 1   # CPU check

Prints the top ``--top`` ops, the time per category and per model part (:func:`scope`); rows
go to the ``profile`` file of :mod:`benchmarks.results` on a GPU
(``benchmarks/results/profile_<device>.json``):
``{preset, layers, batch, seq, setting, what ("op" | "category" | "scope" | "total"), rank, name,
category, ms, share, count, source}`` with ``ms`` and ``count`` per step and ``share`` of the
summed device time. The trace itself stays in ``--trace-dir`` (TensorBoard/xprof read it).
The traced process runs without XLA's GPU command buffers (``XLA_FLAGS``), whose kernels carry
the command buffer's name instead of their op's: with them no kernel could be placed. On the
H200 that leaves the step's time as it is (``bench_vs_torch.py``, qwen3_5_0_8b B4 T4096
bf16+none: 226.2 ms without them, 228.8 ms with them, one run).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import os
import re
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Device-plane lines that summarise other lines (present in some profiler versions).
_DERIVED_LINES = {"XLA Modules", "XLA Ops", "Steps", "XLA TraceMe", "Framework Ops", "Source code"}
_HLO_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([a-z][\w\-]*)\(")


def op_times(xspace: str | Path) -> dict[str, tuple[float, int]]:
    """Summed duration (ns) and count of each HLO op's events in an ``.xplane.pb`` file.

    Device planes (``/device:...``): every event on the stream lines, named by its ``hlo_op``
    stat (the kernel name where there is none: memcpys, kernels outside XLA). Without device
    planes (CPU): the host events that carry an ``hlo_op`` stat (XLA's thunks).
    """
    from jax.profiler import ProfileData

    warnings.filterwarnings("ignore", "builtin type event_stats", DeprecationWarning)
    data = ProfileData.from_file(str(xspace))
    planes = [p for p in data.planes if p.name.startswith("/device:")]
    out: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])

    def add(name, ns):
        out[name][0] += ns
        out[name][1] += 1

    for plane in planes:
        for line in plane.lines:
            if line.name in _DERIVED_LINES:
                continue
            for e in line.events:
                stats = dict(e.stats)
                add(str(stats.get("hlo_op", e.name)), e.duration_ns)
    if not planes:
        for plane in data.planes:
            if not plane.name.startswith("/host:"):
                continue
            for line in plane.lines:
                for e in line.events:
                    stats = dict(e.stats)
                    if "hlo_op" in stats:
                        add(str(stats["hlo_op"]), e.duration_ns)
    return {k: (v[0], v[1]) for k, v in out.items()}


_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|f8\w*)\[([\d,]*)\]")
_BITS = {"pred": 8, "bf16": 16}


def type_bytes(text: str) -> int:
    """Bytes of the arrays an HLO type string names (``f32[4,64]``, a tuple of them, ...)."""
    total = 0
    for dtype, dims in _ARRAY.findall(text):
        bits = _BITS.get(dtype) or (8 if dtype.startswith("f8") else int(dtype[1:]))
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * bits // 8
    return total


def hlo_ops(hlo_text: str) -> dict[str, dict]:
    """``{instruction name: {"opcode", "category", "source", "scope", "bytes"}}`` of a compiled
    module's text; ``bytes`` counts the instruction's result and its operands' results once each
    (what a kernel that reads every operand whole and writes its result moves)."""
    out, result_bytes, operands = {}, {}, {}
    for line in hlo_text.splitlines():
        m = _HLO_LINE.match(line)
        if not m:
            continue
        name, opcode = m.groups()
        head, _, args = line.partition(f" {opcode}(")
        result_bytes[name] = type_bytes(head.partition("=")[2])
        operands[name] = set(re.findall(r"%([\w.\-]+)", args.split(")", 1)[0]))
        meta = re.search(r'op_name="([^"]*)"', line)
        target = re.search(r'custom_call_target="([^"]*)"', line)
        kind = re.search(r"kind=(k\w+)", line)
        out[name] = dict(
            opcode=opcode,
            category=category(opcode, target and target.group(1), kind and kind.group(1), line),
            source=meta.group(1) if meta else "",
            scope=scope(meta.group(1) if meta else ""),
        )
    for name, info in out.items():
        info["bytes"] = result_bytes[name] + sum(result_bytes.get(a, 0) for a in operands[name])
    return out


# The model's ``jax.named_scope`` names (gdn_jax.models.hybrid, gdn_jax.nn.gated_deltanet,
# bench_model's step), outermost first where they nest.
SCOPES = ("optimizer", "lm_head", "attention", "gdn_in", "gdn_core", "gdn_out", "mlp", "norm")


def scope(op_name: str) -> str:
    """The model part an op belongs to, from its JAX ``op_name``: the first of :data:`SCOPES` in
    it, with ``fwd`` or ``bwd`` (an op of a transposed computation) but for the optimizer;
    ``"other"`` when it names none (the embedding, residual adds, XLA's own copies)."""
    parts = re.split(r"[/()]", op_name)
    for name in SCOPES:
        if name in parts:
            if name == "optimizer":
                return name
            return f"{name} {'bwd' if 'transpose(' in op_name else 'fwd'}"
    return "other"


def category(opcode: str, target: str | None, kind: str | None, line: str = "") -> str:
    """A coarse class of an HLO instruction: gemm, attention, pallas, fusion, copy, ..."""
    t = (target or "").lower()
    if opcode == "custom-call":
        if "cublas" in t or "gemm" in t or "matmul" in t:
            return "gemm"
        if "cudnn" in t and ("fmha" in t or "attention" in t or "flash" in t):
            return "attention"
        if "mosaic" in t or "triton" in t or "pallas" in t:
            return "pallas"
        return f"custom-call {target}"
    if opcode == "fusion":
        if kind == "kCustom" and ("gemm" in line or "dot" in line):
            return "gemm"
        if "cudnn" in line and "fmha" in line:
            return "attention"
        if kind == "kInput":
            return "fusion (reduce)"
        return "fusion (elementwise)"
    if opcode in ("dot", "convolution"):
        return "gemm"
    if opcode in ("copy", "transpose", "copy-start", "copy-done", "dynamic-update-slice"):
        return "copy"
    if opcode in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all"):
        return "collective"
    return opcode


def kernel_category(name: str) -> str:
    """The category of an event that is no op of the step's HLO, from its (kernel) name."""
    n = name.lower()
    for cat, words in (("gemm", ("gemm", "cutlass", "xmma", "matmul")),
                       ("attention", ("fmha", "flash", "cudnn")),
                       ("copy", ("memcpy", "memset", "copy"))):  # fmt: skip
        if any(w in n for w in words):
            return cat
    return "other (not in the step's HLO)"


def _key(name: str) -> str:
    # XLA names a kernel after its instruction with "." and "-" turned into "_".
    return re.sub(r"[.\-]", "_", name)


def join(times: dict, ops: dict) -> tuple[dict, float]:
    """``times`` keyed by HLO instruction names where an event's name is a kernel named after
    one (``loop_add_fusion_3`` for ``loop_add_fusion.3``), and the share of the time that is
    now on an instruction of ``ops``."""
    by_key = {_key(k): k for k in ops}
    out: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for name, (ns, n) in times.items():
        k = name if name in ops else by_key.get(_key(name), name)
        out[k][0] += ns
        out[k][1] += n
    total = sum(ns for ns, _ in times.values()) or 1.0
    joined = sum(ns for k, (ns, _) in out.items() if k in ops) / total
    return {k: (v[0], v[1]) for k, v in out.items()}, joined


def summarise(times: dict, ops: dict, steps: int, top: int) -> list[dict]:
    """Rows: the summed device time (``what="total"``), the ``top`` ops by time
    (``what="op"``) and the time per category (``what="category"``), ms per step."""
    times, _ = join(times, ops)
    total = sum(ns for ns, _ in times.values()) or 1.0
    ms = lambda ns: ns / 1e6 / steps
    calls = sum(c for _, c in times.values()) / steps
    rows = [dict(what="total", rank=0, name="all device time", category=None, ms=ms(total),
                 share=1.0, count=calls, source=None)]  # fmt: skip
    by_cat: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    ranked = sorted(times.items(), key=lambda kv: -kv[1][0])
    for name, (ns, n) in ranked:
        cat = ops.get(name, {}).get("category") or kernel_category(name)
        by_cat[cat][0] += ns
        by_cat[cat][1] += n
    for i, (name, (ns, n)) in enumerate(ranked[:top]):
        info = ops.get(name, {})
        rows.append(dict(
            what="op", rank=i + 1, name=name,
            category=info.get("category") or kernel_category(name),
            ms=ms(ns), share=ns / total, count=n / steps, source=_short(info.get("source", "")),
        ))  # fmt: skip
    for i, (cat, (ns, n)) in enumerate(sorted(by_cat.items(), key=lambda kv: -kv[1][0])):
        rows.append(dict(what="category", rank=i + 1, name=cat, category=cat, ms=ms(ns),
                         share=ns / total, count=n / steps, source=None))  # fmt: skip
    by_scope: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for name, (ns, n) in times.items():
        part = by_scope[ops.get(name, {}).get("scope", "other")]
        part[0] += ns
        part[1] += n
    for i, (sc, (ns, n)) in enumerate(sorted(by_scope.items(), key=lambda kv: -kv[1][0])):
        rows.append(dict(what="scope", rank=i + 1, name=sc, category=None, ms=ms(ns),
                         share=ns / total, count=n / steps, source=None))  # fmt: skip
    return rows


def _short(source: str, width: int = 90) -> str:
    s = re.sub(r"^jit\([^)]*\)/", "", source)
    return s if len(s) <= width else "…" + s[-(width - 1) :]


def table(rows: list[dict]) -> str:
    lines = ["| # | op | category | ms/step | share | calls/step | JAX op |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if r["what"] == "op":
            lines.append(f"| {r['rank']} | {r['name']} | {r['category']} | {r['ms']:.2f} | "
                         f"{r['share']:.1%} | {r['count']:g} | {r['source'] or ''} |")  # fmt: skip
    for what in ("category", "scope"):
        lines += ["", f"| {what} | ms/step | share | calls/step |", "|---|---|---|---|"]
        for r in rows:
            if r["what"] in (what, "total"):
                lines.append(f"| {r['name']} | {r['ms']:.2f} | {r['share']:.1%} | {r['count']:g} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="qwen3_5_0_8b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--setting", default="bf16+none", help="bench_model setting")
    p.add_argument("--implementation", default=None, help="default: pallas on a GPU, else xla")
    p.add_argument(
        "--steps", type=int, default=3, help="steps timed each way (bench_model.time_step)"
    )
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--trace-dir", default=None, help="default: a temporary folder")
    p.add_argument("--json", default="auto", help="results file: auto, PATH, none")
    p.add_argument("--hlo", default=None, help="also write the compiled step's HLO text here")
    p.add_argument(
        "--xspace", default=None, help="also copy the trace's .xplane.pb file here (.gz: gzipped)"
    )
    args = p.parse_args(argv)
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_enable_command_buffer=".strip()

    import jax

    from benchmarks import results
    from benchmarks.bench_model import build_step, time_step
    from gdn_jax.models import get_config

    date = results.now()
    overrides = {"num_layers": args.layers} if args.layers else {}
    config = get_config(args.preset, **overrides)
    impl = args.implementation or ("pallas" if jax.default_backend() == "gpu" else "xla")
    s = build_step(config, args.setting, args.batch, args.seq, implementation=impl)
    hlo = s.compiled.as_text()
    if args.hlo:
        Path(args.hlo).write_text(hlo)
    ops = hlo_ops(hlo)
    wall, s, _ = time_step(s, 1)  # untraced
    with tempfile.TemporaryDirectory() as tmp:
        trace_dir = Path(args.trace_dir or tmp)
        t0 = time.perf_counter()
        with jax.profiler.trace(str(trace_dir)):
            traced, s, _ = time_step(s, args.steps)
        traced_s = time.perf_counter() - t0
        files = sorted(trace_dir.rglob("*.xplane.pb"), key=lambda f: f.stat().st_mtime)
        if not files:
            raise SystemExit(f"no *.xplane.pb under {trace_dir}: the profiler wrote no trace")
        times = op_times(files[-1])
        if args.xspace:
            with open(files[-1], "rb") as src:
                opener = gzip.open if args.xspace.endswith(".gz") else open
                with opener(args.xspace, "wb") as dst:
                    shutil.copyfileobj(src, dst)
    _, joined = join(times, ops)
    rows = summarise(times, ops, traced.steps, args.top)
    for r in rows:
        r.update(preset=args.preset, layers=config.num_layers, batch=args.batch, seq=args.seq,
                 setting=args.setting)  # fmt: skip
    print(f"{jax.devices()[0].device_kind}: {args.preset} B{args.batch} T{args.seq} "
          f"{args.setting} ({impl}); step {1e3 * wall.pipelined_s:.1f} ms untraced, "
          f"{1e3 * traced_s / traced.steps:.1f} ms traced; device time "
          f"{rows[0]['ms']:.1f} ms/step, {joined:.0%} of it on ops of the step's HLO")  # fmt: skip
    print(table(rows))
    results.write(results.output_path(args.json, "profile"), "profile", rows, date=date)
    return rows


if __name__ == "__main__":
    main()
