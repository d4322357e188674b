"""benchmarks/kernel_resources.py: ptxas reports, CTAs per SM, the rows and their table."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import kernel_resources as kr  # noqa: E402

SPILLED = """ptxas info    : Compiling entry function 'chan_intra_qk_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for chan_intra_qk_mosaic_gpu_kernel
ptxas warning : Registers are spilled to local memory in function 'chan_intra_qk_mosaic_gpu_kernel', 56 bytes spill stores, 56 bytes spill loads
    56 bytes stack frame, 56 bytes spill stores, 56 bytes spill loads
ptxas info    : Used 255 registers, used 2 barriers, 56 bytes cumulative stack size, 1 bytes smem
"""  # noqa: E501


def test_parse_ptxas_reads_registers_and_spills():
    assert kr.parse_ptxas(SPILLED) == {
        "registers": 255, "stack": 56, "spill_stores": 56, "spill_loads": 56,
    }  # fmt: skip
    clean = "ptxas info    : Used 168 registers, used 16 barriers, 1 bytes smem\n"
    assert kr.parse_ptxas(clean) == {
        "registers": 168, "stack": 0, "spill_stores": 0, "spill_loads": 0,
    }  # fmt: skip
    with pytest.raises(ValueError, match="one function"):
        kr.parse_ptxas(SPILLED + clean)
    with pytest.raises(ValueError, match="one function"):
        kr.parse_ptxas("ptxas info    : Compiling entry function 'x' for 'sm_90a'\n")


@pytest.mark.parametrize(
    "smem,threads,registers,expected",
    [
        (54_352, 128, 255, (4, 2, 2)),  # registers, not shared memory, bound it
        (75_848, 128, 242, (3, 2, 2)),
        (83_024, 128, 229, (2, 2, 2)),
        (20_000, 128, 168, (11, 3, 3)),  # 168 registers: three CTAs of one warpgroup
        (20_000, 128, 128, (11, 4, 4)),
        (100_000, 384, 168, (2, 1, 1)),  # three warpgroups of 168 fill the register file
        (1_000, 128, 13, (16, 32, 16)),  # threads bound it: 2048 per SM
        (54_352, 128, None, (4, None, 4)),
    ],
)
def test_ctas_per_sm(smem, threads, registers, expected):
    assert kr.ctas_per_sm(smem, threads, registers) == expected


def _report():
    spec = importlib.util.spec_from_file_location("report", ROOT / "benchmarks" / "report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rows_and_their_table():
    launches = {"chan_intra_qk": {"smem": 54_352, "threads": 128},
                "chan_chunk_fwd": {"smem": 100_000, "threads": 384}}  # fmt: skip
    ptxas = {"chan_intra_qk": kr.parse_ptxas(SPILLED)}
    rows = kr.rows_for("kda", "bfloat16", "fwd", launches, ptxas)
    qk, loop = sorted(rows, key=lambda r: r["kernel"], reverse=True)
    assert (qk["kernel"], qk["registers"], qk["ctas_smem"], qk["ctas_regs"], qk["ctas"]) == (
        "chan_intra_qk", 255, 4, 2, 2,
    )  # fmt: skip
    assert loop["registers"] is None and loop["ctas"] == loop["ctas_smem"] == 2
    doc = {
        "device": "NVIDIA H100 80GB HBM3",
        "runs": [{"date": "d", "commit": "c", "command": "cmd", "note": None, "versions": {}}],
        "rows": [r | {"run": 0} for r in rows],
    }
    text = "\n".join(_report().kernels_section(doc))
    assert "| `chan_intra_qk` | fwd | 128 | 255 r +112 B · 2 (4) | a |" in text
    assert "| `chan_chunk_fwd` | fwd | 384 | — · (2) | a |" in text
    assert "- **a**: NVIDIA H100 80GB HBM3, d, commit c" in text


def test_cpu_run_lowers_the_kernels_and_counts_their_shared_memory():
    """Without a GPU the child lowers the pass for CUDA: every kernel of the KDA forward with its
    shared memory and threads, no registers."""
    rows = kr.measure("kda", "bfloat16", "fwd")
    by = {r["kernel"]: r for r in rows}
    assert {"chan_intra_wy", "chan_intra_qk", "chan_chunk_fwd"} <= set(by), sorted(by)
    for r in rows:
        assert r["smem"] > 0 and r["threads"] % 128 == 0 and r["registers"] is None, r
        assert r["ctas"] == r["ctas_smem"] == kr.ctas_per_sm(r["smem"], r["threads"])[0]
