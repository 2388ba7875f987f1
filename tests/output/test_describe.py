"""What fp4convert says about an output is what it is (issue 34): the run's summary line, the model card,
``inspect`` (text and ``--json``) and ``inspect -q`` for weight-only and every kind of W4A4 output.

A W4A4 output was described as "Weight-only ... (data-free: no calibration set)" with its activation
scales counted as kept tensors; the card's ModelOpt serving text said no activation scales were stored.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from fp4convert.cli.main import main
from fp4convert.output.card import START, split_card
from tests import zoo
from tests.calibrate.test_calibrate import add_tokenizer

# (id, options, W4A4?, how its activation scales were had, the activation-scale suffix the format stores)
KINDS = [
    ("native", ("--format", "fp4convert"), False, None, None),
    ("ct-weight-only", ("--format", "compressed-tensors"), False, None, None),
    ("modelopt-weight-only", ("--format", "modelopt"), False, None, None),
    ("ct-nvfp4-calibrated", ("--format", "compressed-tensors", "--activations", "nvfp4", "--calibration-samples", "2",
                             "--calibration-seq-len", "8"), True, "calibrated", ".input_global_scale"),
    ("modelopt-nvfp4-constant", ("--format", "modelopt", "--activations", "nvfp4", "--activation-scale", "constant"),
     True, "constant", ".input_scale"),
    ("ct-mxfp4-dynamic", ("--format", "compressed-tensors", "--scheme", "mxfp4", "--activations", "mxfp4"), True,
     "dynamic", None),
]


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    p = zoo.build("llama", tmp_path_factory.mktemp("describe") / "llama")
    add_tokenizer(p)
    return p


@pytest.fixture(scope="module")
def outputs(src, tmp_path_factory) -> dict[str, tuple[Path, str, str]]:
    out = {}
    for kind, options, *_ in KINDS:
        dst = tmp_path_factory.mktemp("describe") / kind
        r = CliRunner().invoke(main, ["quantize", str(src), str(dst), "--device", "cpu", *options])
        assert r.exit_code == 0, r.output
        lines = r.stdout.splitlines()
        at = next(i for i, ln in enumerate(lines) if ln.startswith(f"{dst}: "))
        out[kind] = (dst, lines[at], lines[at + 1])  # the summary, and how to load what was written
    return out


@pytest.mark.parametrize("kind,options,w4a4,scales,suffix", KINDS, ids=[k[0] for k in KINDS])
def test_summary_card_and_inspect_say_what_the_output_is(outputs, kind, options, w4a4, scales, suffix):
    dst, summary, load = outputs[kind]
    manifest = json.loads((dst / "fp4convert.json").read_text())
    keeps = sum(1 for rec in manifest["tensors"].values() if rec["action"] == "keep")
    # the run's summary line
    assert ("W4A4" in summary) == w4a4, summary
    if w4a4:
        assert f"W4A4 with {scales} activation scales" in summary, summary
    assert f", {keeps} kept;" in summary, summary
    # how to load it: the native layout only after an export; the others say whether transformers reads them
    assert load.startswith("load: ") and f"{dst}/README.md" in load, load
    if kind == "native":
        assert f"fp4convert export {dst} OUT --format compressed-tensors" in load, load
    else:
        assert "fp4convert export" not in load and ("from_pretrained" in load) == kind.startswith("ct-"), load
    # the card
    meta, body = split_card((dst / "README.md").read_text())
    section = body.split(START, 1)[1]
    first = next(ln for ln in section.splitlines() if "quantization of" in ln)
    assert first.startswith("W4A4 " if w4a4 else "Weight-only "), first
    assert ("w4a4" in meta["tags"]) == w4a4
    if not w4a4:
        assert "data-free" in first and "weights only" in first, first
    elif scales == "calibrated":
        assert "calibrated on 2 x 8 tokens" in first and "input mean squares measured on calibration data" in first
    elif scales == "constant":
        assert "constant static scale" in first and "no calibration" in first, first
    else:
        assert "at run time (dynamic scales, nothing calibrated)" in first, first
    if "modelopt" in kind:  # the format's own serving text: what is stored
        assert ("No activation scales are stored" in section) == (not w4a4)
        assert ("`input_scale`) is stored" in section) == w4a4
    if kind.startswith("ct-") and w4a4:
        assert "runs the activations unquantized" in section  # the transformers snippet runs it weight-only
    # inspect --json and text: activations, and activation scales not counted as kept tensors
    r = CliRunner().invoke(main, ["inspect", str(dst), "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["kept"] == keeps == manifest["summary"]["kept"]
    assert rep["params"] == manifest["summary"]["params"]
    n_scales = sum(1 for n in _names(dst) if suffix and n.endswith(suffix))
    assert rep["activation_scales"] == n_scales and (n_scales > 0) == (scales in ("calibrated", "constant"))
    if w4a4:
        assert rep["activations"]["scales"] == scales and rep["activations"]["scheme"] in ("nvfp4", "mxfp4")
        if scales == "calibrated":
            assert rep["activations"]["calibration"]["samples"] == 2
    else:
        assert rep["activations"] is None
    text = CliRunner().invoke(main, ["inspect", str(dst)]).stdout
    line = next(ln for ln in text.splitlines() if ln.startswith("  activations: "))
    assert line.startswith("  activations: W4A4") == w4a4, line
    weights = next(ln for ln in text.splitlines() if ln.startswith("  weights: "))  # for data-free outputs too
    assert weights.startswith("  weights: round-to-nearest, "), weights
    assert ("input mean squares measured on calibration data" in weights) == (scales == "calibrated"), weights


def _names(dst: Path) -> list[str]:
    from safetensors import safe_open

    out = []
    for f in dst.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            out += list(h.keys())
    return out


def test_inspect_quiet_prints_errors_only(outputs, src, tmp_path):
    """``-q``: nothing for a sound checkpoint; one Error line (and the problems) for a failed one; one for an
    unquantized folder. The exit codes are those of the full report."""
    dst = outputs["native"][0]
    r = CliRunner().invoke(main, ["inspect", str(dst), "-q"])
    assert r.exit_code == 0 and r.output == "", r.output
    bad = tmp_path / "bad"
    import shutil

    shutil.copytree(dst, bad)
    (bad / "tokenizer.json").write_text("{}")  # its size no longer matches the manifest
    r = CliRunner().invoke(main, ["inspect", str(bad), "-q"])
    assert r.exit_code == 6 and r.stdout == "", r.output
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and str(bad) in errors[0] and "1 problem(s)" in errors[0], r.stderr
    assert "tokenizer.json: size" in r.stderr and "verdict" not in r.stderr and "layer " not in r.stderr
    r = CliRunner().invoke(main, ["inspect", str(src), "-q"])
    assert r.exit_code == 6 and r.stdout == "" and r.stderr.startswith(f"Error: {src}: not quantized"), r.output


def test_inspect_without_a_manifest_still_says_w4a4(outputs, tmp_path):
    """A W4A4 folder whose manifest is gone (or another tool's): the stored activation scales say W4A4;
    how they were had is not claimed, and they are not counted as kept tensors."""
    import shutil

    dst = tmp_path / "nomanifest"
    shutil.copytree(outputs["modelopt-nvfp4-constant"][0], dst)
    keeps = sum(1 for rec in json.loads((dst / "fp4convert.json").read_text())["tensors"].values()
                if rec["action"] == "keep")
    (dst / "fp4convert.json").unlink()
    rep = json.loads(CliRunner().invoke(main, ["inspect", str(dst), "--json"]).stdout)
    assert rep["activations"] == {"scheme": "nvfp4", "scales": "stored", "calibration": None}
    assert rep["kept"] == keeps and rep["activation_scales"] == rep["quantized"]
