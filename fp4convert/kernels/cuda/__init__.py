"""fp4convert's CUDA kernels (``csrc/``), built with nvcc on first use and loaded through ctypes.

Importing this package is cheap and never compiles: :func:`fp4convert.kernels.cuda.ops.available` only asks
whether a usable GPU is there; the first kernel call builds (or finds in the cache) the library.
"""

from __future__ import annotations

from fp4convert.errors import CUDABuildError, CUDAKernelError, CUDAUnavailableError

__all__ = ["CUDABuildError", "CUDAKernelError", "CUDAUnavailableError"]
