"""The exact input decoders (docs/numerics.md "Quantized inputs"): hand-computed values, torch's own float8 cast, round trips."""

from __future__ import annotations

import math

import pytest
import torch

from fp4convert.numerics import reference as ref
from fp4convert.errors import QuantizationError, ShapeError

from tests import oracle


def e4m3(values: list[list[float]]) -> torch.Tensor:
    return torch.tensor(values).to(torch.float8_e4m3fn)


# ---------------------------------------------------------------------------------------------
# FP8 block-scaled
# ---------------------------------------------------------------------------------------------

def test_fp8_block_hand_values_with_partial_edge_blocks() -> None:
    w = e4m3([[1.0, 2.0, 3.0], [0.5, -1.0, 448.0], [-0.0, 0.25, 6.0]])
    scale_inv = torch.tensor([[2.0, 0.5], [4.0, 8.0]])  # blocks 2x2: rows {0,1},{2}; cols {0,1},{2}
    out = ref.fp8_block_dequantize(w, scale_inv, (2, 2))
    assert out.dtype == torch.float32
    assert out.tolist() == [[2.0, 4.0, 1.5], [1.0, -2.0, 224.0], [-0.0, 1.0, 48.0]]
    assert math.copysign(1.0, out[2, 0].item()) == -1.0  # -0 * 4 keeps its sign


