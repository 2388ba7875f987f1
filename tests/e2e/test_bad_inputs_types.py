"""Issue 34's kinds of bad input: each gets one ``Error:`` line naming the file, key or tensor and what to
do, its documented exit code, and nothing written (the rest of issue 12's matrix is test_bad_inputs.py).

- config.json values of the wrong JSON type under keys fp4convert reads (every output format, --dry-run,
  --input-weights random, W4A4): exit 4 (fp4convert.source.config_json), before planning.
- A manifest holding numbers no float holds (400-digit integers, 1e999, NaN/Infinity tokens), deep nesting
  or wrong types: ``inspect`` (-q, --check-files, --json) reports a finding (exit 6), ``export`` refuses
  (exit 4), never exit 1.
- Source tensors named like the parts an output format writes for a quantized weight: refused before
  anything is written (exit 2) naming both tensors, unless the format can hold both.
- ``inspect`` of a folder whose manifest, or a file it lists, is a FIFO: the file and why, no hang.
- Folders that are not checkpoints as such (weights in a subfolder, an HF cache entry's root, pickles):
  the error says where the weights are or how to convert them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import zlib
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from fp4convert.cli.main import main

from tests import checkpoints as ck


def run(*args) -> object:
    return CliRunner().invoke(main, [str(a) for a in args])


def one_error(r, code: int, *words: str) -> str:
    assert r.exit_code == code, (r.exit_code, r.output)
    assert "Traceback" not in r.output and "internal error" not in r.output, r.output
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1, r.output
    for w in words:
        assert w in errors[0], (w, errors[0])
    return errors[0]


@pytest.fixture(autouse=True)
def _definitions_here(monkeypatch):
    """Model definitions built in this process: a planner's child per edited config.json costs a Python
    start and transformers' imports (10-25 s on a loaded 2-core machine)."""
    ck.definitions_in_process(monkeypatch, like_child=True)


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("types") / "llama"
    ck.llama(p, layers=1, single=True)
    return p


@pytest.fixture(scope="module")
def outputs(src, tmp_path_factory) -> dict[str, Path]:
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        ck.definitions_in_process(mp, like_child=True)
        for fmt in ("fp4convert", "compressed-tensors", "modelopt"):
            dst = tmp_path_factory.mktemp("types") / fmt
            r = run("quantize", src, dst, "--device", "cpu", "-q", "--format", fmt)
            assert r.exit_code == 0, r.output
            out[fmt] = dst
    return out


# --- config.json: values of the wrong JSON type ----------------------------------------------------

DEEP: object = "LlamaForCausalLM"
for _ in range(40):
    DEEP = [DEEP]

CONFIG_CASES = [  # (key, value); the key may be dotted (text_config.hidden_size)
    ("architectures", 5), ("architectures", "LlamaForCausalLM"), ("architectures", {"a": "LlamaForCausalLM"}),
    ("architectures", ["LlamaForCausalLM", 5]), ("architectures", [["LlamaForCausalLM"]]), ("architectures", DEEP),
    ("architectures", True), ("architectures", 10 ** 400),
    ("model_type", 5), ("model_type", ["llama"]), ("model_type", {"llama": 1}), ("model_type", False),
    ("hidden_size", "64"), ("hidden_size", 64.0), ("hidden_size", [64]), ("hidden_size", {"h": 64}),
    ("hidden_size", True), ("hidden_size", -64), ("hidden_size", 0),
    ("num_hidden_layers", "2"), ("num_hidden_layers", 1.5), ("num_hidden_layers", ["2"]), ("num_hidden_layers", -1),
    ("num_hidden_layers", {"language": "2"}), ("num_nextn_predict_layers", "1"), ("num_local_experts", "8"),
    ("moe_num_experts", [64, "64"]),
    ("tie_word_embeddings", "false"), ("tie_word_embeddings", 0), ("tie_word_embeddings", [False]),
    ("is_encoder_decoder", "yes"), ("_name_or_path", 5), ("_name_or_path", ["org/model"]),
    ("quantization_config", "fp8"),
    ("quantization_config", [1]), ("text_config", "x"), ("text_config", [1]), ("vision_config", 5),
    ("text_config.hidden_size", "64"), ("text_config.architectures", 5), ("text_config.tie_word_embeddings", "no"),
]
MODES = {"dry-run": ("--dry-run",), "native": (), "compressed-tensors": ("--format", "compressed-tensors"),
         "modelopt": ("--format", "modelopt"), "random": ("--input-weights", "random"),
         "w4a4": ("--format", "compressed-tensors", "--activations", "nvfp4", "--activation-scale", "constant")}


