"""``inspect --verify`` judges each output by a criterion that fits how its weights were rounded (issue 45):
round-to-nearest by the error itself, a calibrated method (GPTQ) by its error over round-to-nearest's on the
same weights, recomputed from the source (fp4convert/checkpoint/verify.py, docs/numerics.md "What inspect
--verify accepts of a GPTQ checkpoint"). A GPTQ checkpoint made at the defaults passes; a broken layer still fails."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from fp4convert.checkpoint.inspect import inspect_checkpoint
from fp4convert.calibrate.methods.gptq import GPTQ as GPTQ_METHOD
from fp4convert.checkpoint.verify import DEFAULT_MAX_ERROR, Criterion, criterion
from fp4convert.cli.main import main
from tests import checkpoints as ck
from tests import zoo
from tests.calibrate.test_calibrate import TEXT, add_tokenizer

GPTQ = ("--method", "gptq")
W4A4 = ("--method", "gptq", "--activations", "nvfp4", "--format", "compressed-tensors")  # smoothing on: its default


def run(*args) -> object:
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("verify")
    src = add_tokenizer(zoo.build("llama", root / "llama", dtype=torch.float32))
    text = root / "calibration.txt"
    text.write_text(TEXT * 2)  # the default 16 x 256 tokens
    return src, text


@pytest.fixture(scope="module")
def outputs(model, tmp_path_factory) -> dict[str, Path]:
    """The command line's defaults for each method (the calibration file aside)."""
    src, text = model
    out = {}
    for name, extra in (("rtn", ()), ("gptq", GPTQ), ("gptq-w4a4", W4A4)):
        dst = tmp_path_factory.mktemp(name) / "out"
        data = ("--calibration-data", text) if extra else ()
        r = run("quantize", src, dst, "--device", "cpu", "-q", *data, *extra)
        assert r.exit_code == 0, r.output
        out[name] = dst
    return out


def test_criterion_follows_the_manifests_method():
    assert criterion(None) == Criterion("rtn", False, DEFAULT_MAX_ERROR, None)  # no manifest: as before
    assert criterion({"settings": {}}) == Criterion("rtn", False, 0.25, None)
    gptq = {"method": {"method": "gptq"}}
    assert criterion(gptq) == Criterion("gptq", False, None, GPTQ_METHOD.RATIO_BUDGET[False])
    assert criterion({**gptq, "activations": {"scheme": "nvfp4"}}) == \
        Criterion("gptq", True, None, GPTQ_METHOD.RATIO_BUDGET[True])
    assert criterion({"method": {"method": "future"}}).max_ratio == max(GPTQ_METHOD.RATIO_BUDGET.values())
    assert criterion(gptq, max_error=0.3) == Criterion("gptq", False, 0.3, None)  # asked: only what is asked
    assert criterion(None, max_ratio=1.5) == Criterion("rtn", False, None, 1.5)
    assert criterion(gptq, 0.3, 1.5).describe() == "rel.err <= 0.3 and rel.err <= 1.5 x round-to-nearest's"


@pytest.mark.parametrize("options", [(), ("--scheme", "mxfp4"), ("--rotate", "had16", "--scale-rule", "mse"),
                                     ("--format", "compressed-tensors", "--scale-rule", "max")],
                         ids=["nvfp4", "mxfp4", "had16-mse", "ct-max"])
def test_round_to_nearest_is_recomputed_exactly(model, tmp_path, options):
    """The reference is the data-free quantizer with the checkpoint's scheme, rotation, scale rule and
    fused-group global scale: on a data-free output it reproduces every layer's error exactly."""
    src, _ = model
    dst = tmp_path / "q"
    assert run("quantize", src, dst, "--device", "cpu", "-q", *options).exit_code == 0
    v = inspect_checkpoint(str(dst), verify=str(src))["verify"]
    assert v["method"] == "rtn" and v["max_error"] == DEFAULT_MAX_ERROR and v["max_ratio"] is None
    assert v["layers"] and all(e["vs_rtn"] == 1.0 and e["rtn_rel_error"] == e["rel_error"]
                               for e in v["layers"].values()), v["layers"]


