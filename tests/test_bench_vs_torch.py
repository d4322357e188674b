"""benchmarks/bench_vs_torch.py (smoke run, FLOP count) and benchmarks/profile_step.py's trace
parsing, on the CPU."""

import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import bench_vs_torch, profile_step  # noqa: E402
from gdn_jax.models import HybridLM, get_config  # noqa: E402

HAS_TORCH = all(importlib.util.find_spec(m) for m in ("torch", "transformers"))


@pytest.mark.parametrize("preset,kw", [("tiny", {}), ("qwen3_5_0_8b", {"num_layers": 4})])
def test_non_embedding_params_counts_the_model(preset, kw):
    """The FLOP count's parameter term is the model's parameter count less the embedding (and
    the LM head when untied)."""
    config = get_config(preset, **kw)
    model = nnx.eval_shape(lambda: HybridLM(config, rngs=nnx.Rngs(0)))
    total = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    tables = 1 if config.tie_embeddings else 2
    assert bench_vs_torch.non_embedding_params(config) == total - tables * (
        config.vocab_size * config.hidden_size
    )


def test_train_flops_parts():
    """Per token, only attention grows with T (linearly); the total is the sum of the parts;
    qwen3_5_0_8b at T2048 is about 4.8 GFLOP per token."""
    config = get_config("qwen3_5_0_8b")
    a, b = (bench_vs_torch.train_flops(config, 2, t) for t in (2048, 4096))
    for part in ("params", "lm_head", "gdn_core"):
        assert b[part] == 2 * a[part]
    assert b["attention"] == 4 * a["attention"]
    assert a["total"] == sum(v for k, v in a.items() if k != "total")
    assert 4.6e9 < a["total"] / (2 * 2048) < 5.0e9


def test_smoke_run_writes_rows(tmp_path, capsys):
    """``--smoke``: our step (and the torch stack where torch and transformers import) in child
    processes; one row per setting with the model file's fields, a printed table."""
    path = tmp_path / "model.json"
    rows = bench_vs_torch.main(["--smoke", "--settings", "none", "--json", str(path)])
    out = capsys.readouterr().out
    if not HAS_TORCH:
        print("torch/transformers not importable here: only our side ran")
        assert "not installed: the PyTorch side is skipped" in out
    assert len(rows) == 1
    r = rows[0]
    keys = {"preset", "batch", "seq", "setting", "step_ms", "mfu", "peak_gib", "torch_eager_ms",
            "torch_compile_ms", "tokens_s"}  # fmt: skip
    assert keys <= set(r)
    assert (r["preset"], r["layers"], r["batch"], r["seq"]) == ("tiny", 2, 2, 64)
    assert r["setting"] == "bf16+none"
    assert r["step_ms"] > 0 and math.isfinite(r["loss"])
    assert r["tokens_s"] == pytest.approx(2 * 64 / r["step_ms"] * 1e3)
    flops = bench_vs_torch.train_flops(bench_vs_torch.model_config(
        bench_vs_torch.parse_args(["--smoke"])), 2, 64)["total"]  # fmt: skip
    assert r["mfu"] == pytest.approx(flops / (r["step_ms"] / 1e3) / bench_vs_torch.PEAK_FLOPS)
    assert (r["torch_eager_ms"] is not None) == HAS_TORCH
    assert "| B2 T64 | ours:bf16+none |" in out
    doc = json.loads(path.read_text())
    assert doc["topic"] == "model" and doc["rows"][0]["step_ms"] == r["step_ms"]


