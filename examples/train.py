"""Train the hybrid Gated DeltaNet LM on multi-query associative recall (default) or a text file.

    python examples/train.py                       # MQAR, 2 GDN layers, ~2 minutes on a 2-core CPU
    python examples/train.py --text corpus.txt     # next-byte LM on a text file
    python examples/train.py --resume              # continue from the latest checkpoint in --out
    python examples/train.py --cpu-devices 8 --mesh data=2,fsdp=2,tensor=2   # DP x FSDP x TP
    python examples/train.py --fp8 native --remat save --offload core   # FP8 projections; the
                                                   # GDN core's residuals in pinned host memory

Multi-process (one process per host, or several on one host), JAX's multi-controller runtime:

    python examples/train.py --coordinator HOST:PORT --num-processes N --process-id I --mesh ...
    JAX_COORDINATOR_ADDRESS=HOST:PORT JAX_NUM_PROCESSES=N JAX_PROCESS_ID=I python examples/train.py
    srun python examples/train.py --distributed --mesh ...   # SLURM / Open MPI: detected by JAX

Every process runs the same program on the global mesh; each feeds its own rows of the global
batch (``jax.make_array_from_process_local_data``); checkpoints are written and restored by all
processes together (Orbax); the progress bar, the log lines, the metrics file and the plot come
from process 0.

Shows a progress bar (loss, accuracy, tokens/s), writes ``<out>/train.png`` (loss and accuracy
curves), ``<out>/metrics.jsonl`` and orbax checkpoints under ``<out>/checkpoints``. The GDN core
runs the Pallas kernels on a GPU (falling back to XLA if they cannot serve) and XLA on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_tasks as tasks  # noqa: E402  (examples/ is a folder of scripts, not a package)

from gdn_jax import fp8 as fp8_lib  # noqa: E402
from gdn_jax import remat, sharding  # noqa: E402
from gdn_jax.models import HybridLM, get_config  # noqa: E402

# The demo model: the tiny preset with two GDN layers and no attention layer; 16-token chunks
# are the cheapest on a CPU for its 32-token sequences.
DEMO = dict(num_layers=2, full_attention_interval=0, chunk_size=16)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--text", type=str, default=None, help="train on this text file (bytes)")
    p.add_argument("--out", type=str, default="runs/train", help="output folder")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--preset",
        type=str,
        default="demo",
        help="model: demo (the tiny preset cut to 2 GDN layers, no attention, so the recall\n"
        "is Gated DeltaNet's own), tiny (4-layer hybrid), qwen3_5_0_8b",
    )
    p.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    p.add_argument("--hidden", type=int, default=None, help="override the preset's model width")
    p.add_argument(
        "--attention-interval",
        type=int,
        default=None,
        help="every n-th layer is softmax attention (0: GDN only); default from the preset",
    )
    p.add_argument("--variant", choices=["gdn", "kda", "gdn2"], default=None)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument(
        "--implementation",
        choices=["pallas", "xla"],
        default=None,
        help="GDN core; default: pallas (then xla) on GPU, xla on CPU",
    )
    p.add_argument("--num-pairs", type=int, default=8, help="MQAR key-value pairs per sequence")
    p.add_argument("--num-keys", type=int, default=32, help="MQAR key vocabulary")
    p.add_argument("--num-values", type=int, default=32, help="MQAR value vocabulary")
    p.add_argument("--seq-len", type=int, default=128, help="text: window length")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument(
        "--eval-batches", type=int, default=32, help="held-out batches for the eval (0: none)"
    )
    p.add_argument("--save-every", type=int, default=0, help="checkpoint period (0: at the end)")
    p.add_argument("--resume", action="store_true", help="restore the latest checkpoint in --out")
    p.add_argument(
        "--stop-at", type=int, default=None, help="stop (and checkpoint) early, as if interrupted"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_runtime_args(p)
    p.add_argument("--fp8", choices=["te", "native"], default=None, help="FP8 projections")
    p.add_argument("--fp8-recipe", choices=["current", "delayed"], default="current", help="te")
    p.add_argument(
        "--remat",
        choices=["none", "save", "remat"],
        default="none",
        help="checkpoint every layer: save the named tensors, or recompute them too",
    )
    p.add_argument(
        "--offload",
        default=None,
        help="comma list of checkpoint names or groups (core, layer, all) to move to host memory",
    )
    p.add_argument("--offload-threshold", type=int, default=0, help="only tensors >= N elements")
    p.add_argument("--offload-fraction", type=float, default=1.0, help="share of layers (0-1)")
    p.add_argument(
        "--offload-overlap",
        action="store_true",
        help="keep XLA's GPU latency-hiding scheduler with --offload (faster; device memory may "
        "rise: gdn_jax.remat.compiler_options)",
    )
    return p.parse_args(argv)


def add_runtime_args(p: argparse.ArgumentParser) -> None:
    """The device flags shared by the training examples: the mesh, CPU devices, and the
    multi-process settings (flags, or JAX's environment variables)."""
    p.add_argument(
        "--mesh",
        default=None,
        help='shard over a device mesh, e.g. "data=2,fsdp=2,tensor=2" (DP, FSDP, TP over heads; '
        '"context=2": the sequence, CP); multi-process default: "data=-1"',
    )
    p.add_argument(
        "--cpu-devices",
        type=int,
        default=None,
        help="split the CPU into N devices (for --mesh; per process when multi-process)",
    )
    p.add_argument(
        "--coordinator",
        default=os.environ.get("JAX_COORDINATOR_ADDRESS"),
        help="multi-process: HOST:PORT of process 0 (default $JAX_COORDINATOR_ADDRESS)",
    )
    p.add_argument(
        "--num-processes",
        type=int,
        default=_env_int("JAX_NUM_PROCESSES"),
        help="multi-process: number of processes (default $JAX_NUM_PROCESSES)",
    )
    p.add_argument(
        "--process-id",
        type=int,
        default=_env_int("JAX_PROCESS_ID"),
        help="multi-process: this process's index (default $JAX_PROCESS_ID)",
    )
    p.add_argument(
        "--distributed",
        action="store_true",
        help="multi-process with the settings JAX detects (SLURM, Open MPI, Kubernetes)",
    )


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return None if value in (None, "") else int(value)


def init_distributed(args: argparse.Namespace) -> bool:
    """``jax.distributed.initialize`` when the command line or the environment asks for several
    processes; must run before JAX touches a device. Returns whether it did."""
    asked = args.distributed or args.coordinator is not None or (args.num_processes or 1) > 1
    if not asked:
        return False
    # CPU processes exchange collectives through gloo (GPUs use NCCL on their own).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
    )
    return True


