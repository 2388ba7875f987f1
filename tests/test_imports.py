"""The package's import graph: no cycles (lazy imports inside functions included), no private names.

Read from the source with ``ast`` (nothing is imported), so the test also covers modules that need a
GPU. Imports under ``if TYPE_CHECKING:`` are annotations only and are left out.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "fp4convert"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(imported fp4convert module, names taken from it) for every runtime import in ``path``."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            skip.update(id(n) for child in node.body for n in ast.walk(child))
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.startswith("fp4convert")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("fp4convert"):
                continue
            names = [a.name for a in node.names]
            if node.module is None or node.module == "":
                # `from . import x`: each name is a submodule (or a package attribute)
                out += [(f"{target}.{n}" if (PKG.parent / target.replace(".", "/") / f"{n}.py").exists()
                         or (PKG.parent / target.replace(".", "/") / n).is_dir() else target, [n]) for n in names]
            else:
                out.append((target, names))
    return out


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for m, p in modules.items():
        for target, _ in _imports(p):
            if target in modules and target != m:
                graph[m].add(target)
    return graph


def test_graph_is_read() -> None:
    g = _graph()
    assert "fp4convert.convert" in g and "fp4convert.writer" in g["fp4convert.convert"]
    assert "fp4convert.formats.base" in g["fp4convert.formats.native"]


def test_no_import_cycle() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_no_private_names_across_modules() -> None:
    offenders = []
    for p in PKG.rglob("*.py"):
        me = _module_name(p)
        for target, names in _imports(p):
            if target == me:
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            private += [target for part in target.split(".")[1:] if part.startswith("_") and part != "__init__"]
            if private:
                offenders.append(f"{me} imports {private} from {target}")
    assert not offenders, offenders


def test_cycle_detector_finds_a_cycle(tmp_path: Path, monkeypatch) -> None:
    """The detector itself works: a planted two-module cycle is reported."""
    pkg = tmp_path / "fp4convert"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import x\n")
    (pkg / "b.py").write_text("def f():\n    from .a import y\n")
    monkeypatch.setattr(sys.modules[__name__], "PKG", pkg)

    with pytest.raises(AssertionError, match="import cycle"):
        test_no_import_cycle()
