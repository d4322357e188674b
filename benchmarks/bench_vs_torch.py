"""The hybrid LM's train step, gdn_jax vs transformers' ``Qwen3_5ForCausalLM`` with FLA's kernels.

Both stacks run one AdamW step (``bench_model.ADAMW``: the same lr, betas, eps and weight
decay; f32 parameters, bf16 compute) of the same model on the same tokens
(``bench_model.make_tokens``: inputs ``[:, :-1]``, targets ``[:, 1:]``, mean cross-entropy over
all ``B * T`` positions):

- ours: ``bench_model.build_step`` (``HybridLM``, the chunked LM-head loss), per remat setting
  ``bf16+none`` (no checkpoint) and ``bf16+save`` (every layer checkpointed, named tensors
  saved); peak memory is ``device.memory_stats()['peak_bytes_in_use']``.
- torch: ``transformers.Qwen3_5ForCausalLM`` built in code from ``HybridConfig.to_hf()`` (no
  download), random weights, ``torch.autocast(bfloat16)``, logits upcast to f32 for the
  cross-entropy, fused ``torch.optim.AdamW``; eager and ``torch.compile`` (of each decoder layer
  and of the cross-entropy). FLA's kernels are bound when ``fla`` imports (transformers picks
  them up); FLA refuses its gated backward on Triton < 3.7.1, so for timing only this script sets
  ``fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 = True`` and prints that it did. Peak memory is
  ``torch.cuda.max_memory_allocated()``.

Every (case, stack) runs in its own process, so device memory, allocator peaks and compile
caches never mix. After two warm-up steps dispatched back to back (Triton autotuning and
``torch.compile`` on the torch side; both allocators then hold two steps' buffers) each stack
runs ``--iters`` steps back to back with one sync at the end, as a training loop does:
``step_ms`` is their mean. Then ``--iters`` more steps each blocked until done: ``*_synced_ms``
(their median) adds the host's time to prepare a step to every step.

FLOPs of one step (:func:`train_flops`; model FLOPs, no recomputation counted), per token::

    6 * N_nonembedding                          matmul parameters, forward + backward
  + 6 * d * vocab                               the LM head (tied or not)
  + 6 * d_head * heads * T * layers_attn        causal softmax attention: 2 products of
                                                2 * T^2 * d_head * heads per sequence, halved
                                                by the causal mask, times 3 (forward + backward)
  + 6 * layers_gdn * HV * (3*C*K + 2*C*V + 3*K*V + C^2/3)
                                                the chunked GDN core (chunk C = 64): per chunk
                                                and head K K^T, Q K^T, W = A (beta K) (C^2 K
                                                each), U = A (beta V) and the intra-chunk output
                                                (C^2 V each), V_new = U - W S, Q S and the state
                                                update (C K V each), the triangular solve (C^3/3);
                                                2 FLOPs a multiply-add, times 3

``N_nonembedding`` (:func:`non_embedding_params`) counts every parameter but the embedding table
and an untied LM head. MFU = FLOPs / (step time * 989 TFLOP/s), the H200's dense bf16 peak.

    python benchmarks/bench_vs_torch.py                                 # H200, all cases
    python benchmarks/bench_vs_torch.py --cases 4x4096 --stacks ours,torch_eager
    python benchmarks/bench_vs_torch.py --smoke        # tiny preset, T=64, 2 steps, any backend
    python benchmarks/bench_vs_torch.py --cases 2x4096 --stacks torch_compile --torch-profile 15
                                                       # + the costliest kernels of one step

Rows ``{preset, layers, batch, seq, setting, gpu, step_ms, tokens_s, mfu, peak_gib,
torch_eager_ms, torch_compile_ms, ...}`` (one per our setting, with the torch numbers of its
case) go to ``benchmarks/results/model_<device>.json`` on a GPU (:mod:`benchmarks.results`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PEAK_FLOPS = 989e12  # H200 dense bf16
DEFAULT_CASES = "2x2048,4x2048,8x2048,4x4096"
STACKS = ("ours", "torch_eager", "torch_compile")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="qwen3_5_0_8b")
    p.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    p.add_argument("--cases", default=DEFAULT_CASES, help="comma list of BATCHxSEQ")
    p.add_argument("--settings", default="none,save", help="our remat policies (bench_model)")
    p.add_argument("--stacks", default=",".join(STACKS), help=f"subset of {STACKS}")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument(
        "--implementation", default=None, help="GDN core: default pallas on a GPU, xla on a CPU"
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=1e9,
        help="wall seconds for the whole run: a process still running then is stopped, none is "
        "started with less than 15 s left (the table shows what finished)",
    )
    p.add_argument("--child-timeout-s", type=float, default=900.0, help="per process")
    p.add_argument(
        "--torch-profile",
        type=int,
        default=0,
        metavar="N",
        help="torch stacks: one more step under torch.profiler; print its N costliest kernels",
    )
    p.add_argument("--json", default="auto", help="results file: auto, PATH, none")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny preset (2 layers), one case B2 T64, 2 steps; torch on the CPU without a GPU, "
        "no FLA",
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: stack:setting
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--hf-config", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.preset, args.cases, args.iters = "tiny", "2x64", 2
    stacks = args.stacks.split(",")
    if not set(stacks) <= set(STACKS):
        raise ValueError(f"--stacks {args.stacks!r}: expected a comma list of {STACKS}")
    args.case_list = [parse_case(c) for c in args.cases.split(",")]
    return args


def parse_case(case: str) -> tuple[int, int]:
    """``"4x4096"`` -> ``(4, 4096)`` (batch, sequence length)."""
    try:
        b, t = (int(x) for x in case.lower().split("x"))
    except ValueError:
        raise ValueError(f"case {case!r}: expected BATCHxSEQ, e.g. 4x4096") from None
    if b < 1 or t < 1:
        raise ValueError(f"case {case!r}: batch and sequence length must be >= 1")
    return b, t


# The smoke model: the tiny preset cut to one GDN and one attention layer (the cheapest
# compile with both mixers), with Qwen3.5's zero-centred norms so that it has an HF equivalent.
SMOKE = dict(
    num_layers=2, layer_pattern=("linear", "attention"), zero_centered_norm=True, chunk_size=16
)


def model_config(args):
    """The benchmarked ``HybridConfig``: the preset (:data:`SMOKE` in smoke mode) and
    ``--layers``."""
    from gdn_jax.models import get_config

    overrides = dict(SMOKE) if args.smoke else {}
    if args.layers:
        overrides.pop("layer_pattern", None)
        overrides["num_layers"] = args.layers
    return get_config(args.preset, **overrides)


# ---------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------


def non_embedding_params(config) -> int:
    """Parameters of ``HybridLM(config)`` without the embedding table and an untied LM head."""
    c = config
    D = c.hidden_size
    n = 3 * D * c.intermediate_size + 2 * D  # SwiGLU, the two RMSNorms of a layer
    per = {"linear": 0, "attention": 0}
    H, K, HV, V = c.linear_num_heads, c.linear_head_dim, c.linear_num_v_heads, c.linear_v_head_dim
    if c.variant != "gdn":
        raise NotImplementedError(f"variant={c.variant!r}: the FLOP count is for 'gdn' layers")
    per["linear"] = (
        2 * D * H * K + 2 * D * HV * V + 2 * D * HV + HV * V * D  # q, k, v, z, a, b, out
        + c.conv_kernel * (2 * H * K + HV * V)  # short convs
        + 2 * HV + V  # A_log, dt_bias, the gated norm
    )  # fmt: skip
    N, NKV, Dh = c.attn_num_heads, c.attn_num_kv_heads, c.attn_head_dim
    per["attention"] = 2 * D * N * Dh + 2 * D * NKV * Dh + N * Dh * D + 2 * Dh
    return sum(n + per[t] for t in c.layer_types) + D  # + the final norm


def train_flops(config, batch: int, seq: int, *, chunk: int | None = None) -> dict[str, float]:
    """Model FLOPs of one train step (forward + backward) over ``batch * seq`` tokens, by part
    (``params``, ``lm_head``, ``attention``, ``gdn_core``) and their ``total`` (module docstring).
    """
    c = config
    tokens = batch * seq
    C = chunk or c.chunk_size
    K, V, HV = c.linear_head_dim, c.linear_v_head_dim, c.linear_num_v_heads
    n_attn = c.layer_types.count("attention")
    n_gdn = c.layer_types.count("linear")
    out = dict(
        params=6.0 * non_embedding_params(c) * tokens,
        lm_head=6.0 * c.hidden_size * c.vocab_size * tokens,
        attention=6.0 * c.attn_head_dim * c.attn_num_heads * seq * n_attn * tokens,
        gdn_core=6.0 * n_gdn * HV * (3 * C * K + 2 * C * V + 3 * K * V + C * C / 3) * tokens,
    )
    out["total"] = sum(out.values())
    return out


# ---------------------------------------------------------------------------------------------
# The two stacks (each in its own process)
# ---------------------------------------------------------------------------------------------


def run_ours(args, setting: str, batch: int, seq: int) -> dict:
    import jax

    from benchmarks.bench_model import build_step, peak_gib, time_step

    impl = args.implementation or ("pallas" if jax.default_backend() == "gpu" else "xla")
    s = build_step(model_config(args), setting, batch, seq, implementation=impl)
    ma = s.compiled.memory_analysis()
    times, s, loss = time_step(s, args.iters)
    gib = 2.0**-30
    return dict(
        step_ms=1e3 * times.pipelined_s,
        step_synced_ms=1e3 * times.synced_s,
        peak_gib=peak_gib(),
        compile_s=s.compile_s,
        device_temp_gib=getattr(ma, "temp_size_in_bytes", 0) * gib,
        host_temp_gib=getattr(ma, "host_temp_size_in_bytes", 0) * gib,
        loss=loss,
        implementation=impl,
        device=jax.devices()[0].device_kind,
    )


def bind_fla(smoke: bool) -> tuple[str, list[int] | None]:
    """Makes transformers' Qwen3.5 GDN layer call FLA's chunked kernel (or, in smoke mode, its
    PyTorch reference); what was done, for the output, and a one-element list that counts the
    kernel's calls (None without FLA). Call before importing transformers.

    transformers picks FLA up by itself in eager mode, but its compiled step (torch 2.11,
    transformers 5.17) ran the PyTorch reference of the chunked rule: ``--torch-profile`` showed
    thousands of small per-chunk matmuls and no FLA kernel. So the module's
    ``torch_chunk_gated_delta_rule`` is replaced by FLA's function here, outside any graph
    (``torch.compiler.disable``, as FLA itself declares it), and the step checks the call count.
    """
    if smoke:
        sys.modules["fla"] = None  # transformers' availability check then finds no FLA
        return "FLA not used (smoke)", None
    try:
        import fla
        import fla.ops.common.chunk_o as fla_chunk_o
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as e:
        return f"FLA does not import ({e}): transformers' PyTorch fallbacks", None
    import inspect

    import torch
    from transformers.models.qwen3_5 import modeling_qwen3_5

    fla_chunk_o.TRITON_ABOVE_3_7_1 = True  # timing only: FLA refuses its gated bwd on Triton<3.7.1
    print("NOTE: fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1 = True (FLA's gated backward forced on "
          "for timing; Triton < 3.7.1)", flush=True)  # fmt: skip
    accepted = set(inspect.signature(chunk_gated_delta_rule).parameters)
    calls = [0]

    @torch.compiler.disable
    def fla_chunk_rule(*args, **kwargs):
        calls[0] += 1
        return chunk_gated_delta_rule(*args, **{k: v for k, v in kwargs.items() if k in accepted})

    modeling_qwen3_5.torch_chunk_gated_delta_rule = fla_chunk_rule
    note = f"fla {getattr(fla, '__version__', '?')}, gated backward forced on (TRITON_ABOVE_3_7_1)"
    return note, calls


def run_torch(args, compiled: bool, batch: int, seq: int) -> dict:  # pragma: no cover - torch
    """The transformers side: written from transformers 5.17's API; runs where torch does."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is built from a local config.json
    fla_note, fla_calls = bind_fla(args.smoke)
    import torch
    import transformers

    from benchmarks.bench_model import ADAMW, WARMUP, make_tokens, time_calls

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = transformers.AutoConfig.from_pretrained(args.hf_config)  # config.json of to_hf()
    with torch.device(device):
        model = transformers.Qwen3_5ForCausalLM(cfg).to(torch.float32)
    model.train()
    opt = torch.optim.AdamW(
        model.parameters(), lr=ADAMW["learning_rate"], betas=(ADAMW["b1"], ADAMW["b2"]),
        eps=ADAMW["eps"], weight_decay=ADAMW["weight_decay"], fused=device == "cuda",
    )  # fmt: skip
    tokens = torch.as_tensor(make_tokens(batch, seq, cfg.vocab_size), device=device).long()
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def cross_entropy(logits, targets):
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    if compiled:
        # Per decoder layer, as torchtitan compiles per block: the layers share one compiled graph
        # per mixer type, so compile time does not grow with depth. The loss is compiled on its own.
        for layer in model.model.layers:
            layer.compile()
        cross_entropy = torch.compile(cross_entropy)

    def loss_fn(inputs, targets):
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            logits = model(input_ids=inputs, use_cache=False).logits
        return cross_entropy(logits, targets)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    last = {}

    def step():
        loss = loss_fn(inputs, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        last["loss"] = loss
        return loss

    t0 = time.perf_counter()
    for _ in range(WARMUP):  # also torch.compile and Triton autotuning
        step()
    sync()
    warmup_s = time.perf_counter() - t0
    pipelined_s, synced_s = time_calls(step, lambda loss: sync(), args.iters)
    peak = torch.cuda.max_memory_allocated() * 2.0**-30 if device == "cuda" else None
    top = profile_top_kernels(step, args.torch_profile) if args.torch_profile else None
    steps = WARMUP + 2 * args.iters + bool(args.torch_profile)
    gdn_layers = cfg.layer_types.count("linear_attention")
    if fla_calls is not None and fla_calls[0] != steps * gdn_layers:
        raise RuntimeError(f"FLA's chunked kernel ran {fla_calls[0]} times in {steps} steps of "
                           f"{gdn_layers} GDN layers: the torch stack did not run FLA")  # fmt: skip
    return dict(
        top_kernels=top,
        step_synced_ms=1e3 * synced_s,
        dynamo=dynamo_summary() if compiled else None,
        step_ms=1e3 * pipelined_s,
        peak_gib=peak,
        compile_s=warmup_s,
        loss=float(last["loss"]),
        params=sum(p.numel() for p in model.parameters()),
        attn_implementation=getattr(cfg, "_attn_implementation", None),
        fla=fla_note,
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
        versions=dict(torch=torch.__version__, transformers=transformers.__version__),
    )


def dynamo_summary() -> dict:  # pragma: no cover - torch
    """What ``torch.compile`` made of the step: its graph and recompile counts and the most
    frequent graph-break reasons (a compiled step slower than eager is explained here)."""
    from torch._dynamo.utils import counters

    breaks = counters["graph_break"]
    return dict(
        stats=dict(counters["stats"]),
        recompiles=sum(counters["recompiles"].values()) if "recompiles" in counters else None,
        graph_breaks=[(r.split("\n")[0][:160], n) for r, n in breaks.most_common(6)],
    )


def profile_top_kernels(step, n: int) -> list[tuple[str, float, int]]:  # pragma: no cover
    """One ``step()`` under ``torch.profiler``: its ``n`` costliest device kernels (CPU ops
    without a GPU) as ``(name, total ms, calls)``, from the profiler's per-name averages."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = e.device_time_total if cuda else e.self_cpu_time_total
        if us > 0 and (not cuda or e.device_type.name == "CUDA"):
            rows.append((e.key[:120], us / 1e3, e.count))
    return sorted(rows, key=lambda r: -r[1])[:n]


def child_main(args) -> None:
    stack, _, setting = args.child.partition(":")
    batch, seq = parse_case(args.case)
    if stack == "ours":
        out = run_ours(args, setting, batch, seq)
    else:
        out = run_torch(args, stack == "torch_compile", batch, seq)
    Path(args.child_out).write_text(json.dumps(out))


def _child_argv(argv: list[str]) -> list[str]:
    """The parent's flags a child needs (the parent-only ones dropped)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=")[0]
        if name in ("--cases", "--stacks", "--settings", "--json", "--budget-s"):
            skip = "=" not in a
            continue
        out.append(a)
    return out


def run_child(argv, what: str, case: str, hf_config: Path, timeout: float) -> dict | None:
    """``what`` (``ours:<setting>``, ``torch_eager``, ``torch_compile``) for ``case`` in a fresh
    interpreter; its result, or None (the reason printed)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, *_child_argv(argv), "--child", what, "--case", case,
               "--child-out", str(out), "--hf-config", str(hf_config)]  # fmt: skip
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"  {what} {case}: timed out after {timeout:.0f} s", flush=True)
            return None
        for line in proc.stdout.splitlines():
            if line.startswith("NOTE"):
                print(f"  {what}: {line}", flush=True)
        if proc.returncode or not out.exists():
            tail = "\n".join("    " + x for x in proc.stderr.strip()[-1500:].splitlines())
            print(f"  {what} {case} failed (rc {proc.returncode}):\n{tail}", flush=True)
            return None
        return json.loads(out.read_text())


# ---------------------------------------------------------------------------------------------
# Rows and table
# ---------------------------------------------------------------------------------------------


def make_rows(args, config, results: dict) -> list[dict]:
    """One row per our setting and case that ran: ``results[(case, what)]`` -> row fields."""
    rows = []
    for batch, seq in args.case_list:
        case = f"{batch}x{seq}"
        flops = train_flops(config, batch, seq)["total"]
        eager = results.get((case, "torch_eager")) or {}
        comp = results.get((case, "torch_compile")) or {}
        for setting in args.settings.split(","):
            r = results.get((case, f"ours:bf16+{setting}"))
            if r is None:
                continue
            step_s = r["step_ms"] / 1e3
            rows.append(dict(
                preset=args.preset, layers=config.num_layers, batch=batch, seq=seq,
                setting=f"bf16+{setting}", gpu=None, step_ms=r["step_ms"],
                tokens_s=batch * seq / step_s, mfu=flops / step_s / PEAK_FLOPS,
                step_synced_ms=r.get("step_synced_ms"),
                peak_gib=r["peak_gib"], torch_eager_ms=eager.get("step_ms"),
                torch_compile_ms=comp.get("step_ms"),
                torch_eager_synced_ms=eager.get("step_synced_ms"),
                torch_compile_synced_ms=comp.get("step_synced_ms"),
                torch_eager_peak_gib=eager.get("peak_gib"),
                torch_compile_peak_gib=comp.get("peak_gib"), flops=flops,
                compile_s=r["compile_s"], device_temp_gib=r["device_temp_gib"],
                host_temp_gib=r["host_temp_gib"], loss=r["loss"], torch_loss=eager.get("loss"),
            ))  # fmt: skip
    return rows


def table(args, config, results: dict) -> str:
    """The printed table: one line per (case, stack), ratios ours / theirs on our lines."""
    head = ("| case | stack | step ms | tokens/s | MFU | peak GiB | ours/eager | ours/compile |\n"
            "|---|---|---|---|---|---|---|---|")  # fmt: skip
    lines = [head]
    fmt = lambda x, f: "—" if x is None else format(x, f)
    for batch, seq in args.case_list:
        case = f"{batch}x{seq}"
        flops = train_flops(config, batch, seq)["total"]
        eager = (results.get((case, "torch_eager")) or {}).get("step_ms")
        comp = (results.get((case, "torch_compile")) or {}).get("step_ms")
        whats = [f"ours:bf16+{s}" for s in args.settings.split(",")] + [
            "torch_eager",
            "torch_compile",
        ]
        for what in whats:
            if (case, what) not in results:
                continue
            r = results[(case, what)]
            if r is None:
                lines.append(f"| B{batch} T{seq} | {what} | failed | | | | | |")
                continue
            ms = r["step_ms"]
            ours = what.startswith("ours")
            ratio = lambda t, ms=ms, ours=ours: fmt(ms / t, ".2f") if ours and t else ""
            lines.append(
                f"| B{batch} T{seq} | {what} | {ms:.1f} | {batch * seq / ms * 1e3:,.0f} | "
                f"{flops / (ms / 1e3) / PEAK_FLOPS:.1%} | {fmt(r.get('peak_gib'), '.1f')} | "
                f"{ratio(eager)} | {ratio(comp)} |"
            )
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.child:
        child_main(args)
        return []
    from benchmarks import results as results_lib

    config = model_config(args)
    start, date = time.perf_counter(), results_lib.now()
    stacks = args.stacks.split(",")
    whats = [f"ours:bf16+{s}" for s in args.settings.split(",")] if "ours" in stacks else []
    torch_ok = True
    if any(s.startswith("torch") for s in stacks):
        missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
        if missing:
            torch_ok = False
            print(f"{' and '.join(missing)} not installed: the PyTorch side is skipped")
    whats += [s for s in stacks if s.startswith("torch") and torch_ok]
    n, seq = non_embedding_params(config), args.case_list[0][1]
    per_token = train_flops(config, 1, seq)["total"] / seq
    print(f"{args.preset}: {config.num_layers} layers, {n / 1e6:.1f} M non-embedding parameters; "
          f"{per_token / 1e9:.2f} GFLOP per token at T={seq}", flush=True)  # fmt: skip
    res: dict = {}
    notes = set()
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "hf_config"
        hf_dir.mkdir()
        (hf_dir / "config.json").write_text(json.dumps(config.to_hf()))
        for batch, seq in args.case_list:
            case = f"{batch}x{seq}"
            for what in whats:
                left = args.budget_s - (time.perf_counter() - start)
                if left < 15:
                    print(f"  {what} {case}: skipped (--budget-s)", flush=True)
                    continue
                t0 = time.perf_counter()
                r = run_child(argv, what, case, hf_dir, min(args.child_timeout_s, left - 5))
                res[(case, what)] = r
                if r is not None:
                    print(f"  {what} {case}: {r['step_ms']:.1f} ms, peak "
                          f"{r['peak_gib'] or 0:.1f} GiB, {time.perf_counter() - t0:.0f} s in "
                          "all", flush=True)  # fmt: skip
                    print(f"      each step synced: {r['step_synced_ms']:.1f} ms", flush=True)
                    if r.get("dynamo"):
                        print(f"      torch.compile: {r['dynamo']}", flush=True)
                    for name, ms, calls in r.get("top_kernels") or ():
                        print(f"      {ms:9.2f} ms {calls:6d}x  {name}", flush=True)
                    if "fla" in r:
                        notes.add(f"torch side: {r['fla']}, {r['versions']}, "
                                  f"attention {r['attn_implementation']}, "
                                  f"{r['params'] / 1e6:.1f} M parameters")  # fmt: skip
    for note in sorted(notes):
        print(note)
    rows = make_rows(args, config, res)
    note = "dry run (smoke)" if args.smoke else None
    path = results_lib.output_path(args.json, "model")
    results_lib.write(path, "model", rows, date=date, note=note)
    print(f"\n{args.preset}, MFU at {PEAK_FLOPS / 1e12:.0f} TFLOP/s (train_flops):")
    print(table(args, config, res))
    return rows


if __name__ == "__main__":
    main()
