"""Step time and device memory of a hybrid-LM train step: BF16 vs FP8 projections, remat/offload.

One AdamW step (forward, backward, update; parameters f32, compute BF16) of the chosen preset per
setting. Memory comes from XLA's compiled memory analysis (device temp = activations, residuals
and workspace; host temp = what offload parks in pinned host memory) plus the device's peak
bytes in use; time is per step of ``--iters`` steps run back to back after two warm-up steps, as
a training loop runs them (:func:`time_step`; ``step_synced_ms``: each step blocked until done).
Settings run in order until ``--budget-s`` is spent; results go to a printed table and ``--json``.

    python benchmarks/bench_model.py --preset qwen3_5_0_8b --batch 4 --seq 2048
    python benchmarks/bench_model.py --preset tiny --layers 2 --seq 64 --iters 2   # CPU smoke

Settings: ``<fp8>+<policy>[+overlap]``, fp8 in {bf16, native, te}, policy in {none (no
checkpoint), save (every layer checkpointed, named tensors saved), offload (the GDN core's
residuals offloaded), offloadall (every named tensor offloaded), remat (everything recomputed)}.
Offloading steps are compiled with :func:`gdn_jax.remat.compiler_options` (XLA's GPU
latency-hiding scheduler off); ``+overlap`` keeps the scheduler.

Results: the run updates the ``model`` file of :mod:`benchmarks.results` (rows ``preset, layers,
batch, seq, setting, step_ms, mfu, peak_gib, torch_eager_ms, torch_compile_ms`` and the memory
analysis), by default ``benchmarks/results/model_<device>.json`` on a GPU. ``mfu`` uses the FLOP
count of ``bench_vs_torch.train_flops`` (model FLOPs over 989 TFLOP/s, FP8 settings too); the
PyTorch peer is ``bench_vs_torch.py``: here ``torch_*_ms`` are null.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import results  # noqa: E402
from gdn_jax import fp8, remat  # noqa: E402
from gdn_jax.models import HybridLM, get_config  # noqa: E402

DEFAULT = (
    "bf16+save,bf16+offload,bf16+offloadall,native+save,native+offload,bf16+none,bf16+remat,te+save"
)

# policy -> (action of the core residuals, action of the layer activations); None: no remat.
_POLICIES = {
    "none": None,
    "save": ("save", "save"),
    "offload": ("offload", "save"),
    "offloadall": ("offload", "offload"),
    "remat": ("remat", "remat"),
}


def _spec(name: str) -> dict | None:
    actions = _POLICIES[name]
    if actions is None:
        return None
    spec = dict.fromkeys(remat.CORE_RESIDUALS, actions[0])
    spec.update(dict.fromkeys(remat.LAYER_ACTIVATIONS, actions[1]))
    return spec


def _policies(spec: dict | None, num_layers: int, threshold: int, fraction: float):
    if spec is None:
        return [None] * num_layers
    return remat.layer_policies(
        spec, num_layers, offload_fraction=fraction, offload_threshold=threshold
    )


# The optimizer of every step timed here and of its PyTorch peer (bench_vs_torch.py).
ADAMW = dict(learning_rate=1e-4, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)


def make_tokens(batch: int, seq: int, vocab: int, seed: int = 0) -> np.ndarray:
    """[batch, seq + 1] int32 random token ids (inputs ``[:, :-1]``, targets ``[:, 1:]``)."""
    return np.random.default_rng(seed).integers(0, vocab, (batch, seq + 1)).astype(np.int32)


class TrainStep(NamedTuple):
    """A compiled train step and its state.

    ``compiled(param_leaves, opt_leaves, tokens)`` returns ``(param_leaves, opt_leaves, loss)``:
    the parameters (f32) and the AdamW state as flat lists of arrays in the leaf order of
    ``treedefs``, both donated; ``tokens`` int32 ``[batch, seq + 1]``; ``loss`` an f32 scalar.
    :attr:`params` and :attr:`opt_state` are the same arrays as pytrees.
    """

    compiled: Any
    param_leaves: list[jax.Array]
    opt_leaves: list[jax.Array]
    treedefs: tuple[Any, Any]  # PyTreeDefs of the nnx.State of nnx.Param and the AdamW state
    tokens: jax.Array
    compile_s: float
    config: Any

    @property
    def params(self) -> nnx.State:
        """The parameters, ``nnx.split(model, nnx.Param)``'s state."""
        return jax.tree.unflatten(self.treedefs[0], self.param_leaves)

    @property
    def opt_state(self) -> Any:
        """The AdamW state (``optax.adamw(...).init(params)``)."""
        return jax.tree.unflatten(self.treedefs[1], self.opt_leaves)


