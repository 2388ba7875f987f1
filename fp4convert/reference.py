"""The numerics reference: SPEC.md in pure PyTorch, in the kernels' order of operations.

This module is the readable source of truth that every fast path is tested against bit for bit.
It imports no compiled code and runs on any torch device. Every arithmetic step is one IEEE fp32
operation with round-to-nearest-even, written in the order SPEC.md fixes; two expressions that are
equal on paper can round differently, so do not "simplify" them.

Two points where SPEC.md is silent, fixed here for every backend:
- ``gs = min(2688 / amax, FLT_MAX)`` and ``r = min(gs / sf, FLT_MAX)``: without the clamps a tensor with
  amax below ~4e-33 gives ``r = inf`` and ``0 * inf = NaN``, whose sign bit differs between CPUs and
  GPUs. For every other tensor the clamps change nothing.
- The E2M1 sign is the sign bit of ``y = x * r``; ``y`` is never NaN thanks to the clamps.
"""

from __future__ import annotations

import torch

from .errors import NonFiniteError, ShapeError

NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
HAD16_SIZE = 16

E2M1_MAX = 6.0
E4M3_MAX = 448.0
NVFP4_AMAX_TO_GS = 2688.0  # E2M1_MAX * E4M3_MAX
FLT_MAX = torch.finfo(torch.float32).max

# Magnitudes of E2M1 codes 0..7; codes 8..15 are the same magnitudes negated.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

_F32 = torch.float32


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The raw int32 bit pattern of an fp32 tensor."""
    return x.contiguous().view(torch.int32)


def _from_bits(b: torch.Tensor) -> torch.Tensor:
    return b.to(torch.int32).contiguous().view(_F32)


# ---------------------------------------------------------------------------------------------
# E2M1 elements
# ---------------------------------------------------------------------------------------------

def e2m1_encode(y: torch.Tensor) -> torch.Tensor:
    """fp32 -> E2M1 codes (uint8, 0..15): round half to even, saturate at 6, keep the sign bit.

    The predicate sum is SPEC.md's rule: each ``>`` sits on a tie that rounds down (to an even
    mantissa) and each ``>=`` on a tie that rounds up.
    """
    y = y.to(_F32)
    a = y.abs()
    idx = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75)
        + (a > 1.25)
        + (a >= 1.75)
        + (a > 2.5)
        + (a >= 3.5)
        + (a > 5.0)
    ).to(torch.uint8)
    sign = (_bits(y) < 0).to(torch.uint8)  # the sign bit itself, so -0.0 gives 0x8
    return idx | (sign << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes -> fp32 values (exact)."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=_F32, device=codes.device)
    table[8] = -0.0
    return table[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] bytes: element 2j in the low nibble, 2j+1 in the high one."""
    if codes.shape[-1] % 2:
        raise ShapeError(f"cannot pack an odd number of E2M1 codes ({codes.shape[-1]})")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] codes."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


# ---------------------------------------------------------------------------------------------
# Block scales
# ---------------------------------------------------------------------------------------------

def e4m3_encode(s: torch.Tensor) -> torch.Tensor:
    """Non-negative fp32 -> E4M3 (float8_e4m3fn) bits as uint8: RNE, saturating at 448, subnormals kept.

    Written out on the bits so the rule is visible; the tests check it against torch's own
    ``float8_e4m3fn`` cast on every boundary.
    """
    s = torch.clamp(s.to(_F32), max=E4M3_MAX)
    if bool((s < 0).any()):
        raise ValueError("E4M3 block scales are non-negative by construction")
    b = _bits(s)
    exp = (b >> 23) & 0xFF  # biased fp32 exponent
    # Normal E4M3 (s >= 2^-6): keep 3 mantissa bits, rounding the 20 dropped bits half to even.
    mant = b & 0x7FFFFF
    keep = mant >> 20
    rest = mant & 0xFFFFF
    round_up = (rest > 0x80000) | ((rest == 0x80000) & ((keep & 1) == 1))
    normal = (((exp - 127 + 7) << 3) | keep) + round_up.to(torch.int32)  # a carry bumps the exponent
    # Subnormal E4M3 (s < 2^-6): code = round_half_even(s / 2^-9); 2^-9 scaling is exact.
    sub = torch.round(s * 512.0).to(torch.int32)  # torch.round is half-to-even; 8 means 2^-6 (= code 8)
    code = torch.where(exp >= 127 - 6, normal, sub)
    return code.clamp(max=0x7E).to(torch.uint8)


