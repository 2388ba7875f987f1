"""The module table of docs/architecture.md: read, checked against the tree, and regenerated.

Every ``.py`` file of ``fp4convert/`` has one row: its layer (the one ``tests/test_imports.py`` gives it), its
name (relative to ``fp4convert/``; a sub-package's ``__init__.py`` is the package line ``pkg/``), its line
count (as ``wc -l`` counts) and its one-line job. The jobs are written by hand in the page; the rest follows
from the tree, so after code moves:

    python -m tests.docs.architecture_map          # print the table as the tree has it now
    python -m tests.docs.architecture_map --fix    # rewrite it in docs/architecture.md

keeps every job written there, drops the rows of modules that are gone, and gives a new module its
docstring's first sentence as a job to edit. :mod:`tests.docs.test_architecture` holds the page to it.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "fp4convert"
DOC = ROOT / "docs" / "architecture.md"
START = "<!-- module table: python -m tests.docs.architecture_map --fix -->"
END = "<!-- /module table -->"
HEADER = "| layer | module | lines | its job |\n|---:|---|---:|---|"
TOLERANCE = 0.10  # a count may drift this far (relative) before the page is stale
LONG = 500  # modules over this many lines are named, with their reason, under LONG_HEADING
LONG_HEADING = "### Modules over 500 lines, and why"

_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*`([^`]+)`\s*\|\s*(\d+)\s*\|(.*)\|\s*$")
_LONG_ITEM = re.compile(r"^- `([^`]+)` \((\d+)\)")


@dataclass(frozen=True)
class Row:
    layer: int
    name: str
    lines: int
    job: str


def module_name(path: Path) -> str:
    """A file's name in the table: ``plan/planner.py``; a sub-package's ``__init__.py`` is ``plan/``."""
    rel = path.relative_to(PACKAGE).as_posix()
    if path.name == "__init__.py" and rel != "__init__.py":
        return rel.removesuffix("__init__.py")
    return rel


def dotted(name: str) -> str:
    """``plan/planner.py`` -> ``fp4convert.plan.planner``; ``plan/`` -> ``fp4convert.plan``."""
    stem = name.removesuffix(".py").removesuffix("/").removesuffix("__init__").rstrip("/")
    return "fp4convert" + ("." + stem.replace("/", ".") if stem else "")


def layer_of(name: str) -> int:
    """The 1-based layer of tests/test_imports.py's LAYERS (0: none)."""
    from tests.test_imports import _layer

    return _layer(dotted(name)) + 1


def modules() -> dict[str, Path]:
    """Every module of the package by its table name."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in p.parts}


def line_count(path: Path) -> int:
    return path.read_bytes().count(b"\n")


def first_sentence(path: Path) -> str:
    """A new module's job until one is written: its docstring's first sentence."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or "(no docstring: write its job here)"
    text = " ".join(doc.split("\n\n")[0].split())
    m = re.search(r"(?<=[.!?])\s", text)
    return (text[: m.start()] if m else text).replace("|", "\\|")


def table_block(text: str) -> tuple[int, int]:
    """The character range of the table between START and END (AssertionError when the markers are off)."""
    assert text.count(START) == 1 and text.count(END) == 1, f"{DOC.name}: one {START!r} and one {END!r} expected"
    a, b = text.index(START) + len(START), text.index(END)
    assert a < b, f"{END!r} before {START!r}"
    return a, b


def parse(text: str) -> list[Row]:
    """The rows of the page's module table."""
    a, b = table_block(text)
    rows = []
    for line in text[a:b].splitlines():
        m = _ROW.match(line.strip())
        if m:
            rows.append(Row(int(m.group(1)), m.group(2), int(m.group(3)), m.group(4).strip()))
        elif line.strip() and not line.lstrip().startswith("|"):
            raise AssertionError(f"not a table row between the markers: {line!r}")
    return rows


def long_modules(text: str) -> dict[str, int]:
    """The modules named (with their counts) under LONG_HEADING."""
    assert LONG_HEADING in text, f"no {LONG_HEADING!r} section"
    section = text.split(LONG_HEADING, 1)[1].split("\n#", 1)[0]
    return {m.group(1): int(m.group(2)) for m in map(_LONG_ITEM.match, section.splitlines()) if m}


def off(written: int, actual: int) -> bool:
    return abs(written - actual) > TOLERANCE * max(actual, 1)


def problems(text: str, tree: dict[str, Path] | None = None) -> list[str]:
    """What the page says wrongly of the tree: each problem one line naming the module."""
    tree = modules() if tree is None else tree
    rows = parse(text)
    named = [r.name for r in rows]
    out = [f"{n}: named twice" for n in sorted({n for n in named if named.count(n) > 1})]
    out += [f"{n}: a module the table does not name" for n in sorted(set(tree) - set(named))]
    out += [f"{n}: named, but fp4convert/ has no such module" for n in sorted(set(named) - set(tree))]
    for r in rows:
        if r.name not in tree:
            continue
        lines = line_count(tree[r.name])
        if off(r.lines, lines):
            out.append(f"{r.name}: {r.lines} lines written, {lines} now (more than {TOLERANCE:.0%} off)")
        if r.layer != layer_of(r.name):
            out.append(f"{r.name}: layer {r.layer} written, tests/test_imports.py gives {layer_of(r.name)}")
        if not r.job:
            out.append(f"{r.name}: no job written")
    long = {n: line_count(p) for n, p in tree.items() if line_count(p) > LONG}
    listed = long_modules(text)
    out += [f"{n}: {c} lines, not named under {LONG_HEADING!r}" for n, c in sorted(long.items()) if n not in listed]
    out += [f"{n}: named under {LONG_HEADING!r}, but it is not over {LONG} lines" for n in sorted(set(listed) - set(long))]
    out += [f"{n}: {listed[n]} lines written under {LONG_HEADING!r}, {c} now" for n, c in sorted(long.items())
            if n in listed and off(listed[n], c)]
    return out


def render(text: str, tree: dict[str, Path] | None = None) -> str:
    """The table for the tree as it is, keeping the jobs ``text`` writes for the modules still there."""
    tree = modules() if tree is None else tree
    jobs = {r.name: r.job for r in parse(text)}
    rows = sorted((Row(layer_of(n), n, line_count(p), jobs.get(n) or first_sentence(p)) for n, p in tree.items()),
                  key=lambda r: (r.layer, r.name))
    return "\n".join([HEADER, *(f"| {r.layer} | `{r.name}` | {r.lines} | {r.job} |" for r in rows)])


def regenerate(text: str, tree: dict[str, Path] | None = None) -> str:
    """``text`` with its module table rendered again (the rest of the page as it was)."""
    a, b = table_block(text)
    return text[:a] + "\n" + render(text, tree) + "\n" + text[b:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fix", action="store_true", help=f"rewrite the table in {DOC.relative_to(ROOT)}")
    a = ap.parse_args(argv)
    text = DOC.read_text()
    if not a.fix:
        print(render(text))
        return 0
    new = regenerate(text)
    if new != text:
        DOC.write_text(new)
    left = [p for p in problems(new) if "not over" in p or LONG_HEADING in p]
    for p in left:  # the reasons for long modules are prose: the generator leaves them to a person
        print(f"{DOC.relative_to(ROOT)}: {p}", file=sys.stderr)
    return 1 if left else 0


if __name__ == "__main__":
    raise SystemExit(main())