def start_runtime(args: argparse.Namespace) -> bool:
    """Set up the devices from :func:`add_runtime_args`' flags before JAX uses one: split the
    CPU, join the other processes, and with several processes and no ``--mesh`` take
    ``data=-1`` (the global batch over every process's devices). Returns whether it runs
    multi-process."""
    if args.cpu_devices:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    multi = init_distributed(args)
    if multi and not args.mesh:
        args.mesh = "data=-1"
    return multi


def is_lead() -> bool:
    """Whether this process writes the logs, progress bar, metrics file and plot (process 0)."""
    return jax.process_index() == 0


def lead_print(*args, **kwargs) -> None:
    """``print`` on process 0 only."""
    if is_lead():
        print(*args, **kwargs)


def _local_rows(sharding, shape) -> slice:
    """The rows of a [B, ...] global array that this process's devices hold (one block)."""
    spans = sorted(
        {
            idx[0].indices(shape[0])[:2]
            for idx in sharding.addressable_devices_indices_map(shape).values()
        }
    )
    end = spans[0][0]
    for a, b in spans:
        if a > end:
            raise ValueError(f"this process's batch rows {spans} are not one block of rows")
        end = max(end, b)
    return slice(spans[0][0], end)


def place_batch(batch: dict, mesh, rules) -> dict:
    """A batch of ``[B, T]`` arrays (the same global batch on every process) laid out on the
    mesh by the rules (B over the batch axes, T over ``context``): each process hands over the
    rows its devices hold and ``jax.make_array_from_process_local_data`` assembles the global
    arrays. Without a mesh the batch is returned as it is."""
    if mesh is None:
        return batch

    def place(x):
        sh = sharding.batch_sharding(mesh, rules, x.ndim)
        rows = _local_rows(sh, x.shape)
        return jax.make_array_from_process_local_data(sh, np.asarray(x[rows]), x.shape)

    return jax.tree.map(place, batch)


