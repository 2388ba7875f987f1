"""Re-laying FP4 checkpoints between formats (issue 44): ours in any format, and compressed-tensors / ModelOpt
checkpoints another tool wrote, into every format that can hold them, with the codes and scales of a direct
conversion of the same weights; what cannot be held is refused (or, with --requantize, quantized again from the
exactly decoded weights); the outputs load where their format is loaded today."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("compressed_tensors")

from click.testing import CliRunner  # noqa: E402

import fp4convert  # noqa: E402
from fp4convert.checkpoint.export import export, plan_relayout, relayout  # noqa: E402
from fp4convert.checkpoint.inspect import inspect_checkpoint  # noqa: E402
from fp4convert.cli.main import main  # noqa: E402
from fp4convert.config import ConvertConfig  # noqa: E402
from fp4convert.errors import ConfigError, PlanError  # noqa: E402
from fp4convert.run.convert import convert, plan_conversion  # noqa: E402
from fp4convert.source.open import open_source  # noqa: E402
from tests import foreign, zoo  # noqa: E402

SHARD = 40_000  # bytes: the tiny models' outputs span several shards
FORMATS = ("fp4convert", "compressed-tensors", "modelopt")
CPU = dict(device="cpu", max_shard_size=SHARD)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("relayout")


_DIRECT: dict[tuple, Path] = {}


def gptq():
    """``--method gptq`` as the recipe carries it: the method's settings value (or, before the method seam,
    its name)."""
    import importlib

    methods = importlib.import_module("fp4convert.calibrate.methods")
    return methods.settings("gptq") if hasattr(methods, "settings") else "gptq"


def direct(root: Path, family: str, fmt: str, scheme: str = "nvfp4", **extra) -> Path:
    """``family``'s tiny bf16 model converted straight to ``fmt`` (cached per module)."""
    key = (family, fmt, scheme, tuple(sorted(extra.items())))
    if key not in _DIRECT:
        src = root / family
        if not src.exists():
            zoo.build(family, src)
        out = root / "-".join(["direct", family, fmt, scheme, *map(str, extra.values())])
        convert(src, out, ConvertConfig(**{"format": fmt, "scheme": scheme, **CPU, **extra}))
        _DIRECT[key] = out
    return _DIRECT[key]


@pytest.fixture(scope="module", autouse=True)
def _drop_cache():
    yield
    _DIRECT.clear()


def relay(src: Path, dst: Path, **cfg) -> None:
    planned = plan_relayout(open_source(str(src)), ConvertConfig(**{**CPU, **cfg}))
    assert planned is not None
    relayout(planned, dst)


def files_of(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in d.iterdir() if p.is_file() and p.name != "fp4convert.json"}


def assert_same_files(a: Path, b: Path) -> None:
    fa, fb = files_of(a), files_of(b)
    assert sorted(fa) == sorted(fb)
    assert len([f for f in fa if f.endswith(".safetensors")]) > 1
    for f in fa:
        assert fa[f] == fb[f], f


def tensors(d: Path) -> dict[str, torch.Tensor]:
    return zoo.read_tensors(d)


def stripped(src: Path, dst: Path) -> Path:
    """``src`` as another tool would have written it: no manifest, no card of ours."""
    shutil.copytree(src, dst)
    (dst / "fp4convert.json").unlink()
    (dst / "README.md").unlink()
    return dst


# ---------------------------------------------------------------------------------------------
# Our own outputs, every format into every other: the files of a direct conversion
# ---------------------------------------------------------------------------------------------

PAIRS = [(a, b, "nvfp4") for a in FORMATS for b in FORMATS if a != b] + \
    [("fp4convert", "compressed-tensors", "mxfp4"), ("compressed-tensors", "fp4convert", "mxfp4")]


@pytest.mark.parametrize("a,b,scheme", PAIRS)
def test_relayout_of_our_output_equals_a_direct_conversion(root, tmp_path, a, b, scheme) -> None:
    out = tmp_path / "out"
    relay(direct(root, "llama", a, scheme), out, format=b, scheme=scheme)
    assert_same_files(out, direct(root, "llama", b, scheme))  # shards, config files, index and card
    report = inspect_checkpoint(str(out), check_files=True)
    assert report["ok"], report["checks"]["problems"]
    manifest = json.loads((out / "fp4convert.json").read_text())
    q = [r for r in manifest["tensors"].values() if r["action"] == "quantize"]
    assert q and all("re-laid from" in r["reason"] for r in q)


