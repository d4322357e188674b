"""The Mosaic GPU interpreter's callbacks get NumPy operands (pallas_kernels._compat): no JAX op
is dispatched from inside a running interpreted kernel, where jax 0.11.2 can hang under CPU
contention. Every interpreter test runs through this path; these check the hand-off itself."""

from __future__ import annotations

import jax
import numpy as np
from jax._src import callback
from jax._src.pallas.mosaic_gpu.interpret import shared_memory

import pallas_kernels  # noqa: F401  (installs the hand-off)


def _seen_types(module: str) -> list[type]:
    seen = []

    def f(x):
        seen.append(type(x))
        return x

    f.__module__ = module
    flat = callback._FlatCallback(f, jax.tree.structure(((0,), {})))
    out = callback.io_callback_impl(
        np.arange(3, dtype=np.int32), result_avals=(), callback=flat, sharding=None, ordered=False
    )
    assert all(isinstance(o, np.ndarray) for o in out)
    np.testing.assert_array_equal(out[0], np.arange(3))
    return seen


def test_interpreter_callbacks_get_numpy_and_others_are_unchanged():
    assert getattr(callback.io_callback_impl, "host_operands", False)
    assert _seen_types("jax._src.pallas.mosaic_gpu.interpret.gpu_callbacks") == [np.ndarray]
    assert _seen_types("jax._src.pallas.mosaic.interpret.thread_map") == [np.ndarray]
    (seen,) = _seen_types("user_code")
    assert issubclass(seen, jax.Array)  # io_callback's own behaviour


def test_interpreter_reads_numpy_integers():
    assert shared_memory._to_int(np.int32(3)) == 3
    assert shared_memory._to_int(np.asarray(5, np.int32)) == 5
    assert shared_memory._to_int(7) == 7
