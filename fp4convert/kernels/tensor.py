"""The public tensor API: quantize / dequantize one weight, on whichever backend fits its device.

Backends: ``"reference"`` (pure PyTorch, any device, the source of truth), ``"cpu"`` (the reference's
arithmetic in row chunks with a one-pass E2M1 encoder: faster, and bounded memory) and ``"cuda"``
(our own kernels, built on first use). ``"auto"`` takes the kernels for CUDA tensors and the CPU
fast path for CPU tensors; every backend gives the same bytes.
"""

from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass
from typing import Literal

import torch

from fp4convert.errors import HAD16_GAIN, ConfigError, NonFiniteError, QuantizationError, RotationOverflowError, ShapeError
from fp4convert.numerics import reference as ref
from fp4convert.numerics.scheme import Scheme, check_rotation, get_scheme
from fp4convert.numerics.swizzle import swizzle_scales, unswizzle_scales

SchemeName = Literal["nvfp4", "mxfp4"]
Rotation = Literal["had16"]
ScaleLayout = Literal["linear", "swizzled"]
Backend = Literal["auto", "reference", "cpu", "cuda"]
BACKENDS = ("auto", "reference", "cpu", "cuda")


@dataclass(frozen=True)
class QuantizedTensor:
    """An FP4 weight: packed E2M1 nibbles, block scales and (NVFP4) the per-matrix global scale."""

    packed: torch.Tensor  # uint8 [..., M, K/2]
    scale: torch.Tensor  # float8_e4m3fn (nvfp4) / uint8 E8M0 (mxfp4); [..., M, K/bs] or swizzled [..., Mp, nbp]
    global_scale: torch.Tensor | None  # fp32, shape = leading dims (0-dim for a matrix); None for mxfp4
    scheme: SchemeName
    rotate: Rotation | None = None
    scale_layout: ScaleLayout = "linear"
    scale_rule: str | None = None  # how block scales were chosen (None: the scheme's default)

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the original weight."""
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)

    @property
    def block_size(self) -> int:
        return get_scheme(self.scheme).block_size

    def matrix(self, i: int) -> QuantizedTensor:
        """Matrix ``i`` of a batch ``[B, M, K]`` (its own packed codes, scales and global scale)."""
        gs = None if self.global_scale is None else self.global_scale[i]
        return QuantizedTensor(self.packed[i], self.scale[i], gs, self.scheme, self.rotate, self.scale_layout,
                               self.scale_rule)

    def linear_scale(self) -> torch.Tensor:
        """The block scales in the linear [..., M, K/bs] layout, whatever layout they are stored in."""
        if self.scale_layout == "linear":
            return self.scale
        m, k = self.shape[-2:]
        return unswizzle_scales(self.scale, m, k // self.block_size)


def _check_options(scheme: str | Scheme, rotate: str | None, scale_layout: str, backend: str) -> Scheme:
    """Bad options are ConfigError (exit 2), raised before any work (valid ones are remembered: a
    public-API call's host time is exposed between kernels)."""
    try:
        return _checked_options(scheme, rotate, scale_layout, backend)
    except TypeError:  # an unhashable option: checked uncached, for its own ConfigError
        return _checked_options.__wrapped__(scheme, rotate, scale_layout, backend)


@functools.lru_cache(maxsize=64)
def _checked_options(scheme: str | Scheme, rotate: str | None, scale_layout: str, backend: str) -> Scheme:
    s = get_scheme(scheme)
    check_rotation(rotate)
    if scale_layout not in ("linear", "swizzled"):
        raise ConfigError(f"unknown scale layout {scale_layout!r}; expected 'linear' or 'swizzled'")
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    return s


def _use_cuda(x: torch.Tensor, backend: str) -> bool:
    if backend == "cuda":
        if not x.is_cuda:
            raise ConfigError("backend='cuda' needs a CUDA tensor; move it with .cuda() or use 'auto'")
        return True
    return backend == "auto" and x.is_cuda


_ops = None


def _cuda_ops():
    """The kernels' module, imported only when a CUDA tensor needs it (never at package import);
    kept after the first call (an import statement costs ~1 us, a public-API call's budget is ~25)."""
    global _ops
    if _ops is None:
        from fp4convert.kernels.cuda import ops

        _ops = ops
    return _ops


def _batch_ops(x: torch.Tensor, backend: str):
    """The batched backend for x ([B, M, K] interface), or None for the reference."""
    if _use_cuda(x, backend):
        return _cuda_ops()
    if backend == "cpu" or (backend == "auto" and x.device.type == "cpu"):
        if x.device.type != "cpu":
            raise ConfigError(f"backend='cpu' needs a CPU tensor, got one on {x.device}")
        from fp4convert.kernels import cpu

        return cpu
    return None


def _as_batch(x: torch.Tensor) -> torch.Tensor:
    """[..., M, K] -> contiguous [B, M, K] for the kernels."""
    return x.reshape(-1, *x.shape[-2:]).contiguous()


def amax(x: torch.Tensor, *, rotate: Rotation | None = None, backend: Backend = "auto") -> torch.Tensor:
    """max|x| per matrix in fp32 (of the rotated values with ``rotate``): pass 1 of the pipeline.

    Fused groups take the max of their members' amax and hand it to :func:`quantize` as
    ``global_amax``. NaN/Inf propagate, so callers can refuse the tensor.
    """
    _check_options("nvfp4", rotate, "linear", backend)
    if x.dim() < 2:
        raise ShapeError(f"expected a weight of shape [..., M, K], got shape {tuple(x.shape)}")
    ops = _batch_ops(x, backend)
    if ops is None:
        return ref.tensor_amax(x, rotate)
    if rotate and x.shape[-1] % ref.HAD16_SIZE:
        raise ShapeError(f"Had16 needs K divisible by 16, got K={x.shape[-1]}")
    return ops.amax(_as_batch(x), rotate).reshape(x.shape[:-2])


def quantize(
    x: torch.Tensor,
    scheme: SchemeName | Scheme = "nvfp4",
    *,
    rotate: Rotation | None = None,
    global_amax: torch.Tensor | float | None = None,
    scale_layout: ScaleLayout = "linear",
    scale_rule: str | None = None,
    backend: Backend = "auto",
    input_weight: torch.Tensor | None = None,
) -> QuantizedTensor:
    """Quantize a bf16/fp16/fp32 weight ``[..., M, K]`` (blocks along K) to NVFP4 or MXFP4.

    Leading dims are independent matrices, each with its own global scale unless ``global_amax``
    (the max |x| of a fused group, after rotation) is given. ``scale_rule`` picks the block scales
    (scheme.py lists each scheme's rules; None is the scheme's default); the global scale never
    depends on it. ``input_weight`` (fp32 [K], finite, >= 0; one for every matrix of x): each input
    channel's weight in the search rules' block error, e.g. the mean square of the layer's input
    channel (docs/numerics.md "Input weights"; in the rotated domain with ``rotate``); rules without
    a search (max, floor, rceil) ignore it, and None gives the unweighted bytes. Raises
    NonFiniteError for NaN/Inf, ShapeError when K is not a multiple of the block size and
    QuantizationError for a malformed input weight; bad options raise ConfigError before any work.
    """
    s = _check_options(scheme, rotate, scale_layout, backend)
    rule = s.check_rule(scale_rule)
    if not s.global_scale and global_amax is not None:
        raise ConfigError(f"{s.name.upper()} has no global scale; global_amax applies to NVFP4 only")
    if input_weight is not None:
        ref.check_shape(x, s.block_size)
        ref.check_input_weight(input_weight, x.shape[-1], s.block_size)  # the values, once, for every backend
    if x.is_cuda and (backend == "auto" or backend == "cuda"):  # the kernels: the fewest host steps
        if x.dim() < 2 or x.shape[-1] % s.block_size or not x.is_floating_point():
            ref.check_shape(x, s.block_size)  # raises, saying what to do
        return _quantize_cuda(x, s, rotate, global_amax, scale_layout, rule, input_weight)
    ref.check_shape(x, s.block_size)
    ops = _batch_ops(x, backend)
    if ops is not None:
        return _quantize_batched(ops, x, s, rotate, global_amax, scale_layout, rule, input_weight)
    if input_weight is not None:
        input_weight = input_weight.to(x.device)
    if s.global_scale:
        packed, scale, gs = ref.nvfp4_quantize(x, global_amax, rotate, scale_rule=rule, input_weight=input_weight)
    else:
        (packed, scale), gs = ref.mxfp4_quantize(x, rotate, scale_rule=rule, input_weight=input_weight), None
    if scale_layout == "swizzled":
        scale = swizzle_scales(scale)
    return QuantizedTensor(packed, scale, gs, s.name, rotate, scale_layout, rule)


def _group_amax(x: torch.Tensor, s: Scheme, global_amax) -> torch.Tensor | None:
    """``global_amax`` as an fp32 tensor on x's device with one value per matrix (None: none given)."""
    if not s.global_scale or global_amax is None:
        return None
    lead = x.shape[:-2]
    a = global_amax
    if not (isinstance(a, torch.Tensor) and a.dtype == torch.float32 and a.get_device() == x.get_device()):
        a = torch.as_tensor(global_amax, dtype=torch.float32).to(x.device, non_blocking=True)
    if a.numel() != 1 or len(lead) and math.prod(lead) != 1:
        a = a.expand(lead).contiguous()  # one per matrix (a group's amax broadcast)
    return a


def _quantize_cuda(
    x: torch.Tensor, s: Scheme, rotate: Rotation | None, global_amax, scale_layout: ScaleLayout, rule: str,
    input_weight: torch.Tensor | None = None,
) -> QuantizedTensor:
    """The kernels take [..., M, K] as is, compute gs from the amax (pass 1 first when none is given)
    and flag a non-finite amax or block in this thread's mapped flags: launch, the bookkeeping below
    while the kernel runs, then one stream sync."""
    ops = _cuda_ops()
    packed, scale, gs, flagged = ops.quantize_checked(x, s.name, _group_amax(x, s, global_amax), rotate,
                                                      scale_layout == "swizzled", s.rule(rule).code,
                                                      input_weight)
    q = QuantizedTensor(packed, scale, gs, s.name, rotate, scale_layout, rule)
    if flagged():
        raise _nonfinite(x, rotate)
    return q


def _quantize_batched(
    ops, x: torch.Tensor, s: Scheme, rotate: Rotation | None, global_amax, scale_layout: ScaleLayout, rule: str,
    input_weight: torch.Tensor | None = None,
) -> QuantizedTensor:
    """The CPU backend: pass 1 (amax, unless the group's is given) and pass 2, one check at the end."""
    lead = x.shape[:-2]
    amax_b = _group_amax(x, s, global_amax)
    swizzle = scale_layout == "swizzled"
    xb = _as_batch(x)  # the CPU ops take [B, M, K] and gs [B]
    gs = bad = None
    if s.global_scale:
        group_amax = ops.amax(xb, rotate) if amax_b is None else amax_b.reshape(-1)
        bad = None if amax_b is None else ~torch.isfinite(amax_b).all()
        gs = ref.global_scale(group_amax)
    if input_weight is None:
        packed, scale, nonfinite = ops.quantize(xb, s.name, gs, rotate, swizzle, rule)
    else:  # the torch path (a compiled CPU kernel, where there is one, runs the unweighted rules only)
        packed, scale, nonfinite = ops.quantize_input_weighted(xb, s.name, gs, rotate, swizzle, rule,
                                                               input_weight.to(x.device, torch.float32))
    bad = nonfinite if bad is None else nonfinite | bad
    q = QuantizedTensor(packed.reshape(*lead, *packed.shape[-2:]), scale.reshape(*lead, *scale.shape[-2:]),
                        None if gs is None else gs.reshape(lead), s.name, rotate, scale_layout, rule)
    if bool(bad):
        raise _nonfinite(x, rotate)
    return q


def _nonfinite(x: torch.Tensor, rotate: Rotation | None) -> NonFiniteError:
    """Why quantizing ``x`` met NaN/Inf (computed on this failure path only): the source holds them, or a
    finite source near the fp32 limit overflowed in the rotation."""
    if rotate and bool(torch.isfinite(x).all()):
        a = float(x.abs().amax())
        return RotationOverflowError(f"the {rotate} rotation overflowed fp32: the tensor is finite (max |x| {a:.3g}) "
                                     f"but a rotated value reaches up to {HAD16_GAIN:g}x that; quantize it without "
                                     "rotation")
    return NonFiniteError("the tensor holds NaN or Inf; FP4 cannot represent it (fix or exclude the tensor)")


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.bfloat16, *, backend: Backend = "auto") -> torch.Tensor:
    """Back to a dense weight: fp32 arithmetic, the rotation undone, then cast to ``dtype``."""
    s = _check_options(q.scheme, q.rotate, q.scale_layout, backend)
    if _use_cuda(q.packed, backend):
        lead = q.packed.shape[:-2]
        gs = None if q.global_scale is None else q.global_scale.reshape(-1).to(torch.float32).contiguous()
        out = _cuda_ops().dequantize(
            _as_batch(q.packed),
            _as_batch(q.scale),
            gs,
            q.scheme,
            q.rotate,
            q.scale_layout == "swizzled",
            dtype,
        )
        return out.reshape(*lead, *out.shape[-2:])
    scale = q.linear_scale()
    if s.global_scale:
        if q.global_scale is None:
            raise QuantizationError("an NVFP4 tensor needs its global scale to be dequantized")
        w = ref.nvfp4_dequantize(q.packed, scale, q.global_scale, q.rotate)
    else:
        w = ref.mxfp4_dequantize(q.packed, scale, q.rotate)
    return w.to(dtype)


