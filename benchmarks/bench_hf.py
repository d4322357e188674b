"""A Qwen3.5 HF checkpoint end to end: load, prefill and decode, gdn_jax vs transformers + FLA.

One run, one random ``qwen3_5_0_8b``-shaped bf16 checkpoint on disk (written by
``gdn_jax.convert.save_hf_model``, ``Qwen3_5ForCausalLM`` layout), both stacks on it:

- ``load_s``: ``gdn_jax.convert.load_hf_model`` to bf16 parameters on the device (blocked until
  ready); beside it ``safetensors_read_s``, the raw read of every tensor with ``safe_open``
  (numpy) -- the floor of any loader. Torch: ``from_pretrained(dtype=bfloat16)`` + ``.cuda()``.
- ``prefill_tok_s`` at B1 T8192: the prompt through the model with a fresh cache, logits of the
  last position only (ours: ``HybridLM.extend(..., last_only=True)``; torch:
  ``model(ids, use_cache=True, logits_to_keep=1)``), median of ``--iters``.
- ``decode_tok_s`` at B1 and B64: generation after a 128-token prompt, greedy, no eos:
  ``B * (N2 - N1) / (t(N2) - t(N1))`` with ``N1 = --decode-short``, ``N2 = --decode-long`` new
  tokens, so prefill and fixed costs cancel (ours: ``gdn_jax.models.generate``; torch:
  ``model.generate(min_new_tokens = max_new_tokens = N)``), each timed after a warm-up run.

The torch side runs in its own process (same checkpoint, same prompts) so the two never share
device memory; it uses flash-linear-attention's kernels when ``fla`` imports (transformers picks
them up). Rows ``{what, batch, seq, ours, torch, ratio}`` (docs/design.md) go to ``--json``
(``benchmarks/results/hf_<device>.json`` on a GPU; see ``benchmarks/results.py``) and a
markdown table is printed.

    # H200, from the checkout (FLA wheel, no dependency resolution):
    python3 -m pip install -q --no-index --no-deps --target /tmp/site \
        .whl/fla_core-0.6.0-py3-none-any.whl
    PYTHONPATH=.:/tmp/site python3 benchmarks/bench_hf.py
    python benchmarks/bench_hf.py --dry-run      # CPU smoke: tiny model, short shapes, no torch
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import results  # noqa: E402

PROMPT_LEN = 128


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--checkpoint", default=None, help="reuse this HF directory (else: random)")
    p.add_argument("--prefill-seq", type=int, default=8192)
    p.add_argument("--decode-batches", default="1,64")
    p.add_argument("--decode-short", type=int, default=32)
    p.add_argument("--decode-long", type=int, default=160)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument(
        "--json",
        default="auto",
        help="results file: auto (benchmarks/results on a GPU), PATH, none",
    )
    p.add_argument("--no-torch", action="store_true", help="skip the transformers side")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny model and shapes on any backend (CPU smoke); torch only if it imports",
    )
    p.add_argument("--torch-child", default=None, help=argparse.SUPPRESS)  # internal
    return p.parse_args(argv)


def _dry(args) -> None:
    args.prefill_seq, args.decode_batches = 64, "1,4"
    args.decode_short, args.decode_long, args.iters = 2, 6, 2


def _timed(fn, iters: int) -> float:
    """Median wall seconds of ``fn()`` (which must block until its work is done)."""
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _prompts(vocab: int, batch: int, length: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (batch, length)).astype(np.int32)


# ---------------------------------------------------------------------------------------------
# gdn_jax
# ---------------------------------------------------------------------------------------------


def write_checkpoint(path: Path, dry: bool) -> Path:
    """A random bf16 checkpoint of the qwen3_5_0_8b preset (tiny when ``dry``)."""
    import jax.numpy as jnp
    from flax import nnx

    from gdn_jax.convert import save_hf_model
    from gdn_jax.models import HybridLM, get_config

    config = (
        get_config("tiny", zero_centered_norm=True, eos_token_id=None)
        if dry
        else get_config("qwen3_5_0_8b", eos_token_id=None)
    )
    model = HybridLM(config, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    save_hf_model(model, path, dtype=jnp.bfloat16)
    return path


def raw_read_s(path: Path) -> float:
    from safetensors import safe_open

    t0 = time.perf_counter()
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="np") as h:
            for k in h.keys():
                h.get_tensor(k)
    return time.perf_counter() - t0


def bench_ours(path: Path, args) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from gdn_jax.convert import load_hf_model
    from gdn_jax.models import generate

    out: dict = {"safetensors_read_s": raw_read_s(path)}
    impl = ("pallas", "xla") if jax.default_backend() == "gpu" else "xla"
    t0 = time.perf_counter()
    model = load_hf_model(path, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, implementation=impl)
    jax.block_until_ready(nnx.state(model))
    out["load_s"] = time.perf_counter() - t0
    vocab = model.config.vocab_size

    graphdef, state = nnx.split(model)
    T = args.prefill_seq

    @jax.jit
    def prefill(state, tokens):
        m = nnx.merge(graphdef, state)
        logits, cache = m.extend(tokens, m.init_cache(1, T), last_only=True)
        return logits, cache

    tokens = jnp.asarray(_prompts(vocab, 1, T))
    jax.block_until_ready(prefill(state, tokens))  # compile + warm-up
    out["prefill_s"] = _timed(lambda: jax.block_until_ready(prefill(state, tokens)), args.iters)

    for b in [int(x) for x in args.decode_batches.split(",")]:
        prompts = _prompts(vocab, b, PROMPT_LEN, seed=b)
        times = {}
        for n in (args.decode_short, args.decode_long):
            run = lambda n=n, p=prompts: np.asarray(generate(model, p, max_new_tokens=n))
            run()  # compile + warm-up
            times[n] = _timed(run, max(1, args.iters // 2))
        out[f"decode_B{b}"] = times
    return out


# ---------------------------------------------------------------------------------------------
# transformers + flash-linear-attention (its own process)
# ---------------------------------------------------------------------------------------------


def bench_torch(path: Path, args) -> dict:  # pragma: no cover - needs torch and a GPU
    """The transformers side. Written from transformers 5.17's API; runs where torch does."""
    import torch
    import transformers

    try:
        import fla  # noqa: F401  (transformers uses its kernels when it imports)

        fla_version = getattr(fla, "__version__", "?")
    except Exception as e:  # noqa: BLE001
        fla_version = f"unavailable ({type(e).__name__})"
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    out: dict = {"versions": dict(torch=torch.__version__, transformers=transformers.__version__,
                                  fla=fla_version)}  # fmt: skip
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)
    model = model.to(device).eval()
    sync()
    out["load_s"] = time.perf_counter() - t0
    vocab = model.config.vocab_size
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0

    T = args.prefill_seq
    ids = torch.as_tensor(_prompts(vocab, 1, T), device=device, dtype=torch.long)

    @torch.inference_mode()
    def prefill():
        model(input_ids=ids, use_cache=True, logits_to_keep=1)
        sync()

    prefill()  # warm-up (Triton autotuning)
    out["prefill_s"] = _timed(prefill, args.iters)

    for b in [int(x) for x in args.decode_batches.split(",")]:
        prompts = torch.as_tensor(_prompts(vocab, b, PROMPT_LEN, seed=b), device=device)
        prompts = prompts.long()
        mask = torch.ones_like(prompts)
        times = {}
        for n in (args.decode_short, args.decode_long):

            @torch.inference_mode()
            def run(n=n, prompts=prompts, mask=mask):
                model.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=n,
                               min_new_tokens=n, do_sample=False)  # fmt: skip
                sync()

            run()
            times[n] = _timed(run, max(1, args.iters // 2))
        out[f"decode_B{b}"] = times
    return out


def _run_torch_child(path: Path, argv: list[str]) -> dict | None:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "torch.json"
        cmd = [sys.executable, __file__, *argv, "--checkpoint", str(path),
               "--torch-child", str(result)]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not result.exists():
            print(f"torch side failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
            return None
        return json.loads(result.read_text())


# ---------------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------------


def rows_from(ours: dict, torch: dict | None, args) -> list[dict]:
    def decode_rate(r, b):
        t = r[f"decode_B{b}"]
        t = {int(k): v for k, v in t.items()}
        n1, n2 = args.decode_short, args.decode_long
        return b * (n2 - n1) / (t[n2] - t[n1])

    def row(what, batch, seq, a, t):
        ratio = None
        if a is not None and t is not None:
            ratio = (a / t) if what.endswith("tok_s") else (t / a)  # > 1: ours is better
        return dict(what=what, batch=batch, seq=seq, ours=a, torch=t, ratio=ratio)

    T = args.prefill_seq
    rows = [
        row("load_s", None, None, ours["load_s"], torch and torch["load_s"]),
        row("safetensors_read_s", None, None, ours["safetensors_read_s"], None),
        row("prefill_tok_s", 1, T, T / ours["prefill_s"], torch and T / torch["prefill_s"]),
    ]
    for b in [int(x) for x in args.decode_batches.split(",")]:
        rows.append(row("decode_tok_s", b, PROMPT_LEN, decode_rate(ours, b),
                        torch and decode_rate(torch, b)))  # fmt: skip
    return rows


def run_note(dry_run: bool, torch: dict | None) -> str | None:
    """The run's note: a dry run says so; the transformers side's versions (FLA's among them, or
    why it did not import) are recorded, since its kernels depend on them."""
    parts = ["dry run (CPU smoke)"] if dry_run else []
    if torch is not None and "versions" in torch:
        parts.append("torch side: " + ", ".join(f"{k} {v}" for k, v in torch["versions"].items()))
    return "; ".join(parts) or None


def table(rows: list[dict]) -> str:
    fmt = lambda x: "-" if x is None else (f"{x:.3g}" if abs(x) < 100 else f"{x:,.0f}")
    lines = ["| what | batch | seq | gdn_jax | transformers+FLA | ours / torch (>1 better) |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['what']} | {r['batch'] or '-'} | {r['seq'] or '-'} | {fmt(r['ours'])} | "
            f"{fmt(r['torch'])} | {fmt(r['ratio'])} |"
        )
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.dry_run:
        _dry(args)
    if args.torch_child:
        result = bench_torch(Path(args.checkpoint), args)
        Path(args.torch_child).write_text(json.dumps(result))
        return []

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.checkpoint) if args.checkpoint else Path(tmp) / "qwen3_5_random"
        if not args.checkpoint:
            t0 = time.perf_counter()
            write_checkpoint(path, args.dry_run)
            print(f"wrote a random checkpoint to {path} in {time.perf_counter() - t0:.1f} s")
        torch = None
        if not args.no_torch:
            try:
                import torch as _  # noqa: F401

                has_torch = True
            except ImportError:
                has_torch = False
                print("torch does not import: the transformers side is skipped")
            if has_torch:
                child = [a for a in argv if a not in ("--dry-run",)]
                if args.dry_run:
                    child.append("--dry-run")
                torch = _run_torch_child(path, child)
        ours = bench_ours(path, args)
    rows = rows_from(ours, torch, args)
    print(table(rows))
    if torch is None:
        print("(no transformers numbers)")
    elif "versions" in torch:
        print(f"torch side: {torch['versions']}")
    note = run_note(args.dry_run, torch)
    results.write(results.output_path(args.json, "hf"), "hf", rows, date=results.now(), note=note)
    return rows


if __name__ == "__main__":
    main()