def init_state(tx, params, meta, mesh):
    """(params, meta, a fresh optimizer state) laid out as a train step returns them: committed
    to the first local device without a mesh; on a mesh the optimizer's moments like their
    parameters and its counters replicated (:func:`gdn_jax.sharding.init_optimizer_state`). The
    step then compiles once, not again for the second step's inputs."""
    if mesh is None:
        params, meta = jax.device_put((params, meta), jax.local_devices()[0])
    return params, meta, sharding.init_optimizer_state(tx, params, mesh)


def open_checkpoints(out: Path, *, resume: bool) -> ocp.CheckpointManager:
    """The Orbax manager of ``<out>/checkpoints`` (written by all processes together); a run
    that does not resume drops the old run's checkpoints."""
    manager = ocp.CheckpointManager(out / "checkpoints", options=ocp.CheckpointManagerOptions())
    if not resume:
        for old in manager.all_steps():
            manager.delete(old)
    return manager


def save_checkpoint(manager: ocp.CheckpointManager, step: int, state) -> None:
    """Save a pytree of (global) arrays as checkpoint ``step``."""
    manager.save(step, args=ocp.args.StandardSave(state))


def restore_checkpoint(manager: ocp.CheckpointManager, step: int, like):
    """Checkpoint ``step`` restored into the layout of ``like`` (:func:`init_state`'s; whatever
    mesh and process count wrote it)."""

    def layout(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)

    return manager.restore(step, args=ocp.args.StandardRestore(jax.tree.map(layout, like)))


def _implementation(choice: str | None):
    if choice is not None:
        return choice
    # A sequence is tried in order: Pallas where it can serve (Hopper), else XLA.
    return ("pallas", "xla") if jax.default_backend() == "gpu" else "xla"


def _plot(history: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.plot(steps, [h["loss"] for h in history])
    a.set(xlabel="step", ylabel="loss", yscale="log", title="training loss")
    b.plot(steps, [h["accuracy"] for h in history], label="train")
    evals = [h for h in history if "eval_accuracy" in h]
    if evals:
        b.plot([h["step"] for h in evals], [h["eval_accuracy"] for h in evals], "o-", label="eval")
    b.set(xlabel="step", ylabel="accuracy", ylim=(0, 1.02), title="accuracy")
    b.legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def make_task(args: argparse.Namespace):
    """Train and held-out batch functions, the task's vocabulary, its name, tokens per batch."""
    if args.text is None:
        make = lambda seed, bs: tasks.mqar(
            seed=seed,
            batch_size=bs,
            num_pairs=args.num_pairs,
            num_keys=args.num_keys,
            num_values=args.num_values,
        )
        vocab = args.num_keys + args.num_values
        task_name = f"MQAR ({args.num_pairs} pairs, {args.num_keys} keys, {args.num_values} values)"
    else:
        make = lambda seed, bs: tasks.text(
            args.text, seed=seed, batch_size=bs, seq_len=args.seq_len
        )
        vocab = 256
        task_name = f"bytes of {args.text}"
    seq_len = 4 * args.num_pairs if args.text is None else args.seq_len
    # A different seed stream for the held-out evaluation.
    held_out = make(args.seed + 10_000, args.batch_size)
    return make(args.seed, args.batch_size), held_out, vocab, task_name, args.batch_size * seq_len


def make_config(args: argparse.Namespace, vocab: int):
    """The model shape: a preset with the command line's overrides."""
    overrides = {}
    if args.layers is not None:
        overrides["num_layers"] = args.layers
    if args.hidden is not None:
        overrides["hidden_size"] = args.hidden
    if args.attention_interval is not None:
        overrides["full_attention_interval"] = args.attention_interval
    if args.variant is not None:
        overrides["variant"] = args.variant
    if args.preset == "demo":
        config = get_config("tiny", **{**DEMO, **overrides})
    else:
        config = get_config(args.preset, **overrides)
    if config.vocab_size < vocab:
        raise ValueError(f"preset vocab {config.vocab_size} < task vocab {vocab}")
    return config


def make_optimizer(args: argparse.Namespace) -> optax.GradientTransformation:
    """AdamW with linear warmup, cosine decay to 5 % and global-norm clipping."""
    warmup = max(1, min(args.warmup, args.steps // 4))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, warmup, max(args.steps, warmup + 1), args.lr * 0.05
    )
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.98, weight_decay=args.weight_decay),
    )