@pytest.mark.parametrize("family,a,b", [("qwen3_moe", "fp4convert", "modelopt"),
                                        ("gpt_oss", "fp4convert", "compressed-tensors"),
                                        ("deepseek_v3", "compressed-tensors", "modelopt")])
def test_relayout_of_experts_equals_a_direct_conversion(root, tmp_path, family, a, b) -> None:
    """Per-expert modules (gate and up of each expert sharing a global scale), stacked experts split per expert
    (their global scales recorded per matrix), MLA's fused projections."""
    relay(direct(root, family, a), tmp_path / "out", format=b)
    assert_same_files(tmp_path / "out", direct(root, family, b))


def test_had16_relayout_needs_the_rotation_said_and_equals_a_direct_conversion(root, tmp_path) -> None:
    src = direct(root, "llama", "fp4convert", rotate="had16")
    with pytest.raises(PlanError, match="had16-rotated: pass --rotate had16"):
        relay(src, tmp_path / "no", format="compressed-tensors")
    with pytest.raises(ConfigError, match="--format modelopt cannot record a rotation"):
        relay(src, tmp_path / "mo", format="modelopt", rotate="had16")
    assert not (tmp_path / "no").exists() and not (tmp_path / "mo").exists()
    relay(src, tmp_path / "ct", format="compressed-tensors", rotate="had16")
    assert_same_files(tmp_path / "ct", direct(root, "llama", "compressed-tensors", rotate="had16"))


def test_w4a4_activation_scales_are_carried(root, tmp_path) -> None:
    """Our W4A4 output (constant activation scales: no calibration run) re-laid between the two engine formats:
    the files of a direct W4A4 conversion; the native format has no activation convention: refused."""
    w4a4 = dict(activations="nvfp4", activation_scale="constant")
    ct = direct(root, "llama", "compressed-tensors", **w4a4)
    relay(ct, tmp_path / "mo", format="modelopt")
    assert_same_files(tmp_path / "mo", direct(root, "llama", "modelopt", **w4a4))
    assert tensors(tmp_path / "mo")["model.layers.0.mlp.down_proj.input_scale"].item() == 1.0
    with pytest.raises(PlanError, match="W4A4 NVFP4 and --format fp4convert has no activation convention"):
        relay(ct, tmp_path / "nat", format="fp4convert")


# ---------------------------------------------------------------------------------------------
# Checkpoints other tools wrote
# ---------------------------------------------------------------------------------------------

def test_foreign_compressed_tensors_checkpoint_relays_exactly(root, tmp_path) -> None:
    """Our compressed-tensors output without its manifest stands for another tool's: every other format's direct
    conversion, byte for byte (compressed-tensors stores the encode scale gs itself)."""
    src = stripped(direct(root, "llama", "compressed-tensors"), tmp_path / "ct")
    for fmt in ("fp4convert", "modelopt"):
        relay(src, tmp_path / fmt, format=fmt)
        want, got = files_of(direct(root, "llama", fmt)), files_of(tmp_path / fmt)
        assert sorted(want) == sorted(got)
        for f in want:
            if f != "README.md":  # the card says how the weights were had: here, not recorded
                assert got[f] == want[f], (fmt, f)
        card = got["README.md"].decode()
        assert "re-laid from NVFP4 in the compressed-tensors layout without re-quantizing" in card


