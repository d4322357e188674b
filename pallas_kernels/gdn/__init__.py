"""Chunked Gated DeltaNet (scalar gate) kernels, one module per stage."""
