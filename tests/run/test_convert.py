"""The converter end to end on small generated checkpoints: outputs, bytes, manifest, safe writes, resume."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import fp4convert
import fp4convert.quantizer.choice as choice
import fp4convert.run.convert as convert_mod
import fp4convert.run.work as work
from fp4convert.numerics import reference as ref
from fp4convert.config import ConvertConfig
from fp4convert.run.convert import convert
from fp4convert.errors import OutputError, PlanError, SourceError
from fp4convert.errors import NonFiniteError
from fp4convert.output.shards import ShardFile

from tests import checkpoints as ck

FUSED = [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"), ("q_a_proj", "kv_a_proj_with_mqa")]


def cfg(**kw) -> ConvertConfig:
    return ConvertConfig(device="cpu", **kw)


def expected_group(name: str) -> str | None:
    """Independent of fp4convert.plan: module prefix + the fused family of the leaf."""
    prefix, _, leaf = name[: -len(".weight")].rpartition(".")
    fam = next((f for f in FUSED if leaf in f), None)
    return f"{prefix}:{fam}" if fam else None


def load_all(root: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(root).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


def tensor_file(root: Path, name: str) -> Path:
    return ck.shard_with(root, name)


def check_against_reference(src: Path, dst: Path, scheme: str, rotate: str | None) -> dict:
    """Every quantized output equals fp4convert.quantize of the source (group amax), kept ones are raw copies."""
    manifest = json.loads((dst / "fp4convert.json").read_text())
    source = load_all(src)
    out = load_all(dst)
    quantized = [n for n, r in manifest["tensors"].items() if r["action"] == "quantize"]
    assert quantized
    amax = {n: (ref.had16(source[n].float()) if rotate else source[n].float()).abs().max() for n in quantized}
    group_amax: dict[str, torch.Tensor] = {}
    for n in quantized:
        g = expected_group(n) or n
        group_amax[g] = torch.maximum(group_amax.get(g, torch.tensor(0.0)), amax[n])
    for n in quantized:
        m = n[: -len(".weight")]
        ga = group_amax[expected_group(n) or n]
        q = fp4convert.quantize(source[n], scheme, rotate=rotate, global_amax=ga if scheme == "nvfp4" else None,
                                scale_layout="swizzled", backend="reference")  # the source of truth
        assert n not in out
        assert out[m + ".weight_packed"].dtype == torch.uint8
        assert torch.equal(out[m + ".weight_packed"], q.packed), n
        assert torch.equal(out[m + ".weight_scale"].view(torch.uint8), q.scale.view(torch.uint8)), n
        if scheme == "nvfp4":
            assert out[m + ".weight_scale"].dtype == torch.float8_e4m3fn
            gs = out[m + ".weight_global_scale"]
            assert gs.dtype == torch.float32 and gs.shape == (1,)
            assert torch.equal(gs, q.global_scale.reshape(1)), n
            assert gs.item() == (torch.tensor(2688.0) / ga).item(), n
            assert manifest["tensors"][n]["global_scale"] == gs.item()
        else:
            assert out[m + ".weight_scale"].dtype == torch.uint8 and m + ".weight_global_scale" not in out
    kept = [n for n, r in manifest["tensors"].items() if r["action"] == "keep"]
    for n in kept:
        src_file = src / manifest["tensors"][n]["source_file"]
        assert ck.tensor_bytes(tensor_file(dst, n), n) == ck.tensor_bytes(src_file, n), n
        _, h_in = ck.header(src_file)
        _, h_out = ck.header(tensor_file(dst, n))
        assert (h_out[n]["dtype"], h_out[n]["shape"]) == (h_in[n]["dtype"], h_in[n]["shape"])
    assert set(out) == set(kept) | {f"{n[:-7]}.{s}" for n in quantized for s in
                                    (("weight_packed", "weight_scale", "weight_global_scale") if scheme == "nvfp4"
                                     else ("weight_packed", "weight_scale"))}
    return manifest


@pytest.fixture(scope="module")
def llama_src(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("llama")
    ck.llama(p, zoo=True)
    return p


@pytest.fixture(scope="module")
def llama_out(llama_src, tmp_path_factory) -> tuple[Path, object]:
    dst = tmp_path_factory.mktemp("out") / "q"
    return dst, convert(llama_src, dst, cfg(max_shard_size=6000))


# --- outputs and bytes -------------------------------------------------------------------------

@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("rotate", [None, "had16"])
def test_llama_bytes_match_reference(llama_src, tmp_path, scheme, rotate) -> None:
    dst = tmp_path / "q"
    res = convert(llama_src, dst, cfg(scheme=scheme, rotate=rotate))
    m = check_against_reference(llama_src, dst, scheme, rotate)
    assert m["scheme"] == scheme and m["rotate"] == rotate
    assert res.plan.summary()["quantized"] == 14
    for name, why in ck.ZOO_REASONS.items():
        assert m["tensors"][name]["action"] == "keep" and why in m["tensors"][name]["reason"]


def test_multi_shard_output_and_split_group(llama_src, llama_out) -> None:
    dst, res = llama_out
    shards = sorted(p.name for p in dst.glob("*.safetensors"))
    n = len(shards)
    assert n >= 3 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    for s in shards:  # a shard over the limit holds a single tensor's outputs
        _, h = ck.header(dst / s)
        h.pop("__metadata__", None)
        size = sum(v["data_offsets"][1] - v["data_offsets"][0] for v in h.values())
        assert size <= 6000 or len({k.rsplit(".weight", 1)[0] for k in h}) == 1
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    on_disk = {k: s for s in shards for k in ck.header(dst / s)[1] if k != "__metadata__"}
    assert index["weight_map"] == on_disk  # the index maps every tensor, correctly
    assert index["metadata"]["total_size"] == res.plan.summary()["bytes_out"]
    # Some fused group has members in different output shards (and in different source shards).
    split = [g for g, members in res.plan.groups.items()
             if len({index["weight_map"][m[:-7] + ".weight_packed"] for m in members
                     if m[:-7] + ".weight_packed" in index["weight_map"]}) > 1]
    assert split
    check_against_reference(llama_src, dst, "nvfp4", None)
    # The group split across the SOURCE shard boundary shares one scale.
    gs = {p: load_all(dst)[f"model.layers.0.self_attn.{p}.weight_global_scale"].item() for p in ("q_proj", "k_proj", "v_proj")}
    assert len(set(gs.values())) == 1


def test_fused_groups_share_one_global_scale_moe(tmp_path) -> None:
    src = tmp_path / "moe"
    tensors = ck.moe(src, experts=3)
    dst = tmp_path / "q"
    convert(src, dst, cfg())
    m = check_against_reference(src, dst, "nvfp4", None)
    out = load_all(dst)
    pre = "model.layers.0.mlp."
    per_expert = []
    for e in range(3):
        a = max(tensors[pre + f"experts.{e}.{p}_proj.weight"].float().abs().max() for p in ("gate", "up"))
        g = out[pre + f"experts.{e}.gate_proj.weight_global_scale"]
        assert torch.equal(g, out[pre + f"experts.{e}.up_proj.weight_global_scale"])
        assert g.item() == (torch.tensor(2688.0) / a).item()
        per_expert.append(g.item())
    assert len(set(per_expert)) == 3  # one scale per expert, not per layer
    assert torch.equal(out[pre + "shared_expert.gate_proj.weight_global_scale"],
                       out[pre + "shared_expert.up_proj.weight_global_scale"])
    for n in ("mlp.gate.weight", "mlp.shared_expert_gate.weight"):
        assert m["tensors"]["model.layers.0." + n]["action"] == "keep"
        assert "router" in m["tensors"]["model.layers.0." + n]["reason"]
    assert m["tensors"][pre + "experts.0.down_proj.weight"]["action"] == "quantize"


def test_deepseek_mtp_vision_and_mla(tmp_path) -> None:
    src = tmp_path / "ds"
    ck.deepseek(src)
    dst = tmp_path / "q"
    convert(src, dst, cfg())
    m = check_against_reference(src, dst, "nvfp4", None)
    t = m["tensors"]
    for n, r in t.items():
        if n.startswith("model.layers.2."):
            assert r["action"] == "keep", n
            if n.endswith("proj.weight"):
                assert "MTP" in r["reason"]
    assert "vision" in t["model.vision_tower.blocks.0.attn.qkv.weight"]["reason"]
    assert t["model.multi_modal_projector.linear_1.weight"]["action"] == "keep"
    assert t["model.layers.0.self_attn.q_a_proj.weight"]["action"] == "quantize"
    assert t["model.layers.1.block_sparse_moe.experts.1.w1.weight"]["group"] == \
        t["model.layers.1.block_sparse_moe.experts.1.w3.weight"]["group"]


def test_tied_embeddings(tmp_path) -> None:
    src = tmp_path / "tied"
    ck.llama(src, tie=True, single=True)
    dst = tmp_path / "q"
    convert(src, dst, cfg())
    check_against_reference(src, dst, "nvfp4", None)
    out = load_all(dst)
    assert not [k for k in out if k.startswith("lm_head")]
    assert out["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert json.loads((dst / "config.json").read_text())["tie_word_embeddings"] is True
    assert [p.name for p in dst.glob("*.safetensors")] == ["model.safetensors"]


def test_fp32_and_fp16_sources(tmp_path) -> None:
    for dtype in (torch.float32, torch.float16):
        src = tmp_path / str(dtype)
        ck.llama(src, dtype=dtype, layers=1, single=True)
        dst = tmp_path / f"q{dtype}"
        convert(src, dst, cfg())
        check_against_reference(src, dst, "nvfp4", None)


# --- non-weight files, index, manifest ---------------------------------------------------------

def test_other_files_copied(llama_src, llama_out) -> None:
    from fp4convert.formats.base import restore_config

    dst, _ = llama_out
    for rel in ["generation_config.json", *ck.OTHER_FILES]:
        if rel != "README.md":  # README.md becomes the model card, the source's card kept below (tests/output/test_card.py)
            assert (dst / rel).read_bytes() == (llama_src / rel).read_bytes(), rel
    # config.json: the source's, plus the native quantization_config that makes loaders refuse it (tests/formats/test_native_config.py)
    assert restore_config(json.loads((dst / "config.json").read_text())) == json.loads((llama_src / "config.json").read_text())
    names = {p.relative_to(dst).as_posix() for p in dst.rglob("*") if p.is_file()}
    assert not [n for n in names if n.endswith(".partial") or n.startswith(".fp4convert")]


def test_manifest(llama_src, llama_out) -> None:
    import hashlib

    dst, res = llama_out
    m = json.loads((dst / "fp4convert.json").read_text())
    assert m["manifest_version"] == 2 and m["producer"] == {"name": "fp4convert", "version": fp4convert.__version__}
    assert m["format"] == "fp4convert" and m["scheme"] == "nvfp4" and m["rotate"] is None
    assert m["block_size"] == 16 and m["scale_layout"] == "128x4"
    assert m["settings"]["scheme"] == "nvfp4" and m["settings"]["max_shard_size"] == 6000
    assert m["source"]["type"] == "local" and m["source"]["path"] == llama_src.name  # never the absolute path
    assert str(llama_src.parent) not in (dst / "fp4convert.json").read_text()
    names = set()
    for f in llama_src.glob("*.safetensors"):
        start, h = ck.header(f)
        h.pop("__metadata__", None)
        for k, v in h.items():
            names.add(k)
            r = m["tensors"][k]
            assert r["dtype"] == v["dtype"] and r["shape"] == v["shape"] and r["source_file"] == f.name
            assert r["action"] in ("quantize", "keep") and r["reason"]
            for out_name, o in r["outputs"].items():
                _, oh = ck.header(dst / o["file"])
                assert oh[out_name]["dtype"] == o["dtype"] and oh[out_name]["shape"] == o["shape"]
            if r["action"] == "quantize":
                assert r["global_scale"] > 0 and set(r["outputs"]) == {
                    k[:-7] + s for s in (".weight_packed", ".weight_scale", ".weight_global_scale")}
    assert set(m["tensors"]) == names
    on_disk = {p.relative_to(dst).as_posix() for p in dst.rglob("*") if p.is_file()} - {"fp4convert.json"}
    assert set(m["files"]) == on_disk
    for rel, rec in m["files"].items():  # shards: the chunked sha256 (docs/formats.md); other files: sha256
        data = (dst / rel).read_bytes()
        want = ck.chunked_sha256(data) if rel.endswith(".safetensors") else hashlib.sha256(data).hexdigest()
        assert rec == {"chunked_sha256" if rel.endswith(".safetensors") else "sha256": want, "size": len(data)}, rel
    assert m["summary"] == res.plan.summary()


def test_deterministic(llama_src, llama_out, tmp_path) -> None:
    dst, _ = llama_out
    again = tmp_path / "again"
    convert(llama_src, again, cfg(max_shard_size=6000))
    assert ck.all_files(again) == ck.all_files(dst)


# --- destination handling, refusals ------------------------------------------------------------

def test_non_empty_destination_refused_then_overwrite(llama_src, tmp_path) -> None:
    dst = tmp_path / "q"
    dst.mkdir()
    (dst / "mine.txt").write_text("user data")
    with pytest.raises(OutputError, match="not empty"):
        convert(llama_src, dst, cfg())
    assert sorted(p.name for p in dst.iterdir()) == ["mine.txt"]
    convert(llama_src, dst, cfg(overwrite=True, scheme="mxfp4"))
    convert(llama_src, dst, cfg(overwrite=True, max_shard_size=6000))  # fewer/more shards: stale ones go
    check_against_reference(llama_src, dst, "nvfp4", None)
    m = json.loads((dst / "fp4convert.json").read_text())
    assert set(p.name for p in dst.glob("*.safetensors")) == {f for f in m["files"] if f.endswith(".safetensors")}


def test_overwrite_keeps_files_it_did_not_write(llama_src, tmp_path) -> None:
    """--overwrite removes what an earlier conversion wrote, and nothing else; the manifest lists only outputs."""
    dst = tmp_path / "q"
    dst.mkdir()
    (dst / "mine.txt").write_text("user data")
    convert(llama_src, dst, cfg(overwrite=True, scheme="mxfp4"))
    assert "mine.txt" not in json.loads((dst / "fp4convert.json").read_text())["files"]
    convert(llama_src, dst, cfg(overwrite=True))
    assert (dst / "mine.txt").read_text() == "user data"


def test_destination_is_source_refused(llama_src) -> None:
    with pytest.raises(OutputError):
        convert(llama_src, llama_src, cfg(overwrite=True))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[  # cuda: the torch-free path
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp4"])
# up_proj: the second member of a shape group (gate, up), which the GPU quantizes in one launch
@pytest.mark.parametrize("bad", ["model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.up_proj.weight"])
def test_nan_refused_naming_the_tensor(tmp_path, scheme, device, bad) -> None:
    src = tmp_path / "nan"
    ck.nan_checkpoint(src, bad)
    dst = tmp_path / "q"
    with pytest.raises(NonFiniteError, match=bad.replace(".", r"\.")):
        convert(src, dst, ConvertConfig(device=device, scheme=scheme))
    left = [p.name for p in dst.iterdir()] if dst.exists() else []
    assert not [n for n in left if n.endswith((".safetensors", ".partial", ".json"))], left


def test_pickle_only_refused(tmp_path) -> None:
    src = tmp_path / "pkl"
    ck.pickle_only(src)
    with pytest.raises(SourceError, match="pickle.*safetensors"):
        convert(src, tmp_path / "q", cfg())
    assert not (tmp_path / "q").exists()


def test_already_quantized_source_refused(llama_src, llama_out, tmp_path) -> None:
    dst, _ = llama_out
    # Our own output carries no quantization_config, but its names collide with what we would write.
    with pytest.raises(PlanError):
        convert(dst, tmp_path / "q2", cfg())
    src = tmp_path / "ct"
    ck.llama(src, layers=1, single=True)
    c = json.loads((src / "config.json").read_text())
    c["quantization_config"] = {"quant_method": "fp8"}
    (src / "config.json").write_text(json.dumps(c))
    with pytest.raises(PlanError, match="already quantized"):
        convert(src, tmp_path / "q3", cfg())
    assert not (tmp_path / "q3").exists()


# --- crash and resume --------------------------------------------------------------------------

@pytest.mark.parametrize("hard", [False, True])
def test_crash_then_resume(llama_src, llama_out, tmp_path, monkeypatch, hard) -> None:
    ref_dst, _ = llama_out
    dst = tmp_path / "q"
    # one lane of the torch cpu backend (unit by unit): "the first item after a shard is finished" is
    # then one point of the run on every machine (cpu-native batches the small model, and auto lanes
    # grow with the cores: on 16 cores no other shard was open yet at that point)
    c = cfg(max_shard_size=6000, backend="cpu", lanes=1)
    with monkeypatch.context() as mp:
        ck.crash_after_first_shard(mp, dst, hard)
        with pytest.raises(RuntimeError, match="simulated crash"):
            convert(llama_src, dst, c)
    finished = sorted(dst.glob("*.safetensors"))
    assert finished and len(finished) < len(list(ref_dst.glob("*.safetensors")))
    assert not (dst / "fp4convert.json").exists() and not (dst / "model.safetensors.index.json").exists()
    for p in finished:  # whatever looks finished IS finished: identical to the uninterrupted run
        assert p.read_bytes() == (ref_dst / p.name).read_bytes()
    partials = list(dst.glob("*.partial"))
    assert bool(partials) == hard
    mtimes = {p.name: p.stat().st_mtime_ns for p in finished}

    with pytest.raises(OutputError):  # no flag: refused
        convert(llama_src, dst, c)
    with pytest.raises(OutputError, match="other settings"):
        convert(llama_src, dst, cfg(max_shard_size=6000, scheme="mxfp4", resume=True))
    with pytest.raises(OutputError, match="other settings"):
        convert(llama_src, dst, cfg(max_shard_size=6000, ignore=("lm_head",), resume=True))
    res = convert(llama_src, dst, cfg(max_shard_size=6000, resume=True))
    assert res.reused_files == sorted(mtimes)
    assert {p: (dst / p).stat().st_mtime_ns for p in mtimes} == mtimes
    assert ck.all_files(dst) == ck.all_files(ref_dst)


def test_resume_of_a_finished_conversion_reuses_everything(llama_src, llama_out, tmp_path) -> None:
    ref_dst, _ = llama_out
    dst = tmp_path / "q"
    convert(llama_src, dst, cfg(max_shard_size=6000))
    res = convert(llama_src, dst, cfg(max_shard_size=6000, resume=True))
    assert res.reused_files == sorted(p.name for p in ref_dst.glob("*.safetensors"))
    assert ck.all_files(dst) == ck.all_files(ref_dst)


def test_resume_rewrites_a_corrupted_shard(llama_src, llama_out, tmp_path, monkeypatch) -> None:
    ref_dst, _ = llama_out
    dst = tmp_path / "q"
    with monkeypatch.context() as mp:
        ck.crash_after_first_shard(mp, dst)
        with pytest.raises(RuntimeError):
            convert(llama_src, dst, cfg(max_shard_size=6000))
    first = sorted(dst.glob("*.safetensors"))[0]
    raw = bytearray(first.read_bytes())
    raw[-1] ^= 0xFF
    first.write_bytes(bytes(raw))
    res = convert(llama_src, dst, cfg(max_shard_size=6000, resume=True))
    assert first.name not in res.reused_files
    assert ck.all_files(dst) == ck.all_files(ref_dst)


def test_resume_refused_when_source_changed(llama_src, tmp_path, monkeypatch) -> None:
    src = tmp_path / "src"
    ck.llama(src)
    dst = tmp_path / "q"
    with monkeypatch.context() as mp:
        ck.crash_after_first_shard(mp, dst)
        with pytest.raises(RuntimeError):
            convert(src, dst, cfg(max_shard_size=6000))
    ck.llama(src, seed=0, hidden=96)  # other shapes: other headers
    with pytest.raises(OutputError, match="another source"):
        convert(src, dst, cfg(max_shard_size=6000, resume=True))


def test_progress_counts_every_input_byte(llama_src, tmp_path, monkeypatch) -> None:
    seen = ck.progress_seen(monkeypatch)
    res = convert(llama_src, tmp_path / "q", cfg())
    assert sum(seen) == res.plan.summary()["bytes_in"]
    assert res.wall_s > 0 and res.peak_rss_bytes > 10 * 2**20
    j = res.to_json()
    assert j["quantized"] == 14 and j["reused_files"] == []


def test_os_environ_untouched(llama_src, tmp_path) -> None:
    before = dict(os.environ)
    convert(llama_src, tmp_path / "q", cfg())
    assert dict(os.environ) == before


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("scheme,rotate", [("nvfp4", None), ("nvfp4", "had16"), ("mxfp4", None)])
def test_cuda_device_gives_the_same_bytes(llama_src, tmp_path, scheme, rotate) -> None:
    cpu, gpu = tmp_path / "cpu", tmp_path / "gpu"
    convert(llama_src, cpu, cfg(scheme=scheme, rotate=rotate, max_shard_size=6000))
    convert(llama_src, gpu, ConvertConfig(device="cuda", scheme=scheme, rotate=rotate, max_shard_size=6000))
    assert ck.all_files(gpu) == ck.all_files(cpu)
    check_against_reference(llama_src, gpu, scheme, rotate)


def test_hard_crash_before_any_shard_then_resume(llama_src, llama_out, tmp_path, monkeypatch) -> None:
    ref_dst, _ = llama_out
    dst = tmp_path / "q"
    with monkeypatch.context() as mp:
        mp.setattr(work, "quantize", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
        mp.setattr(ShardFile, "abort", lambda self: True)
        # one lane of the torch cpu backend, writes in the calling thread: what is on disk when the first
        # quantize call dies is then the same on every machine (cpu-native's background writes raced it)
        ck.inline_writes(mp)
        with pytest.raises(RuntimeError, match="boom"):
            convert(llama_src, dst, cfg(max_shard_size=6000, backend="cpu", lanes=1))
    assert list(dst.glob("*.partial"))
    finished = sorted(p.name for p in dst.glob("*.safetensors"))  # only the shard of the embedding, kept
    res = convert(llama_src, dst, cfg(max_shard_size=6000, resume=True))
    assert res.reused_files == finished
    assert ck.all_files(dst) == ck.all_files(ref_dst)  # no .partial left behind either


def test_resume_into_a_missing_destination_just_converts(llama_src, llama_out, tmp_path) -> None:
    dst = tmp_path / "new"
    res = convert(llama_src, dst, cfg(max_shard_size=6000, resume=True))
    assert res.reused_files == [] and ck.all_files(dst) == ck.all_files(llama_out[0])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant,rule", [("gpt_oss", "mse"), ("llama4", "4over6"), ("fp8", "max"), ("mxfp4", "max")])
def test_cuda_families_and_inputs_give_the_same_bytes(tmp_path, variant, rule) -> None:
    """Stacked experts (batched per expert part), FP8 and MXFP4 inputs (decoded by the kernels) and the
    search rules: the GPU route writes the CPU route's bytes."""
    from tests import zoo

    family = {"fp8": "deepseek_v3", "mxfp4": "gpt_oss"}.get(variant, variant)
    src = zoo.build(family, tmp_path / "bf16")
    if variant == "fp8":
        zoo.fp8_block_variant(src, tmp_path / "in", block=(128, 128))
        src = tmp_path / "in"
    elif variant == "mxfp4":
        zoo.mxfp4_variant(src, tmp_path / "in")
        src = tmp_path / "in"
    outs = {}
    for device in ("cpu", "cuda"):
        outs[device] = tmp_path / device
        convert(src, outs[device], ConvertConfig(device=device, scale_rule=rule, format="compressed-tensors"))
    assert ck.all_files(outs["cpu"]) == ck.all_files(outs["cuda"])


