"""The package's import graph: no cycles, dependencies pointing down the stages, no private names.

Read from the source with ``ast`` (nothing is imported), so the test also covers modules that need a
GPU. Every import counts: at module level, inside functions, and under ``if TYPE_CHECKING:`` (an
annotation that names a module above is still a dependency on it). docs/architecture.md draws the layers.
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


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(imported fp4convert module, names taken from it) for every import in ``path``."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
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
            # `from pkg import x`: x is a submodule (a dependency on it) or a name of pkg's __init__
            folder = PKG.parent / target.replace(".", "/")
            for n in (a.name for a in node.names):
                sub = (folder / f"{n}.py").exists() or (folder / n / "__init__.py").exists()
                out.append((f"{target}.{n}" if sub else target, [n]))
    return out


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for m, p in modules.items():
        for target, _ in _imports(p):
            if target in modules and target != m:
                graph[m].add(target)
    return graph


# The stages, top to bottom: a module may import from its own layer and the layers below, never above.
LAYERS: list[tuple[str, ...]] = [
    ("fp4convert.cli", "fp4convert.__main__", "fp4convert"),  # the command line, and the package's API facade
    ("fp4convert.checkpoint",),  # a written checkpoint: layout, inspect, export, push
    ("fp4convert.run",),  # one conversion top to bottom, the run loop, a part's work
    ("fp4convert.calibrate",),  # running the model on calibration tokens (its results feed the quantizer)
    ("fp4convert.output",),  # the writer, the manifest, the card
    ("fp4convert.quantizer",),  # the backend seam, work items, backends
    ("fp4convert.source",),  # a local folder or a Hub repo
    ("fp4convert.plan",),  # decisions from headers and the model definition
    ("fp4convert.config",),  # the recipe and the run options
    ("fp4convert.formats",),  # on-disk conventions
    ("fp4convert.kernels",),  # compiled kernels and the tensor API
    ("fp4convert.numerics", "fp4convert.storage"),  # the contract in code; bytes on disk
    ("fp4convert.errors", "fp4convert.version", "fp4convert.timing"),  # imported by everything
]


def _layer(module: str) -> int:
    best, depth = -1, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > depth:
                best, depth = i, len(p)
    return best


def test_graph_is_read() -> None:
    g = _graph()
    assert "fp4convert.run.convert" in g and "fp4convert.output.finish" in g["fp4convert.run.runner"]
    assert "fp4convert.formats.base" in g["fp4convert.formats.native"]
    assert "fp4convert.plan.planner" in g["fp4convert.quantizer.backend"]  # a TYPE_CHECKING import counts


def test_every_module_has_a_layer() -> None:
    assert [m for m in _graph() if _layer(m) < 0] == []


def test_dependencies_point_down_the_stages() -> None:
    upward = [f"{m} ({LAYERS[_layer(m)][0]}) imports {t} ({LAYERS[_layer(t)][0]})"
              for m, targets in _graph().items() for t in sorted(targets) if _layer(t) < _layer(m)]
    assert not upward, "\n".join(upward)


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


def test_no_module_shadows_the_public_api() -> None:
    """``fp4convert.quantize(x, ...)`` is a function: a subpackage of that name would replace it as soon as
    anything imported the subpackage (attribute lookup finds the module first)."""
    import fp4convert

    names = {p.stem if p.suffix == ".py" else p.name for p in PKG.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert sorted(set(fp4convert.__all__) & names) == []


def test_no_format_name_is_compared_outside_formats() -> None:
    """issue 29: what differs between output formats is stated by each format (formats/); a comparison of a
    format's name anywhere else (``fmt == "compressed-tensors"``) is knowledge that a new format would not
    get. Counted: a comparison with a registered format's name whose other side mentions a format."""
    from fp4convert.formats import OUTPUT_FORMATS

    names = set(OUTPUT_FORMATS)
    offenders = []
    for p in PKG.rglob("*.py"):
        if "formats" in p.relative_to(PKG).parts:
            continue
        src = p.read_text()
        for node in ast.walk(ast.parse(src)):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            consts = {c.value for s in sides for c in ast.walk(s) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
            text = " ".join(ast.get_source_segment(src, s) or "" for s in sides)
            if consts & names and ("fmt" in text or "format" in text):
                offenders.append(f"{p.relative_to(PKG.parent)}:{node.lineno}: {ast.get_source_segment(src, node)}")
    assert not offenders, "\n".join(offenders)


def test_format_name_check_finds_a_planted_comparison(tmp_path: Path, monkeypatch) -> None:
    """The check itself works: a comparison planted outside formats/ is reported, one inside is not."""
    pkg = tmp_path / "fp4convert"
    (pkg / "formats").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "formats" / "x.py").write_text("def f(fmt):\n    return fmt == 'modelopt'\n")
    (pkg / "run.py").write_text("def g(config):\n    return config.format in ('compressed-tensors', 'x')\n")
    monkeypatch.setattr(sys.modules[__name__], "PKG", pkg)

    with pytest.raises(AssertionError, match=r"run.py:2: config.format in"):
        test_no_format_name_is_compared_outside_formats()


def test_no_method_name_is_compared_outside_methods() -> None:
    """issue 43: what differs between calibrated methods is stated by each method (calibrate/methods/); a
    comparison with a method's name anywhere else (``config.method == "gptq"``, ``name in ("rtn", "gptq")``) is
    knowledge a new method would not get. Counted: a comparison one of whose sides is a registered method's name
    (or ``rtn``, the name of no method) as a string constant."""
    from fp4convert.calibrate.methods import method_names

    names = {*method_names(), "rtn"}
    offenders = []
    for p in PKG.rglob("*.py"):
        if "methods" in p.relative_to(PKG).parts:
            continue
        src = p.read_text()
        for node in ast.walk(ast.parse(src)):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            consts = {c.value for s in sides for c in ast.walk(s) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
            if consts & names:
                offenders.append(f"{p.relative_to(PKG.parent)}:{node.lineno}: {ast.get_source_segment(src, node)}")
    assert not offenders, "\n".join(offenders)


def test_method_name_check_finds_a_planted_comparison(tmp_path: Path, monkeypatch) -> None:
    """The check itself works: a comparison planted outside calibrate/methods/ is reported, one inside is not."""
    pkg = tmp_path / "fp4convert"
    (pkg / "calibrate" / "methods").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "calibrate" / "methods" / "x.py").write_text("def f(name):\n    return name == 'gptq'\n")
    (pkg / "stage.py").write_text("def g(config):\n    return config.method in ('rtn', 'other')\n")
    monkeypatch.setattr(sys.modules[__name__], "PKG", pkg)

    with pytest.raises(AssertionError, match=r"stage.py:2: config.method in \('rtn', 'other'\)") as got:
        test_no_method_name_is_compared_outside_methods()
    assert "x.py" not in str(got.value)
