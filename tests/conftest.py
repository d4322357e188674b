"""Test setup: CPU with 8 fake devices, set before jax is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
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


def pytest_collection_modifyitems(config, items):
    on_gpu = any(d.platform == "gpu" for d in jax.devices())
    if on_gpu:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA Hopper GPU; run on the device with -m gpu")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
