"""errors.py: one table of exit codes, and every error class maps into it; README and --help agree."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from click.testing import CliRunner

import fp4convert.errors as errors
from fp4convert.cli import main

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