@pytest.mark.parametrize("name", ["gptq", "gptq-w4a4"])
def test_gptq_at_the_defaults_passes(outputs, model, name):
    """GPTQ moves weights off their nearest grid point on purpose: judged by round-to-nearest's error
    threshold its W4A4 output failed ("layers exceed --max-error 0.25"); judged against round-to-nearest on
    the same weights it passes, and its layers do err more than round-to-nearest's (the criterion is needed)."""
    src, _ = model
    r = inspect_checkpoint(str(outputs[name]), verify=str(src))
    v = r["verify"]
    assert r["ok"], r["checks"]["problems"]
    budget = GPTQ_METHOD.RATIO_BUDGET[name.endswith("w4a4")]
    assert v["method"] == "gptq" and v["max_ratio"] == budget and v["max_error"] is None
    ratios = [e["vs_rtn"] for e in v["layers"].values()]
    assert 1.05 < min(ratios) and max(ratios) <= budget, ratios
    assert v["overall"]["worst_vs_rtn"] == max(ratios)
    text = run("inspect", outputs[name], "--verify", src)
    assert text.exit_code == 0 and "verdict: OK" in text.stdout
    assert f"criterion (gptq weights): every layer's rel.err <= {budget:g} x round-to-nearest's" in text.stdout
    if name == "gptq-w4a4":  # what the old criterion said of it
        old = inspect_checkpoint(str(outputs[name]), verify=str(src), max_error=DEFAULT_MAX_ERROR)
        assert not old["ok"] and any("exceed --max-error 0.25" in p for p in old["checks"]["problems"])


@pytest.mark.parametrize("name", ["gptq", "gptq-w4a4"])
def test_a_broken_layer_still_fails(outputs, model, tmp_path, name):
    """One layer's codes replaced by another layer's (same shape, sizes unchanged: only --verify can tell),
    and one source layer that is twice the converted one (a scale off by one binade): each is the one
    layer that fails, named in the report."""
    src, _ = model
    dst = tmp_path / "bad"
    shutil.copytree(outputs[name], dst)
    layout = inspect_checkpoint(str(dst))
    packed = next(n for n in _names(dst) if "layers.0.self_attn.o_proj" in n and n.endswith(_packed_suffix(layout)))
    other = packed.replace("layers.0.self_attn.o_proj", "layers.1.self_attn.o_proj")
    ck.patch_tensor(ck.shard_with(dst, packed), packed, ck.tensor_bytes(ck.shard_with(dst, other), other))
    _fails_only(dst, src, "model.layers.0.self_attn.o_proj")
    doubled = tmp_path / "src2"
    shutil.copytree(src, doubled)
    f = doubled / "model.safetensors"
    from safetensors.torch import load_file, save_file

    t = load_file(str(f))
    t["model.layers.1.mlp.down_proj.weight"] = t["model.layers.1.mlp.down_proj.weight"] * 2
    save_file(t, str(f), metadata={"format": "pt"})
    _fails_only(outputs[name], doubled, "model.layers.1.mlp.down_proj")


def _packed_suffix(report: dict) -> str:
    from fp4convert.formats import get_format

    return get_format(report["format"]).packed_suffix


def _names(dst: Path) -> list[str]:
    return [n for f in sorted(dst.glob("*.safetensors")) for n in ck.header(f)[1] if n != "__metadata__"]


def _fails_only(dst: Path, src: Path, layer: str) -> None:
    r = inspect_checkpoint(str(dst), verify=str(src))
    v = r["verify"]
    assert not r["ok"] and v["layers"][layer]["vs_rtn"] > v["max_ratio"], v["layers"][layer]
    others = {k: e["vs_rtn"] for k, e in v["layers"].items() if k != layer}
    assert max(others.values()) <= v["max_ratio"], others
    assert [p for p in r["checks"]["problems"] if "exceed" in p] == [
        p for p in r["checks"]["problems"] if p.startswith("1 layer(s) exceed --max-ratio") and layer in p]
    out = run("inspect", dst, "--verify", src)
    assert out.exit_code == 6 and "verdict: FAILED" in out.stdout
    flagged = [ln.split()[0] for ln in out.stdout.splitlines() if ln.endswith("> max-ratio")]
    assert flagged == [layer], out.stdout


