"""The two references that define the maths: token recurrence (oracle) and chunked form."""

from gdn_jax.reference.chunked import chunk_gated_delta_rule, chunk_gdn2, chunk_kda
from gdn_jax.reference.recurrent import recurrent_gated_delta_rule, recurrent_gdn2, recurrent_kda

__all__ = [
    "chunk_gated_delta_rule",
    "chunk_gdn2",
    "chunk_kda",
    "recurrent_gated_delta_rule",
    "recurrent_gdn2",
    "recurrent_kda",
]
