"""``implementation="xla"``: the chunked stages of ``gdn_jax.reference.chunked`` under a
``custom_vjp`` whose backward keeps only the inputs, the chunk-local gate cumsum, A and one state
per chunk (memory O(T·(K+V+C)) + O(T/C·K·V)), and recomputes the rest.

Backward plan (research/algorithms.md §1.4, restated for our stages):
1. recompute w, u from the saved A, and v_new = u − w S_in from the saved chunk states;
2. reverse recurrence for dS, the gradient of the state entering each chunk:
   dv_new = scale·Pᵀ do + k_dec dS_out,  dS_in = scale (q e^G)ᵀ do + e^{G_last} dS_out − wᵀ dv_new;
   With QAT the saved states are the fake-quantised ones and the sites pass gradients straight
   through, so the same formulas hold;
3. every chunk's input gradients by the VJP of the chunk-local map
   (q, k, v, g, b, w) ↦ (o, S_out) with S_in held fixed, all chunks at once.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from gdn_jax import remat
from gdn_jax.qat import QATConfig
from gdn_jax.reference import chunked as ref
from gdn_jax.reference._common import ChunkLayout, from_chunks

f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class ChunkConfig:
    """Static configuration of one chunked call.

    Attributes:
      scale: query scale.
      dtype: name of the io dtype (operand dtype of the state/v_new products).
      qat: optional fake quantisation of w and the chunk-entering states.
    """

    scale: float
    dtype: str
    qat: QATConfig | None = None

    def __post_init__(self):
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(
                f"ChunkConfig.dtype must be bfloat16, float16 or float32; got {self.dtype}"
            )


def _local(cfg: ChunkConfig, q, k, v, g, b, w, S_in):
    """Chunk-local map with the entering state given: (o, S_out), all chunks in parallel."""
    G = ref.gate_cumsum(g)
    _, wk, u = ref.intra_chunk(k, v, b, w, G, dtype=cfg.dtype)
    if cfg.qat is not None:
        wk = cfg.qat.quantize_w(wk)
    kdec, decay_last = ref.decayed_keys(k, G)
    v_new = u - ref.mm("...chk,...hkv->...chv", wk, S_in, cfg.dtype)
    S_out = decay_last[..., None] * S_in + ref.mm("...chk,...chv->...hkv", kdec, v_new, cfg.dtype)
    o = ref.chunk_output(q, k, G, S_in, v_new, scale=cfg.scale, dtype=cfg.dtype)
    return o, S_out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def chunked_core(cfg: ChunkConfig, q, k, v, g, b, w, h0, layout: ChunkLayout):
    """Chunked forward on chunked tensors.

    Args:
      q, k: [L, NC, C, HV, K]; v: [L, NC, C, HV, V]; g: [L, NC, C, HV, Kg] f32;
      b: [L, NC, C, HV, Kb] f32; w: [L, NC, C, HV, Vw] f32; h0: [N, HV, K, V] f32.
    Returns:
      o [L, NC, C, HV, V] f32, final state [N, HV, K, V] f32.
    """
    o, final, _ = ref.chunk_forward(
        q, k, v, g, b, w, h0, layout, scale=cfg.scale, dtype=cfg.dtype, qat=cfg.qat
    )
    return o, final


def _fwd(cfg, q, k, v, g, b, w, h0, layout):
    o, final, (G, A, S_in) = ref.chunk_forward(
        q, k, v, g, b, w, h0, layout, scale=cfg.scale, dtype=cfg.dtype, qat=cfg.qat
    )
    G = remat.name(G, remat.GDN_GATE_CUMSUM)
    A = remat.name(A, remat.GDN_A)
    S_in = remat.name(S_in, remat.GDN_CHUNK_STATES)
    return (o, final), (q, k, v, g, b, w, h0, layout, G, A, S_in)


def _bwd(cfg, res, cts):
    q, k, v, g, b, w, h0, layout, G, A, S_in = res
    do, dfinal = cts
    do = do.astype(f32)
    dfinal = dfinal.astype(f32)
    N = h0.shape[0]
    bk = b * k.astype(f32)
    wk = ref.mm("...hij,...jhk->...ihk", A, bk * jnp.exp(G))
    if cfg.qat is not None:
        wk = cfg.qat.quantize_w(wk)
    kdec, decay_last = ref.decayed_keys(k, G)
    # Output-side cotangents that do not depend on later chunks.
    qg = q.astype(f32) * jnp.exp(G)
    dS_local = cfg.scale * ref.mm("...chk,...chv->...hkv", qg, do)
    P = ref.pairwise_decay(q, k, G, strict=False, dtype=cfg.dtype)
    dvn_local = cfg.scale * ref.mm("...hij,...ihv->...jhv", P, do)

    dfinal_x = jnp.concatenate([dfinal, jnp.zeros_like(dfinal[:1])])

    def body(dS_next, x):
        dS_loc, dvn_loc, kdec_c, wk_c, dl_c, last_c, seq_c = x
        dS_out = jnp.where(last_c[:, None, None, None], dfinal_x[seq_c], dS_next)
        dvn = dvn_loc + ref.mm("lchk,lhkv->lchv", kdec_c, dS_out)
        dS_in = dS_loc + dl_c[..., None] * dS_out - ref.mm("lchk,lchv->lhkv", wk_c, dvn)
        return dS_in, (dS_out, dS_in)

    xs = (dS_local, dvn_local, kdec, wk, decay_last, layout.last, layout.seq)
    xs = tuple(jnp.swapaxes(x, 0, 1) for x in xs)
    dS0 = jnp.zeros((q.shape[0],) + h0.shape[1:], f32)
    _, (dS_out, dS_in) = jax.lax.scan(body, dS0, xs, reverse=True)
    dS_out, dS_in = (jnp.swapaxes(x, 0, 1) for x in (dS_out, dS_in))

    idx = jnp.where(layout.first, layout.seq, N).reshape(-1)
    dh0 = jnp.zeros((N + 1,) + h0.shape[1:], f32).at[idx].add(dS_in.reshape((-1,) + h0.shape[1:]))
    dh0 = jnp.where(layout.empty[:, None, None, None], dfinal, dh0[:N])

    _, vjp = jax.vjp(lambda *a: _local(cfg, *a, S_in), q, k, v, g, b, w)
    dq, dk, dv, dg, db, dw = vjp((do, dS_out))
    return dq, dk, dv, dg, db, dw, dh0, None


# No optimize_remat: it would wrap the forward in one opaque primitive and hide the residuals'
# checkpoint names from remat/offload policies (they would recompute the whole core instead).
chunked_core.defvjp(_fwd, _bwd)


def chunked(
    q, k, v, g, b, w, *, scale, initial_state, use_qk_l2norm, cu_seqlens, chunk_size, qat=None
):
    """The xla implementation on public layouts (validated, gates with trailing axes).

    Args:
      q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, Kg]; b: [B, T, HV, Kb];
      w: [B, T, HV, Vw]; initial_state: [N, HV, K, V] f32 or None; cu_seqlens: [N + 1] or None.
    Returns:
      o [B, T, HV, V] in v.dtype, final state [N, HV, K, V] f32.
    """
    B, T = q.shape[:2]
    chunks, h0, layout = ref.prepare(
        q, k, v, g, b, w, initial_state, use_qk_l2norm, cu_seqlens, chunk_size
    )
    cfg = ChunkConfig(scale=float(scale), dtype=jnp.dtype(v.dtype).name, qat=qat)
    o, final = chunked_core(cfg, *chunks, h0, layout)
    return from_chunks(o, layout, B, T).astype(v.dtype), final
