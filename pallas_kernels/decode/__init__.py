"""Decode kernels: tokens appended to carried f32 states, updated in place."""

from pallas_kernels.decode.step import SUPPORTED_DIMS, StepConfig, decode_step

__all__ = ["SUPPORTED_DIMS", "StepConfig", "decode_step"]