def test_profile_parses_a_trace(tmp_path):
    """A jax.profiler trace of a jitted function is read back with ProfileData: each op with
    time is an instruction of the compiled HLO, the dot is a gemm, shares sum to 1."""
    f = jax.jit(lambda x, w: jnp.tanh(x @ w).sum())
    x, w = jnp.ones((128, 256)), jnp.ones((256, 128))
    compiled = f.lower(x, w).compile()
    compiled(x, w).block_until_ready()
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(2):
            compiled(x, w).block_until_ready()
    (xspace,) = tmp_path.rglob("*.xplane.pb")
    times = profile_step.op_times(xspace)
    ops = profile_step.hlo_ops(compiled.as_text())
    assert times and set(times) <= set(ops)
    rows = profile_step.summarise(times, ops, steps=2, top=5)
    assert rows[0]["what"] == "total"
    cats = [r for r in rows if r["what"] == "category"]
    assert sum(r["share"] for r in cats) == pytest.approx(1.0)
    assert "| category | ms/step |" in profile_step.table(rows)


@pytest.mark.parametrize(
    "line,want",
    [
        ('%cublas-gemm.3 = (bf16[8,8]{1,0}, s8[0]{0}) custom-call(%a, %b), '
         'custom_call_target="__cublas$gemm"', "gemm"),
        ('%custom-call.1 = (bf16[2,8,64,256]{3,2,1,0}, f32[2,8,64]{2,1,0}, u8[0]{0}) '
         'custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax"', "attention"),
        ('%custom-call.9 = f32[4,64]{1,0} custom-call(%x), custom_call_target="mosaic_gpu_v2"',
         "pallas"),
        ('%gemm_fusion_dot.2 = bf16[64,64]{1,0} fusion(%p0, %p1), kind=kCustom, calls=%c, '
         'backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}', "gemm"),
        ('%loop_add_fusion = f32[8]{0} fusion(%p0), kind=kLoop, calls=%c', "fusion (elementwise)"),
        ('%input_reduce_fusion.1 = f32[8]{0} fusion(%p0), kind=kInput, calls=%c',
         "fusion (reduce)"),
        ('%copy.4 = bf16[8,16]{0,1} copy(%p0)', "copy"),
    ],
)  # fmt: skip
def test_hlo_categories(line, want):
    """Ops of a compiled GPU module fall in the categories the profile table sums over."""
    (info,) = profile_step.hlo_ops("  " + line).values()
    assert info["category"] == want


def test_kernel_names_join_their_instructions():
    """Events named after a kernel (``.``/``-`` as ``_``) count for their HLO instruction; the
    rest stay apart, and the joined share says how much time found an instruction."""
    ops = profile_step.hlo_ops(
        "  %loop_add_fusion.3 = f32[8]{0} fusion(%p0), kind=kLoop, calls=%c\n"
        '  %cublas-gemm.1 = bf16[8,8]{1,0} custom-call(%a, %b), custom_call_target="__cublas$gemm"'
    )
    times = {"loop_add_fusion_3": (3.0, 1), "loop_add_fusion.3": (1.0, 1),
             "cublas_gemm_1": (4.0, 2), "MemcpyDtoH": (2.0, 1)}  # fmt: skip
    joined, share = profile_step.join(times, ops)
    assert joined == {"loop_add_fusion.3": (4.0, 2), "cublas-gemm.1": (4.0, 2),
                      "MemcpyDtoH": (2.0, 1)}  # fmt: skip
    assert share == pytest.approx(0.8)
    cats = {r["name"] for r in profile_step.summarise(times, ops, 1, 3) if r["what"] == "category"}
    assert cats == {"fusion (elementwise)", "gemm", "copy"}


def test_profile_scope_names_the_model_part_and_pass():
    """Ops are placed in the model part whose ``jax.named_scope`` their op_name carries, in the
    backward pass where the name is under a transpose; the optimizer has no pass; ops outside
    every scope are ``other``."""
    assert profile_step.scope("jit(step)/jvp(gdn_in)/dot_general") == "gdn_in fwd"
    assert profile_step.scope("jit(step)/transpose(jvp(mlp))/dot_general") == "mlp bwd"
    assert profile_step.scope("jit(step)/transpose(jvp(gdn_core))/jit(_core_bwd)/x") == (
        "gdn_core bwd"
    )
    assert profile_step.scope("jit(step)/optimizer/jit(tree_bias_correction)/div") == "optimizer"
    assert profile_step.scope("jit(step)/jvp()/add") == "other"
    assert profile_step.scope("") == "other"