def _edit_config(folder: Path, key: str, value: object) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    where = cfg
    *parents, last = key.split(".")
    for p in parents:
        where = where.setdefault(p, {})
    where[last] = value
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("key,value", CONFIG_CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CONFIG_CASES)])
def test_config_value_of_the_wrong_type_is_one_line_exit_4(src, tmp_path, key, value):
    folder = tmp_path / "src"
    shutil.copytree(src, folder)
    _edit_config(folder, key, value)
    # every mode for a few keys; one mode (rotating) for the rest keeps the test short: the check is one
    # place, before any mode differs
    modes = list(MODES) if key in ("architectures", "hidden_size") else [list(MODES)[zlib.crc32(repr(value).encode()) % len(MODES)]]
    for mode in modes:
        dst = tmp_path / f"out-{mode}"
        r = run("quantize", folder, dst, "--device", "cpu", "-q", *MODES[mode])
        line = one_error(r, 4, "config.json", key.split(".")[-1] if key.count(".") == 0 else key, "fix config.json")
        assert line.startswith(f"Error: {folder}/config.json: "), line
        assert not dst.exists(), (mode, list(dst.iterdir()))


@pytest.mark.parametrize("key,value", [("architectures", None), ("num_hidden_layers", {"language": 1, "vision": 1}),
                                       ("text_config", None), ("moe_num_experts", [64, 64]),
                                       ("hidden_size", 10 ** 30)])
def test_config_values_of_the_right_type_still_plan(src, tmp_path, key, value):
    """null is "not set" to transformers; LXMERT's per-part layer counts are an object of integers, ERNIE 4.5
    VL's expert counts a list; a large integer is still an integer (its range is the model definition's
    concern). (Every transformers config class's defaults pass the check: 820 with transformers 5.24.)"""
    folder = tmp_path / "src"
    shutil.copytree(src, folder)
    _edit_config(folder, key, value)
    r = run("quantize", folder, tmp_path / "out", "--device", "cpu", "-q", "--dry-run")
    assert r.exit_code == 0, r.output


# --- manifests: numbers no float holds, deep nesting, wrong types ------------------------------------

QDOWN = "model.layers.0.mlp.down_proj.weight"
MANIFEST_CASES = [  # (id, (json path), raw JSON text put there)
    ("gs-400-digits", ("tensors", QDOWN, "global_scale"), "9" * 400),
    ("gs-negative-400-digits", ("tensors", QDOWN, "global_scale"), "-" + "9" * 400),
    ("gs-1e999", ("tensors", QDOWN, "global_scale"), "1e999"),
    ("gs-NaN", ("tensors", QDOWN, "global_scale"), "NaN"),
    ("gs-Infinity-in-list", ("tensors", QDOWN, "global_scale"), "[1.0, Infinity]"),
    ("gs-string", ("tensors", QDOWN, "global_scale"), '"34406.4"'),
    ("gs-deep", ("tensors", QDOWN, "global_scale"), "[" * 100 + "1" + "]" * 100),
    ("amax-1e999", ("tensors", QDOWN, "amax"), "1e999"),
    ("amax-4000-digits", ("tensors", QDOWN, "amax"), "1" + "0" * 4000),
    ("shape-huge", ("tensors", QDOWN, "shape"), "[" + "9" * 40 + ", 64]"),
    ("file-size-huge", ("files", "model.safetensors", "size"), "9" * 400),
    ("block-size-huge", ("block_size",), "9" * 400),
    ("summary-deep", ("summary",), '{"a":' * 80 + "1" + "}" * 80),
    ("tensors-list", ("tensors",), "[1, 2]"),
]


def _edit_manifest(folder: Path, path: tuple, raw: str) -> None:
    m = json.loads((folder / "fp4convert.json").read_text())
    where = m
    for k in path[:-1]:
        where = where[k]
    where[path[-1]] = "@@X@@"
    (folder / "fp4convert.json").write_text(json.dumps(m).replace('"@@X@@"', raw))


