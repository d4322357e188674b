"""Chunked GDN2 / KDA (decay per key channel) kernels, one module per stage."""
