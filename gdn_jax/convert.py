"""Hugging Face checkpoints <-> gdn_jax models.

Whole models: :func:`load_hf_model` reads a Qwen3.5 dense checkpoint (``Qwen3_5ForCausalLM`` or
``Qwen3_5ForConditionalGeneration``: ``config.json`` + safetensors) into a
:class:`gdn_jax.models.HybridLM` that computes what transformers computes, and
:func:`save_hf_model` writes one back (``Qwen3_5ForCausalLM`` names, loadable by transformers).
Every HF tensor maps to one or more of our parameters by a fixed rule (below); PyTorch
``Linear`` weights are ``[out, in]``, our kernels ``[in, out]`` (transposed).

HF key (under ``model.`` / ``model.language_model.``)  -> gdn_jax parameter
embed_tokens.weight [vocab, D]                  -> embed.embedding
layers.i.input_layernorm / post_attention_layernorm -> layers.i.input_norm / post_norm (1 + w)
layers.i.mlp.{gate,up,down}_proj.weight         -> layers.i.mlp.{gate,up,down}_proj.kernel
layers.i.self_attn.q_proj.weight [N·2·Dh, D]    -> mixer.q_proj and mixer.gate_proj kernels: each
                                                   head's 2·Dh rows are [query (Dh) | gate (Dh)]
layers.i.self_attn.{k,v,o}_proj.weight          -> mixer.{k,v,o}_proj.kernel
layers.i.self_attn.{q,k}_norm.weight [Dh]       -> mixer.{q,k}_norm.weight (1 + w)
layers.i.linear_attn.*                          -> mixer.* (the ``"qwen3_5"`` layout below)
norm.weight                                     -> norm.weight (1 + w)
lm_head.weight [vocab, D] (untied only)         -> lm_head.kernel

One layer: :func:`gated_deltanet_from_hf` builds a :class:`gdn_jax.nn.GatedDeltaNet` from one
HF decoder layer's ``linear_attn`` weights (Qwen3-Next or Qwen3.5; variant ``"gdn"``,
``use_qk_l2norm=True``).

HF key (layout)                   -> gdn_jax parameter
in_proj_qkvz.weight (qwen3_next)  -> q_proj, k_proj, v_proj, z_proj kernels; rows grouped per key
                                     head h: [q (K) | k (K) | v (r·V) | z (r·V)], r = HV / H
in_proj_ba.weight (qwen3_next)    -> b_proj, a_proj; rows per key head [b (r) | a (r)]
in_proj_qkv.weight (qwen3_5)      -> q_proj, k_proj, v_proj; rows [q (H·K) | k (H·K) | v (HV·V)]
in_proj_{z,b,a}.weight (qwen3_5)  -> z_proj, b_proj, a_proj
conv1d.weight [2·H·K + HV·V, 1, W] -> q_conv, k_conv, v_conv weights [W, C] (channels q | k | v)
A_log, dt_bias [HV]               -> A_log, dt_bias
norm.weight [V]                   -> norm.weight (gated RMSNorm, multiplies directly)
out_proj.weight [D, HV·V]         -> out_proj kernel
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.typing import Dtype

from gdn_jax.nn.gated_deltanet import GatedDeltaNet

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from gdn_jax.models import HybridConfig, HybridLM

__all__ = ["gated_deltanet_from_hf", "Layout", "load_hf_model", "save_hf_model", "hf_state_dict"]

logger = logging.getLogger(__name__)

Layout = Literal["qwen3_next", "qwen3_5"]

_KEYS = {
    "qwen3_next": ("in_proj_qkvz.weight", "in_proj_ba.weight"),
    "qwen3_5": ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"),
}
_COMMON_KEYS = ("conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight")


def _cfg(config: Any, name: str, default: Any = None) -> Any:
    value = (
        config.get(name, default) if isinstance(config, Mapping) else getattr(config, name, default)
    )
    if value is None:
        raise ValueError(f"config lacks {name!r}")
    return value


def _lookup(state_dict: Mapping[str, Any], name: str) -> np.ndarray:
    # Accept bare names ("A_log") and prefixed ones ("model.layers.0.linear_attn.A_log").
    hits = [k for k in state_dict if k == name or k.endswith("." + name)]
    if len(hits) != 1:
        raise ValueError(
            f"state_dict must hold exactly one key ending in {name!r}; found {hits or 'none'}"
        )
    return np.asarray(state_dict[hits[0]], dtype=np.float32)


def _expect(name: str, x: np.ndarray, shape: tuple[int, ...]) -> None:
    if x.shape != shape:
        raise ValueError(f"{name}: got shape {x.shape}, expected {shape} from the config")


def gated_deltanet_from_hf(
    state_dict: Mapping[str, Any],
    config: Any,
    *,
    layout: Layout,
    dtype: Dtype | None = None,
    param_dtype: Dtype = jnp.float32,
    chunk_size: int = 64,
    implementation: str | tuple[str, ...] | None = None,
) -> GatedDeltaNet:
    """Build a ``GatedDeltaNet`` from one HF layer's ``linear_attn`` weights.

    Args:
      state_dict: numpy arrays (or anything ``np.asarray`` takes) keyed by HF names, bare
        (``"in_proj_qkvz.weight"``) or with a prefix (``"model.layers.0.linear_attn.A_log"``).
      config: the HF text config, as a mapping or an object with attributes ``hidden_size``,
        ``linear_num_key_heads``, ``linear_num_value_heads``, ``linear_key_head_dim``,
        ``linear_value_head_dim``, ``linear_conv_kernel_dim`` (default 4), ``rms_norm_eps``
        (default 1e-6).
      layout: ``"qwen3_next"`` (fused ``in_proj_qkvz`` / ``in_proj_ba``, interleaved per key-head
        group) or ``"qwen3_5"`` (separate ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
        ``in_proj_a``).
      dtype, param_dtype, chunk_size, implementation: as for :class:`GatedDeltaNet`.
    Returns:
      The layer with the HF weights.
    """
    if layout not in _KEYS:
        raise ValueError(f"{layout=}: expected one of {tuple(_KEYS)}")
    D = int(_cfg(config, "hidden_size"))
    H = int(_cfg(config, "linear_num_key_heads"))
    HV = int(_cfg(config, "linear_num_value_heads"))
    K = int(_cfg(config, "linear_key_head_dim"))
    V = int(_cfg(config, "linear_value_head_dim"))
    W = int(_cfg(config, "linear_conv_kernel_dim", 4))
    eps = float(_cfg(config, "rms_norm_eps", 1e-6))
    if HV % H:
        raise ValueError(f"linear_num_value_heads={HV} must be a multiple of {H=}")
    r = HV // H
    sd = {name: _lookup(state_dict, name) for name in _KEYS[layout] + _COMMON_KEYS}
    rules = {rule.key: rule for rule in _linear_attn_rules("", (), D=D, H=H, HV=HV, K=K, V=V, W=W)}
    pure: dict[Path_, np.ndarray] = {}
    if layout == "qwen3_next":
        qkvz = sd["in_proj_qkvz.weight"]
        _expect("in_proj_qkvz.weight", qkvz, (H * (2 * K + 2 * r * V), D))
        qkvz = qkvz.reshape(H, 2 * K + 2 * r * V, D)
        q, k, v, z = np.split(qkvz, [K, 2 * K, 2 * K + r * V], axis=1)
        # Within a key head, value heads j = 0..r-1 are consecutive: global value head h * r + j.
        q, k = q.reshape(H * K, D), k.reshape(H * K, D)
        v, z = v.reshape(HV * V, D), z.reshape(HV * V, D)
        ba = sd["in_proj_ba.weight"]
        _expect("in_proj_ba.weight", ba, (2 * HV, D))
        b, a = np.split(ba.reshape(H, 2 * r, D), [r], axis=1)
        b, a = b.reshape(HV, D), a.reshape(HV, D)
        # The same tensors the qwen3_5 layout stores separately.
        sd["in_proj_qkv.weight"] = np.concatenate([q, k, v])
        sd["in_proj_z.weight"], sd["in_proj_b.weight"] = z, b
        sd["in_proj_a.weight"] = a
    for name, rule in rules.items():
        _expect(name, sd[name], rule.shape)
        pure.update(zip(rule.targets, rule.split(sd[name]), strict=True))

    # Build abstractly (no random init of weights we overwrite), then fill in the HF values.
    abstract = nnx.eval_shape(
        lambda: GatedDeltaNet(
            D,
            num_heads=H,
            head_dim=K,
            num_v_heads=HV,
            v_head_dim=V,
            variant="gdn",
            conv_kernel=W,
            norm_eps=eps,
            use_qk_l2norm=True,
            chunk_size=chunk_size,
            implementation=implementation,
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=nnx.Rngs(0),
        )
    )
    graphdef, state = nnx.split(abstract)
    pure = {p: jnp.asarray(x, param_dtype) for p, x in pure.items()}
    nnx.replace_by_pure_dict(state, nnx.traversals.unflatten_mapping(pure))
    return nnx.merge(graphdef, state)


# --------------------------------------------------------------------------------------------
# Whole models: the tensor rules shared by the loader and the saver
# --------------------------------------------------------------------------------------------

Path_ = tuple[str | int, ...]  # a parameter's path in nnx.state(model)


@dataclasses.dataclass(frozen=True)
class _Rule:
    """One HF tensor and the parameters it becomes.

    ``split`` maps the HF array to the targets' arrays (in ``targets`` order); ``merge`` is its
    inverse. Both only reshape, transpose and slice, so a round trip is bitwise.
    """

    key: str
    shape: tuple[int, ...]
    targets: tuple[Path_, ...]
    split: Callable[[np.ndarray], tuple[np.ndarray, ...]]
    merge: Callable[[tuple[np.ndarray, ...]], np.ndarray]


def _same(key, shape, target) -> _Rule:
    return _Rule(key, shape, (target,), lambda a: (a,), lambda xs: xs[0])


def _linear(key, shape, target) -> _Rule:
    # HF Linear [out, in] <-> our kernel [in, out].
    return _Rule(key, shape, (target,), lambda a: (a.T,), lambda xs: xs[0].T)


def _rows(key, shape, targets, sizes) -> _Rule:
    # A Linear whose output rows are several of our projections, one after the other.
    cuts = np.cumsum(sizes)[:-1]
    return _Rule(
        key,
        shape,
        tuple(targets),
        lambda a: tuple(x.T for x in np.split(a, cuts, axis=0)),
        lambda xs: np.concatenate([x.T for x in xs], axis=0),
    )


def _query_gate(key, shape, targets, N, Dh) -> _Rule:
    # Qwen3.5 attention q_proj: per head, 2·Dh rows [query | output gate].
    D = shape[1]

    def split(a):
        a = a.reshape(N, 2, Dh, D)
        return a[:, 0].reshape(N * Dh, D).T, a[:, 1].reshape(N * Dh, D).T

    def merge(xs):
        q, g = (x.T.reshape(N, Dh, D) for x in xs)
        return np.stack([q, g], axis=1).reshape(2 * N * Dh, D)

    return _Rule(key, shape, tuple(targets), split, merge)


def _conv(key, shape, targets, sizes) -> _Rule:
    # Depthwise Conv1d weight [C, 1, W] <-> our ShortConv weights [W, C_i], channels q | k | v.
    cuts = np.cumsum(sizes)[:-1]
    return _Rule(
        key,
        shape,
        tuple(targets),
        lambda a: tuple(np.split(a[:, 0, :].T, cuts, axis=1)),
        lambda xs: np.concatenate(xs, axis=1).T[:, None, :],
    )


def _linear_attn_rules(
    prefix: str, target: Path_, *, D: int, H: int, HV: int, K: int, V: int, W: int
) -> list[_Rule]:
    """Rules of one Qwen3.5 ``linear_attn`` module (the ``"qwen3_5"`` layout)."""
    t = lambda *names: (*target, *names)
    qk, v = H * K, HV * V
    return [
        _rows(
            prefix + "in_proj_qkv.weight",
            (2 * qk + v, D),
            [t("q_proj", "kernel"), t("k_proj", "kernel"), t("v_proj", "kernel")],
            [qk, qk, v],
        ),
        _linear(prefix + "in_proj_z.weight", (v, D), t("z_proj", "kernel")),
        _linear(prefix + "in_proj_b.weight", (HV, D), t("b_proj", "kernel")),
        _linear(prefix + "in_proj_a.weight", (HV, D), t("a_proj", "kernel")),
        _conv(
            prefix + "conv1d.weight",
            (2 * qk + v, 1, W),
            [t("q_conv", "weight"), t("k_conv", "weight"), t("v_conv", "weight")],
            [qk, qk, v],
        ),
        _same(prefix + "A_log", (HV,), t("A_log")),
        _same(prefix + "dt_bias", (HV,), t("dt_bias")),
        _same(prefix + "norm.weight", (V,), t("norm", "weight")),
        _linear(prefix + "out_proj.weight", (D, v), t("out_proj", "kernel")),
    ]


def _model_rules(c: HybridConfig, body: str) -> list[_Rule]:
    """Every tensor of a Qwen3.5 text model with config ``c``; ``body`` prefixes the decoder's
    keys (``"model."`` or ``"model.language_model."``; ``lm_head`` is top-level in both)."""
    D, I, Vocab = c.hidden_size, c.intermediate_size, c.vocab_size
    N, NKV, Dh = c.attn_num_heads, c.attn_num_kv_heads, c.attn_head_dim
    rules = [_same(body + "embed_tokens.weight", (Vocab, D), ("embed", "embedding"))]
    for i, kind in enumerate(c.layer_types):
        pre, tgt = f"{body}layers.{i}.", ("layers", i)
        rules.append(_same(pre + "input_layernorm.weight", (D,), (*tgt, "input_norm", "weight")))
        if kind == "attention":
            a, m = pre + "self_attn.", (*tgt, "mixer")
            rules += [
                _query_gate(
                    a + "q_proj.weight",
                    (2 * N * Dh, D),
                    [(*m, "q_proj", "kernel"), (*m, "gate_proj", "kernel")],
                    N,
                    Dh,
                ),
                _linear(a + "k_proj.weight", (NKV * Dh, D), (*m, "k_proj", "kernel")),
                _linear(a + "v_proj.weight", (NKV * Dh, D), (*m, "v_proj", "kernel")),
                _linear(a + "o_proj.weight", (D, N * Dh), (*m, "o_proj", "kernel")),
                _same(a + "q_norm.weight", (Dh,), (*m, "q_norm", "weight")),
                _same(a + "k_norm.weight", (Dh,), (*m, "k_norm", "weight")),
            ]
        else:
            rules += _linear_attn_rules(
                pre + "linear_attn.",
                (*tgt, "mixer"),
                D=D,
                H=c.linear_num_heads,
                HV=c.linear_num_v_heads,
                K=c.linear_head_dim,
                V=c.linear_v_head_dim,
                W=c.conv_kernel,
            )
        rules.append(
            _same(pre + "post_attention_layernorm.weight", (D,), (*tgt, "post_norm", "weight"))
        )
        for name, shape in (("gate_proj", (I, D)), ("up_proj", (I, D)), ("down_proj", (D, I))):
            rules.append(_linear(f"{pre}mlp.{name}.weight", shape, (*tgt, "mlp", name, "kernel")))
    rules.append(_same(body + "norm.weight", (D,), ("norm", "weight")))
    if not c.tie_embeddings:
        rules.append(_linear("lm_head.weight", (Vocab, D), ("lm_head", "kernel")))
    return rules


# Checkpoint tensors that are not part of the text model: loaded by neither kind here (HF's
# Qwen3_5ForCausalLM ignores them too).
_SKIPPED_PREFIXES = {"model.visual.": "vision-tower", "mtp.": "multi-token-prediction"}
_BODY = {"qwen3_5_text": "model.", "qwen3_5": "model.language_model."}


# --------------------------------------------------------------------------------------------
# Safetensors I/O
# --------------------------------------------------------------------------------------------


class _Checkpoint:
    """The tensors of a HF model directory: ``model.safetensors`` or a sharded index; each
    tensor is read on request (safetensors, numpy API), never the whole checkpoint at once."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self._safe_open = safe_open
        index, single = path / "model.safetensors.index.json", path / "model.safetensors"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {k: path / f for k, f in weight_map.items()}
        elif single.is_file():
            self.files = None
            self._single = single
        else:
            raise ValueError(
                f"path={str(path)!r} has neither model.safetensors nor model.safetensors.index.json"
            )
        self._open: dict[Path, Any] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for file in sorted(set(self.files.values())) if self.files else [self._single]:
            if not file.is_file():
                raise ValueError(f"{file.name} (named by the index) is missing from {path}")
            handle = self._handle(file)
            for key in handle.keys():
                if self.files is None or self.files.get(key) == file:
                    self.shapes[key] = tuple(handle.get_slice(key).get_shape())
        if self.files is not None:
            absent = [k for k in self.files if k not in self.shapes]
            if absent:
                raise ValueError(f"index names tensors absent from their files: {absent[:5]}")

    def _handle(self, file: Path):
        if file not in self._open:
            self._open[file] = self._safe_open(str(file), framework="np")
        return self._open[file]

    def read(self, key: str) -> np.ndarray:
        file = self._single if self.files is None else self.files[key]
        return self._handle(file).get_tensor(key)

    def close(self) -> None:
        for h in self._open.values():
            exit_ = getattr(h, "__exit__", None)
            if exit_ is not None:
                exit_(None, None, None)
        self._open.clear()


