"""errors.py: one table of exit codes, and every error class maps into it; README and --help agree."""

from __future__ import annotations

import inspect
import re

import pytest
from pathlib import Path

from click.testing import CliRunner

import fp4convert.errors as errors
from fp4convert.cli.main import main

README = Path(__file__).resolve().parents[1] / "README.md"


def _classes() -> list[type]:
    return [c for _, c in inspect.getmembers(errors, inspect.isclass)
            if issubclass(c, errors.FP4ConvertError) and c.__module__ == errors.__name__]


def test_every_class_has_a_documented_exit_code_and_a_docstring() -> None:
    classes = _classes()
    assert len(classes) >= 12
    for c in classes:
        assert c.exit_code in errors.EXIT_CODES, c
        assert c.__doc__ and "\n" not in c.__doc__.strip(), f"{c.__name__}: one-line docstring"


def test_no_error_class_is_defined_outside_errors_py() -> None:
    pkg = Path(errors.__file__).parent
    pattern = re.compile(r"^class \w+\((?:[\w.]*Error|FP4ConvertError|Exception)\b", re.M)
    outside = [p.relative_to(pkg).as_posix() for p in pkg.rglob("*.py")
               if p.name != "errors.py" and pattern.search(p.read_text())]
    assert not outside, outside


def test_readme_table_equals_exit_codes() -> None:
    rows = dict(re.findall(r"^\s*\| (\d+) \| (.+?) \|$", README.read_text(), re.M))
    assert {int(k): v for k, v in rows.items()} == errors.EXIT_CODES


def test_help_lists_every_exit_code() -> None:
    for args in ([], ["quantize"], ["inspect"], ["export"]):
        out = CliRunner().invoke(main, [*args, "--help"]).output
        for code, text in errors.EXIT_CODES.items():
            assert re.search(rf"^\s*{code}\s+{re.escape(text[:30])}", out, re.M), (args, code)


def test_a_finite_source_that_overflows_in_the_rotation_is_named_as_such(tmp_path) -> None:
    """Issue 23 item 14: a finite source near the fp32 limit overflowed in Had16 and was refused as
    'holds NaN or Inf; fix the source'."""
    import torch
    from click.testing import CliRunner

    from fp4convert.cli.main import main
    from fp4convert.errors import RotationOverflowError
    from fp4convert.kernels.tensor import quantize

    from . import checkpoints as ck

    x = torch.randn(16, 64)
    x[0, :16] = 3e38  # finite; rotated, a value reaches 4 x 3e38
    quantize(x)  # without rotation it quantizes
    with pytest.raises(RotationOverflowError, match="had16 rotation overflowed fp32: the tensor is finite"):
        quantize(x, rotate="had16")
    cfg = ck.llama_config(layers=1)
    t = ck.llama_tensors(cfg, dtype=torch.float32)
    t["model.layers.0.mlp.down_proj.weight"][:, :16] = 3e38
    ck.write(tmp_path / "src", t, cfg)
    r = CliRunner().invoke(main, ["quantize", str(tmp_path / "src"), str(tmp_path / "q"), "--rotate", "had16",
                                  "--device", "cpu", "-q"])
    assert r.exit_code == 3 and "overflow fp32 in the had16 rotation" in r.output, r.output
    assert "convert without --rotate" in r.output
    r = CliRunner().invoke(main, ["quantize", str(tmp_path / "src"), str(tmp_path / "p"), "--device", "cpu", "-q"])
    assert r.exit_code == 0, r.output