def test_foreign_modelopt_checkpoint_relays_with_the_reciprocal_of_its_decode_scale(root, tmp_path) -> None:
    """ModelOpt stores the decode scale 1/gs only: codes, block scales, config and every other tensor are a
    direct conversion's; each encode scale is fp32(1 / weight_scale_2), compressed-tensors' own converter's
    choice, which is the direct conversion's gs exactly where 1/(1/gs) round-trips in fp32."""
    mo = direct(root, "llama", "modelopt")
    src = stripped(mo, tmp_path / "mo")
    relay(src, tmp_path / "ct", format="compressed-tensors")
    got, want, stored = tensors(tmp_path / "ct"), tensors(direct(root, "llama", "compressed-tensors")), tensors(mo)
    assert sorted(got) == sorted(want)
    differ = 0
    for name, t in want.items():
        if not name.endswith("weight_global_scale"):
            assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name
            continue
        s2 = stored[name.replace("weight_global_scale", "weight_scale_2")]
        assert torch.equal(got[name], (1.0 / s2).reshape(1)), name
        differ += not torch.equal(got[name], t)
    roundtrip_misses = sum(not torch.equal(1.0 / (1.0 / t), t) for n, t in want.items()
                           if n.endswith("weight_global_scale"))
    assert differ == roundtrip_misses
    assert (tmp_path / "ct" / "config.json").read_bytes() == \
        (direct(root, "llama", "compressed-tensors") / "config.json").read_bytes()
    assert not (tmp_path / "ct" / "hf_quant_config.json").exists()  # the source format's own file is not copied
    # ...and it loads where compressed-tensors is loaded: transformers' weights are the files' dequantization
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ct", dtype=torch.bfloat16,
                                                 quantization_config=CompressedTensorsConfig(dequantize=True))
    params = dict(model.named_parameters())
    checked = 0
    for name in got:
        if name.endswith(".weight_packed"):
            m = name[: -len("_packed")]
            q = fp4convert.QuantizedTensor(got[name], got[m + "_scale"], got[m + "_global_scale"].reshape(()), "nvfp4")
            assert torch.equal(params[m].data.view(torch.int16), fp4convert.dequantize(q).view(torch.int16)), m
            checked += 1
    assert checked == 14


def _clean_ct(src: Path, dst: Path, **kw) -> dict[str, torch.Tensor]:
    """compressed-tensors' own NVFP4 checkpoint of ``src``, every fused group sharing one global scale."""
    shapes = zoo.read_shapes(src)
    shared: dict[str, list[str]] = {}
    for name in shapes:
        for leaf, group in (("q_proj", "qkv"), ("k_proj", "qkv"), ("v_proj", "qkv"), ("gate_proj", "mlp"),
                            ("up_proj", "mlp")):
            if name.endswith(f".{leaf}.weight"):
                shared.setdefault(name.rsplit(".", 2)[0] + group, []).append(name)
    return foreign.nvfp4_variant(src, dst, shared=shared, **kw)


@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp4"])
def test_compressed_tensors_own_checkpoint_round_trips_through_every_format(root, tmp_path, scheme) -> None:
    """A checkpoint compressed-tensors' compressors wrote: re-laid to native (and ModelOpt), then back to
    compressed-tensors, every tensor is the source's, its ignore list the source's; transformers loads the
    round trip with the weights it loads from the source."""
    direct(root, "llama", "fp4convert")  # builds the bf16 model
    written = _clean_ct(root / "llama", tmp_path / "ct", scheme=scheme)
    relay(tmp_path / "ct", tmp_path / "nat", format="fp4convert", scheme=scheme)
    assert inspect_checkpoint(str(tmp_path / "nat"))["ok"]
    export(str(tmp_path / "nat"), tmp_path / "back", ConvertConfig(format="compressed-tensors"))
    back = tensors(tmp_path / "back")
    assert sorted(back) == sorted(written)
    for name, t in written.items():
        assert torch.equal(back[name].view(torch.uint8), t.contiguous().view(torch.uint8)), name
    qc_src = zoo.read_config(tmp_path / "ct")["quantization_config"]
    assert zoo.read_config(tmp_path / "back")["quantization_config"]["ignore"] == qc_src["ignore"]
    if scheme == "nvfp4":
        relay(tmp_path / "ct", tmp_path / "mo", format="modelopt")
        mo = tensors(tmp_path / "mo")
        for name, t in written.items():
            if name.endswith("weight_packed"):
                assert torch.equal(mo[name[: -len("_packed")]], t), name
            elif name.endswith("weight_global_scale"):
                assert torch.equal(mo[name.replace("weight_global_scale", "weight_scale_2")], (1.0 / t).reshape(()))
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    def weights(path: Path) -> dict[str, torch.Tensor]:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                     quantization_config=CompressedTensorsConfig(dequantize=True))
        return {k: v.detach() for k, v in model.state_dict().items()}

    want, got = weights(tmp_path / "ct"), weights(tmp_path / "back")
    assert sorted(want) == sorted(got)
    for k in want:
        assert torch.equal(got[k].view(torch.int16), want[k].view(torch.int16)), k


