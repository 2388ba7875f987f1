"""The numerics reference: docs/numerics.md in pure PyTorch, in the kernels' order of operations.

This module is the readable source of truth that every fast path is tested against bit for bit.
It imports no compiled code and runs on any torch device. Every arithmetic step is one IEEE fp32
operation with round-to-nearest-even, written in the order docs/numerics.md fixes; two expressions that are
equal on paper can round differently, so do not "simplify" them.

Scale rules (docs/numerics.md "Scale rules", "NVFP4", "MXFP4"): the per-block scale is a choice; the
search rules try a few candidate scales per block and keep the one whose squared block error (fp32,
summed in element order, see :func:`block_error`) is lowest. The global scale never changes.

Two points the source specification left open, fixed here for every backend (docs/numerics.md states both):
- ``gs = min(2688 / amax, FLT_MAX)`` and ``r = min(gs / sf, FLT_MAX)``: without the clamps a tensor with
  amax below ~4e-33 gives ``r = inf`` and ``0 * inf = NaN``, whose sign bit differs between CPUs and
  GPUs. For every other tensor the clamps change nothing.
- The E2M1 sign is the sign bit of ``y = x * r``; ``y`` is never NaN thanks to the clamps.
"""

from __future__ import annotations

import torch

from fp4convert.errors import NonFiniteError, QuantizationError, ShapeError
from fp4convert.numerics.scheme import SCHEMES

NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
HAD16_SIZE = 16

E2M1_MAX = 6.0
E4M3_MAX = 448.0
NVFP4_AMAX_TO_GS = 2688.0  # E2M1_MAX * E4M3_MAX
FLT_MAX = torch.finfo(torch.float32).max

# Magnitudes of E2M1 codes 0..7; codes 8..15 are the same magnitudes negated.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# The scale rules and each scheme's default, as numerics/scheme.py states them (names in kernel-code order).
SCALE_RULES: dict[str, tuple[str, ...]] = {name: s.scale_rules for name, s in SCHEMES.items()}
DEFAULT_SCALE_RULE: dict[str, str] = {name: s.default_rule for name, s in SCHEMES.items()}

E4M3_MAX_CODE = 0x7E  # 448; 0x7F is NaN
E8M0_MAX_EXP = 254  # 2^127; 255 is NaN

_F32 = torch.float32


def check_scale_rule(scheme: str, scale_rule: str | None) -> str:
    """The rule to apply (None -> the scheme's default); QuantizationError for an invalid combination.

    Called before any work, so a bad option never leaves a half-written output behind.
    """
    if scheme not in SCALE_RULES:
        raise QuantizationError(f"unknown scheme {scheme!r}; expected one of {', '.join(SCALE_RULES)}")
    if scale_rule is None:
        return DEFAULT_SCALE_RULE[scheme]
    if scale_rule not in SCALE_RULES[scheme]:
        other = [s for s, rules in SCALE_RULES.items() if scale_rule in rules and s != scheme]
        hint = f" ({scale_rule!r} is a rule of {other[0]})" if other else ""
        raise QuantizationError(
            f"scale rule {scale_rule!r} does not apply to {scheme}{hint}; "
            f"expected one of {', '.join(SCALE_RULES[scheme])}"
        )
    return scale_rule


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

    The predicate sum is docs/numerics.md's rule: each ``>`` sits on a tie that rounds down (to an even
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
    table = _E2M1_TABLES.get(codes.device)
    if table is None:  # made once per device (GPTQ's sweep decodes one column at a time)
        table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=_F32, device=codes.device)
        table[8] = -0.0
        _E2M1_TABLES[codes.device] = table
    return table[codes.long()]


_E2M1_TABLES: dict[torch.device, torch.Tensor] = {}


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

    Exactly docs/numerics.md "Had16 rotation"'s butterflies (h = 1, 2, 4, 8; v[i] = a + b, v[i+h] = a - b). The
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
# Block error (shared by every search rule)
# ---------------------------------------------------------------------------------------------

def _div(a: torch.Tensor, constant: float) -> torch.Tensor:
    """a / constant as a true fp32 division on any device (CUDA turns a division by a Python scalar
    into a multiply by its reciprocal, which rounds differently for 6)."""
    return a / torch.full_like(a, constant)


