"""An FP4 checkpoint read as an input for --requantize (fp4convert/formats/fp4_checkpoint.py): which modules it
decodes and how, each format's own decode, bit for bit (docs/formats.md "FP4 sources")."""

from __future__ import annotations

import pytest
import torch

import fp4convert
from fp4convert.errors import SourceError
from fp4convert.formats import input_weights
from fp4convert.kernels.tensor import dequantize_input
from fp4convert.numerics.swizzle import swizzle_scales
from fp4convert.storage.safetensors import TensorInfo

from tests import oracle

M = "model.layers.0.mlp.down_proj"


def _weight(seed: int, rows: int = 40, cols: int = 96) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 4


@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("swizzled", [False, True], ids=["linear", "swizzled"])
def test_encode_scale_formats_decode_as_fp4convert_dequantize(scheme, swizzled) -> None:
    q = fp4convert.quantize(_weight(oracle.fresh_seed()), scheme)
    want = fp4convert.dequantize(q, torch.float32)
    scale = swizzle_scales(q.scale) if swizzled else q.scale
    inputs = [q.packed, scale] + ([q.global_scale.reshape(1)] if scheme == "nvfp4" else [])
    got = dequantize_input(scheme, inputs, swizzled=swizzled)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_modelopt_decode_is_the_exact_product_rounded_once() -> None:
    """(value * sf) * weight_scale_2: value * sf is exact, so each element is the real product rounded once;
    value * (sf * weight_scale_2) would round twice and differs somewhere."""
    q = fp4convert.quantize(_weight(oracle.fresh_seed(), 64, 256), "nvfp4")
    s2 = torch.tensor(1.0) / q.global_scale  # ModelOpt's weight_scale_2, an fp32 decode scale
    got = dequantize_input("nvfp4", [q.packed, q.scale, s2], decode_global=True)
    from fp4convert.numerics.reference import e2m1_decode, unpack_nibbles

    vals = e2m1_decode(unpack_nibbles(q.packed)).tolist()
    sf = q.scale.float().repeat_interleave(16, dim=-1).tolist()
    d2 = s2.item()
    want = [[oracle.f32(v * s * d2) for v, s in zip(vr, sr)] for vr, sr in zip(vals, sf)]
    assert got.tolist() == want
    twice = (torch.tensor(vals) * (torch.tensor(sf) * s2))
    assert not torch.equal(twice, got)  # the other order rounds twice: not the same numbers


def _infos(*spec: tuple[str, str, tuple[int, ...]]) -> list[TensorInfo]:
    return [TensorInfo(n, d, s, "model.safetensors", 0, 0) for n, d, s in spec]


CT_NV = {"quantization_config": {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                                 "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float"}}}}}


def test_compressed_tensors_modules_decode_with_their_activation_scale_consumed() -> None:
    tensors = _infos((M + ".weight_packed", "U8", (64, 64)), (M + ".weight_scale", "F8_E4M3", (64, 8)),
                     (M + ".weight_global_scale", "F32", (1,)), (M + ".input_global_scale", "F32", (1,)),
                     ("model.norm.weight", "BF16", (64,)))
    out, decodes = input_weights(tensors, CT_NV)
    assert [(t.name, t.dtype, t.shape) for t in out] == [(M + ".weight", "F32", (64, 128)),
                                                          ("model.norm.weight", "BF16", (64,))]
    d = decodes[M + ".weight"]
    assert (d.kind, d.layout, d.swizzled, d.decode_global) == ("nvfp4", "compressed-tensors", False, False)
    assert [t.name for t in d.inputs][-1] == M + ".input_global_scale"


def test_native_and_modelopt_modules_say_their_layout() -> None:
    native = {"quantization_config": {"quant_method": "fp4convert", "scheme": "mxfp4", "scale_layout": "128x4"}}
    _, dec = input_weights(_infos((M + ".weight_packed", "U8", (64, 64)), (M + ".weight_scale", "U8", (128, 4))),
                           native)
    assert (dec[M + ".weight"].kind, dec[M + ".weight"].swizzled) == ("mxfp4", True)
    mo = {"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}}
    out, dec = input_weights(_infos((M + ".weight", "U8", (64, 64)), (M + ".weight_scale", "F8_E4M3", (64, 8)),
                                    (M + ".weight_scale_2", "F32", ()), (M + ".input_scale", "F32", ())), mo)
    assert [t.name for t in out] == [M + ".weight"] and out[0].dtype == "F32"
    assert (dec[M + ".weight"].layout, dec[M + ".weight"].decode_global) == ("modelopt", True)


def test_nothing_is_decoded_without_a_declaration_and_a_rotation_is_refused() -> None:
    tensors = _infos((M + ".weight_packed", "U8", (64, 64)), (M + ".weight_scale", "F8_E4M3", (64, 8)),
                     (M + ".weight_global_scale", "F32", (1,)))
    assert input_weights(tensors, {})[1] == {}  # names alone decode nothing: the planner refuses the source
    rotated = {"quantization_config": {**CT_NV["quantization_config"], "transform_config": {"config_groups": {
        "had16": {"type": "hadamard", "head_dim": 16}}}}}
    with pytest.raises(SourceError, match=r"had16-rotated .*\(drop --requantize\)"):
        input_weights(tensors, rotated)
