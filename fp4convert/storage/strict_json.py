"""Hardened JSON for every file we read that a hostile checkpoint controls: headers, the index, config.json, manifests.

Stricter than :mod:`json`: duplicate keys, lone UTF-16 surrogate escapes, NaN/Infinity, integers of more
than :data:`MAX_INT_DIGITS` digits, non-finite numbers and nesting deeper than :data:`MAX_JSON_DEPTH` are
refused with a ``ValueError`` that :func:`json_error` turns into one line.
"""

from __future__ import annotations

import array
import itertools
import json
import math
import re

MAX_JSON_DEPTH = 64  # a header needs 3 levels; serde_json (the library's parser) stops at 128
MAX_INT_DIGITS = 20  # 2**64 - 1 has 20 digits



_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKET = bytes(sorted(set(range(256)) - set(b"[]{}")))
_BRACKET_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # as signed bytes: +1 +1 -1 -1


def json_depth(raw: bytes) -> int:
    """Deepest bracket nesting outside JSON strings, without recursion (cheap; run before json.loads).

    Each bracket becomes a +1/-1 step and the running sum's maximum is the depth; ``accumulate`` over
    a signed byte array runs in C (about 25 ns a bracket, faster than torch even for 10M brackets).
    """
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKET)
    steps = array.array("b", brackets.translate(_BRACKET_STEP))
    return max(itertools.accumulate(steps, initial=0))


def _object_no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"key {quoted(k)} appears twice")
            seen.add(k)
    return out


def _int(s: str) -> int | float:
    if len(s.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"integer {s[:12]}... has {len(s)} digits (at most {MAX_INT_DIGITS})")
    if s == "-0":
        return -0.0  # as serde_json (the library's parser) reads it: a float, so never a size or offset
    return int(s)


def _float(s: str) -> float:
    v = float(s)
    if not math.isfinite(v):
        raise ValueError(f"number {s[:24]} is out of range")
    return v


def _constant(s: str) -> float:
    raise ValueError(f"{s} is not JSON")


def loads_strict(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> object:
    """Bytes -> JSON value, refusing what a careless parse would accept or crash on.

    Raises :class:`ValueError` (``UnicodeDecodeError``, ``json.JSONDecodeError`` or a plain one from
    the hooks) with a short message; never ``RecursionError`` or a traceback-worthy type.
    """
    text = raw.decode("utf-8")  # strict: UnicodeDecodeError is a ValueError
    if json_depth(raw) > max_depth:
        raise ValueError(f"JSON nests deeper than {max_depth} levels")
    try:
        return json.loads(text, object_pairs_hook=_object_no_duplicates, parse_int=_int, parse_float=_float,
                          parse_constant=_constant)
    except RecursionError as exc:  # not reached after json_depth; kept so no caller ever sees one
        raise ValueError("JSON nests too deeply") from exc


def loads_bounded(raw: bytes) -> object:
    """Bytes -> JSON value as Python's json reads it (NaN, duplicate keys: last wins), but UTF-8 only and
    with nesting bounded, so a hostile file is a ValueError, never a RecursionError (config.json)."""
    text = raw.decode("utf-8")
    if json_depth(raw) > MAX_JSON_DEPTH:
        raise ValueError(f"JSON nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(text)
    except RecursionError as exc:
        raise ValueError("JSON nests too deeply") from exc


def json_kind(v: object) -> str:
    """'JSON list', 'string', 'null'... for messages about a value of the wrong type."""
    return {dict: "JSON object", list: "JSON list", str: "string", bool: "boolean", int: "number",
            float: "number", type(None): "null"}.get(type(v), type(v).__name__)


def json_error(exc: ValueError) -> str:
    """A one-line reason for a :func:`loads_strict` failure (no document text echoed)."""
    if isinstance(exc, UnicodeDecodeError):
        return f"not UTF-8 (byte {exc.start})"
    if isinstance(exc, json.JSONDecodeError):
        return f"not valid JSON ({exc.msg} at byte {exc.pos})"
    return " ".join(str(exc).split())[:200]


def quoted(name: object, limit: int = 80) -> str:
    """A name for a one-line message: repr (escapes newlines), truncated."""
    s = str(name)
    return repr(s) if len(s) <= limit else repr(s[:limit]) + "..."


def file_label(file: str) -> str:
    """A file name for a message: as is when printable, else quoted."""
    return file if file.isprintable() and len(file) <= 200 else quoted(file, 200)