def _read_config(path: Path) -> dict[str, Any]:
    file = path / "config.json"
    if not file.is_file():
        raise ValueError(f"path={str(path)!r} has no config.json")
    return json.loads(file.read_text())


def _check_tensors(ckpt: _Checkpoint, rules: list[_Rule], tie: bool, body: str) -> list[str]:
    """Raise ValueError for missing, unexpected or mis-shaped tensors; returns skipped keys."""
    want = {r.key: r.shape for r in rules}
    missing = [(k, s) for k, s in want.items() if k not in ckpt.shapes]
    if missing:
        k, s = missing[0]
        raise ValueError(
            f"checkpoint lacks tensor {k!r}; expected shape {s}{_more([m[0] for m in missing])}"
        )
    bad = [(k, ckpt.shapes[k], s) for k, s in want.items() if ckpt.shapes[k] != s]
    if bad:
        k, got, s = bad[0]
        raise ValueError(
            f"tensor {k!r} has shape {got}; expected {s} from config.json"
            + _more([b[0] for b in bad])
        )
    skipped, extra = [], []
    for k, shape in ckpt.shapes.items():
        if k in want:
            continue
        if any(k.startswith(p) for p in _SKIPPED_PREFIXES):
            skipped.append(k)
        elif tie and k == "lm_head.weight" and shape == want[body + "embed_tokens.weight"]:
            skipped.append(k)  # checked equal to the embedding after reading
        else:
            extra.append((k, shape))
    if extra:
        k, shape = extra[0]
        raise ValueError(
            f"checkpoint has tensor {k!r} of shape {shape} that the config does not expect"
            + _more([e[0] for e in extra])
        )
    return skipped


