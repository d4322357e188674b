"""Training equivalence of remat / host offload (and the harness the CPU test uses).

Runs six optimizer steps of four micro-batches each of the hybrid LM with the same data and
compares, bit for bit, the losses, the gradients of every step, and the final parameters and
full optimizer state between:

  (a) save     jitted step; each layer under jax.checkpoint, every named tensor saved on device
  (b) offload  the same step with every named tensor offloaded to pinned host memory
  (c) remat    the same step with the GDN core's residuals recomputed (activations saved)
      rematall the same step with every named tensor recomputed
  (d) nojit    step (a) run op by op, without jit

(a) = (b) must hold exactly (moving bytes changes no bit) and (b) must really offload (the jaxpr
is checked). (c) and (d) are compared bitwise and, where they differ, the largest relative
difference over all six steps and the first step's loss/gradient differences are reported (XLA
rounds BF16 intermediates at different places when it fuses recomputed or op-by-op code).

    python scripts/gpu_equivalence.py --preset qwen3_5_0_8b --seq 128 --fp8 none,native
    python scripts/gpu_equivalence.py --preset tiny --layers 2 --seq 32      # CPU, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gdn_jax import fp8, remat  # noqa: E402
from gdn_jax.models import HybridLM, get_config  # noqa: E402

STEPS, MICRO = 6, 4
VARIANTS = ("save", "offload", "remat", "rematall", "nojit")
# variant -> (action of the GDN core's residuals, action of the layers' named activations)
_ACTION = {
    "save": ("save", "save"),
    "offload": ("offload", "offload"),
    "remat": ("remat", "save"),
    "rematall": ("remat", "remat"),
    "nojit": ("save", "save"),
}


@dataclasses.dataclass
class Setup:
    graphdef: nnx.GraphDef
    params: nnx.State
    tx: optax.GradientTransformation
    data: jax.Array  # [STEPS, MICRO, B, T + 1] int32
    num_layers: int


def make_setup(preset="tiny", *, layers=None, seq=32, batch=2, fp8_backend=None, seed=0,
               implementation="xla", dtype=jnp.bfloat16, **overrides) -> Setup:  # fmt: skip
    """Model (BF16 compute, f32 params; projections FP8 for ``fp8_backend``), AdamW, data."""
    if layers is not None:
        overrides["num_layers"] = layers
    config = get_config(preset, **overrides)
    model = HybridLM(config, implementation=implementation, dtype=dtype, rngs=nnx.Rngs(seed))
    fp8.convert_projections(model, fp8_backend)
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3, weight_decay=0.1))
    key = jax.random.key(seed + 1)
    data = jax.random.randint(key, (STEPS, MICRO, batch, seq + 1), 0, config.vocab_size)
    return Setup(graphdef, params, tx, data, config.num_layers)


def make_step(s: Setup, policies, *, scan: bool = True):
    """One optimizer step over MICRO micro-batches (gradients summed in order, then averaged).

    ``scan``: loop over the micro-batches with ``lax.scan`` (one compiled body; what a jitted
    step does) or in Python (the op-by-op step).
    """

    def loss_fn(params, tokens):
        model = nnx.merge(s.graphdef, params)
        x = model.hidden(tokens[:, :-1], remat_policies=policies)
        return model.loss(x, tokens[:, 1:])[0]

    def micro(acc, tokens):
        loss, g = jax.value_and_grad(loss_fn)(params_, tokens)
        return jax.tree.map(jnp.add, acc, g), loss

    def step(params, opt_state, batches):
        nonlocal params_
        params_ = params
        acc = jax.tree.map(jnp.zeros_like, params)
        if scan:
            acc, losses = jax.lax.scan(micro, acc, batches)
        else:
            losses = []
            for i in range(MICRO):
                acc, loss = micro(acc, batches[i])
                losses.append(loss)
            losses = jnp.stack(losses)
        grads = jax.tree.map(lambda g: g / MICRO, acc)
        updates, opt_state = s.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, losses, grads

    params_ = None
    return step


def spec_for(variant: str) -> dict:
    core, layer = _ACTION[variant]
    spec = dict.fromkeys(remat.CORE_RESIDUALS, core)
    spec.update(dict.fromkeys(remat.LAYER_ACTIVATIONS, layer))
    return spec


def policies_for(variant: str, num_layers: int, **kw):
    return remat.layer_policies(spec_for(variant), num_layers, **kw)


def run_variant(
    s: Setup,
    variant: str,
    *,
    steps: int = STEPS,
    compiler_options=None,
    hlo_path: str | None = None,
    **policy_kw,
) -> dict:
    """``steps`` optimizer steps; returns losses [steps, MICRO], per-step grads, final params
    and optimizer state, and the wall time (compile included). The jitted step is compiled with
    the variant's :func:`gdn_jax.remat.compiler_options` (as a user's step would be) plus
    ``compiler_options``. ``hlo_path``: also write the optimised HLO of the jitted step there
    (to diff the programs of two variants)."""
    jit = variant != "nojit"
    step = make_step(s, policies_for(variant, s.num_layers, **policy_kw), scan=jit)
    params, opt_state = s.params, s.tx.init(s.params)
    if jit:
        options = {**remat.compiler_options(spec_for(variant)), **(compiler_options or {})}
        step = jax.jit(step, compiler_options=options)
        if hlo_path:
            compiled = step.lower(params, opt_state, s.data[0]).compile()
            Path(hlo_path).write_text(compiled.as_text())
    losses, grads = [], []
    t0 = time.perf_counter()
    for i in range(steps):
        params, opt_state, loss, g = step(params, opt_state, s.data[i])
        losses.append(loss)
        grads.append(g)
    jax.block_until_ready(params)
    return dict(
        losses=jnp.stack(losses), grads=grads, params=params, opt_state=opt_state,
        seconds=time.perf_counter() - t0,
    )  # fmt: skip


def offloaded(s: Setup, variant: str, **policy_kw) -> list[str]:
    """Host-memory values in the jaxpr of one step (what the variant moves to the host)."""
    step = make_step(s, policies_for(variant, s.num_layers, **policy_kw))
    text = str(jax.make_jaxpr(step)(s.params, s.tx.init(s.params), s.data[0]))
    return re.findall(r"\w+:(\w+<host>\[[\d,]*\]) = device_put", text)


def _leaves(result: dict) -> list[np.ndarray]:
    tree = (result["losses"], result["grads"], result["params"], result["opt_state"])
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def checksum(result: dict) -> str:
    """sha256 (first 16 hex) over every bit of losses, grads, params and optimizer state."""
    h = hashlib.sha256()
    for x in _leaves(result):
        h.update(np.ascontiguousarray(x).tobytes())
    return h.hexdigest()[:16]


def compare(a: dict, b: dict) -> tuple[bool, float]:
    """(bitwise equal, largest relative difference of any leaf: ‖a − b‖∞ / ‖a‖∞)."""
    worst, equal = 0.0, True
    for x, y in zip(_leaves(a), _leaves(b), strict=True):
        if x.dtype.kind not in "fc":
            equal &= bool(np.array_equal(x, y))
            continue
        xb, yb = x.astype(np.float64), y.astype(np.float64)
        equal &= x.tobytes() == y.tobytes()
        scale = max(np.max(np.abs(xb)), 1e-30) if x.size else 1.0
        worst = max(worst, float(np.max(np.abs(xb - yb)) / scale) if x.size else 0.0)
    return equal, worst


def first_step_diff(a: dict, b: dict) -> tuple[float, float]:
    """Step 1 (same parameters): max relative loss difference, gradients' relative RMS."""
    la, lb = np.asarray(a["losses"][0], np.float64), np.asarray(b["losses"][0], np.float64)
    ga = np.concatenate(
        [np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(a["grads"][0])]
    )
    gb = np.concatenate(
        [np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(b["grads"][0])]
    )
    rel_loss = float(np.max(np.abs(la - lb) / np.abs(la)))
    return rel_loss, float(np.linalg.norm(ga - gb) / max(np.linalg.norm(ga), 1e-30))