def test_compressed_tensors_w4a4_activation_scales_become_modelopt_decode_scales(root, tmp_path) -> None:
    direct(root, "llama", "fp4convert")
    written = _clean_ct(root / "llama", tmp_path / "ct", w4a4=True)
    igs = {k[: -len(".input_global_scale")]: v for k, v in written.items() if k.endswith(".input_global_scale")}
    assert len(igs) == 14 and len({float(v) for v in igs.values()}) > 1
    relay(tmp_path / "ct", tmp_path / "mo", format="modelopt")
    mo = tensors(tmp_path / "mo")
    for module, v in igs.items():
        assert torch.equal(mo[module + ".input_scale"], (1.0 / v).reshape(())), module
    assert inspect_checkpoint(str(tmp_path / "mo"))["ok"]
    card = (tmp_path / "mo" / "README.md").read_text()
    assert "stored static scale per linear" in card
    with pytest.raises(PlanError, match="has no activation convention"):
        relay(tmp_path / "ct", tmp_path / "nat", format="fp4convert")


# ---------------------------------------------------------------------------------------------
# What cannot be re-laid, and --requantize
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("src_fmt,scheme,cfg,match", [
    ("compressed-tensors", "nvfp4", dict(format="fp4convert", scheme="mxfp4"),
     r"holds NVFP4 weights, not MXFP4: pass --scheme nvfp4 to re-lay them, or --requantize"),
    ("fp4convert", "mxfp4", dict(format="modelopt", scheme="mxfp4"), r"--format modelopt cannot hold MXFP4"),
    ("fp4convert", "mxfp4", dict(format="compressed-tensors"), r"holds MXFP4 weights, not NVFP4: pass --scheme mxfp4"),
    ("fp4convert", "nvfp4", dict(format="compressed-tensors", method=gptq()), r"--method / --input-weights"),
    ("fp4convert", "nvfp4", dict(format="compressed-tensors", ignore=("*o_proj*",)), r"--ignore / --only"),
    ("fp4convert", "nvfp4", dict(format="compressed-tensors", scale_rule="max"), r"--scale-rule max"),
    ("fp4convert", "nvfp4", dict(format="modelopt", activations="nvfp4"), r"carries no NVFP4 activation scales"),
    ("fp4convert", "nvfp4", dict(format="fp4convert"), r"already quantized .* in the --format asked for"),
])
def test_what_the_source_cannot_give_is_refused_before_anything_is_written(root, tmp_path, src_fmt, scheme, cfg,
                                                                          match) -> None:
    src = direct(root, "llama", src_fmt, scheme)
    with pytest.raises(PlanError, match=match) as e:
        plan_relayout(open_source(str(src)), ConvertConfig(**{"device": "cpu", **cfg}))
    assert e.value.exit_code == 2
    assert not (tmp_path / "x").exists()


def test_the_library_convert_refuses_an_fp4_source_unless_it_requantizes(root) -> None:
    src = direct(root, "llama", "compressed-tensors")
    with pytest.raises(PlanError, match="fp4convert.checkpoint.export.export .*--requantize"):
        plan_conversion(str(src), ConvertConfig(device="cpu"))
    _, plan, _ = plan_conversion(str(src), ConvertConfig(device="cpu", scheme="mxfp4"), requantize=True)
    q = [d for d in plan.decisions if d.action == "quantize"]
    assert len(q) == 14 and all(d.decode is not None and d.decode.kind == "nvfp4" for d in q)