def main(argv: list[str] | None = None) -> dict:
    """Run the training; returns the final metrics and the trained parameters (for tests)."""
    args = parse_args(argv)
    if args.fp8 == "te":
        fp8_lib.import_te()  # before JAX initialises the GPU (see gdn_jax.fp8.import_te)
    multi = start_runtime(args)  # before any device is used
    lead = is_lead()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    implementation = _implementation(args.implementation)
    train_batch, eval_batch, vocab, task_name, tokens_per_step = make_task(args)
    config = make_config(args, vocab)
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else None
    policies = spec = None
    if args.remat != "none" or args.offload:
        spec = remat.spec_from_flags("save" if args.remat == "none" else args.remat, args.offload)
        policies = remat.layer_policies(
            spec,
            config.num_layers,
            offload_fraction=args.offload_fraction,
            offload_threshold=args.offload_threshold,
        )
    mesh = rules = None
    if args.mesh:
        mesh = sharding.make_mesh(args.mesh)
        sharding.check_model_divisibility(config, mesh)
        rules = sharding.logical_axis_rules(mesh)
    model = HybridLM(
        config,
        implementation=implementation,
        dtype=dtype,
        fp8=args.fp8,
        fp8_recipe=args.fp8_recipe,
        remat_policies=policies,
        sharding=None if mesh is None else sharding.model_core_sharding(mesh),
        rngs=nnx.Rngs(args.seed),
    )
    if mesh is not None:
        sharding.shard_model(model, mesh, rules)  # parameters laid out by the logical-axis rules
    # meta: TE DelayedScaling's amax histories and scales (empty otherwise); the step replaces
    # them with their "gradient", which is where TE returns their updated values.
    graphdef, params, meta = nnx.split(model, nnx.Param, fp8_lib.FP8Meta)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    tx = make_optimizer(args)
    params, meta, opt_state = init_state(tx, params, meta, mesh)

    # Batches are pure functions of the step (examples/train_tasks.py). Each process computes
    # the step's batch on one of its own devices and hands over the rows its devices hold;
    # make_array_from_process_local_data assembles the global array (with one process: the
    # whole batch, laid out by the rules).
    local_device = jax.local_devices()[0]
    make_train, make_eval = (
        jax.jit(fn, out_shardings=jax.sharding.SingleDeviceSharding(local_device))
        for fn in (train_batch, eval_batch)
    )

    def feed(make, step):
        return place_batch(make(jnp.int32(step)), mesh, rules)

    def forward(params, batch, meta):  # (loss, accuracy); the head never holds all logits
        model = nnx.merge(graphdef, params, meta)
        x = model.hidden(batch["inputs"])
        return model.loss(x, batch["targets"], mask=batch["mask"])

    options = remat.compiler_options(spec, overlap_copies=args.offload_overlap)

    @jax.jit(donate_argnums=(0, 1), compiler_options=options)
    def train_step(params, opt_state, batch, meta):
        grad_fn = jax.value_and_grad(forward, argnums=(0, 2), has_aux=True)
        (loss, acc), (grads, meta) = grad_fn(params, batch, meta)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, dict(loss=loss, accuracy=acc), meta

    @jax.jit
    def eval_step(params, batch, meta):
        loss, acc = forward(params, batch, meta)
        return dict(loss=loss, accuracy=acc)

    def evaluate(params):
        ms = [eval_step(params, feed(make_eval, i), meta) for i in range(args.eval_batches)]
        return {k: float(jnp.mean(jnp.stack([m[k] for m in ms]))) for k in ms[0]}

    manager = open_checkpoints(out, resume=args.resume)
    start = 0
    if args.resume and manager.latest_step() is not None:
        start = manager.latest_step()
        restored = restore_checkpoint(manager, start, dict(params=params, opt=opt_state))
        params, opt_state = restored["params"], restored["opt"]

    def save(step):
        save_checkpoint(manager, step, dict(params=params, opt=opt_state))

    lead_print(
        f"task: {task_name} | model: {args.preset} {config.num_layers} layers "
        f"{config.layer_types.count('attention')} attention, {n_params / 1e6:.2f}M params | "
        f"backend: {jax.default_backend()}, GDN implementation: {implementation}"
        + (f" | resumed at step {start}" if start else "")
        + (f" | process {jax.process_index()} of {jax.process_count()}" if multi else "")
    )

    metrics_file = out / "metrics.jsonl"
    if lead and not args.resume and metrics_file.exists():
        metrics_file.unlink()
    stop = args.steps if args.stop_at is None else min(args.stop_at, args.steps)
    bar = tqdm(
        range(start, stop), initial=start, total=args.steps, disable=args.no_progress or not lead
    )
    t0, last = time.perf_counter(), start
    metrics = None
    begin = time.perf_counter()
    for step in bar:
        batch = feed(make_train, step)
        params, opt_state, metrics, meta = train_step(params, opt_state, batch, meta)
        done = step + 1
        if done % args.log_every == 0 or done == stop:
            m = {k: float(v) for k, v in metrics.items()}  # waits for the step
            now = time.perf_counter()
            m.update(step=done, tokens_per_s=tokens_per_step * (done - last) / (now - t0))
            t0, last = now, done
            if done == args.steps or done % (args.log_every * 8) == 0:
                if args.eval_batches:
                    m["eval_accuracy"] = evaluate(params)["accuracy"]
            bar.set_postfix(
                loss=f"{m['loss']:.3f}",
                acc=f"{m['accuracy']:.3f}",
                tok_s=f"{m['tokens_per_s']:.0f}",
            )
            if lead:
                with metrics_file.open("a") as f:
                    f.write(json.dumps(m) + "\n")
        if args.save_every and done % args.save_every == 0 and done != stop:
            save(done)
    bar.close()
    wall = time.perf_counter() - begin
    if stop > start:
        save(stop)
    manager.wait_until_finished()

    final = (
        evaluate(params) if args.eval_batches else dict(loss=float("nan"), accuracy=float("nan"))
    )
    history = []
    if lead and metrics_file.exists():
        history = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    if history:
        n_attn = config.layer_types.count("attention")
        model_name = f"{config.num_layers - n_attn} GDN + {n_attn} attention layers"
        _plot(history, out / "train.png", f"{task_name}, {model_name}")
    lead_print(
        f"done: {stop} steps ({stop - start} in this run) in {wall:.1f} s | "
        f"eval loss {final['loss']:.4f}, eval accuracy {final['accuracy']:.4f} | "
        f"plot: {out / 'train.png'}"
    )
    return dict(
        eval=final,
        last=None if metrics is None else {k: float(v) for k, v in metrics.items()},
        params=params,
        history=history,
        wall_s=wall,
    )


if __name__ == "__main__":
    main()
