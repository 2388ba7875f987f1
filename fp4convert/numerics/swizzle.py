"""The 128x4 scale layout of tensor cores (docs/formats.md#the-128x4-scale-layout), and its exact inverse.

Row ``m`` and block-column ``k`` of a scale matrix land at
``(m//128)*(nbp//4*512) + (k//4)*512 + (m%32)*16 + ((m%128)//32)*4 + (k%4)``: one 512-byte tile holds
128 rows x 4 blocks, so an MMA warp reads its scales with one aligned load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fp4convert.errors import ShapeError

if TYPE_CHECKING:
    import torch


def padded_shape(rows: int, cols: int) -> tuple[int, int]:
    """(Mp, nbp): rows padded to 128, scale columns to 4."""
    return -(-rows // 128) * 128, -(-cols // 4) * 4


def swizzle_scales(scale: torch.Tensor) -> torch.Tensor:
    """[..., M, nb] linear scales -> [..., Mp, nbp] in the 128x4 layout, zero padding; dtype kept."""
    import torch  # here, not at the top: planning asks padded_shape only

    if scale.dim() < 2:
        raise ShapeError(f"expected scales of shape [..., M, nb], got {tuple(scale.shape)}")
    dtype = scale.dtype
    s = scale.view(torch.uint8) if dtype == torch.float8_e4m3fn else scale
    *lead, rows, cols = s.shape
    mp, nbp = padded_shape(rows, cols)
    padded = s.new_zeros(*lead, mp, nbp)
    padded[..., :rows, :cols] = s
    tiles = padded.reshape(*lead, mp // 128, 4, 32, nbp // 4, 4)
    n = len(lead)
    out = tiles.permute(*range(n), n, n + 3, n + 2, n + 1, n + 4).reshape(*lead, mp, nbp)
    return out.view(dtype) if dtype == torch.float8_e4m3fn else out


def unswizzle_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[..., Mp, nbp] 128x4 layout -> [..., rows, cols] linear scales; dtype kept."""
    import torch

    dtype = swizzled.dtype
    s = swizzled.view(torch.uint8) if dtype == torch.float8_e4m3fn else swizzled
    *lead, mp, nbp = s.shape
    if (mp, nbp) != padded_shape(rows, cols):
        raise ShapeError(
            f"swizzled scales of shape [{mp}, {nbp}] do not match {rows}x{cols} "
            f"(expected {list(padded_shape(rows, cols))})"
        )
    n = len(lead)
    tiles = s.reshape(*lead, mp // 128, nbp // 4, 32, 4, 4)
    out = tiles.permute(*range(n), n, n + 3, n + 2, n + 1, n + 4).reshape(*lead, mp, nbp)
    out = out[..., :rows, :cols].contiguous()
    return out.view(dtype) if dtype == torch.float8_e4m3fn else out
