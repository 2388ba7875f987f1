"""``--method gptq`` end to end: the sequential pass on the block runner, every architecture class, what
the output and the manifest say, resume, refusals (fp4convert/calibrate/methods/gptq.py, docs/numerics.md "GPTQ")."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from fp4convert.cli.main import main
from fp4convert.calibrate.methods import settings
from fp4convert.config import ConvertConfig
from fp4convert.errors import ConfigError
from tests import tiny_configs, zoo
from tests.calibrate.test_calibrate import TEXT, add_tokenizer


def cli(*args):
    r = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return r


def quantize(src: Path, dst: Path, data: Path, *extra) -> dict:
    r = cli("quantize", src, dst, "--device", "cpu", "--calibration-data", data, "--calibration-samples", 4,
            "--calibration-seq-len", 48, "-q", *extra)
    assert r.exit_code == 0, r.output
    return json.loads((dst / "fp4convert.json").read_text())


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("text") / "calibration.txt"
    p.write_text(TEXT)
    return p


def block_matrices(manifest: dict) -> set[str]:
    """The quantized matrices (plan modules) whose tensor sits in a repeated block (a numbered name part)."""
    out = set()
    for name, rec in manifest["tensors"].items():
        if rec["action"] != "quantize" or not re.search(r"\.\d+\.", name):
            continue
        mats = rec.get("matrices")
        out |= set(mats) if mats else {name[: -len(".weight")] if name.endswith(".weight") else name}
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "gpt_oss", "gemma3", "bert"])
def test_gptq_runs_every_architecture_class_and_says_what_it_quantized(tmp_path, text, family):
    """dense, MoE routed per expert on disk, MoE stacked on disk (3-D experts), a VLM's text decoder, an
    encoder: every quantized matrix of the blocks is GPTQ's (none left to round-to-nearest), the
    manifest records the pass and its settings, and the bytes differ from the data-free run's."""
    src = add_tokenizer(zoo.build(family, tmp_path / family))
    m = quantize(src, tmp_path / "gptq", text, "--method", "gptq")
    rec = m["method"]
    assert rec["method"] == "gptq" and rec["rtn"] == [] and rec["device"] == "cpu" and rec["target"] == "inputs"
    assert m["settings"]["method"] == {"name": "gptq", "damp": 0.01, "block": 128, "act_order": True,
                                       "true_sequential": True, "calibration": {"data": str(text), "samples": 4, "seq_len": 48, "seed": 0}}
    assert rec["quantized"] >= len(block_matrices(m)) > 0
    assert rec["calibration"]["data"]["source"] == "file"
    r = quantize(src, tmp_path / "rtn", text)
    assert "method" not in r and "method" not in r["settings"]
    differ = [f for f, v in m["files"].items() if f.endswith(".safetensors") and v["chunked_sha256"] != r["files"][f]["chunked_sha256"]]
    assert differ


@pytest.mark.parametrize("model_type", ["lfm2"])
@pytest.mark.parametrize("extra", [(), ("--activations", "nvfp4", "--format", "compressed-tensors")],
                         ids=["weights", "w4a4-smoothed"])
def test_gptq_runs_a_hybrid_attention_ssm_decoder(tmp_path, text, model_type, extra):
    """Weight-only, and W4A4 with its default smoothing (norms of other forms, or read by more than the
    quantized linears, are left alone; the ones it folds are listed)."""
    out = tiny_configs.build(model_type, tmp_path)
    if not out.ok:
        pytest.skip(f"{model_type}: tiny build failed ({out.error})")
    src = add_tokenizer(Path(out.path))
    m = quantize(src, tmp_path / "gptq", text, "--method", "gptq", *extra)
    assert m["method"]["rtn"] == [] and m["method"]["quantized"] > 0
    if extra:
        assert m["method"]["smooth"] == 0.5 and isinstance(m["method"]["smoothed"], dict)


def logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    import transformers as tf

    kw = {}
    if (path / "fp4convert.json").exists():
        kw["quantization_config"] = tf.CompressedTensorsConfig(dequantize=True)
    model = tf.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **kw).float().eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def kl(base: torch.Tensor, q: torch.Tensor) -> float:
    p = torch.log_softmax(base, -1)
    return float((p.exp() * (p - torch.log_softmax(q, -1))).sum(-1).mean())


