"""Model sharding rules: the hybrid LM's logical axis names → mesh axes, and placing a model.

:func:`logical_axis_rules` maps the parameters' logical axis names to mesh axes for data parallel
(``data``), fully sharded data parallel (``fsdp``), tensor parallel (``tensor``) and context
parallel (``context``) training; :func:`shard_model` places a model's variables accordingly and
:func:`model_core_sharding` is the matching :class:`ShardingConfig` of the GDN cores.
"""

from __future__ import annotations

import jax
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gdn_jax.sharding._axes import _entry
from gdn_jax.sharding.config import ContextMode, ShardingConfig

__all__ = [
    "EMBED",
    "HEADS",
    "KV_HEADS",
    "MLP",
    "VOCAB",
    "NORM",
    "CONV_TAPS",
    "DATA",
    "FSDP",
    "TENSOR",
    "CONTEXT",
    "logical_axis_rules",
    "model_core_sharding",
    "check_model_divisibility",
    "model_shardings",
    "shard_model",
    "batch_sharding",
]

# Logical axis names of the parameters (the layers annotate their weights with these).
EMBED = "embed"  # model width
HEADS = "heads"  # head-major flattened head features (q/k/v/z, attention q) or one value per head
KV_HEADS = "kv_heads"  # softmax-attention key/value heads (fewer than HEADS under GQA)
MLP = "mlp"  # SwiGLU hidden width
VOCAB = "vocab"
NORM = "norm"  # weights of norms over a head or model dim; usually replicated
CONV_TAPS = "conv_taps"  # the kernel_size taps of a short conv; usually replicated

# Default mesh axis names (what ``examples/train.py --mesh`` and the rules use).
DATA, FSDP, TENSOR, CONTEXT = "data", "fsdp", "tensor", "context"


def logical_axis_rules(
    mesh: Mesh,
    *,
    data: str = DATA,
    fsdp: str = FSDP,
    tensor: str = TENSOR,
    context: str = CONTEXT,
    shard_kv_heads: bool = False,
) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
    """Logical axis name → mesh axes for the hybrid LM (``nnx.logical_axis_rules``).

    - DP: the batch (``"batch"``, for activations and inputs) is split over ``data`` and ``fsdp``.
    - FSDP: every weight's model-width dimension (``embed``) is split over ``fsdp``; XLA gathers
      it before use and reduce-scatters its gradient.
    - TP (Megatron): ``heads`` over ``tensor``, so the GDN and attention input projections (q, k,
      v, z, a, b, w: ``(embed, heads)``) are column-parallel, the output projections
      (``(heads, embed)``) row-parallel, and the short convs, ``A_log`` and ``dt_bias``
      (``heads``) are sharded with their heads; the SwiGLU is column/row parallel over ``mlp`` and
      the vocabulary over ``tensor`` too. Norm weights and conv taps are replicated.
    - ``kv_heads`` (softmax-attention K/V under GQA, usually fewer than the tensor shards) is
      replicated unless ``shard_kv_heads``.
    - CP: the sequence of the input batch (``"length"``) is split over ``context``. No weight
      has a sequence dimension; the GDN cores pass their states across the shards
      (:func:`model_core_sharding`) and XLA's partitioner handles the rest (the short convs' halo,
      the softmax-attention layers' all-gather of K/V).

    Axes missing from ``mesh`` are dropped, so ``make_mesh("data=8")`` gives plain DP.

    Args:
      mesh: the mesh the rules are for.
      data, fsdp, tensor, context: the mesh axis names of the four kinds of parallelism.
      shard_kv_heads: split ``kv_heads`` over ``tensor`` too.

    Returns:
      ``((logical, mesh_axes), ...)`` for every logical name the model uses.
    """
    has = set(mesh.axis_names)
    batch = tuple(a for a in (data, fsdp) if a in has)
    fs = fsdp if fsdp in has else None
    tp = tensor if tensor in has else None
    return (
        ("batch", _entry(batch)),
        ("length", context if context in has else None),
        (EMBED, fs),
        (HEADS, tp),
        (KV_HEADS, tp if shard_kv_heads else None),
        (MLP, tp),
        (VOCAB, tp),
        (NORM, None),
        (CONV_TAPS, None),
    )


