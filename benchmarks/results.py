"""Benchmark results as data: one JSON file per topic and device under ``benchmarks/results/``.

``benchmarks/results/<topic>_<device>.json`` (``ops_h200.json``, ``decode_h200.json``,
``model_h200.json``, ``sharding_h200.json``) holds every row measured for that topic on that
device::

    {"topic": "ops" | "decode" | "model" | "sharding" | "hf" | "profile" | "kernels",
     "device": "NVIDIA H200",
     "date": "2026-11-29T10:28:52+00:00", "commit": "e396b85" | null,
     "command": "python3 benchmarks/bench_gdn.py ...", "versions": {"jax": "0.11.2", ...},
     "note": "conditions a reader needs" | null,
     "fla": "0.6.0" | null,                                  (ops only)
     "runs": [{"date", "commit", "command", "note", "versions"}, ...],
     "rows": [{...fields..., "run": 3}, ...],
     "stages": [{"variant", "shape", "dtype", "impl", "kernel", "ms", "run"}, ...]}  (ops, opt.)

The top-level ``date``, ``commit``, ``command``, ``versions``, ``note`` (and ops' ``fla``) are
those of the newest run, ``runs[-1]``. Each row's ``run`` indexes ``runs``: the run that
measured it. A row whose fields come from several runs also has ``"runs": {field: index}`` for
the fields measured by a run other than ``run``.

Row fields per topic:

- ops: ``variant, shape, mode ("fwd" | "fwdbwd"), dtype, pallas_ms, xla_ms, fla_ms``
  (+ ``floor_ms``, ``pallas_segments``: the count the pallas path picked; ``qat`` for QAT-cost
  rows; ``segments`` for the pallas path at a forced segment count, ``bench_gdn.py --segments``);
- decode: ``variant, B, H, HV, K, V, floor_ms, pallas_ms, xla_ms, fla_ms`` (+ per-call times);
- model: ``preset, layers, batch, seq, setting, step_ms, mfu, peak_gib, torch_eager_ms,
  torch_compile_ms`` (+ memory analysis, compile time);
- sharding: ``preset, layers, seq, mode, devices, global_batch, loss_rel_diff, grad_rel_rms,
  step_ms_1, step_ms_n, tokens_per_s_per_device, efficiency`` (+ comparisons with the f32 maths);
- hf: ``what, batch, seq, ours, torch, ratio``;
- profile: ``preset, layers, batch, seq, setting, what ("total" | "op" | "category"), rank,
  name, category, ms, share, count, source`` (``benchmarks/profile_step.py``);
- kernels: ``variant, dtype, mode, kernel, threads, smem, registers, stack, spill_stores,
  spill_loads, ctas_smem, ctas_regs, ctas`` (``benchmarks/kernel_resources.py``).

A field that was not measured is ``null``. The fields of :data:`KEYS` identify a row: a run
that measures a row with the same key replaces it whole (:func:`add_run`). The bench scripts
update their topic file in place through :func:`write` when they run on an accelerator; CPU
runs write nothing unless given ``--json PATH``. ``benchmarks/report.py`` renders the files as
``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"
TOPICS = ("ops", "decode", "model", "sharding", "hf", "profile", "kernels")
# the fields that identify a row of each topic (rows with equal keys are the same measurement)
KEYS = {
    "ops": ("variant", "shape", "mode", "dtype", "qat", "segments"),
    "decode": ("variant", "B", "H", "HV", "K", "V"),
    "model": ("preset", "layers", "batch", "seq", "setting", "gpu"),
    "sharding": (
        "preset",
        "layers",
        "seq",
        "mode",
        "axis_type",
        "devices",
        "global_batch",
        "config",
    ),
    "hf": ("what", "batch", "seq"),
    # one profile's table: a new profile of a step replaces the ops of the same rank
    "profile": ("preset", "layers", "batch", "seq", "setting", "what", "rank"),
    "kernels": ("variant", "dtype", "mode", "kernel"),
}
STAGE_KEYS = ("variant", "shape", "dtype", "impl", "kernel")  # the ops file's per-kernel rows
RUN_FIELDS = ("date", "commit", "command", "note", "versions")  # what each entry of runs says


def git_commit() -> str | None:
    """The checkout's short commit (``+`` appended when the work tree has changes), or None.

    ``BENCH_COMMIT`` in the environment overrides it: a copy of the tree without its git history
    (a remote GPU machine) names the commit it was made from that way.
    """
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
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
    """``benchmarks/results/<topic>_<device>.json``, the device named by its model: e.g.
    ``ops_h200.json`` for "NVIDIA H200", ``ops_h100.json`` for "NVIDIA H100 80GB HBM3"."""
    model = (device_kind.lower().removeprefix("nvidia ").split() or [""])[0]
    slug = re.sub(r"[^a-z0-9]+", "", model) or "device"
    return RESULTS_DIR / f"{topic}_{slug}.json"


def output_path(arg: str | None, topic: str) -> Path | None:
    """Where a bench script writes its results for ``--json ARG``.

    ``ARG`` a path: that file (updated in place like a topic file). ``"auto"`` (the scripts'
    default): :func:`default_path` on an accelerator, nowhere on a CPU (CPU runs are checks,
    not results). ``""``/``"none"``: nowhere.

    Raises:
      ValueError: ``ARG`` names an existing file of another topic or device (a script that asks
        before it times anything, as ``bench_gdn.py`` does, fails at once).
    """
    import jax

    if arg is None or arg.lower() in ("", "none"):
        return None
    dev = jax.devices()[0]
    if arg != "auto":
        path = Path(arg)
        if path.exists():
            try:
                _check_doc(json.loads(path.read_text()), topic, dev.device_kind)
            except ValueError as e:
                raise ValueError(
                    f"--json {arg}: {e}; name this device's file "
                    f"({default_path(topic, dev.device_kind).name}) or a new one"
                ) from None
        return path
    return None if dev.platform == "cpu" else default_path(topic, dev.device_kind)


def _by_key(rows: list[dict], keys: tuple[str, ...]) -> dict[tuple, int]:
    return {tuple(r.get(f) for f in keys): i for i, r in enumerate(rows)}


def _replace_rows(old: list[dict], new: list[dict], keys: tuple[str, ...], run: int) -> list[dict]:
    """``old`` with each row of ``new`` (tagged ``run``) in place of the row with its key."""
    out = list(old)
    index = _by_key(out, keys)
    for row in new:
        row = {f: v for f, v in row.items() if f not in ("run", "runs")} | {"run": run}
        k = tuple(row.get(f) for f in keys)
        if k in index:
            out[index[k]] = row
        else:
            index[k] = len(out)
            out.append(row)
    return out


def _check_doc(doc: dict, topic: str, device: str) -> None:
    """Raises ValueError unless the topic document ``doc`` is ``topic``'s on ``device``."""
    if (doc.get("topic"), doc.get("device")) != (topic, device):
        raise ValueError(
            f"doc is for topic {doc.get('topic')!r} on device {doc.get('device')!r}, "
            f"expected topic {topic!r} on device {device!r}"
        )


