"""Generate text with a Hugging Face Qwen3.5 checkpoint.

    python examples/generate.py                                    # a small random checkpoint
    python examples/generate.py --model Qwen3.5-0.8B --prompt "The capital of France is"
    python examples/generate.py --model PATH --prompt "Once" --temperature 0.7 --top-p 0.9

``--model`` is a local directory (``config.json`` + safetensors, e.g. a ``huggingface-cli
download``); without it a small random checkpoint is written to ``--out`` first. The prompt is
tokenized with the checkpoint's ``tokenizer.json`` (the ``tokenizers`` package) when present, as
UTF-8 bytes otherwise; ``--prompt-ids "1 2 3"`` gives raw token ids.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_common  # noqa: E402  (examples/ is a folder of scripts, not a package)

from gdn_jax.convert import load_hf_model  # noqa: E402
from gdn_jax.models import generate  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="HF model directory (default: random)")
    p.add_argument("--random-layers", type=int, default=4, help="layers of the random model")
    p.add_argument("--prompt", default="Gated DeltaNet", help="prompt text")
    p.add_argument("--prompt-ids", default=None, help="space-separated token ids instead")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="compute dtype (default: bfloat16 on a GPU, float32 elsewhere)",
    )
    p.add_argument("--out", default="runs/generate", help="where the random checkpoint goes")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Run; returns the prompt ids, the new ids and the text (for tests)."""
    args = parse_args(argv)
    model_dir = Path(args.model) if args.model else None
    if model_dir is None:
        model_dir = hf_common.random_checkpoint(
            Path(args.out) / "random-checkpoint", num_layers=args.random_layers
        )
        print(f"no --model: wrote a random checkpoint to {model_dir}")
    gpu = jax.default_backend() == "gpu"
    dtype = {"float32": None, "bfloat16": jnp.bfloat16, None: jnp.bfloat16 if gpu else None}[
        args.dtype
    ]
    t0 = time.perf_counter()
    model = load_hf_model(model_dir, dtype=dtype, param_dtype=dtype or jnp.float32,
                          implementation=("pallas", "xla") if gpu else "xla")  # fmt: skip
    print(f"loaded {model_dir} in {time.perf_counter() - t0:.1f} s")
    tok = hf_common.Tokenizer(model_dir, model.config.vocab_size)
    if args.prompt_ids:
        ids = [int(s) for s in args.prompt_ids.split()]
    else:
        ids = tok.encode(args.prompt)
    if not ids:
        raise ValueError("the prompt has no tokens")
    eos = model.config.eos_token_id
    eos = eos[0] if isinstance(eos, tuple) else eos
    t0 = time.perf_counter()
    out = generate(
        model,
        np.asarray([ids], np.int32),
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        eos_token_id=eos,
        rng=jax.random.key(args.seed) if args.temperature > 0 else None,
    )
    new = np.asarray(out[0]).tolist()
    wall = time.perf_counter() - t0
    if eos is not None and eos in new:
        new = new[: new.index(eos) + 1]
    text = tok.decode(new)
    print(f"tokenizer: {tok.name}\nprompt ids: {ids}\nnew ids: {new}")
    print(f"--- {args.prompt if not args.prompt_ids else ''}{text}")
    print(f"{len(new)} tokens in {wall:.2f} s (including compilation)")
    return dict(prompt_ids=ids, new_ids=new, text=text)


if __name__ == "__main__":
    main()