def test_limits_given_on_the_command_line(outputs, model):
    """--max-error judges any output when given (a calibrated one too); --max-ratio too."""
    src, _ = model
    w4a4 = outputs["gptq-w4a4"]
    worst = inspect_checkpoint(str(w4a4), verify=str(src))["verify"]["overall"]
    r = run("inspect", w4a4, "--verify", src, "--max-error", f"{worst['worst_rel_error'] * 0.99:.6f}")
    assert r.exit_code == 6 and "> max-error" in r.stdout and "exceed --max-error" in r.stdout
    r = run("inspect", w4a4, "--verify", src, "--max-error", f"{worst['worst_rel_error'] * 1.01:.6f}")
    assert r.exit_code == 0, r.stdout
    r = run("inspect", outputs["rtn"], "--verify", src, "--max-ratio", "0.99")
    assert r.exit_code == 6 and "exceed --max-ratio 0.99" in r.stdout
    assert run("inspect", outputs["rtn"], "--max-ratio", "2").exit_code == 2  # without --verify: a usage error


def test_layers_in_numeric_order(tmp_path):
    """layers.0, 1, 2, ..., 10, 11: the per-layer list sorted as numbers, not as text (0, 1, 10, 11, 2)."""
    src = tmp_path / "src"
    ck.llama(src, layers=12)
    dst = tmp_path / "q"
    assert run("quantize", src, dst, "--device", "cpu", "-q").exit_code == 0
    v = inspect_checkpoint(str(dst), verify=str(src))["verify"]
    numbers = [int(re.search(r"layers\.(\d+)\.", k).group(1)) for k in v["layers"]]
    assert numbers == sorted(numbers) and numbers[-1] == 11 and numbers.index(10) > numbers.index(9)
    text = run("inspect", dst, "--verify", src).stdout
    listed = [int(m) for m in re.findall(r"^    model\.layers\.(\d+)\.", text, re.M)]
    assert listed == numbers


def test_quiet_verify_prints_errors_only(outputs, model):
    """``-q --verify`` printed the whole per-layer report; now nothing when OK, the problems when not."""
    src, _ = model
    r = run("inspect", outputs["gptq"], "--verify", src, "-q")
    assert r.exit_code == 0 and r.output == "", r.output
    r = run("inspect", outputs["gptq"], "--verify", src, "-q", "--max-ratio", "1.01")
    assert r.exit_code == 6 and r.stdout == "", r.output
    assert r.stderr.startswith(f"Error: {outputs['gptq']}: inspect found 1 problem(s)") and "exceed --max-ratio" in r.stderr
    assert "rel.err" in r.stderr and "SNR" not in r.stderr and "verdict" not in r.stderr


def test_every_output_says_how_its_weights_were_rounded(outputs, model, tmp_path):
    """A method line for data-free outputs too, and an honest one without a manifest."""
    def line(dst):
        r = run("inspect", dst)
        return next(ln for ln in r.stdout.splitlines() if ln.startswith("  weights: "))

    assert line(outputs["rtn"]) == "  weights: round-to-nearest, data-free (no calibration set)"
    assert line(outputs["gptq"]).startswith("  weights: GPTQ (") and "calibration tokens" in line(outputs["gptq"])
    bare = tmp_path / "bare"
    shutil.copytree(outputs["gptq-w4a4"], bare)
    (bare / "fp4convert.json").unlink()
    assert line(bare) == "  weights: how they were rounded is not recorded (no fp4convert manifest)"


def test_plot_shows_what_is_judged(outputs, model, tmp_path):
    """A calibrated output's chart plots the ratio to round-to-nearest against its budget."""
    src, _ = model
    out = tmp_path / "chart.html"
    r = run("inspect", outputs["gptq"], "--verify", src, "--plot", out)
    assert r.exit_code == 0, r.output
    html = out.read_text()
    assert "relative error / round-to-nearest" in html and f"threshold {GPTQ_METHOD.RATIO_BUDGET[False]}" in html