@pytest.mark.parametrize("fmt", ["fp4convert", "modelopt"])
@pytest.mark.parametrize("case", MANIFEST_CASES, ids=[c[0] for c in MANIFEST_CASES])
def test_manifest_numbers_no_float_holds_are_findings_not_exit_1(outputs, tmp_path, fmt, case):
    _, path, raw = case
    folder = tmp_path / "out"
    shutil.copytree(outputs[fmt], folder)
    _edit_manifest(folder, path, raw)
    for extra in ((), ("--check-files",), ("-q",)):
        r = run("inspect", folder, *extra)
        assert r.exit_code == 6, (extra, r.output)
        assert "Traceback" not in r.output and "internal error" not in r.output, r.output
        assert "fp4convert.json" in r.output, r.output
    r = run("inspect", folder, "--json")
    assert r.exit_code == 6 and any("fp4convert.json" in p for p in json.loads(r.stdout)["checks"]["problems"])
    if fmt == "fp4convert":
        dst = tmp_path / "exported"
        one_error(run("export", folder, dst, "--format", "compressed-tensors", "-q"), 4, "fp4convert.json")
        assert not dst.exists()


# --- source tensors named like the parts a format writes ---------------------------------------------

PARTS = ["input_scale", "weight_scale", "weight_scale_2", "input_global_scale", "weight_global_scale",
         "weight_packed"]
FORMATS = ["fp4convert", "compressed-tensors", "modelopt"]
# (part, format) pairs a format can hold both of: its readers do not take that name for a part of x
HOLDS_BOTH = {("input_scale", "fp4convert"), ("input_scale", "compressed-tensors"),
              ("input_global_scale", "fp4convert"), ("input_global_scale", "modelopt")}


@pytest.fixture(scope="module")
def colliding(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for part in PARTS:
        p = tmp_path_factory.mktemp("collide") / part
        cfg = ck.llama_config(layers=1)
        t = ck.llama_tensors(cfg)
        t[f"model.layers.0.mlp.down_proj.{part}"] = torch.ones(1, dtype=torch.bfloat16)
        ck.write(p, t, cfg)
        out[part] = p
    return out


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("part", PARTS)
def test_source_tensor_named_like_a_format_part_is_refused_before_writing(colliding, tmp_path, part, fmt):
    dst = tmp_path / "out"
    r = run("quantize", colliding[part], dst, "--device", "cpu", "-q", "--format", fmt)
    if (part, fmt) in HOLDS_BOTH:
        assert r.exit_code == 0, r.output
        assert run("inspect", dst, "-q").exit_code == 0  # fp4convert's own reader agrees
        return
    line = one_error(r, 2, f"model.layers.0.mlp.down_proj.{part}")
    # both tensors named (a tensor named weight_packed / *_global_scale / weight_scale_2 marks a quantized source)
    assert "model.layers.0.mlp.down_proj.weight" in line.replace(f"down_proj.{part}", "") or "already quantized" in line
    assert not dst.exists()


def test_export_refuses_a_native_output_whose_kept_tensor_the_target_reads_as_a_part(colliding, tmp_path):
    """The native format holds x.input_global_scale beside a quantized x; compressed-tensors would read it as
    x's activation scale: export refuses, naming both, before writing."""
    native = tmp_path / "native"
    assert run("quantize", colliding["input_global_scale"], native, "--device", "cpu", "-q").exit_code == 0
    dst = tmp_path / "ct"
    one_error(run("export", native, dst, "--format", "compressed-tensors", "-q"), 2,
              "model.layers.0.mlp.down_proj.input_global_scale", "model.layers.0.mlp.down_proj.weight")
    assert not dst.exists()
    assert run("export", native, tmp_path / "mo", "--format", "modelopt", "-q").exit_code == 0


# --- inspect: FIFOs and other special files ----------------------------------------------------------

class _Hang(BaseException):
    pass


def _alarm(signum, frame):
    raise _Hang()


@pytest.mark.parametrize("name,code,words", [
    ("fp4convert.json", 6, ("fp4convert.json", "FIFO")),
    ("tokenizer.json", 6, ("tokenizer.json", "FIFO")),
    ("README.md", 6, ("README.md", "FIFO")),
    ("config.json", 4, ("config.json", "not a regular file")),
    ("model.safetensors", 4, ("model.safetensors", "not a regular file")),
])
def test_inspect_names_a_fifo_and_why(outputs, tmp_path, name, code, words):
    folder = tmp_path / "out"
    shutil.copytree(outputs["fp4convert"], folder)
    (folder / name).unlink()
    os.mkfifo(folder / name)
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(30)
    try:
        for extra in ((), ("--check-files",), ("-q",)):
            r = run("inspect", folder, *extra)
            assert r.exit_code == code, (extra, r.output)
            assert "Traceback" not in r.output, r.output
            lines = [ln for ln in r.output.splitlines() if all(w in ln for w in words)]
            assert lines, (words, r.output)
            if code != 6 or extra == ("-q",):
                assert len([ln for ln in r.stderr.splitlines() if ln.startswith("Error:")]) == 1, r.output
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# --- folders that are not a checkpoint as such -------------------------------------------------------

def test_weights_in_a_subfolder_are_named(src, tmp_path):
    top = tmp_path / "repo"
    shutil.copytree(src, top / "weights" / "bf16")
    for cmd in (("quantize", top, tmp_path / "out", "--device", "cpu"), ("inspect", top)):
        line = one_error(run(*cmd), 4, "weights/bf16/", str(top / "weights" / "bf16"))
        assert "pass that folder" in line
    assert not (tmp_path / "out").exists()


def test_the_root_of_an_hf_cache_entry_names_its_snapshot(src, tmp_path):
    entry = tmp_path / "hub" / "models--org--tiny"
    snap = entry / "snapshots" / "0123abcd"
    shutil.copytree(src, snap)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text("0123abcd")
    line = one_error(run("quantize", entry, tmp_path / "out", "--device", "cpu"), 4, "Hugging Face cache", str(snap),
                     "'org/tiny'", f"--cache-dir {entry.parent}")
    assert "snapshot" in line
    assert run("quantize", snap, tmp_path / "out", "--device", "cpu", "-q", "--dry-run").exit_code == 0


def test_pickle_weights_say_how_to_convert(tmp_path):
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(ck.llama_config()))
    (folder / "pytorch_model.bin").write_bytes(b"not read")
    one_error(run("quantize", folder, tmp_path / "out", "--device", "cpu"), 4, "pytorch_model.bin", "save_pretrained",
              "safetensors")
    assert not (tmp_path / "out").exists()


