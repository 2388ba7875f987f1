"""Tensor-level entry points of the CUDA kernels (what fp4convert.kernels.tensor dispatches to).

Inputs are batches of matrices ``[B, M, K]``; each matrix has its own amax / global scale. Outputs
are allocated here with ``torch.empty``: the kernels write every byte, padding included, and the
GPU tests poison buffers to prove it. Launches go to the tensors' device and current stream.
"""

from __future__ import annotations

import ctypes
import functools
import math
import threading
from collections.abc import Callable

import torch

from fp4convert.errors import CUDAKernelError, CUDAUnavailableError
from fp4convert.kernels.cuda import api_ext
from fp4convert.kernels.cuda.build import find_nvcc, load_library
from fp4convert.kernels.cuda.runtime import MIN_CAPABILITY  # the E4M3 conversion instructions
from fp4convert.numerics.scheme import SCHEMES

_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_FMTS = {"nvfp4": 0, "mxfp4": 1}
_BLOCK = {"nvfp4": 16, "mxfp4": 32}
_SCALE_DTYPE = {"nvfp4": torch.float8_e4m3fn, "mxfp4": torch.uint8}
# Scale rules by launcher code: the index in the scheme's list (scheme.py states them, docs/numerics.md "Scale rules").


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


class _Flags:
    """A mapped pinned int32 array (the kernels write it through UVA); freed with its thread."""

    def __init__(self, lib: ctypes.CDLL, n: int) -> None:
        p = ctypes.c_void_p()
        _check(lib, lib.fp4c_host_alloc_mapped(ctypes.byref(p), 4 * n))
        self.lib, self.ptr, self.n = lib, p.value, n

    def __del__(self) -> None:
        if self.ptr:
            self.lib.fp4c_host_free(ctypes.c_void_p(self.ptr))


_thread = threading.local()


def _host_flags(lib: ctypes.CDLL, b: int) -> int:
    """This thread's flag array, >= b ints, zeroed by a host store. One per thread: its user reads it
    (after the sync) before the thread's next host-flag call, as the public API does. A grown array's
    predecessor stays allocated with the thread, so a kernel still writing it never writes freed memory."""
    f = getattr(_thread, "flags", None)
    if f is None or f.n < b:
        old = getattr(_thread, "retired", [])
        if f is not None:
            old.append(f)
        f = _thread.flags = _Flags(lib, max(b, 1024, 2 * (f.n if f is not None else 0)))
        _thread.retired = old
    ctypes.memset(f.ptr, 0, 4 * b)
    return f.ptr


def _check(lib: ctypes.CDLL, code: int) -> None:
    if code != 0:
        raise CUDAKernelError(f"CUDA kernel error {code}: {lib.fp4c_error_string(code).decode()}")


def _raw_stream(index: int) -> int:
    """The current stream of GPU ``index`` as a plain handle (ctypes takes the int)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream


def _stream(device: torch.device) -> int:
    """The current stream's handle on ``device`` (the raw getter skips building a Stream object)."""
    return _raw_stream(device.index if device.index is not None else torch.cuda.current_device())


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()  # a plain int: ctypes converts it for the c_void_p argtypes


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """Contiguous and 16-byte aligned (the kernels use 16-byte loads); copies only when needed."""
    if not x.is_contiguous():
        x = x.contiguous()
    if x.data_ptr() % 16:
        x = x.clone()
    return x


def _per_matrix_amax(amax: torch.Tensor, b: int, device: torch.device) -> torch.Tensor:
    """One fp32 amax per matrix, contiguous on the device (no copy when it already is)."""
    if not isinstance(amax, torch.Tensor) or amax.numel() != b:
        raise CUDAKernelError(f"nvfp4 needs an amax per matrix ([{b}] fp32 tensor)")
    if amax.dtype == torch.float32 and amax.device == device and amax.is_contiguous():
        return amax  # the usual case (any shape of b elements): no dispatcher calls at all
    return amax.to(device=device, dtype=torch.float32, non_blocking=True).reshape(b).contiguous()


