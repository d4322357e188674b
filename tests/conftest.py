"""Test setup: CPU with 8 fake devices, set before jax is imported anywhere.

On a machine without an NVIDIA GPU (the CPU suite, as CI runs it) the tests also

- compile fast (``FAST_COMPILE_FLAGS``): their programs are tiny, so compiling, not running,
  is most of their time. Values stay f32-exact; tests that compare compiled programs bitwise
  compile both sides with the same flags.
- may share compiled programs within one test module through the ``shared_compiles`` fixture:
  a persistent compilation cache in a fresh directory, removed afterwards. examples/train.py
  builds its jitted step anew on each call, so a test that runs it twice with one
  configuration (a checkpoint resumed, a run repeated) compiles that step once; every program
  is still compiled at least once per run. Not for the Pallas interpreter: its kernels call
  back into Python, and a cached executable would call the callbacks of an earlier compile.
- run the tests marked ``slow`` first, so that under ``pytest -n 2`` the long tests start
  early and the two workers finish together (xdist's ``worksteal`` would balance better, but
  its end-of-run race, pytest-xdist issue 884, can leave both workers waiting forever).
"""

import glob
import os

ON_GPU_HOST = bool(glob.glob("/dev/nvidia[0-9]*"))
CACHE_DIR, MIN_TIME = "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs"
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"

flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
if not ON_GPU_HOST:
    flags += " " + FAST_COMPILE_FLAGS
os.environ["XLA_FLAGS"] = flags.strip()
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    # pytest -n N on the GPU: the workers share it (most of their time is compiling on the host),
    # so none may preallocate 75 % of its memory. Each allocates and frees on demand instead: with
    # a fixed share of 0.9 / N, six workers' 8-16 GiB cases run out of memory, while their peaks
    # rarely coincide.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)


def pytest_configure(config):
    # The GPU suite under pytest -n N: the tests of a module share compiled programs (cached per
    # process by tests/channel_cases.py and tests/gdn_cases.py), which xdist's default "load"
    # would scatter over the workers; one module per worker instead.
    markexpr = config.getoption("markexpr", "") or ""
    if "gpu" in markexpr and getattr(config.option, "dist", "no") == "load":
        config.option.dist = "loadfile"


@pytest.fixture(scope="module")
def shared_compiles(tmp_path_factory):
    """A persistent compilation cache for the requesting module (CPU hosts; no-op on GPU)."""
    if ON_GPU_HOST:
        yield
        return
    from jax.experimental.compilation_cache import compilation_cache

    saved = {k: jax.config.values[k] for k in (CACHE_DIR, MIN_TIME)}
    jax.config.update(CACHE_DIR, str(tmp_path_factory.mktemp("xla_cache")))
    jax.config.update(MIN_TIME, 0.2)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        for k, v in saved.items():
            jax.config.update(k, v)
        compilation_cache.reset_cache()


def pytest_collection_modifyitems(config, items):
    if "slow" not in (config.getoption("markexpr") or ""):
        # A test marked gpu and slow (a heavier shape, or a case whose path a quick GPU test
        # covers) runs only when the -m expression names slow: -m gpu is the quick set,
        # -m "gpu and slow" the heavy one.
        heavy = [item for item in items if {"gpu", "slow"} <= set(item.keywords)]
        if heavy:
            config.hook.pytest_deselected(items=heavy)
            items[:] = [item for item in items if item not in heavy]
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: slow first
    on_gpu = any(d.platform == "gpu" for d in jax.devices())
    if on_gpu:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA Hopper GPU; run on the device with -m gpu")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
