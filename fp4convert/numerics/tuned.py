"""Tuned rounding (SignRound family) for NVFP4 / MXFP4: the arithmetic of docs/numerics.md "Tuned rounding".

A tuned matrix is the data-free quantizer's (:mod:`fp4convert.numerics.reference`) with two learned
changes, both within what the format stores:

- a per-weight **offset** ``v`` added to the scaled value before the E2M1 rounding, in units of the E2M1
  grid step at that value (0.5 below 2, 1 below 4, 2 above), so ``|v| <= 0.5`` can move a weight to
  either neighbour of its round-to-nearest code and no further;
- a per-block **scale move** ``t`` (in octaves of the block scale): the stored scale byte is the rule's
  byte moved by ``round(t * steps)`` byte steps, ``steps`` = 1 for E8M0 (one exponent) and 8 for E4M3 (its 8
  mantissa steps per octave), so the scale stays a byte the format can hold and the move is integer
  arithmetic on the byte (no ``exp2`` decides a byte).

:func:`quantize` makes the final bytes from a matrix, its :class:`Start` and the tuned ``(v, t)``: one fp32
multiply ``y = x * r`` (``r`` the reference's encode multiplier of the stored byte), one fp32 add of the
offset ``o = v * step`` where ``o != 0``, and the reference's E2M1 encoder. So with ``v = 0`` and ``t = 0`` it is
the data-free quantizer's bytes exactly, and given ``(v, t)`` the bytes are the same on every device.
:func:`fake_quantize` is the differentiable stand-in used while tuning: its *value* is exactly the
dequantized final weight (the bytes :func:`quantize` would write, decoded), its *gradient* that of the
straight-through estimator (the rounding treated as the identity inside [-6, 6], zero outside; the byte's
rounding treated as a continuous ``2^t`` multiplier of the decode step).

:func:`signed_step` and :func:`learning_rate` are the optimiser's arithmetic (signed gradient descent with
a linearly decaying rate), elementwise fp32 operations that give the same bits on every device; the
gradients they are fed are not (a block's backward pass is matmuls), hence docs/numerics.md's "exact where".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp4convert.errors import NonFiniteError, QuantizationError
from fp4convert.numerics import reference as ref

OFFSET_LIMIT = 0.5  # |v| in grid steps: each weight reaches the neighbours of its round-to-nearest code
SCALE_LIMIT = 1.0  # |t| in octaves: at most one E8M0 exponent, or 8 E4M3 byte steps, either way
STEPS_PER_OCTAVE = {"mxfp4": 1, "nvfp4": 8}  # byte steps per doubling of the scale (E4M3: in its normal range)
OFFSET_UNITS = ("step", "absolute")  # v in E2M1 grid steps (the default) or in units of the scaled value
_MAX_BYTE = {"mxfp4": ref.E8M0_MAX_EXP, "nvfp4": ref.E4M3_MAX_CODE}
_BLOCK = {"mxfp4": ref.MXFP4_BLOCK, "nvfp4": ref.NVFP4_BLOCK}
_F32 = torch.float32


@dataclass(frozen=True)
class Start:
    """Where a matrix's tuning starts: the scale bytes the data-free quantizer picks (a scale rule, perhaps
    input-weighted) and, NVFP4, the matrix's (fused group's) global scale, which tuning never changes."""

    scheme: str
    scale: torch.Tensor  # uint8 [..., N, K/B]: E8M0 exponents (MXFP4) or E4M3 bits (NVFP4), linear layout
    gs: torch.Tensor | None  # NVFP4: fp32 [...], 2688 / amax; MXFP4: None


@dataclass(frozen=True)
class Result:
    """A tuned matrix as the data-free quantizer returns one, and its decode (fp32, the values a reader gets)."""

    packed: torch.Tensor  # uint8 [..., N, K/2]
    scale: torch.Tensor  # NVFP4: float8_e4m3fn [..., N, K/16]; MXFP4: uint8 E8M0 [..., N, K/32]
    gs: torch.Tensor | None
    dequantized: torch.Tensor  # fp32 [..., N, K]


def start(w: torch.Tensor, scheme: str, rule: str | None = None, global_amax: torch.Tensor | float | None = None,
          input_weight: torch.Tensor | None = None) -> Start:
    """The rule's scale bytes of ``w`` [..., N, K] (fp32 values in the quantized domain, rotated already if the
    checkpoint is), exactly as :func:`~fp4convert.numerics.reference.nvfp4_quantize` /
    :func:`~fp4convert.numerics.reference.mxfp4_quantize` choose them (``rule`` None: the reference's own
    argument default is not used; the scheme's default rule is)."""
    if scheme == "nvfp4":
        _, scale, gs = ref.nvfp4_quantize(w, global_amax, None, ref.check_scale_rule(scheme, rule), input_weight)
        return Start(scheme, scale.view(torch.uint8), gs)
    if scheme == "mxfp4":
        if global_amax is not None:
            raise QuantizationError("MXFP4 has no global scale; global_amax applies to NVFP4 only")
        _, e = ref.mxfp4_quantize(w, None, ref.check_scale_rule(scheme, rule), input_weight)
        return Start(scheme, e, None)
    raise QuantizationError(f"unknown scheme {scheme!r}; expected nvfp4 or mxfp4")


def scale_bytes(s: Start, t: torch.Tensor | None) -> torch.Tensor:
    """The stored scale bytes under the scale moves ``t`` (fp32, shaped like ``s.scale``; None: no move):
    ``byte = clamp(start + round(t * steps), 0, max)``, ``round`` half to even, ``t * steps`` exact (a power
    of two), the rest integer arithmetic; ``max`` is 254 (E8M0; 255 is NaN) or 0x7E = 448 (E4M3)."""
    if t is None:
        return s.scale
    if t.shape != s.scale.shape:
        raise QuantizationError(f"scale moves of shape {tuple(t.shape)} for {tuple(s.scale.shape)} block scales")
    if not bool(torch.isfinite(t).all()):
        raise NonFiniteError("a tuned scale move is NaN or Inf")
    moved = s.scale.to(torch.int32) + torch.round(t.to(_F32) * float(STEPS_PER_OCTAVE[s.scheme])).to(torch.int32)
    return moved.clamp(0, _MAX_BYTE[s.scheme]).to(torch.uint8)


def multipliers(s: Start, byte: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(encode multiplier ``r``, decode step ``d``), fp32 [..., N, K/B], of the scale bytes ``byte``: the
    reference's. MXFP4 ``2^(127 - e)`` and ``2^(e - 127)``, exact; NVFP4 ``min(gs / sf, FLT_MAX)`` (0 when
    ``sf`` is 0) and ``sf / gs``, one fp32 division each."""
    if s.scheme == "mxfp4":
        e = byte.to(torch.int32)
        return ref.pow2_f32(127 - e), ref.pow2_f32(e - 127)
    assert s.gs is not None
    sf = ref.e4m3_decode(byte)
    gsb = s.gs.to(_F32)[..., None, None].expand(sf.shape)
    r = torch.where(sf > 0, torch.clamp(gsb / sf, max=ref.FLT_MAX), torch.zeros_like(sf))
    return r, sf / gsb


def grid_step(y: torch.Tensor) -> torch.Tensor:
    """The E2M1 grid step at each scaled value: 0.5 for ``|y| < 2``, 1 for ``|y| < 4``, 2 above (saturated values
    included). Exact constants."""
    a = y.abs()
    half, one, two = (torch.full_like(a, c) for c in (0.5, 1.0, 2.0))
    return torch.where(a < 2.0, half, torch.where(a < 4.0, one, two))


def _offsets(y: torch.Tensor, v: torch.Tensor, unit: str) -> torch.Tensor:
    """``o = v * step`` (``unit`` "step") or ``v`` ("absolute"), fp32, one multiply."""
    if unit == "step":
        return v * grid_step(y.detach())
    if unit == "absolute":
        return v
    raise QuantizationError(f"unknown offset unit {unit!r}; expected one of {', '.join(OFFSET_UNITS)}")


def _offset_values(y: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """``y + o`` where ``o != 0``, else ``y`` itself: adding a zero would turn a -0.0 weight's scaled value
    into +0.0 and change its code from 8 to 0."""
    return torch.where(o != 0, y + o, y)


def _check(w: torch.Tensor, s: Start, v: torch.Tensor | None) -> torch.Tensor:
    """``w`` as fp32 blocks [..., N, K/B, B], after refusing what the tuned quantizer cannot take."""
    bs = _BLOCK[s.scheme]
    ref.check_shape(w, bs)
    blocks = w.to(_F32).reshape(*w.shape[:-1], -1, bs)
    if blocks.shape[:-1] != s.scale.shape:
        raise QuantizationError(f"a {tuple(w.shape)} matrix with {tuple(s.scale.shape)} block scales")
    if not bool(torch.isfinite(blocks).all()):
        raise NonFiniteError("the tensor holds NaN or Inf; FP4 cannot represent it (fix or exclude the tensor)")
    if v is not None:
        if v.shape != w.shape:
            raise QuantizationError(f"offsets of shape {tuple(v.shape)} for a {tuple(w.shape)} matrix")
        if not bool(torch.isfinite(v).all()):
            raise NonFiniteError("a tuned rounding offset is NaN or Inf")
    return blocks


def quantize(w: torch.Tensor, s: Start, v: torch.Tensor | None = None, t: torch.Tensor | None = None,
             unit: str = "step") -> Result:
    """The final bytes of ``w`` [..., N, K] under the offsets ``v`` (fp32 like ``w``; None: none) and the scale
    moves ``t`` (fp32 like ``s.scale``; None: none), in docs/numerics.md "Tuned rounding"'s order:
    the scale bytes (:func:`scale_bytes`), ``r`` and ``d`` (:func:`multipliers`), ``y = x * r``, ``y' = y + v *
    step(y)`` where that offset is non-zero, ``code = E2M1(y')`` (the reference's encoder), packed; the decode
    ``value(code) * d``. With ``v`` and ``t`` None (or zero) these are the data-free quantizer's bytes."""
    blocks = _check(w, s, v)
    with torch.no_grad():
        byte = scale_bytes(s, None if t is None else t.detach())
        r, d = multipliers(s, byte)
        y = blocks * r[..., None]
        if v is not None:
            y = _offset_values(y, _offsets(y, v.detach().to(_F32).reshape(blocks.shape), unit))
        codes = ref.e2m1_encode(y)
        deq = (ref.e2m1_decode(codes) * d[..., None]).reshape(w.shape)
        packed = ref.pack_nibbles(codes.reshape(w.shape))
    if s.scheme == "nvfp4":
        return Result(packed, byte.view(torch.float8_e4m3fn), s.gs, deq)
    return Result(packed, byte, None, deq)


def e2m1_round(y: torch.Tensor) -> torch.Tensor:
    """The value of ``E2M1(y)`` for finite fp32 ``y``: ``reference.e2m1_decode(reference.e2m1_encode(y))`` bit for bit
    (-0.0 included), in fewer operations for the stand-in's every step: ``|y|`` divided by its grid step (a power
    of two: exact), rounded half to even, multiplied back (exact), capped at 6, given ``y``'s sign bit. The ties
    go where the encoder sends them (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4);
    the final bytes use the encoder itself."""
    a = y.abs()
    step = grid_step(a)
    return torch.copysign(torch.clamp(torch.round(a / step) * step, max=ref.E2M1_MAX), y)


def _ste(value: torch.Tensor, through: torch.Tensor) -> torch.Tensor:
    """``value`` exactly (a -0.0 included), with the gradient of ``through``: ``value - (through' - through)``,
    where ``through' - through`` is +0.0 and subtracting +0.0 changes no fp32 value."""
    return value - (through.detach() - through)


def fake_quantize(w: torch.Tensor, s: Start, v: torch.Tensor | None, t: torch.Tensor | None,
                  unit: str = "step") -> torch.Tensor:
    """The tuned weight for the block's forward while tuning: fp32 [..., N, K] whose values are exactly
    ``quantize(w, s, v, t, unit).dequantized``, differentiable in ``v`` and ``t`` (straight-through: the
    E2M1 rounding passes the gradient of its input clamped to [-6, 6]; the scale byte's rounding that of
    ``d * 2^(t - t0)`` at ``t = t0``). ``w`` itself takes no gradient."""
    blocks = _check(w.detach(), s, v.detach() if v is not None else None)
    byte = scale_bytes(s, None if t is None else t.detach())
    r, d = multipliers(s, byte)
    if t is not None:
        f = torch.exp2(t - t.detach())  # exactly 1.0; d f / d t = ln 2
        r, d = r / f, d * f  # (dividing and multiplying by 1.0 is exact)
    y = blocks * r[..., None]
    if v is not None:
        o = _offsets(y, v.to(_F32).reshape(blocks.shape), unit)
        y = _ste(_offset_values(y.detach(), o.detach()), y + o)
    q = _ste(e2m1_round(y.detach()), torch.clamp(y, -ref.E2M1_MAX, ref.E2M1_MAX))
    return (q * d[..., None]).reshape(w.shape)


def learning_rate(lr: float, step: int, steps: int) -> float:
    """The rate of update ``step`` (0-based) of ``steps``: ``lr * (steps - step) / steps``, linear to 0 (so
    a parameter moves at most about ``lr * (steps + 1) / 2`` in all)."""
    return lr * (steps - step) / steps


def signed_step(p: torch.Tensor, grad: torch.Tensor | None, lr: float, limit: float) -> None:
    """One signed-gradient update in place: ``p = clamp(p - lr * sign(grad), -limit, limit)`` (fp32
    elementwise: the same bits on every device for the same gradient signs; a zero gradient leaves ``p``)."""
    if grad is None:
        return
    with torch.no_grad():
        p.sub_(torch.sign(grad) * lr).clamp_(-limit, limit)