@pytest.mark.parametrize("world,current,want", [
    (None, 1, 1),  # one process: the current GPU, with its index
    ((3, 4, 3, 4), 0, 1),  # torchrun local rank 3 on 2 visible GPUs: GPU 3 % 2
])
def test_cuda_device_always_has_an_index(monkeypatch, world, current, want) -> None:
    """torch.cuda.set_device and the worker threads refuse a bare 'cuda': resolve_device names the GPU."""
    from fp4convert.run.distributed import World

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    w = World(*world) if world else World()
    for name in ("cuda", "auto"):
        if name == "auto":
            from fp4convert.kernels.cuda import ops

            monkeypatch.setattr(ops, "ensure_loaded", lambda dev: None)
        dev = choice.resolve_device(name, w)
        assert (dev.type, dev.index) == ("cuda", want)
    assert choice.resolve_device("cuda:0", w).index == 0


@pytest.mark.parametrize("backend", ["cpu", "stacked"])
def test_kept_dtype_bf16_for_a_kept_quantized_input(tmp_path, backend) -> None:
    """A kept FP8 input is written as the fp32 weight it encodes; with --kept-dtype bf16 as that weight rounded
    to BF16 (on either torch backend), the other outputs unchanged."""
    from tests import zoo

    exact = zoo.fp8_block_variant(zoo.build("llama", tmp_path / "bf16"), tmp_path / "fp8", block=(128, 128))
    kept = "model.layers.0.self_attn.o_proj.weight"
    c = dict(device="cpu", backend=backend, ignore=("model.layers.0.self_attn.o_proj",))
    convert(tmp_path / "fp8", tmp_path / "a", ConvertConfig(**c))
    convert(tmp_path / "fp8", tmp_path / "b", ConvertConfig(**c, kept_dtype="bf16"))
    a, b = load_all(tmp_path / "a"), load_all(tmp_path / "b")
    assert a[kept].dtype == torch.float32 and torch.equal(a[kept], exact[kept])
    assert b[kept].dtype == torch.bfloat16 and torch.equal(b[kept], exact[kept].to(torch.bfloat16))
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[n], b[n]) for n in a if n != kept)  # the rest of the source was bf16 already
    rec = json.loads((tmp_path / "b" / "fp4convert.json").read_text())["tensors"][kept]
    assert rec["dtype"] == "F32" and rec["outputs"][kept]["dtype"] == "BF16"
    from fp4convert.checkpoint.inspect import inspect_checkpoint

    assert inspect_checkpoint(str(tmp_path / "b"), check_files=True)["ok"]


