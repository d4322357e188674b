"""benchmarks/kernel_resources.py: ptxas reports, CTAs per SM, the rows and their table."""

import importlib.util
import shutil
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


SERIALIZED = (
    "ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are "
    "serialized due to non wgmma instructions reading accumulator registers of  a wgmma between "
    "start and end of the pipeline stage in the function 'chan_bwd_wy_mosaic_gpu_kernel'\n"
)


def test_parse_ptxas_reads_registers_and_spills():
    assert kr.parse_ptxas(SPILLED) == {
        "registers": 255, "stack": 56, "spill_stores": 56, "spill_loads": 56,
        "wgmma_serialized": False,
    }  # fmt: skip
    clean = "ptxas info    : Used 168 registers, used 16 barriers, 1 bytes smem\n"
    assert kr.parse_ptxas(clean) == {
        "registers": 168, "stack": 0, "spill_stores": 0, "spill_loads": 0,
        "wgmma_serialized": False,
    }  # fmt: skip
    assert kr.parse_ptxas(SERIALIZED + clean)["wgmma_serialized"] is True
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
    ptxas = {"chan_intra_qk": kr.parse_ptxas(SERIALIZED + SPILLED) | {"code_bytes": 138_112}}
    rows = kr.rows_for("kda", "bfloat16", "fwd", launches, ptxas)
    qk, loop = sorted(rows, key=lambda r: r["kernel"], reverse=True)
    assert (qk["kernel"], qk["registers"], qk["ctas_smem"], qk["ctas_regs"], qk["ctas"]) == (
        "chan_intra_qk", 255, 4, 2, 2,
    )  # fmt: skip
    assert loop["registers"] is None and loop["ctas"] == loop["ctas_smem"] == 2
    assert (qk["code_bytes"], loop["code_bytes"]) == (138_112, None)
    assert (qk["wgmma_serialized"], loop["wgmma_serialized"]) == (True, None)
    doc = {
        "device": "NVIDIA H100 80GB HBM3",
        "runs": [{"date": "d", "commit": "c", "command": "cmd", "note": None, "versions": {}}],
        "rows": [r | {"run": 0} for r in rows],
    }
    text = "\n".join(_report().kernels_section(doc))
    cell = "255 r +112 B · 2 (4) · 135 KiB · wgmma serialized"
    assert f"| `chan_intra_qk` | fwd | 128 | {cell} | a |" in text
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


READELF = """Section Headers:
  [Nr] Name              Type            Address          Off    Size   ES Flg Lk Inf Al
  [ 0]                   NULL            0000000000000000 000000 000000 00      0   0  0
  [ 9] .nv.info.k        LOPROC+0        0000000000000000 000514 000044 00   I  3  12  4
  [12] .text.k           PROGBITS        0000000000000000 000600 000180 00  AX  3   8 128
  [13] .text.k_helper    PROGBITS        0000000000000000 000780 000020 00  AX  3   8 128
  [14] .nv.constant0.k   PROGBITS        0000000000000000 0007a0 000218 00  AI  0  12  4
"""

TINY_PTX = """.version 8.0
.target sm_90a
.address_size 64
.visible .entry twice(.param .u64 p)
{
  .reg .b64 %rd<3>;
  .reg .f32 %f<3>;
  ld.param.u64 %rd1, [p];
  cvta.to.global.u64 %rd2, %rd1;
  ld.global.f32 %f1, [%rd2];
  add.f32 %f2, %f1, %f1;
  st.global.f32 [%rd2], %f2;
  ret;
}
"""


def test_text_bytes_sums_the_code_sections_only():
    assert kr.text_bytes(READELF) == 0x180 + 0x20  # not the info or constant sections
    with pytest.raises(ValueError, match="no .text"):
        kr.text_bytes(READELF.replace(".text.", ".data."))


@pytest.mark.skipif(
    kr.find_ptxas() is None or shutil.which("readelf") is None, reason="needs ptxas and readelf"
)
def test_code_bytes_compiles_ptx_for_its_target(tmp_path):
    ptx = tmp_path / "twice.ptx"
    ptx.write_text(TINY_PTX)
    small = kr.code_bytes(ptx)
    # SASS instructions are 16 bytes; a longer kernel makes more code
    assert small > 0 and small % 16 == 0
    body = "  add.f32 %f2, %f2, %f1;\n" * 64
    ptx.write_text(TINY_PTX.replace("  st.global", body + "  st.global"))
    assert kr.code_bytes(ptx) > small
    ptx.write_text(TINY_PTX.replace(".target sm_90a\n", ""))
    assert kr.code_bytes(ptx) is None  # no target to compile for


@pytest.mark.gpu
@pytest.mark.parametrize("variant,dtype", [("gdn", "bfloat16"), ("kda", "bfloat16"),
                                           ("gdn2", "float16")])  # fmt: skip
def test_gpu_no_kernel_serializes_its_wgmmas(variant, dtype):
    """ptxas pipelines every kernel's wgmmas: no instruction reads an accumulator before its
    wait (``_compat.acc_values``), which would serialise all of the kernel's wgmmas (C7514)."""
    rows = kr.measure(variant, dtype, "fwdbwd")
    assert all(r["registers"] is not None for r in rows), rows
    serialized = [r["kernel"] for r in rows if r["wgmma_serialized"]]
    assert not serialized, serialized