def test_an_engine_format_output_re_lays_into_the_other_engine_format_byte_for_byte(outputs, tmp_path):
    """An engine-format output (it has an fp4convert.json) re-lays into the other engine format: once refused as
    'native format only', now the tensors equal a direct ``quantize --format`` of the same source."""
    from safetensors.torch import load_file

    for fmt, target in (("compressed-tensors", "modelopt"), ("modelopt", "compressed-tensors")):
        r = run("export", outputs[fmt], tmp_path / fmt, "--format", target, "-q")
        assert r.exit_code == 0, r.output
        got = load_file(tmp_path / fmt / "model.safetensors")
        want = load_file(outputs[target] / "model.safetensors")
        assert got.keys() == want.keys()
        for name in want:
            assert got[name].dtype == want[name].dtype, (fmt, name)
            assert torch.equal(got[name].reshape(-1).view(torch.uint8), want[name].reshape(-1).view(torch.uint8)), (fmt, name)


def test_a_layer_number_of_5000_digits_is_a_name_not_an_error(tmp_path):
    """A tensor name with a 5000-digit layer number (past Python's int-string limit): found by the extended
    fuzzer (inspect sorted layers with int()); the MTP rules of the planner read the number too."""
    folder = tmp_path / "src"
    cfg = ck.llama_config(layers=1, num_nextn_predict_layers=1)
    t = ck.llama_tensors(cfg)
    t["model.layers." + "7" * 5000 + ".mlp.x.weight"] = torch.ones(16, 16, dtype=torch.bfloat16)
    ck.write(folder, t, cfg)
    dst = tmp_path / "out"
    for fmt in FORMATS:
        r = run("quantize", folder, dst, "--device", "cpu", "-q", "--format", fmt, "--overwrite")
        assert r.exit_code == 0, r.output
        r = run("inspect", dst, "--json")
        assert r.exit_code == 0, r.output
        assert any(len(k) > 5000 for k in json.loads(r.stdout)["layers"])


@pytest.mark.parametrize("key", ["num_hidden_layers", "num_local_experts"])
@pytest.mark.parametrize("mode", ["random", "w4a4"])
def test_absurd_counts_are_refused_before_the_model_is_built(src, tmp_path, key, mode):
    """Building 10**41 layers, even on meta, never ends: the model-run stages refuse the count first (exit 2,
    the key, the way out), as the planner's model definition already did (it falls back to name rules). Found
    by issue 34's campaign (a hang under --input-weights random)."""
    folder = tmp_path / "src"
    shutil.copytree(src, folder)
    _edit_config(folder, key, 10 ** 41)
    opts = {"random": ("--input-weights", "random"),
            "w4a4": ("--format", "compressed-tensors", "--activations", "nvfp4")}[mode]
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(60)
    try:
        r = run("quantize", folder, tmp_path / "out", "--device", "cpu", "-q", *opts, "--calibration-samples", 2,
                "--calibration-seq-len", 8)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    one_error(r, 2, key, "fix config.json", "--input-weights none" if mode == "random" else "--activation-scale")
    assert not (tmp_path / "out").exists()
