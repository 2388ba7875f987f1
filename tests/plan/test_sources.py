"""What a quantized source means (fp4convert/plan/sources.py): the conversion's gate before planning, and what a
re-layout can and cannot give (each refusal saying what to pass instead)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fp4convert.config import ConvertConfig
from fp4convert.errors import PlanError
from fp4convert.formats import get_format
from fp4convert.plan.sources import FP4Source, check_source, relayout_problems, relayout_refusal

CT = {"quantization_config": {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                              "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float"}}}}}
INT4 = {"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int"}}}}}


def gptq():
    """``--method gptq`` as the recipe carries it: the method's settings value (or, before the method seam,
    its name)."""
    import importlib

    methods = importlib.import_module("fp4convert.calibrate.methods")
    return methods.settings("gptq") if hasattr(methods, "settings") else "gptq"


def test_plain_and_decodable_sources_go_on_to_the_planner(tmp_path: Path) -> None:
    for cfg in ({}, INT4, {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}):
        check_source(tmp_path, cfg, None)  # no exception: the planner decodes them (or refuses what it cannot)


@pytest.mark.parametrize("cfg,manifest,hf_quant,says", [
    (CT, None, None, "FP4 weights in the compressed-tensors layout"),
    ({}, {"format": "fp4convert"}, None, "an fp4convert output (fp4convert format)"),
    ({}, None, {"quantization": {"quant_algo": "NVFP4"}}, "FP4 weights in the modelopt layout"),
])
def test_an_fp4_source_is_refused_unless_it_is_requantized(tmp_path: Path, cfg, manifest, hf_quant, says) -> None:
    if hf_quant is not None:
        (tmp_path / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    with pytest.raises(PlanError, match="already quantized") as e:
        check_source(tmp_path, cfg, manifest)
    assert says in str(e.value) and "--requantize" in str(e.value) and "fp4convert export" in str(e.value)
    assert e.value.exit_code == 2
    check_source(tmp_path, cfg, manifest, requantize=True)  # decoded and quantized again


def _problems(src: FP4Source, **cfg) -> list[str]:
    c = ConvertConfig(**cfg)
    target = get_format(c.format)
    return relayout_problems(src, c, target.activation_modes, target.schemes)


NV = FP4Source("compressed-tensors", "nvfp4", None, "none")


def test_the_settings_that_describe_the_source_have_no_problem() -> None:
    assert _problems(NV, format="fp4convert") == []
    assert _problems(NV, format="modelopt") == []
    assert _problems(FP4Source("fp4convert", "mxfp4", "had16", "none", "wmse"), format="compressed-tensors",
                     scheme="mxfp4", rotate="had16", scale_rule="wmse") == []
    w4a4 = FP4Source("compressed-tensors", "nvfp4", None, "nvfp4")
    assert _problems(w4a4, format="modelopt") == []  # the activation scales are carried by default
    assert _problems(w4a4, format="modelopt", activations="nvfp4") == []


@pytest.mark.parametrize("src,cfg,says", [
    (NV, dict(format="fp4convert", scheme="mxfp4"), "pass --scheme nvfp4 to re-lay them, or --requantize"),
    (FP4Source("fp4convert", "mxfp4", None, "none"), dict(format="modelopt", scheme="mxfp4"),
     "--format modelopt cannot hold MXFP4"),
    (FP4Source("fp4convert", "nvfp4", "had16", "none"), dict(format="compressed-tensors"), "pass --rotate had16"),
    (NV, dict(format="fp4convert", rotate="had16"), "drop --rotate had16"),
    (NV, dict(format="modelopt", activations="nvfp4"), "carries no NVFP4 activation scales (it is weight-only)"),
    (FP4Source("compressed-tensors", "nvfp4", None, "nvfp4"), dict(format="fp4convert"),
     "--format fp4convert has no activation convention for it: choose --format compressed-tensors or modelopt"),
    (NV, dict(format="fp4convert", scale_rule="mse"), "--scale-rule mse would choose other block scales"),
    (NV, dict(format="fp4convert", method=gptq()), "--method / --input-weights"),
    (NV, dict(format="fp4convert", input_weights="random"), "--method / --input-weights"),
    (NV, dict(format="fp4convert", only=("*mlp*",)), "--ignore / --only"),
    (NV, dict(format="fp4convert", kept_dtype="bf16"), "--kept-dtype bf16"),
])
def test_what_a_relayout_cannot_give_is_named_with_what_to_pass(src, cfg, says) -> None:
    problems = _problems(src, **cfg)
    assert len(problems) == 1 and says in problems[0], problems
    err = relayout_refusal(src, problems)
    assert isinstance(err, PlanError) and err.exit_code == 2 and src.describe() in str(err)


def test_a_source_says_what_it_holds() -> None:
    assert NV.describe() == "NVFP4 in the compressed-tensors layout"
    assert FP4Source("fp4convert", "mxfp4", "had16", "mxfp4").describe() == \
        "MXFP4 in the fp4convert layout (had16-rotated, W4A4 MXFP4)"
