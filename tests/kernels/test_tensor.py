"""The public tensor API: options, shapes, dtypes, layouts and backends on CPU."""

from __future__ import annotations

import pytest
import torch

import fp4convert
from fp4convert import ConfigError, QuantizationError, QuantizedTensor, ShapeError
from fp4convert.numerics import reference as ref


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fmt,bs", [("nvfp4", 16), ("mxfp4", 32)])
@pytest.mark.parametrize("rotate", [None, "had16"])
def test_shapes_dtypes_and_reference_equality(dtype, fmt, bs, rotate) -> None:
    x = torch.randn(2, 40, 96).to(dtype)
    q = fp4convert.quantize(x, fmt, rotate=rotate)
    assert isinstance(q, QuantizedTensor) and q.scheme == fmt and q.rotate == rotate
    assert q.packed.shape == (2, 40, 48) and q.packed.dtype == torch.uint8
    assert q.scale.shape == (2, 40, 96 // bs)
    assert q.scale.dtype == (torch.float8_e4m3fn if fmt == "nvfp4" else torch.uint8)
    if fmt == "nvfp4":
        assert q.global_scale.shape == (2,) and q.global_scale.dtype == torch.float32
        packed, scale, gs = ref.nvfp4_quantize(x, rotate=rotate, scale_rule=ref.DEFAULT_SCALE_RULE["nvfp4"])
        assert torch.equal(gs, q.global_scale)
    else:
        assert q.global_scale is None
        packed, scale = ref.mxfp4_quantize(x, rotate=rotate, scale_rule=ref.DEFAULT_SCALE_RULE["mxfp4"])
    assert torch.equal(q.packed, packed) and torch.equal(q.scale.view(torch.uint8), scale.view(torch.uint8))
    w = fp4convert.dequantize(q, dtype)
    assert w.shape == x.shape and w.dtype == dtype
    rel = (w.float() - x.float()).norm() / x.float().norm()
    assert rel < 0.15  # FP4 keeps ~2 significant bits; a wrong rotation or scale is far worse


def test_matrix_global_scale_is_0_dim() -> None:
    q = fp4convert.quantize(torch.randn(16, 32))
    assert q.global_scale.dim() == 0


def test_dequantize_undoes_the_rotation() -> None:
    x = torch.randn(32, 64)
    q = fp4convert.quantize(x, rotate="had16")
    manual = ref.had16(ref.nvfp4_dequantize(q.packed, q.scale, q.global_scale))
    assert torch.equal(fp4convert.dequantize(q, torch.float32), manual)
    plain = fp4convert.dequantize(fp4convert.quantize(x), torch.float32)
    assert not torch.equal(plain, fp4convert.dequantize(q, torch.float32))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_swizzled_layout_holds_the_same_scales(fmt: str) -> None:
    x = torch.randn(130, 160)
    lin = fp4convert.quantize(x, fmt)
    swz = fp4convert.quantize(x, fmt, scale_layout="swizzled")
    assert swz.scale_layout == "swizzled" and swz.scale.shape[0] == 256
    assert torch.equal(swz.scale.view(torch.uint8), fp4convert.swizzle_scales(lin.scale).view(torch.uint8))
    assert torch.equal(swz.linear_scale().view(torch.uint8), lin.scale.view(torch.uint8))
    assert torch.equal(fp4convert.dequantize(swz), fp4convert.dequantize(lin))


def test_amax_and_global_amax_make_a_fused_group() -> None:
    q_w, k_w = torch.randn(64, 32), torch.randn(16, 32) * 3
    group = torch.maximum(fp4convert.amax(q_w), fp4convert.amax(k_w))
    qa = fp4convert.quantize(q_w, global_amax=group)
    ka = fp4convert.quantize(k_w, global_amax=group)
    assert torch.equal(qa.global_scale, ka.global_scale)
    fused = fp4convert.quantize(torch.cat([q_w, k_w]))  # the same as quantizing the fused matrix
    assert torch.equal(torch.cat([qa.packed, ka.packed]), fused.packed)
    assert fp4convert.amax(q_w, rotate="had16").item() == ref.had16(q_w).abs().max().item()


def test_option_errors_are_clear() -> None:
    """Bad options are ConfigError (exit 2, a settings problem), not a tensor problem (exit 3)."""
    x = torch.randn(4, 32)
    with pytest.raises(ConfigError, match="unknown scheme 'fp8'"):
        fp4convert.quantize(x, "fp8")
    with pytest.raises(ConfigError, match="unknown rotation"):
        fp4convert.quantize(x, rotate="had32")
    with pytest.raises(ConfigError, match="no global scale"):
        fp4convert.quantize(x, "mxfp4", global_amax=1.0)
    with pytest.raises(ConfigError, match="needs a CUDA tensor"):
        fp4convert.quantize(x, backend="cuda")
    with pytest.raises(ConfigError, match="scale rule 'floor' does not apply to nvfp4"):
        fp4convert.quantize(x, "nvfp4", scale_rule="floor")
    assert not issubclass(ConfigError, QuantizationError) and ConfigError.exit_code == 2
    with pytest.raises(ShapeError, match="K=48 .* block size 32"):
        fp4convert.quantize(torch.randn(4, 48), "mxfp4")
    with pytest.raises(ShapeError, match="floating-point"):
        fp4convert.quantize(torch.zeros(4, 32, dtype=torch.int32))


def test_import_does_not_load_compiled_code() -> None:
    import subprocess
    import sys

    code = "import sys, fp4convert; fp4convert.quantize(__import__('torch').randn(4, 32)); print('fp4convert.kernels.cuda' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
