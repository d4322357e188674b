"""Fine-tune a Hugging Face Qwen3.5 checkpoint on a text file and save it back in HF format.

    python examples/finetune_hf.py                                  # small random checkpoint
    python examples/finetune_hf.py --model Qwen3.5-0.8B --text corpus.txt --steps 200
    python examples/finetune_hf.py --model PATH --text FILE --fp8 native --qat --offload

Loads ``--model`` (``config.json`` + safetensors; without it a small random checkpoint is written
first), tokenizes ``--text`` with the checkpoint's ``tokenizer.json`` (UTF-8 bytes without one;
default text: this script), trains next-token prediction on random windows with AdamW (progress
bar), and writes ``<out>/finetune.png`` (loss curve), ``<out>/metrics.jsonl``, orbax checkpoints
under ``<out>/checkpoints`` and the fine-tuned model in HF format under ``<out>/hf`` (with the
tokenizer files). ``--fp8`` runs the projections in FP8 (gdn_jax.fp8), ``--qat`` adds FP8 fake
quantisation to every GDN core (gdn_jax.qat), ``--offload`` moves the GDN cores' residuals to
host memory (gdn_jax.remat). ``--mesh data=2,tensor=2`` shards the run (DP, FSDP, TP, as in
examples/train.py).

Multi-process (JAX's multi-controller runtime), with the flags and environment variables of
examples/train.py; ``--out`` must be on a filesystem all processes share:

    python examples/finetune_hf.py --coordinator HOST:PORT --num-processes N --process-id I
    JAX_COORDINATOR_ADDRESS=HOST:PORT JAX_NUM_PROCESSES=N JAX_PROCESS_ID=I python \
        examples/finetune_hf.py
    srun python examples/finetune_hf.py --distributed --mesh ...

Every process feeds its own rows of each batch, the Orbax checkpoint is written by all of them,
and process 0 alone writes the random checkpoint, the logs, metrics, plot and HF output.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_common  # noqa: E402  (examples/ is a folder of scripts, not a package)
import train as train_example  # noqa: E402

from gdn_jax import fp8 as fp8_lib  # noqa: E402
from gdn_jax import qat, remat, sharding  # noqa: E402
from gdn_jax.convert import load_hf_model, save_hf_model  # noqa: E402
from gdn_jax.models import HybridLM  # noqa: E402
from gdn_jax.nn import apply_qat_policy  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="HF model directory (default: random)")
    p.add_argument("--random-layers", type=int, default=4, help="layers of the random model")
    p.add_argument("--text", default=None, help="training text file (default: this script)")
    p.add_argument("--out", default="runs/finetune_hf", help="output folder")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="compute dtype (default: bfloat16 on a GPU, float32 elsewhere)",
    )
    p.add_argument("--fp8", choices=["native", "te"], default=None, help="FP8 projections")
    p.add_argument("--fp8-recipe", choices=["current", "delayed"], default="current", help="te")
    p.add_argument("--qat", action="store_true", help="FP8 fake quantisation in the GDN cores")
    p.add_argument("--offload", action="store_true", help="GDN core residuals to host memory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    train_example.add_runtime_args(p)
    return p.parse_args(argv)


def _windows(ids: np.ndarray, seed: int, batch_size: int, seq_len: int) -> dict:
    """``batch_size`` random windows of ``seq_len + 1`` tokens: inputs and next-token targets."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(ids) - seq_len - 1, batch_size)
    w = np.stack([ids[s : s + seq_len + 1] for s in starts])
    return dict(inputs=w[:, :-1], targets=w[:, 1:])


def _plain_paths(state: nnx.State) -> dict:
    # TransformerEngine projections keep their kernel one level down (TEDense.inner.kernel).
    return {tuple(p for p in path if p != "inner"): v for path, v in nnx.to_flat_state(state)}