def _more(keys: list[str]) -> str:
    return f" (and {len(keys) - 1} more: {keys[1:4]})" if len(keys) > 1 else ""


def _log_skipped(skipped: list[str]) -> None:
    if not skipped:
        return
    counts: dict[str, int] = {}
    for k in skipped:
        what = next((w for p, w in _SKIPPED_PREFIXES.items() if k.startswith(p)), "tied lm_head")
        counts[what] = counts.get(what, 0) + 1
    parts = ", ".join(f"{n} {what} tensors" for what, n in counts.items())
    logger.warning("load_hf_model: skipping %s (not part of the text model)", parts)


# --------------------------------------------------------------------------------------------
# Loader and saver
# --------------------------------------------------------------------------------------------


def load_hf_model(
    path: str | os.PathLike,
    *,
    dtype: Dtype | None = None,
    param_dtype: Dtype = jnp.float32,
    mesh: Mesh | None = None,
    implementation: str | tuple[str, ...] | None = None,
) -> HybridLM:
    """Load a Hugging Face Qwen3.5 dense checkpoint as a :class:`gdn_jax.models.HybridLM`.

    ``path`` holds ``config.json`` and ``model.safetensors`` (or a sharded
    ``model.safetensors.index.json``) of a ``Qwen3_5ForCausalLM`` (``model_type``
    ``"qwen3_5_text"``) or a ``Qwen3_5ForConditionalGeneration`` (``"qwen3_5"``: the text model
    under ``model.language_model.*``; its vision tower and ``mtp.*`` tensors are skipped, which
    is logged once). Tensors are read one at a time, cast to ``param_dtype`` and placed: with
    ``mesh``, each directly onto its ``NamedSharding`` from
    :func:`gdn_jax.sharding.logical_axis_rules` (each device receives only its shard), and the
    GDN cores run per shard (:func:`gdn_jax.sharding.model_core_sharding`).

    The model's features are set afterwards as for any HybridLM: FP8 projections with
    :func:`gdn_jax.fp8.convert_projections`, QAT per layer (``layer.mixer.qat``), remat/offload
    policies (``model.remat_policies`` or ``hidden(..., remat_policies=...)``).

    Args:
      path: the model directory.
      dtype: compute dtype (e.g. ``jnp.bfloat16``); None: inferred from the parameters.
      param_dtype: parameter dtype.
      mesh: optional device mesh (axes named as in :mod:`gdn_jax.sharding`: data, fsdp,
        tensor, context).
      implementation: GDN core implementation (``None``: Pallas on Hopper, XLA elsewhere).
    Returns:
      The model.
    Raises:
      NotImplementedError: MoE checkpoints (``qwen3_5_moe``, ``qwen3_next``) and config
        options the model does not implement (see :meth:`HybridConfig.from_hf`).
      ValueError: a missing, unexpected or mis-shaped tensor (naming the key, its shape and
        the expected shape), a missing file, or a mesh that does not divide the heads.
    """
    from gdn_jax import sharding as sharding_lib
    from gdn_jax.models import HybridConfig, HybridLM
    from gdn_jax.models._hf_config import text_config

    path = Path(path)
    hf = _read_config(path)
    _, kind = text_config(hf)  # raises for MoE / unknown model types
    config = HybridConfig.from_hf(hf)
    body = _BODY[kind]
    rules = _model_rules(config, body)
    ckpt = _Checkpoint(path)
    try:
        skipped = _check_tensors(ckpt, rules, config.tie_embeddings, body)
        _log_skipped(skipped)
        core = None
        if mesh is not None:
            sharding_lib.check_model_divisibility(config, mesh)
            core = sharding_lib.model_core_sharding(mesh)
        abstract = nnx.eval_shape(
            lambda: HybridLM(
                config,
                implementation=implementation,
                sharding=core,
                dtype=dtype,
                param_dtype=param_dtype,
                rngs=nnx.Rngs(0),
            )
        )
        graphdef, params = nnx.split(abstract, nnx.Param)
        slots = {tuple(p): v for p, v in nnx.to_flat_state(params)}
        shardings = {}
        if mesh is not None:
            rules_ = sharding_lib.logical_axis_rules(mesh)
            flat = nnx.to_flat_state(sharding_lib.model_shardings(abstract, mesh, rules_))
            shardings = {
                tuple(p): s.get_value() if isinstance(s, nnx.Variable) else s for p, s in flat
            }
        values: dict[Path_, jax.Array] = {}
        for rule in rules:
            pieces = rule.split(ckpt.read(rule.key))
            for target, x in zip(rule.targets, pieces, strict=True):
                slot = slots.get(target)
                if slot is None or tuple(slot.shape) != x.shape:
                    raise RuntimeError(f"internal: {rule.key} -> {target} {x.shape} mismatch")
                values[target] = _place(x, slot.dtype, shardings.get(target))
        if "lm_head.weight" in skipped:
            embed = ckpt.read(body + "embed_tokens.weight")
            if not np.array_equal(ckpt.read("lm_head.weight"), embed):
                raise ValueError(
                    "tie_word_embeddings=True but the checkpoint's 'lm_head.weight' differs "
                    "from the embedding"
                )
    finally:
        ckpt.close()
    unfilled = set(slots) - set(values)
    if unfilled:
        raise RuntimeError(f"internal: parameters without an HF tensor: {sorted(unfilled)[:5]}")
    nnx.replace_by_pure_dict(params, nnx.traversals.unflatten_mapping(values))
    return nnx.merge(graphdef, params)


