"""Engine formats proven by real consumers: transformers + compressed-tensors load what we write.

Each test converts the shipped tiny Llama, loads the result with the consumer's own code (offline,
CPU), and checks (1) every quantized Linear's weight equals our own dequantization bit for bit,
(2) the logits stay close to the bf16 model's. Cosine similarity of the logits against the bf16
model, measured on the shipped tiny-llama (random weights, 8 tokens; transformers 5.23,
compressed-tensors 0.20): NVFP4 0.9777, MXFP4 0.9719, Had16 + NVFP4 with the online rotation applied
0.9799 and 0.101 without it (why transformers alone, which ignores transform_config, cannot serve a
rotated checkpoint). The thresholds sit just under the measurements.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM, CompressedTensorsConfig  # noqa: E402

import fp4convert  # noqa: E402
from fp4convert.config import ConvertConfig  # noqa: E402
from fp4convert.run.convert import convert  # noqa: E402
from fp4convert.checkpoint.export import export  # noqa: E402
from fp4convert.checkpoint.inspect import inspect_checkpoint  # noqa: E402

EXAMPLE = Path(__file__).parents[2] / "examples" / "tiny-llama"
TOKENS = torch.tensor([[1, 17, 42, 99, 256, 300, 7, 511]])
LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


@pytest.fixture(scope="module")
def bf16_logits() -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(EXAMPLE, dtype=torch.bfloat16)
    with torch.no_grad():
        return model(TOKENS).logits.float()


def load_ct(path: Path):
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, quantization_config=CompressedTensorsConfig(dequantize=True)
    )


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()


def source_weight(name: str) -> torch.Tensor:
    index = json.loads((EXAMPLE / "model.safetensors.index.json").read_text())["weight_map"]
    return load_file(EXAMPLE / index[name])[name]


def expected_weight(layer: int, lin: str, scheme: str, rotate: str | None = None) -> torch.Tensor:
    """Our own dequantization of what the converter wrote (group amax for fused layers)."""
    name = f"model.layers.{layer}.{lin}.weight"
    x = source_weight(name)
    group_amax = None
    if scheme == "nvfp4":
        leaf = lin.split(".")[-1]
        group = {"q_proj": LINEARS[:3], "k_proj": LINEARS[:3], "v_proj": LINEARS[:3],
                 "gate_proj": LINEARS[4:6], "up_proj": LINEARS[4:6]}.get(leaf, [lin])
        group_amax = max(fp4convert.amax(source_weight(f"model.layers.{layer}.{m}.weight"), rotate=rotate) for m in group)
    q = fp4convert.quantize(x, scheme, rotate=rotate, global_amax=group_amax)
    if rotate:  # the checkpoint holds rotated weights: compare in the rotated domain
        q = fp4convert.QuantizedTensor(q.packed, q.scale, q.global_scale, q.scheme, None)
    return fp4convert.dequantize(q, torch.bfloat16)


def assert_weights_bit_exact(model, scheme: str, rotate: str | None = None) -> None:
    for layer in range(2):
        for lin in LINEARS:
            mod = model.model.layers[layer]
            for part in lin.split("."):
                mod = getattr(mod, part)
            got = mod.weight.data
            want = expected_weight(layer, lin, scheme, rotate)
            assert got.dtype == torch.bfloat16
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"layer {layer} {lin}"


@pytest.mark.parametrize("scheme,min_cos", [("nvfp4", 0.97), ("mxfp4", 0.965)])
def test_transformers_loads_compressed_tensors(tmp_path: Path, bf16_logits, scheme: str, min_cos: float) -> None:
    out = tmp_path / scheme
    convert(str(EXAMPLE), out, ConvertConfig(scheme=scheme, format="compressed-tensors"))
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == f"{scheme}-pack-quantized" and qc["quantization_status"] == "compressed"
    assert qc["config_groups"]["group_0"]["input_activations"] is None
    assert qc["ignore"] == ["lm_head", "model.embed_tokens"]
    shard = load_file(out / "model.safetensors")
    if scheme == "nvfp4":
        assert shard["model.layers.0.self_attn.q_proj.weight_global_scale"].shape == (1,)
        assert shard["model.layers.0.self_attn.q_proj.weight_scale"].shape == (256, 16)  # linear, unpadded
    model = load_ct(out)
    assert_weights_bit_exact(model, scheme)
    with torch.no_grad():
        logits = model(TOKENS).logits.float()
    assert cosine(logits, bf16_logits) > min_cos
    assert inspect_checkpoint(str(out))["ok"]


def test_modelopt_through_compressed_tensors_converter(tmp_path: Path, bf16_logits) -> None:
    from compressed_tensors.entrypoints.convert import ModelOptNvfp4Converter, convert_checkpoint

    mo = tmp_path / "modelopt"
    convert(str(EXAMPLE), mo, ConvertConfig(format="modelopt"))
    hq = json.loads((mo / "hf_quant_config.json").read_text())
    assert hq["quantization"]["quant_algo"] == "NVFP4" and hq["quantization"]["exclude_modules"]
    raw = load_file(mo / "model.safetensors")
    w2 = raw["model.layers.0.self_attn.q_proj.weight_scale_2"]
    assert w2.dim() == 0 and w2.dtype == torch.float32 and raw["model.layers.0.self_attn.q_proj.weight"].dtype == torch.uint8
    assert inspect_checkpoint(str(mo))["format"] == "modelopt"

    ct = tmp_path / "ct"
    convert_checkpoint(str(mo), str(ct), ModelOptNvfp4Converter(targets=["Linear"], ignore=hq["quantization"]["exclude_modules"]),
                       device="cpu")
    # The two adaptations NOTES.md describes: the converter keeps ModelOpt's 0-dim scale (transformers
    # expects [1]) and writes the W4A4 preset for a weight-only checkpoint.
    for f in ct.glob("*.safetensors"):
        sd = load_file(f)
        save_file({k: v.reshape(1) if k.endswith("weight_global_scale") else v for k, v in sd.items()}, f,
                  metadata={"format": "pt"})
    cfg = json.loads((ct / "config.json").read_text())
    for group in cfg["quantization_config"]["config_groups"].values():
        group["input_activations"] = None
    (ct / "config.json").write_text(json.dumps(cfg))

    model = load_ct(ct)
    # The converter recomputes gs as 1 / weight_scale_2 = 1 / (1 / gs): compare with that gs.
    for layer in range(2):
        for lin in LINEARS:
            mod = model.model.layers[layer]
            for part in lin.split("."):
                mod = getattr(mod, part)
            base = f"model.layers.{layer}.{lin}"
            q = fp4convert.QuantizedTensor(raw[base + ".weight"], raw[base + ".weight_scale"],
                                           1.0 / raw[base + ".weight_scale_2"], "nvfp4")
            assert torch.equal(mod.weight.data.view(torch.int16), fp4convert.dequantize(q).view(torch.int16)), base
    with torch.no_grad():
        assert cosine(model(TOKENS).logits.float(), bf16_logits) > 0.97


def test_had16_compressed_tensors_needs_and_gets_the_online_rotation(tmp_path: Path, bf16_logits) -> None:
    from compressed_tensors.transform import TransformConfig, apply_transform_config

    out = tmp_path / "had16"
    convert(str(EXAMPLE), out, ConvertConfig(format="compressed-tensors", rotate="had16"))
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    tc = qc["transform_config"]
    scheme = tc["config_groups"]["had16"]
    assert scheme["type"] == "hadamard" and scheme["head_dim"] == 16
    assert {a["location"] for a in scheme["apply"]} == {"input", "weight_input"}
    assert inspect_checkpoint(str(out))["rotate"] == "had16"

    model = load_ct(out)
    assert_weights_bit_exact(model, "nvfp4", rotate="had16")  # rotated weights, quantized bit-exactly
    with torch.no_grad():
        unrotated = cosine(model(TOKENS).logits.float(), bf16_logits)
    # Apply only the online entry, as vLLM does; the weight entry is already fused into the weights.
    online = json.loads(json.dumps(tc))
    online["config_groups"]["had16"]["apply"] = [a for a in scheme["apply"] if a["location"] == "input"]
    apply_transform_config(model, TransformConfig.model_validate(online))
    with torch.no_grad():
        rotated = cosine(model(TOKENS).logits.float(), bf16_logits)
    assert rotated > 0.97 and unrotated < 0.5


def test_modelopt_refuses_mxfp4_and_rotation(tmp_path: Path) -> None:
    from fp4convert.errors import ConfigError

    with pytest.raises(ConfigError, match="NVFP4 only"):
        convert(str(EXAMPLE), tmp_path / "a", ConvertConfig(scheme="mxfp4", format="modelopt"))
    with pytest.raises(ConfigError, match="cannot record a rotation"):
        convert(str(EXAMPLE), tmp_path / "b", ConvertConfig(rotate="had16", format="modelopt"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("fmt,scheme", [("compressed-tensors", "nvfp4"), ("compressed-tensors", "mxfp4"), ("modelopt", "nvfp4")])
def test_export_equals_direct_conversion(tmp_path: Path, fmt: str, scheme: str) -> None:
    native = tmp_path / "native"
    convert(str(EXAMPLE), native, ConvertConfig(scheme=scheme, max_shard_size=1_000_000))
    direct = tmp_path / "direct"
    convert(str(EXAMPLE), direct, ConvertConfig(scheme=scheme, format=fmt, max_shard_size=1_000_000))
    exported = tmp_path / "exported"
    export(str(native), exported, ConvertConfig(format=fmt, max_shard_size=1_000_000))
    files = sorted(p.name for p in direct.iterdir() if p.name != "fp4convert.json")
    assert files == sorted(p.name for p in exported.iterdir() if p.name != "fp4convert.json")
    assert len([f for f in files if f.endswith(".safetensors")]) > 1
    for f in files:
        assert (direct / f).read_bytes() == (exported / f).read_bytes(), f
    report = inspect_checkpoint(str(exported), check_files=True)
    assert report["ok"] and report["format"] == fmt


@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp4"])
def test_an_fp32_model_in_compressed_tensors_loads_with_a_plain_from_pretrained(tmp_path, scheme) -> None:
    """Issue 23 item 17: compressed-tensors decompresses FP4 weights to bf16, so an fp32 model's output
    failed at the first forward ('Float and BFloat16'). The output's config says bfloat16 now."""
    from transformers import AutoModel

    from tests import zoo

    torch.manual_seed(0)
    model = transformers.BertModel(zoo._config("bert")).float().eval()
    model.save_pretrained(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "q", ConvertConfig(device="cpu", format="compressed-tensors", scheme=scheme))
    assert json.loads((tmp_path / "q" / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = AutoModel.from_pretrained(tmp_path / "q")
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        got = loaded(input_ids=ids).last_hidden_state.float()
        want = model(input_ids=ids).last_hidden_state
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.95


def test_kept_dtype_bf16_of_an_fp32_model_loads_as_the_default_output_does(tmp_path) -> None:
    """Issue 23 item 17's second half: an fp32 model's kept tensors stayed fp32 on disk, though transformers loads
    a compressed-tensors output in bf16 anyway. With --kept-dtype bf16 they are BF16 on disk (smaller shards), and
    transformers loads the very same model: every parameter equal to the default output's."""
    from tests import zoo

    src = zoo.build("llama", tmp_path / "src", dtype=torch.float32)
    c = dict(device="cpu", format="compressed-tensors")
    convert(src, tmp_path / "plain", ConvertConfig(**c))
    convert(src, tmp_path / "bf16", ConvertConfig(**c, kept_dtype="bf16"))
    size = {k: sum(p.stat().st_size for p in (tmp_path / k).glob("*.safetensors")) for k in ("plain", "bf16")}
    assert size["bf16"] < size["plain"]
    assert zoo.read_tensors(tmp_path / "bf16")["model.norm.weight"].dtype == torch.bfloat16
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "plain", quantization_config=CompressedTensorsConfig(dequantize=True))
    bf16 = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", quantization_config=CompressedTensorsConfig(dequantize=True))
    want, got = plain.state_dict(), bf16.state_dict()
    assert sorted(want) == sorted(got)
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
    with torch.no_grad():
        assert torch.equal(bf16(TOKENS[:, :6] % 128).logits, plain(TOKENS[:, :6] % 128).logits)
