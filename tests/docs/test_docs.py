"""The documentation cannot drift: its relative links resolve, and its worked examples run.

- Every relative link in README.md and docs/*.md (``[text](path)``, ``![alt](path)``, ``[id]: path``,
  with or without ``#anchor``) points to a file or folder inside the repository; an anchor must name a
  heading (GitHub's slug rules) or an explicit ``<a name>``/``id`` of a markdown file.
- Every fenced ``python`` block in docs/*.md starts with ``# doctest`` (executed here, and it must
  assert something) or ``# not run`` (shown only): nothing is silently left unchecked.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
RUN_MARK = "# doctest"
SKIP_MARK = "# not run"


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted(DOCS.glob("*.md"))]


# --- markdown parsing -------------------------------------------------------------------------

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)")


def split_fences(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str, str]]]:
    """(prose lines as (line_no, text), fenced blocks as (first line_no, info string, body))."""
    prose: list[tuple[int, str]] = []
    blocks: list[tuple[int, str, str]] = []
    fence = None  # (marker char, length, info, start line, body lines)
    for no, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if fence is None:
            if m:
                fence = (m.group(1)[0], len(m.group(1)), m.group(2).lower(), no, [])
            else:
                prose.append((no, line))
        elif m and m.group(1)[0] == fence[0] and len(m.group(1)) >= fence[1] and not line.strip(" `~"):
            blocks.append((fence[3] + 1, fence[2], "\n".join(fence[4])))
            fence = None
        else:
            fence[4].append(line)
    if fence is not None:
        raise AssertionError(f"unclosed code fence opened at line {fence[3]}")
    return prose, blocks


_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)(?:\s+[\"'(][^)]*)?\)")
_REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def links(text: str) -> list[tuple[int, str]]:
    """(line_no, target) of every link outside code blocks and code spans."""
    prose, _ = split_fences(text)
    out = []
    for no, line in prose:
        plain = _CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)
        for m in _INLINE_LINK.finditer(plain):
            out.append((no, m.group(1).strip("<>")))
        m = _REF_DEF.match(plain)
        if m:
            out.append((no, m.group(1).strip("<>")))
    return out


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: rendered text, lowercased, punctuation dropped, spaces -> '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = _CODE_SPAN.sub(lambda m: m.group(2), text)  # code spans: their content
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = re.sub(r"(\*\*|__|\*|(?<!\w)_|_(?!\w))", "", text)  # emphasis markers
    text = text.strip().lower()
    kept = "".join(
        c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN" or unicodedata.category(c) == "Mn"
    )
    return kept.replace(" ", "-")


_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*(?:\s#+\s*)?$")
_HTML_ANCHOR = re.compile(r"<a\s[^>]*(?:name|id)\s*=\s*[\"']([^\"']+)[\"']|\sid\s*=\s*[\"']([^\"']+)[\"']")


def anchors(text: str) -> set[str]:
    """Every anchor GitHub renders for a markdown file (duplicate headings get -1, -2, ...)."""
    prose, _ = split_fences(text)
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _, line in prose:
        m = _HEADING.match(line)
        if m:
            slug = github_slug(m.group(2))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
        for a in _HTML_ANCHOR.finditer(line):
            out.add(a.group(1) or a.group(2))
    return out


def broken_links(md: Path, root: Path = ROOT) -> list[str]:
    """Problems with the relative links of one markdown file (empty when all resolve)."""
    text = md.read_text(encoding="utf-8")
    problems = []
    for no, target in links(text):
        if _SCHEME.match(target) or target.startswith("//"):
            continue  # http(s), mailto, ...: not checked here (no network in tests)
        path_part, _, anchor = target.partition("#")
        where = f"{md.relative_to(root)}:{no}: {target}"
        dest = (md.parent / unquote(path_part)).resolve() if path_part else md.resolve()
        if not dest.is_relative_to(root.resolve()):
            problems.append(f"{where}: points outside the repository")
            continue
        if not dest.exists():
            problems.append(f"{where}: {dest.relative_to(root.resolve())} does not exist")
            continue
        if anchor:
            if dest.suffix.lower() != ".md":
                problems.append(f"{where}: an anchor into a non-markdown file (line anchors drift; link the file)")
            elif unquote(anchor) not in anchors(dest.read_text(encoding="utf-8")):
                problems.append(f"{where}: no heading with anchor #{anchor} in {dest.name}")
    return problems


def python_blocks(md: Path) -> list[tuple[int, str]]:
    """(first line_no, body) of every fenced python block."""
    _, blocks = split_fences(md.read_text(encoding="utf-8"))
    return [(no, body) for no, info, body in blocks if info in ("python", "py", "python3")]


def runnable_blocks() -> list[tuple[str, int, str]]:
    """(file name, first line_no, body) of every block marked to run."""
    return [
        (md.name, no, body)
        for md in sorted(DOCS.glob("*.md"))
        for no, body in python_blocks(md)
        if body.lstrip().startswith(RUN_MARK)
    ]


# --- the documentation ------------------------------------------------------------------------


@pytest.mark.parametrize("md", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(md: Path) -> None:
    assert md.exists(), f"{md} is missing"
    problems = broken_links(md)
    assert not problems, "broken links:\n" + "\n".join(problems)


@pytest.mark.parametrize("md", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_python_blocks_are_marked(md: Path) -> None:
    for no, body in python_blocks(md):
        first = body.lstrip().splitlines()[0] if body.strip() else ""
        assert first.startswith((RUN_MARK, SKIP_MARK)), (
            f"{md.name}:{no}: a python block must start with '{RUN_MARK}' (run by tests/docs/test_docs.py) "
            f"or '{SKIP_MARK}'"
        )
        if first.startswith(RUN_MARK):
            assert re.search(r"^\s*assert\b|raise AssertionError", body, re.M), (
                f"{md.name}:{no}: a '{RUN_MARK}' block must assert its outputs"
            )


def test_numerics_has_worked_examples() -> None:
    """The examples are the point of numerics.md: losing the marker must not silently skip them."""
    assert sum(name == "numerics.md" for name, _, _ in runnable_blocks()) >= 8


@pytest.mark.parametrize(
    "name,line,body", [pytest.param(*b, id=f"{b[0]}:{b[1]}") for b in runnable_blocks()]
)
def test_worked_example_runs(name: str, line: int, body: str) -> None:
    code = compile(body, f"docs/{name} (block at line {line})", "exec")
    exec(code, {"__name__": f"docs_{Path(name).stem}_{line}"})


# --- the checker itself can fail -------------------------------------------------------------


def test_slugs_follow_github() -> None:
    assert github_slug("Python API") == "python-api"
    assert github_slug("Serving the output (engine formats)") == "serving-the-output-engine-formats"
    assert github_slug("Native `fp4convert`") == "native-fp4convert"
    assert github_slug("NVFP4 rules: max, 4over6, mse") == "nvfp4-rules-max-4over6-mse"
    assert github_slug("ModelOpt: `weight_scale_2` = 1/gs") == "modelopt-weight_scale_2--1gs"
    assert github_slug("[Links](x.md) and *emphasis*") == "links-and-emphasis"
    text = "# A\n```\n# not a heading\n```\n## A\n<a name=\"here\"></a>\n"
    assert anchors(text) == {"a", "a-1", "here"}


def test_checker_reports_broken_links(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "real.py").write_text("")
    md = tmp_path / "docs" / "page.md"
    md.write_text(
        "# Title\n\n## Sub section\n"
        "[ok](../real.py) [ok](#sub-section) [ok](page.md#title) [web](https://example.com/x)\n"
        "`[code span](missing.md)`\n```\n[in a fence](missing.md)\n```\n"
        "[missing](../nope.py) [bad anchor](#nope) [outside](../../elsewhere.md)\n"
        "[line anchor](../real.py#L3)\n[ref]: ../also-missing.md\n"
    )
    problems = broken_links(md, tmp_path)
    assert len(problems) == 5, problems
    assert [p.split(": ")[1] for p in problems] == [
        "../nope.py", "#nope", "../../elsewhere.md", "../real.py#L3", "../also-missing.md",
    ]