# Bitwise comparisons of separately compiled programs on a GPU need XLA to choose the same GEMM
# algorithms (no autotuning), deterministic reductions, and BF16 rounding where the program says
# (with excess precision a fusion may keep f32 intermediates, so rounding follows fusion choices).
BITWISE_XLA_FLAGS = (
    "--xla_gpu_deterministic_ops=true",
    "--xla_gpu_autotune_level=0",
    "--xla_allow_excess_precision=false",
)


def _add_bitwise_xla_flags() -> None:
    """Adds each of :data:`BITWISE_XLA_FLAGS` that ``XLA_FLAGS`` does not set (before JAX starts
    its backends, which read the variable once)."""
    flags = os.environ.get("XLA_FLAGS", "")
    for flag in BITWISE_XLA_FLAGS:
        if flag.split("=")[0] not in flags:
            flags = f"{flags} {flag}".strip()
    os.environ["XLA_FLAGS"] = flags


def f32_distances(args, results: dict) -> list[dict]:
    """Step 1 of each run in ``results`` ({(backend, variant): its step-1 losses and grads})
    against the same step in f32 compute (same parameters and data): if a variant that is not
    bitwise (a) is as far from f32 as (a) is, the two differ by where they round, not by what
    they compute."""
    rows = []
    for backend in dict.fromkeys(b for b, _ in results):
        s = make_setup(
            args.preset, layers=args.layers, seq=args.seq, batch=args.batch,
            fp8_backend=None if backend == "none" else backend,
            implementation=args.implementation, dtype=jnp.float32,
        )  # fmt: skip
        ref = jax.tree.map(np.asarray, run_variant(s, "save", steps=1))
        for (b, v), r in results.items():
            if b != backend:
                continue
            loss, grads = first_step_diff(ref, r)
            print(
                f"fp8={backend:6s} {v:8s} vs f32 compute, step 1: "
                f"loss rel diff {loss:.2g}, grads rel RMS {grads:.2g}",
                flush=True,
            )
            rows.append(dict(fp8=backend, variant=v, vs="f32", step1_loss_rel=loss,
                             step1_grad_rel_rms=grads))  # fmt: skip
    return rows