@pytest.mark.parametrize("device,backend,want", [
    ("cpu", None, "cpu kernel"), ("cpu", "cpu", "cpu kernel"), ("cpu", "cpu-native", "cpu kernel"),
    ("cpu", "stacked", None), ("cpu", "cuda", None),
    ("auto", None, "gpu 0"), ("cuda:1", None, "gpu 1"), ("cuda", "cuda", "gpu 0"),
    ("cuda", "stacked", None), ("cuda", "cpu", None), ("cuda", "cpu-native", None),
])
def test_prewarm_starts_the_device_the_run_will_take(monkeypatch, device, backend, want) -> None:
    """While the source is planned, the device of the backend the run will take starts (its ``prewarm``):
    the CPU kernel for ``cpu``/``cpu-native`` on the CPU, the GPU for ``cuda`` (by name or the default on a
    GPU); nothing for torch's ``stacked``, for a backend that does not run on the device, or under torchrun."""
    import fp4convert.kernels.cpu_lib as cpu_lib
    import fp4convert.kernels.cuda.runtime as runtime
    import fp4convert.output.card as card

    started: list[str] = []
    monkeypatch.setattr(card, "preload", lambda: None)
    monkeypatch.setattr(cpu_lib, "prepare", lambda: started.append("cpu kernel"))
    monkeypatch.setattr(runtime, "prewarm", lambda index: started.append(f"gpu {index}"))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    choice.prewarm_device(ConvertConfig(device=device, backend=backend))
    assert started == ([want] if want else [])
    if want and want.startswith("gpu"):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", "0")
        started.clear()
        choice.prewarm_device(ConvertConfig(device=device, backend=backend))
        assert started == []  # torchrun: each rank's torch starts its own GPU
