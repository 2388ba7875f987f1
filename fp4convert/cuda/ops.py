"""Tensor-level entry points of the CUDA kernels (what fp4convert.tensor dispatches to).

Inputs are batches of matrices ``[B, M, K]``; each matrix has its own amax / global scale. Outputs
are allocated here with ``torch.empty``: the kernels write every byte, padding included, and the
GPU tests poison buffers to prove it. Launches go to the tensors' device and current stream.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from .build import find_nvcc, load_library
from .errors import CUDAKernelError, CUDAUnavailableError

_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_FMTS = {"nvfp4": 0, "mxfp4": 1}
_BLOCK = {"nvfp4": 16, "mxfp4": 32}
MIN_CAPABILITY = (8, 9)  # the E4M3 conversion instructions


def available() -> bool:
    """True when a CUDA device of capability >= 8.9 and nvcc are present (builds nothing)."""
    try:
        if not torch.cuda.is_available():
            return False
        cap = torch.cuda.get_device_capability()
    except Exception:  # noqa: BLE001 - a broken driver means "not available", never a crash here
        return False
    return cap >= MIN_CAPABILITY and find_nvcc() is not None


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _lib(device: torch.device) -> ctypes.CDLL:
    if device.type != "cuda":
        raise CUDAUnavailableError(f"the CUDA kernels need CUDA tensors, got a tensor on {device}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    cap = _capability(index)
    if cap < MIN_CAPABILITY:
        raise CUDAUnavailableError(
            f"the CUDA kernels need compute capability >= 8.9 (E4M3 conversion), this GPU has "
            f"{cap[0]}.{cap[1]}; use backend='reference'"
        )
    lib = load_library(cap)
    _check(lib, lib.fp4c_set_device(index))
    return lib


def ensure_loaded(device: torch.device) -> None:
    """Build or load the library for ``device`` now (raises CUDAUnavailableError if it cannot)."""
    _lib(device)


def _check(lib: ctypes.CDLL, code: int) -> None:
    if code != 0:
        raise CUDAKernelError(f"CUDA kernel error {code}: {lib.fp4c_error_string(code).decode()}")


def _stream(device: torch.device) -> ctypes.c_void_p:
    return ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(0 if t is None else t.data_ptr())


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """Contiguous and 16-byte aligned (the kernels use 16-byte loads); copies only when needed."""
    if not x.is_contiguous():
        x = x.contiguous()
    if x.data_ptr() % 16:
        x = x.clone()
    return x


def _per_matrix_gs(gs: torch.Tensor | None, fmt: str, b: int, device: torch.device) -> torch.Tensor | None:
    """NVFP4: one fp32 global scale per matrix, contiguous on the device; MXFP4: none."""
    if fmt != "nvfp4":
        return None
    if gs is None or gs.numel() != b:
        raise CUDAKernelError(f"nvfp4 needs a global scale per matrix ([{b}] fp32)")
    return gs.to(device=device, dtype=torch.float32).reshape(b).contiguous()


def _check_input(x: torch.Tensor, rotate: str | None) -> None:
    if x.dim() != 3:
        raise CUDAKernelError(f"expected [B, M, K], got shape {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise CUDAKernelError(f"unsupported dtype {x.dtype}; expected bf16, fp16 or fp32")
    if x.shape[-1] % 16:
        raise CUDAKernelError(f"K={x.shape[-1]} is not a multiple of 16")
    if rotate not in (None, "had16"):
        raise CUDAKernelError(f"unknown rotation {rotate!r}")


def padded(m: int, nb: int) -> tuple[int, int]:
    """(Mp, nbp) of the 128x4 scale layout."""
    return -(-m // 128) * 128, -(-nb // 4) * 4


def amax(x: torch.Tensor, rotate: str | None) -> torch.Tensor:
    """fp32 [B]: max|x| of each matrix (of its Had16-rotated values with rotate); NaN/Inf propagate."""
    _check_input(x, rotate)
    x = _aligned(x)
    b, m, k = x.shape
    out = torch.empty(b, dtype=torch.int32, device=x.device)
    if b == 0:
        return out.view(torch.float32)
    lib = _lib(x.device)
    _check(lib, lib.fp4c_amax(_ptr(x), _DTYPES[x.dtype], int(rotate == "had16"), b, m * k, _ptr(out),
                              _stream(x.device)))
    return out.view(torch.float32)


def quantize(
    x: torch.Tensor,
    fmt: str,
    gs: torch.Tensor | None,
    rotate: str | None,
    swizzle: bool,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8 [B, M, K/2], scale, nonfinite int32 scalar) for x [B, M, K].

    scale is float8_e4m3fn (NVFP4) or uint8 E8M0 (MXFP4), linear ``[B, M, K/bs]`` or, with
    swizzle, the 128x4 layout ``[B, Mp, nbp]`` with zero padding. ``nonfinite`` is non-zero when a
    block held NaN/Inf (the caller refuses the tensor). ``gs``: fp32 [B] on x's device (NVFP4).
    ``out``: optional preallocated (packed, scale uint8) buffers, e.g. poisoned ones in tests.
    """
    _check_input(x, rotate)
    if fmt not in _FMTS:
        raise CUDAKernelError(f"unknown format {fmt!r}")
    bs = _BLOCK[fmt]
    b, m, k = x.shape
    if k % bs:
        raise CUDAKernelError(f"K={k} is not a multiple of the {fmt} block size {bs}")
    x = _aligned(x)
    gs = _per_matrix_gs(gs, fmt, b, x.device)
    nb = k // bs
    rows, cols = padded(m, nb) if swizzle else (m, nb)
    if out is None:
        packed = torch.empty(b, m, k // 2, dtype=torch.uint8, device=x.device)
        scale = torch.empty(b, rows, cols, dtype=torch.uint8, device=x.device)
    else:
        packed, scale = out
        if packed.shape != (b, m, k // 2) or scale.shape != (b, rows, cols) or not (
            packed.dtype == scale.dtype == torch.uint8 and packed.is_contiguous() and scale.is_contiguous()
            and packed.data_ptr() % 16 == 0
        ):
            raise CUDAKernelError("out buffers do not match the expected shapes / uint8 / contiguous")
    flag = torch.zeros((), dtype=torch.int32, device=x.device) if x.numel() == 0 else torch.empty(
        (), dtype=torch.int32, device=x.device)  # the launcher zeroes it
    if x.numel():
        lib = _lib(x.device)
        _check(lib, lib.fp4c_quantize(_ptr(x), _DTYPES[x.dtype], _FMTS[fmt], int(rotate == "had16"), int(swizzle),
                                      b, m, k, _ptr(gs), _ptr(packed), _ptr(scale), _ptr(flag), _stream(x.device)))
    elif swizzle:
        scale.zero_()
    if fmt == "nvfp4":
        scale = scale.view(torch.float8_e4m3fn)
    return packed, scale, flag


def dequantize(
    packed: torch.Tensor,
    scale: torch.Tensor,
    gs: torch.Tensor | None,
    fmt: str,
    rotate: str | None,
    swizzled: bool,
    out_dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, M, K] of out_dtype: value(code) * (sf / gs) (NVFP4) or * 2^(e-127) (MXFP4) in fp32, the
    inverse Had16 if rotate, then the cast. ``out``: optional preallocated result buffer."""
    if fmt not in _FMTS:
        raise CUDAKernelError(f"unknown format {fmt!r}")
    if out_dtype not in _DTYPES:
        raise CUDAKernelError(f"unsupported output dtype {out_dtype}")
    if packed.dim() != 3 or packed.dtype != torch.uint8:
        raise CUDAKernelError(f"expected packed uint8 [B, M, K/2], got {packed.dtype} {tuple(packed.shape)}")
    b, m, k2 = packed.shape
    k = 2 * k2
    bs = _BLOCK[fmt]
    if k % bs:
        raise CUDAKernelError(f"K={k} is not a multiple of the {fmt} block size {bs}")
    nb = k // bs
    want = (b, *padded(m, nb)) if swizzled else (b, m, nb)
    if tuple(scale.shape) != want:
        raise CUDAKernelError(f"scale shape {tuple(scale.shape)} does not match {want}")
    packed = _aligned(packed)
    scale = scale.contiguous()
    if scale.dtype != torch.uint8:
        scale = scale.view(torch.uint8)
    gs = _per_matrix_gs(gs, fmt, b, packed.device)
    if out is None:
        out = torch.empty(b, m, k, dtype=out_dtype, device=packed.device)
    elif out.shape != (b, m, k) or out.dtype != out_dtype or not out.is_contiguous() or out.data_ptr() % 16:
        raise CUDAKernelError("out buffer does not match the expected shape / dtype / contiguity")
    if out.numel():
        lib = _lib(packed.device)
        _check(lib, lib.fp4c_dequantize(_ptr(packed), _ptr(scale), _ptr(gs), _FMTS[fmt], int(rotate == "had16"),
                                        int(swizzled), b, m, k, _ptr(out), _DTYPES[out_dtype],
                                        _stream(packed.device)))
    return out


TUNING_KEYS = {"quant_persistent": 0, "unbalanced_grid": 1, "persistent_grid": 3}


def set_tuning(key: str, value: int, device: torch.device | str = "cuda") -> None:
    """Benchmark A/B switch (see csrc); the defaults are the measured winners. Not for production."""
    lib = _lib(torch.device(device))
    _check(lib, lib.fp4c_set_tuning(TUNING_KEYS[key], int(value)))


def e2m1_selftest(device: torch.device | str = "cuda") -> int:
    """Mismatches of this GPU's E2M1 path against SPEC.md's predicate sum over every fp32 input."""
    device = torch.device(device)
    counter = torch.zeros(1, dtype=torch.int64, device=device)
    lib = _lib(device)
    _check(lib, lib.fp4c_e2m1_selftest(_ptr(counter), _stream(device)))
    return int(counter.item())