INPUT_DECODES = ("fp8_block", "fp8_scaled", "mxfp4_blocks", "int4_pack", "nvfp4", "mxfp4")


def dequantize_input(kind: str, tensors: list[torch.Tensor], *, block: tuple[int, int] | None = None,
                     group: int | None = None, cols: int | None = None, zero_point: bool = False,
                     swizzled: bool = False, decode_global: bool = False, backend: Backend = "auto") -> torch.Tensor:
    """The exact fp32 weight a quantized INPUT encodes, on the tensors' device (docs/formats.md "Sources").

    ``tensors`` are the on-disk tensors, the main one first: FP8 ``weight`` then its scale (``block``: the
    block-scaled kind's block); gpt-oss ``blocks``, ``scales``; INT4 pack-quantized ``weight_packed``,
    ``weight_scale``, the packed ``weight_zero_point`` (``zero_point``) and ``weight_shape`` when present
    (``cols``: the row length; ``group``: weights per scale, None for one per row or tensor); FP4 (``nvfp4``,
    ``mxfp4``) the packed codes, the block scales (``swizzled``: in the 128x4 layout) and NVFP4's global
    (``decode_global``: stored as the decode scale 1/gs, ModelOpt's). Tensors past those are ignored. FP8
    and gpt-oss CUDA tensors use the kernels; the other kinds are the reference's torch arithmetic on any
    device (integer unpacking and one fp32 multiply: the same bits everywhere).
    """
    if kind not in INPUT_DECODES:
        raise ConfigError(f"unknown input encoding {kind!r}; expected one of {', '.join(INPUT_DECODES)}")
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    main = tensors[0]
    if kind == "int4_pack":
        return _int4_input(tensors, cols, group, zero_point)
    if kind in ("nvfp4", "mxfp4"):
        return _fp4_input(kind, tensors, swizzled, decode_global)
    if _use_cuda(main, backend):
        ops = _cuda_ops()
        if kind == "fp8_block":
            return ops.decode_fp8_block(main, tensors[1], block)
        if kind == "fp8_scaled":
            return ops.decode_fp8_scaled(main, tensors[1])
        return ops.decode_mxfp4_blocks(main, tensors[1])
    if kind == "fp8_block":
        return ref.fp8_block_dequantize(main, tensors[1], block)
    if kind == "fp8_scaled":
        return ref.fp8_scaled_dequantize(main, tensors[1])
    return ref.mxfp4_blocks_dequantize(main, tensors[1])


