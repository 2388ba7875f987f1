"""``inspect``: summary of converted outputs, corruption detected, ``--verify`` against the source."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from fp4convert.output.manifest import MANIFEST_VERSION
from fp4convert.cli.main import main
from fp4convert.config import ConvertConfig
from fp4convert.run.convert import convert
from fp4convert.checkpoint.verify import DEFAULT_MAX_ERROR
from fp4convert.checkpoint.inspect import inspect_checkpoint

from tests import checkpoints as ck


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("moe")
    ck.moe(p, experts=2, shards=2)
    return p


@pytest.fixture(scope="module")
def converted(src, tmp_path_factory) -> dict[str, tuple[Path, object]]:
    out = {}
    for scheme in ("nvfp4", "mxfp4"):
        dst = tmp_path_factory.mktemp(scheme) / "q"
        # the textbook rules pinned: the error and SNR figures below are theirs (the defaults moved in issue 22)
        rule = {"nvfp4": "max", "mxfp4": "floor"}[scheme]
        out[scheme] = (dst, convert(src, dst, ConvertConfig(device="cpu", scheme=scheme, scale_rule=rule, max_shard_size=20000)))
    return out


@pytest.fixture
def copy(converted, tmp_path):
    def make(scheme: str = "nvfp4") -> Path:
        dst = tmp_path / "copy"
        shutil.copytree(converted[scheme][0], dst)
        return dst
    return make


@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp4"])
def test_summary_of_a_converted_checkpoint(converted, scheme) -> None:
    dst, res = converted[scheme]
    s = res.plan.summary()
    r = inspect_checkpoint(str(dst), check_files=True)
    assert r["ok"] and r["verdict"] == "ok" and r["checks"]["problems"] == []
    assert r["checks"]["manifest"] == "present" and r["checks"]["engine_config"] == "agrees with the tensors"
    assert r["format"] == "fp4convert" and r["scheme"] == scheme and r["rotate"] is None
    assert r["quantized"] == s["quantized"] and r["kept"] == s["kept"]
    assert r["params"] == s["params"] and r["bytes"] == s["bytes_out"]
    assert r["bits_per_param"] == s["bits_per_param"]
    assert r["bits_per_param_quantized"] == s["bits_per_param_quantized"]
    assert r["checks"]["checksums"] == "sha256 verified"
    layers = r["layers"]
    assert list(layers) == ["(other)", "model.layers.0", "model.layers.1"]  # natural order
    assert sum(v["quantized"] for v in layers.values()) == s["quantized"]
    assert sum(v["kept"] for v in layers.values()) == s["kept"]
    assert sum(v["bytes"] for v in layers.values()) == s["bytes_out"]
    n_q0 = sum(1 for n, d in res.plan.by_name.items() if n.startswith("model.layers.0.") and d.action == "quantize")
    assert layers["model.layers.0"]["quantized"] == n_q0
    if scheme == "nvfp4":
        assert len(r["global_scales"]) == s["quantized"]
        assert all(g > 0 for g in r["global_scales"].values())


def test_cli_report_and_json(converted) -> None:
    dst, res = converted["nvfp4"]
    r = CliRunner().invoke(main, ["inspect", str(dst)])
    assert r.exit_code == 0, r.output
    assert "format fp4convert, scheme nvfp4" in r.stdout and "verdict: OK" in r.stdout
    assert f"{res.plan.summary()['quantized']} quantized weights" in r.stdout
    assert "model.layers.1" in r.stdout
    r = CliRunner().invoke(main, ["inspect", str(dst), "--json"])
    j = json.loads(r.stdout)
    assert j["ok"] is True and j["quantized"] == res.plan.summary()["quantized"]


def test_unquantized_checkpoint(src) -> None:
    """A bf16 checkpoint is 'not quantized', never 'OK', and inspect exits 6 (it checks FP4 checkpoints)."""
    r = inspect_checkpoint(str(src))
    assert r["format"] == "unquantized" and r["quantized"] == 0 and r["kept"] > 0
    assert r["verdict"] == "not quantized" and not r["ok"]
    res = CliRunner().invoke(main, ["inspect", str(src)])
    assert res.exit_code == 6
    assert "not quantized" in res.stdout and "OK" not in res.stdout and "scheme None" not in res.stdout


# --- corruption ----------------------------------------------------------------------------------

def test_fused_group_with_different_global_scales(copy) -> None:
    dst = copy()
    name = "model.layers.1.mlp.experts.0.up_proj.weight_global_scale"
    f = ck.shard_with(dst, name)
    (v,) = struct.unpack("<f", ck.tensor_bytes(f, name))
    ck.patch_tensor(f, name, struct.pack("<f", v * 2))
    r = inspect_checkpoint(str(dst))
    assert not r["ok"]
    assert any("model.layers.1.mlp.experts.0" in p and "different global scales" in p for p in r["checks"]["problems"])
    res = CliRunner().invoke(main, ["inspect", str(dst)])
    assert res.exit_code == 6 and "different global scales" in res.stdout


def test_negative_global_scale(copy) -> None:
    dst = copy()
    name = "model.layers.0.self_attn.o_proj.weight_global_scale"
    ck.patch_tensor(ck.shard_with(dst, name), name, struct.pack("<f", -1.0))
    r = inspect_checkpoint(str(dst))
    assert any("model.layers.0.self_attn.o_proj" in p and "not finite and positive" in p for p in r["checks"]["problems"])


@pytest.mark.parametrize("scheme,byte,words", [("nvfp4", 0x7F, "NaN"), ("nvfp4", 0x80 | 0x38, "negative"),
                                               ("mxfp4", 0xFF, "NaN")])
def test_bad_block_scale_needs_check_files(copy, scheme, byte, words) -> None:
    dst = copy(scheme)
    name = "model.layers.0.mlp.experts.1.down_proj.weight_scale"
    ck.patch_tensor(ck.shard_with(dst, name), name, bytes([byte]))
    assert inspect_checkpoint(str(dst))["ok"]  # headers only: cannot see it (sizes unchanged)
    r = inspect_checkpoint(str(dst), check_files=True)
    probs = r["checks"]["problems"]
    assert any("model.layers.0.mlp.experts.1.down_proj" in p and words in p for p in probs), probs
    assert any("sha256 differs" in p for p in probs)
    res = CliRunner().invoke(main, ["inspect", str(dst), "--check-files"])
    assert res.exit_code == 6


def test_modified_file_detected_by_checksum(copy) -> None:
    dst = copy()
    name = "model.layers.1.self_attn.q_proj.weight_packed"
    f = ck.shard_with(dst, name)
    old = ck.tensor_bytes(f, name)
    ck.patch_tensor(f, name, bytes([old[0] ^ 0x11]))
    assert inspect_checkpoint(str(dst))["ok"]
    r = inspect_checkpoint(str(dst), check_files=True)
    assert r["checks"]["problems"] == [f"{f.name}: sha256 differs from fp4convert.json"]
    listed = len(json.loads((dst / "fp4convert.json").read_text())["files"])
    assert r["checks"]["checksums"] == f"1 of {listed} file(s) fail the sha256 check"
    res = CliRunner().invoke(main, ["inspect", str(dst), "--check-files"])
    assert res.exit_code == 6 and "sha256 differs" in res.stdout and "sha256 verified" not in res.stdout
    assert "verdict: FAILED" in res.stdout
    (dst / "tokenizer.json").write_text("{}")  # a copied file too
    r = inspect_checkpoint(str(dst))
    assert any("tokenizer.json" in p and "size" in p for p in r["checks"]["problems"])


def test_missing_files(copy) -> None:
    dst = copy()
    (dst / "generation_config.json").unlink()
    r = inspect_checkpoint(str(dst))
    assert any("generation_config.json" in p and "missing" in p for p in r["checks"]["problems"])
    res = CliRunner().invoke(main, ["inspect", str(dst)])
    assert res.exit_code == 6 and "generation_config.json" in res.output
    shard = sorted(dst.glob("*.safetensors"))[-1]
    shard.unlink()
    res = CliRunner().invoke(main, ["inspect", str(dst)])
    assert res.exit_code in (4, 6) and shard.name in res.output and "Traceback" not in res.output


def rename_tensor(f: Path, old: str, new: str) -> None:
    """Rename a tensor by editing the header in place; same header length (JSON padded with spaces)."""
    raw = bytearray(f.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    head = raw[8:8 + n].decode()
    assert f'"{old}"' in head and len(new) <= len(old)
    head = head.replace(f'"{old}"', f'"{new}"').rstrip()
    raw[8:8 + n] = (head + " " * (n - len(head))).encode()
    f.write_bytes(bytes(raw))


def test_partly_quantized_group(copy) -> None:
    dst = copy()
    m = "model.layers.0.self_attn.q_proj"
    f = ck.shard_with(dst, m + ".weight_packed")
    for suffix in ("weight_packed", "weight_scale", "weight_global_scale"):  # q_proj now looks kept
        rename_tensor(f, f"{m}.{suffix}", f"{m}.{'weight' if suffix == 'weight_packed' else 'w' + suffix[7:]}")
    r = inspect_checkpoint(str(dst))
    assert any("partly quantized" in p and "q_proj" in p for p in r["checks"]["problems"]), r["checks"]["problems"]
    assert not r["ok"]


def test_scale_without_packed_weight(copy) -> None:
    """A quantized module that lost its packed weight (its scales are left over) is a broken checkpoint."""
    dst = copy()
    m = "model.layers.0.self_attn.o_proj"
    rename_tensor(ck.shard_with(dst, m + ".weight_packed"), m + ".weight_packed", m + ".weight_pecked")
    r = inspect_checkpoint(str(dst))
    assert not r["ok"]
    assert any("o_proj" in p for p in r["checks"]["problems"]), r["checks"]["problems"]


# --- --verify ------------------------------------------------------------------------------------

def test_verify_reports_error_and_snr(converted, src) -> None:
    dst, res = converted["nvfp4"]
    r = inspect_checkpoint(str(dst), verify=str(src))
    v = r["verify"]
    assert r["ok"] and v["passed"] and v["problems"] == []
    assert v["fingerprint"] == "matches (file sizes and header hashes)"
    assert set(v["layers"]) == {n[:-7] for n, d in res.plan.by_name.items() if d.action == "quantize"}
    for m, e in v["layers"].items():
        assert 0.09 <= e["rel_error"] <= 0.11, (m, e)  # NVFP4 on Gaussian weights: ~0.095
        assert 19.0 <= e["snr_db"] <= 21.0, (m, e)
    o = v["overall"]
    errs = [e["rel_error"] for e in v["layers"].values()]
    assert o["layers"] == len(errs) and o["worst_rel_error"] == max(errs)
    assert o["mean_rel_error"] == pytest.approx(sum(errs) / len(errs))
    assert v["layers"][o["worst_layer"]]["rel_error"] == max(errs) and 19.0 <= o["snr_db"] <= 21.0
    assert v["max_error"] == DEFAULT_MAX_ERROR
    out = CliRunner().invoke(main, ["inspect", str(dst), "--verify", str(src)])
    assert out.exit_code == 0 and "rel.err 0.09" in out.stdout and "SNR 20." in out.stdout
    assert "overall: mean rel.err 0.09" in out.stdout and "worst 0." in out.stdout and "verdict: OK" in out.stdout
    j = json.loads(CliRunner().invoke(main, ["inspect", str(dst), "--verify", str(src), "--json"]).stdout)
    assert j["verify"]["layers"].keys() == v["layers"].keys() and j["verify"]["overall"]["worst_layer"] == o["worst_layer"]
    assert j["verdict"] == "ok" and j["checks"]["manifest"] == "present"


def test_verify_with_rotation(src, tmp_path) -> None:
    dst = tmp_path / "had"
    convert(src, dst, ConvertConfig(device="cpu", rotate="had16", only=("*.experts.*",)))
    r = inspect_checkpoint(str(dst), verify=str(src))
    assert r["rotate"] == "had16" and r["ok"]
    for m, e in r["verify"]["layers"].items():
        assert 0.08 <= e["rel_error"] <= 0.12 and 18.5 <= e["snr_db"] <= 22.0, (m, e)


def test_verify_threshold(converted, src) -> None:
    """--max-error: NVFP4 (~0.095) passes the default 0.25 and fails 0.05; MXFP4 (~0.12) sits between."""
    nv, mx = str(converted["nvfp4"][0]), str(converted["mxfp4"][0])
    worst_mx = inspect_checkpoint(mx, verify=str(src))["verify"]["overall"]["worst_rel_error"]
    assert 0.10 < worst_mx < 0.16 and inspect_checkpoint(mx, verify=str(src))["ok"]
    r = inspect_checkpoint(nv, verify=str(src), max_error=0.05)
    assert not r["ok"] and r["verdict"] == "failed"
    assert any("exceed --max-error 0.05" in p for p in r["checks"]["problems"])
    res = CliRunner().invoke(main, ["inspect", nv, "--verify", str(src), "--max-error", "0.05"])
    assert res.exit_code == 6 and "> max-error" in res.stdout and "verdict: FAILED" in res.stdout
    res = CliRunner().invoke(main, ["inspect", mx, "--verify", str(src), "--max-error", "0.1"])
    assert res.exit_code == 6
    assert CliRunner().invoke(main, ["inspect", mx, "--verify", str(src), "--max-error", "0.2"]).exit_code == 0


def test_verify_against_the_wrong_source_fails(converted, tmp_path) -> None:
    """Same names and shapes, other weights: the fingerprint matches (headers are equal) but the error
    (~1.4, independent weights) fails the threshold; another shard layout fails the fingerprint too."""
    other = tmp_path / "other"
    ck.moe(other, experts=2, shards=2, seed=9)
    dst = str(converted["nvfp4"][0])
    r = inspect_checkpoint(dst, verify=str(other))
    assert not r["ok"] and all(e["rel_error"] > 0.5 for e in r["verify"]["layers"].values())
    assert any("exceed --max-error" in p for p in r["checks"]["problems"])
    res = CliRunner().invoke(main, ["inspect", dst, "--verify", str(other)])
    assert res.exit_code == 6 and "verdict: FAILED" in res.stdout
    one = tmp_path / "one_shard"
    ck.moe(one, experts=2, shards=1)  # the converted model's weights, in one file
    r = inspect_checkpoint(dst, verify=str(one))
    assert r["verify"]["fingerprint"] == "differs" and not r["ok"]
    assert any("does not match the manifest's source fingerprint" in p and "model.safetensors" in p
               for p in r["checks"]["problems"]), r["checks"]["problems"]
    assert all(e["rel_error"] < 0.11 for e in r["verify"]["layers"].values())  # same data: only the fingerprint fails
    smaller = tmp_path / "smaller"
    ck.moe(smaller, experts=1, shards=2)
    r = inspect_checkpoint(dst, verify=str(smaller))
    assert not r["ok"] and any("not in the --verify source" in p for p in r["checks"]["problems"])


def test_verify_against_a_quantized_folder_fails(converted) -> None:
    """Every layer 'not in the source' is a failure, not 'OK'."""
    r = inspect_checkpoint(str(converted["nvfp4"][0]), verify=str(converted["mxfp4"][0]))
    assert not r["ok"]
    assert all(e == {"error": "not in the source checkpoint"} for e in r["verify"]["layers"].values())
    assert any("not in the --verify source" in p for p in r["checks"]["problems"])
    res = CliRunner().invoke(main, ["inspect", str(converted["nvfp4"][0]), "--verify", str(converted["mxfp4"][0])])
    assert res.exit_code == 6 and "OK" not in res.stdout


def test_plot_without_matplotlib_writes_html(converted, src, tmp_path) -> None:
    out = tmp_path / "err.png"
    res = CliRunner().invoke(main, ["inspect", str(converted["nvfp4"][0]), "--verify", str(src), "--plot", str(out)])
    assert res.exit_code == 0, res.output
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        html = tmp_path / "err.html"
        assert "matplotlib is not installed" in res.stderr and html.exists() and not out.exists()
        text = html.read_text()
        assert "<svg" in text and "model.layers.1.mlp.experts.0.up_proj" in text and "threshold 0.25" in text
    else:
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert CliRunner().invoke(main, ["inspect", str(converted["nvfp4"][0]), "--plot", str(out)]).exit_code == 2


# --- the manifest against the files -------------------------------------------------------------

def test_missing_manifest_in_an_output_folder_fails(copy) -> None:
    dst = copy()
    (dst / "fp4convert.json").unlink()
    r = inspect_checkpoint(str(dst))
    assert r["format"] == "fp4convert" and r["quantized"] > 0  # still recognised (config.json names fp4convert)
    assert not r["ok"] and r["checks"]["manifest"].startswith("missing")
    assert any("fp4convert.json is missing" in p and "config.json names fp4convert" in p for p in r["checks"]["problems"])
    # Without the native quantization_config either: the tensors are recognised by their names and scale shapes.
    c = json.loads((dst / "config.json").read_text())
    del c["quantization_config"]
    (dst / "config.json").write_text(json.dumps(c))
    r = inspect_checkpoint(str(dst))
    assert r["format"] == "fp4convert" and r["scheme"] == "nvfp4" and r["quantized"] > 0
    assert any("recognised from the tensor names" in n for n in r["checks"]["notes"])
    assert not r["ok"] and any("model card" in p for p in r["checks"]["problems"])
    assert CliRunner().invoke(main, ["inspect", str(dst)]).exit_code == 6


def test_interrupted_conversion_is_named(copy) -> None:
    dst = copy()
    (dst / "fp4convert.json").rename(dst / ".fp4convert-progress.json")
    r = inspect_checkpoint(str(dst))
    assert not r["ok"] and any("--resume" in p for p in r["checks"]["problems"])


def test_engine_folder_without_manifest_is_fine(src, tmp_path) -> None:
    """A compressed-tensors folder another tool wrote has no manifest: that is not a problem."""
    dst = tmp_path / "ct"
    convert(src, dst, ConvertConfig(device="cpu", format="compressed-tensors"))
    (dst / "fp4convert.json").unlink()
    (dst / "README.md").write_text("# someone else's card\n")
    r = inspect_checkpoint(str(dst))
    assert r["ok"] and r["checks"]["manifest"] == "not expected (not an fp4convert output)", r["checks"]


def test_files_not_in_the_manifest(copy) -> None:
    dst = copy()
    (dst / "notes.txt").write_text("added later")
    r = inspect_checkpoint(str(dst))
    assert not r["ok"] and "notes.txt: not listed in fp4convert.json (added after the conversion?)" in r["checks"]["problems"]
    assert "sha256 verified" not in r["checks"]["checksums"]


def test_manifest_scales_and_settings_must_match_the_tensors(copy) -> None:
    dst = copy()
    path = dst / "fp4convert.json"
    m = json.loads(path.read_text())
    name = "model.layers.0.self_attn.o_proj.weight"
    m["tensors"][name]["global_scale"] *= 1.5
    m["scheme"] = "mxfp4"
    path.write_text(json.dumps(m))
    probs = inspect_checkpoint(str(dst))["checks"]["problems"]
    assert any(p.startswith("model.layers.0.self_attn.o_proj: global scale") and "records" in p for p in probs), probs
    assert any("says scheme mxfp4, the block scales are nvfp4" in p for p in probs), probs
    assert any("settings.scheme is 'nvfp4' but scheme is 'mxfp4'" in p for p in probs), probs


# --- engine configs against the tensors -----------------------------------------------------------

@pytest.fixture(scope="module")
def engine_outputs(src, tmp_path_factory) -> dict[str, Path]:
    out = {}
    for fmt, scheme in (("compressed-tensors", "nvfp4"), ("compressed-tensors", "mxfp4"), ("modelopt", "nvfp4")):
        dst = tmp_path_factory.mktemp(f"{fmt}-{scheme}") / "q"
        convert(src, dst, ConvertConfig(device="cpu", format=fmt, scheme=scheme))
        out[f"{fmt}-{scheme}"] = dst
    return out


def edit_json(path: Path, fn) -> None:
    obj = json.loads(path.read_text())
    fn(obj)
    path.write_text(json.dumps(obj))


@pytest.mark.parametrize("key", ["compressed-tensors-nvfp4", "compressed-tensors-mxfp4", "modelopt-nvfp4"])
def test_engine_config_agrees(engine_outputs, key) -> None:
    r = inspect_checkpoint(str(engine_outputs[key]), check_files=True)
    assert r["ok"] and r["checks"]["engine_config"] == "agrees with the tensors", r["checks"]


@pytest.mark.parametrize("edit,words", [
    (lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(group_size=32), "group_size is 32"),
    (lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(strategy="group"), "strategy is 'group'"),
    (lambda c: c["quantization_config"]["config_groups"]["group_0"].update(format="mxfp4-pack-quantized"), "does not match the nvfp4"),
    (lambda c: c["quantization_config"].update(ignore=[]), "ignore misses"),
    (lambda c: c["quantization_config"]["ignore"].append("model.layers.0.self_attn.q_proj"), "names 1 quantized weight"),
    (lambda c: c["quantization_config"]["ignore"].append("re:.*experts.*"), "would load it unquantized"),
    (lambda c: c.pop("quantization_config"), "no quantization_config"),
])
def test_compressed_tensors_config_disagrees(engine_outputs, tmp_path, edit, words) -> None:
    dst = tmp_path / "ct"
    shutil.copytree(engine_outputs["compressed-tensors-nvfp4"], dst)
    (dst / "fp4convert.json").unlink()  # as a third-party folder: only config.json describes it
    edit_json(dst / "config.json", edit)
    r = inspect_checkpoint(str(dst))
    if words == "no quantization_config":  # nothing says compressed-tensors any more: guessed by names
        assert any("recognised from the tensor names" in n for n in r["checks"]["notes"])
    assert not r["ok"] and any(words in p for p in r["checks"]["problems"]), r["checks"]["problems"]


def test_mxfp4_config_disagrees(engine_outputs, tmp_path) -> None:
    dst = tmp_path / "ct"
    shutil.copytree(engine_outputs["compressed-tensors-mxfp4"], dst)
    edit_json(dst / "config.json", lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(group_size=16))
    probs = inspect_checkpoint(str(dst))["checks"]["problems"]
    assert any("group_size is 16, the mxfp4 scales are per 32" in p for p in probs), probs
    assert any("disagree with group_size 16" in p for p in probs), probs


@pytest.mark.parametrize("edit,words", [
    (lambda h: h["quantization"].update(group_size=32), "group_size is 32"),
    (lambda h: h["quantization"].update(exclude_modules=["lm_head"]), "exclude_modules misses"),
    (lambda h: h["quantization"].update(exclude_modules=["*"]), "exclude_modules names"),
])
def test_modelopt_config_disagrees(engine_outputs, tmp_path, edit, words) -> None:
    dst = tmp_path / "mo"
    shutil.copytree(engine_outputs["modelopt-nvfp4"], dst)
    edit_json(dst / "hf_quant_config.json", edit)
    probs = inspect_checkpoint(str(dst))["checks"]["problems"]
    assert any(words in p for p in probs), probs


def test_verify_an_export_against_the_original_source(converted, src, tmp_path) -> None:
    """An exported folder's manifest names the native folder as its source; --verify checks the original
    fingerprint it carries (identity.exported_from) instead."""
    from fp4convert.checkpoint.export import export

    out = tmp_path / "ct"
    export(str(converted["nvfp4"][0]), out, ConvertConfig(format="compressed-tensors"))
    r = inspect_checkpoint(str(out), verify=str(src))
    assert r["ok"] and r["verify"]["fingerprint"] == "matches (file sizes and header hashes)", r["checks"]
    assert 0.09 <= r["verify"]["overall"]["worst_rel_error"] <= 0.11


def test_verify_a_hub_conversion_against_a_folder(copy, src) -> None:
    """A manifest that names a Hub commit cannot be compared file by file with a folder: the tensor names,
    shapes and dtypes are (and pass here), and the report says so."""
    dst = copy()
    path = dst / "fp4convert.json"
    m = json.loads(path.read_text())
    m["identity"]["source"] = {"type": "hub", "repo_id": "org/model", "revision": None, "commit": "0" * 40}
    path.write_text(json.dumps(m))
    r = inspect_checkpoint(str(dst), verify=str(src))
    assert r["verify"]["fingerprint"].startswith("not comparable") and r["ok"], r["checks"]["problems"]
    m["tensors"]["model.layers.0.self_attn.o_proj.weight"]["shape"] = [64, 32]
    path.write_text(json.dumps(m))
    r = inspect_checkpoint(str(dst), verify=str(src))
    assert not r["ok"] and any("differs from the converted one" in p and "o_proj" in p for p in r["checks"]["problems"])


# --- fresh outputs of every format x scheme x rotation x family pass inspect (no transformers) ----

ZOO_SHAPES = Path(__file__).parents[1] / "zoo_shapes.json"  # tests/zoo.py's families: names, shapes, config
MATRIX = [(f, s, r) for f in ("fp4convert", "compressed-tensors") for s in ("nvfp4", "mxfp4") for r in (None, "had16")]
MATRIX.append(("modelopt", "nvfp4", None))


def zoo_checkpoint(family: str, path: Path, seed: int = 0) -> Path:
    """A tiny real-family checkpoint without transformers: the tensor names, shapes and config.json that
    ``tests.zoo.build(family)`` writes (recorded in zoo_shapes.json), filled with seeded random bf16."""
    import torch

    spec = json.loads(ZOO_SHAPES.read_text())[family]
    g = torch.Generator().manual_seed(seed)
    tensors = {n: (torch.randn(shape, generator=g) * 0.02).to(getattr(torch, {"BF16": "bfloat16"}[dt]))
               for n, (dt, shape) in spec["tensors"].items()}
    ck.write(path, tensors, spec["config"])
    return path


@pytest.mark.parametrize("family", sorted(json.loads(ZOO_SHAPES.read_text())))
def test_every_fresh_output_passes_inspect(family, tmp_path) -> None:
    """Issue 23 item 12: inspect failed fresh outputs (had16 compressed-tensors: 'ignore misses ...
    had16_input'; stacked experts: 'lists 6 quantized weights, the shards hold 16')."""
    src = zoo_checkpoint(family, tmp_path / family)
    for fmt, scheme, rotate in MATRIX:
        dst = tmp_path / f"{fmt}-{scheme}-{rotate}"
        convert(src, dst, ConvertConfig(device="cpu", scheme=scheme, format=fmt, rotate=rotate))
        r = inspect_checkpoint(str(dst), check_files=True)
        assert r["verdict"] == "ok", (family, fmt, scheme, rotate, r["checks"]["problems"])
        assert r["format"] == fmt and r["scheme"] == scheme and r["rotate"] == rotate
        shutil.rmtree(dst)


@pytest.mark.parametrize("fmt", ["modelopt", "fp4convert", "compressed-tensors"])
def test_a_kept_u8_weight_is_not_taken_for_a_packed_one(fmt, tmp_path) -> None:
    """ModelOpt's packed weights are U8 ``.weight``: a source's kept U8 ``.weight`` is not one (the
    manifest says it is kept)."""
    import torch

    cfg = ck.llama_config(layers=1)
    t = ck.llama_tensors(cfg)
    t["model.extra.weight"] = torch.arange(32, dtype=torch.uint8).reshape(4, 8)
    ck.write(tmp_path / "src", t, cfg)
    convert(tmp_path / "src", tmp_path / "q", ConvertConfig(device="cpu", format=fmt))
    r = inspect_checkpoint(str(tmp_path / "q"))
    assert r["verdict"] == "ok", r["checks"]["problems"]


# --- crafted folders: nothing outside read, no hang, the manifest validated --------------------

def _manifest(dst: Path) -> dict:
    return json.loads((dst / "fp4convert.json").read_text())


def _save_manifest(dst: Path, m: dict) -> None:
    (dst / "fp4convert.json").write_text(json.dumps(m))


def _one_problem_exit_6(dst: Path, *words: str) -> str:
    res = CliRunner().invoke(main, ["inspect", str(dst)])
    assert res.exit_code == 6, res.output
    assert "Traceback" not in res.output and "verdict: FAILED" in res.stdout
    hits = [line for line in res.stdout.splitlines() if all(w in line for w in words)]
    assert hits, (words, res.stdout)
    return res.stdout


def test_manifest_naming_absolute_paths_is_not_followed(copy, monkeypatch) -> None:
    """Issue 23 item 5: a manifest naming /etc/passwd made inspect stat and hash it."""
    dst = copy()
    m = _manifest(dst)
    m["files"]["/etc/passwd"] = {"sha256": "0" * 64, "size": 1}
    _save_manifest(dst, m)
    out = _one_problem_exit_6(dst, "/etc/passwd", "not a plain relative path")
    assert str(Path("/etc/passwd").stat().st_size) not in out.replace("fp4convert.json", "")


@pytest.mark.parametrize("rel", ["../outside.txt", "a/../../outside.txt"])
def test_manifest_paths_leading_out_are_refused(copy, rel) -> None:
    dst = copy()
    (dst.parent / "outside.txt").write_text("secret")
    m = _manifest(dst)
    m["files"][rel] = {"sha256": "0" * 64, "size": 6}
    _save_manifest(dst, m)
    _one_problem_exit_6(dst, "not a plain relative path")


def test_listed_symlink_out_of_the_folder_is_not_read(copy, monkeypatch) -> None:
    dst = copy()
    secret = dst.parent / "secret.txt"
    secret.write_text("x" * 77)
    (dst / "notes.txt").symlink_to(secret)
    m = _manifest(dst)
    m["files"]["notes.txt"] = {"sha256": "0" * 64, "size": 77}  # the right size: a stat would pass it
    _save_manifest(dst, m)
    import fp4convert.checkpoint.inspect as insp

    opened = []
    real = insp.open_regular
    monkeypatch.setattr(insp, "open_regular", lambda p: opened.append(str(p)) or real(p))
    out = _one_problem_exit_6(dst, "notes.txt", "outside the checkpoint folder")
    assert not any(p.endswith("notes.txt") for p in opened) and "size 77" not in out


# 13 malformed manifest shapes (issue 23 item 11): each is one line, inspect FAILED (6), export 4.
def _edit(path: list, value=None, delete: bool = False):
    def apply(m: dict) -> None:
        node = m
        for k in path[:-1]:
            node = node[k(node) if callable(k) else k]
        key = path[-1] if not callable(path[-1]) else path[-1](node)
        if delete:
            del node[key]
        else:
            node[key] = value
    return apply


def _first(d: dict) -> str:
    return next(iter(d))


MALFORMED = {
    "files a list": (_edit(["files"], ["model.safetensors"]), "'files'"),
    "sha256 not a string": (_edit(["files", _first, "sha256"], 5), "sha256"),
    "size negative": (_edit(["files", _first, "size"], -1), "size"),
    "settings missing": (_edit(["settings"], delete=True), "'settings' is missing"),
    "settings a string": (_edit(["settings"], "x"), "'settings'"),
    "tensors a list": (_edit(["tensors"], []), "'tensors'"),
    "tensor record a number": (_edit(["tensors", _first], 3), "'tensors'["),
    "action unknown": (_edit(["tensors", _first, "action"], "drop"), "'action'"),
    "shape of strings": (_edit(["tensors", _first, "shape"], ["a"]), "'shape'"),
    "outputs a list": (_edit(["tensors", _first, "outputs"], []), "'outputs'"),
    "output dtype a number": (_edit(["tensors", _first, "outputs", _first, "dtype"], 1), "'dtype'"),
    "global scale a string": (_edit(["tensors", "model.layers.0.self_attn.q_proj.weight", "global_scale"], "x"),
                              "'global_scale'"),
    "groups a list": (_edit(["groups"], ["a"]), "'groups'"),
    "scheme unknown": (_edit(["scheme"], "int3"), "'scheme'"),
    "format a number": (_edit(["format"], 4), "'format'"),
    "identity source a list": (_edit(["identity", "source"], []), "'source'"),
    "activations a number": (_edit(["activations"], 5), "'activations'"),  # exit 1 on a weight-only ModelOpt output
    # Issue 23's second campaign: a manifest of another version was read as this one (inspect OK, export 0);
    # nested global scales that are no rectangular array stopped inspect and export with a TypeError (exit 1).
    "manifest version from the future": (_edit(["manifest_version"], MANIFEST_VERSION + 1), "'manifest_version'"),
    "global scales ragged": (_edit(["tensors", "model.layers.0.self_attn.q_proj.weight", "global_scale"],
                                   [[1.0, [2.0]]]), "'global_scale'"),
    "amax ragged": (_edit(["tensors", "model.layers.0.self_attn.q_proj.weight", "amax"], [[1.0], [2.0, 3.0]]),
                    "'amax'"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_manifest_is_one_problem(copy, tmp_path, case) -> None:
    edit, words = MALFORMED[case]
    dst = copy()
    m = _manifest(dst)
    edit(m)
    _save_manifest(dst, m)
    _one_problem_exit_6(dst, "fp4convert.json", "malformed", words)
    res = CliRunner().invoke(main, ["export", str(dst), str(tmp_path / "ct"), "--format", "compressed-tensors", "-q"])
    assert res.exit_code == 4, res.output
    assert res.output.count("\n") == 1 and "malformed" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "ct").exists()


def _cli(*args: str, timeout: float = 120):
    """The CLI in a subprocess with a timeout (a hang fails the test instead of stalling the suite)."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "fp4convert", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_special_files_never_hang_inspect_or_export(copy, tmp_path) -> None:
    """Issue 23 item 11: a FIFO manifest hung inspect and export; a FIFO or /dev/zero entry hung --check-files."""
    import os

    dst = copy()
    os.mkfifo(dst / "extra.fifo")
    (dst / "zero.bin").symlink_to("/dev/zero")
    m = _manifest(dst)
    m["files"]["extra.fifo"] = {"sha256": "0" * 64, "size": 0}
    m["files"]["zero.bin"] = {"sha256": "0" * 64, "size": 0}
    _save_manifest(dst, m)
    r = _cli("inspect", str(dst), "--check-files")
    assert r.returncode == 6 and "Traceback" not in r.stderr, r.stderr
    assert "extra.fifo: listed in fp4convert.json but cannot be read (a FIFO" in r.stdout
    assert "zero.bin: listed in fp4convert.json but it resolves outside" in r.stdout
    (dst / "fp4convert.json").unlink()
    os.mkfifo(dst / "fp4convert.json")
    r = _cli("inspect", str(dst))
    assert r.returncode == 6 and "fp4convert.json: cannot read (a FIFO, not a regular file)" in r.stdout, r
    r = _cli("export", str(dst), str(tmp_path / "ct"), "--format", "compressed-tensors", "-q")
    assert r.returncode == 4 and r.stderr.count("\n") == 1 and "a FIFO" in r.stderr, r


@pytest.mark.parametrize("edit,words", [
    (lambda qc: qc.update(ignore=["re:(unclosed"]), "does not compile"),
    (lambda qc: qc.update(ignore=[5]), "quantization_config.ignore[0] is an integer"),
    (lambda qc: qc.update(ignore="lm_head"), "quantization_config.ignore is a string, not a list"),
    (lambda qc: qc.update(config_groups=["group_0"]), "config_groups is a list, not an object"),
    (lambda qc: qc["config_groups"].update(group_0=7), "config_groups.group_0 is an integer"),
    (lambda qc: qc["config_groups"]["group_0"].update(weights=[4]), "group_0.weights is a list"),
    (lambda qc: qc.update(transform_config=[1]), "transform_config is a list"),
])
def test_compressed_tensors_config_of_wrong_types_is_a_finding(engine_outputs, tmp_path, edit, words) -> None:
    dst = tmp_path / "ct"
    shutil.copytree(engine_outputs["compressed-tensors-nvfp4"], dst)
    (dst / "fp4convert.json").unlink()  # as another tool wrote it: the config alone describes the format
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg["quantization_config"])
    (dst / "config.json").write_text(json.dumps(cfg))
    res = CliRunner().invoke(main, ["inspect", str(dst)])
    assert res.exit_code in (4, 6) and "Traceback" not in res.output and "internal error" not in res.output
    assert words in res.output, res.output


@pytest.mark.parametrize("quant,words", [
    ([1], "hf_quant_config.json's quantization is a list"),
    ({"quant_algo": "NVFP4", "exclude_modules": "lm_head"}, "exclude_modules is a string, not a list"),
    ({"quant_algo": "NVFP4", "exclude_modules": [None]}, "exclude_modules[0] is null"),
])
def test_modelopt_config_of_wrong_types_is_a_finding(engine_outputs, tmp_path, quant, words) -> None:
    dst = tmp_path / "mo"
    shutil.copytree(engine_outputs["modelopt-nvfp4"], dst)
    hq = json.loads((dst / "hf_quant_config.json").read_text())
    hq["quantization"] = quant
    (dst / "hf_quant_config.json").write_text(json.dumps(hq))
    res = CliRunner().invoke(main, ["inspect", str(dst)])
    assert res.exit_code == 6 and "Traceback" not in res.output and words in res.output, res.output


def test_hf_quant_config_producer_of_a_wrong_type(engine_outputs, tmp_path) -> None:
    """Found by tests/e2e/test_fuzz_checkpoints.py: a string 'producer' was an internal error (exit 1)."""
    dst = tmp_path / "mo"
    shutil.copytree(engine_outputs["modelopt-nvfp4"], dst)
    (dst / "fp4convert.json").unlink()
    hq = json.loads((dst / "hf_quant_config.json").read_text())
    hq["producer"] = "fp4convert"
    (dst / "hf_quant_config.json").write_text(json.dumps(hq))
    res = CliRunner().invoke(main, ["inspect", str(dst)])
    assert res.exit_code in (0, 6) and "internal error" not in res.output, res.output


def test_hf_quant_config_nested_too_deep_is_no_internal_error(engine_outputs, tmp_path) -> None:
    """Found by tests/e2e/test_fuzz_checkpoints.py: 100,000 nested '[' in hf_quant_config.json was a RecursionError."""
    dst = tmp_path / "mo"
    shutil.copytree(engine_outputs["modelopt-nvfp4"], dst)
    (dst / "hf_quant_config.json").write_text("[" * 100000)
    res = CliRunner().invoke(main, ["inspect", str(dst)])
    assert res.exit_code in (0, 6) and "internal error" not in res.output, res.output


# --- edited manifests that pass the schema: inspect names the disagreement, export refuses (4) --------

Q = "model.layers.0.self_attn.o_proj.weight"
KEPT = "model.norm.weight"
GROUPED = "model.layers.0.self_attn.q_proj.weight"


def _set(name: str, key: str, value):
    return lambda m: m["tensors"][name].__setitem__(key, value)


def _rename(m: dict) -> None:
    m["tensors"][KEPT + ".x"] = m["tensors"].pop(KEPT)


def _other_outputs(m: dict) -> None:
    m["tensors"][KEPT]["outputs"] = dict(m["tensors"]["model.layers.1.input_layernorm.weight"]["outputs"])


def _flip_to_keep(m: dict) -> None:
    m["tensors"][Q]["action"] = "keep"


def _rename_quantized(m: dict) -> None:
    """A quantized record under another name (its outputs still o_proj's): inspect passed it (second campaign)."""
    m["tensors"]["a\nError: fake.weight"] = m["tensors"].pop(Q)


# Each was exit 1 under export (KeyError, "got N B, the plan says M B") or exit 0 with a wrong output, and
# inspect passed most of them (campaign of issue 23, round 2).
EDITED = {
    "kept tensor's shape doubled": (_set(KEPT, "shape", [128]), KEPT),
    "kept tensor's dtype": (_set(KEPT, "dtype", "F32"), KEPT),
    "kept tensor's output shape": (lambda m: m["tensors"][KEPT]["outputs"][KEPT].__setitem__("shape", [128]), KEPT),
    "record renamed": (_rename, KEPT),
    "quantized record renamed": (_rename_quantized, "not named after it"),
    "outputs of another tensor": (_other_outputs, "model.layers.1.input_layernorm.weight"),
    "quantized record flipped to kept": (_flip_to_keep, "o_proj"),
    "quantized shape of another size": (_set(Q, "shape", [64, 128]), Q),
    "fused groups emptied": (lambda m: m.__setitem__("groups", {}), "fused group"),
    "group of a record": (_set(GROUPED, "group", "g"), GROUPED),
    "global scale differs": (lambda m: m["tensors"][Q].__setitem__("global_scale", 1.0), "global scale"),
    "rotation claimed": (lambda m: m.__setitem__("rotate", "had16"), "rotate"),
    "unknown scale rule": (lambda m: m.__setitem__("scale_rule", "x"), "scale rule"),
}


@pytest.mark.parametrize("case", sorted(EDITED))
def test_edited_manifest_disagreeing_with_the_shards(copy, tmp_path, case) -> None:
    edit, words = EDITED[case]
    dst = copy()
    m = _manifest(dst)
    edit(m)
    _save_manifest(dst, m)
    _one_problem_exit_6(dst, words)
    res = CliRunner().invoke(main, ["export", str(dst), str(tmp_path / "ct"), "--format", "compressed-tensors", "-q"])
    assert res.exit_code == 4, res.output
    assert res.output.count("\n") == 1 and "fp4convert.json" in res.output and words in res.output, res.output
    assert "Traceback" not in res.output and not (tmp_path / "ct").exists()


@pytest.mark.parametrize("shape", [[1024], []])
def test_a_packed_weight_that_is_no_matrix_is_a_finding(copy, shape) -> None:
    """A ``.weight_packed`` header edited to 1-D or 0-D stopped inspect with 'not enough values to unpack' (exit 1)."""
    dst = copy()
    name = "model.layers.0.self_attn.o_proj.weight_packed"
    f = ck.shard_with(dst, name)
    start, header = ck.header(f)
    meta = header.pop("__metadata__", None)
    blobs = {k: f.read_bytes()[start + v["data_offsets"][0]:start + v["data_offsets"][1]] for k, v in header.items()}
    header[name]["shape"] = shape
    blobs[name] = blobs[name][: max(1, sum(shape))]  # 0-D: one byte
    out, off = ({"__metadata__": meta} if meta is not None else {}), 0
    for k, v in header.items():
        out[k] = {**v, "data_offsets": [off, off + len(blobs[k])]}
        off += len(blobs[k])
    raw = json.dumps(out).encode()
    raw += b" " * (-len(raw) % 8)
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs[k] for k in header))
    for args in (["inspect", str(dst)], ["inspect", str(dst), "--check-files"]):
        res = CliRunner().invoke(main, args)
        assert res.exit_code == 6 and "Traceback" not in res.output, res.output
        assert "o_proj.weight_packed: shape" in res.stdout and "not a [..., rows, columns] matrix" in res.stdout


def _gpt2(path: Path) -> Path:
    """A tiny GPT-2: its linear weights are Conv1D, stored [in, out] (quantized as their transpose)."""
    import torch

    h, n = 64, 1
    g = torch.Generator().manual_seed(3)

    def r(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    t = {"transformer.wte.weight": r(96, h), "transformer.wpe.weight": r(32, h), "transformer.ln_f.weight": r(h),
         "transformer.ln_f.bias": r(h)}
    for i in range(n):
        p = f"transformer.h.{i}."
        t.update({p + "ln_1.weight": r(h), p + "ln_1.bias": r(h), p + "ln_2.weight": r(h), p + "ln_2.bias": r(h),
                  p + "attn.c_attn.weight": r(h, 3 * h), p + "attn.c_attn.bias": r(3 * h),
                  p + "attn.c_proj.weight": r(h, h), p + "attn.c_proj.bias": r(h),
                  p + "mlp.c_fc.weight": r(h, 4 * h), p + "mlp.c_fc.bias": r(4 * h),
                  p + "mlp.c_proj.weight": r(4 * h, h), p + "mlp.c_proj.bias": r(h)})
    cfg = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": h, "n_layer": n, "n_head": 4,
           "n_positions": 32, "vocab_size": 96, "torch_dtype": "bfloat16", "tie_word_embeddings": True}
    ck.write(path, t, cfg)
    return path


@pytest.mark.parametrize("family", ["gpt2", "gpt_oss", "llama4"])
def test_export_of_conv1d_and_stacked_experts_equals_direct_conversion(family, tmp_path) -> None:
    """A GPT-2 Conv1D weight ([in, out] on disk) was exported with [in, out/2] packed headers over [out, in]
    data (exit 0, a wrong model; inspect passed it), and a stacked expert tensor split per expert was
    refused as 'recorded as quantized but the shards hold no quantized module' (our own output)."""
    from fp4convert.checkpoint.export import export

    src = _gpt2(tmp_path / "src") if family == "gpt2" else zoo_checkpoint(family, tmp_path / "src")
    for fmt, scheme, rotate in (("compressed-tensors", "nvfp4", None), ("compressed-tensors", "mxfp4", "had16"),
                                ("modelopt", "nvfp4", None)):
        cfg = dict(device="cpu", scheme=scheme, rotate=rotate)
        native, direct, exported = (tmp_path / f"{k}-{fmt}-{scheme}" for k in ("native", "direct", "exported"))
        convert(src, native, ConvertConfig(**cfg))
        convert(src, direct, ConvertConfig(format=fmt, **cfg))
        export(str(native), exported, ConvertConfig(format=fmt))
        shards = sorted(p.name for p in direct.glob("*.safetensors"))
        assert shards and shards == sorted(p.name for p in exported.glob("*.safetensors"))
        for f in shards:
            assert (direct / f).read_bytes() == (exported / f).read_bytes(), (family, fmt, f)
        r = inspect_checkpoint(str(exported), check_files=True)
        assert r["verdict"] == "ok", (family, fmt, r["checks"]["problems"])


# --- --kept-dtype bf16: kept F32/F64 tensors stored as BF16 -------------------------------------------------

@pytest.fixture(scope="module")
def fp32_src(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("fp32")
    ck.mixed_kept(p)
    return p


def test_kept_dtype_bf16_outputs_pass_inspect_and_export_as_a_direct_conversion(fp32_src, tmp_path) -> None:
    """Native, direct engine-format and exported outputs with --kept-dtype bf16: inspect passes them (the manifest
    records each kept tensor's source dtype and its BF16 output), export keeps the BF16 tensors and gives the
    bytes of a direct conversion, and every config.json says bfloat16."""
    from fp4convert.checkpoint.export import export

    cfg = dict(device="cpu", kept_dtype="bf16", max_shard_size=20_000)
    native = tmp_path / "native"
    convert(fp32_src, native, ConvertConfig(**cfg))
    outputs = [native]
    for fmt in ("compressed-tensors", "modelopt"):
        direct, exported = tmp_path / f"direct-{fmt}", tmp_path / f"exported-{fmt}"
        convert(fp32_src, direct, ConvertConfig(format=fmt, **cfg))
        export(str(native), exported, ConvertConfig(format=fmt, max_shard_size=20_000))
        files = sorted(f for f in ck.all_files(direct) if f not in ("fp4convert.json", "README.md"))
        assert files == sorted(f for f in ck.all_files(exported) if f not in ("fp4convert.json", "README.md"))
        assert len([f for f in files if f.endswith(".safetensors")]) > 1
        for f in files:
            assert (direct / f).read_bytes() == (exported / f).read_bytes(), (fmt, f)
        assert _manifest(exported)["settings"] == _manifest(direct)["settings"]
        outputs += [direct, exported]
    for out in outputs:
        m = _manifest(out)
        assert m["settings"]["kept_dtype"] == "bf16"
        rec = m["tensors"]["model.norm.weight"]
        assert rec["dtype"] == "F32" and rec["outputs"]["model.norm.weight"]["dtype"] == "BF16"
        assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
        r = inspect_checkpoint(str(out), check_files=True, verify=str(fp32_src))
        assert r["ok"], (out.name, r["checks"]["problems"])


def test_kept_dtype_in_the_manifest_must_match_the_kept_tensors(fp32_src, tmp_path) -> None:
    """A BF16 kept tensor from an F32 source is right only where the settings say --kept-dtype bf16; the same
    edit the other way (an F32 output under bf16 settings) is a finding too."""
    bf16, plain = tmp_path / "bf16", tmp_path / "plain"
    convert(fp32_src, bf16, ConvertConfig(device="cpu", kept_dtype="bf16"))
    convert(fp32_src, plain, ConvertConfig(device="cpu"))
    assert inspect_checkpoint(str(plain))["ok"] and inspect_checkpoint(str(bf16))["ok"]
    m = _manifest(bf16)
    del m["settings"]["kept_dtype"]
    _save_manifest(bf16, m)
    _one_problem_exit_6(bf16, "model.norm.weight: recorded as kept F32 [64], its output is BF16 [64]")
    m = _manifest(plain)
    m["settings"]["kept_dtype"] = "bf16"
    _save_manifest(plain, m)
    _one_problem_exit_6(plain, "model.norm.weight: recorded as kept F32 [64], its output is F32 [64] (kept_dtype 'bf16')")


# ---------------------------------------------------------------------------------------------
# Checkpoints fp4convert did not write (issue 44): compressed-tensors' own, ModelOpt's (our writer, no manifest)
# ---------------------------------------------------------------------------------------------

def _fused(shapes) -> dict[str, list[str]]:
    """Every group an engine fuses (q/k/v; gate/up, per expert too) -> its member weights."""
    from fp4convert.plan.knowledge import fused_group

    out: dict[str, list[str]] = {}
    for name in shapes:
        g = fused_group(name)
        if g:
            out.setdefault(g, []).append(name)
    return out


@pytest.fixture(scope="module")
def foreign_ct(tmp_path_factory) -> dict[str, Path]:
    """compressed-tensors' own NVFP4 checkpoints of a tiny Qwen3-MoE (written by its compressors, every fused
    group sharing its global scale): weight-only, W4A4 (per-expert activation scales, as llm-compressor
    calibrates them), and one with its routers quantized too."""
    pytest.importorskip("compressed_tensors")
    from tests import foreign, zoo

    root = tmp_path_factory.mktemp("foreign")
    src = zoo.build("qwen3_moe", root / "bf16")
    shared = _fused(zoo.read_shapes(src))
    out = {"bf16": src}
    for name, kw in (("ct", {}), ("w4a4", {"w4a4": True}),
                     ("router", {"pick": lambda n, s: foreign.default_pick(n, s) or n.endswith("mlp.gate.weight")})):
        out[name] = root / name
        foreign.nvfp4_variant(src, out[name], shared=shared, **kw)
    return out


def _planted(src: Path, dst: Path, edit_tensors=None, edit_config=None) -> Path:
    from safetensors.torch import save_file

    from tests import zoo

    shutil.copytree(src, dst)
    if edit_tensors is not None:
        t = zoo.read_tensors(dst)
        edit_tensors(t)
        assert [p.name for p in zoo.shard_files(dst)] == ["model.safetensors"]
        save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
        (dst / "model.safetensors.index.json").unlink(missing_ok=True)  # (one shard: its index is optional)
    if edit_config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        edit_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("which", ["ct", "w4a4"])
def test_a_clean_compressed_tensors_checkpoint_passes(foreign_ct, which) -> None:
    r = inspect_checkpoint(str(foreign_ct[which]), check_files=True)
    assert r["verdict"] == "ok", r["checks"]["problems"]
    assert r["format"] == "compressed-tensors" and r["scheme"] == "nvfp4"
    assert r["checks"]["manifest"].startswith("not expected") and r["checks"]["engine_config"] == "agrees with the tensors"
    assert r["quantized"] == 2 * (4 + 3 * 4)  # per layer: q/k/v/o and 4 experts' gate/up/down
    if which == "w4a4":  # each expert calibrated on its own: the engines take their max (a warning, not a problem)
        assert r["activations"]["scales"] == "stored"
        assert any("experts:w13 have" in w for w in r["warnings"]), r["warnings"]


E0 = "model.layers.1.mlp.experts.2"


def _scaled(name: str, by: float):
    def edit(t):
        t[name] = t[name] * by
    return edit


def _set(name: str, value: float):
    def edit(t):
        t[name] = torch.full_like(t[name], value)
    return edit


def _drop(name: str):
    def edit(t):
        del t[name]
    return edit


FOREIGN_PLANTS = {
    # gate and up of one expert with different global scales (vLLM takes w1's, TensorRT-LLM refuses)
    "expert gate/up global scales": ("ct", _scaled(f"{E0}.up_proj.weight_global_scale", 2.0), None,
                                     f"fused group {E0}.{{gate_proj,up_proj}} has 2 different global scales"),
    "q/k/v global scales": ("ct", _scaled("model.layers.0.self_attn.v_proj.weight_global_scale", 0.5), None,
                            "fused group model.layers.0.self_attn.{q_proj,k_proj,v_proj} has 2 different"),
    "an expert without its activation scale": ("w4a4", _drop(f"{E0}.down_proj.input_global_scale"), None,
                                               f"{E0}.down_proj: W4A4 layer without an activation scale"),
    "a NaN activation scale": ("w4a4", _set(f"{E0}.gate_proj.input_global_scale", float("nan")), None,
                               f"{E0}.gate_proj.input_global_scale: activation scale [nan] is not finite"),
    "a zero global scale": ("ct", _set("model.layers.0.self_attn.o_proj.weight_global_scale", 0.0), None,
                            "model.layers.0.self_attn.o_proj: global scale [0.0] is not finite and positive"),
    "the ignore list misses a kept linear": ("ct", None, lambda c: c["quantization_config"]["ignore"].remove("lm_head"),
                                             "quantization_config.ignore misses 1 kept 2-D weight(s), e.g. lm_head"),
    "the ignore list names a quantized linear": ("ct", None, lambda c: c["quantization_config"]["ignore"].append(
        f"{E0}.down_proj"), f"quantization_config.ignore names 1 quantized weight(s), e.g. {E0}.down_proj"),
    "a quantized router": ("router", None, None, "model.layers.0.mlp.gate: a MoE router stored in FP4"),
    "block scales of the wrong shape": ("ct", lambda t: t.__setitem__(f"{E0}.down_proj.weight_scale",
                                                                       t[f"{E0}.down_proj.weight_scale"][:, :1].clone()),
                                        None, f"{E0}.down_proj: scale shape [64, 1], expected [64, 2]"),
    "a NaN block scale": ("ct", lambda t: t[f"{E0}.down_proj.weight_scale"].view(torch.uint8).__setitem__(
        (0, 0), 0x7F), None, f"{E0}.down_proj: block scale is NaN (0x7F)"),
}


@pytest.mark.parametrize("plant", list(FOREIGN_PLANTS))
def test_each_engine_breaking_problem_of_a_foreign_checkpoint_is_named(foreign_ct, tmp_path, plant) -> None:
    which, edit_t, edit_c, says = FOREIGN_PLANTS[plant]
    dst = _planted(foreign_ct[which], tmp_path / "bad", edit_t, edit_c)
    r = inspect_checkpoint(str(dst), check_files=True)
    assert r["verdict"] == "failed"
    hits = [p for p in r["checks"]["problems"] if says in p]
    assert len(hits) == 1, r["checks"]["problems"]


def test_a_foreign_checkpoint_fails_with_exit_6_one_line_per_problem(foreign_ct, tmp_path) -> None:
    def two(t):
        _scaled(f"{E0}.up_proj.weight_global_scale", 2.0)(t)
        _drop(f"{E0}.down_proj.input_global_scale")(t)

    dst = _planted(foreign_ct["w4a4"], tmp_path / "bad", two)
    r = CliRunner().invoke(main, ["inspect", str(dst)])
    assert r.exit_code == 6
    lines = [ln.strip() for ln in r.output.splitlines() if ln.strip().startswith("- ")]
    assert len(lines) == 2 and any(f"{E0}.{{gate_proj,up_proj}}" in ln for ln in lines) and \
        any(f"{E0}.down_proj" in ln for ln in lines), r.output


def test_verify_a_foreign_checkpoint_against_its_unquantized_source(foreign_ct) -> None:
    r = inspect_checkpoint(str(foreign_ct["ct"]), verify=str(foreign_ct["bf16"]))
    assert r["verdict"] == "ok", r["checks"]["problems"] + r["verify"]["problems"]
    overall = r["verify"]["overall"]
    assert overall["layers"] == r["quantized"] and 0 < overall["worst_rel_error"] < DEFAULT_MAX_ERROR


def test_a_modelopt_w4a4_checkpoint_without_an_experts_input_scale_fails(tmp_path) -> None:
    """A ModelOpt W4A4 MoE checkpoint (our ModelOpt writer, manifest and card removed: what another tool ships):
    clean, it passes; an expert with no ``input_scale`` (vLLM #45212: NaN) and a bf16 ``weight_scale_2`` fail."""
    from tests import zoo

    src = zoo.build("qwen3_moe", tmp_path / "bf16")
    mo = tmp_path / "mo"
    convert(src, mo, ConvertConfig(device="cpu", format="modelopt", activations="nvfp4", activation_scale="constant"))
    (mo / "fp4convert.json").unlink()
    (mo / "README.md").unlink()
    for name in ("hf_quant_config.json", "config.json"):  # as ModelOpt itself names its checkpoints
        cfg = json.loads((mo / name).read_text())
        (cfg.get("quantization_config") or cfg)["producer"] = {"name": "modelopt", "version": "0.37.0"}
        (mo / name).write_text(json.dumps(cfg))
    r = inspect_checkpoint(str(mo))
    assert r["verdict"] == "ok" and r["format"] == "modelopt", r["checks"]["problems"]
    bad = _planted(mo, tmp_path / "bad", _drop(f"{E0}.gate_proj.input_scale"))
    problems = inspect_checkpoint(str(bad))["checks"]["problems"]
    assert problems == [f"{E0}.gate_proj: W4A4 layer without an activation scale ({E0}.gate_proj.input_scale); "
                        "engines would run it with an uninitialised scale"]

    def bf16(t):
        t[f"{E0}.down_proj.weight_scale_2"] = t[f"{E0}.down_proj.weight_scale_2"].to(torch.bfloat16)

    problems = inspect_checkpoint(str(_planted(mo, tmp_path / "bf16s2", bf16)))["checks"]["problems"]
    assert problems == [f"{E0}.down_proj: global scale is BF16, engines expect F32"]
