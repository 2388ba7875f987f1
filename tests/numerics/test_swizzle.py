"""128x4 scale layout: every element lands at the offset docs/formats.md#the-128x4-scale-layout gives, and unswizzling is exact."""

from __future__ import annotations

import pytest
import torch

from fp4convert import swizzle_scales, unswizzle_scales
from fp4convert.errors import ShapeError
from fp4convert.numerics.swizzle import padded_shape


def spec_offset(m: int, k: int, nbp: int) -> int:
    return (m // 128) * (nbp // 4 * 512) + (k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + (k % 4)


@pytest.mark.parametrize("rows,cols", [(1, 1), (5, 3), (128, 4), (130, 5), (200, 9), (257, 3), (384, 16)])
def test_every_element_lands_at_the_spec_offset(rows: int, cols: int) -> None:
    scale = torch.randint(1, 256, (rows, cols), dtype=torch.int32).to(torch.uint8)
    out = swizzle_scales(scale)
    mp, nbp = padded_shape(rows, cols)
    assert out.shape == (mp, nbp) and out.dtype == torch.uint8
    flat = out.flatten()
    expected = torch.zeros(mp * nbp, dtype=torch.uint8)
    for m in range(rows):
        for k in range(cols):
            expected[spec_offset(m, k, nbp)] = scale[m, k]
    assert torch.equal(flat, expected)  # also: every padding byte is zero


def test_matches_the_reshape_permute_form() -> None:
    s = torch.randint(0, 256, (256, 8), dtype=torch.int32).to(torch.uint8)
    alt = s.reshape(2, 4, 32, 2, 4).permute(0, 3, 2, 1, 4).reshape(256, 8)
    assert torch.equal(swizzle_scales(s), alt)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn])
def test_round_trip_keeps_dtype_and_batches(dtype: torch.dtype) -> None:
    s = torch.randint(0, 0x7F, (3, 2, 130, 7), dtype=torch.int32).to(torch.uint8).view(dtype)
    out = swizzle_scales(s)
    assert out.dtype == dtype and out.shape == (3, 2, 256, 8)
    back = unswizzle_scales(out, 130, 7)
    assert back.dtype == dtype and torch.equal(back.view(torch.uint8), s.view(torch.uint8))
    assert torch.equal(out[1, 0].view(torch.uint8), swizzle_scales(s[1, 0]).view(torch.uint8))


def test_unswizzle_refuses_a_shape_mismatch() -> None:
    with pytest.raises(ShapeError, match="expected \\[256, 8\\]"):
        unswizzle_scales(torch.zeros(128, 8, dtype=torch.uint8), 130, 7)
