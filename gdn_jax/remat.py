"""Names of the tensors that remat/offload policies can save, offload or recompute, and the
policies built from them.

Every residual of the GDN core and the layer's main activations is wrapped in
``jax.ad_checkpoint.checkpoint_name(x, NAME)`` with one of these constants. A policy maps names
to an action::

    policy = remat_policy({GDN_CHUNK_STATES: "offload", GDN_A: "save"})
    layer_fn = jax.checkpoint(layer_fn, policy=policy)       # or nnx.remat(..., policy=policy)

* ``"save"``: kept in device memory from the forward to the backward pass;
* ``"offload"``: copied to host memory (``pinned_host``) in the forward pass and back for the
  backward pass; the values are the same bits, only their location changes;
* ``"remat"``: recomputed in the backward pass (as is every unnamed intermediate inside the
  checkpointed function).

Offloading can be limited to large tensors (``offload_threshold``, in elements: smaller ones
are saved on the device, where a transfer would cost more than it frees) and to a fraction of
the layers (:func:`layer_policies`). A step that offloads is jitted with
:func:`compiler_options` (``jax.jit(step, compiler_options=remat.compiler_options(spec))``), or
on the GPU XLA brings the offloaded tensors back long before the backward needs them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import jax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.layout import Layout, with_layout_constraint

__all__ = [
    "GDN_GATE_CUMSUM",
    "GDN_A",
    "GDN_CHUNK_STATES",
    "GDN_INTRA",
    "CORE_RESIDUALS",
    "GDN_QKV",
    "GDN_GATES",
    "GDN_CORE_OUT",
    "MIXER_OUT",
    "MLP_HIDDEN",
    "LAYER_ACTIVATIONS",
    "ALL_NAMES",
    "ACTIONS",
    "Action",
    "name",
    "remat_policy",
    "layer_policies",
    "spec_from_flags",
    "compiler_options",
]

# Residuals of the chunked core's backward (docs/design.md).
GDN_GATE_CUMSUM = "gdn_gate_cumsum"  # chunk-local cumulative log-decay, f32
GDN_A = "gdn_A"  # (I + strict_tril(β K Kᵀ ⊙ decay))⁻¹ per chunk
GDN_CHUNK_STATES = "gdn_chunk_states"  # state entering each chunk, f32 [.., HV, K, V]
# GDN2/KDA Pallas core: the intra kernel's other products (decayed q and k, the WY keys w and
# values u, the intra-chunk attention Aqk), io dtype [.., HV, K|V|64]
GDN_INTRA = "gdn_intra"

CORE_RESIDUALS = (GDN_GATE_CUMSUM, GDN_A, GDN_CHUNK_STATES, GDN_INTRA)

# Main activations of a layer (named by gdn_jax.nn / gdn_jax.models).
GDN_QKV = "gdn_qkv"  # q, k, v after the short conv: the core's inputs, [B, T, H|HV, K|V]
GDN_GATES = "gdn_gates"  # g, beta (gdn2: g, b, w), f32: the core's gate inputs
GDN_CORE_OUT = "gdn_core_out"  # the core's output o before the gated norm, [B, T, HV, V]
MIXER_OUT = "mixer_out"  # a token mixer's output after its out projection, [B, T, D]
MLP_HIDDEN = "mlp_hidden"  # silu(x W_gate) * x W_up, [B, T, intermediate]

LAYER_ACTIVATIONS = (GDN_QKV, GDN_GATES, GDN_CORE_OUT, MIXER_OUT, MLP_HIDDEN)
ALL_NAMES = CORE_RESIDUALS + LAYER_ACTIVATIONS

Action = Literal["save", "offload", "remat"]
ACTIONS: tuple[Action, ...] = ("save", "offload", "remat")


def _pin(a: jax.Array) -> jax.Array:
    # Why (scripts/gpu_equivalence.py on the H200): without a pin XLA may keep a named tensor
    # in another form when it stays on the device (a transposed copy, operands merged into other
    # GEMMs) than when it must go to host memory as itself, so "save" and "offload" compiled to
    # different fusions and differed at rounding level (0.19 % in the first gradients). The
    # barrier makes the named value itself materialise, the layout constraint fixes it row-major,
    # so every policy sees the same forward and backward programs (bitwise on the H200 for
    # bf16, native and TE FP8). Cost: no fusion across the named points (step times:
    # benchmarks/bench_model.py).
    a = jax.lax.optimization_barrier(a)
    return with_layout_constraint(a, Layout(tuple(range(a.ndim))))


def name(x: Any, label: str) -> Any:
    """``checkpoint_name`` over a pytree (e.g. the (q, k, v) tuple), each array pinned first.

    The one way the library names a tensor for remat/offload policies: the pin (an optimisation
    barrier and a row-major layout) makes the named value the same buffer whatever a policy
    does with it, which keeps saved and offloaded training bitwise equal on the GPU.
    """
    return jax.tree.map(lambda a: checkpoint_name(_pin(a), label), x)


@dataclasses.dataclass(frozen=True)
class _OffloadAtLeast:
    """Offload the offloadable names only for tensors of at least ``threshold`` elements.

    ``offload`` and ``keep`` are ``save_and_offload_only_these_names`` policies that differ only
    in where the offloadable names go (host vs device); the size picks one of them.
    """

    offload: Callable[..., Any]
    keep: Callable[..., Any]
    names: frozenset[str]
    threshold: int

    def __call__(self, prim, *avals, **params):
        if params.get("name") in self.names and avals and avals[0].size < self.threshold:
            return self.keep(prim, *avals, **params)
        return self.offload(prim, *avals, **params)


def remat_policy(
    spec: Mapping[str, Action],
    *,
    offload_threshold: int = 0,
    offload_src: str = "device",
    offload_dst: str = "pinned_host",
) -> Callable[..., Any]:
    """The ``jax.checkpoint`` policy for ``{name: "save" | "offload" | "remat"}``.

    Names missing from ``spec`` and unnamed intermediates are recomputed.

    Args:
      spec: action per checkpoint name (constants of this module or your own names).
      offload_threshold: offload a named tensor only if it has at least this many elements;
        smaller ones are saved on the device. 0 offloads all of them.
      offload_src, offload_dst: memory kinds of the offload.
    Returns:
      a policy for ``jax.checkpoint(..., policy=...)`` / ``nnx.remat``.
    Raises:
      ValueError: an action other than save/offload/remat, or a negative threshold.
    """
    groups: dict[str, list[str]] = {a: [] for a in ACTIONS}
    for n, action in spec.items():
        if action not in groups:
            raise ValueError(f"{n!r}: {action=} must be one of {ACTIONS}")
        groups[action].append(n)
    if offload_threshold < 0:
        raise ValueError(f"{offload_threshold=} must be >= 0")
    policies = jax.checkpoint_policies
    offload = policies.save_and_offload_only_these_names(
        names_which_can_be_saved=groups["save"],
        names_which_can_be_offloaded=groups["offload"],
        offload_src=offload_src,
        offload_dst=offload_dst,
    )
    if offload_threshold == 0 or not groups["offload"]:
        return offload
    keep = policies.save_and_offload_only_these_names(
        names_which_can_be_saved=groups["save"] + groups["offload"],
        names_which_can_be_offloaded=[],
        offload_src=offload_src,
        offload_dst=offload_dst,
    )
    return _OffloadAtLeast(offload, keep, frozenset(groups["offload"]), offload_threshold)


# An action of a layer that does not offload: its offloaded names stay on the device.
_ON_DEVICE: dict[str, Action] = {"save": "save", "offload": "save", "remat": "remat"}


def offloaded_layers(num_layers: int, fraction: float) -> tuple[bool, ...]:
    """Which layers offload for ``fraction`` of ``num_layers``: the first ``round(f·L)``.

    The first layers' residuals wait longest for the backward pass, so moving theirs frees
    device memory for longest and leaves the most time to hide the copies.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"{fraction=} must be in [0, 1]")
    n = round(fraction * num_layers)
    return tuple(i < n for i in range(num_layers))


