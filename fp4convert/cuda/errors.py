"""Errors of the CUDA backend; all are FP4ConvertError, so the CLI maps them like any other."""

from __future__ import annotations

from ..errors import FP4ConvertError


class CUDAUnavailableError(FP4ConvertError):
    """No usable CUDA device, driver or nvcc for the kernels; use backend='reference' (the CPU path)."""

    exit_code = 7


class CUDABuildError(FP4ConvertError):
    """nvcc failed to build the kernel library (its output is in the message)."""

    exit_code = 7


class CUDAKernelError(FP4ConvertError):
    """A kernel launch or a launcher argument check failed."""

    exit_code = 7

