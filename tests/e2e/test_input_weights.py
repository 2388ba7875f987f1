"""``--input-weights``: the converter's input-weighted scale rules end to end (docs/numerics.md "Input weights").

What the converter writes with input weights equals the reference quantizer given the same weights (raw
bytes), on every CPU schedule; the weights are the layer-by-layer mean squares recorded (source, shape,
seed, digest) in the manifest's identity, so ``--resume`` refuses other weights; models the layer-by-layer
run cannot run are refused for an explicit source and converted unweighted by ``auto``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import fp4convert.run.convert as convert_mod
from fp4convert import calibrate
from fp4convert.numerics import reference as ref
from fp4convert.cli.main import main
from fp4convert.config import ConvertConfig
from fp4convert.run.convert import convert, plan_conversion
from fp4convert.errors import OutputError

from tests import checkpoints as ck
from tests.run.test_convert import expected_group, load_all

SHAPE = dict(calibration_samples=3, calibration_seq_len=16)  # small random-token pass


def gains_llama(path: Path, layers: int = 2, seed: int = 0) -> Path:
    """A Llama whose norm gains spread over two orders of magnitude, as trained models' do (the
    mean squares of the linear inputs then differ by channel, and the weighting changes scales)."""
    cfg = ck.llama_config(64, layers)
    t = ck.llama_tensors(cfg, seed)
    g = torch.Generator().manual_seed(seed + 11)
    for n in t:
        if n.endswith("layernorm.weight"):
            t[n] = torch.exp(2.0 * torch.randn(t[n].shape, generator=g)).to(t[n].dtype)
    ck.write(path, t, cfg, [list(t)])
    return path


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return gains_llama(tmp_path_factory.mktemp("iw") / "src")


def weights_of(src: Path, config: ConvertConfig) -> tuple[dict, dict]:
    """What the layer-by-layer stage gives for ``config`` (module -> InputWeight, record)."""
    source, plan, _ = plan_conversion(str(src), config)
    st = calibrate.statistics(source, plan, config, "cpu")
    assert st.input_weights is not None and st.input_weight_record is not None
    return st.input_weights, st.input_weight_record


def check_weighted_output(src: Path, dst: Path, config: ConvertConfig) -> int:
    """Every quantized tensor of ``dst`` (compressed-tensors) equals the reference quantizer with the
    stage's input weight and the fused group's amax; returns how many tensors the weights changed
    against the unweighted rule."""
    weights, _ = weights_of(src, config)
    manifest = json.loads((dst / "fp4convert.json").read_text())
    source, out = load_all(src), load_all(dst)
    quantized = [n for n, r in manifest["tensors"].items() if r["action"] == "quantize"]
    assert len(quantized) == 14  # 7 linears x 2 layers (lm_head kept)
    group_amax: dict[str, torch.Tensor] = {}
    for n in quantized:
        g = expected_group(n) or n
        group_amax[g] = torch.maximum(group_amax.get(g, torch.tensor(0.0)), source[n].float().abs().max())
    rule, changed = config.rule, 0
    for n in quantized:
        m = n[: -len(".weight")]
        iw = torch.frombuffer(bytearray(weights[m].data), dtype=torch.float32)
        assert iw.shape == (source[n].shape[1],)
        x = source[n]
        if config.scheme == "nvfp4":
            p, s, _ = ref.nvfp4_quantize(x, group_amax[expected_group(n) or n], None, rule, input_weight=iw)
            p0, s0, _ = ref.nvfp4_quantize(x, group_amax[expected_group(n) or n], None, rule)
        else:
            p, s = ref.mxfp4_quantize(x, None, rule, input_weight=iw)
            p0, s0 = ref.mxfp4_quantize(x, None, rule)
        assert torch.equal(out[m + ".weight_packed"], p), n
        assert torch.equal(out[m + ".weight_scale"].view(torch.uint8), s.view(torch.uint8)), n
        changed += not torch.equal(s.view(torch.uint8), s0.view(torch.uint8))
    return changed


@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp4"])
def test_weighted_output_equals_the_reference_with_the_recorded_weights(src, tmp_path, scheme) -> None:
    c = ConvertConfig(device="cpu", scheme=scheme, format="compressed-tensors", input_weights="random", **SHAPE)
    assert c.rule == "mse"  # the rule with weights when none is asked for
    convert(src, tmp_path / "q", c)
    assert check_weighted_output(src, tmp_path / "q", c) >= 7  # the weights change most tensors' scales
    # and the output is not the unweighted mse rule's
    convert(src, tmp_path / "u", ConvertConfig(device="cpu", scheme=scheme, format="compressed-tensors",
                                               scale_rule="mse", input_weights="none"))
    assert ck.all_files(tmp_path / "q")["model.safetensors"] != ck.all_files(tmp_path / "u")["model.safetensors"]


def test_fused_members_share_one_weight_and_other_modules_their_own(src) -> None:
    weights, record = weights_of(src, ConvertConfig(device="cpu", input_weights="random", **SHAPE))
    for i in range(2):
        p = f"model.layers.{i}."
        q, k, v = (weights[p + f"self_attn.{x}_proj"] for x in "qkv")
        assert q is k is v and q.key in {p + f"self_attn.{x}_proj" for x in "qkv"}  # one input, one weight
        assert weights[p + "mlp.gate_proj"] is weights[p + "mlp.up_proj"]
        assert weights[p + "self_attn.o_proj"].data != q.data
        assert weights[p + "mlp.down_proj"].k == 128
    assert record["weighted"] == 14 and record["unweighted"] == []


@pytest.mark.parametrize("schedule", ["stacked-1", "stacked-64", "row-slices", "sync"])
def test_every_cpu_schedule_writes_the_same_weighted_bytes(src, tmp_path, monkeypatch, schedule) -> None:
    """The stacked backend (the CUDA scheduling on the CPU) cuts a shape group into runs of one input
    weight (q/k/v and o_proj share a shape here but not a weight): the cpu backend's bytes."""
    from tests.run.test_pipeline import run

    want = run(src, tmp_path / "cpu", "default", monkeypatch, input_weights="random", **SHAPE)
    assert run(src, tmp_path / schedule, schedule, monkeypatch, input_weights="random", **SHAPE) == want