def _int4_input(tensors: list[torch.Tensor], cols: int | None, group: int | None, zero_point: bool) -> torch.Tensor:
    """INT4 pack-quantized: decoded, then checked against its ``weight_shape`` when it has one."""
    packed = tensors[0]
    if cols is None:
        raise ConfigError("an INT4 pack-quantized input needs its row length (cols)")
    zp = tensors[2] if zero_point else None
    w = ref.int4_pack_dequantize(packed, tensors[1], cols, group, zp)
    rest = tensors[3 if zero_point else 2:]
    if rest:  # weight_shape: the shape compressed-tensors recorded (what the header-only plan inferred)
        recorded = [int(v) for v in rest[0].reshape(-1).tolist()]
        if recorded != list(w.shape):
            raise ShapeError(f"weight_shape says {recorded}, the packed weight and its scales give {list(w.shape)} "
                             "(a row length that is not a multiple of 8 cannot be told from the headers)")
    return w


def _fp4_input(kind: str, tensors: list[torch.Tensor], swizzled: bool, decode_global: bool) -> torch.Tensor:
    """An FP4 checkpoint's weight, each format's own decode (the rotation, if any, is not undone)."""
    packed, scale = tensors[0], tensors[1]
    if packed.dim() < 2:
        raise ShapeError(f"expected packed codes [..., M, K/2], got {tuple(packed.shape)}")
    m, k = packed.shape[-2], packed.shape[-1] * 2
    s = get_scheme(kind)
    if swizzled:
        scale = unswizzle_scales(scale, m, k // s.block_size)
    if not s.global_scale:
        return ref.mxfp4_dequantize(packed, scale.view(torch.uint8))
    if len(tensors) < 3:
        raise ShapeError("an NVFP4 weight needs its global scale to be decoded")
    g = tensors[2].to(torch.float32)
    if decode_global:
        return ref.nvfp4_dequantize_decode_global(packed, scale, g)
    return ref.nvfp4_dequantize(packed, scale, g.reshape(packed.shape[:-2]))


def as_bytes(t: torch.Tensor) -> memoryview:
    """A host tensor's bytes (made contiguous first), as the shards take them; the view keeps the
    tensor alive (a memoryview holds its exporter, and the exporter here holds the tensor)."""
    t = t.detach().contiguous()
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    raw = (ctypes.c_char * n).from_address(t.data_ptr())
    raw._tensor = t  # type: ignore[attr-defined]
    return memoryview(raw).cast("B")
