"""W4A4 GPTQ's smoothing (``--smooth``, fp4convert/calibrate/smooth.py, docs/numerics.md "GPTQ"):
the factors, their fold into a norm (plain and ``1 + w`` norms, found by running them), and a conversion
whose quantized linears carry the factors its norms give up."""

from __future__ import annotations

import json

import pytest
import torch

from fp4convert.calibrate.smooth import RANGE, fold, scales
from fp4convert.config import ConvertConfig
from fp4convert.errors import ConfigError
from tests import zoo
from tests.calibrate.test_calibrate import TEXT, add_tokenizer
from tests.calibrate.test_gptq import _tensors, cli


def test_scales_are_smoothquants_normalised_and_leave_dead_channels_alone():
    x = torch.tensor([4.0, 1.0, 0.0, 9.0])
    w = torch.tensor([1.0, 4.0, 2.0, 0.0])
    s = scales(x, w, 0.5)
    raw = (x[:2] ** 0.5) / (w[:2] ** 0.5)
    assert torch.allclose(s[:2], raw / torch.exp(torch.log(raw).mean()))
    assert s[2] == 1 and s[3] == 1  # (an input or a weight column that is all zeros)
    assert torch.allclose(torch.exp(torch.log(s[:2]).mean()), torch.tensor(1.0))
    big = scales(torch.tensor([1e30, 1e-30]), torch.ones(2), 1.0 - 1e-9)
    assert float(big.max()) == RANGE and float(big.min()) == 1 / RANGE


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fold_divides_the_norm_output_by_the_factor_it_reports(kind, dtype):
    """w / s for a plain RMSNorm, (1 + w) / s - 1 for Gemma's (1 + w) norm, rounded to the checkpoint's
    dtype; the reported factor is what the rounded weight gives (s up to that rounding)."""
    import transformers as tf

    k = 64
    norm = (tf.models.llama.modeling_llama.LlamaRMSNorm(k) if kind == "llama"
            else tf.models.gemma3.modeling_gemma3.Gemma3RMSNorm(k))
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(k, generator=g) * 0.3 + (1.0 if kind == "llama" else 0.0)).to(dtype).float()
    s = torch.exp(torch.randn(k, generator=g))
    got = fold(norm, w, s, dtype)
    assert got is not None
    new, eff, offset = got
    assert offset == (kind == "gemma3")
    assert torch.equal(new, new.to(dtype).float())
    x = torch.randn(5, k, generator=g)
    from torch.func import functional_call

    y = functional_call(norm, {"weight": w}, (x,))
    y2 = functional_call(norm, {"weight": new}, (x,))
    torch.testing.assert_close(y2 * eff, y, rtol=1e-5, atol=1e-6)
    tol = 2.0 ** -7 if dtype == torch.bfloat16 else 1e-6
    assert float(((eff - s) / s).abs().max()) < 4 * tol * float(s.max() / s.min())


def test_fold_refuses_a_norm_with_a_bias():
    assert fold(torch.nn.LayerNorm(16), torch.ones(16), torch.full((16,), 2.0), torch.float32) is None


def test_fold_refuses_a_norm_that_takes_more_than_its_input():
    """A gated norm (Mamba's ``norm(x, gate)``) or any other form it cannot run on the input alone."""

    class GatedNorm(torch.nn.Module):
        def __init__(self, k: int) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(k))

        def forward(self, x, gate):
            return x * torch.sigmoid(gate) * self.weight

    assert fold(GatedNorm(16), torch.ones(16), torch.full((16,), 2.0), torch.float32) is None


@pytest.mark.parametrize("kwargs,match", [
    ({}, "W4A4 GPTQ only"),
    ({"smooth": 1.5, "activations": "nvfp4", "format": "compressed-tensors"}, r"\[0, 1\)"),
    ({"activations": "nvfp4", "format": "compressed-tensors", "rotate": "had16"}, "--rotate"),
    ({"activations": "nvfp4", "format": "compressed-tensors", "kept_dtype": "bf16"}, "--kept-dtype"),
])
def test_smoothing_settings_that_cannot_apply_are_refused(kwargs, match):
    from fp4convert.calibrate.methods import settings

    smooth = kwargs.pop("smooth", 0.5)
    with pytest.raises(ConfigError, match=match):
        ConvertConfig(method=settings("gptq", smooth=smooth), **kwargs)


