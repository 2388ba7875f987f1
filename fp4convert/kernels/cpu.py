"""The CPU path: the compiled CPU kernel, or the reference's arithmetic in torch, in row chunks.

Same interface as :mod:`fp4convert.kernels.cuda.ops` (batches ``[B, M, K]``), same bytes as
:mod:`fp4convert.numerics.reference` (tested bit for bit). :func:`amax` and :func:`quantize` run the compiled
kernel (:mod:`fp4convert.kernels.cpu_lib`: vectorised, on ``threads`` threads, default torch's intra-op
count) whenever it is available for the input, and the torch path below otherwise: the same bytes.

The torch path: rows are processed in chunks of about
``CHUNK_ELEMS`` elements, so the fp32 temporaries of a multi-GB weight stay a few MB (the reference
holds ~10x the tensor at once, which a 24 GiB machine cannot do for the largest layers) and stay
in cache. Measured alternatives for the E2M1 step (torch.bucketize on the seven thresholds, a
2048-entry table on the float bits) were slower than the reference's predicate sum, which is used.

The search scale rules (``4over6``, ``mse``, ``wmse``) score each candidate scale on magnitudes only: with
``y = x * r``, ``|y| = |x| * r`` and ``value(code) * d - x = sign(x) * (|value| * d - |x|)`` exactly
(IEEE rounding is symmetric), so the squared block error equals the reference's bit for bit while
the candidates skip the sign and the packing; only the winner is encoded with signs.
"""

from __future__ import annotations

import torch

from fp4convert.kernels import cpu_lib as cpu_kernel
from fp4convert.numerics import reference as ref
from fp4convert.numerics.scheme import get_scheme
from fp4convert.numerics.swizzle import swizzle_scales

CHUNK_ELEMS = 1 << 20  # ~4 MB of fp32 per temporary (measured best of 2^18..2^22 on 2 cores)

_F32 = torch.float32


