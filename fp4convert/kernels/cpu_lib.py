"""The compiled CPU kernel (``csrc/fp4c_cpu.cpp``): built with the C++ compiler on first use, called through ctypes.

Why compiled: the torch CPU path (:mod:`fp4convert.kernels.cpu`) runs each step of the reference as one torch
op over a chunk, about thirty passes over memory for a search rule; the kernel does them all on a
tile of 16 blocks held in L1, vectorised by the compiler and threaded inside, so ``--device cpu``
keeps up with the disk. It computes the reference's bytes exactly (tests/kernels/test_cpu_kernel.py).

How it is built: the first call compiles one C++ file (plain C ABI, no torch or Python headers;
~10 s of CPU, once) with ``-O3 -fno-fast-math -ffp-contract=off`` into the cache folder of the
CUDA kernels (``$FP4CONVERT_CACHE_DIR``, default ``~/.cache/fp4convert/kernels``), keyed by the
source's hash, the flags, the compiler's identity and the CPU architecture (:mod:`fp4convert.kernels.jit`).
On x86-64 the library carries AVX-512, AVX2 and baseline clones of its hot functions, picked at load
time, so one cached build runs on every x86-64 machine sharing the cache.

When it is not used: ``FP4CONVERT_CPU_KERNEL=0`` (checked at every call), a dtype other than fp32 /
bf16 / fp16, a scale rule the kernel does not implement yet (one added to the reference and the
torch path first), or no working compiler: then one warning, and the torch path for the rest of the
process (the same bytes, several times slower).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from fp4convert.kernels import jit
from fp4convert.numerics.scheme import get_scheme

if TYPE_CHECKING:
    import torch

log = logging.getLogger("fp4convert.kernels.cpu")

SOURCE = "fp4c_cpu.cpp"
LIB_NAME = "libfp4convert_cpu.so"
ABI_VERSION = 3
# IEEE fp32 exactly as written (docs/numerics.md): no fast math, no FMA contraction, no reassociation.
# -fno-trapping-math only lets the vectoriser turn the selects on float compares (min(y, 6), ...) into
# blends: it assumes nobody reads the FP exception flags, and changes no value. -fPIC -shared for a
# library, -pthread for its std::thread workers.
CXX_FLAGS = ("-O3", "-std=c++17", "-fno-fast-math", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math",
             "-fPIC", "-shared", "-pthread")
SCHEMES = {"nvfp4": 0, "mxfp4": 1}
# Status codes of fp4c_cpu_quantize / fp4c_cpu_amax / fp4c_cpu_gptq_sweep.
OK, BAD_ARGUMENT, UNKNOWN_RULE, NEGATIVE_SCALE, NONFINITE = 0, 1, 2, 3, 4

_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib": the loaded library, or None once it proved unavailable


def enabled() -> bool:
    """False when ``FP4CONVERT_CPU_KERNEL=0`` asks for the torch path (an A/B switch)."""
    return os.environ.get("FP4CONVERT_CPU_KERNEL", "1") != "0"


def source_dir() -> Path:
    """Where the kernel source lives: ``$FP4CONVERT_CSRC``, the repository's csrc/, or the wheel's copy."""
    env = os.environ.get("FP4CONVERT_CSRC")
    here = Path(__file__).resolve().parent
    candidates = ([Path(env)] if env else []) + [here.parents[1] / "csrc", here / "cuda" / "csrc"]
    for c in candidates:
        if (c / SOURCE).is_file():
            return c
    raise jit.BuildFailed(f"{SOURCE} not found (looked in {', '.join(map(str, candidates))})")


def spec() -> jit.BuildSpec:
    """The build of this machine's CPU architecture (raises jit.BuildFailed without a compiler)."""
    cxx = jit.cxx()
    if cxx is None:
        raise jit.BuildFailed("no C++ compiler found (install g++ or set CXX)")
    return jit.BuildSpec(lib=LIB_NAME, tag=f"cpu-{platform.machine() or 'unknown'}", compiler=tuple(cxx),
                         sources=(source_dir() / SOURCE,), flags=CXX_FLAGS, what="CPU kernel (~10 s of CPU)")


def load() -> ctypes.CDLL:
    """Build (or find) and load the library, its functions typed; jit.BuildFailed when it cannot be used."""
    return open_library(spec().build())


