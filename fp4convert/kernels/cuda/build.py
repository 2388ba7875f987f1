"""Lazy build of the kernel library: nvcc on first use, cached per GPU arch and source hash.

Nothing here runs at import or install time. The library is plain CUDA C++ with ``extern "C"``
launchers (no torch headers): every ``csrc/*.cu`` file (with the ``*.cuh`` headers) goes into one
nvcc call of ~30-60 s, and the result is reused from ``$FP4CONVERT_CACHE_DIR`` (default
``~/.cache/fp4convert/kernels``) as ``<sm>-<hash>/libfp4convert_kernels.so``. The hash covers every
source and header, the flags and nvcc's identity (its resolved path, size and mtime: a cache hit runs
no subprocess and hashes only the ~100 KB of sources). Concurrent builds serialize on a lock file.
The caching and locking are :mod:`fp4convert.kernels.jit`'s, shared with the CPU kernel and the API glue.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
from pathlib import Path

from fp4convert.errors import CUDABuildError, CUDAUnavailableError
from fp4convert.kernels import jit

log = logging.getLogger("fp4convert.kernels.cuda")

SOURCE_NAME = "fp4c_library.cu"  # marks a csrc/ directory; every *.cu beside it is compiled
LIB_NAME = "libfp4convert_kernels.so"
ABI_VERSION = 4
# -fmad=false: docs/numerics.md forbids FMA contraction; the kernels use explicit __fmaf_rn only where a
# fused multiply-add is exact by construction. No fast math: IEEE division and denormals.
NVCC_FLAGS = ("-O3", "-std=c++17", "-fmad=false", "-shared", "-Xcompiler", "-fPIC", "-lineinfo")


def source_dir() -> Path:
    """Where csrc/ lives: $FP4CONVERT_CSRC, the repository checkout, or a copy inside the package."""
    env = os.environ.get("FP4CONVERT_CSRC")
    candidates = [Path(env)] if env else []
    here = Path(__file__).resolve()
    candidates += [here.parents[3] / "csrc", here.parent / "csrc"]
    for c in candidates:
        if (c / SOURCE_NAME).is_file():
            return c
    raise CUDAUnavailableError(
        f"kernel source {SOURCE_NAME} not found (looked in {', '.join(map(str, candidates))}); "
        "set FP4CONVERT_CSRC to the repository's csrc/ or use backend='reference'"
    )


def find_nvcc() -> str | None:
    """$FP4CONVERT_NVCC, $CUDA_HOME/bin/nvcc, nvcc on PATH, or /usr/local/cuda/bin/nvcc."""
    env = os.environ.get("FP4CONVERT_NVCC")
    if env:
        return env
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.is_file() else None


def arch_flags(capability: tuple[int, int]) -> tuple[str, list[str]]:
    """(tag, nvcc -gencode flags) for a compute capability.

    Blackwell and later get the arch-specific target (sm_100a, sm_120a, ...), which has the E2M1
    conversion instruction; Hopper and Ada get plain sm_90 / sm_89 and the software E2M1 path.
    """
    major, minor = capability
    sm = f"{major}{minor}{'a' if major >= 10 else ''}"
    return f"sm_{sm}", ["-gencode", f"arch=compute_{sm},code=sm_{sm}"]


def cache_root() -> Path:
    return jit.cache_root()


def sources(src_dir: Path) -> tuple[list[Path], list[Path]]:
    """(the .cu files nvcc compiles, the .cuh headers they include), sorted."""
    return sorted(src_dir.glob("*.cu")), sorted(src_dir.glob("*.cuh"))


def _spec(src_dir: Path, flags: list[str], nvcc: str, tag: str = "") -> jit.BuildSpec:
    """The library's build: every .cu into one nvcc call, the headers hashed (fp4convert.kernels.jit)."""
    cu, cuh = sources(src_dir)
    return jit.BuildSpec(lib=LIB_NAME, tag=tag, compiler=(nvcc,), sources=tuple(cu), headers=tuple(cuh),
                         flags=tuple(flags), what=f"CUDA kernels for {tag} (~1 min)", error=CUDABuildError,
                         hint="use backend='reference'")


def cache_key(src_dir: Path, flags: list[str], nvcc: str) -> str:
    """Hash of every source and header (name and bytes), the flags and nvcc's identity (its resolved
    path, size and mtime: one stat, no subprocess)."""
    return _spec(src_dir, flags, nvcc).key()


