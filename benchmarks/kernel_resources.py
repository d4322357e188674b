"""Per-kernel resources of the Pallas kernels an op compiles to, and the CTAs per SM they allow.

    python benchmarks/kernel_resources.py                          # kda and gdn2, bf16 and f16
    python benchmarks/kernel_resources.py --variants gdn --dtypes bfloat16 --json none

For each variant, io dtype and pass (``fwd``: the forward; ``fwdbwd``: the forward and its VJP;
:func:`profile_ops.programs` at B1_T256_H2_HV2_D128, whose kernels are those of every dense
shape with K = V = 128), a child process lowers the pass and records per Mosaic GPU kernel:

- ``smem``, ``threads``: Mosaic GPU's shared-memory count per CTA and the CTA's threads
  (:func:`pallas_kernels._compat.record_kernel_launches`);
- on a GPU also ``registers``, ``stack``, ``spill_stores``, ``spill_loads`` (bytes per thread)
  and ``wgmma_serialized`` (ptxas's note C7514, :func:`pallas_kernels._compat.acc_values`):
  ptxas's report on the compiled kernel (Mosaic GPU's ``MOSAIC_GPU_DUMP_PTXAS`` dump), and
  ``code_bytes``: the size of its machine code (the ``.text`` sections of the cubin ptxas makes
  of the dumped PTX, ``MOSAIC_GPU_DUMP_PTX``; None where no ptxas or readelf is found). The
  channel kernels are straight-line code of up to 143 KiB (``results/kernels_h200.json``), so
  the size is one to watch beside the registers when a kernel slows as a whole;
- ``ctas_smem``, ``ctas_regs``, ``ctas``: the CTAs per SM that its shared memory, its registers
  and both allow on a Hopper SM (:func:`ctas_per_sm`).

Without a GPU the passes are lowered for CUDA only (``smem``, ``threads``, ``ctas_smem``); the
registers need the GPU's ptxas. Rows go to ``benchmarks/results/kernels_<device>.json``
(``--json``, as the other bench scripts).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE = "B1_T256_H2_HV2_D128"
# Hopper (sm_90) per SM: shared memory for CTAs (1 KiB of it reserved per CTA), registers
# (allocated per warp in units of 256), threads and resident CTAs
SM_SMEM, CTA_RESERVED_SMEM = 228 * 1024, 1024
SM_REGISTERS, WARP_REGISTER_UNIT = 65536, 256
SM_THREADS, SM_CTAS = 2048, 32

_USED = re.compile(r"Used (\d+) registers")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas(text: str) -> dict[str, int | bool]:
    """``{"registers", "stack", "spill_stores", "spill_loads", "wgmma_serialized"}`` of ptxas's
    verbose report on one kernel (``ptxas info : Used N registers ...``, ``N bytes stack frame,
    N bytes spill stores, N bytes spill loads``, and its note C7514: every wgmma of the kernel
    serialised because other instructions read an accumulator before its wait).

    Raises:
      ValueError: the text holds no register count, or reports on more than one function.
    """
    used = _USED.findall(text)
    frames = _FRAME.findall(text)
    if len(used) != 1 or len(frames) > 1:
        raise ValueError(f"expected one function's ptxas report, found {len(used)}: {text!r}")
    stack, stores, loads = map(int, frames[0]) if frames else (0, 0, 0)
    return {
        "registers": int(used[0]),
        "stack": stack,
        "spill_stores": stores,
        "spill_loads": loads,
        "wgmma_serialized": "(C7514)" in text,
    }


_TEXT = re.compile(r"\]\s+\.text\.\S+\s+PROGBITS\s+[0-9a-f]+\s+[0-9a-f]+\s+([0-9a-f]+)\s")
_TARGET = re.compile(r"^\s*\.target\s+(sm_\w+)", re.M)


def find_ptxas() -> str | None:
    """A ptxas binary: on the PATH, else one shipped in a Python package (the CUDA toolchain
    wheels ``nvidia/*/bin``, Triton's ``triton/backends/nvidia/bin``); None if there is none."""
    found = shutil.which("ptxas")
    if found:
        return found
    for root in map(Path, sys.path):
        for hit in (*root.glob("nvidia/*/bin/ptxas"), root / "triton/backends/nvidia/bin/ptxas"):
            if hit.is_file():
                return str(hit)
    return None


def text_bytes(readelf_sections: str) -> int:
    """The summed size of the ``.text.*`` sections (one per kernel function) in ``readelf -S -W``
    output of a cubin.

    Raises:
      ValueError: the listing has no ``.text`` section.
    """
    sizes = [int(h, 16) for h in _TEXT.findall(readelf_sections)]
    if not sizes:
        raise ValueError(f"no .text section in {readelf_sections!r}")
    return sum(sizes)


def code_bytes(ptx: Path) -> int | None:
    """Bytes of machine code ptxas makes of one kernel's PTX (for the PTX's own ``.target``);
    None where ptxas or readelf is missing."""
    ptxas, readelf = find_ptxas(), shutil.which("readelf")
    target = _TARGET.search(ptx.read_text())
    if ptxas is None or readelf is None or target is None:
        return None
    with tempfile.TemporaryDirectory() as d:
        cubin = Path(d) / "kernel.cubin"
        subprocess.run(
            [ptxas, f"-arch={target.group(1)}", "-O3", str(ptx), "-o", str(cubin)],
            check=True, capture_output=True,
        )  # fmt: skip
        listing = subprocess.run([readelf, "-S", "-W", str(cubin)], check=True,
                                 capture_output=True, text=True).stdout  # fmt: skip
    return text_bytes(listing)


def ctas_per_sm(
    smem: int, threads: int, registers: int | None = None
) -> tuple[int, int | None, int]:
    """(by shared memory and threads, by registers, both) CTAs per Hopper SM for a kernel of
    ``smem`` bytes of shared memory and ``threads`` threads per CTA, using ``registers`` per
    thread (None: unknown, the third value then counts shared memory and threads only)."""
    by_smem = min(SM_CTAS, SM_THREADS // threads, SM_SMEM // (smem + CTA_RESERVED_SMEM))
    if registers is None:
        return by_smem, None, by_smem
    per_warp = math.ceil(registers * 32 / WARP_REGISTER_UNIT) * WARP_REGISTER_UNIT
    by_regs = SM_REGISTERS // (per_warp * (threads // 32))
    return by_smem, by_regs, min(by_smem, by_regs)


def rows_for(variant: str, dtype: str, mode: str, launches: dict, ptxas: dict) -> list[dict]:
    """One row per kernel from the child's ``launches`` ({name: {"smem", "threads"}}) and the
    ptxas reports ``ptxas`` ({name: :func:`parse_ptxas` dict, with ``code_bytes`` where
    measured}; empty without a GPU)."""
    rows = []
    for name in sorted(launches):
        launch, report = launches[name], ptxas.get(name, {})
        by_smem, by_regs, ctas = ctas_per_sm(
            launch["smem"], launch["threads"], report.get("registers")
        )
        rows.append({
            "variant": variant, "dtype": dtype, "mode": mode, "kernel": name,
            "threads": launch["threads"], "smem": launch["smem"],
            "registers": report.get("registers"), "stack": report.get("stack"),
            "spill_stores": report.get("spill_stores"), "spill_loads": report.get("spill_loads"),
            "code_bytes": report.get("code_bytes"),
            "wgmma_serialized": report.get("wgmma_serialized"),
            "ctas_smem": by_smem, "ctas_regs": by_regs, "ctas": ctas,
        })  # fmt: skip
    return rows


def child(variant: str, dtype: str, mode: str) -> None:
    """Lowers (GPU: compiles and runs once) one pass and prints its kernels' launches as JSON."""
    import jax

    from benchmarks import profile_ops
    from pallas_kernels import _compat as pk

    v, s = profile_ops.parse_case(f"{variant}:{SHAPE}")
    f, args = profile_ops.programs(v, s, "pallas", dtype)[mode]
    with pk.record_kernel_launches() as launches:
        if jax.default_backend() == "gpu":
            jax.block_until_ready(f(*args))
        else:
            with pk.cuda_lowering_mesh():
                f.trace(*args).lower(lowering_platforms=("cuda",))
    print(json.dumps({n: {"smem": k.smem, "threads": k.threads} for n, k in launches.items()}))


def measure(variant: str, dtype: str, mode: str) -> list[dict]:
    """The rows of one pass, from a child process (its own dump directory)."""
    with tempfile.TemporaryDirectory() as dump:
        env = dict(
            os.environ, MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_TO=dump
        )
        cmd = [sys.executable, __file__, "--child", variant, dtype, mode]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        if out.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-4000:]}")
        launches = json.loads(out.stdout.strip().splitlines()[-1])
        ptxas = {p.stem: parse_ptxas(p.read_text()) for p in Path(dump).glob("*.ptxas")}
        for name, report in ptxas.items():
            ptx = Path(dump) / f"{name}.ptx"
            report["code_bytes"] = code_bytes(ptx) if ptx.is_file() else None
    return rows_for(variant, dtype, mode, launches, ptxas)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="+", default=["kda", "gdn2"], choices=["gdn", "kda", "gdn2"])
    p.add_argument(
        "--dtypes", nargs="+", default=["bfloat16", "float16"], choices=["bfloat16", "float16"]
    )
    p.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    p.add_argument("--json", default="auto", help="topic file, 'auto' (GPU only) or 'none'")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        child(*a.child)
        return 0
    from benchmarks import results

    date = results.now()
    rows = []
    for variant in a.variants:
        for dtype in a.dtypes:
            for mode in a.modes:
                rows += measure(variant, dtype, mode)
    cols = ("variant", "dtype", "mode", "kernel", "threads", "smem", "registers",
            "spill_stores", "code_bytes", "wgmma_serialized", "ctas_smem", "ctas_regs",
            "ctas")  # fmt: skip
    print(" ".join(f"{c:>14}" for c in cols))
    for r in rows:
        print(" ".join(f"{r[c]!s:>14}" for c in cols))
    results.write(results.output_path(a.json, "kernels"), "kernels", rows, date=date)
    return 0


if __name__ == "__main__":
    sys.exit(main())
