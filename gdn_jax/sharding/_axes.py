"""Mesh-axis names as PartitionSpec entries: the small conversions every sharding module uses."""

from __future__ import annotations

from collections.abc import Sequence

AxisNames = str | Sequence[str] | None


def _as_tuple(axes: AxisNames) -> tuple[str, ...]:
    if axes is None:
        return ()
    if isinstance(axes, str):
        return (axes,)
    return tuple(axes)


def _entry(axes: tuple[str, ...]) -> str | tuple[str, ...] | None:
    """One PartitionSpec entry for a dimension split over ``axes`` (major to minor)."""
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes
