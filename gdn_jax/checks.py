"""Checked mode: value checks on traced arguments through ``jax.experimental.checkify``.

Concrete arguments (not under ``jax.jit``) are always checked eagerly and bad values raise
``ValueError``. Under ``jax.jit`` the values are unknown at trace time: the ops, layers and models
then replace out-of-range values by defined ones (see docs/ops.md, "Bad input and edge values").
Inside :func:`checked` they also add ``checkify`` checks for those values, so that a function
transformed by ``checkify.checkify`` reports them::

    from jax.experimental import checkify

    with gdn_jax.checked():
        err, logits = checkify.checkify(jax.jit(model_fn))(tokens)
    err.throw()  # JaxRuntimeError naming the argument, e.g. "tokens must lie in [0, 256)"

The switch is read while tracing: trace (call for the first time) the jitted function inside the
context. A function traced outside it keeps its traced form, without checks, in jit's cache; a
function traced inside it must be run through ``checkify.checkify`` (JAX refuses to stage a
``checkify.check`` otherwise).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
from jax.experimental import checkify

__all__ = ["checked", "enabled", "check", "is_concrete"]

_ENABLED = contextvars.ContextVar("gdn_jax_checked", default=False)


@contextlib.contextmanager
def checked(enable: bool = True) -> Iterator[None]:
    """Context in which traced values are checked with ``checkify.check`` (see module doc)."""
    token = _ENABLED.set(bool(enable))
    try:
        yield
    finally:
        _ENABLED.reset(token)


def enabled() -> bool:
    """Whether checked mode is on."""
    return _ENABLED.get()


def is_concrete(*xs) -> bool:
    """True when no argument is a tracer (its values can be read now)."""
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


def check(pred: jax.Array, msg: str, *fmt_args: jax.Array) -> None:
    """``checkify.check(pred, msg, *fmt_args)`` in checked mode; nothing otherwise.

    Args:
      pred: bool scalar that must hold.
      msg: error message; ``{}`` fields are filled with ``fmt_args`` (arrays, read at run time).
    """
    if _ENABLED.get():
        checkify.check(pred, msg, *fmt_args)