def test_the_identity_records_the_weights(src, tmp_path) -> None:
    c = ConvertConfig(device="cpu", input_weights="random", calibration_seed=5, **SHAPE)
    convert(src, tmp_path / "q", c)
    identity = json.loads((tmp_path / "q" / "fp4convert.json").read_text())["identity"]
    assert identity["settings"]["input_weights"] == {"source": "random", "samples": 3, "seq_len": 16, "seed": 5}
    rec = identity["input_weights"]
    weights, want = weights_of(src, c)
    assert rec == json.loads(json.dumps(want))
    assert rec["source"] == "random" and rec["samples"] == 3 and rec["seq_len"] == 16 and rec["seed"] == 5
    assert rec["vocab_size"] == 96 and rec["weighted"] == 14 and len(rec["sha256"]) == 64
    # the seed changes the weights, hence the digest
    _, other = weights_of(src, ConvertConfig(device="cpu", input_weights="random", calibration_seed=6, **SHAPE))
    assert other["sha256"] != rec["sha256"]
    # unweighted conversions record nothing (their identity is unchanged)
    convert(src, tmp_path / "n", ConvertConfig(device="cpu", input_weights="none"))
    plain = json.loads((tmp_path / "n" / "fp4convert.json").read_text())["identity"]
    assert "input_weights" not in plain and "input_weights" not in plain["settings"]


def test_resume_refuses_other_input_weights(tmp_path, monkeypatch) -> None:
    src = tmp_path / "src"
    cfg = ck.llama_config(64, 3)
    t = ck.llama_tensors(cfg, 0)
    ck.write(src, t, cfg, [[n for n in t if ".layers.0." in n or "embed" in n],
                           [n for n in t if not (".layers.0." in n or "embed" in n)]])
    dst = tmp_path / "q"
    c = dict(device="cpu", input_weights="random", max_shard_size=6000, **SHAPE)
    with monkeypatch.context() as mp:
        ck.crash_after_first_shard(mp, dst)
        with pytest.raises(RuntimeError, match="simulated crash"):
            convert(src, dst, ConvertConfig(**c))
    assert list(dst.glob("*.safetensors")) and not (dst / "fp4convert.json").exists()
    with pytest.raises(OutputError, match="other settings.*input_weights"):
        convert(src, dst, ConvertConfig(**{**c, "input_weights": "none"}, resume=True))
    with pytest.raises(OutputError, match="other settings.*seed"):
        convert(src, dst, ConvertConfig(**c, calibration_seed=1, resume=True))
    # same settings, other measured weights (another torch, say): the digest differs, refused
    from fp4convert.calibrate import resume, stage

    real = stage.input_weights_for

    def skewed(plan, mean_square, described, rotate=None):
        return real(plan, {k: v * 2 for k, v in mean_square.items()}, described, rotate)

    with monkeypatch.context() as mp:
        mp.setattr(stage, "input_weights_for", skewed)
        mp.setattr(resume, "load", lambda k: None)  # measured again, not the interrupted run's kept result
        mp.setattr(resume, "save", lambda k, st: None)
        with pytest.raises(OutputError, match="input_weights was"):
            convert(src, dst, ConvertConfig(**c, resume=True))
    # the interrupted run's statistics are kept: the resume does not run the model again
    with monkeypatch.context() as mp:
        def no_run(*a, **kw):
            raise AssertionError("the resume ran the model again")
        mp.setattr(calibrate.LayerwiseModel, "observe", no_run)
        convert(src, dst, ConvertConfig(**c, resume=True))
    convert(src, tmp_path / "whole", ConvertConfig(**c))
    assert ck.all_files(dst) == ck.all_files(tmp_path / "whole")


def cli(*args):
    return CliRunner().invoke(main, ["quantize", *[str(a) for a in args], "--device", "cpu"])