def _place(x: np.ndarray, dtype, sharding) -> jax.Array:
    """A host array as a device array of ``dtype``; with a sharding, each device gets (and the
    host converts) only its own slice."""
    dtype = np.dtype(dtype)
    if sharding is None:
        return jnp.asarray(np.asarray(x, dtype))
    return jax.make_array_from_callback(
        x.shape, sharding, lambda index: np.ascontiguousarray(x[index], dtype)
    )


def _hf_tensor(rule: _Rule, flat: dict, dtype) -> np.ndarray:
    parts = tuple(np.asarray(jax.device_get(flat[t][...])) for t in rule.targets)
    x = rule.merge(parts)
    dtype = np.dtype(flat[rule.targets[0]].dtype if dtype is None else dtype)
    return np.ascontiguousarray(x.astype(dtype, copy=False))


def _flat_params(model) -> dict:
    return {tuple(p): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def hf_state_dict(
    model: HybridLM, *, dtype: Dtype | None = None
) -> Iterator[tuple[str, np.ndarray]]:
    """The model's tensors under ``Qwen3_5ForCausalLM`` names, one at a time.

    Args:
      model: a HybridLM whose config has a Qwen3.5 equivalent (``HybridConfig.to_hf``).
      dtype: cast every tensor to this dtype; None keeps each parameter's dtype.
    Yields:
      ``(key, array)`` with HF's shapes (host numpy arrays, C-contiguous).
    """
    config = model.config
    config.to_hf()  # raises NotImplementedError for configs transformers cannot express
    flat = _flat_params(model)
    for rule in _model_rules(config, _BODY["qwen3_5_text"]):
        yield rule.key, _hf_tensor(rule, flat, dtype)


def save_hf_model(
    model: HybridLM,
    path: str | os.PathLike,
    *,
    dtype: Dtype | None = None,
    max_shard_bytes: int = 5 * 10**9,
) -> None:
    """Write ``model`` as a Hugging Face ``Qwen3_5ForCausalLM`` checkpoint.

    ``path`` receives ``config.json`` and ``model.safetensors``, or, above ``max_shard_bytes``,
    ``model-0000i-of-0000n.safetensors`` shards with ``model.safetensors.index.json`` (earlier
    ``model*.safetensors`` files there are removed first). Loading a checkpoint and saving it in
    its own dtype reproduces every text-model tensor bitwise (under ``Qwen3_5ForCausalLM``
    names, also for a ``Qwen3_5ForConditionalGeneration`` source). Parameters are gathered to
    the host one tensor at a time (single-process).

    Args:
      model: a HybridLM with a Qwen3.5 config (``zero_centered_norm=True``, variant "gdn").
      path: output directory (created if needed).
      dtype: dtype of the saved tensors; None keeps each parameter's dtype.
      max_shard_bytes: largest shard file before the checkpoint is split.
    Raises:
      NotImplementedError: the config has no Qwen3.5 equivalent.
      ValueError: ``max_shard_bytes`` is not positive.
    """
    from safetensors.numpy import save_file

    if max_shard_bytes <= 0:
        raise ValueError(f"{max_shard_bytes=} must be positive")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = model.config
    hf = config.to_hf()
    rules = _model_rules(config, _BODY["qwen3_5_text"])
    flat = _flat_params(model)

    def out_dtype(rule):
        return np.dtype(dtype) if dtype is not None else np.dtype(flat[rule.targets[0]].dtype)

    # Assign tensors to shards by size first, so file names can say "-of-n".
    shards: list[list[_Rule]] = [[]]
    size = 0
    for rule in rules:
        nbytes = math.prod(rule.shape) * out_dtype(rule).itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(rule)
        size += nbytes
    for old in list(path.glob("model*.safetensors")) + [path / "model.safetensors.index.json"]:
        if old.exists():
            old.unlink()
    n = len(shards)
    names = (
        ["model.safetensors"]
        if n == 1
        else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    weight_map, total = {}, 0
    for name, shard in zip(names, shards, strict=True):
        tensors = {}
        for rule in shard:
            x = tensors[rule.key] = _hf_tensor(rule, flat, dtype)
            weight_map[rule.key] = name
            total += x.nbytes
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        del tensors
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    dtypes = {out_dtype(r).name for r in rules}
    hf["dtype"] = dtypes.pop() if len(dtypes) == 1 else "float32"
    (path / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
