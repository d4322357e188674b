"""Quantization-aware training: FP8 fake quantisation inside the chunked GDN path.

Projection quantisation never sees two tensors that an FP8 GDN inference kernel rounds: the
recurrent state entering each chunk (used by that chunk's output and update) and the WY
activation ``w = A (β e^G k)``. :class:`QATConfig` turns on dynamic FP8-E4M3 quantise-dequantise
at those sites (scale from the current amax), with an identity straight-through gradient.
:class:`QATPolicy` selects modules by name patterns (last match wins) and is stored with the
model's checkpoint (:func:`save_policy` / :func:`load_policy`);
:func:`gdn_jax.nn.apply_qat_policy` sets it on every GDN layer of a model. This module imports
nothing from the layers or ops that use it.

Scale granularity (chosen so that a kernel that splits V across thread blocks can fuse it):
- state: ``"column"`` one scale per value column (amax over K), or ``"matrix"`` one per K×V state
  of each sequence and head;
- w: ``"row"`` one scale per token row (amax over K), or ``"tile"`` one per chunk and head (C×K).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import json
import pathlib

import jax
import jax.numpy as jnp

from gdn_jax.reference._common import cast_round_trip
from pallas_kernels.gdn.fake_quant import AMAX_FLOOR

__all__ = [
    "SITES",
    "QATConfig",
    "QATRule",
    "QATPolicy",
    "fake_quant",
    "policy_to_json",
    "policy_from_json",
    "save_policy",
    "load_policy",
]

SITES = ("state", "w")
FORMATS = {"e4m3": (jnp.float8_e4m3fn, 448.0)}
STATE_GRANULARITY = {"column": (-2,), "matrix": (-2, -1)}  # state [..., K, V]
W_GRANULARITY = {"row": (-1,), "tile": (-3, -1)}  # w [..., C, HV, K]


@dataclasses.dataclass(frozen=True)
class QATConfig:
    """Where and how the chunked GDN path is fake-quantised.

    Attributes:
      sites: subset of ``("state", "w")``.
      fmt: FP8 format; only ``"e4m3"``.
      state_granularity: ``"column"`` or ``"matrix"``.
      w_granularity: ``"row"`` or ``"tile"``.
    """

    sites: tuple[str, ...] = SITES
    fmt: str = "e4m3"
    state_granularity: str = "column"
    w_granularity: str = "row"

    def __post_init__(self):
        object.__setattr__(self, "sites", tuple(sorted(set(self.sites))))
        bad = [s for s in self.sites if s not in SITES]
        if bad or not self.sites:
            raise ValueError(
                f"QATConfig.sites must be a non-empty subset of {SITES}; got {self.sites}"
            )
        if self.fmt not in FORMATS:
            raise ValueError(f"QATConfig.fmt must be one of {tuple(FORMATS)}; got {self.fmt!r}")
        if self.state_granularity not in STATE_GRANULARITY:
            raise ValueError(
                f"QATConfig.state_granularity must be one of {tuple(STATE_GRANULARITY)}; "
                f"got {self.state_granularity!r}"
            )
        if self.w_granularity not in W_GRANULARITY:
            raise ValueError(
                f"QATConfig.w_granularity must be one of {tuple(W_GRANULARITY)}; "
                f"got {self.w_granularity!r}"
            )

    def quantize_state(self, S: jax.Array) -> jax.Array:
        """Fake-quantises a state [..., K, V] if the state site is on."""
        if "state" not in self.sites:
            return S
        return fake_quant(S, STATE_GRANULARITY[self.state_granularity], self.fmt)

    def quantize_w(self, w: jax.Array) -> jax.Array:
        """Fake-quantises w [..., C, HV, K] if the w site is on."""
        if "w" not in self.sites:
            return w
        return fake_quant(w, W_GRANULARITY[self.w_granularity], self.fmt)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def fake_quant(x: jax.Array, axes: tuple[int, ...], fmt: str = "e4m3") -> jax.Array:
    """FP8 quantise-dequantise with a dynamic scale ``amax / fmt_max`` shared over ``axes``:
    ``fp8(x * (fmt_max / amax)) * (amax * f32(1 / fmt_max))``.

    The gradient is the identity (straight-through). The group's amax is floored at
    ``AMAX_FLOOR`` (the kernels' constant), so an all-zero or nearly-zero group (a state decayed
    to ~1e-36) gets a finite scale: zeros stay zeros, tiny values round towards zero, and no
    ``x * inf`` appears.

    Args:
      x: f32 array.
      axes: axes that share one scale.
      fmt: ``"e4m3"``.
    Returns:
      f32 array of x's shape, every value representable as ``fp8 * scale``.
    """
    dtype, fmax = FORMATS[fmt]
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=axes, keepdims=True)
    # One division per group, then only multiplies: every backend and kernel rounds the same.
    amax = jnp.maximum(amax, AMAX_FLOOR)
    inv_scale = fmax / amax
    # Multiply by a rounded reciprocal (what compilers turn a constant divisor into anyway).
    scale = amax * jnp.float32(1.0 / fmax)
    return cast_round_trip(x * inv_scale, dtype) * scale


@fake_quant.defjvp
def _fake_quant_jvp(axes, fmt, primals, tangents):
    return fake_quant(primals[0], axes, fmt), tangents[0].astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class QATRule:
    """``pattern`` is an fnmatch glob on module paths (e.g. ``"layers.*.mixer"``); ``config``
    None switches QAT off for the matched modules."""

    pattern: str
    config: QATConfig | None


@dataclasses.dataclass(frozen=True)
class QATPolicy:
    """Ordered rules; the last rule whose pattern matches a module's path wins."""

    rules: tuple[QATRule, ...] = ()

    def resolve(self, path: str) -> QATConfig | None:
        """The QAT config of the module at ``path`` (None: off)."""
        found = None
        for rule in self.rules:
            if fnmatch.fnmatchcase(path, rule.pattern):
                found = rule.config
        return found


def policy_to_json(policy: QATPolicy) -> str:
    """Serialises a policy (stored next to the model's checkpoint)."""
    rules = [
        {"pattern": r.pattern, "config": None if r.config is None else dataclasses.asdict(r.config)}
        for r in policy.rules
    ]
    return json.dumps({"rules": rules}, sort_keys=True)


def policy_from_json(text: str) -> QATPolicy:
    """Inverse of :func:`policy_to_json`; validates every config."""
    data = json.loads(text)
    rules = []
    for r in data["rules"]:
        cfg = r["config"]
        if cfg is not None:
            cfg = QATConfig(**{**cfg, "sites": tuple(cfg["sites"])})
        rules.append(QATRule(r["pattern"], cfg))
    return QATPolicy(tuple(rules))


POLICY_FILE = "qat_policy.json"


def save_policy(directory, policy: QATPolicy) -> None:
    """Writes the policy next to a checkpoint (``<directory>/qat_policy.json``)."""
    path = pathlib.Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / POLICY_FILE).write_text(policy_to_json(policy))


def load_policy(directory) -> QATPolicy | None:
    """The policy saved by :func:`save_policy` in ``directory``, or None if there is none."""
    path = pathlib.Path(directory) / POLICY_FILE
    return policy_from_json(path.read_text()) if path.exists() else None
