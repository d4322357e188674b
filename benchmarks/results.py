"""Benchmark results as data: one JSON file per run under ``benchmarks/results/``.

Every file has the same envelope::

    {"topic": "ops" | "decode" | "model" | "sharding",
     "device": "NVIDIA H200", "date": "2026-11-29T10:28:52+00:00", "commit": "e396b85" | null,
     "command": "python3 benchmarks/bench_gdn.py ...", "versions": {"jax": "0.11.2", ...},
     "note": "conditions a reader needs" | null,
     "rows": [...], ...topic extras (ops: "stages")}

Row fields per topic:

- ops: ``variant, shape, mode ("fwd" | "fwdbwd"), dtype, pallas_ms, xla_ms, fla_ms``
  (+ ``floor_ms``; ``qat`` for QAT-cost rows);
- decode: ``variant, B, H, HV, K, V, floor_ms, pallas_ms, xla_ms, fla_ms`` (+ per-call times);
- model: ``preset, layers, batch, seq, setting, step_ms, mfu, peak_gib, torch_eager_ms,
  torch_compile_ms`` (+ memory analysis, compile time);
- sharding: ``preset, layers, seq, mode, devices, global_batch, loss_rel_diff, grad_rel_rms,
  step_ms_1, step_ms_n, tokens_per_s_per_device, efficiency`` (+ comparisons with the f32 maths).

A field that was not measured is ``null``. ``benchmarks/report.py`` merges the files of a topic
(for each row and field, the newest file that measured it) into ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import datetime
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"
TOPICS = ("ops", "decode", "model", "sharding")
# the fields that identify a row of each topic (rows with equal keys are the same measurement)
KEYS = {
    "ops": ("variant", "shape", "mode", "dtype", "qat"),
    "decode": ("variant", "B", "H", "HV", "K", "V"),
    "model": ("preset", "layers", "batch", "seq", "setting", "gpu"),
    "sharding": ("preset", "layers", "seq", "mode", "devices", "global_batch", "config"),
}


def git_commit() -> str | None:
    """The checkout's short commit (``+`` appended when the work tree has changes), or None."""
    try:
        run = lambda *a: subprocess.run(
            ["git", *a], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        commit = run("rev-parse", "--short", "HEAD")
        return commit + ("+" if run("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def versions() -> dict[str, str]:
    """Versions of jax, jaxlib and, when they import, fla, triton, torch, transformer_engine."""
    import jax
    import jaxlib

    out = {"jax": jax.__version__, "jaxlib": jaxlib.__version__}
    for name in ("fla", "triton", "torch", "transformer_engine"):
        mod = sys.modules.get(name)
        if mod is not None:
            out[name] = getattr(mod, "__version__", "?")
    return out


def default_path(topic: str, device_kind: str) -> Path:
    """``benchmarks/results/<topic>_<device>_<UTC time>.json``, e.g. ``ops_h200_20261129T1028``."""
    slug = re.sub(r"[^a-z0-9]+", "", device_kind.lower().removeprefix("nvidia ")) or "device"
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M")
    return RESULTS_DIR / f"{topic}_{slug}_{stamp}.json"


def output_path(arg: str | None, topic: str) -> Path | None:
    """Where a bench script writes its results for ``--json ARG``.

    ``ARG`` a path: there. ``"auto"`` (the scripts' default): :func:`default_path` on an
    accelerator, nowhere on a CPU (CPU runs are checks, not results). ``""``/``"none"``: nowhere.
    """
    import jax

    if arg is None or arg.lower() in ("", "none"):
        return None
    if arg != "auto":
        return Path(arg)
    dev = jax.devices()[0]
    return None if dev.platform == "cpu" else default_path(topic, dev.device_kind)


def write(
    path: Path | None,
    topic: str,
    rows: list[dict],
    *,
    date: str,
    note: str | None = None,
    **extra,
) -> None:
    """Writes one run's results to ``path`` (nothing when None) in the envelope above."""
    import jax

    if path is None:
        return
    if topic not in TOPICS:
        raise ValueError(f"{topic=}: expected one of {TOPICS}")
    doc = {
        "topic": topic,
        "device": jax.devices()[0].device_kind,
        "date": date,
        "commit": git_commit(),
        "command": "python3 " + shlex.join(sys.argv),
        "versions": versions(),
        "note": note,
        "rows": rows,
        **extra,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")


def now() -> str:
    """The current UTC time, ISO 8601 to the second."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
