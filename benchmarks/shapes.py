"""Named benchmark shapes.

``B4_T4096_H16_HV16_D128`` = batch 4, 4096 tokens, 16 q/k heads, 16 value heads, K = V = 128.
Decode shapes (``T = None``) are for the single-step kernels, not the chunked op. ``_P`` shapes
pack sequences of the given lengths on one row (``cu_seqlens``). :data:`LONG_CONTEXT` (B1, few
heads, long T: the sequence-parallel chunk loops) is not part of the default :data:`CHUNKED` run.
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
    lengths: tuple[int, ...] | None = None  # packed sequence lengths (B == 1, sum == T)

    def cu_seqlens(self) -> list[int] | None:
        """[0, l0, l0 + l1, …] for packed shapes, else None."""
        if self.lengths is None:
            return None
        cu = [0]
        for n in self.lengths:
            cu.append(cu[-1] + n)
        return cu


LONG_CONTEXT = tuple(
    [Shape(f"B1_T{t}_H{h}_HV{h}_D128", 1, t, h, h) for t in (8192, 16384, 65536, 131072)
     for h in (8, 16)]
    + [Shape("B1_T8192_H16_HV16_D128_P4096+4096", 1, 8192, 16, 16, lengths=(4096, 4096)),
       Shape("B1_T8192_H16_HV16_D128_P1024+7168", 1, 8192, 16, 16, lengths=(1024, 7168))]
)  # fmt: skip


SHAPES = {
    s.name: s
    for s in (
        Shape("B4_T4096_H16_HV16_D128", 4, 4096, 16, 16),
        Shape("B1_T32768_H16_HV16_D128", 1, 32768, 16, 16),
        Shape("B8_T2048_H16_HV32_D128", 8, 2048, 16, 32),
        Shape("B16_T1024_H16_HV16_D128", 16, 1024, 16, 16),
        Shape("B64_H16_D128", 64, None, 16, 16),  # decode
        *LONG_CONTEXT,
    )
}

_LONG = {s.name for s in LONG_CONTEXT}
CHUNKED = tuple(n for n, s in SHAPES.items() if s.T is not None and n not in _LONG)
