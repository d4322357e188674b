"""GPU tests of the kernels: the quick set by default.

A test marked both ``gpu`` and ``slow`` (a heavier shape on a code path that a quick GPU test
covers) runs only when the ``-m`` expression names ``slow``: ``pytest -m gpu`` runs the quick set,
``pytest -m "gpu and slow"`` the heavy one.
"""


def _heavy(item) -> bool:
    return "gpu" in item.keywords and "slow" in item.keywords


def pytest_collection_modifyitems(config, items):
    if "slow" in (config.getoption("markexpr") or ""):
        return
    heavy = [item for item in items if _heavy(item)]
    if heavy:
        config.hook.pytest_deselected(items=heavy)
        items[:] = [item for item in items if not _heavy(item)]