def test_profile_step_attributes_time_to_model_parts():
    """The tiny model's step, traced on the CPU: every named part of the model shows up in the
    per-part rows, forward and backward, and their shares sum to 1."""
    rows = profile_step.main(
        ["--preset", "tiny", "--batch", "2", "--seq", "64", "--steps", "1", "--json", "none"]
    )
    parts = {r["name"]: r["share"] for r in rows if r["what"] == "scope"}
    for part in ("gdn_in", "gdn_core", "gdn_out", "attention", "mlp", "norm"):
        assert {f"{part} fwd", f"{part} bwd"} <= set(parts), (part, sorted(parts))
    assert {"lm_head fwd", "optimizer"} <= set(parts)
    assert sum(parts.values()) == pytest.approx(1.0)


def test_profile_ops_cpu(capsys):
    """benchmarks/profile_ops.py on the CPU (xla path): a case name of any B_T_H_HV_D form, and a
    printed table with the op's device time."""
    from benchmarks import profile_ops

    variant, s = profile_ops.parse_case("kda:B1_T64_H1_HV2_D64")
    assert (variant, s.B, s.T, s.H, s.HV, s.K, s.V) == ("kda", 1, 64, 1, 2, 64, 64)
    with pytest.raises(ValueError, match="variant"):
        profile_ops.parse_case("gla:B1_T64_H1_HV1_D64")
    assert profile_ops.main(["--impl", "xla", "--modes", "fwd", "--iters", "1", "--top", "2",
                             "--ceiling-mib", "1", "gdn:B1_T64_H1_HV1_D64"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert re.search(r"== gdn B1_T64_H1_HV1_D64 bfloat16 fwd \(xla\): \d+\.\d+ ms", out), out
    assert re.search(r"elementwise 2x of 1 MiB f32: \d+ GB/s", out), out
    assert re.search(r"ms  x\d+ +\d+\.\d MB +\d+ GB/s", out), out
    # --dtype: the io tensors (q, k, v, do and the gates beside g) in that dtype, g f32
    progs = profile_ops.programs("gdn2", s, "xla", "float16")
    dts = [a.dtype for a in progs["fwdbwd"][1]]
    assert dts == [jnp.float16] * 3 + [jnp.float32] + [jnp.float16] * 3, dts


def test_hlo_ops_bytes():
    """An instruction's bytes: its result (a tuple's arrays too) and each operand's result once."""
    from benchmarks.profile_step import hlo_ops, type_bytes

    assert type_bytes("(bf16[4,8]{1,0}, f32[2]{0}, pred[3])") == 4 * 8 * 2 + 2 * 4 + 3
    assert type_bytes("s32[]") == 4 and type_bytes("f8e4m3fn[16]") == 16
    hlo = """
ENTRY %main (a: f32[64,128], b: bf16[64,128]) -> f32[64] {
  %a = f32[64,128]{1,0} parameter(0), metadata={op_name="a"}
  %b = bf16[64,128]{1,0} parameter(1)
  %fusion = (f32[64]{0}, bf16[64,128]{1,0}) fusion(%a, %b), kind=kInput, calls=%f
  %sq = f32[64,128]{1,0} multiply(%a, %a)
  ROOT %gte = f32[64]{0} get-tuple-element(%fusion), index=0
}"""
    ops = hlo_ops(hlo)
    assert ops["fusion"]["bytes"] == (64 * 4 + 64 * 128 * 2) + 64 * 128 * 4 + 64 * 128 * 2
    assert ops["sq"]["bytes"] == 2 * 64 * 128 * 4  # an operand read twice counts once
    assert ops["a"]["bytes"] == 64 * 128 * 4 and ops["gte"]["opcode"] == "get-tuple-element"
