"""``inspect``: summary of converted outputs, corruption detected, ``--verify`` against the source."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner

from fp4convert.cli import main
from fp4convert.config import ConvertConfig
from fp4convert.convert import convert
from fp4convert.inspect import inspect_checkpoint

from . import checkpoints as ck


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
        out[scheme] = (dst, convert(src, dst, ConvertConfig(device="cpu", scheme=scheme, max_shard_size=20000)))
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
    assert r["ok"] and r["checks"]["problems"] == []
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
    assert "format fp4convert, scheme nvfp4" in r.stdout and "checks: OK" in r.stdout
    assert f"{res.plan.summary()['quantized']} quantized weights" in r.stdout
    assert "model.layers.1" in r.stdout
    r = CliRunner().invoke(main, ["inspect", str(dst), "--json"])
    j = json.loads(r.stdout)
    assert j["ok"] is True and j["quantized"] == res.plan.summary()["quantized"]


def test_unquantized_checkpoint(src) -> None:
    r = inspect_checkpoint(str(src))
    assert r["format"] == "unquantized" and r["quantized"] == 0 and r["kept"] > 0


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
    assert set(v) == {n[:-7] for n, d in res.plan.by_name.items() if d.action == "quantize"}
    for m, e in v.items():
        assert 0.09 <= e["rel_error"] <= 0.11, (m, e)  # NVFP4 on Gaussian weights: ~0.095
        assert 19.0 <= e["snr_db"] <= 21.0, (m, e)
    out = CliRunner().invoke(main, ["inspect", str(dst), "--verify", str(src)])
    assert out.exit_code == 0 and "rel.err 0.09" in out.stdout and "SNR 20." in out.stdout
    j = json.loads(CliRunner().invoke(main, ["inspect", str(dst), "--verify", str(src), "--json"]).stdout)
    assert j["verify"].keys() == v.keys()


def test_verify_with_rotation(src, tmp_path) -> None:
    dst = tmp_path / "had"
    convert(src, dst, ConvertConfig(device="cpu", rotate="had16", only=("*.experts.*",)))
    r = inspect_checkpoint(str(dst), verify=str(src))
    assert r["rotate"] == "had16" and r["ok"]
    for m, e in r["verify"].items():
        assert 0.08 <= e["rel_error"] <= 0.12 and 18.5 <= e["snr_db"] <= 22.0, (m, e)


def test_verify_against_the_wrong_source_shows_it(converted, tmp_path) -> None:
    other = tmp_path / "other"
    ck.moe(other, experts=2, shards=1, seed=9)
    r = inspect_checkpoint(str(converted["nvfp4"][0]), verify=str(other))
    assert all(e["rel_error"] > 0.5 for e in r["verify"].values())