def e4m3_decode(code: torch.Tensor) -> torch.Tensor:
    """E4M3 bits (uint8 or float8_e4m3fn) -> fp32 (exact; 0x7F/0xFF are NaN)."""
    if code.dtype == torch.float8_e4m3fn:
        code = code.view(torch.uint8)
    c = code.to(torch.int32)
    e = (c >> 3) & 0xF
    m = (c & 7).to(_F32)
    mag = torch.where(e == 0, m * 2.0**-9, (8.0 + m) * pow2_f32(e - 10))
    mag = torch.where((c & 0x7F) == 0x7F, torch.full_like(mag, float("nan")), mag)
    return torch.where((c & 0x80) != 0, -mag, mag)


def e8m0_encode_from_bmax(bmax: torch.Tensor) -> torch.Tensor:
    """MXFP4 scale exponent (OCP floor rule): biased_exponent(bmax) - 2, clamped to [0, 254]; 0 for 0."""
    field = (_bits(bmax.to(_F32)) >> 23) & 0xFF
    e = (field - 2).clamp(0, 254)
    return torch.where(bmax == 0, torch.zeros_like(e), e).to(torch.uint8)


def pow2_f32(k: torch.Tensor) -> torch.Tensor:
    """Exact fp32 2^k for integer k in [-149, 127], built from bits (no libm)."""
    k = k.to(torch.int32)
    normal = _from_bits((k + 127).clamp(1, 254) << 23)
    subnormal = _from_bits(torch.ones_like(k) << (k + 149).clamp(0, 22))
    return torch.where(k >= -126, normal, subnormal)


def e8m0_decode(e: torch.Tensor) -> torch.Tensor:
    """E8M0 byte -> fp32 2^(e-127) (exact; 255 is NaN)."""
    e = e.to(torch.int32)
    v = pow2_f32(e - 127)
    return torch.where(e == 255, torch.full_like(v, float("nan")), v)


# ---------------------------------------------------------------------------------------------
# Had16 rotation
# ---------------------------------------------------------------------------------------------

