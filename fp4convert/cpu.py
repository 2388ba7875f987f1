"""The CPU path: the reference's arithmetic, in row chunks.

Same interface as :mod:`fp4convert.cuda.ops` (batches ``[B, M, K]``), same bytes as
:mod:`fp4convert.reference` (tested bit for bit). Rows are processed in chunks of about
``CHUNK_ELEMS`` elements, so the fp32 temporaries of a multi-GB weight stay a few MB (the reference
holds ~10x the tensor at once, which a 24 GiB machine cannot do for the largest layers) and stay
in cache. Measured alternatives for the E2M1 step (torch.bucketize on the seven thresholds, a
2048-entry table on the float bits) were slower than the reference's predicate sum, which is used.
"""

from __future__ import annotations

import torch

from . import reference as ref
from .swizzle import swizzle_scales

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


def amax(x: torch.Tensor, rotate: str | None) -> torch.Tensor:
    """max|x| per matrix of a [B, M, K] batch (NaN/Inf propagate, as the reference's do)."""
    b, m, k = x.shape
    out = torch.zeros(b, dtype=_F32)
    for i in range(b):
        acc = torch.zeros((), dtype=_F32)
        for r0, r1 in _chunks(m, k):
            part = _prepared(x[i, r0:r1], rotate).abs().amax() if k else torch.zeros((), dtype=_F32)
            acc = torch.maximum(acc, part)  # torch.maximum propagates NaN
        out[i] = acc
    return out


def quantize(
    x: torch.Tensor, fmt: str, gs: torch.Tensor | None, rotate: str | None, swizzle: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed [B, M, K/2], scale [B, M, nb] or swizzled, nonfinite flag), like the CUDA ops."""
    b, m, k = x.shape
    bs = ref.NVFP4_BLOCK if fmt == "nvfp4" else ref.MXFP4_BLOCK
    packed = torch.empty(b, m, k // 2, dtype=torch.uint8)
    scale = torch.empty(b, m, k // bs, dtype=torch.uint8)
    nonfinite = torch.zeros((), dtype=torch.bool)
    for i in range(b):
        gsb = gs[i] if gs is not None else None
        for r0, r1 in _chunks(m, k):
            blocks = _prepared(x[i, r0:r1], rotate).reshape(r1 - r0, -1, bs)
            bmax = blocks.abs().amax(dim=-1)
            nonfinite |= ~torch.isfinite(bmax).all()
            if fmt == "nvfp4":
                sbits = ref.e4m3_encode(torch.nan_to_num((gsb * bmax) / ref.E2M1_MAX, nan=0.0))
                sf = ref.e4m3_decode(sbits)
                mult = torch.where(sf > 0, torch.clamp(gsb / sf, max=ref.FLT_MAX), torch.zeros_like(sf))
            else:
                sbits = ref.e8m0_encode_from_bmax(bmax)
                mult = ref.pow2_f32(127 - sbits.to(torch.int32))
            codes = ref.e2m1_encode((blocks * mult[..., None]).reshape(r1 - r0, k))
            packed[i, r0:r1] = codes[:, 0::2] | (codes[:, 1::2] << 4)
            scale[i, r0:r1] = sbits
    if fmt == "nvfp4":
        scale = scale.view(torch.float8_e4m3fn)
    if swizzle:
        scale = swizzle_scales(scale)
    return packed, scale, nonfinite