def build_library(capability: tuple[int, int]) -> Path:
    """Path of the built library for this capability, compiling it if the cache lacks it."""
    src_dir = source_dir()
    nvcc = find_nvcc()
    if nvcc is None:
        raise CUDAUnavailableError(
            "nvcc (the CUDA compiler) was not found; the kernels are built on first use. Install the "
            "CUDA toolkit, set CUDA_HOME or FP4CONVERT_NVCC, or use backend='reference'"
        )
    tag, gencode = arch_flags(capability)
    return _spec(src_dir, [*NVCC_FLAGS, *gencode], nvcc, tag).build()


@functools.lru_cache(maxsize=None)
def load_library(capability: tuple[int, int]) -> ctypes.CDLL:
    """Build (or find) and load the library for this capability, with its launchers typed."""
    lib = ctypes.CDLL(str(build_library(capability)))
    c_i64, c_int, c_ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.fp4c_abi_version.restype = c_int
    if lib.fp4c_abi_version() != ABI_VERSION:  # first: a stale library may lack launchers typed below
        raise CUDABuildError(f"stale kernel library (ABI {lib.fp4c_abi_version()} != {ABI_VERSION})")
    lib.fp4c_error_string.restype = ctypes.c_char_p
    lib.fp4c_error_string.argtypes = [c_int]
    lib.fp4c_set_device.restype = c_int
    lib.fp4c_set_device.argtypes = [c_int]
    lib.fp4c_amax.restype = c_int
    lib.fp4c_amax.argtypes = [c_ptr, c_int, c_int, c_i64, c_i64, c_ptr, c_ptr]
    lib.fp4c_quantize.restype = c_int
    lib.fp4c_quantize.argtypes = [c_ptr, c_int, c_int, c_int, c_int, c_int, c_i64, c_i64, c_i64, c_ptr, c_ptr,
                                  c_ptr, c_ptr, c_ptr, c_ptr]
    lib.fp4c_quantize_iw.restype = c_int  # the same with the input weight (fp32 [K] or null) before the stream
    lib.fp4c_quantize_iw.argtypes = [c_ptr, c_int, c_int, c_int, c_int, c_int, c_i64, c_i64, c_i64, c_ptr, c_ptr,
                                     c_ptr, c_ptr, c_ptr, c_ptr, c_ptr]
    lib.fp4c_dequantize.restype = c_int
    lib.fp4c_dequantize.argtypes = [c_ptr, c_ptr, c_ptr, c_int, c_int, c_int, c_i64, c_i64, c_i64, c_ptr, c_int,
                                    c_ptr]
    lib.fp4c_decode_fp8_block.restype = c_int
    lib.fp4c_decode_fp8_block.argtypes = [c_ptr, c_ptr, c_i64, c_i64, c_i64, c_i64, c_i64, c_i64, c_ptr, c_ptr]
    lib.fp4c_decode_mxfp4_blocks.restype = c_int
    lib.fp4c_decode_mxfp4_blocks.argtypes = [c_ptr, c_ptr, c_i64, c_ptr, c_ptr]
    lib.fp4c_gptq_sweep.restype = c_int
    lib.fp4c_gptq_sweep.argtypes = [c_ptr, c_ptr, c_ptr, c_ptr, c_int, c_int, c_i64, c_int, c_ptr, c_ptr, c_ptr, c_ptr,
                                    c_ptr]
    lib.fp4c_e2m1_selftest.restype = c_int
    lib.fp4c_e2m1_selftest.argtypes = [c_ptr, c_ptr]
    c_pp = ctypes.POINTER(c_ptr)
    for name, args in (("fp4c_host_alloc", [c_pp, c_i64]), ("fp4c_host_alloc_mapped", [c_pp, c_i64]),
                       ("fp4c_host_free", [c_ptr]),
                       ("fp4c_memset_async", [c_ptr, c_int, c_i64, c_ptr]), ("fp4c_malloc", [c_pp, c_i64]),
                       ("fp4c_free", [c_ptr]), ("fp4c_stream_create", [c_pp]), ("fp4c_stream_destroy", [c_ptr]),
                       ("fp4c_stream_sync", [c_ptr]), ("fp4c_event_create", [c_pp]), ("fp4c_event_destroy", [c_ptr]),
                       ("fp4c_event_record", [c_ptr, c_ptr]), ("fp4c_event_sync", [c_ptr]),
                       ("fp4c_memcpy_async", [c_ptr, c_ptr, c_i64, c_int, c_ptr]),
                       ("fp4c_device_count", [ctypes.POINTER(c_int)]), ("fp4c_host_nonfinite", [c_ptr, c_i64, c_int])):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = c_int, args
    return lib
