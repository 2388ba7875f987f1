"""The CUDA backend's errors live in :mod:`fp4convert.errors` with every other class."""

from __future__ import annotations

from ..errors import CUDABuildError, CUDAKernelError, CUDAUnavailableError

__all__ = ["CUDABuildError", "CUDAKernelError", "CUDAUnavailableError"]