def _input_weight(w: torch.Tensor, k: int, device: torch.device) -> torch.Tensor:
    """The input weight as the launcher reads it: fp32 [K], contiguous, on x's device."""
    if w.dim() != 1 or w.shape[0] != k or not w.is_floating_point():
        raise CUDAKernelError(f"input_weight must be a float vector of K={k} entries, got {w.dtype} {tuple(w.shape)}")
    return w.to(device=device, dtype=torch.float32).contiguous()


def _per_matrix_gs(gs: torch.Tensor | None, fmt: str, b: int, device: torch.device) -> torch.Tensor | None:
    """NVFP4 dequantize: one fp32 global scale per matrix, contiguous on the device; MXFP4: none."""
    if fmt != "nvfp4":
        return None
    if gs is None or gs.numel() != b:
        raise CUDAKernelError(f"nvfp4 needs a global scale per matrix ([{b}] fp32)")
    return gs.to(device=device, dtype=torch.float32).reshape(b).contiguous()


def scale_rule_code(fmt: str, scale_rule: int | str) -> int:
    """The launchers' int for a scale rule: its ``code`` in scheme.py (:class:`~fp4convert.numerics.scheme.ScaleRule`)."""
    rules = SCHEMES[fmt].rules
    if isinstance(scale_rule, str):
        found = [r for r in rules if r.name == scale_rule]
        if not found:
            names = ", ".join(r.name for r in rules)
            raise CUDAKernelError(f"scale rule {scale_rule!r} does not apply to {fmt}; expected one of {names}")
        return found[0].code
    codes = sorted(r.code for r in rules)
    if scale_rule not in codes or isinstance(scale_rule, bool):
        raise CUDAKernelError(f"scale rule {scale_rule!r} is not one of {', '.join(map(str, codes))}")
    return int(scale_rule)


def _check_input(x: torch.Tensor, rotate: str | None) -> None:
    if x.dim() < 2:
        raise CUDAKernelError(f"expected [..., M, K], got shape {tuple(x.shape)}")
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
    """fp32 [B] (the leading dims): max|x| of each matrix (of its Had16-rotated values with rotate);
    NaN/Inf propagate."""
    _check_input(x, rotate)
    x = _aligned(x)
    *lead, m, k = x.shape
    b = math.prod(lead)
    out = torch.empty(lead, dtype=torch.int32, device=x.device)
    if b == 0:
        return out.view(torch.float32)
    lib = _lib(x.device)
    _check(lib, lib.fp4c_amax(_ptr(x), _DTYPES[x.dtype], int(rotate == "had16"), b, m * k, _ptr(out),
                              _stream(x.device)))
    return out.view(torch.float32)


_amax_pass = amax  # quantize's `amax` argument shadows the function


