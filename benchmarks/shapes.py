"""Named benchmark shapes.

``B4_T4096_H16_HV16_D128`` = batch 4, 4096 tokens, 16 q/k heads, 16 value heads, K = V = 128.
Decode shapes (``T = None``) are for the single-step kernels, not the chunked op.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Shape:
    """One benchmark shape."""

    name: str
    B: int
    T: int | None
    H: int
    HV: int
    K: int = 128
    V: int = 128


SHAPES = {
    s.name: s
    for s in (
        Shape("B4_T4096_H16_HV16_D128", 4, 4096, 16, 16),
        Shape("B1_T32768_H16_HV16_D128", 1, 32768, 16, 16),
        Shape("B8_T2048_H16_HV32_D128", 8, 2048, 16, 32),
        Shape("B16_T1024_H16_HV16_D128", 16, 1024, 16, 16),
        Shape("B64_H16_D128", 64, None, 16, 16),  # decode
    )
}

CHUNKED = tuple(n for n, s in SHAPES.items() if s.T is not None)
