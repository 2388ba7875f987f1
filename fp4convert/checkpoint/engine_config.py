"""The engine config files against the tensors: each format checks its own (``OutputFormat.config_problems``), and
the modules a config keeps out of FP4 are checked here against the kept and the quantized weights."""

from __future__ import annotations

import re

from fp4convert.checkpoint.layout import CheckpointLayout
from fp4convert.formats import OUTPUT_FORMATS, get_format
from fp4convert.numerics.scheme import get_scheme
from fp4convert.source.source import Source


def _kept_2d(layout: CheckpointLayout) -> list[str]:
    """Kept 2-D float weights an engine would take for Linear layers; a rotated compressed-tensors
    module's own transform (``<module>.had16_input.weight``, 16x16) is part of that module, not one."""
    transforms = {f"{m}.{layout.rotate}_input" for m in layout.modules} if layout.rotate else set()
    return sorted(n for n in (t.name[: -len(".weight")] for t in layout.kept
                              if t.name.endswith(".weight") and len(t.shape) == 2 and t.dtype in ("BF16", "F16", "F32"))
                  if n not in transforms)


def _bad_patterns(ignore: list, key: str, regex: bool) -> list[str]:
    """Entries of an ignore list that are not strings, or (compressed-tensors) ``re:`` patterns that do
    not compile: engines would fail to load the config."""
    out = []
    for i, p in enumerate(ignore):
        if not isinstance(p, str):
            out.append(f"{key}[{i}] is {_kind(p)}, not a module name or pattern")
        elif regex and p.startswith("re:"):
            try:
                re.compile(p[3:])
            except (re.error, RecursionError, OverflowError) as exc:
                out.append(f"{key}[{i}] {p[:60]!r}: the regular expression does not compile ({exc})")
    return out


def _ignore_agrees(ignore: object, layout: CheckpointLayout, match, key: str, regex: bool = False) -> list[str]:
    out = []
    if not isinstance(ignore, list):
        return [f"{key} is {_kind(ignore)}, not a list"]
    bad = _bad_patterns(ignore, key, regex)
    if bad:
        return bad
    missing = [m for m in _kept_2d(layout) if not any(match(p, m) for p in ignore)]
    if missing:
        out.append(f"{key} misses {len(missing)} kept 2-D weight(s), e.g. {missing[0]}: an engine would load it as FP4")
    wrong = sorted(m for m in layout.modules if any(match(p, m) for p in ignore))
    if wrong:
        out.append(f"{key} names {len(wrong)} quantized weight(s), e.g. {wrong[0]}: an engine would load it unquantized")
    return out


def _kind(v: object) -> str:
    if v is None:
        return "null"
    return {bool: "true/false", str: "a string", int: "an integer", float: "a number", list: "a list",
            dict: "an object"}.get(type(v), type(v).__name__)


def check_engine_config(source: Source, layout: CheckpointLayout) -> list[str]:
    """The engine config files against the tensors (each format checks its own: ``OutputFormat.config_problems``),
    then the modules its config keeps out of FP4 against the kept weights. Every value is type-checked before
    use: a value of the wrong type is a finding (one line naming the key), never an exception."""
    if layout.format not in OUTPUT_FORMATS:
        return []  # an unquantized checkpoint: no engine config of ours to check
    fmt = get_format(layout.format)
    scheme = get_scheme(layout.scheme) if layout.scheme else None
    out, excluded = fmt.config_problems(source.root, source.config(), scheme, layout.modules)
    if excluded is not None:
        out += _ignore_agrees(excluded.patterns, layout, excluded.match, excluded.key, regex=excluded.regex)
    return out