def block_error(blocks: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, weighted: bool = False,
                input_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Squared error of each block [..., n] under decode step d [...], in docs/numerics.md "Scale rules"'s order.

    ``err = 0; for i in 0..n-1: e = value(code_i) * d - x_i; err = err + e * e``, every step one fp32
    operation, elements in ascending order. torch's sum would add in another order (and round
    differently), so the loop is explicit: one fp32 op per line across all blocks at once.

    ``weighted`` (the ``wmse`` rules): each error is first multiplied by its weight, ``f = e * x_i;
    err = err + f * f``, i.e. the squared error weighted by x_i^2. A weight's share of a layer's output
    error grows with its magnitude (large weights sit on the inputs that matter, and are few per
    block), and the model-level benchmark shows this measure choosing better scales than plain MSE.

    ``input_weight`` (broadcastable to blocks, fp32, finite, >= 0): the weight of each element's
    input channel, ``err = err + (e * e) * c_i``. A linear's output error is ``sum_j c_j * e_j^2``
    summed over its rows when c_j is the mean square of input channel j (a diagonal model of the
    activations); the model-level benchmark measures what this choice wins. ``None`` is the
    unweighted error (a weight of exactly 1 gives the same bits: multiplying by 1 is exact).
    """
    vals = e2m1_decode(codes)
    err = torch.zeros(blocks.shape[:-1], dtype=_F32, device=blocks.device)
    for i in range(blocks.shape[-1]):
        e = vals[..., i] * d - blocks[..., i]
        if weighted:
            e = e * blocks[..., i]
        sq = e * e
        if input_weight is not None:
            sq = sq * input_weight[..., i]
        err = err + sq
    return err


def check_input_weight(input_weight: torch.Tensor | None, k: int, block: int) -> torch.Tensor | None:
    """The per-input-channel weights as fp32 [K/block, block] (broadcast over rows), or None.

    Refused (QuantizationError) unless 1-D with K entries, finite and >= 0: a NaN weight would make
    every candidate's error NaN and the choice arbitrary.
    """
    if input_weight is None:
        return None
    w = torch.as_tensor(input_weight)
    if w.dim() != 1 or w.shape[0] != k or not w.is_floating_point():
        raise QuantizationError(f"input_weight must be a float vector of K={k} entries, got {w.dtype} {tuple(w.shape)}")
    w = w.to(_F32)
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise QuantizationError("input_weight must be finite and >= 0 (one mean square per input channel)")
    return w.reshape(-1, block)


# ---------------------------------------------------------------------------------------------
# NVFP4
# ---------------------------------------------------------------------------------------------

def nvfp4_candidate(blocks: torch.Tensor, gsb: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [..., 16] and decode step d [...] of blocks [..., 16] under E4M3 scale bytes c [...].

    r = (sf > 0) ? min(gs / sf, FLT_MAX) : 0 encodes; d = sf / gs decodes (one fp32 division each).
    """
    sf = e4m3_decode(c)
    r = torch.where(sf > 0, torch.clamp(gsb / sf, max=FLT_MAX), torch.zeros_like(sf))
    codes = e2m1_encode(blocks * r[..., None])
    return codes, sf / gsb


def _nvfp4_choose(blocks: torch.Tensor, gsb: torch.Tensor, bmax: torch.Tensor, rule: str,
                  input_weight: torch.Tensor | None = None) -> torch.Tensor:
    """The E4M3 scale byte of every block under ``rule`` (uint8 [...]); ``input_weight`` [nb, 16]
    weights the search rules' block error (:func:`block_error`)."""
    s = gsb * bmax
    b6 = e4m3_encode(_div(s, E2M1_MAX))  # today's scale: (gs * bmax) / 6
    if rule == "max":
        return b6
    b4 = e4m3_encode(_div(s, 4.0))  # saturates at 448 like every E4M3 here

    weighted = rule == "wmse"

    def err(c: torch.Tensor) -> torch.Tensor:
        return block_error(blocks, *nvfp4_candidate(blocks, gsb, c), weighted=weighted, input_weight=input_weight)

    best, best_err = b6, err(b6)
    if rule == "4over6":
        return torch.where(err(b4) < best_err, b4, b6)  # ties keep the /6 scale
    # mse / wmse: {b6, b4, b6 - 1} (b6 - 1 on the byte, 0 stays 0); the lowest (weighted) error wins,
    # and among equal errors the larger byte (= larger scale). That pair order does not depend on the
    # order the candidates are tried in.
    for c in (b4, (b6.to(torch.int32) - 1).clamp(min=0).to(torch.uint8)):
        e = err(c)
        take = (e < best_err) | ((e == best_err) & (c > best))
        best, best_err = torch.where(take, c, best), torch.where(take, e, best_err)
    return best


