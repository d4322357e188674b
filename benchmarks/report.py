"""Regenerates ``benchmarks/RESULTS.md`` (and its plots) from ``benchmarks/results/*.json``.

    python benchmarks/report.py                 # writes benchmarks/RESULTS.md and the PNGs
    python benchmarks/report.py --out /tmp/R.md --no-plots

Each results file holds one topic on one device (see :mod:`benchmarks.results`); each table row
names the runs its numbers come from (letters for indices into the file's ``runs``, listed under
the table with device, date, commit and command). The output depends only on the JSON files, so
regenerating it without new results reproduces it byte for byte.
"""

from __future__ import annotations

import argparse
import json
import re
import string
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.results import RESULTS_DIR, TOPICS  # noqa: E402

HERE = Path(__file__).resolve().parent
MAX_LINES = 300  # one device's sections and a second device's op, segment and stage tables


def load(directory: Path = RESULTS_DIR) -> dict[str, list[dict]]:
    """The topic files of each topic, one per device, the one with the most rows first (the
    primary device: its figures are plotted); an empty list where a topic has none.

    Raises:
        ValueError: a file's ``topic`` is not one of ``TOPICS``, or two files of a topic name
            the same device.
    """
    docs: dict[str, list[dict]] = {t: [] for t in TOPICS}
    files: dict[tuple[str, str], str] = {}
    for path in sorted(directory.glob("*.json")):
        doc = json.loads(path.read_text())
        topic = doc.get("topic")
        if topic not in docs:
            raise ValueError(f"{path}: topic {topic!r} is not one of {TOPICS}")
        key = (topic, doc.get("device"))
        if key in files:
            raise ValueError(f"{path} and {files[key]}: two files for topic {topic!r} on {key[1]}")
        files[key] = path.name
        docs[topic].append(doc)
    for group in docs.values():
        group.sort(key=lambda d: -len(d.get("rows", [])))
    return docs


def primary(docs: dict[str, list[dict]], topic: str) -> dict | None:
    """The topic's primary-device file (the plotted one), or None."""
    return docs[topic][0] if docs[topic] else None