def main(argv: list[str] | None = None) -> dict:
    """Run the fine-tuning; returns the metrics history and the HF output folder (for tests)."""
    args = parse_args(argv)
    if args.fp8 == "te":
        fp8_lib.import_te()  # before JAX initialises the GPU (see gdn_jax.fp8.import_te)
    multi = train_example.start_runtime(args)  # before any device is used
    lead = train_example.is_lead()
    log = train_example.lead_print
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(args.model) if args.model else None
    if model_dir is None:
        model_dir = out / "random-checkpoint"
        if lead:
            hf_common.random_checkpoint(model_dir, seed=args.seed, num_layers=args.random_layers)
            log(f"no --model: wrote a random checkpoint to {model_dir}")
        if multi:
            multihost_utils.sync_global_devices("random checkpoint written")
    mesh = rules = None
    if args.mesh:
        mesh = sharding.make_mesh(args.mesh)
        rules = sharding.logical_axis_rules(mesh)
    gpu = jax.default_backend() == "gpu"
    dtype = {"float32": None, "bfloat16": jnp.bfloat16, None: jnp.bfloat16 if gpu else None}[
        args.dtype
    ]
    impl = ("pallas", "xla") if gpu else "xla"
    model = load_hf_model(model_dir, dtype=dtype, mesh=mesh, implementation=impl)
    config = model.config
    if args.fp8:
        fp8_lib.convert_projections(model, args.fp8, recipe=args.fp8_recipe)
    if args.qat:
        policy = qat.QATPolicy((qat.QATRule("layers.*.mixer", qat.QATConfig()),))
        apply_qat_policy(model, policy)
        qat.save_policy(out, policy)
    spec = None
    if args.offload:
        spec = remat.spec_from_flags("save", "core")
        model.remat_policies = tuple(remat.layer_policies(spec, config.num_layers))
    if mesh is not None:
        sharding.shard_model(model, mesh, rules)  # the FP8 / QAT variables too

    tok = hf_common.Tokenizer(model_dir, config.vocab_size)
    text_file = Path(args.text) if args.text else Path(__file__)
    ids = np.asarray(tok.encode(text_file.read_text(errors="replace")), np.int32)
    if len(ids) < args.seq_len + 2:
        raise ValueError(f"{text_file} has {len(ids)} tokens; need > --seq-len + 1")

    graphdef, params, meta = nnx.split(model, nnx.Param, fp8_lib.FP8Meta)
    tx = train_example.make_optimizer(args)
    params, meta, opt_state = train_example.init_state(tx, params, meta, mesh)

    def loss_fn(params, batch, meta):
        m = nnx.merge(graphdef, params, meta)
        return m.loss(m.hidden(batch["inputs"]), batch["targets"])

    @jax.jit(donate_argnums=(0, 1), compiler_options=remat.compiler_options(spec))
    def train_step(params, opt_state, batch, meta):
        grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 2), has_aux=True)
        (loss, acc), (grads, meta) = grad_fn(params, batch, meta)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, dict(loss=loss, accuracy=acc), meta

    n_params = sum(x.size for x in jax.tree.leaves(params))
    log(
        f"model: {model_dir} ({n_params / 1e6:.1f}M params, {config.num_layers} layers) | "
        f"tokenizer: {tok.name}, {len(ids)} tokens of {text_file.name} | fp8: {args.fp8} | "
        f"qat: {args.qat} | offload: {args.offload} | backend: {jax.default_backend()}"
        + (f" | process {jax.process_index()} of {jax.process_count()}" if multi else "")
    )
    history, metrics_file = [], out / "metrics.jsonl"
    if lead:
        metrics_file.unlink(missing_ok=True)
    tokens_per_step = args.batch_size * args.seq_len
    t0, last = time.perf_counter(), 0
    bar = tqdm(range(args.steps), disable=args.no_progress or not lead)
    for step in bar:
        batch = _windows(ids, args.seed * 1_000_003 + step, args.batch_size, args.seq_len)
        batch = train_example.place_batch(batch, mesh, rules)
        params, opt_state, metrics, meta = train_step(params, opt_state, batch, meta)
        done = step + 1
        if done % args.log_every == 0 or done == args.steps:
            m = {k: float(v) for k, v in metrics.items()}
            now = time.perf_counter()
            m.update(step=done, tokens_per_s=tokens_per_step * (done - last) / (now - t0))
            t0, last = now, done
            bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{m['tokens_per_s']:.0f}")
            history.append(m)
            if lead:
                with metrics_file.open("a") as f:
                    f.write(json.dumps(m) + "\n")
    bar.close()

    manager = train_example.open_checkpoints(out, resume=False)
    train_example.save_checkpoint(manager, args.steps, dict(params=params, opt=opt_state))
    manager.wait_until_finished()
    if multi:  # every process holds a copy of the trained values (for the HF output)
        params = multihost_utils.process_allgather(params, tiled=True)
    if not lead:
        return dict(history=history, hf_dir=out / "hf", params=params)
    train_example._plot(history, out / "finetune.png", f"fine-tuning {model_dir.name}")

    # Back to HF format: the trained values in a plain (non-FP8) model of the same config.
    plain = nnx.eval_shape(lambda: HybridLM(config, rngs=nnx.Rngs(0)))
    gdef, slots = nnx.split(plain, nnx.Param)
    trained = _plain_paths(params)
    nnx.replace_by_pure_dict(slots, nnx.traversals.unflatten_mapping(
        {p: trained[p][...] for p, _ in nnx.to_flat_state(slots)}
    ))  # fmt: skip
    save_hf_model(nnx.merge(gdef, slots), out / "hf")
    hf_common.copy_tokenizer(model_dir, out / "hf")
    print(f"done: loss {history[-1]['loss']:.4f} | HF checkpoint: {out / 'hf'} | "
          f"plot: {out / 'finetune.png'}")  # fmt: skip
    return dict(history=history, hf_dir=out / "hf", params=params)


if __name__ == "__main__":
    main()
