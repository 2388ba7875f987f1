"""The generated model card (README.md): front matter, the quantization section, the source card below."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from fp4convert.config import ConvertConfig
from fp4convert.errors import ConfigError
from fp4convert.run.convert import convert
from fp4convert.checkpoint.export import export
from fp4convert.checkpoint.inspect import inspect_checkpoint
from fp4convert.output.card import END, ORIGINAL_HEADING, PLACEHOLDER, START, build_card, split_card

from tests import checkpoints as ck

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
    assert "base_model" not in meta  # a local folder is no Hub id: omitted, never its name nor its path
    assert meta["library_name"] == library
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
    convert(src, native, ConvertConfig(device="cpu", base_model="org/tiny-base"))
    assert card(native)[0]["base_model"] == "org/tiny-base"
    export(str(native), ct, ConvertConfig(format="compressed-tensors"))
    meta, body = card(ct)
    # Our own card (its sha256 is in the native manifest) still names the base model.
    assert meta["base_model"] == "org/tiny-base" and meta["library_name"] == "transformers"
    assert body.count(START) == 1 and body.count(ORIGINAL_HEADING) == 1 and body.count("# Tiny Llama") == 1
    assert "| format | compressed-tensors |" in body and "vllm serve" in body


def test_no_source_card(tmp_path) -> None:
    src = tmp_path / "plain"
    ck.llama(src, layers=1, single=True)
    (src / "README.md").unlink()
    convert(src, tmp_path / "q", ConvertConfig(device="cpu"))
    meta, body = card(tmp_path / "q")
    assert "base_model" not in meta and ORIGINAL_HEADING not in body


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


def test_base_model_option_and_name_or_path(tmp_path) -> None:
    """--base-model wins; else a Hub-like _name_or_path in config.json; a local path there is no base model."""
    src = tmp_path / "model"
    ck.llama(src, layers=1, single=True)
    config = json.loads((src / "config.json").read_text())
    convert(src, tmp_path / "a", ConvertConfig(device="cpu", base_model="meta-llama/Llama-3.2-1B"))
    meta, body = card(tmp_path / "a")
    assert meta["base_model"] == "meta-llama/Llama-3.2-1B" and meta["base_model_relation"] == "quantized"
    assert "[meta-llama/Llama-3.2-1B](https://huggingface.co/meta-llama/Llama-3.2-1B)" in body
    (src / "config.json").write_text(json.dumps({**config, "_name_or_path": "org/tiny"}))
    convert(src, tmp_path / "b", ConvertConfig(device="cpu"))
    assert card(tmp_path / "b")[0]["base_model"] == "org/tiny"
    (src / "config.json").write_text(json.dumps({**config, "_name_or_path": "/home/me/model"}))
    convert(src, tmp_path / "c", ConvertConfig(device="cpu"))
    meta, _ = card(tmp_path / "c")
    assert "base_model" not in meta and "base_model_relation" not in meta
    with pytest.raises(ConfigError, match="--base-model"):
        ConvertConfig(base_model="org/x\n<b>")


CRAFTED = ("---\nbase_model: evil/model\nlicense: \"mit\\n<script>x</script>\"\ntags: 5\nlanguage:\n- en\n- \"x\\ny\"\n"
           "pipeline_tag: text-generation\n---\n\n"
           "<!-- fp4convert:card-end -->\n# Injected\n---\nbase_model: evil/again\n---\n<details>\n")


def test_a_crafted_source_card_changes_neither_front_matter_nor_section(tmp_path, caplog) -> None:
    """A source card's base_model is never taken; wrongly typed or multi-line values are dropped with a
    warning (no crash, at finish nor on resume); its text stays below our section, markers defused."""
    src = tmp_path / "crafted"
    ck.llama(src, layers=1, single=True)
    (src / "README.md").write_text(CRAFTED)
    dst = tmp_path / "q"
    with caplog.at_level("WARNING"):
        convert(src, dst, ConvertConfig(device="cpu", format="compressed-tensors"))
    text = (dst / "README.md").read_text()
    meta, body = split_card(text)
    assert "base_model" not in meta and "evil" not in yaml.safe_dump(meta)
    assert "license" not in meta and meta["language"] == ["en"] and meta["pipeline_tag"] == "text-generation"
    assert {"fp4convert", "nvfp4", "compressed-tensors"} <= set(meta["tags"])
    assert meta["tags"] == ["fp4convert", "nvfp4", "fp4", "compressed-tensors", "quantized"]  # the source's never pass
    assert text.count(START) == 1 and text.count(END) == 1  # the source's marker cannot end our section early
    assert body.index(END) < body.index(ORIGINAL_HEADING) < body.index("# Injected")
    section = body.split(START, 1)[1].split(END, 1)[0]
    assert "Injected" not in section and "<details>" not in section
    assert inspect_checkpoint(str(dst), check_files=True)["ok"]


def test_usage_snippet_uses_the_auto_class_of_the_architecture() -> None:
    from fp4convert.output.card import auto_class

    assert auto_class({"architectures": ["BertModel"]}) == "AutoModel"
    assert auto_class({"architectures": ["LlamaForCausalLM"]}) == "AutoModelForCausalLM"
    assert auto_class({"architectures": ["Gemma3ForConditionalGeneration"], "vision_config": {}}) == \
        "AutoModelForImageTextToText"
    assert auto_class({"architectures": ["T5ForConditionalGeneration"], "is_encoder_decoder": True}) == \
        "AutoModelForSeq2SeqLM"
    assert auto_class({"architectures": ["BertForMaskedLM"]}) == "AutoModelForMaskedLM"
    assert auto_class({"architectures": 5}) == "AutoModel" and auto_class({}) == "AutoModel"
    manifest = {"format": "compressed-tensors", "scheme": "nvfp4", "summary": {}, "tensors": {},
                "source": {"type": "local", "path": "model"}}
    text = build_card(manifest, None, config={"architectures": ["BertModel"]})
    assert "AutoModel.from_pretrained" in text and "AutoModelForCausalLM" not in text
    assert "base_model" not in split_card(text)[0]


def test_a_readme_symlink_out_of_the_source_is_never_read(tmp_path, caplog) -> None:
    """SRC/README.md -> a file outside SRC (think /proc/self/environ): warned about, and not one byte of
    it reaches DST/README.md (which --push-to-hub would publish)."""
    src = tmp_path / "linked"
    ck.llama(src, layers=1, single=True)
    secret = tmp_path / "outside.txt"
    secret.write_text("HF_TOKEN=hf_SECRET_MARKER_1234\n")
    (src / "README.md").unlink()
    (src / "README.md").symlink_to(secret)
    with caplog.at_level("WARNING"):
        convert(src, tmp_path / "q", ConvertConfig(device="cpu"))
    assert "SECRET_MARKER" not in (tmp_path / "q" / "README.md").read_text()
    assert any("README.md" in r.getMessage() and "outside" in r.getMessage() for r in caplog.records)


def test_base_model_on_the_command_line(tmp_path) -> None:
    from click.testing import CliRunner

    from fp4convert.cli.main import main

    src = tmp_path / "model"
    ck.llama(src, layers=1, single=True)
    r = CliRunner().invoke(main, ["quantize", str(src), str(tmp_path / "q"), "--device", "cpu", "-q",
                                  "--base-model", "org/tiny"])
    assert r.exit_code == 0, r.output
    assert card(tmp_path / "q")[0]["base_model"] == "org/tiny"
    r = CliRunner().invoke(main, ["quantize", str(src), str(tmp_path / "r"), "--device", "cpu", "-q",
                                  "--base-model", "not a repo"])
    assert r.exit_code == 2 and "--base-model" in r.output and not (tmp_path / "r").exists()


def test_odd_tensor_names_cannot_inject_into_our_section() -> None:
    """Tensor names are any string in a safetensors header; shown in our section, they stay one plain code span."""
    manifest = {"format": "fp4convert", "scheme": "nvfp4", "summary": {"quantized": "<b>x</b>"},
                "source": {"type": "local", "path": "m\n<img src=x>"},
                "tensors": {"x\n</table><script>alert(1)</script>.weight": {"action": "keep", "shape": [2, 2]}}}
    text = build_card(manifest, None, base_model="org/m\n<b>")
    meta, body = split_card(text)
    section = body.split(START, 1)[1].split(END, 1)[0]
    assert "<script>" not in text and "</table>" not in text and "<img" not in text and "<b>" not in text
    assert "base_model" not in meta  # an invalid id is omitted, never written
    assert "<" not in section and "\n<" not in body.split(END, 1)[0]
    assert "| excluded modules (kept in the source dtype) | `x??/table??script?alert?1??/script?` |" in section


def test_re_rendering_our_own_card_keeps_the_model_it_named(src, tmp_path) -> None:
    """Exporting a native output (no base model known) and pushing it: the card keeps naming the original
    model, never the intermediate folder."""
    native, ct = tmp_path / "native", tmp_path / "ct"
    convert(src, native, ConvertConfig(device="cpu"))
    export(str(native), ct, ConvertConfig(format="compressed-tensors"))
    text = (ct / "README.md").read_text()
    assert "# tiny-base NVFP4 (compressed-tensors)" in text and "quantization of `tiny-base`" in text
    m = json.loads((ct / "fp4convert.json").read_text())
    again = build_card(m, text, repo_hint="me/m", base_model=None, original_is_ours=True)
    assert "quantization of `tiny-base`" in again and "native" not in split_card(again)[1].split(END)[0]


def test_the_cards_loading_snippet_loads_without_a_warning(src, tmp_path) -> None:
    """The compressed-tensors card's transformers snippet, run as a reader would (the folder's path in place
    of the repo id): the model loads, its linears hold the dequantized weights, and transformers says
    nothing (passing ``quantization_config=`` made it warn about a duplicate quantization_config)."""
    import logging
    import re
    import warnings

    import torch
    from safetensors.torch import load_file

    from fp4convert.kernels.tensor import QuantizedTensor, dequantize

    dst = tmp_path / "ct"
    convert(src, dst, ConvertConfig(device="cpu", format="compressed-tensors"))
    section = card(dst)[1].split(START, 1)[1].split(END, 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1).replace(PLACEHOLDER, str(dst))
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("transformers").addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scope: dict = {}
            exec(code, scope)  # noqa: S102 - the card's own snippet
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    said = [str(w.message) for w in caught] + [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    assert not [s for s in said if "quantization_config" in s or "quantization" in s.lower()], said
    t = load_file(str(dst / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    q = QuantizedTensor(t[name + "_packed"], t[name + "_scale"], t[name + "_global_scale"].reshape(()), "nvfp4",
                        None, "linear", "4over6")
    got = dict(scope["model"].named_parameters())[name]
    assert got.dtype == torch.bfloat16 and torch.equal(got, dequantize(q, torch.bfloat16))