def open_library(path: Path) -> ctypes.CDLL:
    """Load a built kernel library and type its functions (jit.BuildFailed if it cannot be used)."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise jit.BuildFailed(f"cannot load {path}: {exc}") from exc
    c_i64, c_int, c_ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.fp4c_cpu_abi_version.restype = c_int
    if lib.fp4c_cpu_abi_version() != ABI_VERSION:
        raise jit.BuildFailed(f"stale CPU kernel at {path} (ABI {lib.fp4c_cpu_abi_version()} != {ABI_VERSION})")
    lib.fp4c_cpu_has_rule.restype = c_int
    lib.fp4c_cpu_has_rule.argtypes = [c_int, c_int]
    lib.fp4c_cpu_amax.restype = c_int
    lib.fp4c_cpu_amax.argtypes = [c_ptr, c_int, c_int, c_i64, c_i64, c_i64, c_ptr, c_int]
    lib.fp4c_cpu_quantize.restype = c_int
    lib.fp4c_cpu_quantize.argtypes = [c_ptr, c_int, c_int, c_int, c_int, c_int, c_i64, c_i64, c_i64, c_ptr, c_ptr,
                                      c_ptr, c_ptr, c_int]
    lib.fp4c_cpu_global_scale.restype = c_int
    lib.fp4c_cpu_global_scale.argtypes = [c_ptr, c_ptr, c_i64]
    lib.fp4c_cpu_nonfinite.restype = c_int
    lib.fp4c_cpu_nonfinite.argtypes = [c_ptr, c_i64, c_int, c_int]
    lib.fp4c_cpu_memcpy.restype = c_int
    lib.fp4c_cpu_memcpy.argtypes = [c_ptr, c_ptr, c_i64, c_int]
    lib.fp4c_cpu_gptq_sweep.restype = c_int
    lib.fp4c_cpu_gptq_sweep.argtypes = [c_ptr, c_ptr, c_ptr, ctypes.c_float, c_int, c_int, c_i64, c_int, c_ptr, c_ptr,
                                        c_ptr, c_ptr, c_int]
    lib.fp4c_cpu_e2m1_selftest.restype = c_i64
    lib.fp4c_cpu_e2m1_selftest.argtypes = [c_int, ctypes.POINTER(ctypes.c_uint32)]
    return lib


def get() -> ctypes.CDLL | None:
    """The loaded kernel, building it on the first call; None for the torch path.

    None when disabled (``FP4CONVERT_CPU_KERNEL=0``) or when it cannot be built or loaded: that is
    logged once as a warning with the reason, and not retried in this process.
    """
    if not enabled():
        return None
    lib = _state.get("lib", _state)
    if lib is not _state:
        return lib  # type: ignore[return-value]
    with _lock:
        if "lib" not in _state:
            try:
                _state["lib"] = load()
            except (jit.BuildFailed, OSError) as exc:
                log.warning("fp4convert: the compiled CPU kernel is unavailable, so the CPU path uses torch "
                            "(the same bytes, several times slower): %s", str(exc).strip().splitlines()[0][:500])
                _state["lib"] = None
    return _state["lib"]  # type: ignore[return-value]


def prepare() -> None:
    """Start building (or loading) the kernel on a background thread, so that a caller who knows it
    will need it (``convert()`` with ``--device cpu``) overlaps the one-time build with its planning;
    the first :func:`get` then waits for that thread instead of starting its own build."""
    if enabled() and "lib" not in _state and not _lock.locked():
        threading.Thread(target=get, name="fp4convert-cpu-kernel-build", daemon=True).start()


@functools.lru_cache(maxsize=None)
def _dtype_codes() -> dict:
    import torch

    return {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def dtype_code(dtype: torch.dtype) -> int | None:
    """The kernel's code for a torch dtype it takes (fp32, bf16, fp16), else None. (This module imports
    torch only here and in the tensor wrappers below: the torch-free ``--device cpu`` backend,
    fp4convert.quantizer.backends.cpu_native, loads the kernel without it.)"""
    return _dtype_codes().get(dtype)


def _threads(threads: int | None) -> int:
    if threads:
        return max(1, int(threads))
    import torch

    return max(1, torch.get_num_threads())


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def amax(lib: ctypes.CDLL, x: torch.Tensor, rotate: str | None, threads: int | None = None) -> torch.Tensor:
    """max|x| per matrix of a [B, M, K] batch (of the Had16-rotated values with ``rotate``); NaN/Inf propagate."""
    import torch

    x = x.contiguous()
    b, m, k = x.shape
    out = torch.empty(b, dtype=torch.float32)
    status = lib.fp4c_cpu_amax(_ptr(x), _dtype_codes()[x.dtype], int(rotate == "had16"), b, m, k, _ptr(out), _threads(threads))
    if status != OK:
        raise RuntimeError(f"internal: fp4c_cpu_amax returned {status} for {tuple(x.shape)} {x.dtype}")
    return out


def quantize(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    fmt: str,
    gs: torch.Tensor | None,
    rotate: str | None,
    swizzle: bool,
    rule: str,
    threads: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(packed [B, M, K/2], scale [B, M, nb] or swizzled, nonfinite [B] bool), or None where the torch
    path must decide (a rule the kernel lacks, a negative global scale, which that path refuses)."""
    import torch

    scheme = get_scheme(fmt)
    code = scheme.rule(rule).code
    if not lib.fp4c_cpu_has_rule(SCHEMES[fmt], code):
        return None
    x = x.contiguous()
    b, m, k = x.shape
    bs = scheme.block_size
    g = None
    if fmt == "nvfp4":
        if gs is None or gs.numel() != b:
            return None
        g = gs.reshape(b).to(torch.float32).contiguous()
    packed = torch.empty(b, m, k // 2, dtype=torch.uint8)
    if swizzle:
        mp, nbp = -(-m // 128) * 128, -(-(k // bs) // 4) * 4
        scale = torch.zeros(b, mp, nbp, dtype=torch.uint8)
    else:
        scale = torch.empty(b, m, k // bs, dtype=torch.uint8)
    flags = torch.empty(b, dtype=torch.uint8)
    status = lib.fp4c_cpu_quantize(_ptr(x), _dtype_codes()[x.dtype], SCHEMES[fmt], code, int(rotate == "had16"), int(swizzle),
                                   b, m, k, _ptr(g) if g is not None else None, _ptr(packed), _ptr(scale), _ptr(flags),
                                   _threads(threads))
    if status == NEGATIVE_SCALE:
        return None
    if status != OK:
        raise RuntimeError(f"internal: fp4c_cpu_quantize returned {status} for {tuple(x.shape)} {x.dtype} {fmt} {rule}")
    if fmt == "nvfp4":
        scale = scale.view(torch.float8_e4m3fn)
    return packed, scale, flags.view(torch.bool)


def gptq_sweep(lib: ctypes.CDLL, w1: torch.Tensor, u1: torch.Tensor, scheme: str, rule: str, gs: float | None,
               iw: torch.Tensor | None, threads: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """GPTQ's in-batch sweep of one column batch (``fp4c_cpu_gptq_sweep``): ``w1`` [N, B] and ``u1`` [B, B]
    fp32 (not changed), ``gs`` the NVFP4 global scale (None for MXFP4), ``iw`` [B] fp32 or None; returns
    (codes [N, B], scale bytes [N, B/bs], values [N, B], errors [N, B]), or None where a block holds
    NaN/Inf when its scale is chosen (the caller raises the reference's error)."""
    import torch

    scheme_ = get_scheme(scheme)
    n, b = w1.shape
    w = w1.contiguous()
    u = u1.contiguous()
    c = None if iw is None else iw.to(torch.float32).contiguous()
    codes = torch.empty(n, b, dtype=torch.uint8)
    scales = torch.empty(n, b // scheme_.block_size, dtype=torch.uint8)
    values = torch.empty(n, b, dtype=torch.float32)
    errors = torch.empty(n, b, dtype=torch.float32)
    status = lib.fp4c_cpu_gptq_sweep(_ptr(w), _ptr(u), _ptr(c) if c is not None else None, float(gs or 0.0),
                                     SCHEMES[scheme], scheme_.rule(rule).code, n, b, _ptr(codes), _ptr(scales),
                                     _ptr(values), _ptr(errors), _threads(threads))
    if status == NONFINITE:
        return None
    if status != OK:
        raise RuntimeError(f"internal: fp4c_cpu_gptq_sweep returned {status} for {tuple(w1.shape)} {scheme} {rule}")
    return codes, scales, values, errors


def e2m1_selftest(lib: ctypes.CDLL, threads: int | None = None) -> tuple[int, int]:
    """(mismatches, first mismatching fp32 bit pattern) of the kernel's E2M1 path against the predicate
    sum over every non-NaN fp32 value."""
    first = ctypes.c_uint32(0)
    return int(lib.fp4c_cpu_e2m1_selftest(_threads(threads), ctypes.byref(first))), first.value
