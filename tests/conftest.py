"""Test setup: CPU with 8 fake devices, set before jax is imported anywhere.

On a machine without an NVIDIA GPU (the CPU suite, as CI runs it) the tests also

- compile fast (``FAST_COMPILE_FLAGS``): their programs are tiny, so compiling, not running,
  is most of their time. Values stay f32-exact; tests that compare compiled programs bitwise
  compile both sides with the same flags.
- share compiled programs through a persistent compilation cache that lives for one pytest
  process (a fresh directory, removed at exit): examples/train.py and the benchmark scripts
  build their jitted step anew on each call, and a test that runs them twice with one
  configuration (a checkpoint resumed, a run repeated) compiles that step once. Every program
  is still compiled at least once per run.
- run the tests marked ``slow`` first, so that ``pytest -n 2 --dist worksteal`` (the
  ``addopts`` of pyproject.toml) starts the long tests early and the two workers finish
  together.
"""

import atexit
import glob
import os
import shutil
import tempfile

ON_GPU_HOST = bool(glob.glob("/dev/nvidia[0-9]*"))
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"

flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
if not ON_GPU_HOST:
    flags += " " + FAST_COMPILE_FLAGS
os.environ["XLA_FLAGS"] = flags.strip()
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    # pytest -n N on the GPU: the workers share it (the GPU tests spend most of their time in
    # their host-CPU references), so none may preallocate 75 % of its memory. Each allocates and
    # frees on demand instead: with a fixed share of 0.9 / N, six workers' 8-16 GiB cases run
    # out of memory, while their peaks rarely coincide.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)
if not ON_GPU_HOST:
    _cache_dir = tempfile.mkdtemp(prefix="gdn-jax-test-xla-cache-")
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", _cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: slow first
    on_gpu = any(d.platform == "gpu" for d in jax.devices())
    if on_gpu:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA Hopper GPU; run on the device with -m gpu")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