def layer_policies(
    spec: Mapping[str, Action],
    num_layers: int,
    *,
    offload_fraction: float = 1.0,
    offload_threshold: int = 0,
    offload_dst: str = "pinned_host",
) -> list[Callable[..., Any]]:
    """One policy per layer: ``spec`` in the offloading layers, ``spec`` with every
    ``"offload"`` turned into ``"save"`` in the others (see :func:`offloaded_layers`).

    Args:
      spec: as for :func:`remat_policy`.
      num_layers: L.
      offload_fraction: share of layers that offload (0, 0.5, 1 or anything in between).
      offload_threshold: as for :func:`remat_policy`.
    Returns:
      L policies.
    """
    on_device = {n: _ON_DEVICE[a] if a in _ON_DEVICE else a for n, a in spec.items()}
    full = remat_policy(spec, offload_threshold=offload_threshold, offload_dst=offload_dst)
    kept = remat_policy(on_device)
    return [full if off else kept for off in offloaded_layers(num_layers, offload_fraction)]


# Groups of names a command line can refer to.
NAME_GROUPS: dict[str, tuple[str, ...]] = {
    "core": CORE_RESIDUALS,
    "layer": LAYER_ACTIVATIONS,
    "all": ALL_NAMES,
}


def spec_from_flags(remat: str = "save", offload: str | Sequence[str] | None = None) -> dict:
    """The spec behind ``--remat {save,remat}`` and ``--offload NAMES``.

    Args:
      remat: the action of every name not offloaded: ``"save"`` (recompute only unnamed
        intermediates) or ``"remat"`` (recompute everything).
      offload: comma-separated names or groups (``core``, ``layer``, ``all``) to offload.
    Returns:
      ``{name: action}`` for :func:`remat_policy` / :func:`layer_policies`.
    """
    if remat not in ("save", "remat"):
        raise ValueError(f"{remat=}: expected 'save' or 'remat'")
    if isinstance(offload, str):
        offload = [s for s in offload.split(",") if s]
    spec: dict[str, Action] = dict.fromkeys(ALL_NAMES, remat)
    for item in offload or ():
        spec.update(dict.fromkeys(NAME_GROUPS.get(item, (item,)), "offload"))
    return spec


