"""Sharding: the GDN ops per shard through ``shard_map``, context parallelism, model rules, meshes.

Pallas kernels are opaque to XLA's partitioner, so the ops run per shard inside
:func:`jax.shard_map`. Batch and head sharding need no communication; a sequence split over a
mesh axis (context parallelism) passes the recurrent state across the shards.

Modules, one job each:

- :mod:`~gdn_jax.sharding.config`: :class:`ShardingConfig`, how an op's tensors are laid out.
- :mod:`~gdn_jax.sharding.op_sharding`: :func:`shard_op`, :func:`shard_step` (``shard_map``).
- :mod:`~gdn_jax.sharding.context`: context parallelism (``"state_passing"``: segment maps and
  their prefix combine, reusable on one device; ``"all_to_all"``).
- :mod:`~gdn_jax.sharding.layouts`: layouts read off the inputs (:func:`implicit_config`,
  :func:`pallas_layout_error`, the sequence-axis checks).
- :mod:`~gdn_jax.sharding.explicit`: model pieces on Explicit mesh axes (projections, gathers).
- :mod:`~gdn_jax.sharding.mesh`: :func:`parse_mesh`, :func:`make_mesh`.
- :mod:`~gdn_jax.sharding.model_rules`: :func:`logical_axis_rules`, :func:`shard_model` and the
  other model layouts, :func:`init_optimizer_state`.

Example::

    mesh = make_mesh("data=2,tensor=2,context=2")
    cfg = ShardingConfig(mesh, batch="data", heads="tensor", context="context")
    op = shard_op(gdn_jax.gated_delta_rule, cfg)
    o, final = op(q, k, v, g, beta, initial_state=h0, output_final_state=True)

For the model, :func:`logical_axis_rules` maps the parameters' logical axis names to mesh axes for
data parallel (``data``), fully sharded data parallel (``fsdp``) and tensor parallel (``tensor``)
training; :func:`shard_model` places a model's variables accordingly.
"""

from gdn_jax.sharding.config import ShardingConfig
from gdn_jax.sharding.explicit import (
    explicit_axes_of,
    explicit_mesh,
    in_auto_axes,
    laid_out_like,
    projection_dot_general,
    projection_out_spec,
)
from gdn_jax.sharding.layouts import (
    check_sequence_layout,
    check_sequence_unsplit,
    implicit_config,
    input_layout,
    pallas_layout_error,
)
from gdn_jax.sharding.mesh import make_mesh, parse_mesh
from gdn_jax.sharding.model_rules import (
    batch_sharding,
    check_model_divisibility,
    init_optimizer_state,
    logical_axis_rules,
    model_core_sharding,
    model_shardings,
    shard_model,
)
from gdn_jax.sharding.op_sharding import shard_op, shard_step

# Also importable from here, outside __all__: the PartitionSpec-entry helper the models use, the
# default mesh axis names and the context-mode literals.
from gdn_jax.sharding._axes import AxisNames, _entry  # noqa: F401  # isort: skip
from gdn_jax.sharding.config import CONTEXT_MODES, ContextMode  # noqa: F401  # isort: skip
from gdn_jax.sharding.model_rules import CONTEXT, DATA, FSDP, TENSOR  # noqa: F401  # isort: skip

__all__ = [
    "ShardingConfig",
    "shard_op",
    "shard_step",
    "parse_mesh",
    "make_mesh",
    "logical_axis_rules",
    "model_core_sharding",
    "check_model_divisibility",
    "model_shardings",
    "shard_model",
    "batch_sharding",
    "init_optimizer_state",
    "input_layout",
    "implicit_config",
    "pallas_layout_error",
    "explicit_mesh",
    "explicit_axes_of",
    "projection_dot_general",
    "projection_out_spec",
    "in_auto_axes",
    "laid_out_like",
    "check_sequence_unsplit",
    "check_sequence_layout",
]
