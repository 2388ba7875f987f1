"""Lazy build of the kernel library: nvcc on first use, cached per GPU arch and source hash.

Nothing here runs at import or install time. The library is plain CUDA C++ with ``extern "C"``
launchers (no torch headers), so a build is one nvcc call of ~10-30 s, and the result is reused
from ``$FP4CONVERT_CACHE_DIR`` (default ``~/.cache/fp4convert/kernels``) as
``<sm>-<hash>/libfp4convert_kernels.so``, where the hash covers the source, the flags and nvcc's
version. Concurrent builds (several processes) serialize on a lock file.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from .errors import CUDABuildError, CUDAUnavailableError

log = logging.getLogger("fp4convert.cuda")

SOURCE_NAME = "fp4convert_kernels.cu"
LIB_NAME = "libfp4convert_kernels.so"
ABI_VERSION = 1
# -fmad=false: SPEC.md forbids FMA contraction; the kernels use explicit __fmaf_rn only where a
# fused multiply-add is exact by construction. No fast math: IEEE division and denormals.
NVCC_FLAGS = ("-O3", "-std=c++17", "-fmad=false", "-shared", "-Xcompiler", "-fPIC", "-lineinfo")


def source_dir() -> Path:
    """Where csrc/ lives: $FP4CONVERT_CSRC, the repository checkout, or a copy inside the package."""
    env = os.environ.get("FP4CONVERT_CSRC")
    candidates = [Path(env)] if env else []
    here = Path(__file__).resolve()
    candidates += [here.parents[2] / "csrc", here.parent / "csrc"]
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
    env = os.environ.get("FP4CONVERT_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fp4convert" / "kernels"


def _nvcc_version(nvcc: str) -> str:
    try:
        return subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise CUDAUnavailableError(f"nvcc at {nvcc} does not run ({exc}); use backend='reference'") from exc


def build_library(capability: tuple[int, int]) -> Path:
    """Path of the built library for this capability, compiling it if the cache lacks it."""
    src = source_dir() / SOURCE_NAME
    nvcc = find_nvcc()
    if nvcc is None:
        raise CUDAUnavailableError(
            "nvcc (the CUDA compiler) was not found; the kernels are built on first use. Install the "
            "CUDA toolkit, set CUDA_HOME or FP4CONVERT_NVCC, or use backend='reference'"
        )
    tag, gencode = arch_flags(capability)
    flags = [*NVCC_FLAGS, *gencode]
    digest = hashlib.sha256()
    digest.update(src.read_bytes())
    digest.update(" ".join(flags).encode())
    digest.update(_nvcc_version(nvcc).encode())
    target_dir = cache_root() / f"{tag}-{digest.hexdigest()[:16]}"
    target = target_dir / LIB_NAME
    if target.is_file():
        return target
    target_dir.mkdir(parents=True, exist_ok=True)
    with open(target_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():  # another process built it while we waited
            return target
        log.info("building fp4convert CUDA kernels for %s (one time, ~30 s)", tag)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target_dir)
        os.close(fd)
        cmd = [nvcc, *flags, "-o", tmp, str(src)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            os.unlink(tmp)
            raise CUDABuildError(f"nvcc failed ({' '.join(cmd)}):\n{proc.stdout}{proc.stderr}")
        os.replace(tmp, target)
    return target


@functools.lru_cache(maxsize=None)
def load_library(capability: tuple[int, int]) -> ctypes.CDLL:
    """Build (or find) and load the library for this capability, with its launchers typed."""
    lib = ctypes.CDLL(str(build_library(capability)))
    c_i64, c_int, c_ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.fp4c_abi_version.restype = c_int
    lib.fp4c_error_string.restype = ctypes.c_char_p
    lib.fp4c_error_string.argtypes = [c_int]
    lib.fp4c_set_tuning.restype = c_int
    lib.fp4c_set_tuning.argtypes = [c_int, c_int]
    lib.fp4c_set_device.restype = c_int
    lib.fp4c_set_device.argtypes = [c_int]
    lib.fp4c_amax.restype = c_int
    lib.fp4c_amax.argtypes = [c_ptr, c_int, c_int, c_i64, c_i64, c_ptr, c_ptr]
    lib.fp4c_quantize.restype = c_int
    lib.fp4c_quantize.argtypes = [c_ptr, c_int, c_int, c_int, c_int, c_i64, c_i64, c_i64, c_ptr, c_ptr, c_ptr,
                                  c_ptr, c_ptr]
    lib.fp4c_dequantize.restype = c_int
    lib.fp4c_dequantize.argtypes = [c_ptr, c_ptr, c_ptr, c_int, c_int, c_int, c_i64, c_i64, c_i64, c_ptr, c_int,
                                    c_ptr]
    lib.fp4c_e2m1_selftest.restype = c_int
    lib.fp4c_e2m1_selftest.argtypes = [c_ptr, c_ptr]
    if lib.fp4c_abi_version() != ABI_VERSION:
        raise CUDABuildError(f"stale kernel library (ABI {lib.fp4c_abi_version()} != {ABI_VERSION})")
    return lib