def test_explicit_sources_refuse_a_model_that_cannot_run(tmp_path) -> None:
    """random / calibration name a model run: a model without one is refused (exit 2) before anything is written."""
    noconf = tmp_path / "noconf"
    t = ck.llama_tensors(ck.llama_config(64, 1))
    ck.write(noconf, t, ck.llama_config(64, 1))
    (noconf / "config.json").unlink()
    r = cli(noconf, tmp_path / "o1", "--input-weights", "random", "--allow-no-config")
    assert r.exit_code == 2 and "config.json" in r.output and not (tmp_path / "o1").exists()
    moe = tmp_path / "moe"
    ck.moe(moe)
    r = cli(moe, tmp_path / "o2", "--input-weights", "random")
    # a MoE runs now, but this hand-made checkpoint lacks the q/k/v biases Qwen2-MoE's attention has
    assert r.exit_code == 2 and "q_proj.bias" in r.output and "--input-weights none" in r.output
    assert not (tmp_path / "o2").exists()
    plain = tmp_path / "plain"
    ck.llama(plain, layers=1)  # its tokenizer.json is a stub that does not load
    r = cli(plain, tmp_path / "o3", "--input-weights", "calibration")
    assert r.exit_code == 2 and "tokenizer does not load" in r.output and not (tmp_path / "o3").exists()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (plain / f).unlink()  # no tokenizer: random ids need none, calibration text does
    r = cli(plain, tmp_path / "o3", "--input-weights", "calibration")
    assert r.exit_code == 2 and "no tokenizer" in r.output and not (tmp_path / "o3").exists()
    r = cli(plain, tmp_path / "o4", "--input-weights", "random", "--calibration-samples", 2,
            "--calibration-seq-len", 8)
    assert r.exit_code == 0, r.output
    r = cli(plain, tmp_path / "o5", "--input-weights", "random", "--scale-rule", "max")
    assert r.exit_code == 2 and "no search" in r.output


def test_weighted_conversion_is_deterministic(src, tmp_path) -> None:
    c = ConvertConfig(device="cpu", scheme="mxfp4", input_weights="random", **SHAPE)
    convert(src, tmp_path / "a", c)
    convert(src, tmp_path / "b", c)
    assert ck.all_files(tmp_path / "a") == ck.all_files(tmp_path / "b")


def test_no_model_run_without_input_weights(src, tmp_path, monkeypatch) -> None:
    """``--input-weights none`` (and every W4A16 conversion that resolves to none) never builds the model."""
    def boom(*a, **kw):
        raise AssertionError("the model was run")

    monkeypatch.setattr(calibrate, "LayerwiseModel", boom)
    convert(src, tmp_path / "q", ConvertConfig(device="cpu", input_weights="none"))
    assert convert_mod is not None


def test_auto_weights_only_from_the_w4a4_calibration_pass(tmp_path) -> None:
    """``auto`` (the default): W4A4 NVFP4 with calibrated scales weights the weight rule by the same
    pass's mean squares (rule mse unless one is asked for); every other conversion runs no model and
    writes the unweighted bytes, so a model the layer-by-layer run cannot run (no config.json, a family
    it does not run, no tokenizer) converts as before."""
    from tests import zoo
    from tests.calibrate.test_calibrate import TEXT, add_tokenizer

    llama = add_tokenizer(zoo.build("llama", tmp_path / "llama"))
    data = tmp_path / "calib.txt"
    data.write_text(TEXT)
    r = cli(llama, tmp_path / "w4a4", "--format", "compressed-tensors", "--activations", "nvfp4",
            "--calibration-data", data, "--calibration-samples", 2, "--calibration-seq-len", 16)
    assert r.exit_code == 0, r.output
    m = json.loads((tmp_path / "w4a4" / "fp4convert.json").read_text())
    rec = m["identity"]["input_weights"]
    assert rec["source"] == "calibration" and rec["samples"] == 2 and rec["seq_len"] == 16
    assert rec["data"]["name"] == "calib.txt" and rec["weighted"] == 14
    assert m["identity"]["settings"]["scale_rule"] in (None, "mse") and m["scale_rule"] == "mse"
    # constant activation scale: no pass, no weights, the scheme's default rule
    r = cli(llama, tmp_path / "const", "--format", "compressed-tensors", "--activations", "nvfp4",
            "--activation-scale", "constant")
    assert r.exit_code == 0, r.output
    m = json.loads((tmp_path / "const" / "fp4convert.json").read_text())
    assert "input_weights" not in m["identity"] and m["scale_rule"] == "4over6"
    # W4A16 on models the stage cannot run: converted unweighted, exit 0
    noconf = tmp_path / "noconf"
    ck.llama(noconf, layers=1)
    (noconf / "config.json").unlink()
    moe = tmp_path / "moe"
    ck.moe(moe)
    for name, path, extra in (("noconf", noconf, ["--allow-no-config"]), ("moe", moe, []), ("plain", llama, [])):
        r = cli(path, tmp_path / f"o-{name}", *extra)
        assert r.exit_code == 0, (name, r.output)
        m = json.loads((tmp_path / f"o-{name}" / "fp4convert.json").read_text())
        assert "input_weights" not in m["identity"] and m["scale_rule"] == "4over6", name