def run_id(i: int) -> str:
    """The letter(s) naming run index ``i``: a … z, then aa, ab, …"""
    letters = string.ascii_lowercase
    return letters[i] if i < len(letters) else run_id(i // len(letters) - 1) + letters[i % 26]


def sources(row: dict) -> list[int]:
    """Indices of the runs whose values a row shows: its ``run`` and its per-field ``runs``."""
    return sorted({row["run"], *row.get("runs", {}).values()})


def _run_col(row: dict) -> str:
    return ", ".join(run_id(i) for i in sources(row))


def _ms(x, digits=3) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def _ratio(a, b) -> str:
    return "—" if a is None or b is None else f"{a / b:.2f}"


def _sci(x) -> str:
    return "—" if x is None else f"{x:.1e}"


def _run_lines(rows: list[dict], doc: dict) -> list[str]:
    """One entry per run that ``rows`` show, oldest first."""
    out = [""]
    for i in sorted({i for row in rows for i in sources(row)}):
        r = doc["runs"][i]
        versions = ", ".join(f"{k} {v}" for k, v in r.get("versions", {}).items())
        commit = f"commit {r['commit']}" if r.get("commit") else "commit not recorded"
        note = f"; {r['note']}" if r.get("note") else ""
        out.append(
            f"- **{run_id(i)}**: {doc['device']}, {r['date']}, {commit}, {versions}{note}: "
            f"`{r['command']}`"
        )
    return out


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def op_rows(doc: dict) -> list[dict]:
    """The ops file's rows of the op as users run it: no QAT, the segment count it picks."""
    return [r for r in doc["rows"] if r.get("qat") is None and r.get("segments") is None]


def ops_section(doc: dict) -> list[str]:
    rows = op_rows(doc)
    rows.sort(key=lambda r: (r["variant"] != "gdn", r["variant"], r["dtype"], r["shape"]))
    body = []
    for r in rows:
        p, x, f = r.get("pallas_ms"), r.get("xla_ms"), r.get("fla_ms")
        cells = [r["variant"], r["dtype"], r["shape"], r["mode"], _ms(p), _ms(x), _ms(f)]
        cells += [_ratio(p, f), _ratio(x, p), _ms(r.get("floor_ms")), _run_col(r)]
        body.append(cells)
    out = [
        "## Chunked ops vs FLA",
        "",
        "Forward (`fwd`) and forward+backward (`fwdbwd`, `value_and_grad` of `sum(o * do)`) in ms; "
        "q, k normalised beforehand; JAX: median of batches of back-to-back calls; FLA: "
        "`triton.testing.do_bench` median, its gated backward forced on for timing only (Triton "
        "< 3.7.1 refuses it, FLA issue #640). Floor: `max(bytes / 4.07 TB/s, FLOPs / 700 TFLOP/s)` "
        "from `roofline()` in `bench_gdn.py`.",
        "",
    ]
    out += _table(
        ["variant", "io", "shape", "mode", "pallas", "xla", "FLA", "pallas/FLA", "xla/pallas",
         "floor", "runs"], body)  # fmt: skip
    out += _run_lines(rows, doc)
    if any(r.get("fla_ms") for r in rows):
        out += ["", "![ops vs FLA](ops_vs_fla.png)"]
    if long_context_rows(doc):
        out += ["", "![GDN time vs sequence length at batch 1](ops_vs_T.png)"]
    out += segments_section(doc)
    out += stages_section(doc.get("stages", []), doc)
    qat = [r for r in doc["rows"] if r.get("qat") is not None]
    if qat:
        base = {(r["shape"], r["mode"]): r.get("pallas_ms") for r in qat if r["qat"] == "off"}
        body = [
            [r["shape"], r["mode"], r["qat"], _ms(r.get("pallas_ms")),
             _ratio(r.get("pallas_ms"), base.get((r["shape"], r["mode"]))), _run_col(r)]
            for r in qat
        ]  # fmt: skip
        out += ["", "### QAT cost (GDN, pallas)", ""]
        out += ["FP8 fake quantisation at the state and `w` sites (`bench_gdn.py --qat`).", ""]
        out += _table(["shape", "mode", "QAT (state + w)", "pallas ms", "vs off", "runs"], body)
        out += _run_lines(qat, doc)
    return out


def segments_section(doc: dict) -> list[str]:
    """The pallas path at forced segment counts (``bench_gdn.py --segments``): one row per shape
    and mode, each count's time against the fastest count's."""
    groups: dict[tuple, list[dict]] = {}
    for r in doc["rows"]:
        if r.get("segments") is not None:
            groups.setdefault((r["variant"], r["dtype"], r["shape"], r["mode"]), []).append(r)
    if not groups:
        return []
    body, rows = [], []
    for key, rs in sorted(groups.items()):
        rs.sort(key=lambda r: r["segments"])
        timed = [r for r in rs if r.get("pallas_ms") is not None]
        best = min(timed, key=lambda r: r["pallas_ms"]) if timed else None
        ms = [(r["segments"], r.get("pallas_ms")) for r in rs]
        cells = [f"S{n} {_ms(t)} ({_ratio(t, best['pallas_ms'] if best else None)})" for n, t in ms]
        picked = {r.get("pallas_segments") for r in rs} - {None}
        body.append([*key, str(best["segments"]) if best else "—", ", ".join(cells),
                     ", ".join(map(str, sorted(picked))) or "—", _run_col(rs[0])])  # fmt: skip
        rows += rs
    out = ["", "### Segment counts", ""]
    out += [
        "The pallas path with each lane's chunk loops forced into S segments (`bench_gdn.py "
        "--segments`), ms and (in brackets) the ratio to the fastest count of the same shape and "
        "mode; `picked`: the count the path chose in that run (`segment_count` in "
        "`gdn_jax/ops/_segments.py`).",
        "",
    ]
    out += _table(["variant", "io", "shape", "mode", "fastest S", "pallas ms by S", "picked",
                   "runs"], body)  # fmt: skip
    return out + _run_lines(rows, doc)


STAGE_TOP = 8  # kernels listed per pass; the rest are summed


def _stage_cell(kernels: list[tuple[str, float]]) -> str:
    kernels = sorted(kernels, key=lambda kv: -kv[1])
    cells = [f"`{k}` {ms:.3f}" for k, ms in kernels[:STAGE_TOP]]
    rest = kernels[STAGE_TOP:]
    if rest:
        cells.append(f"{len(rest)} others {sum(ms for _, ms in rest):.3f}")
    return ", ".join(cells)


def stages_section(stages: list[dict], doc: dict) -> list[str]:
    """Per-kernel times: ours (each kernel timed alone, ``bench_gdn.py --stages``) and FLA's
    (profiled in its forward and its forward+backward), one row per (shape, implementation,
    pass), heaviest kernels first."""
    if not stages:
        return []
    groups: dict[tuple, list[tuple[str, float]]] = {}
    for r in stages:
        impl = r["impl"]
        what, kernel = ("kernels", r["kernel"]) if impl == "pallas" else r["kernel"].split(": ", 1)
        key = (r["variant"], r["dtype"], r["shape"], impl, what)
        groups.setdefault(key, []).append((kernel, r["ms"]))
    body = [
        [
            v,
            d,
            shape,
            impl,
            what,
            _ms(None if impl == "pallas" else sum(ms for _, ms in ks)),
            _stage_cell(ks),
        ]
        for (v, d, shape, impl, what), ks in sorted(groups.items())
    ]
    out = [
        "",
        "### Stages",
        "",
        "Kernel times in ms: ours each timed alone (`bench_gdn.py --stages`: forward and backward "
        "kernels, the op's edge-value work and, for split loops, each segment count's kernels), "
        "FLA's from a `torch.profiler` trace of its forward (`fwd`) and of its forward+backward "
        "(`fwdbwd`; `sum`: the pass's kernel time). Edge values: `poison_flags` is what the "
        "pallas path computes in XLA (the flags and first bad tokens of what XLA reads itself; "
        "the kernels flag the other inputs as they load them, in the rows measured at the "
        "commit named); `sanitize_inputs` and `poison_output` are all of `_sanitize.inputs` "
        "and `Poison.output`.",
        "",
    ]
    out += _table(["variant", "io", "shape", "impl", "pass", "sum", "kernels"], body)
    return out + _run_lines(stages, doc)


def decode_section(doc: dict) -> list[str]:
    rows = list(doc["rows"])
    rows.sort(key=lambda r: (r["B"], r["variant"] != "gdn", r["variant"]))
    body = []
    for r in rows:
        fl = r.get("floor_ms")
        cells = [r["variant"], str(r["B"]), f"{r['H']}/{r['HV']}", f"{r['K']}/{r['V']}", _ms(fl, 4)]
        for impl in ("pallas", "xla", "fla"):
            t = r.get(f"{impl}_ms")
            cells.append("—" if t is None else f"{t:.4f} ({_ratio(t, fl)})")
        body.append(cells + [_run_col(r)])
    out = [
        "## Decode step vs FLA and the bandwidth floor",
        "",
        "One token appended to each of B carried f32 states, device time per step inside a jitted "
        "decode loop (state donated); floor = reading and writing the f32 state once at "
        "4.07 TB/s. In brackets: time / floor. FLA: its `fused_recurrent_*` kernels.",
        "",
    ]
    out += _table(["variant", "B", "H/HV", "K/V", "floor ms", "pallas ms", "xla ms", "FLA ms",
                   "runs"], body)  # fmt: skip
    out += _run_lines(rows, doc)
    if any(r.get("pallas_ms") for r in rows):
        out += ["", "![decode vs batch](decode_vs_batch.png)"]
    return out


def _vs(ours, theirs) -> str:
    """``theirs`` ms with ours / theirs in brackets; — where not measured."""
    if theirs is None:
        return "—"
    return f"{theirs:.2f}" + ("" if ours is None else f" ({ours / theirs:.2f})")


def model_section(doc: dict) -> list[str]:
    rows = list(doc["rows"])
    rows.sort(key=lambda r: (-(r["layers"] or 0), r["gpu"] is None, r["gpu"] or 0,
                             r["batch"] * r["seq"], r["seq"]))  # fmt: skip
    body = []
    for r in rows:
        gib = lambda k, r=r: "—" if r.get(k) is None else f"{r[k]:.2f}"
        step = r.get("step_ms")
        tok = r.get("tokens_s") or (step and r["batch"] * r["seq"] / step * 1e3)
        body.append([
            r["preset"], str(r["layers"]), f"B{r['batch']} T{r['seq']}", r["setting"],
            "—" if r["gpu"] is None else str(r["gpu"]), _ms(step, 2),
            "—" if tok is None else f"{tok / 1e3:.1f} k",
            "—" if r.get("mfu") is None else f"{r['mfu']:.1%}", gib("peak_gib"),
            gib("device_temp_gib"), gib("host_temp_gib"), _vs(step, r.get("torch_eager_ms")),
            _vs(step, r.get("torch_compile_ms")), _run_col(r),
        ])  # fmt: skip
    out = [
        "## Model train step",
        "",
        "One AdamW step (f32 parameters, bf16 compute) of the hybrid LM after a warm-up, each "
        "setting in its own process: the mean of steps dispatched back to back, as a training "
        "loop runs them (`bench_model.time_step`; the JSON's `step_synced_ms`: the median of "
        "steps each blocked until done); rows without `step_synced_ms` are that median. Settings "
        "`<projections>+<remat policy>[+overlap]` (`bench_model.py`); memory from XLA's "
        "compiled memory analysis (device / host temp) and the device's peak bytes in use. "
        "The PyTorch columns (`bench_vs_torch.py`: transformers' `Qwen3_5ForCausalLM` with "
        "FLA's kernels, f32 parameters + bf16 autocast, fused AdamW, eager and "
        "`torch.compile`; in brackets ours / theirs) and MFU (`train_flops` in "
        "`bench_vs_torch.py`, 989 TFLOP/s) are empty where not measured.",
        "",
    ]
    out += _table(
        ["preset", "layers", "shape", "setting", "GPU", "step ms", "tokens/s", "MFU",
         "peak GiB", "device temp GiB", "host temp GiB", "torch eager ms", "torch compile ms",
         "runs"],
        body,
    )  # fmt: skip
    out += _run_lines(rows, doc)
    return out


PROFILE_TOP_OPS = 8  # ops listed per profiled step (the JSON keeps --top of them)


def profile_section(doc: dict) -> list[str]:
    steps: dict[tuple, dict[str, list[dict]]] = {}
    for r in doc["rows"]:
        key = (r["preset"], r["batch"], r["seq"], r["setting"])
        steps.setdefault(key, {}).setdefault(r["what"], []).append(r)
    body, used = [], []
    for (preset, batch, seq, setting), kinds in sorted(steps.items()):
        (total,) = kinds["total"]
        used.append(total)
        parts = sorted(kinds.get("scope", []), key=lambda r: r["rank"])
        ops = sorted(kinds.get("op", []), key=lambda r: r["rank"])[:PROFILE_TOP_OPS]
        step = f"{preset} B{batch} T{seq} {setting}"
        body.append(
            [
                step,
                "model parts",
                f"{total['ms']:.2f}",
                ", ".join(f"`{r['name']}` {r['ms']:.2f} ({r['share']:.0%})" for r in parts),
                _run_col(total),
            ]
        )
        body.append(
            [
                step,
                f"top {len(ops)} ops",
                "",
                ", ".join(
                    f"`{r['name']}` {r['ms']:.2f} ({r['category']}; "
                    f"{(r.get('source') or '').replace('|', '/')})"
                    for r in ops
                ),
                _run_col(total),
            ]
        )
    out = [
        "## Train step profile",
        "",
        "Device time per step of the `bench_model` step under `jax.profiler.trace` "
        "(`profile_step.py`, XLA's GPU command buffers off so that each kernel names its op), "
        "in ms: per model part (the model's `jax.named_scope`s; `bwd`: the backward pass; "
        "`other`: ops outside them) with its share of the step, then the heaviest HLO ops "
        "with their category and `op_name`.",
        "",
    ]
    out += _table(["step", "what", "device ms", "ms per part or op", "runs"], body)
    out += _run_lines(used, doc)
    return out


def sharding_section(doc: dict) -> list[str]:
    rows = list(doc["rows"])
    order = {"dp": 0, "fsdp": 1, "tp": 2, "cp": 3}
    rows.sort(key=lambda r: (r["preset"] != "qwen3_5_0_8b", r["preset"], order.get(r["mode"], 9)))
    body = []
    for r in rows:
        name = r["preset"] + (f" ({r['config']})" if r.get("config") else "")
        f32 = (
            "—" if r.get("grad_rel_rms_f32") is None
            else f"{_sci(r['grad_rel_rms_f32'])} / {_sci(r.get('grad_floor'))}"
        )  # fmt: skip
        step = (
            "—" if r.get("step_ms_1") is None
            else f"{r['step_ms_1']:.1f} → {r['step_ms_n']:.1f}"
        )  # fmt: skip
        tok = r.get("tokens_per_s_per_device")
        body.append([
            name, "—" if r["layers"] is None else str(r["layers"]), str(r["seq"]),
            r["mode"] + (" (Explicit axes)" if r.get("axis_type") == "explicit" else ""),
            str(r["devices"]), str(r["global_batch"]), _sci(r.get("loss_rel_diff")),
            _sci(r.get("grad_rel_rms")), f32, step, "—" if tok is None else f"{tok:,.0f}",
            _ratio(r.get("efficiency"), 1.0), _run_col(r),
        ])  # fmt: skip
    out = [
        "## Sharded training",
        "",
        "Each mode on n devices vs the same steps on one device: the largest relative loss "
        "difference over the compared updates, the gradients' relative RMS difference, and "
        "(bf16) the distance of the n-device and one-device gradients from the f32 maths (the "
        "check is n-device ≤ 2× one-device). DP/FSDP scale the global batch with n, TP/CP "
        "split it; efficiency = t₁ / (n·tₙ).",
        "",
    ]
    out += _table(
        ["model", "layers", "T", "mode", "n", "global B", "loss rel diff", "grad vs 1 device",
         "vs f32: n / 1", "step ms 1 → n", "tokens/s/device", "efficiency", "runs"],
        body,
    )  # fmt: skip
    out += _run_lines(rows, doc)
    return out


def hf_section(doc: dict) -> list[str]:
    rows = list(doc["rows"])
    body = []
    for r in rows:
        fmt = lambda x: "—" if x is None else (f"{x:.3g}" if abs(x) < 100 else f"{x:,.0f}")
        body.append([r["what"], "—" if r["batch"] is None else str(r["batch"]),
                     "—" if r["seq"] is None else str(r["seq"]), fmt(r["ours"]), fmt(r["torch"]),
                     fmt(r.get("ratio")), _run_col(r)])  # fmt: skip
    out = [
        "## Hugging Face checkpoint: load, prefill, decode",
        "",
        "One random `qwen3_5_0_8b`-shaped bf16 checkpoint on disk (`Qwen3_5ForCausalLM` layout), "
        "gdn_jax (`load_hf_model`, `HybridLM.extend`, `generate`) against transformers with FLA's "
        "kernels (`from_pretrained`, forward, `generate`) in its own process "
        "(`bench_hf.py`). `load_s` in seconds; `*_tok_s` in tokens/s (decode: greedy after a "
        "128-token prompt, the difference of two generation lengths). Ratio > 1: gdn_jax is "
        "better.",
        "",
    ]
    out += _table(["what", "batch", "seq", "gdn_jax", "transformers+FLA", "ratio", "runs"], body)
    out += _run_lines(rows, doc)
    return out


def render(docs: dict[str, list[dict]]) -> str:
    """The page for the topic files ``docs`` (see :func:`load`). A topic measured on several
    devices gets one section per device, the primary first; the others' headings name their
    device and carry no plots (the plots show the primary device)."""
    out = [
        "# Benchmark results",
        "",
        "Generated by `python benchmarks/report.py` from "
        "`benchmarks/results/<topic>_<device>.json` (one file per topic and device, updated by "
        "the bench scripts); do not edit by hand. Times in ms. Run letters are per section.",
    ]
    sections = {"ops": ops_section, "decode": decode_section, "model": model_section,
                "sharding": sharding_section, "hf": hf_section,
                "profile": profile_section}  # fmt: skip
    for topic in TOPICS:
        for i, doc in enumerate(docs[topic]):
            lines = sections[topic](doc)
            if i:
                rest = [x for x in lines[1:] if not x.startswith("![")]
                lines = [f"{lines[0]} ({doc['device']})", *rest]
            out += [""] + lines
    return "\n".join(out) + "\n"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def bar_rows(doc: dict | None) -> list[dict]:
    """The rows of the bar plot: bf16, no QAT, measured by FLA, and not on the time-vs-T plot
    (:func:`long_context_rows`); GDN first, then by variant, shape and mode."""
    if doc is None:
        return []
    on_t_plot = {id(r) for group in long_context_rows(doc).values() for _, r in group}
    rows = [r for r in op_rows(doc) if r.get("fla_ms")]
    rows = [r for r in rows if r["dtype"] == "bfloat16" and id(r) not in on_t_plot]
    return sorted(rows, key=lambda r: (r["variant"] != "gdn", r["variant"], r["shape"], r["mode"]))


def plot_ops(doc: dict | None, path: Path) -> bool:
    """Bars of pallas / xla / FLA ms for :func:`bar_rows`; False when there are none."""
    rows = bar_rows(doc)
    if not rows:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(1.7 * len(rows) + 2, 3.6))
    width = 0.27
    for i, (impl, label) in enumerate(
        (("pallas_ms", "pallas"), ("fla_ms", "FLA"), ("xla_ms", "xla"))
    ):
        xs = [j + (i - 1) * width for j, r in enumerate(rows) if r.get(impl) is not None]
        ys = [r[impl] for r in rows if r.get(impl) is not None]
        ax.bar(xs, ys, width, label=label)
    ax.set_xticks(range(len(rows)))
    labels = [f"{r['variant']} {r['mode']}\n{r['shape'].removesuffix('_D128')}" for r in rows]
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("ms (log scale)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
    return True


_B1 = re.compile(r"^B1_T(\d+)_H\d+_HV(\d+)_D128$")  # B1 dense shapes (no packed lengths)


def long_context_rows(doc: dict | None) -> dict[tuple[int, str], list[tuple[int, dict]]]:
    """GDN bf16 rows at batch 1 without packing, by (HV, mode): [(T, row)] sorted by T; only
    the groups with at least two sequence lengths (a line needs two points)."""
    groups: dict[tuple[int, str], list[tuple[int, dict]]] = {}
    for r in [] if doc is None else op_rows(doc):
        m = _B1.match(r["shape"])
        if m and r["variant"] == "gdn" and r["dtype"] == "bfloat16":
            groups.setdefault((int(m.group(2)), r["mode"]), []).append((int(m.group(1)), r))
    return {k: sorted(v, key=lambda x: x[0]) for k, v in sorted(groups.items()) if len(v) > 1}


def plot_long_context(doc: dict | None, path: Path) -> bool:
    """GDN ms vs T at batch 1 (pallas, FLA, xla), one panel per mode, a line style per value
    head count; False when no group has two sequence lengths."""
    groups = long_context_rows(doc)
    if not groups:
        return False
    plt = _pyplot()
    modes = sorted({mode for _, mode in groups}, key=lambda m: m != "fwd")
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 3.6), sharey=True)
    axes = [axes] if len(modes) == 1 else list(axes)
    dashes = ["-", "--", ":", "-."]
    hvs = sorted({hv for hv, _ in groups})
    for ax, mode in zip(axes, modes, strict=True):
        for (hv, m), pts in groups.items():
            if m != mode:
                continue
            line = dashes[hvs.index(hv) % len(dashes)]
            for key, label, marker in (("pallas_ms", "pallas", "o"), ("fla_ms", "FLA", "^"),
                                       ("xla_ms", "xla", "s")):  # fmt: skip
                xy = [(t, r[key]) for t, r in pts if r.get(key) is not None]
                if xy:
                    ax.plot(*zip(*xy, strict=True), marker + line, label=f"{label} HV{hv}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"GDN bf16, B1, {mode}")
        ax.set_xlabel("T (tokens)")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("ms")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
    return True


def plot_decode(doc: dict | None, path: Path) -> bool:
    """Decode ms vs batch per variant (pallas, xla, FLA, floor); False when nothing to plot."""
    rows = [] if doc is None else list(doc["rows"])
    if not rows:
        return False
    plt = _pyplot()
    variants = sorted({r["variant"] for r in rows}, key=lambda v: (v != "gdn", v))
    fig, axes = plt.subplots(1, len(variants), figsize=(4 * len(variants), 3.2), sharey=True)
    axes = [axes] if len(variants) == 1 else list(axes)
    for ax, v in zip(axes, variants, strict=True):
        rs = sorted((r for r in rows if r["variant"] == v), key=lambda r: r["B"])
        Bs = [r["B"] for r in rs]
        for key, label, style in (("floor_ms", "floor", "k--"), ("pallas_ms", "pallas", "o-"),
                                  ("xla_ms", "xla", "s-"), ("fla_ms", "FLA", "^-")):  # fmt: skip
            pts = [(b, r.get(key)) for b, r in zip(Bs, rs, strict=True) if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(Bs, [str(b) for b in Bs])
        ax.set_yscale("log")
        ax.set_title(v)
        ax.set_xlabel("batch (sequences)")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("ms per decode step")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=RESULTS_DIR)
    p.add_argument("--out", type=Path, default=HERE / "RESULTS.md")
    p.add_argument("--no-plots", action="store_true")
    a = p.parse_args(argv)
    docs = load(a.results)
    text = render(docs)
    n = text.count("\n")
    if n > MAX_LINES:
        raise SystemExit(
            f"{a.out}: {n} lines, more than {MAX_LINES}: remove superseded rows from the results"
        )
    a.out.write_text(text)
    if not a.no_plots:
        plot_ops(primary(docs, "ops"), a.out.parent / "ops_vs_fla.png")
        plot_decode(primary(docs, "decode"), a.out.parent / "decode_vs_batch.png")
        plot_long_context(primary(docs, "ops"), a.out.parent / "ops_vs_T.png")
    print(f"wrote {a.out} ({n} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
