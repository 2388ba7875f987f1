"""File names read from a checkpoint (an index, a listing): checked as plain relative paths below it, quoted in messages."""

from __future__ import annotations

import re

from fp4convert.errors import OutsideSourceError


def one_line(exc: BaseException, limit: int = 300) -> str:
    """huggingface_hub's multi-line messages (and signed URLs) folded into one short line."""
    text = " ".join(str(exc).split())
    text = re.sub(r"(https?://[^\s?]+)\?\S+", r"\1?...", text)  # drop signed query strings
    return f"{type(exc).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def qname(name: object, limit: int = 120) -> str:
    s = str(name)
    return repr(s) if len(s) <= limit else repr(s[:limit]) + "..."


# ---------------------------------------------------------------------------------------------
# Paths: lexical checks, containment
# ---------------------------------------------------------------------------------------------

def check_relative(rel: object, what: str) -> str:
    """A file name from the checkpoint (index entry, listing) must be a plain relative path below it."""
    if not isinstance(rel, str) or not rel:
        raise OutsideSourceError(f"{what}: {qname(rel)} is not a file name")
    if "\0" in rel or "\\" in rel or not rel.isprintable():
        raise OutsideSourceError(f"{what}: {qname(rel)} has characters a checkpoint file name cannot have")
    if rel.startswith("/") or re.match(r"^[A-Za-z]:", rel):
        raise OutsideSourceError(f"{what}: {qname(rel)} is an absolute path; entries must be relative to the folder")
    parts = rel.split("/")
    if ".." in parts:
        raise OutsideSourceError(f"{what}: {qname(rel)} leads out of the checkpoint folder ('..')")
    if any(p in ("", ".") for p in parts):
        raise OutsideSourceError(f"{what}: {qname(rel)} is not a normalised relative path")
    return rel