# XLA's GPU latency-hiding scheduler treats the host<->device copies of offloaded tensors as
# async work to overlap, with no limit on copies in flight and a memory limit of the whole
# device: it starts the copies back to the device as early as it can, so every layer's offloaded
# residuals are on the device again together with the forward's. benchmarks/bench_model.py on
# the H200 (24-layer qwen3_5_0_8b train step, B2 T2048): offloading every named tensor takes
# device temp memory from 5.50 GiB (save) to 13.69 GiB with the scheduler
# (bf16+offloadall+overlap) and to 3.53 GiB without it (bf16+offloadall; benchmarks/RESULTS.md).
_SERIAL_COPIES = {"xla_gpu_enable_latency_hiding_scheduler": False}


def compiler_options(spec: Mapping[str, Action] | None, *, overlap_copies: bool = False) -> dict:
    """``jax.jit`` compiler options for a step whose checkpoint policies come from ``spec``.

    With any ``"offload"`` in ``spec`` (and not ``overlap_copies``), XLA's GPU latency-hiding
    scheduler is switched off for that step, so that offloading lowers device memory (see
    ``_SERIAL_COPIES``); the copies then no longer overlap compute (nor do collectives of a
    sharded step). Values are unchanged either way: scheduling moves no arithmetic. Other
    backends ignore the option.

    Args:
      spec: ``{name: action}`` as for :func:`remat_policy`, or None (no remat).
      overlap_copies: keep the scheduler (faster, but device memory may rise with offload).
    Returns:
      a dict for ``jax.jit(..., compiler_options=...)`` (empty when nothing is offloaded).
    """
    if overlap_copies or not spec or "offload" not in spec.values():
        return {}
    return dict(_SERIAL_COPIES)