def build_step(
    config,
    setting: str,
    batch: int,
    seq: int,
    *,
    implementation="xla",
    offload_threshold: int = 0,
    offload_fraction: float = 1.0,
) -> TrainStep:
    """One AdamW step (:data:`ADAMW`; f32 parameters, bf16 compute) of ``HybridLM(config)``,
    compiled for ``[batch, seq]`` tokens under ``setting`` (``<fp8>+<policy>[+overlap]``)."""
    backend, policy, *extra = setting.split("+")
    if extra not in ([], ["overlap"]) or policy not in _POLICIES:
        raise ValueError(f"{setting=}: expected <fp8>+<policy>[+overlap], policy in {_POLICIES}")
    model = HybridLM(config, implementation=implementation, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    fp8.convert_projections(model, None if backend == "bf16" else backend)
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.adamw(**ADAMW)
    # The step takes and returns flat lists of arrays: each call flattens its arguments and
    # unflattens its results on the host, which for a list is one C++ pass, while an nnx.State
    # calls back into Python for every nnx.Param (about 1,200 leaves for qwen3_5_0_8b with
    # the AdamW moments), host time that precedes every step's first kernel.
    param_leaves, param_def = jax.tree.flatten(params)
    opt_leaves, opt_def = jax.tree.flatten(tx.init(params))
    spec = _spec(policy)
    policies = _policies(spec, config.num_layers, offload_threshold, offload_fraction)
    options = remat.compiler_options(spec, overlap_copies=bool(extra))
    tokens = jnp.asarray(make_tokens(batch, seq, config.vocab_size))

    def loss_fn(params, tokens):
        model = nnx.merge(graphdef, params)
        x = model.hidden(tokens[:, :-1], remat_policies=policies)
        return model.loss(x, tokens[:, 1:])[0]

    def step(param_leaves, opt_leaves, tokens):
        params = param_def.unflatten(param_leaves)
        opt_state = opt_def.unflatten(opt_leaves)
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        with jax.named_scope("optimizer"):
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        # flatten_up_to: the leaves come back in the order of the inputs' treedefs (it raises
        # if the update changed a structure)
        return param_def.flatten_up_to(params), opt_def.flatten_up_to(opt_state), loss

    t0 = time.perf_counter()
    step = jax.jit(step, donate_argnums=(0, 1), compiler_options=options)
    compiled = step.lower(param_leaves, opt_leaves, tokens).compile()
    compile_s = time.perf_counter() - t0
    treedefs = (param_def, opt_def)
    return TrainStep(compiled, param_leaves, opt_leaves, treedefs, tokens, compile_s, config)


class StepTimes(NamedTuple):
    """Seconds per step, two ways (:func:`time_calls`), and the steps run, warm-up included."""

    pipelined_s: float
    synced_s: float
    steps: int


def time_calls(call: Callable[[], Any], wait: Callable[[Any], Any], iters: int):
    """Seconds per ``call()``, two ways: the mean of ``iters`` calls dispatched back to back with
    one ``wait`` on the last result, as a training loop runs steps (the host prepares call i + 1
    while the device still runs call i), and the median of ``iters`` more calls, each waited
    for, which adds the host's time to prepare a call to every call."""
    t0 = time.perf_counter()
    for _ in range(iters):
        out = call()
    wait(out)
    back_to_back = (time.perf_counter() - t0) / iters
    synced = []
    for _ in range(iters):
        t0 = time.perf_counter()
        wait(call())
        synced.append(time.perf_counter() - t0)
    return back_to_back, float(np.median(synced))


# Warm-up steps of both stacks (bench_vs_torch's PyTorch step too), dispatched back to back as
# the timed ones are: the pair also makes the allocator hold two steps' buffers at once, a
# one-time cost that would otherwise land in the first timed batch.
WARMUP = 2


def time_step(s: TrainStep, iters: int) -> tuple[StepTimes, TrainStep, float]:
    """Step times (:func:`time_calls`) after :data:`WARMUP` steps, the step with its updated
    state, and the last loss."""
    state = (s.param_leaves, s.opt_leaves)

    def call():
        nonlocal state
        state = s.compiled(state[0], state[1], s.tokens)
        return state

    for _ in range(WARMUP):
        out = call()
    jax.block_until_ready(out)
    times = StepTimes(*time_calls(call, jax.block_until_ready, iters), WARMUP + 2 * iters)
    param_leaves, opt_leaves, loss = state
    return times, s._replace(param_leaves=param_leaves, opt_leaves=opt_leaves), float(loss)


def peak_gib() -> float | None:
    """The device's peak bytes in use so far (``memory_stats``), GiB; None where not reported."""
    peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    return None if peak is None else peak * 2.0**-30


def _mfu(config, batch: int, seq: int, step_s: float) -> float | None:
    """Model FLOPs (``bench_vs_torch.train_flops``) per second over the H200's bf16 peak; None
    for variants the count does not cover."""
    from benchmarks.bench_vs_torch import PEAK_FLOPS, train_flops

    try:
        return train_flops(config, batch, seq)["total"] / step_s / PEAK_FLOPS
    except NotImplementedError:
        return None


def bench(setting: str, args) -> dict:
    config = get_config(args.preset, **({"num_layers": args.layers} if args.layers else {}))
    s = build_step(
        config, setting, args.batch, args.seq, implementation=args.implementation,
        offload_threshold=args.offload_threshold, offload_fraction=args.offload_fraction,
    )  # fmt: skip
    ma = s.compiled.memory_analysis()
    hlo = s.compiled.as_text()
    times, s, loss = time_step(s, args.iters)
    step_s = times.pipelined_s
    gib = 2.0**-30
    return dict(
        preset=args.preset,
        layers=config.num_layers,
        batch=args.batch,
        seq=args.seq,
        setting=setting,
        step_ms=1e3 * step_s,
        step_synced_ms=1e3 * times.synced_s,
        tokens_s=args.batch * args.seq / step_s,
        mfu=_mfu(config, args.batch, args.seq, step_s),
        peak_gib=peak_gib(),
        torch_eager_ms=None,
        torch_compile_ms=None,
        compile_s=s.compile_s,
        device_temp_gib=getattr(ma, "temp_size_in_bytes", 0) * gib,
        device_args_gib=getattr(ma, "argument_size_in_bytes", 0) * gib,
        host_temp_gib=getattr(ma, "host_temp_size_in_bytes", 0) * gib,
        host_copies_S5=hlo.count("S(5)"),
        fp8_ops=hlo.count("f8e4m3fn") + hlo.count("f8e5m2"),
        cublaslt_fp8_gemms=hlo.count("cublas$lt$matmul$f8"),
        loss=loss,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3_5_0_8b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--settings", default=DEFAULT)
    p.add_argument("--implementation", default="xla")
    p.add_argument("--offload-threshold", type=int, default=0)
    p.add_argument("--offload-fraction", type=float, default=1.0)
    p.add_argument("--budget-s", type=float, default=1e9, help="stop starting new settings")
    p.add_argument(
        "--json", default="auto", help="results file to update; auto: the topic file on a GPU"
    )
    args = p.parse_args(argv)
    if any(s.startswith("te+") for s in args.settings.split(",")):
        fp8.te_available()  # import TE before JAX loads its CUDA libraries (see fp8.import_te)
    start, date = time.perf_counter(), results.now()
    rows = []
    print(f"{jax.devices()[0].device_kind}: {args.preset} B={args.batch} T={args.seq}")
    head = f"{'setting':24s} {'step ms':>8s} {'dev temp GiB':>12s} {'host temp GiB':>13s}"
    print(
        head + f" {'peak GiB':>9s} {'S(5)':>5s} {'f8 ops':>6s} {'f8 GEMMs':>8s} {'compile s':>9s}"
    )
    settings = args.settings.split(",")
    for setting in settings:
        if time.perf_counter() - start > args.budget_s:
            print(f"{setting:24s} skipped (budget)")
            continue
        if len(settings) > 1:
            # one process per setting: the device's peak-bytes counter cannot be reset, and
            # compiled executables of earlier settings would stay resident
            r = _run_child(argv, setting)
        else:
            try:
                r = bench(setting, args)
            except fp8.TEUnavailableError as e:
                r = None
                print(f"{setting:24s} not run: {str(e)[:100]}")
        if r is None:
            continue
        rows.append(r)
        print(
            f"{setting:24s} {r['step_ms']:8.2f} {r['device_temp_gib']:12.3f} "
            f"{r['host_temp_gib']:13.3f} {r['peak_gib'] or 0:9.2f} {r['host_copies_S5']:5d} "
            f"{r['fp8_ops']:6d} {r['cublaslt_fp8_gemms']:8d} {r['compile_s']:9.1f}",
            flush=True,
        )
    results.write(results.output_path(args.json, "model"), "model", rows, date=date)
    return 0


def _run_child(argv, setting: str) -> dict | None:
    """Runs one setting in a fresh interpreter; its row, or None (the child's output says why)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    for flag in ("--settings", "--json"):  # drop the parent's values of these
        while flag in argv:
            i = argv.index(flag)
            del argv[i : i + 2]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        cmd = [sys.executable, __file__, *argv, "--settings", setting, "--json", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode or not out.exists():
            print(f"{setting:24s} failed (rc {proc.returncode}): {proc.stderr.strip()[-300:]}")
            return None
        rows = json.loads(out.read_text())["rows"]
        if not rows:
            print(f"{setting:24s} " + proc.stdout.strip().splitlines()[-1][25:])
        return rows[0] if rows else None


if __name__ == "__main__":
    sys.exit(main())
