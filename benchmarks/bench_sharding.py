"""Sharded training of the hybrid LM: each parallelism mode vs the one-device run.

For every mode (``dp``: batch over ``data``; ``fsdp``: batch and weights over ``fsdp``; ``tp``:
heads over ``tensor``; ``cp``: the sequence over ``context``, GDN states passed between shards)
on ``--devices`` devices, one AdamW train step (forward, backward, update) of the chosen preset is

- checked: the losses of ``--train-steps`` successive updates and every gradient of the first
  against the same steps on one device (relative RMS over all gradient leaves); in a 16-bit
  ``--dtype`` the gradients are also compared with the f32 maths (the xla core in f32 on one
  device), which the sharded run must match within 2x of the one-device run's own distance
  (``matches_one_device``; a failing mode fails the run), and
- timed: median of ``--iters`` steps after a warm-up, for the mode and for the one-device step
  of the same global batch, giving tokens/s per device and the scaling efficiency
  ``t_1 / (n · t_n)`` (1.0 = perfect: n devices run the same step n times faster).

DP and FSDP scale the global batch with the devices (``--batch`` per device: weak scaling); TP and
CP split one ``--batch`` (strong scaling). The one-device step of the same global batch must fit
on one device.

``--axis-type`` sets the mesh axes' type: ``auto`` (default; XLA's partitioner propagates the
parameters' and the batch's shardings) or ``explicit`` (shardings in the values' types, as with
``jax.make_mesh``'s default; the batch is laid out with ``jax.sharding.reshard``). Model context
parallelism needs Auto axes, so ``explicit`` runs ``dp,fsdp,tp`` by default and refuses ``cp``.

    python benchmarks/bench_sharding.py --preset qwen3_5_0_8b --layers 4 --devices 2 \
        --implementation pallas                                      # on 2+ GPUs
    python benchmarks/bench_sharding.py --cpu-devices 4 --preset tiny --layers 2 --seq 128 \
        --batch 2 --iters 1 --devices 2 --dtype float32             # CPU check, seconds

Results: the run updates the ``sharding`` file of :mod:`benchmarks.results` (one row per mode,
the fields printed below), by default ``benchmarks/results/sharding_<device>.json`` on a GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jax.sharding import AxisType  # noqa: E402

from benchmarks import results  # noqa: E402
from gdn_jax import sharding  # noqa: E402
from gdn_jax.models import HybridLM, get_config  # noqa: E402

MODES = {"dp": "data", "fsdp": "fsdp", "tp": "tensor", "cp": "context"}
WEAK = ("dp", "fsdp")  # global batch grows with the devices
AXIS_TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}
# Modes per --axis-type when --modes is not given (model CP runs on Auto axes only).
DEFAULT_MODES = {"auto": "dp,fsdp,tp,cp", "explicit": "dp,fsdp,tp"}


def _model(config, implementation, dtype, mesh):
    core = None if mesh is None else sharding.model_core_sharding(mesh)
    return HybridLM(
        config,
        implementation=implementation,
        dtype=dtype,
        sharding=core,
        rngs=nnx.Rngs(0),
    )


def _step_fn(graphdef, tx, constrain):
    def loss_fn(params, tokens):
        inputs, targets = constrain(tokens)
        model = nnx.merge(graphdef, params)
        # one chunk: the sequence axis may be sharded (context parallel)
        return model.loss(model.hidden(inputs), targets, chunk=None)[0]

    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    return jax.jit(step)


def _time(step, params, opt_state, tokens, iters: int) -> tuple[float, tuple]:
    out = step(params, opt_state, tokens)  # compile + warm-up; its results are the ones checked
    jax.block_until_ready(out)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(step(params, opt_state, tokens))
        times.append(time.perf_counter() - t0)
    return (float(np.median(times)) if times else float("nan")), out  # --iters 0: check only


def _run(config, args, tokens, mesh):
    """One train step on ``tokens`` [B, T + 1] on ``mesh`` (None: the first device)."""
    tokens = (tokens[:, :-1], tokens[:, 1:])  # inputs, targets: [B, T] each
    model = _model(config, args.implementation, jnp.dtype(args.dtype), mesh)
    tx = optax.adamw(1e-3)
    if mesh is None:
        dev = jax.devices()[0]
        graphdef, params = nnx.split(model, nnx.Param)
        params = jax.device_put(params, dev)
        tokens = jax.device_put(tokens, dev)
        constrain = lambda t: t
    else:
        rules = sharding.logical_axis_rules(mesh)
        sharding.shard_model(model, mesh, rules)
        graphdef, params = nnx.split(model, nnx.Param)
        tok_sharding = sharding.batch_sharding(mesh, rules)
        tokens = jax.device_put(tokens, tok_sharding)
        if args.axis_type == "explicit":  # with_sharding_constraint takes Auto axes only
            constrain = lambda t: jax.sharding.reshard(t, tok_sharding)
        else:
            constrain = lambda t: jax.lax.with_sharding_constraint(t, tok_sharding)
    opt_state = sharding.init_optimizer_state(tx, params, mesh)  # the step compiles once
    step = _step_fn(graphdef, tx, constrain)
    t, (params_1, opt_state_1, loss, grads) = _time(step, params, opt_state, tokens, args.iters)
    losses = [float(loss)]  # training: the loss of each of --train-steps updates
    for _ in range(args.train_steps - 1):
        params_1, opt_state_1, loss_k, _ = step(params_1, opt_state_1, tokens)
        losses.append(float(loss_k))
    return t, losses, jax.tree.map(np.asarray, jax.device_get(grads))


def _grad_rel_rms(a, b) -> float:
    """sqrt(Σ|a − b|²) / sqrt(Σ|b|²) over all leaves (f32)."""
    num = den = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        num += float(np.sum((x - y) ** 2))
        den += float(np.sum(y**2))
    return float(np.sqrt(num / max(den, 1e-300)))


def _field(kv: str) -> tuple[str, int]:
    name, sep, value = kv.partition("=")
    if not sep or not value.lstrip("-").isdigit():
        raise ValueError(f"--config {kv!r}: expected FIELD=INT")
    return name, int(value)


def matches_one_device(row: dict, tol: float) -> bool:
    """The check of one mode's row: losses within ``tol`` (relative) of the one-device run's;
    gradients within ``tol`` (relative RMS) of them in f32, and in a 16-bit ``--dtype`` no
    further from the f32 maths than 2x the one-device run is (the 2x rule of docs/design.md:
    reduction order differs between meshes, so 16-bit gradients differ at their rounding
    level)."""
    if row["loss_rel_diff"] > tol:
        return False
    if "grad_floor" in row:
        return row["grad_rel_rms_f32"] <= 2 * row["grad_floor"]
    return row["grad_rel_rms"] <= tol


def bench(args) -> list[dict]:
    n = args.devices or len(jax.devices())
    if n > len(jax.devices()):
        raise ValueError(f"--devices {n}: only {len(jax.devices())} devices")
    overrides = dict(_field(kv) for kv in args.config)
    if args.layers is not None:
        overrides["num_layers"] = args.layers
    config = get_config(args.preset, **overrides)
    rng = np.random.default_rng(0)
    reference: dict[int, tuple] = {}  # global batch -> one-device (tokens, time, losses, grads)
    floor: dict[int, tuple] = {}  # global batch -> one-device f32 xla (losses, grads)
    exact = jnp.dtype(args.dtype) == jnp.float32
    f32_args = argparse.Namespace(**{**vars(args), "dtype": "float32", "implementation": "xla"})
    f32_args.iters = 0
    if args.axis_type not in AXIS_TYPES:
        raise ValueError(f"--axis-type {args.axis_type!r}: expected one of {sorted(AXIS_TYPES)}")
    modes = (args.modes or DEFAULT_MODES[args.axis_type]).split(",")
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"--modes: {mode!r} is not one of {sorted(MODES)}")
    if args.axis_type == "explicit" and "cp" in modes:
        raise ValueError(
            f"--modes {','.join(modes)} with --axis-type explicit: model context parallelism "
            "(cp) runs on Auto mesh axes only; use --axis-type auto for cp"
        )
    rows = []
    for mode in modes:
        B = args.batch * n if mode in WEAK else args.batch
        if B not in reference:
            tokens = rng.integers(0, config.vocab_size, (B, args.seq + 1), dtype=np.int32)
            reference[B] = (tokens, *_run(config, args, tokens, None))
            if not exact:  # the rounding level of --dtype: one device vs the f32 maths
                floor[B] = _run(config, f32_args, tokens, None)[1:]
        tokens, t1, losses1, grads1 = reference[B]
        mesh = sharding.make_mesh({MODES[mode]: n}, axis_type=AXIS_TYPES[args.axis_type])
        if mode == "tp":
            sharding.check_model_divisibility(config, mesh)
        tn, losses_n, grads_n = _run(config, args, tokens, mesh)
        loss1, loss_n = losses1[-1], losses_n[-1]
        row = dict(
            preset=args.preset,
            layers=config.num_layers,
            config=" ".join(args.config) or None,
            mode=mode,
            axis_type=args.axis_type,
            devices=n,
            global_batch=B,
            seq=args.seq,
            loss_1=loss1,
            loss_n=loss_n,
            losses_1=losses1,
            losses_n=losses_n,
            loss_rel_diff=max(abs(a - b) / abs(b) for a, b in zip(losses_n, losses1, strict=True)),
            grad_rel_rms=_grad_rel_rms(grads_n, grads1),
            step_ms_1=1e3 * t1,
            step_ms_n=1e3 * tn,
            tokens_per_s_per_device=B * args.seq / tn / n,
            efficiency=t1 / (n * tn),
        )
        if not exact:
            losses32, grads32 = floor[B]
            row.update(
                losses_f32=losses32,
                grad_floor=_grad_rel_rms(grads1, grads32),  # one device vs f32
                grad_rel_rms_f32=_grad_rel_rms(grads_n, grads32),  # n devices vs f32
            )
        rows.append(row)
        print(
            f"{mode:5s} n={n} B={B:3d}  loss@{len(losses1)} {loss1:.6f} vs {loss_n:.6f} "
            f"(max rel diff {row['loss_rel_diff']:.1e})  "
            f"grad rel RMS {row['grad_rel_rms']:.2e}  step {row['step_ms_1']:.1f} → "
            f"{row['step_ms_n']:.1f} ms  {row['tokens_per_s_per_device']:.0f} tok/s/dev  "
            f"efficiency {row['efficiency']:.2f}"
            + (
                ""
                if exact
                else f"  vs f32: {row['grad_rel_rms_f32']:.2e} (1 device {row['grad_floor']:.2e})"
            ),  # fmt: skip
            flush=True,
        )
    return rows


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="qwen3_5_0_8b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument(
        "--config", nargs="*", default=[], metavar="FIELD=INT",
        help="override preset fields, e.g. linear_head_dim=64 linear_v_head_dim=64",
    )  # fmt: skip
    p.add_argument("--batch", type=int, default=2, help="per device for dp/fsdp, global for tp/cp")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--devices", type=int, default=None, help="default: all")
    p.add_argument(
        "--modes", default=None,
        help="comma-separated modes; default dp,fsdp,tp,cp (auto) or dp,fsdp,tp (explicit)",
    )  # fmt: skip
    p.add_argument(
        "--axis-type", choices=sorted(AXIS_TYPES), default="auto",
        help="mesh axis type: auto (the partitioner propagates shardings) or explicit",
    )  # fmt: skip
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--train-steps", type=int, default=3, help="updates whose losses are compared")
    p.add_argument("--implementation", default=None, help="GDN core (default: per platform)")
    p.add_argument("--dtype", default="bfloat16", help="compute dtype (float32 for exactness)")
    p.add_argument("--tol", type=float, default=5e-3, help="see matches_one_device")
    p.add_argument("--cpu-devices", type=int, default=None)
    p.add_argument(
        "--json", default="auto", help="results file to update; auto: the topic file on a GPU"
    )
    args = p.parse_args(argv)
    if args.cpu_devices:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    print(f"devices: {jax.devices()}  preset={args.preset} layers={args.layers} seq={args.seq}")
    date = results.now()
    rows = bench(args)
    results.write(results.output_path(args.json, "sharding"), "sharding", rows, date=date)
    bad = [r["mode"] for r in rows if not matches_one_device(r, args.tol)]
    if bad:
        raise SystemExit(f"modes {bad} differ from the one-device run (see matches_one_device)")
    return rows


if __name__ == "__main__":
    main()
