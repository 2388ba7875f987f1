"""The generated model card (README.md): front matter, the quantization section, the source card below."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from fp4convert.config import ConvertConfig
from fp4convert.convert import convert
from fp4convert.export import export
from fp4convert.inspect import inspect_checkpoint
from fp4convert.modelcard import END, ORIGINAL_HEADING, PLACEHOLDER, START, build_card, split_card

from . import checkpoints as ck

ORIGINAL = ("---\nlicense: apache-2.0\nlanguage:\n- en\ntags:\n- llama\n---\n\n# Tiny Llama\n\n"
            "The original card, with its own text.\n")


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("cards") / "tiny-base"
    ck.llama(p, layers=1, single=True)
    (p / "README.md").write_text(ORIGINAL)
    return p


def card(dst: Path) -> tuple[dict, str]:
    return split_card((dst / "README.md").read_text())


@pytest.mark.parametrize("fmt,scheme,library", [("fp4convert", "nvfp4", "fp4convert"),
                                                ("compressed-tensors", "mxfp4", "transformers"),
                                                ("modelopt", "nvfp4", "vllm")])
def test_card_of_a_local_conversion(src, tmp_path, fmt, scheme, library) -> None:
    dst = tmp_path / "out"
    convert(src, dst, ConvertConfig(device="cpu", format=fmt, scheme=scheme, ignore=("*.o_proj",)))
    meta, body = card(dst)
    assert meta["base_model"] == "tiny-base"  # the local folder's name, never its path
    assert meta["base_model_relation"] == "quantized" and meta["library_name"] == library
    assert {"fp4convert", scheme, fmt, "quantized"} <= set(meta["tags"])
    assert meta["license"] == "apache-2.0" and meta["language"] == ["en"]  # kept from the source card
    assert str(src.parent) not in (dst / "README.md").read_text()
    section = body.split(START, 1)[1].split(END, 1)[0]
    assert f"| scheme | {scheme.upper()}" in section and f"| format | {fmt} |" in section
    assert f"| scale rule | {'4over6' if scheme == 'nvfp4' else 'wmse'} |" in section  # the defaults (issue 22)
    assert "`model.layers.0.self_attn.o_proj`" in section and "`lm_head`" in section and "`model.embed_tokens`" in section
    serve = {"fp4convert": "fp4convert export", "compressed-tensors": "vllm serve",
             "modelopt": "--quantization modelopt_fp4"}[fmt]
    assert serve in section and PLACEHOLDER in section
    # The source's card below, once, without its front matter.
    assert body.count(ORIGINAL_HEADING) == 1 and body.rstrip().endswith("The original card, with its own text.")
    assert body.index(END) < body.index("# Tiny Llama")
    # The manifest covers the card; inspect agrees.
    m = json.loads((dst / "fp4convert.json").read_text())
    assert "README.md" in m["files"]
    assert inspect_checkpoint(str(dst), check_files=True)["ok"]


def test_export_replaces_the_card_instead_of_nesting_it(src, tmp_path) -> None:
    native, ct = tmp_path / "native", tmp_path / "ct"
    convert(src, native, ConvertConfig(device="cpu"))
    export(str(native), ct, ConvertConfig(format="compressed-tensors"))
    meta, body = card(ct)
    assert meta["base_model"] == "tiny-base" and meta["library_name"] == "transformers"
    assert body.count(START) == 1 and body.count(ORIGINAL_HEADING) == 1 and body.count("# Tiny Llama") == 1
    assert "| format | compressed-tensors |" in body and "vllm serve" in body


def test_no_source_card(tmp_path) -> None:
    src = tmp_path / "plain"
    ck.llama(src, layers=1, single=True)
    (src / "README.md").unlink()
    convert(src, tmp_path / "q", ConvertConfig(device="cpu"))
    meta, body = card(tmp_path / "q")
    assert meta["base_model"] == "plain" and ORIGINAL_HEADING not in body


def test_scale_rule_from_the_settings_and_hub_base_model() -> None:
    manifest = {"format": "compressed-tensors", "scheme": "nvfp4", "rotate": "had16",
                "settings": {"scale_rule": "4over6"}, "summary": {"quantized": 2, "tensors": 3},
                "source": {"type": "hub", "repo_id": "org/model", "commit": "abc"},
                "tensors": {"lm_head.weight": {"action": "keep", "shape": [8, 16]}}}
    text = build_card(manifest, "broken front matter ---\nbody", repo_hint="me/model-nvfp4")
    meta, body = split_card(text)
    assert meta["base_model"] == "org/model" and "[org/model](https://huggingface.co/org/model)" in body
    assert "| scale rule | 4over6 |" in body and "| rotation | had16 |" in body and "transform_config" in body
    assert "vllm serve me/model-nvfp4" in body and PLACEHOLDER not in body
    assert yaml.safe_load(text.split("---")[1])["tags"][0] == "fp4convert"