def _twin(src: Path, fmt: str, dst: Path) -> None:
    """The fp32 checkpoint of ``src``'s exactly decoded weights: each format's readers' decode, written out
    independently of the re-layout and planner code."""
    from fp4convert.numerics.reference import e2m1_decode, unpack_nibbles

    t = tensors(src)
    out = {}
    for name, v in t.items():
        if fmt == "compressed-tensors" and name.endswith(".weight_packed"):
            m = name[: -len("_packed")]
            q = fp4convert.QuantizedTensor(v, t[m + "_scale"], t[m + "_global_scale"].reshape(()), "nvfp4")
            out[m] = fp4convert.dequantize(q, torch.float32)
        elif fmt == "modelopt" and name + "_scale_2" in t:
            vals = e2m1_decode(unpack_nibbles(v)).reshape(v.shape[0], -1, 16)
            sf = t[name + "_scale"].float()[..., None]
            out[name] = ((vals * sf) * t[name + "_scale_2"]).reshape(v.shape[0], -1)
        elif not name.endswith(("_scale", "_scale_2", "_global_scale")):
            out[name] = v
    zoo.write_like(src, dst, out)
    (dst / "hf_quant_config.json").unlink(missing_ok=True)  # a bf16 checkpoint has no ModelOpt config


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
def test_requantize_equals_converting_the_exactly_decoded_weights(root, tmp_path, fmt) -> None:
    src = stripped(direct(root, "llama", fmt, max_shard_size=10**9), tmp_path / "src")  # one shard, as the twin
    _twin(src, fmt, tmp_path / "twin")
    for path, dst in ((src, "a"), (tmp_path / "twin", "b")):
        r = CliRunner().invoke(main, ["quantize", str(path), str(tmp_path / dst), "--scheme", "mxfp4", "--device",
                                      "cpu", "--quiet", *(["--requantize"] if path == src else [])])
        assert r.exit_code == 0, r.output
    fa, fb = files_of(tmp_path / "a"), files_of(tmp_path / "b")
    shards = [f for f in fa if f.endswith(".safetensors")]
    assert shards and all(fa[f] == fb[f] for f in shards)
    if fmt == "compressed-tensors":  # compressed-tensors' own decompression is the same values, in bf16
        from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
        from compressed_tensors.quantization import preset_name_to_scheme

        t = tensors(src)
        m = "model.layers.0.self_attn.q_proj.weight"
        state = {k[len(m) - len("weight"):]: v for k, v in t.items() if k.startswith(m[: -len("weight")])}
        theirs = NVFP4PackedCompressor.decompress(state, preset_name_to_scheme("NVFP4A16", ["Linear"]))["weight"]
        assert torch.equal(tensors(tmp_path / "twin")[m].to(torch.bfloat16).view(torch.int16),
                           theirs.to(torch.bfloat16).view(torch.int16))


def test_a_rotated_checkpoint_is_not_requantized(root, tmp_path) -> None:
    src = direct(root, "llama", "compressed-tensors", rotate="had16")
    r = CliRunner().invoke(main, ["quantize", str(src), str(tmp_path / "q"), "--requantize", "--device", "cpu"])
    assert r.exit_code == 4 and "had16-rotated" in r.output and "drop --requantize" in r.output
    assert not (tmp_path / "q").exists()


# ---------------------------------------------------------------------------------------------
# The command line: quantize re-lays by default and says so; export takes any FP4 checkpoint
# ---------------------------------------------------------------------------------------------

def test_quantize_relays_by_default_and_says_so(root, tmp_path) -> None:
    src = stripped(direct(root, "llama", "modelopt"), tmp_path / "mo")
    r = CliRunner().invoke(main, ["quantize", str(src), str(tmp_path / "dry"), "--format", "compressed-tensors",
                                  "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "re-laid from NVFP4 in the modelopt layout without re-quantizing" in r.output
    assert not (tmp_path / "dry").exists()
    r = CliRunner().invoke(main, ["quantize", str(src), str(tmp_path / "ct"), "--format", "compressed-tensors",
                                  "--quiet"])
    assert r.exit_code == 0, r.output
    manifest = json.loads((tmp_path / "ct" / "fp4convert.json").read_text())
    assert manifest["method"]["method"] == "relayout"
    card = (tmp_path / "ct" / "README.md").read_text()
    assert "re-laid from NVFP4 in the modelopt layout without re-quantizing" in card
    r = CliRunner().invoke(main, ["quantize", str(src), str(tmp_path / "x"), "--scheme", "mxfp4"])
    assert r.exit_code == 2 and "--requantize" in r.output and not (tmp_path / "x").exists()


def test_export_takes_a_foreign_checkpoint(root, tmp_path) -> None:
    src = stripped(direct(root, "llama", "compressed-tensors", "mxfp4"), tmp_path / "ct")
    r = CliRunner().invoke(main, ["export", str(src), str(tmp_path / "nat"), "--format", "fp4convert", "--quiet"])
    assert r.exit_code == 0, r.output
    got, want = tensors(tmp_path / "nat"), tensors(direct(root, "llama", "fp4convert", "mxfp4"))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8))
                                               for k in want)