def test_smooth_without_gptq_is_refused_on_the_command_line(tmp_path):
    from click.testing import CliRunner

    from fp4convert.cli.main import main

    r = CliRunner().invoke(main, ["quantize", str(tmp_path / "src"), str(tmp_path / "dst"), "--smooth", "0.5",
                                  "--activations", "nvfp4", "--format", "compressed-tensors"])
    assert r.exit_code == 2 and "--smooth applies to --method gptq only" in r.output, r.output


def test_a_smoothed_conversion_moves_the_norms_factor_into_the_linears(tmp_path):
    """Every block's input norms are smoothed (the manifest lists them, the identity records alpha), their
    written weights are the source's divided per channel; each reading linear's dequantized weight is
    close to the source weight with its columns multiplied by that factor, and far from the source
    weight itself; the non-norm-fed linears (o, down) are quantized as without smoothing's factors."""
    from fp4convert.numerics import reference as ref

    from safetensors.torch import load_file, save_file

    src = add_tokenizer(zoo.build("llama", tmp_path / "llama", dtype=torch.bfloat16))
    for f in src.glob("*.safetensors"):  # an outlier channel in every norm-fed input, as real LMs have
        t = load_file(str(f))
        for k in t:
            if k.endswith("layernorm.weight"):
                t[k][3] *= 40
        save_file(t, str(f), metadata={"format": "pt"})
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    dst = tmp_path / "out"
    r = cli("quantize", src, dst, "--device", "cpu", "--calibration-data", text, "--calibration-samples", 4,
            "--calibration-seq-len", 48, "-q", "--method", "gptq", "--activations", "nvfp4", "--format",
            "compressed-tensors", "--smooth", "0.5")
    assert r.exit_code == 0, r.output
    m = json.loads((dst / "fp4convert.json").read_text())
    layers = {k.split(".")[2] for k in _tensors(src) if k.startswith("model.layers.")}
    want = {f"model.layers.{i}.{n}.weight" for i in layers for n in ("input_layernorm", "post_attention_layernorm")}
    assert set(m["method"]["smoothed"]) == want and m["settings"]["method"]["smooth"] == 0.5
    a, b = _tensors(src), _tensors(dst)
    for i in layers:
        for norm, readers in (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                              ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"))):
            key = f"model.layers.{i}.{norm}.weight"
            assert b[key].dtype == a[key].dtype and not torch.equal(a[key], b[key])
            eff = a[key].float() / b[key].float()
            for lin in readers:
                p = f"model.layers.{i}.{lin}.weight"
                w = a[p].float()
                q = ref.nvfp4_dequantize(b[p + "_packed"], b[p + "_scale"], b[p + "_global_scale"].float().reshape(()))
                near = float((q - w * eff).norm() / (w * eff).norm())
                far = float((q - w).norm() / w.norm())
                assert near < 0.45 and far > 1.5 * near, (p, near, far)
    # inspect --verify divides the factors out again: the smoothed layers compare like any other
    r = cli("inspect", dst, "--verify", src, "--json", "--max-error", "1.0")  # (W4A4 GPTQ on a tiny random model)
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output)
    layers = rep["verify"]["layers"] if "verify" in rep else rep["layers"]
    q = next(k for k in layers if k.endswith("layers.0.self_attn.q_proj"))
    assert layers[q]["rel_error"] < 0.45
    # the real consumer loads it: transformers + compressed-tensors, the smoothed norms as written
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(str(dst), dtype=torch.float32,
                                                    quantization_config=tf.CompressedTensorsConfig(dequantize=True))
    params = dict(model.named_parameters())
    for key in want:
        assert torch.equal(params[key].detach(), b[key].float())
    ids = torch.randint(3, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(model(input_ids=ids).logits).all()
