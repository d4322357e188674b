"""Names of the tensors that remat/offload policies can save, offload or recompute.

Every residual of the GDN core and the layer's main activations is wrapped in
``jax.ad_checkpoint.checkpoint_name(x, NAME)`` with one of these constants.
"""

from __future__ import annotations

# Residuals of the chunked core's backward (DESIGN §4).
GDN_GATE_CUMSUM = "gdn_gate_cumsum"  # chunk-local cumulative log-decay, f32
GDN_A = "gdn_A"  # (I + strict_tril(β K Kᵀ ⊙ decay))⁻¹ per chunk
GDN_CHUNK_STATES = "gdn_chunk_states"  # state entering each chunk, f32 [.., HV, K, V]

CORE_RESIDUALS = (GDN_GATE_CUMSUM, GDN_A, GDN_CHUNK_STATES)