def add_run(
    doc: dict | None,
    topic: str,
    device: str,
    run: dict,
    rows: list[dict],
    stages: list[dict] | None = None,
) -> dict:
    """The topic document ``doc`` (None: a new one) with one run's results added.

    Args:
        doc: the current contents of the topic file, or None.
        topic: one of :data:`TOPICS`; must equal ``doc["topic"]``.
        device: the device kind (``"NVIDIA H200"``); must equal ``doc["device"]``.
        run: ``{"date", "commit", "command", "note", "versions"}`` of this run. A run with the
            same ``date`` and ``command`` already in ``doc["runs"]`` is this run (a script that
            rewrites its file as it goes) and is updated; otherwise the run is appended.
        rows: this run's rows; each replaces the row of ``doc`` with the same :data:`KEYS`
            fields or is appended, with ``"run"`` set to this run's index.
        stages: ops only: per-kernel times, replaced by ``STAGE_KEYS`` the same way.

    Returns:
        A new document whose top-level fields are this run's.
    """
    if topic not in TOPICS:
        raise ValueError(f"{topic=}: expected one of {TOPICS}")
    if stages and topic != "ops":
        raise ValueError(f"stages given for {topic=}: only the ops topic has stages")
    missing = [f for f in RUN_FIELDS if f not in run]
    if missing:
        raise ValueError(f"run={run!r}: missing {missing}, expected the fields {RUN_FIELDS}")
    doc = doc or {"topic": topic, "device": device, "runs": [], "rows": []}
    _check_doc(doc, topic, device)
    runs = list(doc["runs"])
    run = {f: run[f] for f in RUN_FIELDS}
    ident = (run["date"], run["command"])
    same = [i for i, r in enumerate(runs) if (r["date"], r["command"]) == ident]
    if same:
        index = same[-1]
        runs[index] = run
    else:
        index = len(runs)
        runs.append(run)
    out = {"topic": topic, "device": device, **{f: run[f] for f in RUN_FIELDS}}
    if topic == "ops":
        out["fla"] = run["versions"].get("fla")
    out["runs"] = runs
    out["rows"] = _replace_rows(doc["rows"], rows, KEYS[topic], index)
    if stages or doc.get("stages"):
        out["stages"] = _replace_rows(doc.get("stages", []), stages or [], STAGE_KEYS, index)
    return out


def write(
    path: Path | None,
    topic: str,
    rows: list[dict],
    *,
    date: str,
    note: str | None = None,
    stages: list[dict] | None = None,
) -> None:
    """Adds one run's results to the topic file ``path`` in place (see :func:`add_run`).

    Nothing is written when ``path`` is None or the run has no rows. The file is locked while it
    is read and rewritten, so processes on several GPUs of one host can share it.

    Args:
        path: the topic file (created when absent), or None.
        topic: one of :data:`TOPICS`.
        rows: the rows this run measured (fields per topic in the module docstring).
        date: the run's start, ISO 8601 (:func:`now`); with the command it identifies the run.
        note: conditions a reader needs, or None.
        stages: ops only: ``{"variant", "shape", "dtype", "impl", "kernel", "ms"}`` per kernel.
    """
    import jax

    if path is None or not (rows or stages):
        return
    run = {
        "date": date,
        "commit": git_commit(),
        "command": "python3 " + shlex.join(sys.argv),
        "note": note,
        "versions": versions(),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        doc = json.loads(path.read_text()) if path.exists() else None
        doc = add_run(doc, topic, jax.devices()[0].device_kind, run, rows, stages)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, path)
    finally:
        os.close(lock)


def now() -> str:
    """The current UTC time, ISO 8601 to the second."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