@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp4"])
def test_gptq_output_loads_in_transformers_and_is_closer_to_the_model_than_round_to_nearest(tmp_path, text, scheme):
    """The real consumer (transformers + compressed-tensors) loads the GPTQ checkpoint, and on the
    calibration text its next-token distribution is closer (mean KL) to the unquantized model's than the
    data-free conversion's, at the same scale rule."""
    src = add_tokenizer(zoo.build("llama", tmp_path / "llama", dtype=torch.float32))
    common = ("--scheme", scheme, "--format", "compressed-tensors", "--scale-rule", "mse")
    quantize(src, tmp_path / "gptq", text, "--method", "gptq", *common)
    quantize(src, tmp_path / "rtn", text, *common)
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(str(src))
    ids = tok(TEXT[:400], return_tensors="pt").input_ids[:, :96]
    base = logits(src, ids)
    assert kl(base, logits(tmp_path / "gptq", ids)) < kl(base, logits(tmp_path / "rtn", ids))


@pytest.mark.parametrize("extra", [(), ("--activations", "nvfp4", "--format", "compressed-tensors", "--smooth", "0.5")],
                         ids=["weights", "w4a4-smoothed"])
def test_resume_after_an_interruption_does_not_run_gptq_again(tmp_path, text, monkeypatch, extra):
    """The pass's result (the quantized matrices) is kept: a Ctrl-C while writing, then --resume, writes
    the same bytes as an uninterrupted run, without running the model again; the kept matrices are
    removed once written."""
    from fp4convert.calibrate.methods import gptq as gptq_mod
    from fp4convert.calibrate.resume import keep_dir
    from fp4convert.run import work

    src = add_tokenizer(zoo.build("llama", tmp_path / "llama"))
    clean = quantize(src, tmp_path / "clean", text, "--method", "gptq", "--max-shard-size", "20KB", *extra)
    assert not list(keep_dir().glob("*.gptq"))  # written: removed
    calls = {"n": 0}
    real = work.write_result

    def stop_once(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(work, "write_result", stop_once)
    r = cli("quantize", src, tmp_path / "out", "--device", "cpu", "--calibration-data", text, "--calibration-samples", 4,
            "--calibration-seq-len", 48, "-q", "--method", "gptq", "--max-shard-size", "20KB", *extra)
    assert r.exit_code != 0
    monkeypatch.setattr(work, "write_result", real)

    def no_model(*a, **kw):
        raise AssertionError("GPTQ ran again on --resume")

    monkeypatch.setattr(gptq_mod.GPTQ, "run", no_model)
    resumed = quantize(src, tmp_path / "out", text, "--method", "gptq", "--max-shard-size", "20KB", "--resume", *extra)
    assert resumed["method"] == clean["method"]
    shards = {f: v["chunked_sha256"] for f, v in clean["files"].items() if f.endswith(".safetensors")}
    assert len(shards) > 1
    assert {f: resumed["files"][f]["chunked_sha256"] for f in shards} == shards


@pytest.mark.parametrize("kwargs,match", [
    ({"method": {}, "input_weights": "random"}, "does not apply to --method gptq"),
    ({"method": {"block": 48}}, "multiple of 32"),
    ({"method": {"damp": 0.0}}, r"\(0, 10\]"),
    ({"method": {"smooth": 0.5}}, "applies to W4A4 GPTQ only"),
    ({"method": {"smooth": 0.5}, "activations": "nvfp4", "format": "compressed-tensors", "rotate": "had16"},
     "drop one"),
    ({"method": "gptq"}, "give a calibrated method's settings"),
])
def test_settings_that_cannot_apply_are_refused(kwargs, match):
    if isinstance(kwargs.get("method"), dict):
        kwargs = {**kwargs, "method": settings("gptq", **kwargs["method"])}
    with pytest.raises(ConfigError, match=match):
        ConvertConfig(**kwargs)


@pytest.mark.parametrize("args,match", [
    (["--act-order"], "--act-order / --no-act-order applies to --method gptq only"),
    (["--no-true-sequential", "--gptq-damp", "0.1"], "apply to --method gptq only"),
    (["--method", "GPTQ!"], "Invalid value for '--method'"),
])
def test_options_of_another_method_are_refused_on_the_command_line(tmp_path, args, match):
    r = cli("quantize", tmp_path / "src", tmp_path / "dst", *args)
    assert r.exit_code == 2 and match in r.output, r.output


def test_unknown_settings_name_the_method_fields():
    with pytest.raises(ConfigError, match="--method gptq has no setting 'dampening'; its settings: act_order, block"):
        settings("gptq", dampening=0.1)


def test_gptq_defaults_and_identity():
    """rtn's identity is unchanged (no method key); gptq's names its settings and calibration; the rule
    defaults to mse (the search weighted by the Hessian's diagonal), and input weights stay off."""
    gptq = settings("gptq")
    assert "method" not in ConvertConfig().identity() and ConvertConfig().method_settings is None
    c = ConvertConfig(method=gptq)
    s = c.method_settings
    assert c.input_weight_source == "none" and c.rule == "mse" and s.act_order and s.true_sequential
    w4a4 = {"method": gptq, "activations": "nvfp4", "format": "compressed-tensors"}
    assert not ConvertConfig(**w4a4).method_settings.true_sequential
    assert ConvertConfig(**{**w4a4, "method": settings("gptq", true_sequential=True)}).method_settings.true_sequential
    assert not ConvertConfig(method=settings("gptq", true_sequential=False)).method_settings.true_sequential
    assert not ConvertConfig(method=gptq, rotate="had16").method_settings.true_sequential
    assert ConvertConfig(**w4a4).method_settings.smooth == 0.5 and s.smooth == 0.0  # NVFP4 W4A4 only
    assert ConvertConfig(**w4a4).identity()["method"]["smooth"] == 0.5 and "smooth" not in c.identity()["method"]
    assert ConvertConfig(**{**w4a4, "method": settings("gptq", smooth=0.0)}).method_settings.smooth == 0.0
    assert ConvertConfig(**{**w4a4, "method": settings("gptq", smooth=0.25)}).method_settings.smooth == 0.25
    assert ConvertConfig(**w4a4, rotate="had16").method_settings.smooth == 0.0
    assert ConvertConfig(**w4a4, kept_dtype="bf16").method_settings.smooth == 0.0
    assert ConvertConfig(**{**w4a4, "activations": "mxfp4", "scheme": "mxfp4"}).method_settings.smooth == 0.0
    assert not ConvertConfig(method=settings("gptq", act_order=False)).method_settings.act_order
    assert c.identity()["method"] == {"name": "gptq", "damp": 0.01, "block": 128, "act_order": True,
                                      "true_sequential": True, "calibration": c.identity()["method"]["calibration"]}
    assert ConvertConfig(method=gptq, scale_rule="4over6").rule == "4over6"


def _cuda() -> bool:
    try:
        from fp4convert.kernels.cuda import ops

        return ops.available()
    except Exception:  # noqa: BLE001 - no CUDA build of torch
        return False


@pytest.mark.cuda
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU (capability >= 8.9) and nvcc")
@pytest.mark.parametrize("extra", [(), ("--true-sequential",)], ids=["block", "true-sequential"])
def test_gptq_on_the_gpu_is_deterministic_and_matches_the_cpu_at_the_model_level(tmp_path, text, extra):
    """docs/numerics.md "GPTQ": the GPU run is deterministic (two runs, the same bytes); its float
    arithmetic (TF32 Hessians, cuBLAS, the GPU Cholesky) differs from the CPU's, so the checkpoints
    differ in bytes but not in quality: both beat round-to-nearest, and their KLs are within 25%."""
    src = add_tokenizer(zoo.build("llama", tmp_path / "llama", dtype=torch.float32))
    common = ("--format", "compressed-tensors", "--scale-rule", "mse", "--method", "gptq", *extra)

    def run(dst: str, device: str) -> dict:
        r = cli("quantize", src, tmp_path / dst, "--device", device, "--calibration-data", text,
                "--calibration-samples", 4, "--calibration-seq-len", 48, "-q", *common)
        assert r.exit_code == 0, r.output
        return json.loads((tmp_path / dst / "fp4convert.json").read_text())

    a, b, c = run("gpu1", "cuda"), run("gpu2", "cuda"), run("cpu", "cpu")
    assert a["method"]["device"] == "cuda"
    assert {f: v for f, v in a["files"].items() if f.endswith(".safetensors")} == \
        {f: v for f, v in b["files"].items() if f.endswith(".safetensors")}
    quantize(src, tmp_path / "rtn", text, "--format", "compressed-tensors", "--scale-rule", "mse")
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(str(src))
    ids = tok(TEXT[:400], return_tensors="pt").input_ids[:, :96]
    base = logits(src, ids)
    k_gpu, k_cpu, k_rtn = (kl(base, logits(tmp_path / d, ids)) for d in ("gpu1", "cpu", "rtn"))
    assert k_gpu < k_rtn and k_cpu < k_rtn
    assert abs(k_gpu - k_cpu) <= 0.25 * k_cpu
    assert c["method"]["device"] == "cpu"


def test_w4a4_with_a_rotation_calibrates_the_rotated_inputs(tmp_path, text):
    """MR-GPTQ for W4A4: the engine rotates a linear's input before quantizing it, so its static scale
    comes from max|x H|, not max|x| (the input-weight statistics of a weight-only rotation keep max|x|)."""
    from fp4convert.calibrate.stats import Observers
    from fp4convert.numerics.reference import had16

    x = torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(0))
    x[0, 0, 5] = 40.0  # one outlier channel: the rotation spreads it over its 16-block
    rot, plain = Observers(rotate="had16", rotated_amax=True), Observers(rotate="had16", squares=True)
    rot.add("a", x)
    plain.add("a", x)
    assert torch.equal(rot["a"].amax, had16(x).abs().amax().float())
    assert torch.equal(plain["a"].amax, x.abs().amax().float())
    assert rot["a"].amax < plain["a"].amax
    src = add_tokenizer(zoo.build("llama", tmp_path / "llama"))
    m = quantize(src, tmp_path / "mr", text, "--method", "gptq", "--rotate", "had16", "--activations", "nvfp4",
                 "--format", "compressed-tensors")
    qc = json.loads((tmp_path / "mr" / "config.json").read_text())["quantization_config"]
    assert qc["transform_config"] and qc["config_groups"]["group_0"]["input_activations"]["num_bits"] == 4
    assert m["method"]["rtn"] == [] and m["activations"]["calibration"]["amax"]
    assert m["method"]["target"] == "engine-rounded inputs"  # (the W4A4 objective: docs/numerics.md "GPTQ")


