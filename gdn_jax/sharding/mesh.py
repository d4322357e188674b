"""Device meshes from specs such as ``"data=2,fsdp=2,tensor=2"`` (``examples/train.py --mesh``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import AxisType, Mesh

__all__ = ["parse_mesh", "make_mesh"]


def parse_mesh(spec: str) -> dict[str, int]:
    """Parse ``"data=2,fsdp=2,tensor=2"`` into ``{"data": 2, "fsdp": 2, "tensor": 2}``.

    One size may be ``-1``: it takes the devices left over (resolved by :func:`make_mesh`).
    """
    out: dict[str, int] = {}
    for part in spec.replace(" ", "").split(","):
        if not part:
            continue
        name, eq, size = part.partition("=")
        if not eq or not name or not size.lstrip("-").isdigit():
            raise ValueError(
                f"mesh spec {spec!r}: expected 'name=size[,name=size...]'; got {part!r}"
            )
        if name in out:
            raise ValueError(f"mesh spec {spec!r}: axis {name!r} given twice")
        n = int(size)
        if n < 1 and n != -1:
            raise ValueError(f"mesh spec {spec!r}: axis {name!r} has size {n}; expected ≥ 1 or -1")
        out[name] = n
    if not out:
        raise ValueError(f"mesh spec {spec!r} names no axes")
    if list(out.values()).count(-1) > 1:
        raise ValueError(f"mesh spec {spec!r}: at most one axis may have size -1")
    return out


def make_mesh(
    spec: str | Mapping[str, int],
    *,
    devices: Sequence[jax.Device] | None = None,
    axis_type: AxisType = AxisType.Auto,
) -> Mesh:
    """A mesh from ``"data=2,fsdp=2,tensor=2"`` (or a name → size mapping).

    Args:
      spec: axis names and sizes, major to minor; one size may be -1 (the rest of the devices).
      devices: devices to use (default ``jax.devices()``); a mesh smaller than the device list
        takes its first devices.
      axis_type: the axis type of every axis. ``Auto`` (default) lets the partitioner propagate
        shardings from annotated parameters and inputs (what the model rules assume); ``Explicit``
        (``jax.make_mesh``'s default) works as well: the ops, layers and model read layouts off
        their inputs (docs/sharding.md).

    Returns:
      A :class:`jax.sharding.Mesh`.
    """
    sizes = parse_mesh(spec) if isinstance(spec, str) else dict(spec)
    devices = list(jax.devices() if devices is None else devices)
    known = math.prod(n for n in sizes.values() if n != -1)
    if -1 in sizes.values():
        if len(devices) % known:
            raise ValueError(f"mesh {sizes}: {len(devices)} devices are not a multiple of {known}")
        sizes = {a: (len(devices) // known if n == -1 else n) for a, n in sizes.items()}
    total = math.prod(sizes.values())
    if total > len(devices):
        raise ValueError(f"mesh {sizes} needs {total} devices; {len(devices)} available")
    return jax.make_mesh(
        tuple(sizes.values()),
        tuple(sizes),
        axis_types=(axis_type,) * len(sizes),
        devices=devices[:total],
    )