def model_core_sharding(
    mesh: Mesh,
    *,
    data: str = DATA,
    fsdp: str = FSDP,
    tensor: str = TENSOR,
    context: str = CONTEXT,
    context_mode: ContextMode = "state_passing",
) -> ShardingConfig:
    """The :class:`ShardingConfig` of the GDN core that matches :func:`logical_axis_rules`."""
    has = set(mesh.axis_names)
    return ShardingConfig(
        mesh,
        batch=tuple(a for a in (data, fsdp) if a in has),
        heads=tensor if tensor in has else None,
        context=context if context in has else None,
        context_mode=context_mode,
    )


def check_model_divisibility(config, mesh: Mesh, *, tensor: str = TENSOR) -> None:
    """Raise ValueError when the tensor axis does not split the model's heads evenly.

    Args:
      config: a :class:`gdn_jax.models.HybridConfig`.
      mesh: the mesh.
      tensor: the tensor-parallel mesh axis name.
    """
    if tensor not in mesh.axis_names:
        return
    n = mesh.shape[tensor]
    counts = {
        "linear_num_heads": config.linear_num_heads,
        "linear_num_v_heads": config.linear_num_v_heads,
        "attn_num_heads": config.attn_num_heads,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
    }
    for name, c in counts.items():
        if c % n:
            raise ValueError(
                f"mesh axis {tensor!r} of size {n} must divide {name}={c} "
                f"(linear_num_heads={config.linear_num_heads}, "
                f"linear_num_v_heads={config.linear_num_v_heads}, "
                f"attn_num_heads={config.attn_num_heads})"
            )


def model_shardings(model, mesh: Mesh, rules) -> object:
    """NamedShardings for ``nnx.state(model)`` resolved through ``rules``.

    Args:
      model: an ``nnx.Module`` whose parameters carry logical axis names.
      mesh: the mesh.
      rules: from :func:`logical_axis_rules`.

    Returns:
      A pytree like ``nnx.state(model)`` of :class:`jax.sharding.NamedSharding`.
    """
    from flax import nnx

    with nnx.logical_axis_rules(rules):
        specs = nnx.get_partition_spec(nnx.state(model))
    return jax.tree.map(lambda p: NamedSharding(mesh, p), specs)


def shard_model(model, mesh: Mesh, rules) -> object:
    """Move a model's variables to the layout of ``rules`` in place; returns the shardings."""
    from flax import nnx

    shardings = model_shardings(model, mesh, rules)
    nnx.update(model, jax.device_put(nnx.state(model), shardings))
    return shardings


def batch_sharding(mesh: Mesh, rules, rank: int = 2) -> NamedSharding:
    """Sharding of a ``[B, T, ...]`` input batch (tokens, targets) under ``rules``: B over the
    rules' ``"batch"`` axes, T over their ``"length"`` axis (context parallelism)."""
    rules = dict(rules)
    spec = (rules.get("batch"), rules.get("length"))[:rank]
    return NamedSharding(mesh, P(*spec, *([None] * (rank - len(spec)))))


def init_optimizer_state(tx: optax.GradientTransformation, params, mesh: Mesh | None):
    """A fresh ``tx`` state for ``params`` laid out as a jitted train step returns it: on
    ``mesh`` the moments like their parameters and the counters replicated; without a mesh on
    the device of the (committed) parameters. A step given this state compiles once, where a
    state from a bare ``jax.jit(tx.init)`` (counters on one device) makes the second step
    compile again for its inputs' new layout."""
    if mesh is None:
        device = next(iter(jax.tree.leaves(params)[0].devices()))
        layout = jax.sharding.SingleDeviceSharding(device)
    else:
        layout = optax.tree_map_params(
            tx,
            lambda _, p: p.sharding,
            jax.eval_shape(tx.init, params),
            params,
            transform_non_params=lambda _: NamedSharding(mesh, P()),
        )
    return jax.jit(tx.init, out_shardings=layout)(params)