def test_resume_refuses_another_method(tmp_path, text):
    """--method is part of what the bytes depend on: resuming a round-to-nearest run with gptq (or back) is refused."""
    src = add_tokenizer(zoo.build("llama", tmp_path / "llama"))
    quantize(src, tmp_path / "out", text)
    r = cli("quantize", src, tmp_path / "out", "--device", "cpu", "--calibration-data", text, "--calibration-samples", 4,
            "--calibration-seq-len", 48, "-q", "--method", "gptq", "--resume")
    assert r.exit_code != 0 and "method" in r.output


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "gpt_oss"])
def test_true_sequential_quantizes_each_input_after_the_linears_before_it(tmp_path, text, family, monkeypatch):
    """--true-sequential: a block's matrices are swept one input at a time in the order the forward feeds
    them (Llama: q/k/v, o, gate/up, down), each later step on the block run again with the earlier steps
    quantized. The first step of the first block sees the same inputs as without (same bytes); the later
    steps see other inputs (other bytes); every matrix is still GPTQ's and the manifest says how."""
    from fp4convert.calibrate.methods.gptq import GPTQ

    src = add_tokenizer(zoo.build(family, tmp_path / family))
    calls: list[list[str]] = []
    real = GPTQ.quantize_targets

    def spy(self, index, mats, disk):
        if index == 0:
            calls.append(sorted(m.module.split(".layers.0.", 1)[-1] for _d, m, _w, _p in mats))
        return real(self, index, mats, disk)

    monkeypatch.setattr(GPTQ, "quantize_targets", spy)
    plain = quantize(src, tmp_path / "plain", text, "--method", "gptq", "--no-true-sequential")
    if family == "qwen3_moe":  # the block's linears at once, then its streamed experts by group (gate/up, down)
        assert calls[0] == sorted(f"self_attn.{p}_proj" for p in "qkvo") and len(calls) >= 3
    else:
        assert len(calls) == 1
    calls.clear()
    seq = quantize(src, tmp_path / "seq", text, "--method", "gptq", "--true-sequential")
    assert seq["method"]["true_sequential"] is True and plain["method"]["true_sequential"] is False
    assert seq["settings"]["method"]["true_sequential"] is True
    assert "true-sequential" in seq["method"]["description"]
    assert seq["method"]["rtn"] == [] and seq["method"]["quantized"] == plain["method"]["quantized"]
    assert len(set(sum(calls, []))) == len(sum(calls, []))  # (each matrix in one step)
    attention = [[f"self_attn.{p}_proj" for p in "kqv"], ["self_attn.o_proj"]]
    if family == "llama":
        assert calls == [*attention, ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]
    elif family == "qwen3_moe":  # a streamed stack: per expert group, its gate/up, then its down on their outputs
        assert calls[:2] == attention and len(calls) > 2 and len(calls) % 2 == 0
        for gate_up, down in zip(calls[2::2], calls[3::2]):
            experts = {n.split(".")[2] for n in gate_up}
            assert gate_up and all(n.endswith(("gate_proj", "up_proj")) for n in gate_up)
            assert down and all(n.endswith("down_proj") and n.split(".")[2] in experts for n in down)
    else:  # 3-D experts on disk (not streamed): every expert's down projection in one step, after their gate/up
        assert 3 <= len(calls) <= 4
        assert all("down" in n for n in calls[-1]) and not any("down" in n for c in calls[:-1] for n in c)
    a, b = _tensors(tmp_path / "plain"), _tensors(tmp_path / "seq")
    assert a.keys() == b.keys()
    first = [k for k in a if ".layers.0." in k and any(p in k for p in ("q_proj", "k_proj", "v_proj"))]
    later = [k for k in a if ".layers.0." in k and any(p in k for p in ("o_proj", "down_proj"))]
    assert first and later
    assert all(torch.equal(a[k], b[k]) for k in first)
    assert any(not torch.equal(a[k], b[k]) for k in later)


