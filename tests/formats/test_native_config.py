"""The native output's config.json makes loaders refuse it (instead of loading random weights), and
``export`` gives the engine formats the source's config back."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from fp4convert.config import ConvertConfig
from fp4convert.run.convert import convert
from fp4convert.checkpoint.export import export

from tests import checkpoints as ck


@pytest.fixture(scope="module")
def native(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("native")
    ck.llama(root / "src", layers=1, single=True)
    convert(root / "src", root / "q", ConvertConfig(device="cpu", ignore=("*.o_proj",)))
    return root / "src", root / "q"


def test_quantization_config_names_fp4convert(native) -> None:
    src, dst = native
    cfg = json.loads((dst / "config.json").read_text())
    source_cfg = json.loads((src / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "fp4convert" and qc["format"] == "fp4convert"
    assert qc["scheme"] == "nvfp4" and qc["block_size"] == 16 and qc["scale_layout"] == "128x4"
    assert qc["scale_rule"] == "4over6" and qc["rotate"] is None  # the default rule (issue 22)
    assert qc["ignore"] == ["lm_head", "model.embed_tokens", "model.layers.0.self_attn.o_proj"]
    assert qc["model_type"] == source_cfg["model_type"] == "llama" and cfg["model_type"] == "fp4convert"
    assert "fp4convert export" in qc["note"]
    assert list(cfg)[:-1] == list(source_cfg)  # same keys in the same order, the quantization_config last


def test_transformers_refuses_the_native_output(native) -> None:
    """transformers only warns about an unknown quant_method (and would load random weights), so the
    model type is what makes it refuse; its message names fp4convert."""
    from transformers import AutoConfig, AutoModelForCausalLM

    _, dst = native
    with pytest.raises(ValueError, match="model type `fp4convert`") as err:
        AutoModelForCausalLM.from_pretrained(str(dst))
    assert "does not recognize this architecture" in str(err.value)
    with pytest.raises(ValueError, match="fp4convert"):
        AutoConfig.from_pretrained(str(dst))


def test_without_the_model_type_transformers_would_load_random_weights(native, tmp_path) -> None:
    """Why the model type is changed: quant_method alone is skipped with a warning (checked here, so a
    transformers that starts refusing unknown methods is noticed)."""
    import shutil

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    _, dst = native
    d = tmp_path / "q"
    shutil.copytree(dst, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = cfg["quantization_config"]["model_type"]
    (d / "config.json").write_text(json.dumps(cfg))
    messages: list[str] = []
    hf_logging.add_handler(handler := _Collect(messages))
    try:
        model = AutoModelForCausalLM.from_pretrained(str(d))
    finally:
        hf_logging.remove_handler(handler)
    assert model is not None  # loaded, with random linear layers
    assert any("Unknown quantization type, got fp4convert" in m for m in messages), messages


class _Collect(logging.Handler):
    """Keeps every log message (transformers' warnings go through its own logger, not warnings)."""

    def __init__(self, out: list[str]) -> None:
        super().__init__()
        self.out = out

    def emit(self, record: logging.LogRecord) -> None:
        self.out.append(record.getMessage())


@pytest.mark.parametrize("fmt", ["compressed-tensors", "modelopt"])
def test_export_restores_the_source_config(native, tmp_path, fmt) -> None:
    src, dst = native
    out = tmp_path / "out"
    export(str(dst), out, ConvertConfig(format=fmt))
    cfg = json.loads((out / "config.json").read_text())
    source_cfg = json.loads((src / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["quantization_config"]["quant_method"] == fmt
    assert {k: v for k, v in cfg.items() if k != "quantization_config"} == source_cfg


def test_inspect_recognises_native_by_config(native, tmp_path) -> None:
    from fp4convert.formats import detect, get_format

    _, dst = native
    cfg = json.loads((dst / "config.json").read_text())
    assert detect(dst, cfg, None) is get_format("fp4convert")
