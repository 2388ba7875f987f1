"""Opening a source: a local folder, or a Hub repo id (fetched into the HF cache as a :class:`HubSource`)."""

from __future__ import annotations

import difflib
import logging
import os
import re
from pathlib import Path

from fp4convert.errors import SourceError
from fp4convert.source.copying import hub_ignore_patterns
from fp4convert.source.hub import HubSource, offline
from fp4convert.source.paths import check_relative, one_line, qname
from fp4convert.source.source import PICKLE_HOW, PICKLE_SUFFIXES, Source, check_local_weights, roots_for, weight_files_in
from fp4convert.storage.names import INDEX_NAME

log = logging.getLogger(__name__)

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def local_path_hint(src: str) -> str | None:
    """None when ``src`` (no such path here) may be a Hub repo id; else why it must be a mistyped local path.

    Local-looking: no '/' or more than one, starts with '.', '/' or '~', contains a backslash, is not of
    the form org/name, or its first component exists here or is a close misspelling of a folder here
    (``exmaples/tiny-llama`` next to ``examples/``).
    """
    if src.startswith((".", "/", "~")) or "\\" in src:
        return "a path"
    if src.count("/") != 1:
        return "a path" if "/" in src else "not a Hub repo id of the form org/name"
    if not REPO_ID.match(src):
        return "not a Hub repo id of the form org/name"
    first, rest = src.split("/", 1)
    if os.path.lexists(first):
        return f"{first} exists here, but not {src}"
    try:
        with os.scandir(".") as it:
            here = [e.name for _, e in zip(range(5000), it) if e.is_dir()]
    except OSError:
        here = []
    close = difflib.get_close_matches(first, here, n=1, cutoff=0.8)
    if close:
        return f"did you mean {close[0]}/{rest}?"
    return None


def open_source(src: str, revision: str | None = None, *, token: str | None = None,
                cache_dir: str | None = None) -> Source:
    """A local folder if ``src`` is one; a Hub repo id only if it cannot be a mistyped local path
    (``token``, ``cache_dir``: Hub only)."""
    src = str(src)
    if not src or "\0" in src:
        raise SourceError(f"{qname(src)}: not a folder or a Hub repo id")
    path = Path(src).expanduser()
    try:
        exists, is_link = path.exists(), path.is_symlink()
        if exists:
            if not path.is_dir():
                raise SourceError(f"{src} is a file; give the checkpoint folder that holds it")
            if revision:
                raise SourceError("--revision applies to Hub repos, not to a local folder")
            root = path.resolve()
            roots = roots_for(root, False)
            files, weight_map = weight_files_in(root, src, roots)
            check_local_weights(root, files, roots, src)
            return Source(src, root, files, weight_map=weight_map, roots=roots)
    except OSError as exc:
        raise SourceError(f"{src}: cannot read ({exc.strerror or exc})") from exc
    if is_link:
        raise SourceError(f"{src}: no such folder (a broken symlink)")
    hint = local_path_hint(src)
    if hint is not None:
        raise SourceError(f"{src}: no such folder ({hint})")
    return _open_hub(src, revision, token, cache_dir)


def _open_hub(repo_id: str, revision: str | None, token: str | None = None, cache_dir: str | None = None) -> Source:
    from huggingface_hub import snapshot_download

    try:
        # Everything but the weights now (small files); weights shard by shard later.
        # local_files_only when offline: huggingface_hub 1.x would otherwise try to list a commit's tree.
        root = Path(snapshot_download(repo_id, revision=revision, ignore_patterns=hub_ignore_patterns(),
                                      local_files_only=offline(), token=token, cache_dir=cache_dir))
    except Exception as exc:
        what = f"{repo_id}@{revision}" if revision else repo_id
        hint = (f" (HF_HUB_OFFLINE is set and {'this revision of ' if revision else ''}the repo is not in the cache)"
                if offline() else "")
        raise SourceError(f"{what}: cannot open on the Hub{hint}: {one_line(exc)}") from exc
    commit = root.name  # snapshots/<commit>
    roots = roots_for(root, True)
    weight_map = None
    if os.path.lexists(root / INDEX_NAME):
        files, weight_map = weight_files_in(root, repo_id, roots)
    else:
        files = _hub_listing(repo_id, commit, root, token)
    return HubSource(repo_id, root, files, repo_id=repo_id, revision=revision, commit=commit, weight_map=weight_map,
                  roots=roots, token=token, cache_dir=cache_dir)


def _hub_listing(repo_id: str, commit: str, snapshot: Path, token: str | None = None) -> list[str]:
    """Weight files of a repo with no index: ask the Hub, or (offline) list the cached snapshot."""
    names: list[str] = []
    if not offline():
        from huggingface_hub import HfApi

        try:
            names = HfApi(token=token).list_repo_files(repo_id, revision=commit)
        except Exception as exc:
            log.debug("listing %s failed: %s", repo_id, exc)
    if not names:
        names = sorted(p.name for p in snapshot.iterdir())
    st = [n for n in names if n.endswith(".safetensors") and "/" not in n]
    for n in st:
        check_relative(n, f"{repo_id}: weight file")
    if st:
        return sorted(st)
    pickles = [n for n in names if n.endswith(PICKLE_SUFFIXES)]
    if pickles:
        raise SourceError(
            f"{repo_id} has only pickle weights ({', '.join(pickles[:3])}); fp4convert reads safetensors only, "
            f"because unpickling runs arbitrary code. {PICKLE_HOW}"
        )
    raise SourceError(f"{repo_id}: no *.safetensors weights found")
