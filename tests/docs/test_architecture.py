"""docs/architecture.md names every module of fp4convert/ with its job, its layer and its line count.

The page's module table (between the markers of :mod:`tests.docs.architecture_map`) must name every ``.py``
file of the package once (a sub-package's ``__init__.py`` as its package line ``pkg/``), name nothing that does
not exist, give each module the layer ``tests/test_imports.py`` gives it and a line count within 10% of the
file's (exact counts would make every edit of any module an edit of the page too; the generator writes them
exact), and its "Modules over 500 lines" section must name exactly the modules over 500 lines.
``python -m tests.docs.architecture_map --fix`` brings the table up to date.
"""

from __future__ import annotations

import re

import pytest

from tests.docs import architecture_map as am
from tests.test_imports import LAYERS


@pytest.fixture(scope="module")
def page() -> str:
    return am.DOC.read_text()


def test_the_page_matches_the_tree(page: str) -> None:
    assert am.problems(page) == [], "run `python -m tests.docs.architecture_map --fix` (and write the new jobs)"


def test_every_module_is_found() -> None:
    tree = am.modules()
    assert len(tree) == len(list(am.PACKAGE.rglob("*.py")))
    assert {"__init__.py", "plan/", "plan/planner.py", "kernels/cuda/", "kernels/cuda/ops.py"} <= set(tree)
    assert am.dotted("plan/") == "fp4convert.plan" and am.dotted("__init__.py") == "fp4convert"
    assert am.dotted("kernels/cuda/ops.py") == "fp4convert.kernels.cuda.ops"
    assert am.layer_of("cli/main.py") == 1 and am.layer_of("timing.py") == len(LAYERS)


def _drop_row(page: str, name: str) -> str:
    out, n = re.subn(rf"^\| \d+ \| `{re.escape(name)}` \|.*\n", "", page, flags=re.M)
    assert n == 1
    return out


def _edit_row(page: str, name: str, layer: int | None = None, lines: int | None = None, job: str | None = None) -> str:
    row = next(r for r in am.parse(page) if r.name == name)
    new = am.Row(row.layer if layer is None else layer, name, row.lines if lines is None else lines,
                 row.job if job is None else job)
    old_line = f"| {row.layer} | `{name}` | {row.lines} | {row.job} |"
    assert page.count(old_line) == 1
    return page.replace(old_line, f"| {new.layer} | `{new.name}` | {new.lines} | {new.job} |")


def test_a_module_missing_is_found(page: str) -> None:
    assert am.problems(_drop_row(page, "plan/planner.py")) == ["plan/planner.py: a module the table does not name"]


def test_a_package_line_missing_is_found(page: str) -> None:
    assert am.problems(_drop_row(page, "calibrate/methods/")) == ["calibrate/methods/: a module the table does not name"]


def test_a_module_that_does_not_exist_is_found(page: str) -> None:
    planted = page.replace(am.END, "| 8 | `plan/oracle.py` | 100 | a module that was never written |\n" + am.END)
    assert am.problems(planted) == ["plan/oracle.py: named, but fp4convert/ has no such module"]


def test_a_module_named_twice_is_found(page: str) -> None:
    row = next(r for r in am.parse(page) if r.name == "errors.py")
    planted = page.replace(am.END, f"| {row.layer} | `errors.py` | {row.lines} | again |\n" + am.END)
    assert am.problems(planted) == ["errors.py: named twice"]


@pytest.mark.parametrize("factor", [0.85, 1.15])
def test_a_count_more_than_ten_percent_off_is_found(page: str, factor: float) -> None:
    real = am.line_count(am.PACKAGE / "config.py")
    planted = _edit_row(page, "config.py", lines=round(real * factor))
    assert am.problems(planted) == [f"config.py: {round(real * factor)} lines written, {real} now (more than 10% off)"]


def test_a_count_within_ten_percent_passes(page: str) -> None:
    real = am.line_count(am.PACKAGE / "config.py")
    assert am.problems(_edit_row(page, "config.py", lines=round(real * 1.09))) == []


def test_a_wrong_layer_and_an_empty_job_are_found(page: str) -> None:
    planted = _edit_row(_edit_row(page, "plan/planner.py", layer=3), "errors.py", job="")
    assert am.problems(planted) == [
        f"plan/planner.py: layer 3 written, tests/test_imports.py gives {am.layer_of('plan/planner.py')}",
        "errors.py: no job written",
    ]


def test_the_long_modules_section_is_checked(page: str) -> None:
    long = {n for n, p in am.modules().items() if am.line_count(p) > am.LONG}
    assert long, "no module over 500 lines: plant one differently"
    name = sorted(long)[0]
    dropped, n = re.subn(rf"^- `{re.escape(name)}` \(\d+\).*\n", "", page, flags=re.M)
    assert n == 1
    assert am.problems(dropped) == [f"{name}: {am.line_count(am.modules()[name])} lines, not named under {am.LONG_HEADING!r}"]
    short = page.replace(am.LONG_HEADING + "\n", am.LONG_HEADING + "\n\n- `version.py` (8): not long\n", 1)
    assert am.problems(short) == [f"version.py: named under {am.LONG_HEADING!r}, but it is not over {am.LONG} lines"]


def test_regenerating_keeps_the_jobs_and_fixes_the_rest(page: str) -> None:
    again = am.regenerate(page)
    assert am.problems(again) == []
    assert {r.name: r.job for r in am.parse(again)} == {r.name: r.job for r in am.parse(page)}
    (a0, b0), (a1, b1) = am.table_block(page), am.table_block(again)
    assert again[:a1] == page[:a0] and again[b1:] == page[b0:]  # the rest of the page as it was
    planted = _edit_row(_drop_row(page, "storage/names.py"), "config.py", lines=1, layer=2)
    planted = planted.replace(am.END, "| 8 | `plan/oracle.py` | 100 | gone |\n" + am.END)
    fixed = am.parse(am.regenerate(planted))
    by_name = {r.name: r for r in fixed}
    assert "plan/oracle.py" not in by_name
    assert by_name["storage/names.py"].job == am.first_sentence(am.PACKAGE / "storage" / "names.py")
    assert by_name["config.py"].lines == am.line_count(am.PACKAGE / "config.py") and by_name["config.py"].layer == 9
    assert [r.name for r in fixed] == [r.name for r in sorted(fixed, key=lambda r: (r.layer, r.name))]


def test_the_generator_prints_the_table(capsys) -> None:
    assert am.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith(am.HEADER) and out.strip() == am.render(am.DOC.read_text()).strip()