def test_fp8_block_is_one_fp32_multiply_of_torchs_cast() -> None:
    seed = oracle.fresh_seed()
    g = torch.Generator().manual_seed(seed)
    m, n, bm, bn = 37, 300, 16, 128  # ragged in both dims
    bits = torch.randint(0, 256, (m, n), generator=g, dtype=torch.int32).to(torch.uint8)
    bits[bits.bitwise_and(0x7F) == 0x7F] = 0x3C  # NaN codes are tested separately
    w = bits.view(torch.float8_e4m3fn)
    scale_inv = torch.rand(3, 3, generator=g) * torch.exp2(torch.randint(-20, 20, (3, 3), generator=g).float())
    out = ref.fp8_block_dequantize(w, scale_inv, (bm, bn))
    wf = w.float().tolist()
    s = scale_inv.tolist()
    expected = [[oracle.f32(wf[i][j] * s[i // bm][j // bn]) for j in range(n)] for i in range(m)]
    assert out.tolist() == expected
    assert torch.equal(ref.fp8_block_dequantize(bits, scale_inv, (bm, bn)), out)  # raw uint8 bits too


def test_fp8_block_every_byte_and_nan_propagates() -> None:
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(2, 128)
    out = ref.fp8_block_dequantize(bits.view(torch.float8_e4m3fn), torch.tensor([[0.75]]), (128, 128))
    torch_cast = bits.view(torch.float8_e4m3fn).float() * 0.75
    assert torch.equal(out.isnan(), torch_cast.isnan()) and int(out.isnan().sum()) == 2  # 0x7F and 0xFF
    finite = ~out.isnan()
    assert torch.equal(out[finite].view(torch.int32), torch_cast[finite].view(torch.int32))
    assert torch.equal(ref.e4m3_decode(bits)[finite] * 0.75, out[finite])


def test_fp8_block_experts_are_independent_and_bf16_scales_widen() -> None:
    w = (torch.randn(3, 20, 40) * 10).to(torch.float8_e4m3fn)
    s = torch.rand(3, 2, 3).bfloat16()
    out = ref.fp8_block_dequantize(w, s, (16, 16))
    assert out.shape == (3, 20, 40)
    for e in range(3):
        assert torch.equal(out[e], ref.fp8_block_dequantize(w[e], s[e].float(), (16, 16)))
    shared = ref.fp8_block_dequantize(w, s[0].float(), (16, 16))  # one scale grid broadcast to every expert
    assert torch.equal(shared[2], ref.fp8_block_dequantize(w[2], s[0].float(), (16, 16)))


@pytest.mark.parametrize(
    "shape,block,err",
    [((2, 3), (16, 16), ShapeError), ((1, 2), (16, 16), ShapeError), ((1, 1), (0, 16), ShapeError)],
)
def test_fp8_block_refuses_mismatched_scales(shape, block, err) -> None:
    w = torch.zeros(20, 20).to(torch.float8_e4m3fn)  # needs [2, 2] scales for 16x16 blocks
    with pytest.raises(err):
        ref.fp8_block_dequantize(w, torch.ones(shape), block)


def test_fp8_decoders_refuse_non_fp8_weights_and_integer_scales() -> None:
    with pytest.raises(QuantizationError, match="float8_e4m3fn"):
        ref.fp8_block_dequantize(torch.zeros(4, 4), torch.ones(1, 1), (4, 4))
    with pytest.raises(QuantizationError, match="scale"):
        ref.fp8_scaled_dequantize(torch.zeros(4, 4).to(torch.float8_e4m3fn), torch.ones(1, dtype=torch.int32))
    with pytest.raises(ShapeError, match="leading dims"):
        ref.fp8_block_dequantize(torch.zeros(3, 4, 4).to(torch.float8_e4m3fn), torch.ones(2, 1, 1), (4, 4))


# ---------------------------------------------------------------------------------------------
# FP8 per tensor / per channel
# ---------------------------------------------------------------------------------------------

def test_fp8_scaled_per_tensor_and_per_channel_hand_values() -> None:
    w = e4m3([[1.0, -2.0], [3.0, 0.5]])
    for s in (torch.tensor(3.0), torch.tensor([3.0])):
        assert ref.fp8_scaled_dequantize(w, s).tolist() == [[3.0, -6.0], [9.0, 1.5]]
    for s in (torch.tensor([2.0, 0.25]), torch.tensor([[2.0], [0.25]])):
        assert ref.fp8_scaled_dequantize(w, s).tolist() == [[2.0, -4.0], [0.75, 0.125]]


def test_fp8_scaled_bf16_scale_widens_then_one_fp32_multiply() -> None:
    seed = oracle.fresh_seed()
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(8, 64, generator=g) * 30).to(torch.float8_e4m3fn)
    s = (torch.rand(8, 1, generator=g) + 0.1).bfloat16()
    out = ref.fp8_scaled_dequantize(w, s)
    expected = [[oracle.f32(a * sv[0]) for a in row] for row, sv in zip(w.float().tolist(), s.float().tolist())]
    assert out.tolist() == expected


def test_fp8_scaled_experts() -> None:
    w = (torch.randn(3, 4, 32) * 10).to(torch.float8_e4m3fn)
    per_expert = torch.tensor([0.5, 2.0, 3.0]).view(3, 1, 1)
    per_channel = torch.rand(3, 4, 1)
    assert torch.equal(ref.fp8_scaled_dequantize(w, per_expert)[1], w[1].float() * 2.0)
    assert torch.equal(ref.fp8_scaled_dequantize(w, per_channel)[2], ref.fp8_scaled_dequantize(w[2], per_channel[2]))
    assert torch.equal(ref.fp8_scaled_dequantize(w, per_channel[..., 0]), ref.fp8_scaled_dequantize(w, per_channel))


@pytest.mark.parametrize("shape", [(3,), (4, 2), (2, 4)])
def test_fp8_scaled_refuses_other_shapes(shape) -> None:
    w = torch.zeros(4, 8).to(torch.float8_e4m3fn)
    with pytest.raises(ShapeError, match="neither per tensor nor per output channel"):
        ref.fp8_scaled_dequantize(w, torch.ones(shape))


# ---------------------------------------------------------------------------------------------
# gpt-oss MXFP4 blocks
# ---------------------------------------------------------------------------------------------

def test_mxfp4_blocks_hand_values_low_nibble_first() -> None:
    blocks = torch.zeros(2, 16, dtype=torch.uint8)
    blocks[0, 0] = 0x21  # element 0: code 1 (0.5), element 1: code 2 (1.0)
    blocks[0, 15] = 0xF8  # element 30: code 8 (-0.0), element 31: code 15 (-6)
    blocks[1, 1] = 0x07  # element 34 of the flat row: code 7 (6)
    scales = torch.tensor([128, 0], dtype=torch.uint8)  # x2, then 2^-127 (a subnormal step)
    out = ref.mxfp4_blocks_dequantize(blocks, scales)
    assert out.shape == (64,)
    assert out[:2].tolist() == [1.0, 2.0] and out[31].item() == -12.0
    assert out[30].item() == 0.0 and math.copysign(1.0, out[30].item()) == -1.0
    assert out[34].item() == 6 * 2.0**-127 and out[34].item() > 0
    assert out[2:30].eq(0).all() and out[32:34].eq(0).all()


def test_mxfp4_blocks_nan_and_overflow_propagate() -> None:
    blocks = torch.full((2, 16), 0x77, dtype=torch.uint8)  # every code 7 (6)
    out = ref.mxfp4_blocks_dequantize(blocks, torch.tensor([255, 254], dtype=torch.uint8))
    assert out[:32].isnan().all()  # a scale byte of 255 is NaN
    assert out[32:].isinf().all()  # 6 * 2^127 does not fit fp32


def test_mxfp4_blocks_equal_our_own_mxfp4_decode() -> None:
    x = oracle.random_weight(2 * 6, 128, oracle.fresh_seed()).reshape(2, 6, 128)  # 2 experts
    for rule in ref.SCALE_RULES["mxfp4"]:
        packed, scale = ref.mxfp4_quantize(x, scale_rule=rule)
        blocks = packed.reshape(2, 6, 4, 16)  # gpt-oss layout: [E, out, in/32, 16]
        out = ref.mxfp4_blocks_dequantize(blocks, scale)
        assert out.shape == (2, 6, 128)
        assert torch.equal(out.view(torch.int32), ref.mxfp4_dequantize(packed, scale).view(torch.int32))


def test_mxfp4_blocks_refuse_bad_inputs() -> None:
    with pytest.raises(ShapeError):
        ref.mxfp4_blocks_dequantize(torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, dtype=torch.uint8))
    with pytest.raises(ShapeError):
        ref.mxfp4_blocks_dequantize(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(QuantizationError, match="uint8"):
        ref.mxfp4_blocks_dequantize(torch.zeros(2, 16), torch.zeros(2, dtype=torch.uint8))