def nvfp4_quantize(
    x: torch.Tensor,
    global_amax: torch.Tensor | float | None = None,
    rotate: str | None = None,
    scale_rule: str | None = "max",
    input_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., M, K] -> (packed uint8 [..., M, K/2], scale float8_e4m3fn [..., M, K/16], gs fp32 [...]).

    ``global_amax`` replaces each matrix's own amax (fused groups share it); it broadcasts against
    the leading dims. ``scale_rule`` picks each block's scale: "max" (E4M3(gs * bmax / 6)),
    "4over6", "mse" or "wmse" (docs/numerics.md); None is the default, DEFAULT_SCALE_RULE["nvfp4"].
    ``input_weight`` (fp32 [K], >= 0): each input channel's weight in the search rules' block error
    (the mean square of that input, or a data-free stand-in such as the feeding norm's gain squared),
    in the quantized (rotated) domain. The rule ``max`` has no search and ignores it.
    """
    rule = check_scale_rule("nvfp4", scale_rule)
    check_shape(x, NVFP4_BLOCK)
    iw = check_input_weight(input_weight, x.shape[-1], NVFP4_BLOCK)
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
    # 3. Block scale: s = (gs * bmax) / 6, then E4M3; a search rule may pick another byte.
    blocks = v.reshape(*v.shape[:-1], -1, NVFP4_BLOCK)
    bmax = blocks.abs().amax(dim=-1)
    scale_bits = _nvfp4_choose(blocks, gsb, bmax, rule, iw)
    # 4-5. r = gs / sf (0 for a zero scale), then the elements.
    codes, _ = nvfp4_candidate(blocks, gsb, scale_bits)
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


def nvfp4_block_errors(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor, rotate: str | None = None
) -> torch.Tensor:
    """Squared error per block (fp32 [..., M, K/16]) of a quantized weight against its source x.

    Measured in the rotated domain (where the rule chose), with :func:`block_error`'s arithmetic:
    the very value a search rule minimised, so ``inspect --verify`` can report what a rule achieved.
    ``scale`` is in the linear layout.
    """
    v = x.to(_F32)
    if rotate == "had16":
        v = had16(v)
    blocks = v.reshape(*v.shape[:-1], -1, NVFP4_BLOCK)
    codes = unpack_nibbles(packed).reshape(blocks.shape)
    d = e4m3_decode(scale) / gs.to(_F32)[..., None, None]
    return block_error(blocks, codes, d)


# ---------------------------------------------------------------------------------------------
# MXFP4
# ---------------------------------------------------------------------------------------------

def mxfp4_candidate(blocks: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [..., 32] and decode step d = 2^(c - 127) [...] of blocks under E8M0 exponents c [...]."""
    ci = c.to(torch.int32)
    codes = e2m1_encode(blocks * pow2_f32(127 - ci)[..., None])  # exact power-of-two multiply
    return codes, pow2_f32(ci - 127)  # exact, subnormal for c = 0


def _mxfp4_choose(blocks: torch.Tensor, bmax: torch.Tensor, rule: str,
                  input_weight: torch.Tensor | None = None) -> torch.Tensor:
    """The E8M0 exponent of every block under ``rule`` (uint8 [...]); ``input_weight`` [nb, 32] as
    in _nvfp4_choose."""
    e = e8m0_encode_from_bmax(bmax)  # OCP floor rule
    if rule == "floor":
        return e
    up = (e.to(torch.int32) + 1).clamp(max=E8M0_MAX_EXP).to(torch.uint8)
    if rule == "rceil":
        saturates = bmax * pow2_f32(127 - e.to(torch.int32)) > E2M1_MAX  # exact scaling, then compare
        return torch.where(saturates, up, e)
    weighted = rule == "wmse"
    err_e = block_error(blocks, *mxfp4_candidate(blocks, e), weighted=weighted, input_weight=input_weight)
    err_up = block_error(blocks, *mxfp4_candidate(blocks, up), weighted=weighted, input_weight=input_weight)
    return torch.where(err_up < err_e, up, e)  # ties keep the floor exponent


def mxfp4_quantize(
    x: torch.Tensor, rotate: str | None = None, scale_rule: str | None = "floor",
    input_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., M, K] -> (packed uint8 [..., M, K/2], scale uint8 E8M0 [..., M, K/32]).

    ``scale_rule``: "floor" (OCP), "rceil" (one exponent up when the block would saturate), "mse"
    (floor or floor + 1, the lower block error) or "wmse" (the same with the x^2-weighted error); None
    is the default, DEFAULT_SCALE_RULE["mxfp4"]. ``input_weight``: as in nvfp4_quantize (``floor`` and
    ``rceil`` have no search and ignore it).
    """
    rule = check_scale_rule("mxfp4", scale_rule)
    check_shape(x, MXFP4_BLOCK)
    iw = check_input_weight(input_weight, x.shape[-1], MXFP4_BLOCK)
    v = x.to(_F32)
    if rotate == "had16":
        v = had16(v)
    blocks = v.reshape(*v.shape[:-1], -1, MXFP4_BLOCK)
    bmax = blocks.abs().amax(dim=-1)
    _check_finite(bmax)
    e = _mxfp4_choose(blocks, bmax, rule, iw)
    codes, _ = mxfp4_candidate(blocks, e)
    return pack_nibbles(codes.reshape(v.shape)), e


def mxfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor, rotate: str | None = None) -> torch.Tensor:
    """Inverse of mxfp4_quantize in fp32: value(code) * 2^(e-127), then the inverse rotation."""
    vals = e2m1_decode(unpack_nibbles(packed))
    vals = vals.reshape(*vals.shape[:-1], -1, MXFP4_BLOCK)
    w = (vals * e8m0_decode(scale)[..., None]).reshape(*packed.shape[:-1], -1)
    return inverse_had16(w) if rotate == "had16" else w


def mxfp4_block_errors(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, rotate: str | None = None) -> torch.Tensor:
    """Squared error per block (fp32 [..., M, K/32]) of an MXFP4 weight against x (see nvfp4_block_errors)."""
    v = x.to(_F32)
    if rotate == "had16":
        v = had16(v)
    blocks = v.reshape(*v.shape[:-1], -1, MXFP4_BLOCK)
    codes = unpack_nibbles(packed).reshape(blocks.shape)
    return block_error(blocks, codes, e8m0_decode(scale))


# ---------------------------------------------------------------------------------------------
# Quantized inputs (docs/numerics.md "Quantized inputs"): exact fp32 decoders
# ---------------------------------------------------------------------------------------------
# NaN and Inf propagate (an E4M3 byte 0x7F/0xFF, an E8M0 scale of 255, a NaN scale), so the caller's
# non-finite check refuses the tensor like any other.

def _as_e4m3(w: torch.Tensor) -> torch.Tensor:
    if w.dtype == torch.uint8:
        return w.view(torch.float8_e4m3fn)
    if w.dtype != torch.float8_e4m3fn:
        raise QuantizationError(f"expected an FP8 E4M3 weight (float8_e4m3fn), got {w.dtype}")
    return w


def _as_f32_scale(scale: torch.Tensor, what: str) -> torch.Tensor:
    if not scale.is_floating_point() or scale.element_size() < 2:
        raise QuantizationError(f"{what} must be an fp32/bf16/fp16 tensor, got {scale.dtype}")
    return scale.to(_F32)  # widening is exact


def _check_leading(w: torch.Tensor, s: torch.Tensor, what: str) -> None:
    try:
        ok = torch.broadcast_shapes(s.shape[:-2], w.shape[:-2]) == w.shape[:-2]
    except RuntimeError:
        ok = False
    if not ok:
        raise ShapeError(f"{what} leading dims {tuple(s.shape[:-2])} do not match the weight's {tuple(w.shape[:-2])}")


def fp8_block_dequantize(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """FP8 block-scaled weight -> fp32: ``w[i, j] = fp32(w_e4m3[i, j]) * scale_inv[i // bm, j // bn]``.

    ``w`` [..., M, N] float8_e4m3fn (or its uint8 bits); ``scale_inv`` [..., ceil(M/bm), ceil(N/bn)]
    (edge blocks partial; leading dims are experts, broadcast per matrix); ``block`` = (bm, bn), the
    checkpoint's ``weight_block_size``. One fp32 multiply per element: exact wherever the product is.
    """
    w = _as_e4m3(w)
    bm, bn = (int(b) for b in block)
    if bm <= 0 or bn <= 0:
        raise ShapeError(f"block sizes must be positive, got {tuple(block)}")
    if w.dim() < 2 or scale_inv.dim() < 2:
        raise ShapeError(f"expected [..., M, N] weight and scales, got {tuple(w.shape)} and {tuple(scale_inv.shape)}")
    m, n = w.shape[-2:]
    expect = (-(-m // bm), -(-n // bn))
    if tuple(scale_inv.shape[-2:]) != expect:
        raise ShapeError(
            f"scale_inv {tuple(scale_inv.shape)} does not fit a weight {tuple(w.shape)} in blocks {bm}x{bn} "
            f"(expected [..., {expect[0]}, {expect[1]}])"
        )
    _check_leading(w, scale_inv, "scale_inv")
    s = _as_f32_scale(scale_inv, "scale_inv").repeat_interleave(bm, dim=-2)[..., :m, :]  # [..., M, ceil(N/bn)]
    wf = w.to(_F32)  # exact (NaN bytes stay NaN)
    if n % bn == 0:
        return (wf.reshape(*wf.shape[:-1], -1, bn) * s[..., None]).reshape(wf.shape)
    return wf * s.repeat_interleave(bn, dim=-1)[..., :n]


def fp8_scaled_dequantize(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 weight with a per-tensor or per-output-channel scale -> fp32: ``fp32(w[i, j]) * fp32(scale)[i or 0]``.

    ``scale``: one element (0-dim, [1], ...) per tensor; [..., M] or [..., M, 1] per channel (leading
    dims broadcast against the weight's; a per-expert per-tensor scale is [E, 1, 1]). bf16/fp16 scales
    are widened to fp32 first (exact).
    """
    w = _as_e4m3(w)
    if w.dim() < 2:
        raise ShapeError(f"expected a weight of shape [..., M, N], got {tuple(w.shape)}")
    s = _as_f32_scale(scale, "scale")
    m = w.shape[-2]
    if s.numel() == 1:
        s = s.reshape(())
    elif s.dim() == w.dim() and s.shape[-1] == 1 and s.shape[-2] in (1, m):
        _check_leading(w, s, "scale")
    elif s.dim() >= 1 and s.shape[-1] == m and s.dim() <= w.dim() - 1:
        s = s[..., None]
        _check_leading(w, s, "scale")
    else:
        raise ShapeError(f"scale {tuple(scale.shape)} is neither per tensor nor per output channel of a weight {tuple(w.shape)}")
    return w.to(_F32) * s


def mxfp4_blocks_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """gpt-oss MXFP4 (``*_blocks`` uint8 [..., G, 16], ``*_scales`` uint8 [..., G]) -> fp32 [..., G * 32].

    Element 32g + 2j is the low nibble of blocks[..., g, j], 32g + 2j + 1 the high one;
    ``w = value(code) * 2^(scale - 127)``, exact (a scale of 255 is NaN, and 6 * 2^127 overflows to
    Inf: both are refused downstream like any non-finite value).
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise QuantizationError(f"expected uint8 blocks and scales, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != MXFP4_BLOCK // 2 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ShapeError(
            f"expected blocks [..., G, 16] and scales [..., G], got {tuple(blocks.shape)} and {tuple(scales.shape)}"
        )
    vals = e2m1_decode(unpack_nibbles(blocks))  # [..., G, 32], low nibble first
    return (vals * e8m0_decode(scales)[..., None]).reshape(*blocks.shape[:-2], -1)


# INT4 as compressed-tensors' ``pack-quantized`` format stores it (Kimi-K2-Thinking and later): eight 4-bit
# values per int32 word, element ``8w + i`` in bits ``4i .. 4i + 3`` of word ``w`` (the low nibble first), each
# stored as the unsigned ``q + 8`` (q in [-8, 7]); rows are padded to whole words. An asymmetric zero point
# is packed the same way along the ROWS (one word holds eight rows' zero points of one group).
_INT4_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _int4_nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> int32 [..., W, 8]: each word's eight signed 4-bit values, the low nibble first."""
    if words.dtype != torch.int32:
        raise QuantizationError(f"expected int32 packed words, got {words.dtype}")
    shifts = _INT4_SHIFTS.get(words.device)
    if shifts is None:
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
        _INT4_SHIFTS[words.device] = shifts
    q = words[..., None] >> shifts
    q &= 0xF
    q -= 8
    return q


def int4_unpack(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """pack-quantized int32 [..., M, ceil(cols / 8)] -> the int32 values q [..., M, cols] in [-8, 7]."""
    if packed.dim() < 2 or packed.shape[-1] != -(-cols // 8):
        raise ShapeError(f"packed INT4 {tuple(packed.shape)} does not hold rows of {cols} values "
                         f"(expected [..., M, {-(-cols // 8)}] int32 words)")
    q = _int4_nibbles(packed)
    return q.reshape(*packed.shape[:-1], -1)[..., :cols]


def int4_unpack_zero_point(zero_point: torch.Tensor, rows: int) -> torch.Tensor:
    """A pack-quantized zero point, int32 [..., ceil(rows / 8), G] packed along the rows -> int32 [..., rows, G]."""
    if zero_point.dim() < 2 or zero_point.shape[-2] != -(-rows // 8):
        raise ShapeError(f"packed zero point {tuple(zero_point.shape)} does not hold {rows} rows "
                         f"(expected [..., {-(-rows // 8)}, G] int32 words)")
    z = _int4_nibbles(zero_point.transpose(-1, -2))  # [..., G, ceil(rows/8), 8]
    return z.reshape(*z.shape[:-2], -1)[..., :rows].transpose(-1, -2)


def int4_pack_dequantize(packed: torch.Tensor, scale: torch.Tensor, cols: int, group: int | None = None,
                         zero_point: torch.Tensor | None = None) -> torch.Tensor:
    """compressed-tensors ``pack-quantized`` INT4 -> fp32: ``w[i, j] = fp32(q[i, j] - z[i, g]) * fp32(scale[i, g])``.

    ``packed`` int32 [..., M, ceil(cols/8)]; ``scale`` fp32/bf16/fp16 [..., M, G], one per ``group`` weights
    along the row (``group``: cols / G), or one per row ([..., M, 1], channel) or per tensor (one element),
    ``group`` None; ``zero_point`` None (symmetric: z = 0) or int32 packed along the rows (see
    :func:`int4_unpack_zero_point`). ``q - z`` is an integer in [-15, 15], exact in fp32, so each element is
    one fp32 multiply: exact for a bf16 or fp16 scale (at most 4 + 11 significant bits), rounded once for
    an fp32 one. Leading dims are experts, decoded one matrix at a time.
    """
    m = packed.shape[-2] if packed.dim() >= 2 else 0
    q = int4_unpack(packed, cols)
    s = _as_f32_scale(scale, "scale")
    if s.numel() == 1:
        s = s.reshape([1] * q.dim())
    elif s.dim() != q.dim() or s.shape[-2] != m:
        raise ShapeError(f"scale {tuple(scale.shape)} is neither per group, per row nor per tensor of a weight "
                         f"{(*packed.shape[:-1], cols)}")
    else:
        _check_leading(q, s, "scale")
    g = s.shape[-1]
    if group is None and g != 1:
        raise ShapeError(f"scale {tuple(scale.shape)} has {g} groups per row but no group size was given")
    if group is not None and g * group != cols:
        raise ShapeError(f"scale {tuple(scale.shape)}: {g} groups of {group} do not cover rows of {cols} values")
    d = q.reshape(*q.shape[:-1], g, -1)
    if zero_point is not None:
        z = int4_unpack_zero_point(zero_point, m)
        if z.shape[-1] != g:
            raise ShapeError(f"zero point {tuple(zero_point.shape)} does not match scale {tuple(scale.shape)}")
        _check_leading(q, z, "zero point")
        d = d - z[..., None]
    w = d.to(_F32)
    w *= s[..., None]  # one fp32 multiply per element (in place: the weight's size once more, not twice)
    return w.reshape(q.shape)


def nvfp4_dequantize_decode_global(packed: torch.Tensor, scale: torch.Tensor, decode_scale: torch.Tensor
                                   ) -> torch.Tensor:
    """An NVFP4 weight whose global is stored as a DECODE scale (ModelOpt's ``weight_scale_2``) -> fp32:
    ``w = (value(code) * sf) * weight_scale_2``. ``value(code) * sf`` is exact in fp32 (an E2M1 value
    times an E4M3 one), so each element is the exact product rounded once, what ModelOpt's own decode
    computes. ``decode_scale``: one fp32 per matrix (shape = the leading dims, or one element)."""
    vals = e2m1_decode(unpack_nibbles(packed))
    vals = vals.reshape(*vals.shape[:-1], -1, NVFP4_BLOCK)
    sf = e4m3_decode(scale)
    if sf.shape != vals.shape[:-1]:
        raise ShapeError(f"block scales {tuple(scale.shape)} do not fit packed codes {tuple(packed.shape)} "
                         f"(expected {tuple(vals.shape[:-1])})")
    d2 = decode_scale.to(_F32).reshape(*packed.shape[:-2], 1, 1, 1) if decode_scale.numel() > 1 else \
        decode_scale.to(_F32).reshape(())
    return ((vals * sf[..., None]) * d2).reshape(*packed.shape[:-1], -1)
