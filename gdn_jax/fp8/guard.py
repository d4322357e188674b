"""The no-FP8 region: the GDN core never sees FP8.

:func:`no_fp8` marks a traced region where native FP8 projections run in their compute dtype and
TransformerEngine's autocast (if TE is in use) is disabled; on exit, normal or exceptional, the
enclosing state (ours and TE's) is restored exactly. :func:`fp8_free` wraps a core op in that
region and upcasts FP8 array arguments.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["fp8_enabled", "fp8_free", "no_fp8"]

# True inside no_fp8(): projections traced there stay in their compute dtype.
_FP8_OFF: contextvars.ContextVar[bool] = contextvars.ContextVar("gdn_jax_fp8_off", default=False)


def fp8_enabled() -> bool:
    """Whether FP8 projections traced now may quantise (False inside :func:`no_fp8`)."""
    return not _FP8_OFF.get()


def _is_fp8(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits == 8


def _te_autocast_fn(te):
    # TE 2.x: autocast(enabled, recipe, mesh_resource); older: fp8_autocast(enabled, fp8_recipe).
    if hasattr(te, "autocast"):
        return lambda enabled, recipe=None: te.autocast(enabled=enabled, recipe=recipe)
    return lambda enabled, recipe=None: te.fp8_autocast(enabled=enabled, fp8_recipe=recipe)


# Where TE keeps its autocast state differs between releases (class attributes of
# QuantizeConfig, a module-global config object, or a global that autocast swaps). We snapshot
# all three forms from the modules below and put them back verbatim, because some TE releases
# *reset* the config when an inner autocast exits instead of restoring the outer one.
_TE_STATE_MODULES = ("transformer_engine.jax.quantize.helper", "transformer_engine.jax.sharding")


def _te_snapshot() -> list[tuple[Any, str, Any]]:
    snap = []
    for mod_name in _TE_STATE_MODULES:
        mod = sys.modules.get(mod_name)
        if mod is None:
            continue
        for name, val in list(vars(mod).items()):
            if name.startswith("__") or callable(val) and not isinstance(val, type):
                continue
            if isinstance(val, type):
                if "Config" in name or "Resource" in name:
                    snap.extend(
                        (val, k, v)
                        for k, v in vars(val).items()
                        if not k.startswith("__")
                        and not callable(v)
                        and not isinstance(v, (classmethod, staticmethod, property))
                    )
                continue
            snap.append((mod, name, val))
            if "Config" in type(val).__name__ and hasattr(val, "__dict__"):
                snap.extend((val, k, v) for k, v in vars(val).items())
    return snap


def _te_restore(snap) -> None:
    for owner, name, val in snap:
        setattr(owner, name, val)


@contextlib.contextmanager
def no_fp8() -> Iterator[None]:
    """Keep everything traced inside out of FP8 (the GDN core's region).

    Native projections traced here run in their compute dtype; if TE is in use its autocast is
    disabled. On exit, normal or by an exception, the enclosing state (ours and TE's) is
    restored exactly. Quantisation is decided at trace time, so this covers the core's forward
    and its backward (the core's backward holds no projection) and remat, which replays the
    traced forward.
    """
    token = _FP8_OFF.set(True)
    te = sys.modules.get("transformer_engine.jax")  # only if the caller already uses TE
    snap = _te_snapshot() if te is not None else None
    try:
        if te is not None:
            with _te_autocast_fn(te)(False):
                yield
        else:
            yield
    finally:
        if snap is not None:
            _te_restore(snap)
        _FP8_OFF.reset(token)


def fp8_free(fn: Callable[..., Any], *, dtype=jnp.bfloat16) -> Callable[..., Any]:
    """Wrap a core op so that it runs in :func:`no_fp8` and never takes or returns FP8 arrays.

    FP8 array arguments are upcast to ``dtype`` (bf16 by default); the outputs are checked.

    Example:
      >>> core = fp8_free(gdn_jax.gated_delta_rule)
      >>> o, _ = core(q, k, v, g, beta, use_qk_l2norm=True)
    """

    def upcast(x):
        return x.astype(dtype) if hasattr(x, "dtype") and _is_fp8(x.dtype) else x

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        args, kwargs = jax.tree.map(upcast, (args, kwargs))
        with no_fp8():
            out = fn(*args, **kwargs)
        bad = [x.dtype for x in jax.tree.leaves(out) if hasattr(x, "dtype") and _is_fp8(x.dtype)]
        if bad:
            raise TypeError(f"{getattr(fn, '__name__', fn)} returned FP8 arrays {bad}")
        return out

    return wrapped