@pytest.mark.slow
def test_gptq_bytes_do_not_depend_on_the_cpu_thread_count(tmp_path):
    """issue 42 item 5: the same GPTQ command on a MoE gives the same bytes with 1 and 2 torch threads (its
    reductions, matmuls and Hessian sums are split by rows, never across a sum); the manifest records what the
    bytes do depend on (the device kind and the torch build)."""
    import transformers as tf

    cfg = tf.Qwen3MoeConfig(vocab_size=128, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8,
                            num_experts_per_tok=2, max_position_embeddings=512)
    torch.manual_seed(0)
    tf.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(tmp_path / "src"))
    src = add_tokenizer(tmp_path / "src")
    text = tmp_path / "t.txt"
    text.write_text(TEXT * 8)
    saved = torch.get_num_threads()
    out = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            m = quantize(src, tmp_path / f"t{threads}", text, "--method", "gptq", "--calibration-samples", 8,
                         "--calibration-seq-len", 128)
            out[threads] = (_tensors(tmp_path / f"t{threads}"), m)
    finally:
        torch.set_num_threads(saved)
    (one, m1), (two, m2) = out[1], out[2]
    assert one.keys() == two.keys() and len(one) > 100
    assert [k for k in one if not torch.equal(one[k].view(torch.uint8), two[k].view(torch.uint8))] == []
    assert m1["method"]["numerics"] == m2["method"]["numerics"]
    assert m1["method"]["numerics"]["device"].startswith("cpu") and m1["method"]["numerics"]["torch"] == torch.__version__