def had16(x: torch.Tensor) -> torch.Tensor:
    """16-point fast Walsh-Hadamard transform along the last dim, per block of 16, scaled by 0.25.

    Exactly SPEC.md section 4's butterflies (h = 1, 2, 4, 8; v[i] = a + b, v[i+h] = a - b). The
    transform is orthogonal and symmetric, so it is its own inverse.
    """
    if x.shape[-1] % HAD16_SIZE:
        raise ShapeError(f"Had16 needs K divisible by 16, got K={x.shape[-1]}")
    lead = x.shape[:-1]
    v = x.to(_F32).reshape(*lead, -1, HAD16_SIZE)
    for h in (1, 2, 4, 8):
        pairs = v.reshape(*v.shape[:-1], HAD16_SIZE // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        v = torch.stack((a + b, a - b), dim=-2).reshape(v.shape)
    return (v * 0.25).reshape(x.shape)


inverse_had16 = had16


# ---------------------------------------------------------------------------------------------
# Shared checks
# ---------------------------------------------------------------------------------------------

def check_shape(x: torch.Tensor, block: int) -> None:
    """Refuse what the scheme cannot represent, with a message that says what to do."""
    if x.dim() < 2:
        raise ShapeError(f"expected a weight of shape [..., M, K], got shape {tuple(x.shape)}")
    if x.shape[-1] % block:
        raise ShapeError(
            f"K={x.shape[-1]} (the last dim) is not a multiple of the block size {block}; "
            "leave this tensor unquantized"
        )
    if not x.is_floating_point():
        raise ShapeError(f"expected a floating-point tensor, got {x.dtype}")


def tensor_amax(x: torch.Tensor, rotate: str | None = None) -> torch.Tensor:
    """max|x| per matrix (shape = leading dims) in fp32, of the rotated values when rotate is set.

    NaN and Inf propagate (torch.amax keeps NaN), so callers can refuse non-finite tensors.
    """
    v = x.to(_F32)
    if rotate == "had16":
        v = had16(v)
    if v.numel() == 0:
        return torch.zeros(x.shape[:-2], dtype=_F32, device=x.device)
    return v.abs().amax(dim=(-2, -1))


def global_scale(amax: torch.Tensor) -> torch.Tensor:
    """NVFP4 encode scale: gs = 2688 / amax (1 for amax == 0), clamped to FLT_MAX."""
    amax = amax.to(_F32)
    # A true division on the device. (`2688.0 / amax` is reciprocal-then-multiply in torch, which
    # rounds differently; torch.tensor(2688.0, device=...) would be a blocking host-to-device copy.)
    gs = torch.clamp(torch.full_like(amax, NVFP4_AMAX_TO_GS) / amax, max=FLT_MAX)
    return torch.where(amax == 0, torch.ones_like(gs), gs)


def _check_finite(amax: torch.Tensor) -> None:
    if not bool(torch.isfinite(amax).all()):
        raise NonFiniteError("the tensor holds NaN or Inf; FP4 cannot represent it (fix or exclude the tensor)")


# ---------------------------------------------------------------------------------------------
# NVFP4
# ---------------------------------------------------------------------------------------------

def nvfp4_quantize(
    x: torch.Tensor, global_amax: torch.Tensor | float | None = None, rotate: str | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., M, K] -> (packed uint8 [..., M, K/2], scale float8_e4m3fn [..., M, K/16], gs fp32 [...]).

    ``global_amax`` replaces each matrix's own amax (fused groups share it); it broadcasts against
    the leading dims.
    """
    check_shape(x, NVFP4_BLOCK)
    v = x.to(_F32)
    if rotate == "had16":
        v = had16(v)
    own_amax = v.abs().amax(dim=(-2, -1)) if v.numel() else torch.zeros(v.shape[:-2], dtype=_F32)
    _check_finite(own_amax)
    # 1. amax of the tensor, or of its fused group.
    if global_amax is None:
        amax = own_amax
    else:
        amax = torch.as_tensor(global_amax, dtype=_F32, device=x.device).expand(own_amax.shape)
        _check_finite(amax)
    # 2. gs = 2688 / amax.
    gs = global_scale(amax)
    gsb = gs[..., None, None]
    # 3. Block scale: s = (gs * bmax) / 6, then E4M3.
    blocks = v.reshape(*v.shape[:-1], -1, NVFP4_BLOCK)
    bmax = blocks.abs().amax(dim=-1)
    s = (gsb * bmax) / E2M1_MAX
    scale_bits = e4m3_encode(s)
    # 4. r = gs / sf (0 for a zero scale).
    sf = e4m3_decode(scale_bits)
    r = torch.where(sf > 0, torch.clamp(gsb / sf, max=FLT_MAX), torch.zeros_like(sf))
    # 5. Elements.
    codes = e2m1_encode(blocks * r[..., None])
    packed = pack_nibbles(codes.reshape(v.shape))
    return packed, scale_bits.view(torch.float8_e4m3fn), gs


def nvfp4_dequantize(
    packed: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor, rotate: str | None = None
) -> torch.Tensor:
    """Inverse of nvfp4_quantize in fp32: value(code) * (sf / gs), then the inverse rotation."""
    vals = e2m1_decode(unpack_nibbles(packed))
    vals = vals.reshape(*vals.shape[:-1], -1, NVFP4_BLOCK)
    mult = e4m3_decode(scale) / gs.to(_F32)[..., None, None]
    w = (vals * mult[..., None]).reshape(*packed.shape[:-1], -1)
    return inverse_had16(w) if rotate == "had16" else w


# ---------------------------------------------------------------------------------------------
# MXFP4
# ---------------------------------------------------------------------------------------------

def mxfp4_quantize(x: torch.Tensor, rotate: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., M, K] -> (packed uint8 [..., M, K/2], scale uint8 E8M0 [..., M, K/32])."""
    check_shape(x, MXFP4_BLOCK)
    v = x.to(_F32)
    if rotate == "had16":
        v = had16(v)
    blocks = v.reshape(*v.shape[:-1], -1, MXFP4_BLOCK)
    bmax = blocks.abs().amax(dim=-1)
    _check_finite(bmax)
    e = e8m0_encode_from_bmax(bmax)
    mult = pow2_f32(127 - e.to(torch.int32))  # exact power of two
    codes = e2m1_encode(blocks * mult[..., None])
    return pack_nibbles(codes.reshape(v.shape)), e


def mxfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor, rotate: str | None = None) -> torch.Tensor:
    """Inverse of mxfp4_quantize in fp32: value(code) * 2^(e-127), then the inverse rotation."""
    vals = e2m1_decode(unpack_nibbles(packed))
    vals = vals.reshape(*vals.shape[:-1], -1, MXFP4_BLOCK)
    w = (vals * e8m0_decode(scale)[..., None]).reshape(*packed.shape[:-1], -1)
    return inverse_had16(w) if rotate == "had16" else w