def _rows_per_chunk(k: int) -> int:
    return max(1, CHUNK_ELEMS // max(k, 1))


def _chunks(m: int, k: int):
    step = _rows_per_chunk(k)
    for r0 in range(0, m, step):
        yield r0, min(m, r0 + step)


def _prepared(x: torch.Tensor, rotate: str | None) -> torch.Tensor:
    v = x.to(_F32)
    return ref.had16(v) if rotate == "had16" else v


def _kernel(x: torch.Tensor):
    """The compiled kernel when it is enabled, built and takes x's dtype; else None (the torch path)."""
    return cpu_kernel.get() if cpu_kernel.dtype_code(x.dtype) is not None else None


def amax(x: torch.Tensor, rotate: str | None, threads: int | None = None) -> torch.Tensor:
    """max|x| per matrix of a [B, M, K] batch (NaN/Inf propagate, as the reference's do).

    ``threads``: the kernel's thread count (default: torch.get_num_threads()).
    """
    lib = _kernel(x)
    if lib is not None:
        return cpu_kernel.amax(lib, x, rotate, threads)
    b, m, k = x.shape
    out = torch.zeros(b, dtype=_F32)
    for i in range(b):
        acc = torch.zeros((), dtype=_F32)
        for r0, r1 in _chunks(m, k):
            part = _prepared(x[i, r0:r1], rotate).abs().amax() if k else torch.zeros((), dtype=_F32)
            acc = torch.maximum(acc, part)  # torch.maximum propagates NaN
        out[i] = acc
    return out


def _e2m1_magnitude_(y: torch.Tensor) -> torch.Tensor:
    """|value(E2M1(y))| for y >= 0, in place: round y to the grid step of its binade, ties to even.

    The grid steps are 0.5 below 2, 1 in [2, 4) and 2 from 4 on (saturating at 6); the step is read
    from y's exponent bits (2^floor(log2 y) / 2, clamped to [0.5, 2]), the scalings by it are exact,
    and torch.round is half-to-even, so this equals the predicate sum's rounding (tested on every
    tie). Seven simple passes instead of the encoder's fourteen with type conversions.
    """
    step = (y.view(torch.int32) & 0x7F800000).view(_F32)
    step.mul_(0.5).clamp_(0.5, 2.0)
    return y.div_(step).round_().mul_(step).clamp_(max=ref.E2M1_MAX)


def _block_error(
    a: torch.Tensor, r: torch.Tensor, d: torch.Tensor, weighted: bool = False, iw: torch.Tensor | None = None
) -> torch.Tensor:
    """docs/numerics.md's block error ("Block error") of |x| blocks a [R, nb, n] under multiplier r and step d [R, nb].

    ``e = |value| * d - |x|`` (times ``|x|`` when ``weighted``: ``(e * x)^2`` equals
    ``(e' * |x|)^2`` exactly, e' = +-e), squared, times the input-channel weight ``iw`` [nb, n] when
    given (the reference's ``(e * e) * c_i``), then added in element order (0 + e_0^2 is e_0^2
    exactly, so the sum starts from the first term).
    """
    e = _e2m1_magnitude_(a * r[..., None])
    e.mul_(d[..., None]).sub_(a)
    if weighted:
        e.mul_(a)
    e.mul_(e)
    if iw is not None:
        e.mul_(iw)
    err = e[..., 0].clone()
    for i in range(1, e.shape[-1]):
        err.add_(e[..., i])
    return err


def _nvfp4_r_d(c: torch.Tensor, gsb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    sf = ref.e4m3_decode(c)
    r = torch.where(sf > 0, torch.clamp(gsb / sf, max=ref.FLT_MAX), torch.zeros_like(sf))
    return r, sf / gsb


def _nvfp4_search(
    a: torch.Tensor, gsb: torch.Tensor, s: torch.Tensor, rule: str, iw: torch.Tensor | None = None
) -> torch.Tensor:
    """The scale bytes that ``4over6`` / ``mse`` / ``wmse`` choose (see reference._nvfp4_choose)."""
    b6 = ref.e4m3_encode(torch.nan_to_num(s / ref.E2M1_MAX, nan=0.0))
    b4 = ref.e4m3_encode(torch.nan_to_num(s / 4.0, nan=0.0))
    w = rule == "wmse"
    best, best_err = b6, _block_error(a, *_nvfp4_r_d(b6, gsb), w, iw)
    if rule == "4over6":
        return torch.where(_block_error(a, *_nvfp4_r_d(b4, gsb), False, iw) < best_err, b4, b6)
    for c in (b4, (b6.to(torch.int32) - 1).clamp(min=0).to(torch.uint8)):
        e = _block_error(a, *_nvfp4_r_d(c, gsb), w, iw)
        take = (e < best_err) | ((e == best_err) & (c > best))
        best, best_err = torch.where(take, c, best), torch.where(take, e, best_err)
    return best


def _mxfp4_choose(a: torch.Tensor, bmax: torch.Tensor, rule: str, iw: torch.Tensor | None = None) -> torch.Tensor:
    """The E8M0 exponents of ``floor`` / ``rceil`` / ``mse`` / ``wmse`` (see reference._mxfp4_choose)."""
    e = ref.e8m0_encode_from_bmax(bmax)
    if rule == "floor":
        return e
    ei = e.to(torch.int32)
    up = (ei + 1).clamp(max=ref.E8M0_MAX_EXP)
    if rule == "rceil":
        return torch.where(bmax * ref.pow2_f32(127 - ei) > ref.E2M1_MAX, up, ei).to(torch.uint8)
    w = rule == "wmse"
    err_e = _block_error(a, ref.pow2_f32(127 - ei), ref.pow2_f32(ei - 127), w, iw)
    err_up = _block_error(a, ref.pow2_f32(127 - up), ref.pow2_f32(up - 127), w, iw)
    return torch.where(err_up < err_e, up, ei).to(torch.uint8)


def quantize(
    x: torch.Tensor,
    fmt: str,
    gs: torch.Tensor | None,
    rotate: str | None,
    swizzle: bool,
    scale_rule: str | None = None,
    threads: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed [B, M, K/2], scale [B, M, nb] or swizzled, nonfinite flag), like the CUDA ops.

    ``fmt`` is the scheme; ``scale_rule`` one of reference.SCALE_RULES[fmt], None for its default;
    ``threads`` the kernel's thread count (default: torch.get_num_threads()).
    """
    rule = ref.check_scale_rule(fmt, scale_rule)
    lib = _kernel(x)
    if lib is not None:
        out = cpu_kernel.quantize(lib, x, fmt, gs, rotate, swizzle, rule, threads)
        if out is not None:
            packed, scale, flags = out
            return packed, scale, flags.any()
    return _quantize_torch(x, fmt, gs, rotate, swizzle, rule)


def _quantize_torch(
    x: torch.Tensor, fmt: str, gs: torch.Tensor | None, rotate: str | None, swizzle: bool, rule: str,
    iw: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch path of :func:`quantize` and :func:`quantize_input_weighted` (``rule`` already checked).

    ``iw``: the checked input-channel weights [nb, bs] that the search rules' block errors carry, or None.
    """
    b, m, k = x.shape
    bs = ref.NVFP4_BLOCK if fmt == "nvfp4" else ref.MXFP4_BLOCK
    packed = torch.empty(b, m, k // 2, dtype=torch.uint8)
    scale = torch.empty(b, m, k // bs, dtype=torch.uint8)
    nonfinite = torch.zeros((), dtype=torch.bool)
    for i in range(b):
        gsb = gs[i] if gs is not None else None
        for r0, r1 in _chunks(m, k):
            blocks = _prepared(x[i, r0:r1], rotate).reshape(r1 - r0, -1, bs)
            if rule in ("max", "floor"):
                bmax = blocks.abs().amax(dim=-1)
            else:
                a = blocks.abs()
                bmax = a.amax(dim=-1)
            nonfinite |= ~torch.isfinite(bmax).all()
            if fmt == "nvfp4":
                if rule == "max":
                    sbits = ref.e4m3_encode(torch.nan_to_num((gsb * bmax) / ref.E2M1_MAX, nan=0.0))
                else:
                    sbits = _nvfp4_search(a, gsb, gsb * bmax, rule, iw)
                sf = ref.e4m3_decode(sbits)
                mult = torch.where(sf > 0, torch.clamp(gsb / sf, max=ref.FLT_MAX), torch.zeros_like(sf))
            else:
                sbits = ref.e8m0_encode_from_bmax(bmax) if rule == "floor" else _mxfp4_choose(a, bmax, rule, iw)
                mult = ref.pow2_f32(127 - sbits.to(torch.int32))
            codes = ref.e2m1_encode((blocks * mult[..., None]).reshape(r1 - r0, k))
            packed[i, r0:r1] = codes[:, 0::2] | (codes[:, 1::2] << 4)
            scale[i, r0:r1] = sbits
    if fmt == "nvfp4":
        scale = scale.view(torch.float8_e4m3fn)
    if swizzle:
        scale = swizzle_scales(scale)
    return packed, scale, nonfinite


def quantize_input_weighted(
    x: torch.Tensor,
    fmt: str,
    gs: torch.Tensor | None,
    rotate: str | None,
    swizzle: bool,
    scale_rule: str | None,
    input_weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize` with each search rule's block error weighted per input channel.

    ``input_weight`` fp32 [K] (finite, >= 0; reference.check_input_weight): the reference's
    ``err = err + (e * e) * c_i`` in element order, on magnitudes like :func:`_block_error` (the
    square of +-e is the same), so the bytes equal reference.nvfp4_quantize / mxfp4_quantize with
    the same ``input_weight`` bit for bit. Rules without a search (max, floor, rceil) ignore it.
    """
    rule = ref.check_scale_rule(fmt, scale_rule)
    bs = ref.NVFP4_BLOCK if fmt == "nvfp4" else ref.MXFP4_BLOCK
    iw = ref.check_input_weight(input_weight, x.shape[-1], bs)  # [nb, bs]
    if not get_scheme(fmt).rule(rule).searches:
        return quantize(x, fmt, gs, rotate, swizzle, rule)
    return _quantize_torch(x, fmt, gs, rotate, swizzle, rule, iw)
