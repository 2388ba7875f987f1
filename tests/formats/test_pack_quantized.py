"""compressed-tensors pack-quantized INT4 sources (issue 44): decoded exactly, against compressed-tensors' own
unpacking, planned from headers, refused by name when they cannot be decoded, and converted exactly like the
fp32 checkpoint of their exact values (dense and MoE, symmetric and asymmetric, group and channel)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("compressed_tensors")

from click.testing import CliRunner  # noqa: E402
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.utils.helpers import calculate_qparams  # noqa: E402

from fp4convert.cli.main import main  # noqa: E402
from fp4convert.config import ConvertConfig  # noqa: E402
from fp4convert.errors import ShapeError, SourceError  # noqa: E402
from fp4convert.formats import get_format, input_weights  # noqa: E402
from fp4convert.kernels.tensor import dequantize_input  # noqa: E402
from fp4convert.numerics import reference as ref  # noqa: E402
from fp4convert.plan.planner import make_plan  # noqa: E402
from fp4convert.plan.types import KEEP, QUANTIZE  # noqa: E402
from fp4convert.storage.safetensors import TensorInfo  # noqa: E402
from tests import foreign, oracle, zoo  # noqa: E402


def compressed(w: torch.Tensor, strategy: str, symmetric: bool, group: int | None, scale_dtype: torch.dtype):
    """``w`` ([..., M, K], 2-D or a 3-D stack) compressed by compressed-tensors, and its scheme."""
    args = QuantizationArgs(num_bits=4, type="int", strategy=strategy, group_size=group, symmetric=symmetric)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    x = w.float()
    if strategy == "group":
        b = x.reshape(*x.shape[:-1], -1, group)
        lo, hi = b.amin(-1), b.amax(-1)
    else:
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale, zp = calculate_qparams(lo, hi, args)
    state = {"weight": w, "weight_scale": scale.to(scale_dtype)}
    if not symmetric:
        state["weight_zero_point"] = zp.to(torch.int8)
    return PackedQuantizationCompressor.compress(state, scheme), scheme


CASES = [("group", True, 32), ("group", False, 32), ("group", True, 128), ("channel", True, None),
         ("channel", False, None)]


@pytest.mark.parametrize("lead", [(), (3,)], ids=["matrix", "experts"])
@pytest.mark.parametrize("strategy,symmetric,group", CASES)
def test_decode_is_exact_and_is_compressed_tensors_decompression(strategy, symmetric, group, lead) -> None:
    """Our decode is (q - z) * scale in fp32: compressed-tensors' own decompression gives exactly that with an
    fp32 scale, and exactly that rounded to bf16 with the bf16 scale it computes in."""
    g = torch.Generator().manual_seed(oracle.fresh_seed())
    w = (torch.randn(*lead, 40, 256, generator=g) * torch.rand(*lead, 40, 1, generator=g) * 3).to(torch.bfloat16)
    c, scheme = compressed(w, strategy, symmetric, group, torch.bfloat16)
    assert c["weight_packed"].dtype == torch.int32 and c["weight_scale"].dtype == torch.bfloat16
    inputs = [c["weight_packed"], c["weight_scale"]] + ([c["weight_zero_point"]] if not symmetric else []) + \
        [c["weight_shape"]]
    ours = dequantize_input("int4_pack", inputs, group=group, cols=256, zero_point=not symmetric)
    assert ours.dtype == torch.float32 and ours.shape == w.shape
    theirs_bf16 = PackedQuantizationCompressor.decompress(dict(c), scheme)["weight"]
    assert theirs_bf16.dtype == torch.bfloat16
    assert torch.equal(ours.to(torch.bfloat16).view(torch.int16), theirs_bf16.view(torch.int16))
    wide = PackedQuantizationCompressor.decompress(dict(c, weight_scale=c["weight_scale"].float()), scheme)["weight"]
    assert torch.equal(ours.view(torch.int32), wide.view(torch.int32))
    assert int((ours != theirs_bf16.float()).sum()) > 0  # bf16 arithmetic rounds: the exact values differ
    assert float((ours - w.float()).abs().max()) < float(w.float().abs().max()) / 4  # a 4-bit copy of w


def test_decode_hand_values() -> None:
    """One word per row by hand: element i in bits 4i..4i+3 stored as q + 8; zero points packed along rows."""
    q = [[-8, -1, 0, 1, 7, 3, -3, 2], [0, 0, 0, 0, 0, 0, 0, -8]]
    words = [sum(((v + 8) & 0xF) << (4 * i) for i, v in enumerate(row)) for row in q]
    packed = torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w] for w in words], dtype=torch.int32)
    scale = torch.tensor([[0.5], [2.0]], dtype=torch.bfloat16)
    assert ref.int4_unpack(packed, 8).tolist() == q
    assert ref.int4_pack_dequantize(packed, scale, 8).tolist() == [[v * 0.5 for v in q[0]], [v * 2.0 for v in q[1]]]
    zp = torch.tensor([[((3 + 8) | ((-2 + 8) << 4))]], dtype=torch.int32)  # row 0: z = 3, row 1: z = -2
    assert ref.int4_unpack_zero_point(zp, 2).tolist() == [[3], [-2]]
    out = ref.int4_pack_dequantize(packed, scale, 8, zero_point=zp)
    assert out.tolist() == [[(v - 3) * 0.5 for v in q[0]], [(v + 2) * 2.0 for v in q[1]]]
    assert ref.int4_pack_dequantize(packed[:, :1], scale, 5).shape == (2, 5)  # a row padded to a whole word


def test_fp32_scales_round_once_and_nan_propagates() -> None:
    packed = torch.full((1, 1), 0x0F0F0F0F, dtype=torch.int32)  # nibbles F, 0, F, 0, ...: q = 7, -8, 7, -8, ...
    s = torch.tensor([[1.0 + 2**-23]])
    out = ref.int4_pack_dequantize(packed, s, 8)
    assert out[0, 0].item() == oracle.f32(7 * (1.0 + 2**-23))
    assert bool(ref.int4_pack_dequantize(packed, torch.tensor([[float("nan")]]), 8).isnan().all())


def test_weight_shape_is_checked_when_decoded() -> None:
    """A row length the headers cannot tell (channel strategy, K not a multiple of 8) is caught at decode."""
    w = torch.randn(4, 20, dtype=torch.bfloat16)
    c, _ = compressed(w, "channel", True, None, torch.bfloat16)
    assert c["weight_packed"].shape == (4, 3)
    with pytest.raises(ShapeError, match=r"weight_shape says \[4, 20\]"):
        dequantize_input("int4_pack", [c["weight_packed"], c["weight_scale"], c["weight_shape"]], cols=24)
    got = dequantize_input("int4_pack", [c["weight_packed"], c["weight_scale"], c["weight_shape"]], cols=20)
    assert got.shape == (4, 20)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_decode_on_the_gpu_gives_the_cpu_bits() -> None:
    w = torch.randn(3, 64, 256, dtype=torch.bfloat16)
    c, _ = compressed(w, "group", False, 32, torch.bfloat16)
    inputs = [c["weight_packed"], c["weight_scale"], c["weight_zero_point"], c["weight_shape"]]
    cpu = dequantize_input("int4_pack", inputs, group=32, cols=256, zero_point=True)
    gpu = dequantize_input("int4_pack", [t.cuda() for t in inputs], group=32, cols=256, zero_point=True)
    assert gpu.is_cuda and torch.equal(gpu.cpu().view(torch.int32), cpu.view(torch.int32))


# ---------------------------------------------------------------------------------------------
# Planning from headers
# ---------------------------------------------------------------------------------------------

def _info(name: str, dtype: str, shape: tuple[int, ...]) -> TensorInfo:
    return TensorInfo(name, dtype, shape, "model.safetensors", 0, 0)


def _qc(**weights) -> dict:
    args = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True, **weights}
    return {"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": args}}}}


def _int4(m: str = "model.layers.0.mlp.down_proj", rows: int = 64, cols: int = 128, groups: int = 4,
          zp: bool = False) -> dict[str, TensorInfo]:
    t = [_info(f"{m}.weight_packed", "I32", (rows, -(-cols // 8))), _info(f"{m}.weight_scale", "BF16", (rows, groups)),
         _info(f"{m}.weight_shape", "I64", (2,))]
    if zp:
        t.append(_info(f"{m}.weight_zero_point", "I32", (-(-rows // 8), groups)))
    return {x.name: x for x in t}


def test_planner_sees_the_fp32_weight_and_consumes_the_parts() -> None:
    tensors = {**_int4(zp=True), "model.norm.weight": _info("model.norm.weight", "BF16", (64,))}
    out, decodes = input_weights(list(tensors.values()), _qc(symmetric=False))
    assert [(t.name, t.dtype, t.shape) for t in out] == [("model.layers.0.mlp.down_proj.weight", "F32", (64, 128)),
                                                          ("model.norm.weight", "BF16", (64,))]
    d = decodes["model.layers.0.mlp.down_proj.weight"]
    assert (d.kind, d.group, d.cols, d.zero_point) == ("int4_pack", 32, 128, True)
    assert [t.name.rsplit(".", 1)[1] for t in d.inputs] == ["weight_packed", "weight_scale", "weight_zero_point",
                                                          "weight_shape"]
    assert d.to_json()["group"] == 32 and "INT4 pack-quantized (asymmetric, a scale per 32)" in d.describe()
    plan = make_plan(list(tensors.values()), ConvertConfig(), get_format("compressed-tensors"), _qc(symmetric=False))
    dec = plan.by_name["model.layers.0.mlp.down_proj.weight"]
    assert dec.action == QUANTIZE and "decoded from INT4 pack-quantized" in dec.reason
    assert dec.read_bytes == sum(t.nbytes for t in d.inputs)


def test_channel_strategy_and_a_kept_int4_weight() -> None:
    tensors = _int4(groups=1, cols=40)  # K=40 is no multiple of 16: kept, written decoded
    plan = make_plan(list(tensors.values()), ConvertConfig(), get_format("fp4convert"),
                     _qc(strategy="channel", group_size=None))
    d = plan.decisions[0]
    assert d.info.shape == (64, 40) and d.action == KEEP and d.outputs[0].dtype == "F32"
    assert d.decode is not None and d.decode.group is None and "written decoded (F32)" in d.reason


@pytest.mark.parametrize("qc,tensors,match", [
    (_qc(num_bits=8), _int4(), r"num_bits is 8"),
    (_qc(strategy="block"), _int4(), r"strategy is 'block'"),
    (_qc(group_size=64), _int4(), r"4 groups of 64 weights need 32 int32 words per row, the packed weight has 16"),
    (_qc(symmetric=False), _int4(), r"symmetric is False, but .*weight_zero_point is missing"),
    (_qc(), _int4(zp=True), r"symmetric is True, but .*weight_zero_point is present"),
    ({}, _int4(), r"no integer config group targeting this module"),
])
def test_what_cannot_be_decoded_is_refused_by_name(qc, tensors, match) -> None:
    with pytest.raises(SourceError, match=match) as e:
        input_weights(list(tensors.values()), qc)
    assert "model.layers.0.mlp.down_proj.weight_packed" in str(e.value) or "weight_zero_point" in str(e.value)
    assert e.value.exit_code == 4


def test_targets_by_name_beat_a_class_target() -> None:
    qc = _qc()
    qc["quantization_config"]["config_groups"]["group_1"] = {
        "targets": ["re:.*down_proj$"], "weights": {"num_bits": 4, "type": "int", "strategy": "channel",
                                                    "symmetric": True}}
    tensors = {**_int4(groups=1), **_int4("model.layers.0.mlp.up_proj")}
    _, decodes = input_weights(list(tensors.values()), qc)
    assert decodes["model.layers.0.mlp.down_proj.weight"].group is None
    assert decodes["model.layers.0.mlp.up_proj.weight"].group == 32


# ---------------------------------------------------------------------------------------------
# Whole conversions: the INT4 source converts exactly like the fp32 checkpoint of its exact values
# ---------------------------------------------------------------------------------------------

def _convert(src: Path, dst: Path, *extra: str) -> None:
    result = CliRunner().invoke(main, ["quantize", str(src), str(dst), "--format", "compressed-tensors",
                                       "--device", "cpu", "--quiet", *extra])
    assert result.exit_code == 0, result.output


def _same_shards(a: Path, b: Path) -> None:
    fa = sorted(p.name for p in zoo.shard_files(a))
    assert fa == sorted(p.name for p in zoo.shard_files(b))
    for f in fa:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


@pytest.mark.parametrize("family,kw", [
    ("llama", dict(strategy="group", group_size=32, symmetric=True)),
    ("deepseek_v3", dict(strategy="channel", symmetric=False, pick=foreign.experts_only)),
    ("qwen3_moe", dict(strategy="group", group_size=32, symmetric=False, scale_dtype=torch.float16)),
], ids=["dense-sym-group", "moe-asym-channel-experts", "moe-asym-group-fp16"])
def test_int4_source_converts_like_its_exact_fp32_twin(tmp_path: Path, family, kw) -> None:
    src = zoo.build(family, tmp_path / "bf16")
    twin = foreign.int4_variant(src, tmp_path / "int4", **kw)
    zoo.write_like(src, tmp_path / "fp32", twin)
    _convert(tmp_path / "int4", tmp_path / "out-int4")
    _convert(tmp_path / "fp32", tmp_path / "out-fp32")
    _same_shards(tmp_path / "out-int4", tmp_path / "out-fp32")
    manifest = json.loads((tmp_path / "out-int4" / "fp4convert.json").read_text())
    decoded = [n for n, r in manifest["tensors"].items() if "decoded from INT4 pack-quantized" in r["reason"]]
    assert decoded and all(manifest["tensors"][n]["action"] == "quantize" for n in decoded)
    assert not any(n.endswith(("weight_packed", "weight_shape", "weight_zero_point")) for n in manifest["tensors"])
    qc = zoo.read_config(tmp_path / "out-int4")["quantization_config"]
    assert qc["format"] == "nvfp4-pack-quantized"  # the source's INT4 config is replaced, not merged


# ---------------------------------------------------------------------------------------------
# --method gptq on an INT4 source: the calibration pass must run the model on the exact weights
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family,kw", [("llama", dict(group_size=32)),
                                       ("qwen3_moe", dict(group_size=32, symmetric=False))], ids=["dense", "moe"])
def test_gptq_on_an_int4_source_equals_gptq_on_its_exact_fp32_twin(tmp_path: Path, family, kw) -> None:
    from tests.calibrate.test_calibrate import TEXT, add_tokenizer

    text = tmp_path / "calibration.txt"
    text.write_text(TEXT)
    src = zoo.build(family, tmp_path / "bf16")
    twin = foreign.int4_variant(src, tmp_path / "int4", **kw)
    add_tokenizer(zoo.write_like(src, tmp_path / "fp32", twin))
    add_tokenizer(tmp_path / "int4")
    gptq = ["--method", "gptq", "--calibration-data", str(text), "--calibration-samples", "4",
            "--calibration-seq-len", "48"]
    _convert(tmp_path / "fp32", tmp_path / "out-fp32", *gptq)
    _convert(tmp_path / "int4", tmp_path / "out-int4", *gptq)
    _same_shards(tmp_path / "out-int4", tmp_path / "out-fp32")