def quantize(
    x: torch.Tensor,
    scheme: str,
    amax: torch.Tensor | None,
    rotate: str | None,
    swizzle: bool,
    scale_rule: int | str = 0,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    host_flag: bool = False,
    input_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | Callable[[], bool]]:
    """(packed uint8 [B, M, K/2], scale, gs, nonfinite int32 [B]) for x [B, M, K].

    Any leading dims work the same way (``[..., M, K]``, each matrix its own amax): the outputs
    keep them, so a 2-D weight needs no reshape on either side (the public API's per-call cost).

    ``scheme`` "nvfp4" / "mxfp4"; ``scale_rule`` 0 / 1 / 2 / 3 = max / 4over6 / mse / wmse (NVFP4) or
    floor / rceil / mse / wmse (MXFP4), or those names. scale is float8_e4m3fn (NVFP4) or uint8 E8M0 (MXFP4),
    linear ``[B, M, K/bs]`` or, with swizzle, the 128x4 layout ``[B, Mp, nbp]`` with zero padding.
    NVFP4: ``amax`` is the per-matrix (or fused group's) amax, fp32 [B] on x's device; the kernel
    computes gs = 2688 / amax (1 for 0, clamped to FLT_MAX) and returns it as fp32 [B]: one
    launch. ``amax=None`` runs the amax pass first (two launches). MXFP4: amax must be None
    and gs is None. ``nonfinite[b]`` is non-zero when a block of matrix b or its given amax held
    NaN/Inf (the caller refuses the tensor: the one host sync). ``out``: optional preallocated
    (packed, scale uint8) buffers, e.g. poisoned ones in tests. ``host_flag``: the flags go to this
    thread's mapped pinned array instead (no zero-fill launch, no copy back) and ``nonfinite`` is a
    function that waits for the kernel (one stream sync) and says whether any matrix was flagged; call
    it before this thread's next host-flag call, which zeroes the array again. ``input_weight``: fp32
    [K] on x's device, finite and >= 0 (the caller checks the values): the search rules' block error
    weighted per input channel for every matrix of x (``fp4c_quantize_iw``); None: unweighted.
    """
    _check_input(x, rotate)
    if scheme not in _FMTS:
        raise CUDAKernelError(f"unknown scheme {scheme!r}")
    rule = scale_rule_code(scheme, scale_rule)
    bs = _BLOCK[scheme]
    *lead, m, k = x.shape
    b = math.prod(lead)
    if k % bs:
        raise CUDAKernelError(f"K={k} is not a multiple of the {scheme} block size {bs}")
    if scheme == "mxfp4" and amax is not None:
        raise CUDAKernelError("mxfp4 has no global scale: amax must be None")
    x = _aligned(x)
    dev = x.device
    iw = None if input_weight is None else _input_weight(input_weight, k, dev)
    gs = None
    if scheme == "nvfp4":
        amax = _amax_pass(x, rotate) if amax is None else _per_matrix_amax(amax, b, dev)
        gs = torch.empty(lead, dtype=torch.float32, device=dev)
    nb = k // bs
    rows, cols = padded(m, nb) if swizzle else (m, nb)
    packed, scale = _out_buffers(out, (*lead, m, k // 2), (*lead, rows, cols), _SCALE_DTYPE[scheme], dev)
    mapped = host_flag and x.numel() > 0
    flag = None if mapped else torch.zeros(lead, dtype=torch.int32, device=dev)  # the launcher only sets flags
    if x.numel():
        lib, stream = _lib(dev), _stream(dev)
        fp = _host_flags(lib, b) if mapped else _ptr(flag)
        args = (_ptr(x), _DTYPES[x.dtype], _FMTS[scheme], int(rotate == "had16"), int(swizzle), rule, b, m, k,
                _ptr(amax), _ptr(gs), _ptr(packed), _ptr(scale), fp)
        if iw is None:
            _check(lib, lib.fp4c_quantize(*args, stream))
        else:
            _check(lib, lib.fp4c_quantize_iw(*args, _ptr(iw), stream))
    else:  # no launch: the same results the kernel would give an empty matrix
        _empty_results(scale, swizzle, amax, gs, flag)
    if scheme == "nvfp4" and out is not None:
        scale = scale.view(torch.float8_e4m3fn)
    if mapped:

        def flagged() -> bool:
            _check(lib, lib.fp4c_stream_sync(stream))
            return ctypes.string_at(fp, 4 * b) != bytes(4 * b)

        return packed, scale, gs, flagged
    if host_flag:  # an empty input: no launch, the flags were computed here
        bad = bool(flag.any())
        return packed, scale, gs, lambda: bad
    return packed, scale, gs, flag


def _out_buffers(
    out: tuple[torch.Tensor, torch.Tensor] | None,
    packed_shape: tuple[int, ...],
    scale_shape: tuple[int, ...],
    scale_dtype: torch.dtype,
    dev: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize`'s (packed, scale) buffers: new ones, or the caller's ``out`` once checked."""
    if out is None:  # scale in its final dtype: no view afterwards (each dispatcher call is ~1-2 us)
        return (torch.empty(packed_shape, dtype=torch.uint8, device=dev),
                torch.empty(scale_shape, dtype=scale_dtype, device=dev))
    packed, scale = out
    if packed.shape != packed_shape or scale.shape != scale_shape or not (
        packed.dtype == scale.dtype == torch.uint8 and packed.is_contiguous() and scale.is_contiguous()
        and packed.data_ptr() % 16 == 0
    ):
        raise CUDAKernelError("out buffers do not match the expected shapes / uint8 / contiguous")
    return packed, scale


def _empty_results(
    scale: torch.Tensor, swizzle: bool, amax: torch.Tensor | None, gs: torch.Tensor | None, flag: torch.Tensor | None
) -> None:
    """Fill :func:`quantize`'s outputs for an empty input as the kernel would (it is not launched)."""
    if swizzle:
        scale.view(torch.uint8).zero_()
    if gs is not None:
        a = amax.reshape(gs.shape)
        gs.copy_(torch.where(a == 0, torch.ones_like(a),
                             torch.clamp(torch.full_like(a, 2688.0) / a, max=torch.finfo(torch.float32).max)))
        flag.copy_((~torch.isfinite(a)).to(torch.int32))


# device index -> (library, several GPUs visible, empty uint8 / E4M3 / fp32 tensors there: new_empty
# on them allocates without parsing a dtype and a device, ~1 us less per output)
_lean: dict[int, tuple] = {}


def quantize_checked(
    x: torch.Tensor, scheme: str, amax: torch.Tensor | None, rotate: str | None, swizzle: bool, rule: int,
    input_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Callable[[], bool]]:
    """The public API's path: :func:`quantize` with ``host_flag=True``, in fewer host steps.

    A call's host time sits between two kernels (its sync leaves the GPU idle until the next call
    launches), so the usual case (contiguous, aligned CUDA input; NVFP4 with the amax given as a
    contiguous fp32 tensor on x's GPU, or MXFP4) goes straight to the launcher; anything else takes
    :func:`quantize`. The caller has checked the options, the rule code and the shape (and the input
    weight's values: a weighted call takes :func:`quantize`, whose launcher has the weight argument).
    """
    if input_weight is not None:
        return quantize(x, scheme, amax, rotate, swizzle, rule, host_flag=True,  # type: ignore[return-value]
                        input_weight=input_weight)
    idx = x.get_device()
    lean = _lean.get(idx)
    dt = _DTYPES.get(x.dtype)
    nvfp4 = scheme == "nvfp4"
    if lean is None or dt is None or not x.is_contiguous() or x.data_ptr() % 16 or x.numel() == 0 or (
            nvfp4 and not (amax is not None and amax.dtype == torch.float32 and amax.get_device() == idx
                           and amax.is_contiguous())):
        if lean is None and x.is_cuda:
            d = x.device
            lib = _lib(d)
            _lean[idx] = (lib, api_ext.launcher_address(lib), torch.cuda.device_count() > 1,
                          *(torch.empty(0, dtype=t, device=d) for t in (torch.uint8, torch.float8_e4m3fn, torch.float32)))
        return quantize(x, scheme, amax, rotate, swizzle, rule, host_flag=True)
    lib, launcher, several, u8, e4m3, f32 = lean
    shape = x.shape
    lead, m, k = shape[:-2], shape[-2], shape[-1]
    b = math.prod(lead)
    if nvfp4 and amax.numel() != b:
        raise CUDAKernelError(f"nvfp4 needs an amax per matrix ([{b}] fp32 tensor)")
    nb = k >> 4 if nvfp4 else k >> 5
    rows, cols = padded(m, nb) if swizzle else (m, nb)
    if several and (code := lib.fp4c_set_device(idx)):
        _check(lib, code)
    fp = _host_flags(lib, b)
    stream = _raw_stream(idx)
    glue = api_ext.get()
    if glue is not None:  # outputs and launch in one C++ call (the same launcher, the same bytes)
        code, packed, scale, gs = glue.quantize(launcher, x, amax if nvfp4 else None, dt, _FMTS[scheme],
                                                int(rotate == "had16"), int(swizzle), rule, rows, cols, fp, stream)
    else:
        gs = f32.new_empty(lead) if nvfp4 else None
        packed = u8.new_empty((*lead, m, k >> 1))
        scale = (e4m3 if nvfp4 else u8).new_empty((*lead, rows, cols))
        code = lib.fp4c_quantize(x.data_ptr(), dt, _FMTS[scheme], rotate == "had16", swizzle, rule, b, m, k,
                                 amax.data_ptr() if nvfp4 else None, gs.data_ptr() if nvfp4 else None,
                                 packed.data_ptr(), scale.data_ptr(), fp, stream)
    if code:
        _check(lib, code)

    def flagged() -> bool:
        _check(lib, lib.fp4c_stream_sync(stream))
        return ctypes.string_at(fp, 4 * b) != bytes(4 * b)

    return packed, scale, gs, flagged


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


def gptq_sweep(w1: torch.Tensor, u1: torch.Tensor, scheme: str, rule: str, amax: torch.Tensor | None,
               iw: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ's in-batch sweep on the GPU (``csrc/fp4c_gptq.cu``): the signature and the bytes of
    :func:`fp4convert.numerics.gptq.sweep_batch` on the same device. ``w1`` is not changed."""
    device = w1.device
    n, b = w1.shape
    bs = _BLOCK[scheme]
    if w1.dtype != torch.float32 or u1.dtype != torch.float32 or tuple(u1.shape) != (b, b):
        raise CUDAKernelError(f"gptq_sweep takes fp32 w1 [N, B] and u1 [B, B], got {w1.dtype} {tuple(w1.shape)}, "
                              f"{u1.dtype} {tuple(u1.shape)}")
    w = w1.contiguous()
    u = u1.contiguous()
    a = None if amax is None else amax.reshape(1).to(device, torch.float32).contiguous()
    c = None if iw is None else iw.to(device, torch.float32).contiguous()
    codes = torch.empty(n, b, dtype=torch.uint8, device=device)
    scales = torch.empty(n, b // bs, dtype=torch.uint8, device=device)
    values = torch.empty(n, b, dtype=torch.float32, device=device)
    errors = torch.empty(n, b, dtype=torch.float32, device=device)
    lib = _lib(device)
    _check(lib, lib.fp4c_gptq_sweep(_ptr(w), _ptr(u), _ptr(c), _ptr(a), _FMTS[scheme], scale_rule_code(scheme, rule),
                                    n, b, _ptr(codes), _ptr(scales), _ptr(values), _ptr(errors), _stream(device)))
    return codes, scales, values, errors


def e2m1_selftest(device: torch.device | str = "cuda") -> int:
    """Mismatches of this GPU's E2M1 path against the reference's predicate sum (docs/numerics.md "E2M1
    elements") over every fp32 input."""
    device = torch.device(device)
    counter = torch.zeros(1, dtype=torch.int64, device=device)
    lib = _lib(device)
    _check(lib, lib.fp4c_e2m1_selftest(_ptr(counter), _stream(device)))
    return int(counter.item())


# ------------------------------------------------------------------------------------------------
# Input decoding (docs/numerics.md "Quantized inputs"): quantized source checkpoints -> fp32
# ------------------------------------------------------------------------------------------------

_FP8 = (torch.float8_e4m3fn, torch.uint8)


def _fp8_bytes(w: torch.Tensor, what: str) -> torch.Tensor:
    if w.dtype not in _FP8:
        raise CUDAKernelError(f"{what}: expected float8_e4m3fn (or its uint8 bytes), got {w.dtype}")
    if w.dim() < 2:
        raise CUDAKernelError(f"{what}: expected a weight [..., M, N], got shape {tuple(w.shape)}")
    w = w.contiguous().view(torch.uint8)
    return w if w.data_ptr() % 4 == 0 else w.clone()


def _scale_f32(s: torch.Tensor, what: str) -> torch.Tensor:
    if not s.is_floating_point() or s.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise CUDAKernelError(f"{what}: scale must be fp32, fp16 or bf16, got {s.dtype}")
    return s.to(torch.float32).contiguous()  # widening is exact


def _decode_fp8(w: torch.Tensor, s: torch.Tensor, bm: int, bn: int, s_mstride: int) -> torch.Tensor:
    *lead, m, n = w.shape
    b = 1
    for d in lead:
        b *= d
    if s.device != w.device:
        raise CUDAKernelError(f"scale is on {s.device}, the weight on {w.device}")
    out = torch.empty(*lead, m, n, dtype=torch.float32, device=w.device)
    if out.numel():
        if m * n >= (1 << 31) - 4:
            raise CUDAKernelError(f"a {m}x{n} matrix is too large for the decode kernel (< 2^31 elements)")
        lib = _lib(w.device)
        _check(lib, lib.fp4c_decode_fp8_block(_ptr(w), _ptr(s), b, m, n, bm, bn, s_mstride, _ptr(out),
                                              _stream(w.device)))
    return out


def decode_fp8_block(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """fp32 ``w[..., i, j] = fp32(w[..., i, j]) * scale_inv[..., i // bm, j // bn]`` (one fp32 multiply).

    ``w`` float8_e4m3fn ``[..., M, N]``; ``scale_inv`` fp32 (bf16/fp16 widened exactly)
    ``[..., ceil(M/bm), ceil(N/bn)]`` with w's leading dims, or without them (one for every matrix).
    Edge blocks are partial.
    """
    bm, bn = (int(v) for v in block)
    if bm <= 0 or bn <= 0:
        raise CUDAKernelError(f"fp8 block sizes must be positive, got {block}")
    w = _fp8_bytes(w, "decode_fp8_block")
    *lead, m, n = w.shape
    grid = (-(-m // bm), -(-n // bn))
    s = _scale_f32(scale_inv, "decode_fp8_block")
    if tuple(s.shape) == (*lead, *grid):
        s_mstride = grid[0] * grid[1]
    elif tuple(s.shape) == grid and lead:
        s_mstride = 0
    else:
        raise CUDAKernelError(
            f"decode_fp8_block: scale_inv shape {tuple(s.shape)} does not match weight {tuple(w.shape)} with "
            f"blocks {bm}x{bn} (expected {(*lead, *grid)})"
        )
    return _decode_fp8(w, s, bm, bn, s_mstride)


def decode_fp8_scaled(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``w[..., i, j] = fp32(w[..., i, j]) * fp32(scale)[i or 0]``: per tensor (0-dim / [1]) or per
    output channel ([M] / [M, 1]), shared by every matrix of a batch, or per matrix with w's leading
    dims ([...] / [..., 1, 1] per tensor, [..., M] / [..., M, 1] per channel; per channel wins where
    the shapes coincide)."""
    w = _fp8_bytes(w, "decode_fp8_scaled")
    *lead, m, n = w.shape
    s = _scale_f32(scale, "decode_fp8_scaled")
    shape = tuple(s.shape)
    if s.numel() == 1 and len(shape) <= 1:
        return _decode_fp8(w, s.reshape(1), max(m, 1), max(n, 1), 0)
    if shape in ((m,), (m, 1)):
        return _decode_fp8(w, s.reshape(m), 1, max(n, 1), 0)
    if lead and shape in ((*lead, m), (*lead, m, 1)):
        return _decode_fp8(w, s.reshape(-1), 1, max(n, 1), m)
    if lead and shape in (tuple(lead), (*lead, 1), (*lead, 1, 1)):  # one scale per matrix
        return _decode_fp8(w, s.reshape(-1), max(m, 1), max(n, 1), 1)
    raise CUDAKernelError(
        f"decode_fp8_scaled: scale shape {shape} is neither per tensor ([] / [1]) nor per output channel "
        f"([{m}] / [{m}, 1]) of weight {tuple(w.shape)}"
    )


def decode_mxfp4_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """gpt-oss ``*_blocks`` uint8 [..., G, 16] + ``*_scales`` uint8 [..., G] -> fp32 [..., G * 32].

    Element 32 g + 2 j is the low nibble of blocks[..., g, j], 32 g + 2 j + 1 the high one;
    w = value(code) * 2^(scale - 127) (a scale of 255 gives NaN, which the quantizer refuses).
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise CUDAKernelError(f"decode_mxfp4_blocks: expected uint8 blocks and scales, got {blocks.dtype}, {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != 16 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise CUDAKernelError(
            f"decode_mxfp4_blocks: expected blocks [..., G, 16] and scales [..., G], got {tuple(blocks.shape)} "
            f"and {tuple(scales.shape)}"
        )
    if scales.device != blocks.device:
        raise CUDAKernelError(f"scales are on {scales.device}, the blocks on {blocks.device}")
    blocks = blocks.contiguous()
    if blocks.data_ptr() % 2:
        blocks = blocks.clone()
    scales = scales.contiguous()
    out = torch.empty(*blocks.shape[:-2], blocks.shape[-2] * 32, dtype=torch.float32, device=blocks.device)
    if out.numel():
        lib = _lib(blocks.device)
        _check(lib, lib.fp4c_decode_mxfp4_blocks(_ptr(blocks), _ptr(scales), scales.numel(), _ptr(out),
                                                 _stream(blocks.device)))
    return out
