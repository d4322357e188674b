"""How an op's tensors are laid out on a mesh: :class:`ShardingConfig`."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from gdn_jax.sharding._axes import AxisNames, _as_tuple, _entry

__all__ = ["CONTEXT_MODES", "ContextMode", "ShardingConfig"]

ContextMode = Literal["all_to_all", "state_passing"]
CONTEXT_MODES = ("all_to_all", "state_passing")


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    """How an op's tensors are laid out on a mesh.

    Attributes:
      mesh: the device mesh.
      batch: mesh axes that split the batch dimension B (major to minor), e.g. ``("data", "fsdp")``.
      heads: mesh axes that split the head dimensions: q/k heads H and value heads HV by the same
        factor, so a GVA group (value heads ``r·j … r·j + r − 1`` reading q/k head ``j``) stays on
        one shard.
      context: a mesh axis that splits the sequence dimension T, or None.
      context_mode: ``"state_passing"`` (default; any head count) or ``"all_to_all"`` (needs H and
        HV divisible by the head shards times the context shards).
      rerun: state passing only. True (default): rerun the op from each shard's true initial
        state (three op calls per shard: the zero-start one, the K-channel one that gives the
        state map, the rerun). False: add the initial state's contribution to the zero-start
        output as a linear correction instead (two calls; the correction's operand is the op's
        output in the io dtype, so bf16/f16 inputs are rounded once more).
    """

    mesh: Mesh
    batch: AxisNames = None
    heads: AxisNames = None
    context: str | None = None
    context_mode: ContextMode = "state_passing"
    rerun: bool = True

    def __post_init__(self):
        object.__setattr__(self, "batch", _as_tuple(self.batch))
        object.__setattr__(self, "heads", _as_tuple(self.heads))
        used = list(self.batch) + list(self.heads) + ([self.context] if self.context else [])
        for a in used:
            if a not in self.mesh.axis_names:
                raise ValueError(
                    f"mesh axis {a!r} is not in the mesh (axes {self.mesh.axis_names}, "
                    f"shape {dict(self.mesh.shape)})"
                )
        if len(set(used)) != len(used):
            raise ValueError(f"a mesh axis is used twice: batch={self.batch}, "
                             f"heads={self.heads}, context={self.context!r}")  # fmt: skip
        if self.context_mode not in CONTEXT_MODES:
            raise ValueError(f"context_mode={self.context_mode!r}: expected one of {CONTEXT_MODES}")

    def size(self, axes: AxisNames) -> int:
        """Number of shards along ``axes`` (1 for none)."""
        return math.prod(self.mesh.shape[a] for a in _as_tuple(axes))

    @property
    def context_size(self) -> int:
        return self.size(self.context)

    def _cp(self) -> bool:
        # A context axis of size 1 is no context parallelism; skip the collectives.
        return self.context is not None and self.context_size > 1

    def token_spec(self, rank: int) -> P:
        """Spec of a ``[B, T, heads, ...]`` tensor of the given rank (inputs and output)."""
        ctx = self.context if self._cp() else None
        return P(_entry(self.batch), ctx, _entry(self.heads), *([None] * (rank - 3)))

    def state_spec(self) -> P:
        """Spec of an ``[N, HV, K, V]`` state (as passed in and returned)."""
        heads = self.heads
        if self._cp() and self.context_mode == "all_to_all":
            # Each context shard ends up owning a slice of its head shard's heads.
            heads = heads + (self.context,)
        return P(_entry(self.batch), _entry(heads), None, None)