def main(argv=None) -> int:
    _add_bitwise_xla_flags()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3_5_0_8b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--fp8", default="none,native", help="comma list of none, native, te")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--implementation", default="xla")
    p.add_argument("--offload-threshold", type=int, default=0)
    p.add_argument("--offload-fraction", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=STEPS, help="optimizer steps of the jitted runs")
    p.add_argument("--nojit-steps", type=int, default=STEPS, help="steps of the op-by-op run")
    p.add_argument("--budget-s", type=float, default=1e9, help="stop starting new variants")
    p.add_argument("--hlo-dir", default=None, help="write each jitted variant's optimised HLO here")
    p.add_argument(
        "--f32-reference", action="store_true",
        help="also run one step in f32 compute and print how far (a) and each non-bitwise "
        "variant are from it (equally far: their difference is rounding placement)",
    )  # fmt: skip
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.hlo_dir:
        Path(args.hlo_dir).mkdir(parents=True, exist_ok=True)
    if "te" in args.fp8.split(","):
        fp8.te_available()  # import TE before JAX loads its CUDA libraries (see fp8.import_te)
    start = time.perf_counter()
    report = []
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    print(f"devices: {jax.devices()}  preset={args.preset} seq={args.seq} batch={args.batch}")
    kw = dict(offload_fraction=args.offload_fraction, offload_threshold=args.offload_threshold)
    ok = True
    setups, saved, results = {}, {}, {}

    def run_and_compare(backend: str, v: str) -> bool:
        """Runs variant ``v`` of ``backend``, prints its checksum and, unless it is (a) itself,
        its comparison with (a); False when (b) is not bitwise (a)."""
        s = setups[backend]
        if time.perf_counter() - start > args.budget_s:
            print(f"fp8={backend:6s} {v:8s} skipped (budget)")
            return True
        steps = min(args.nojit_steps if v == "nojit" else args.steps, STEPS)
        hlo = f"{args.hlo_dir}/{backend}_{v}.hlo.txt" if args.hlo_dir and v != "nojit" else None
        r = run_variant(s, v, steps=steps, hlo_path=hlo, **kw)
        r = jax.tree.map(np.asarray, r)  # to host: keeps device memory for the next run
        results[backend, v] = dict(losses=r["losses"][:1], grads=r["grads"][:1])  # step 1
        losses = r["losses"]
        print(
            f"fp8={backend:6s} {v:8s} {checksum(r)}  loss[0]={losses[0, 0]:.6f} "
            f"loss[-1]={losses[-1, -1]:.6f}  {r['seconds']:.1f}s",
            flush=True,
        )
        if v == "save":
            saved[backend] = r
            return True
        ref = saved.get(backend)
        if ref is None:
            return True
        if steps != len(ref["grads"]):  # compare the steps both ran
            steps = min(steps, len(ref["grads"]))
            ref = dict(ref, losses=ref["losses"][:steps], grads=ref["grads"][:steps])
            r = dict(r, losses=r["losses"][:steps], grads=r["grads"][:steps])
            r = dict(r, params=ref["params"], opt_state=ref["opt_state"])
        equal, worst = compare(ref, r)
        l1, g1 = first_step_diff(ref, r)
        print(
            f"    save vs {v:8s}: bitwise={equal}  max rel diff={worst:.3g}  "
            f"step 1: loss rel diff {l1:.2g}, grads rel RMS {g1:.2g}",
            flush=True,
        )
        report.append(
            dict(fp8=backend, variant=v, steps=steps, bitwise=equal, max_rel_diff=worst,
                 step1_loss_rel=l1, step1_grad_rel_rms=g1,
                 checksum=checksum(r), checksum_save=checksum(ref))
        )  # fmt: skip
        return equal or v != "offload"

    variants = args.variants.split(",")
    first = [v for v in ("save", "offload") if v in variants]
    # Backend by backend, (a) and (b) right after the backend's setup (which compiles), so a
    # budget cut drops the extras (c), (d) first.
    for backend in args.fp8.split(","):
        try:
            setups[backend] = make_setup(
                args.preset, layers=args.layers, seq=args.seq, batch=args.batch,
                fp8_backend=None if backend == "none" else backend,
                implementation=args.implementation,
            )  # fmt: skip
        except fp8.TEUnavailableError as e:
            print(f"fp8={backend}: not run ({e})")
            continue
        except Exception as e:  # one backend's failure must not hide the others' results
            print(f"fp8={backend}: FAILED to set up: {type(e).__name__}: {e}")
            ok = False
            continue
        moved = offloaded(setups[backend], "offload", **kw)
        print(f"fp8={backend}: the offload variant moves {len(moved)} tensors to host: {moved}")
        ok &= bool(moved)
        for v in first:
            ok &= run_and_compare(backend, v)
    for v in (v for v in variants if v not in first):
        for backend in setups:
            ok &= run_and_compare(backend, v)
    if args.f32_reference:
        saved.clear()  # host memory for the f32 run (the model's f32 Adam state is large)
        report += f32_distances(args, results)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(args=vars(args), ok=ok, rows=report)))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
