"""The CPU fast path against the reference: the same bytes on random data, edge cases and chunk seams."""

from __future__ import annotations

import pytest
import torch

import fp4convert
from fp4convert import cpu

from .oracle import fresh_seed, random_weight


def same(a: fp4convert.QuantizedTensor, b: fp4convert.QuantizedTensor) -> bool:
    gs = (a.global_scale is None and b.global_scale is None) or torch.equal(a.global_scale, b.global_scale)
    return gs and torch.equal(a.packed, b.packed) and torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("rotate", [None, "had16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_matches_reference(fmt: str, rotate: str | None, dtype: torch.dtype, monkeypatch) -> None:
    monkeypatch.setattr(cpu, "CHUNK_ELEMS", 3 * 96)  # several chunks, the last one ragged
    x = random_weight(37, 96, fresh_seed()).to(dtype)
    for layout in ("linear", "swizzled"):
        fast = fp4convert.quantize(x, fmt, rotate=rotate, scale_layout=layout, backend="cpu")
        slow = fp4convert.quantize(x, fmt, rotate=rotate, scale_layout=layout, backend="reference")
        assert same(fast, slow)
    assert torch.equal(fp4convert.amax(x, rotate=rotate, backend="cpu"), fp4convert.amax(x, rotate=rotate, backend="reference"))


def test_batched_and_group_amax_match_reference(monkeypatch) -> None:
    monkeypatch.setattr(cpu, "CHUNK_ELEMS", 200)
    x = torch.randn(3, 20, 64) * torch.tensor([1e-3, 1.0, 1e3]).view(3, 1, 1)
    assert same(fp4convert.quantize(x, backend="cpu"), fp4convert.quantize(x, backend="reference"))
    g = torch.tensor(7.5)
    assert same(fp4convert.quantize(x, global_amax=g, backend="cpu"), fp4convert.quantize(x, global_amax=g, backend="reference"))


def test_auto_uses_the_fast_path_on_cpu(monkeypatch) -> None:
    calls = []
    real = cpu.quantize
    monkeypatch.setattr(cpu, "quantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    fp4convert.quantize(torch.randn(4, 32))
    assert calls


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_refused(bad: float) -> None:
    x = torch.randn(8, 64)
    x[5, 17] = bad
    with pytest.raises(fp4convert.NonFiniteError):
        fp4convert.quantize(x, "mxfp4", backend="cpu")
    with pytest.raises(fp4convert.NonFiniteError):
        fp4convert.quantize(x, global_amax=1.0, backend="cpu")


def test_tiny_amax_and_zero_blocks_match_reference() -> None:
    x = torch.zeros(2, 64)
    x[0, 0], x[0, 1], x[1, 40] = 1e-37, -1e-38, 1e-45
    assert same(fp4convert.quantize(x, backend="cpu"), fp4convert.quantize(x, backend="reference"))
    z = torch.zeros(3, 32)
    assert same(fp4convert.quantize(z, backend="cpu"), fp4convert.quantize(z, backend="reference"))
