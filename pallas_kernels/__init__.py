"""Pallas Mosaic GPU kernels (Hopper) for gdn_jax. Imports nothing from gdn_jax.

``pallas_kernels.gdn`` holds one module per stage of the chunked Gated DeltaNet; every
version-dependent Pallas call goes through :mod:`pallas_kernels._compat`.
"""

from pallas_kernels._compat import execution_mode, is_hopper, use_mode
from pallas_kernels._tiles import CHUNK

__all__ = ["CHUNK", "execution_mode", "is_hopper", "use_mode"]
